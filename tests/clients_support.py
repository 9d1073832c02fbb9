"""Shared pieces of the third-party client tests (tests/test_clients_e2e.py).

- `offline_client_env()`: the environment under which no client library phones home
  (LiteLLM's remote cost map and blog feed, the Agents SDK's trace exporter, LangSmith
  tracing, pydantic-ai's Logfire), and every default OpenAI endpoint points at nothing.
  Libraries read some of these at import time, so the tests import them inside it.
- `WEATHER_SCHEMA` / `Weather`: the one tool every client declares, bounded (enums and a
  small integer range) so a random-weight model under constrained decoding finishes the call
  in a few tokens and its arguments can be checked exactly.
- `check_weather_args`: the shape check each test makes on the arguments a tool received.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Values set for the duration of the client tests, restored afterwards.
OFFLINE_ENV: dict[str, str] = {
    "LITELLM_OFFLINE_MODE": "true",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "OPENAI_AGENTS_DONT_LOG_MODEL_DATA": "1",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LOGFIRE_SEND_TO_LOGFIRE": "false",
    # A request that forgot its base_url must fail here, not reach a hosted API.
    "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
    "OPENAI_API_KEY": "unused",
}


@contextmanager
def offline_client_env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Weather(BaseModel):
    """A structured answer (and the tool's parameters): bounded so constrained decoding on
    random weights ends quickly."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "London", "Tokyo"]
    days: int = Field(ge=1, le=7)


WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather forecast for a city",
                 "parameters": WEATHER_SCHEMA},
}
ASK = "What is the weather in Paris for the next two days? Use the get_weather tool."


def check_weather_args(arguments: str | dict[str, Any]) -> Weather:
    """The arguments a client passed to the tool, validated against the declared schema."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return Weather.model_validate(args)


def forecast(city: str, days: int) -> str:
    """What every tool implementation returns: a fixed string that names its inputs."""
    return f"{city}: sunny for {days} days, 21 C"
