"""Tools end to end through the official SDK on a tiny random-weight model with a Hermes-style
tool template (`tests/data/hermes_tools.jinja`, given as `--chat-template`): forced calls
(constrained decoding makes random weights call), the tool result and the final answer,
named and single calls, streaming assembled by the SDK's stream helper."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.fidelity_support import TIME_TOOL, WEATHER_TOOL, hermes_server, sdk

CHAT = "/v1/chat/completions"
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]
ASK: list[Any] = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def server(gguf_tokenizer: ChatTokenizer) -> Iterator[tuple[str, Runtime]]:
    with hermes_server(gguf_tokenizer) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[str, Runtime]) -> openai.OpenAI:
    return sdk(server[0])


@pytest.fixture
def http(server: tuple[str, Runtime]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120, trust_env=False) as c:
        yield c


def _check_args(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "London", "Tokyo")
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    else:
        assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})
    return dict(args)


def test_call_result_and_final_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=7, max_tokens=120,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None and msg.tool_calls
    ids = set()
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _check_args(call.function.name, call.function.arguments)
        ids.add(call.id)
    assert len(ids) == len(msg.tool_calls)

    history: list[Any] = [*ASK, msg.model_dump()]  # content None, refusal None, tool_calls...
    for call in msg.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    final = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=12, seed=1,
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert first.usage is not None and final.usage is not None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # the whole first turn (prompt and the call it generated) is reused from stored segments
    details = final.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= first.usage.prompt_tokens


def test_named_choice_makes_exactly_that_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, seed=seed, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        calls = r.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.function.name == "get_time"
        _check_args("get_time", call.function.arguments)
        assert r.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            parallel_tool_calls=False, max_tokens=120,
        )
        calls = r.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1


def test_streamed_calls_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                          "seed": 11, "max_tokens": 120}
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert whole
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert streamed is not None
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert final.choices[0].message.content in (None, "")
    # the helper's message (with `parsed`, `index`, `parsed_arguments`) goes back as history
    history: list[Any] = [*ASK, final.choices[0].message.model_dump()]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in streamed]
    r = client.chat.completions.create(model="default", messages=history, max_tokens=2)
    assert r.choices[0].message.role == "assistant"


def test_stream_chunks_carry_id_and_name_first(http: httpx.Client) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 3, "max_tokens": 120,
            "stream": True}
    chunks = []
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    seen: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        delta = ch["choices"][0]["delta"] if ch["choices"] else {}
        assert "<tool_call>" not in (delta.get("content") or "")
        for tc in delta.get("tool_calls") or []:
            i = tc["index"]
            if i not in seen:
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["function"]["name"] in ("get_weather", "get_time")
                seen[i] = {"name": tc["function"]["name"], "args": tc["function"].get("arguments", "")}
            else:
                assert "id" not in tc and "name" not in tc["function"]
                seen[i]["args"] += tc["function"]["arguments"]
    assert seen and sorted(seen) == list(range(len(seen)))
    for call in seen.values():
        _check_args(call["name"], call["args"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_choice_keeps_markup_out_of_content(client: openai.OpenAI) -> None:
    for seed in range(2):
        r = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice="auto", seed=seed, max_tokens=16,
        )
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        if ch.message.tool_calls:
            assert ch.finish_reason == "tool_calls"


def test_tools_reach_the_template(http: httpx.Client) -> None:
    """Also with tool_choice "none" (as vLLM by default): the prompt prefix, and so the
    stored segments, stay those of the turns that could call."""
    def prompt_tokens(**extra: Any) -> int:
        r = http.post(CHAT, json={"messages": ASK, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS) > plain + 50
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == prompt_tokens(tools=TOOLS)
    assert prompt_tokens(tools=[]) == plain


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
        # a forced call with a response_format is accepted (tests/test_clients_e2e.py)
        ({"messages": ASK, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
    ],
)
def test_bad_tool_requests(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = http.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
