"""HTTP API on a tiny model: shapes, streaming, errors (OpenAI's error shape), auth, metrics."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from segserve.config.settings import Settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    from segserve.config.settings import load_settings

    settings = load_settings({"max_tokens_default": "8", "max_request_bytes": "200000"}, environ={})
    runtime = tiny_runtime(tiny_loaded(gguf_tokenizer, context=512), settings)
    yield runtime
    runtime.engine.stop()


@pytest.fixture(scope="module")
def url(rt: Runtime) -> Iterator[str]:
    with serve_in_thread(create_app(rt.serving)) as u:
        yield u


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        yield c


def _msgs(text: str = "Hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _err(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def test_chat_non_stream_shape(client: httpx.Client) -> None:
    r = client.post(CHAT, json={"messages": _msgs(), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    ch = body["choices"][0]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert ch["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert "cached_tokens" in u["prompt_tokens_details"]
    r = client.post(CHAT, json={"messages": _msgs(), "max_tokens": 2}, headers={"X-Session-Id": "echo"})
    assert r.headers["x-session-id"] == "echo"


def test_chat_stream_ends_with_done_and_usage(client: httpx.Client) -> None:
    body = {"messages": _msgs(), "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_and_non_stream_same_text(client: httpx.Client) -> None:
    base = {"messages": _msgs("same"), "max_tokens": 6, "temperature": 0}
    full = client.post(CHAT, json=base).json()["choices"][0]["message"]["content"]
    parts = []
    with client.stream("POST", CHAT, json={**base, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])["choices"][0]["delta"]
                parts.append(d.get("content", ""))
    assert "".join(parts) == full


def test_followup_reports_cached_tokens(client: httpx.Client) -> None:
    msgs = _msgs("first turn of a conversation")
    r1 = client.post(CHAT, json={"messages": msgs, "max_tokens": 4, "temperature": 0}, headers={"X-Session-Id": "c1"}).json()
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "more"}]
    r2 = client.post(CHAT, json={"messages": msgs, "max_tokens": 4, "temperature": 0}, headers={"X-Session-Id": "c1"}).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"] - 1


def test_seed_determinism(client: httpx.Client) -> None:
    body = {"messages": _msgs("seed"), "max_tokens": 6, "temperature": 1.0, "seed": 42}
    a = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    b = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    assert a == b


def test_logprobs(client: httpx.Client) -> None:
    r = client.post(CHAT, json={"messages": _msgs(), "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["logprob"] <= 0


def test_text_parts_content(client: httpx.Client) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    assert client.post(CHAT, json={"messages": msgs, "max_tokens": 2}).status_code == 200


def test_completions(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["object"] == "text_completion" and "text" in r.json()["choices"][0]


def test_models(client: httpx.Client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny-test"


@pytest.mark.parametrize(
    "body, param_word",
    [
        ({"messages": []}, "messages"),
        ({"messages": _msgs(), "max_tokens": -1}, "max_tokens"),
        ({"messages": _msgs(), "max_tokens": "many"}, "max_tokens"),
        ({"messages": _msgs(), "n": 17}, "n"),  # n is built; 1 .. 16
        ({"messages": _msgs(), "tools": [{"type": "function"}]}, "tools"),
        ({"messages": _msgs(), "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": _msgs(), "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"messages": _msgs(), "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": _msgs(), "temperature": 5}, "temperature"),
        ({"messages": _msgs(), "bogus_field": 1}, "bogus_field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": _msgs(), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client: httpx.Client, body: dict[str, Any], param_word: str) -> None:
    err = _err(client.post(CHAT, json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert param_word in err["message"]


def test_malformed_json(client: httpx.Client) -> None:
    err = _err(client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


def test_huge_body(client: httpx.Client) -> None:
    _err(client.post(CHAT, json={"messages": _msgs("x" * 300_000)}), 413)


def test_context_length_exceeded(client: httpx.Client) -> None:
    err = _err(client.post(CHAT, json={"messages": _msgs("word " * 100), "max_tokens": 500}), 400)
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_404(client: httpx.Client) -> None:
    err = _err(client.post(CHAT, json={"messages": _msgs(), "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found"
    assert client.post(CHAT, json={"messages": _msgs(), "model": "tiny-test", "max_tokens": 1}).status_code == 200


def test_unknown_route_404(client: httpx.Client) -> None:
    _err(client.get("/v2/nothing"), 404)


def test_health_and_metrics(client: httpx.Client) -> None:
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["kv"]["mode"] == "segmented"
    client.post(CHAT, json={"messages": _msgs(), "max_tokens": 2})
    text = client.get("/metrics").text
    for name in (
        "segserve_requests_total", "segserve_generation_tokens_sum", "segserve_time_to_first_token_seconds_bucket",
        "segserve_inter_token_latency_seconds_bucket", "segserve_num_requests_running", "segserve_kv_segments",
        "segserve_kv_seals_total", "segserve_kv_bytes",
    ):
        assert name in text, name


def test_client_disconnect_cancels(client: httpx.Client, rt: Runtime) -> None:
    body = {"messages": _msgs("long"), "max_tokens": 400, "temperature": 0, "stream": True}
    with client.stream("POST", CHAT, json=body) as r:
        for line in r.iter_lines():
            if '"content"' in line:
                break
    # The engine notices the cancel within a step or two and drops the request.
    import time

    deadline = time.monotonic() + 20
    while rt.engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.engine.running == 0
    assert client.post(CHAT, json={"messages": _msgs(), "max_tokens": 2}).status_code == 200


def test_api_key(gguf_tokenizer: ChatTokenizer, settings_factory: Callable[..., Settings]) -> None:
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), settings_factory(api_key="sekrit"))
    try:
        with serve_in_thread(create_app(rt.serving)) as u, httpx.Client(base_url=u, trust_env=False) as c:
            err = _err(c.get("/v1/models"), 401)
            assert err["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        rt.engine.stop()


def test_session_api(client: httpx.Client) -> None:
    msgs = _msgs("a conversation kept by the bank")
    for _ in range(2):
        r = client.post(CHAT, json={"messages": msgs, "max_tokens": 3, "temperature": 0}, headers={"X-Session-Id": "sess-api"}).json()
        msgs = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}, {"role": "user", "content": "go on"}]
    listed = client.get("/v1/sessions").json()["data"]
    assert any(s["id"] == "sess-api" for s in listed)
    info = client.get("/v1/sessions/sess-api").json()
    assert info["turns"] == 2 and info["tokens"] > 0 and info["tier"] == "ram"
    fork = client.post("/v1/sessions/sess-api/fork", json={"turn": 0})
    assert fork.status_code == 201, fork.text
    f = fork.json()
    assert f["forked_from"] == "sess-api" and f["turns"] == 1 and f["tokens"] < info["tokens"]
    default_fork = client.post("/v1/sessions/sess-api/fork").json()
    assert default_fork["tokens"] == info["tokens"]
    assert client.delete(f"/v1/sessions/{f['id']}").json()["deleted"] is True
    _err(client.get(f"/v1/sessions/{f['id']}"), 404)
    _err(client.post("/v1/sessions/sess-api/fork", json={"turn": -1}), 400)
    _err(client.post("/v1/sessions/sess-api/fork", json={"turn": 99}), 400)
    _err(client.delete("/v1/sessions/never-existed"), 404)
    # The original session is intact after forking and deleting the fork.
    assert client.get("/v1/sessions/sess-api").json()["turns"] == 2
