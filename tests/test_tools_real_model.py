"""Tools and structured output on the real embedded model, over real HTTP, with the official
SDK: `segserve serve --chat-template tests/data/hermes_tools.jinja --tool-parser hermes`
(SmolLM2's own template has no tool markup), one server process for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fidelity_support import HERMES_TEMPLATE, WEATHER_TOOL
from tests.process_support import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("tools-e2e")
    srv = ServerProcess(tmp / "server.log", "--bank-dir", "none", "--max-tokens-default", "64",
                        "--chat-template", str(HERMES_TEMPLATE), "--tool-parser", "hermes")
    try:
        srv.wait_healthy(180)
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                            http_client=httpx.Client(trust_env=False, timeout=300))  # type: ignore[arg-type]
    finally:
        srv.stop()


def test_tool_call_result_and_answer(client: openai.OpenAI) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is the weather in Tokyo for the next 3 days?"}]
    tools: list[Any] = [WEATHER_TOOL]
    with client.chat.completions.stream(
        model="default", messages=msgs, tools=tools, tool_choice="required",
        temperature=0, max_tokens=60, parallel_tool_calls=False,  # greedy, it would repeat the call
        stream_options={"include_usage": True},
    ) as stream:
        first = stream.get_final_completion()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert args["city"] in ("Paris", "London", "Tokyo") and 1 <= args["days"] <= 7

    msgs.append(choice.message.model_dump())
    msgs.append({"role": "tool", "tool_call_id": calls[0].id, "content": '{"forecast": "sunny", "high_c": 24}'})
    final = client.chat.completions.create(
        model="default", messages=msgs, tools=tools, tool_choice="none",
        temperature=0, max_tokens=40,
    )
    text = final.choices[0].message.content
    assert isinstance(text, str) and text.strip(), final
    assert final.usage is not None and final.usage.prompt_tokens_details is not None
    assert (final.usage.prompt_tokens_details.cached_tokens or 0) >= first.usage.prompt_tokens  # type: ignore[union-attr]


def test_json_schema_on_the_real_model(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 30},
                       "population_millions": {"type": "number"}},
        "required": ["capital", "population_millions"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "The capital of France, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        temperature=0, max_tokens=60,
    )
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content or "")
    assert set(obj) == {"capital", "population_millions"} and isinstance(obj["capital"], str)
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
