"""Reliability: one bad request never takes the engine down; bad seeds are 400s; SIGTERM and
SIGINT shut down gracefully (streams ended with an error event and [DONE], the bank flushed,
exit 0) and sessions survive the restart.

Failure injection: each test poisons ONE request (a marker token at the start of its
prompt, or a marker seed) by monkeypatching the function the engine calls in that phase on
a tiny random-weight model; the poisoned request must fail, and the next request, /health,
the failure counter, the scheduler's reservations and the bank's pins must all be right.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import segserve.server.runner.runner as runner_mod  # where the model phases run now
from segserve.bank import Bank
from segserve.config.settings import SettingsError, default_bank_dir, load_settings
from segserve.kv.segment import Snapshot
from segserve.server.engine.errors import EngineFailure
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer, Sampler, SamplingParams, decode_batch, logits_last
from segserve.server.runtime import Runtime
from tests.conftest import make_tiny_model, tiny_loaded
from tests.engine_support import make_engine, run
from tests.http_support import serve_in_thread, tiny_runtime
from tests.process_support import ServerProcess, write_tiny_model_dir

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MARK = 4321  # first prompt token of a poisoned request
ADMIT_SEED, SAMPLE_SEED = 9001, 9002  # seeds of requests poisoned in admission / sampling


class PinCountingStore(Bank):
    """The real RAM bank, counting pins still held (must be 0 whenever nothing runs)."""

    def __init__(self) -> None:
        from tests.conftest import TINY_NAMESPACE

        super().__init__(TINY_NAMESPACE, 1 << 30)
        self.pins = 0

    def pin(self, snapshot: Snapshot) -> None:
        super().pin(snapshot)
        self.pins += 1

    def unpin(self, snapshot: Snapshot) -> None:
        super().unpin(snapshot)
        self.pins -= 1


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    settings = load_settings(
        {"max_tokens_default": "8", "prefill_chunk": "16", "bank_dir": "none"}, environ={}
    )
    runtime = tiny_runtime(
        tiny_loaded(gguf_tokenizer, make_tiny_model(seed=7), context=1024), settings,
        store=PinCountingStore(),
    )
    yield runtime
    runtime.engine.stop()


@pytest.fixture(scope="module")
def client(rt: Runtime) -> Iterator[httpx.Client]:
    with serve_in_thread(create_app(rt.serving)) as url, httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
        yield c


def _failures(client: httpx.Client, phase: str) -> float:
    m = re.search(rf'^segserve_request_failures_total\{{phase="{phase}"\}} (\S+)$',
                  client.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _cache_tokens(layers: Sequence[Any]) -> tuple[int, ...]:
    return tuple(layers[0].parent.tokens)  # segmented layer cache -> its request's cache


def _poison(monkeypatch: pytest.MonkeyPatch, rt: Runtime, phase: str) -> None:
    """Make the engine's `phase` step raise for poisoned requests only."""
    if phase == "admit":
        class BadSeedSampler(Sampler):
            def __init__(self, params: SamplingParams) -> None:
                if params.seed == ADMIT_SEED:
                    raise TypeError("injected: key(): incompatible function arguments")
                super().__init__(params)

        monkeypatch.setattr(runner_mod, "Sampler", BadSeedSampler)
    elif phase == "prefill":
        real_logits = logits_last  # what runner_mod calls until patched

        def prefill(model: Any, tokens: Sequence[int], layers: Sequence[Any]) -> Any:
            if len(tokens) > 1 and MARK in tokens:
                raise RuntimeError("injected prefill failure")
            return real_logits(model, tokens, layers)

        monkeypatch.setattr(runner_mod, "logits_last", prefill)
    elif phase == "decode":
        _poison_decode(monkeypatch, lambda: None)
    elif phase == "sample":
        real_call = Sampler.__call__

        def sample(self: Sampler, logits: Any) -> Any:
            if self.params.seed == SAMPLE_SEED:
                raise ValueError("injected sampling failure")
            return real_call(self, logits)

        monkeypatch.setattr(Sampler, "__call__", sample)
    elif phase == "store":
        store = rt.engine.store
        real_put = store.put

        def put(session_id: str | None, snapshot: Snapshot, *, salt: str | None) -> str | None:
            if MARK in snapshot.tokens:
                raise OSError("injected store failure")
            return real_put(session_id, snapshot, salt=salt)

        monkeypatch.setattr(store, "put", put)
    else:
        raise AssertionError(phase)


def _poison_decode(monkeypatch: pytest.MonkeyPatch, on_mixed_batch: Callable[[], None]) -> None:
    """Decoding a poisoned request raises, batched or alone; `on_mixed_batch` is called
    when a batch held a poisoned request and a healthy one."""
    real_logits, real_batch = logits_last, decode_batch  # what runner_mod calls until patched

    def one(model: Any, tokens: Sequence[int], layers: Sequence[Any]) -> Any:
        if len(tokens) == 1 and MARK in _cache_tokens(layers):
            raise RuntimeError("injected decode failure")
        return real_logits(model, tokens, layers)

    def batch(model: Any, tokens: Sequence[int], caches: Sequence[Sequence[Any]]) -> Any:
        poisoned = [MARK in _cache_tokens(c) for c in caches]
        if any(poisoned):
            if not all(poisoned):
                on_mixed_batch()
            raise RuntimeError("injected batched decode failure")
        return real_batch(model, tokens, caches)

    monkeypatch.setattr(runner_mod, "logits_last", one)
    monkeypatch.setattr(runner_mod, "decode_batch", batch)


def _assert_nothing_held(rt: Runtime) -> None:
    assert rt.engine.scheduler.reserved == {}
    assert rt.engine.running == 0
    store = rt.engine.store
    assert isinstance(store, PinCountingStore) and store.pins == 0


def _poisoned_body(phase: str, **over: Any) -> dict[str, Any]:
    seed = {"admit": ADMIT_SEED, "sample": SAMPLE_SEED}.get(phase, 1)
    return {"prompt": [MARK, 300, 301, 302, 303, 304], "max_tokens": 6, "temperature": 0, "seed": seed, **over}


@pytest.mark.parametrize("phase", ["admit", "prefill", "decode", "sample", "store"])
def test_a_failure_in_one_request_fails_that_request_only(
    client: httpx.Client, rt: Runtime, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    _poison(monkeypatch, rt, phase)
    before = _failures(client, phase)
    salt = {"X-Cache-Salt": f"inject-{phase}"}  # nothing stored by another test is reused
    r = client.post(COMPLETIONS, json=_poisoned_body(phase), headers=salt)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "generation_failed" and err["type"] == "server_error"
    assert phase in err["message"] and "injected" in err["message"]
    assert _failures(client, phase) == before + 1
    _assert_nothing_held(rt)
    ok = client.post(CHAT, json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}, headers=salt)
    assert ok.status_code == 200, ok.text
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    _assert_nothing_held(rt)


def _sse(client: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None,
         first: threading.Event | None = None) -> list[str]:
    events: list[str] = []
    with client.stream("POST", COMPLETIONS, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if first is not None and '"text"' in line:
                    first.set()
    return events


def test_decode_failure_mid_stream_ends_with_error_event_and_done(
    client: httpx.Client, rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison(monkeypatch, rt, "decode")
    events = _sse(client, _poisoned_body("decode"), {"X-Cache-Salt": "stream-decode"})
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "generation_failed" and "decode" in err["message"]
    assert any('"text"' in e for e in events[:-2])  # a token was streamed before the failure
    _assert_nothing_held(rt)


def test_batched_decode_failure_ends_only_the_failing_request(
    client: httpx.Client, rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    healthy = {"prompt": [500, 501, 502, 503, 504, 505, 506], "max_tokens": 150, "temperature": 0}
    reference = client.post(COMPLETIONS, json=healthy, headers={"X-Cache-Salt": "batch-ref"}).json()
    mixed = threading.Event()
    _poison_decode(monkeypatch, mixed.set)
    first = threading.Event()
    result: dict[str, list[str]] = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "events", _sse(client, healthy, {"X-Cache-Salt": "batch-run"}, first)))
    t.start()
    assert first.wait(60)
    r = client.post(COMPLETIONS, json=_poisoned_body("decode"), headers={"X-Cache-Salt": "batch-bad"})
    t.join(120)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert mixed.is_set(), "the poisoned request never shared a batched step with the healthy one"
    events = result["events"]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
    # The healthy stream's cache was rewound and re-fed alone: same tokens as undisturbed.
    assert text == reference["choices"][0]["text"]
    _assert_nothing_held(rt)


def test_repeated_loop_failures_end_in_flight_requests_and_the_engine_lives(
    client: httpx.Client, rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_guard() -> None:
        raise RuntimeError("injected guard failure")

    monkeypatch.setattr(rt.engine, "_guard", broken_guard)
    before = _failures(client, "engine")
    r = client.post(COMPLETIONS, json={"prompt": [700, 701, 702], "max_tokens": 50, "temperature": 0})
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert _failures(client, "engine") == before + 1
    monkeypatch.undo()
    assert client.post(COMPLETIONS, json={"prompt": [700, 701], "max_tokens": 3}).status_code == 200
    assert client.get("/health").json()["status"] == "ok"
    _assert_nothing_held(rt)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64])
def test_out_of_range_seed_is_400_naming_seed(client: httpx.Client, path: str, seed: int) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "seed": seed}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "seed" and "seed" in err["message"]
    body["seed"] = 2**64 - 1 if seed > 0 else 0  # the edges of what mx.random.key takes
    assert client.post(path, json=body).status_code == 200
    assert client.get("/health").json()["engine"]["alive"] is True


def test_engine_survives_a_seed_that_reaches_it(gguf_tokenizer: ChatTokenizer, make_request: Any) -> None:
    """The original crash: seed -1 reached mx.random.key on the engine thread."""
    eng = make_engine(tiny_loaded(gguf_tokenizer), segmented=True)
    try:
        bad = run(eng, [make_request([1, 2, 3], 4, sampling=SamplingParams(temperature=1.0, seed=-1))])[0]
        assert bad.failed is not None and isinstance(bad.failed.error, EngineFailure)
        assert bad.started is None  # refused before the stream could start
        good = run(eng, [make_request([1, 2, 3], 4)])[0]
        assert good.done is not None and eng.alive and eng.scheduler.reserved == {}
    finally:
        eng.stop()


def test_draining_refuses_new_requests(client: httpx.Client, rt: Runtime) -> None:
    rt.serving.draining = True
    try:
        r = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["retry-after"]
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "shutting_down"
    finally:
        rt.serving.draining = False


# ---- settings -----------------------------------------------------------------------------
def test_shutdown_timeout_setting() -> None:
    assert load_settings({}, environ={}).shutdown_timeout == 30
    assert load_settings({}, environ={"SEGSERVE_SHUTDOWN_TIMEOUT": "2.5"}).shutdown_timeout == 2.5
    assert load_settings({"shutdown_timeout": "0"}, environ={}).shutdown_timeout == 0
    for bad in ("-1", "abc", "100000"):
        with pytest.raises(SettingsError, match="SEGSERVE_SHUTDOWN_TIMEOUT"):
            load_settings({}, environ={"SEGSERVE_SHUTDOWN_TIMEOUT": bad})


def test_bank_dir_defaults_to_the_user_cache(tmp_path: Path) -> None:
    s = load_settings({}, environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert s.bank_dir == str(tmp_path / "segserve" / "bank") and s.cold_tier_dir() == tmp_path / "segserve" / "bank"
    assert default_bank_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/segserve/bank")
    assert default_bank_dir({"XDG_CACHE_HOME": "relative", "HOME": "/h"}) == Path("/h/.cache/segserve/bank")
    off = load_settings({"bank_dir": "None"}, environ={})
    assert off.bank_dir == "none" and off.cold_tier_dir() is None
    assert load_settings({}, environ={"SEGSERVE_BANK_DIR": "/x/y"}).cold_tier_dir() == Path("/x/y")
    with pytest.raises(SettingsError, match="--bank-dir"):  # the flag it came from
        load_settings({"bank_dir": " "}, environ={})
    with pytest.raises(SettingsError, match="SEGSERVE_BANK_DIR"):
        load_settings({}, environ={"SEGSERVE_BANK_DIR": " "})


# ---- a real process: signals, drain, restart --------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


def _serve(model: Path, bank: Path, log: Path) -> ServerProcess:
    srv = ServerProcess(log, "--model", str(model), "--bank-dir", str(bank), "--shutdown-timeout", "0.5",
                        "--max-tokens-default", "16", "--prefill-chunk", "64")
    try:
        srv.wait_healthy()
    except BaseException:
        srv.kill()
        raise
    return srv


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_flushes_and_sessions_survive_restart(
    tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    bank = tmp_path / "bank"
    srv = _serve(tiny_model_dir, bank, tmp_path / "first.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            msgs = [{"role": "user", "content": "remember this conversation " * 20}]
            turn = c.post(CHAT, json={"messages": msgs, "max_tokens": 8, "temperature": 0},
                          headers={"X-Session-Id": "keep"})
            assert turn.status_code == 200, turn.text
            # A stream far longer than --shutdown-timeout is in flight when the signal comes.
            first = threading.Event()
            result: dict[str, list[str]] = {}
            body = {"prompt": "once upon a time", "max_tokens": 6000, "temperature": 0}
            t = threading.Thread(target=lambda: result.setdefault(
                "events", _sse(c, body, {"X-Session-Id": "cut"}, first)))
            t.start()
            assert first.wait(30), srv.log()
            plain: dict[str, httpx.Response] = {}  # and a non-streaming one
            u = threading.Thread(target=lambda: plain.setdefault("r", c.post(COMPLETIONS, json=body)))
            u.start()
            time.sleep(0.3)
            srv.proc.send_signal(sig)
            t.join(30)
            u.join(30)
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "shutting_down"
        events = result["events"]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert srv.wait_exit() == 0, srv.log()
        log = srv.log()
        assert log.count("segserve: stopped") == 1 and "Traceback" not in log, log
        assert "queued SSD writes were lost" not in log
    finally:
        srv.kill()

    again = _serve(tiny_model_dir, bank, tmp_path / "second.log")
    try:
        with httpx.Client(base_url=again.url, timeout=60, trust_env=False) as c:
            info = c.get("/v1/sessions/keep")
            assert info.status_code == 200, info.text
            assert info.json()["turns"] == 1 and info.json()["tokens"] > 0
            assert c.get("/v1/sessions/cut").status_code == 200  # the cut stream's prompt was kept
            msgs += [{"role": "assistant", "content": turn.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and now?"}]
            nxt = c.post(CHAT, json={"messages": msgs, "max_tokens": 2, "temperature": 0},
                         headers={"X-Session-Id": "keep"}).json()
            assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= turn.json()["usage"]["prompt_tokens"] - 1
        again.proc.send_signal(sig)  # idle: shuts down at once
        assert again.wait_exit() == 0, again.log()
        assert again.log().count("segserve: stopped") == 1
    finally:
        again.kill()



@pytest.mark.slow
def test_kill_9_mid_stream_keeps_earlier_turns(tiny_model_dir: Path, tmp_path: Path) -> None:
    bank = tmp_path / "bank"
    srv = _serve(tiny_model_dir, bank, tmp_path / "first.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            msgs = [{"role": "user", "content": "an earlier turn worth keeping " * 20}]
            turn = c.post(CHAT, json={"messages": msgs, "max_tokens": 8, "temperature": 0},
                          headers={"X-Session-Id": "keep"})
            assert turn.status_code == 200, turn.text
            deadline = time.monotonic() + 30  # the turn is committed once its blocks are written
            while c.get("/health").json()["bank"].get("writes_pending", 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            first = threading.Event()
            body = {"prompt": "once upon a time", "max_tokens": 6000, "temperature": 0}
            def stream() -> None:
                with contextlib.suppress(httpx.HTTPError):  # the server dies mid-stream
                    _sse(c, body, {"X-Session-Id": "keep"}, first)

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            assert first.wait(30), srv.log()
            srv.proc.kill()  # SIGKILL while the stream writes its tail
            srv.proc.wait(30)
            t.join(30)
    finally:
        srv.kill()
    again = _serve(tiny_model_dir, bank, tmp_path / "second.log")
    try:
        with httpx.Client(base_url=again.url, timeout=60, trust_env=False) as c:
            msgs += [{"role": "assistant", "content": turn.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "still there?"}]
            nxt = c.post(CHAT, json={"messages": msgs, "max_tokens": 2, "temperature": 0},
                         headers={"X-Session-Id": "keep"})
            assert nxt.status_code == 200, nxt.text
            cached = nxt.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= turn.json()["usage"]["prompt_tokens"] - 1, again.log()
    finally:
        again.kill()


@pytest.mark.slow
def test_second_signal_exits_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "server.log", "--model", str(tiny_model_dir), "--bank-dir", "none",
                        "--shutdown-timeout", "60")
    try:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60, trust_env=False) as c:
            first = threading.Event()
            body = {"prompt": "once upon a time", "max_tokens": 6000, "temperature": 0}
            t = threading.Thread(target=lambda: _sse_ignoring_cut(c, body, first), daemon=True)
            t.start()
            assert first.wait(30), srv.log()
            srv.proc.send_signal(signal.SIGTERM)  # graceful: would wait up to 60 s for the stream
            deadline = time.monotonic() + 10
            while "shutting down gracefully" not in srv.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.wait_exit(10) == 128 + signal.SIGTERM, srv.log()
        assert "exiting now" in srv.log()
    finally:
        srv.kill()


def _sse_ignoring_cut(client: httpx.Client, body: dict[str, Any], first: threading.Event) -> None:
    try:
        _sse(client, body, None, first)
    except httpx.HTTPError:
        pass  # the process exited mid-stream
