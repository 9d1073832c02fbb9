"""A tiny random-weight server with a Hermes-style tool template, for the OpenAI-fidelity
tests (official SDK over real HTTP on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

HERMES_TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@contextmanager
def hermes_server(tok: ChatTokenizer, **settings: str) -> Iterator[tuple[str, Runtime]]:
    """(base URL, runtime) of a started server; the template comes in by `--chat-template`."""
    values = {"max_tokens_default": "48", "bank_dir": "none", "chat_template": str(HERMES_TEMPLATE)}
    values.update(settings)
    rt = tiny_runtime(tiny_loaded(tok, context=2048), load_settings(values, environ={}))
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            yield url, rt
    finally:
        rt.engine.stop()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=120),  # type: ignore[arg-type]  # httpx2 in the stubs
    )
