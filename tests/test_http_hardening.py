"""HTTP hardening on a tiny model: hostile bodies are 400s in OpenAI's shape and the
connection stays usable; strict types; client ids never echoed raw into headers; body
limits and timeouts on every endpoint; a non-streaming client that leaves cancels its
work; the access log cannot be forged; a bounded fuzz run finds no 5xx."""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import mlx.core as mx
import pytest

from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer, MemoryMeter
from segserve.server.runtime import Runtime
from tests.conftest import make_tiny_model, tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

CHAT = "/v1/chat/completions"
LIMIT = 100_000


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    settings = load_settings(
        {"max_tokens_default": "4", "max_request_bytes": str(LIMIT), "body_timeout": "1",
         "bank_dir": "none"},
        environ={},
    )
    runtime = tiny_runtime(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5), context=4096), settings)
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


class Raw:
    """One keep-alive connection, raw bytes: what an HTTP client library would refuse."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.buf = b""

    def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            self._more()
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the server")
        self.buf += data

    def close(self) -> None:
        self.sock.close()


def _chat(text: str = "hi", **over: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0, **over}


HOSTILE: list[tuple[str, str, bytes]] = [
    ("deep nesting", CHAT, b'{"messages":' + b"[" * 40_000 + b"]" * 40_000 + b"}"),
    ("nesting past 32", CHAT, json.dumps(_chat(), separators=(",", ":")).encode()[:-1] + b',"stop":' + b"[" * 40 + b"]" * 40 + b"}"),
    ("5000-digit integer", CHAT, b'{"messages":[{"role":"user","content":"x"}],"max_tokens":' + b"9" * 5000 + b"}"),
    ("41-digit integer", CHAT, b'{"messages":[{"role":"user","content":"x"}],"seed":' + b"1" * 41 + b"}"),
    ("lone surrogate in content", CHAT, b'{"messages":[{"role":"user","content":"a\\ud800b"}]}'),
    ("lone surrogate in a key", CHAT, b'{"messages":[{"role":"user","content":"x"}],"\\udfff":1}'),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt":"\\udc00","max_tokens":2}'),
    ("NaN", CHAT, b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}'),
    ("1e999", CHAT, b'{"messages":[{"role":"user","content":"x"}],"top_p":1e999}'),
    ("non-UTF-8 body", CHAT, b'{"messages":[{"role":"user","content":"\xff\xfe"}]}'),
    ("non-UTF-8 fork body", "/v1/sessions/s-1/fork", b'{"turn": "\xff"}'),
    ("deep fork body", "/v1/sessions/s-1/fork", b"[" * 5000 + b"]" * 5000),
    ("fork turn as string", "/v1/sessions/s-1/fork", b'{"turn": "0"}'),
    ("not an object", CHAT, b'"just a string"'),
    ("string for int", CHAT, json.dumps(_chat(max_tokens="10")).encode()),
    ("string for bool", CHAT, json.dumps(_chat(stream="yes")).encode()),
    ("int for bool", CHAT, json.dumps(_chat(logprobs=1)).encode()),
    ("bool for int", "/v1/completions", json.dumps({"prompt": [True, 5], "max_tokens": 2}).encode()),
    ("float for int", CHAT, json.dumps(_chat(max_tokens=2.0)).encode()),
]


@pytest.mark.parametrize(("what", "path", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_400_and_the_connection_stays_usable(
    url: str, what: str, path: str, body: bytes
) -> None:
    conn = Raw(url)
    try:
        conn.send("POST", path, body)
        status, headers, raw = conn.response()
        assert status == 400, (what, raw[:300])
        err = json.loads(raw)["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert headers.get("connection") != "close"
        conn.send("GET", "/health")  # the same keep-alive connection
        assert conn.response()[0] == 200
    finally:
        conn.close()


def test_an_unexpected_500_keeps_the_connection(url: str, rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(rt.serving, "health", boom)
    conn = Raw(url)
    try:
        conn.send("GET", "/health")
        status, _, raw = conn.response()
        assert status == 500 and json.loads(raw)["error"]["code"] == "internal_error"
        monkeypatch.undo()
        conn.send("GET", "/health")
        assert conn.response()[0] == 200
    finally:
        conn.close()


@pytest.mark.parametrize("key", ["caf\u00e9-\u4e2d", "a\r\nb", "a\nX-Evil: 1", "a\x00b", "has space", "x" * 128])
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_cache_key_is_never_echoed_raw(client: httpx.Client, rt: Runtime, key: str, stream: bool) -> None:
    body = _chat("a conversation kept under an odd key", prompt_cache_key=key, stream=stream)
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    echoed = r.headers.get("x-session-id")
    assert echoed is None or (echoed == key and key.isascii() and key.isprintable() and " " not in key)
    assert "x-evil" not in r.headers
    # The session was stored under the key: the next turn reuses it.
    again = client.post(CHAT, json=_chat("a conversation kept under an odd key", prompt_cache_key=key))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert rt.engine.running == 0


def test_unsafe_x_session_id_is_not_echoed_either(url: str) -> None:
    conn = Raw(url)
    try:
        conn.send("POST", CHAT, json.dumps(_chat()).encode(), {"X-Session-Id": "caf\xe9"})
        status, headers, _ = conn.response()
        assert status == 200 and "x-session-id" not in headers
    finally:
        conn.close()


def _wait_idle(rt: Runtime, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while rt.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    return rt.engine.running == 0


def test_non_streaming_disconnect_cancels_the_engine_work(url: str, rt: Runtime, client: httpx.Client) -> None:
    cancels = _metric(client, "segserve_cancelled_total")
    conn = Raw(url)
    conn.send("POST", CHAT, json.dumps(_chat("tell me everything", max_tokens=3000)).encode())
    deadline = time.monotonic() + 10
    while not rt.engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.engine.running == 1
    t0 = time.monotonic()
    conn.close()
    assert _wait_idle(rt, 3), "the engine kept generating for a client that left"
    assert time.monotonic() - t0 < 3
    assert _metric(client, "segserve_cancelled_total") == cancels + 1
    assert client.post(CHAT, json=_chat()).status_code == 200


def _metric(client: httpx.Client, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_body_limit_is_checked_from_content_length(url: str) -> None:
    """The 413 comes before a single body byte was sent (nothing is buffered)."""
    for path in (CHAT, "/v1/sessions/s-1/fork"):
        conn = Raw(url)
        try:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {200 * LIMIT}\r\n\r\n"
            conn.sock.sendall(head.encode())
            status, headers, raw = conn.response()
            assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
            assert headers.get("connection") == "close"  # far past the limit: not drained
        finally:
            conn.close()


def test_body_limit_is_checked_while_reading(url: str) -> None:
    for path in (CHAT, "/v1/sessions/s-1/fork"):
        conn = Raw(url)
        try:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            conn.sock.sendall(head.encode())
            chunk = b"x" * 30_000
            for _ in range(4):  # 120 kB > 100 kB
                conn.sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            status, _, raw = conn.response()
            assert status == 413, raw
            conn.sock.sendall(b"0\r\n\r\n")  # the rest is drained: the connection goes on
            conn.send("GET", "/health")
            assert conn.response()[0] == 200
        finally:
            conn.close()


def test_slow_body_is_408(url: str) -> None:
    conn = Raw(url)
    try:
        conn.sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{".encode())
        t0 = time.monotonic()
        status, headers, raw = conn.response()
        assert status == 408 and json.loads(raw)["error"]["code"] == "request_timeout"
        assert 0.8 < time.monotonic() - t0 < 5 and headers.get("connection") == "close"
    finally:
        conn.close()


def test_user_cannot_forge_access_log_lines(client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\n2026-01-01 INFO segserve.access: POST /admin 200 tokens=1 0.001s session=- user=root"
    with caplog.at_level(logging.INFO, logger="segserve.access"):
        r = client.post(CHAT, json=_chat(user=forged, prompt_cache_key="log\r\nkey"))
        assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "segserve.access"]
    assert lines and all("\n" not in ln and "\r" not in ln for ln in lines)
    assert any("user=x\\n2026" in ln for ln in lines)


def test_tokenizing_runs_off_the_event_loop(url: str, rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that takes seconds to template and tokenize (the issue: 3.9 MB, 16 s)
    does not hold up other clients."""
    import threading

    real = rt.serving.encode_chat

    def slow(messages: Any) -> Any:
        time.sleep(2.0)
        return real(messages)

    monkeypatch.setattr(rt.serving, "encode_chat", slow)
    done: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        t = threading.Thread(target=lambda: done.setdefault("status", c.post(CHAT, json=_chat()).status_code))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as other:
            assert other.get("/health").status_code == 200
        assert time.monotonic() - t0 < 1.0
        t.join(30)
    assert done["status"] == 200


def test_memory_meter_sees_a_transient_peak() -> None:
    """The guard's reading includes what a step held for a moment (the issue: MLX's peak
    reached 831 MB against an 800 MB budget while active memory looked fine)."""
    meter = MemoryMeter()
    meter()
    big = mx.zeros((64, 1024, 1024))  # 256 MiB, gone by the time the guard looks
    mx.eval(big)
    del big
    active = mx.get_active_memory()
    seen = meter()
    assert seen >= active + (200 << 20) and meter.peak >= seen
    assert meter() < seen  # the peak counter was reset by the previous reading


# ---- bounded fuzz ------------------------------------------------------------------------
def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**63, 2**64, -(2**70), 10**30])
    if kind == 1:
        return rng.choice([0.0, -0.5, 1.5, 2.5, 1e308, -1e-308, 0.7])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4, 5):
        return rng.choice(["", "x", "hello", "\u4e2d\u6587", "\u00e9\r\n\x00", "\U0001f600", "a" * 300,
                           "<|im_start|>", "{{ raise_exception('x') }}", "stop"])
    if kind == 6:
        return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(1, 20)))
    if kind == 7:
        return rng.choice(["10", "yes", "true", "1e3", "null"])
    if kind in (8, 9):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "turn", "x"]): _value(rng, depth + 1)
            for _ in range(rng.randrange(0, 3))}


_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
           "stream", "stream_options", "n", "user", "prompt_cache_key", "logprobs", "top_logprobs",
           "frequency_penalty", "tools", "response_format", "bogus"]


def _body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice([CHAT, CHAT, "/v1/completions", "/v1/sessions/s-1/fork"])
    if path == CHAT:
        obj: dict[str, Any] = _chat(rng.choice(["hi", "\u4e2d", "x" * 50]))
    elif path == "/v1/completions":
        obj = {"prompt": rng.choice(["once", [1, 2, 3], [], [-1], [10**9]]), "max_tokens": 2}
    else:
        obj = {"turn": 0}
    for _ in range(rng.randrange(0, 4)):
        obj[rng.choice(_FIELDS + list(obj))] = _value(rng)
    if path == CHAT and rng.random() < 0.3:
        obj["messages"] = [{"role": rng.choice(["user", "system", "tool", 3]), "content": _value(rng)}]
    obj.pop("stream", None) if rng.random() < 0.5 else None
    if isinstance(obj.get("max_tokens"), int) and not isinstance(obj.get("max_tokens"), bool):
        obj["max_tokens"] = min(obj["max_tokens"], 4)
    raw = json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
    mutation = rng.randrange(10)
    if mutation == 0 and raw:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    elif mutation == 1:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif mutation == 2:
        raw = raw.replace(b'"hi"', b'"\\ud83d"')
    return path, raw


def test_fuzz_bodies_never_get_a_5xx_and_the_engine_lives(url: str, rt: Runtime) -> None:
    rng = random.Random(20261201)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        for _ in range(200):
            path, raw = _body(rng)
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:200], r.text[:300])
        assert c.get("/health").json()["status"] == "ok"
        assert c.post(CHAT, json=_chat()).status_code == 200
    assert rt.engine.alive and rt.engine.running == 0
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 50, statuses


@pytest.fixture(scope="module")
def guarded_url(rt: Runtime) -> Iterator[str]:
    """The app behind the server's own h11 protocol (header timeout, cap, chunk check)."""
    import threading

    import uvicorn

    from segserve.server.http.http_guard import guarded_protocol
    from tests.http_support import free_port

    port = free_port()
    config = uvicorn.Config(
        create_app(rt.serving), host="127.0.0.1", port=port, log_level="warning", access_log=False,
        http=guarded_protocol(60.0, 1000, LIMIT),
    )
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        assert t.is_alive()
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(10)


def _closed(conn: Raw) -> bool:
    try:
        conn.send("GET", "/health")
        conn.response()
    except (ConnectionError, OSError):
        return True
    return False


def test_content_length_with_transfer_encoding_is_400_and_closes(guarded_url: str) -> None:
    body = json.dumps(_chat()).encode()
    conn = Raw(guarded_url)
    try:
        head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")
        conn.sock.sendall(head.encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        status, headers, raw = conn.response()
        assert status == 400, raw
        err = json.loads(raw)["error"]
        assert err["param"] == "Content-Length" and "Transfer-Encoding" in err["message"]
        assert headers.get("connection") == "close" and _closed(conn)
    finally:
        conn.close()


def test_a_chunk_over_the_limit_is_413_at_once(guarded_url: str) -> None:
    """Not the 408 of the body timeout (1 s here): the declared size alone decides."""
    conn = Raw(guarded_url)
    try:
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sock.sendall(head.encode() + b"%x\r\n" % (LIMIT + 1) + b'{"mess')
        status, headers, raw = conn.response()
        assert status == 413, raw
        assert json.loads(raw)["error"]["code"] == "request_too_large" and str(LIMIT + 1) in json.loads(raw)["error"]["message"]
        assert headers.get("connection") == "close"
    finally:
        conn.close()
    # A chunk within the limit is served through the same protocol.
    ok = Raw(guarded_url)
    try:
        body = json.dumps(_chat()).encode()
        head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        ok.sock.sendall(head.encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        assert ok.response()[0] == 200
    finally:
        ok.close()


def test_queue_full_message_counts_what_waits() -> None:
    """`--max-queue 16`: the 429 says 16 are waiting, not 17 (the head is being admitted)."""
    from segserve.server.engine.refusals import queue_full_error
    from segserve.server.http.errors import from_engine
    from tests.test_scheduler import _sched, _tk

    s = _sched(max_queue=16)
    admitted = 0
    while s.enqueue(_tk(f"r{admitted}", 4, 4), 0.0):
        admitted += 1
    assert admitted == 17 and len(s.waiting) == 17
    err = from_engine(queue_full_error(len(s.waiting), 1.0))
    assert err.status == 429 and err.message.startswith("16 requests are already waiting")


def test_orphan_function_call_output_is_400(client: httpx.Client) -> None:
    out = {"type": "function_call_output", "call_id": "call_nope", "output": "42"}
    r = client.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}, out], "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input.1.call_id" and "call_nope" in err["message"]
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    matched = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    first = client.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}, call, matched], "max_output_tokens": 2})
    assert first.status_code == 200, first.text
    # The call may come from the previous response's conversation.
    again = client.post("/v1/responses", json={
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "43"}],
        "previous_response_id": first.json()["id"], "max_output_tokens": 2,
    })
    assert again.status_code == 200, again.text
    orphan = client.post("/v1/responses", json={
        "input": [{"type": "function_call_output", "call_id": "call_2", "output": "1"}],
        "previous_response_id": first.json()["id"], "max_output_tokens": 2,
    })
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "input.0.call_id"
