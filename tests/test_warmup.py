"""The start-up warm-up (`segserve.server.runner.warmup`): a decode step at every batch size
1..N and the prefill chunks, on the engine thread, before the first request.

It must run every size it promises, leave nothing behind (no session stored, no request
seen, the same tokens afterwards), keep the server not ready while it runs, and never stop a
server from serving when it fails."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import mlx.core as mx
import pytest

from segserve.config.settings import load_settings
from segserve.server.engine import GenerationRequest, SamplingParams
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer, WarmUpReport, decode_batch, warmup
from segserve.server.runtime import build_runtime, warmup_batch
from tests.conftest import ram_store, tiny_loaded
from tests.engine_support import run
from tests.http_support import serve_in_thread, tiny_runtime


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(10, 50)), 6, SamplingParams(temperature=0.0))


def _sizes_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every decode step the warm-up runs, in order."""
    seen: list[int] = []
    original = decode_batch

    def spy(backend: Any, tokens: Any, caches: Any, *a: Any, **kw: Any) -> Any:
        seen.append(len(caches))
        return original(backend, tokens, caches, *a, **kw)

    monkeypatch.setattr(warmup, "decode_batch", spy)  # the name warm_up calls
    return seen


@pytest.mark.parametrize("segmented", [True, False])
def test_every_batch_size_runs_and_nothing_stays(
    gguf_tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch, segmented: bool
) -> None:
    sizes = _sizes_spy(monkeypatch)
    loaded = tiny_loaded(gguf_tokenizer, context=512)
    cold = tiny_runtime(loaded, load_settings({}, environ={}), segmented=segmented)
    warm = tiny_runtime(loaded, load_settings({"warmup_batch": 3}, environ={}), segmented=segmented)
    try:
        plain = run(cold.engine, [_request("a")])[0]
        warmed = run(warm.engine, [_request("b")])[0]
        report = warm.engine.warm_report
        assert report is not None and report.error is None and report.max_batch == 3
        # Shared history, then own histories, at each size.
        assert sizes == [1, 1, 2, 2, 3, 3]
        assert cold.engine.warm_report is None
        assert warmed.tokens == plain.tokens and len(plain.tokens) == 6
        # Only the request's own turn was stored: the warm-up's histories never reach the bank.
        assert warm.serving.engine.state().bank["sessions"] == cold.serving.engine.state().bank["sessions"]
        health = warm.serving.health()
        assert health["ready"] and health["engine"]["warm_up"]["max_batch"] == 3
    finally:
        cold.engine.stop()
        warm.engine.stop()


def test_not_ready_while_warming_and_requests_wait(gguf_tokenizer: ChatTokenizer) -> None:
    """Over HTTP: /health is 503 `warming` (a status-only readiness check waits), a chat
    request sent meanwhile is answered once the warm-up ends, then /health is 200 `ok`."""
    release = threading.Event()

    def slow_warm_up(stopped: Any) -> WarmUpReport:
        release.wait(30)
        return WarmUpReport(1, 0.0)

    rt = build_runtime(load_settings({}, environ={}), loaded=tiny_loaded(gguf_tokenizer, context=512),
                       store=ram_store())
    rt.engine._warm_up = slow_warm_up
    rt.engine.start()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    try:
        with serve_in_thread(create_app(rt.serving)) as url, \
                httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "warming"
            assert not r.json()["ready"] and r.json()["engine"]["warming"]
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(client.post, "/v1/chat/completions", json=body)
                time.sleep(0.5)
                assert not answer.done()  # queued behind the warm-up
                release.set()
                got = answer.result(timeout=120)
            assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 4
            r = client.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["ready"]
            assert r.json()["engine"]["warm_up"] == {"max_batch": 1, "seconds": 0.0, "error": None}
    finally:
        release.set()
        rt.engine.stop()


def test_a_failed_warm_up_still_serves(gguf_tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("kernel compile failed")

    monkeypatch.setattr(warmup, "decode_batch", broken)
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer, context=512), load_settings({"warmup_batch": 2}, environ={}))
    try:
        result = run(rt.engine, [_request("f")])[0]
        assert result.done is not None and len(result.tokens) == 6
        report = rt.engine.warm_report
        assert report is not None and report.error == "RuntimeError: kernel compile failed"
        assert rt.serving.health()["ready"]
    finally:
        rt.engine.stop()


def test_auto_is_off_on_the_cpu_and_explicit_wins() -> None:
    assert warmup_batch(None) == (0 if mx.default_device() == mx.cpu else 32)
    assert warmup_batch(5) == 5 and warmup_batch(0) == 0


def test_a_shutdown_ends_the_warm_up_between_batch_sizes(gguf_tokenizer: ChatTokenizer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during the warm-up (`Engine.stop`) does not wait for every batch size: the
    warm-up stops at the next one and the engine thread ends."""
    sizes = _sizes_spy(monkeypatch)
    rt = build_runtime(load_settings({"warmup_batch": 50}, environ={}),
                       loaded=tiny_loaded(gguf_tokenizer, context=512), store=ram_store())
    runner_warm_up = rt.engine._warm_up
    assert runner_warm_up is not None
    entered = threading.Event()

    def warm_up(stopped: Any) -> WarmUpReport:
        def stop_after_two() -> bool:
            if len(sizes) >= 4:  # batch sizes 1 and 2, each twice (shared, own)
                entered.set()
                rt.engine._stop.set()
            return bool(stopped())
        return runner_warm_up(stop_after_two)

    rt.engine._warm_up = warm_up
    rt.engine.start()
    assert entered.wait(60)
    rt.engine.stop(timeout=30)
    assert not rt.engine.thread_alive
    report = rt.engine.warm_report
    assert report is not None and report.error == "stopped at batch size 3" and sizes == [1, 1, 2, 2]
