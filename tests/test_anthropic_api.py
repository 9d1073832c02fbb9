"""Anthropic's Messages API through the official `anthropic` SDK over real HTTP, on a tiny
random-weight model with a Hermes tool template: answer and event shapes, the tool loop,
count_tokens against the chat route's prompt, KV reuse across turns, auth by `x-api-key`,
and refusals in Anthropic's error shape. Shapes are asserted, never the model's wording.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from segserve.server.http import anthropic_api
from segserve.server.http.errors import (
    EngineDead,
    GenerationFailed,
    InsufficientMemory,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    ServerError,
    Unauthorized,
    WaitTimedOut,
)
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.fidelity_support import WEATHER_TOOL, hermes_server

WEATHER: anthropic.types.ToolParam = {
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
KEY = "sk-ant-test-key"
GREEDY: dict[str, Any] = {"temperature": 0}  # sampling fields this SDK no longer sends by name


@pytest.fixture(scope="module")
def server(gguf_tokenizer: ChatTokenizer) -> Iterator[tuple[str, Runtime]]:
    with hermes_server(gguf_tokenizer) as s:
        yield s


def sdk(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url, api_key=key, max_retries=0,
        http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=120),  # the SDK's own httpx
    )


@pytest.fixture(scope="module")
def client(server: tuple[str, Runtime]) -> anthropic.Anthropic:
    return sdk(server[0])


@pytest.fixture
def http(server: tuple[str, Runtime]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120, trust_env=False) as c:
        yield c


def _events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed answer, in order; each data's `type` is its name."""
    out: list[tuple[str, dict[str, Any]]] = []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def _usage_total(u: Any) -> int:
    return int(u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def _cached(u: anthropic.types.Usage) -> int:
    assert u.cache_read_input_tokens is not None  # optional in the SDK's type, always sent here
    return u.cache_read_input_tokens


# ---- answers -----------------------------------------------------------------------------


def test_plain_message(client: anthropic.Anthropic, server: tuple[str, Runtime]) -> None:
    msg = client.messages.create(
        model="default", max_tokens=8, extra_body=GREEDY, messages=[{"role": "user", "content": "Hello"}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == server[1].model_id
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.stop_sequence is None
    assert 1 <= msg.usage.output_tokens <= 8
    assert msg.usage.input_tokens > 0 and msg.usage.cache_creation_input_tokens == 0
    assert (msg.stop_reason == "max_tokens") == (msg.usage.output_tokens == 8)


def test_system_and_multi_turn_build_the_chat_prompt(
    client: anthropic.Anthropic, http: httpx.Client
) -> None:
    """The prompt is exactly the chat route's for the same conversation (one prompt path):
    counted by count_tokens, by /tokenize for the chat messages, and run by a real request."""
    turns: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Hi there."}]},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a story."},
    ]
    as_blocks = client.messages.count_tokens(
        model="default", system=[{"type": "text", "text": "Be brief."}], messages=turns,
    ).input_tokens
    as_string = client.messages.count_tokens(model="default", system="Be brief.", messages=turns).input_tokens
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a story."}]
    r = http.post("/tokenize", json={"messages": chat})
    assert r.status_code == 200, r.text
    assert as_blocks == as_string == r.json()["count"]
    msg = client.messages.create(model="default", max_tokens=4, system="Be brief.", messages=turns)
    assert _usage_total(msg.usage) == as_string
    assert msg.content[0].type == "text"


def test_stop_sequence_ends_the_answer_and_is_named(client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "Count from one to twenty."}]
    free = client.messages.create(model="default", max_tokens=24, extra_body=GREEDY, messages=ask)
    text = free.content[0].text  # type: ignore[union-attr]
    assert len(text) >= 8, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.messages.create(
        model="default", max_tokens=24, extra_body=GREEDY, messages=ask, stop_sequences=["\x00never", stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]  # type: ignore[union-attr]
    assert free.stop_sequence is None


# ---- streaming ---------------------------------------------------------------------------


def test_stream_event_order_and_shapes(http: httpx.Client, client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": "default", "max_tokens": 12,
                            "messages": [{"role": "user", "content": "Write a line about rivers."}]}
    events = _events(http, {**body, **GREEDY})
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) <= {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    end = next(d for n, d in events if n == "message_delta")
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 1 <= end["usage"]["output_tokens"] <= 12
    # the same request unstreamed gives the same text (greedy), and the SDK reads the stream
    streamed = "".join(d["delta"]["text"] for d in deltas)
    plain: Any = client.messages.create(**body, extra_body=GREEDY)
    assert plain.content[0].text == streamed
    with client.messages.stream(**body, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.stop_reason == end["delta"]["stop_reason"]


# ---- tools -------------------------------------------------------------------------------


def test_tool_loop_with_a_forced_tool(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="default", max_tokens=120, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert first.stop_reason == "tool_use"
    assert first.content and all(b.type == "tool_use" for b in first.content)
    call = first.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    args: Any = call.input
    assert args["city"] in ("Paris", "London", "Tokyo") and 1 <= args["days"] <= 7
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp": 21}'},
            {"type": "text", "text": "Answer in one line."},
        ]},
    ]
    final = client.messages.create(model="default", max_tokens=8, messages=history, tools=[WEATHER])
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call went back into the prompt: the whole first turn's prompt was reused
    assert _cached(final.usage) >= _usage_total(first.usage)


def test_any_tool_streamed_as_input_json_deltas(http: httpx.Client) -> None:
    body = {"model": "default", "max_tokens": 120, "messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    events = _events(http, body)
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    block = starts[0]["content_block"]
    assert block["name"] == "get_weather" and block["input"] == {} and block["id"].startswith("toolu_")
    parts = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert parts and all(p["type"] == "input_json_delta" for p in parts)
    args = json.loads("".join(p["partial_json"] for p in parts))
    assert set(args) == {"city", "days"}
    end = next(d for n, d in events if n == "message_delta")
    assert end["delta"]["stop_reason"] == "tool_use"


# ---- counting and reuse ------------------------------------------------------------------


def test_count_tokens_is_the_requests_input(client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "A question nobody asked before: why is ice slippery?"}]
    counted = client.messages.count_tokens(model="default", messages=ask, tools=[WEATHER])
    msg = client.messages.create(model="default", max_tokens=4, messages=ask, tools=[WEATHER])
    assert counted.input_tokens == _usage_total(msg.usage)


def test_second_turn_reads_the_first_from_cache(client: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": "Name three colours, please, in a list."}]
    first = client.messages.create(model="default", max_tokens=10, extra_body=GREEDY, messages=ask)
    second_turn: list[Any] = [*ask, {"role": "assistant", "content": first.content},
                              {"role": "user", "content": "And three more."}]
    second = client.messages.create(model="default", max_tokens=4, messages=second_turn)
    assert _cached(second.usage) >= _usage_total(first.usage) > 0
    assert second.usage.input_tokens > 0  # the new user turn was prefilled
    counted = client.messages.count_tokens(model="default", messages=second_turn).input_tokens
    assert second.usage.input_tokens + _cached(second.usage) == counted


def test_session_header_serves_both_apis(http: httpx.Client) -> None:
    """A conversation begun on chat completions continues on Messages from the same rows."""
    chat = http.post("/v1/chat/completions", headers={"X-Session-Id": "both-apis"}, json={
        "messages": [{"role": "user", "content": "Hi, who are you?"}], "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    answer = chat.json()["choices"][0]["message"]["content"]
    r = http.post("/v1/messages", headers={"X-Session-Id": "both-apis"}, json={
        "model": "default", "max_tokens": 4, "messages": [
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Nice."}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == "both-apis"
    assert r.json()["usage"]["cache_read_input_tokens"] >= chat.json()["usage"]["prompt_tokens"]


# ---- errors and auth ---------------------------------------------------------------------


def test_image_block_is_refused_by_name(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        ]}])
    assert e.value.status_code == 400
    body: Any = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.1" in body["error"]["message"]


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "{"}]}, "messages.1"),
])
def test_refusals_in_anthropic_shape(http: httpx.Client, body: dict[str, Any], named: str) -> None:
    r = http.post("/v1/messages", json={"model": "default", **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and named in err["error"]["message"]


def test_route_errors_in_anthropic_shape(http: httpx.Client) -> None:
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/messages", json={"model": "other", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["type"] == "error"
    # other routes keep OpenAI's shape
    r = http.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_x_api_key_is_a_key_everywhere(gguf_tokenizer: ChatTokenizer) -> None:
    with hermes_server(gguf_tokenizer, api_key=KEY) as (url, _):
        msg = sdk(url, KEY).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"anthropic-version": "2023-06-01"},
        )
        assert msg.type == "message"
        with pytest.raises(anthropic.AuthenticationError) as e:
            sdk(url, "wrong").messages.create(
                model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 401
        body: Any = e.value.body
        assert body == {"type": "error", "error": {"type": "authentication_error", "message": body["error"]["message"]}}
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as h:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert h.post("/v1/chat/completions", json=chat, headers={"x-api-key": KEY}).status_code == 200
            assert h.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            r = h.post("/v1/chat/completions", json=chat, headers={"x-api-key": "wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = h.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (InvalidRequest("bad"), 400, "invalid_request_error"),
    (Unauthorized("no key"), 401, "authentication_error"),
    (ModelNotFound("no model"), 404, "not_found_error"),
    (PayloadTooLarge("big"), 413, "request_too_large"),
    (QueueFull("full"), 429, "rate_limit_error"),
    (WaitTimedOut("waited"), 503, "overloaded_error"),
    (InsufficientMemory("no room", extra={"needed_bytes": 5}), 507, "overloaded_error"),
    (EngineDead("gone"), 503, "api_error"),
    (GenerationFailed("boom"), 500, "api_error"),
])
def test_domain_errors_map_once_to_anthropic_types(exc: ServerError, status: int, kind: str) -> None:
    """Each of our errors keeps its status and gets Anthropic's type; its details stay."""
    r = anthropic_api.error_response(exc)
    assert r.status_code == status == exc.status
    body = json.loads(bytes(r.body))
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert body["error"]["message"] == exc.message
    assert {k: body["error"][k] for k in exc.extra} == exc.extra
    stream_event = anthropic_api.error_body(exc)
    assert stream_event["error"] == body["error"]  # the same body as an SSE `error` event
