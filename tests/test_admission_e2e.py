"""Admission end to end (tiny model, real HTTP): a justified 507, eviction instead of 507,
and the memory guard ending a request that outgrew its price."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from segserve.config.settings import Settings, load_settings
from segserve.server.engine import GenerationRequest
from segserve.server.engine.errors import InsufficientMemory
from segserve.server.http.app import create_app
from segserve.server.http.metrics import Metrics
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.engine_support import make_engine, run
from tests.http_support import serve_in_thread, tiny_runtime

CHAT = "/v1/chat/completions"
# Tiny model: 2048 KV bytes per token; activations 3072 bytes per token of a 16-token chunk;
# the step scratch of these greedy requests (the logits and the argmax's float32 copy,
# vocabulary 49152) 393,216 bytes; the prompt's rows are priced in 64-row steps (the tail
# buffer's). A short chat turn (~30 tokens, max_tokens 4) prices ~0.6 MB, a 150-word one
# (181 tokens) ~0.84 MB.
BUDGET = "760KB"
BUDGET_BYTES = 760_000


def _settings() -> Settings:
    # Speculation on: a short request fits this budget only without a verify window's
    # price, and must then run without drafts rather than be refused.
    return load_settings({"memory_budget": BUDGET, "prefill_chunk": "16", "max_tokens_default": "4",
                          "speculative": "auto"}, environ={})


@pytest.fixture
def tight(gguf_tokenizer: ChatTokenizer) -> Iterator[tuple[Runtime, str]]:
    # Real usage is simulated as "what admission reserved" so the guard stays quiet here:
    # this test process holds other tests' arrays, which MLX counts as active memory.
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), _settings(), memory_in_use=lambda: 0)
    with serve_in_thread(create_app(rt.serving)) as url:
        yield rt, url
    rt.engine.stop()


def _chat(url: str, text: str, **kw: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(url + CHAT, json=body, timeout=60, trust_env=False)


def test_justified_507_with_useful_body(tight: tuple[Runtime, str]) -> None:
    rt, url = tight
    r = _chat(url, "word " * 150)
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory" and err["type"] == "server_error"
    d = err["detail"]
    assert d["needed_bytes"] > d["capacity_when_idle_bytes"]
    assert d["budget_bytes"] == BUDGET_BYTES
    assert set(d["held_by"]) >= {"weights_bytes", "bank_protected_bytes", "running_bytes"}
    assert d["retry_can_succeed"] is False
    assert "needs" in err["message"]
    health = httpx.get(url + "/health", trust_env=False).json()
    assert health["admission"]["last_refusal"]["decision"] == "reject_insufficient_memory"
    assert 'segserve_admission_decisions_total{decision="reject_insufficient_memory"' in httpx.get(url + "/metrics", trust_env=False).text
    # A short request still fits: the refusal was about this request, not the server.
    ok = _chat(url, "hi")
    assert ok.status_code == 200, ok.text


def test_eviction_makes_room_instead_of_507(tight: tuple[Runtime, str]) -> None:
    rt, url = tight
    # Keep opening conversations: idle sessions pile up in the bank until a new request
    # only fits once some are evicted. Every request must still be answered (no 507).
    evicted = 0
    for i in range(16):
        r = _chat(url, f"conversation {i}: " + "tell me something new " * 3, prompt_cache_key=f"s{i}")
        assert r.status_code == 200, r.text
        evicted = sum(rt.engine.bank_state()["evictions_by_reason"].values())
        if evicted:
            break
    assert evicted > 0
    assert rt.engine.store.ram_bytes() <= BUDGET_BYTES
    text = httpx.get(url + "/metrics", trust_env=False).text
    assert 'reason="fits_after_eviction"' in text
    assert 'decision="reject_insufficient_memory"' not in text


def test_guard_ends_a_request_that_outgrew_its_price(
    gguf_tokenizer: ChatTokenizer, make_request: Callable[..., GenerationRequest]
) -> None:
    metrics = Metrics()
    holder: dict[str, Any] = {}

    def usage_after_a_pricing_bug() -> int:
        # Simulate a price that was too low: every reservation shrinks to one byte, and
        # real usage is far past the budget.
        for rid in holder["engine"].scheduler.reserved:
            holder["engine"].scheduler.reserved[rid] = 1
        return 1 << 40

    eng = make_engine(
        tiny_loaded(gguf_tokenizer),
        segmented=True,
        settings_over={"memory_budget": "10MB"},
        memory_in_use=usage_after_a_pricing_bug,
        observer=metrics,
    )
    holder["engine"] = eng
    r = run(eng, [make_request(list(range(40)), 50)])[0]
    eng.stop()
    err = r.failed.error if r.failed is not None else None
    assert isinstance(err, InsufficientMemory) and err.reason == "memory_guard"
    text = metrics.render()[0].decode()
    assert 'segserve_guard_interventions_total{reason="request_outgrew_price"}' in text
