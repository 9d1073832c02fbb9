"""Admission prices what a turn really allocates: measured peak <= price <= 2 x peak.

A tiny random-weight llama runs three turns of one session through the engine (segmented
mode, the default) at two prefill chunk sizes; MLX's peak memory above the turn's start is
compared with the price admission computed for that turn. The turns are sized so that the
tiered merge runs during one of them (its copy is part of the price).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import mlx.core as mx
import pytest

import server.scheduling.scheduler as scheduler_mod
from server.engine import GenerationRequest
from server.runner import ChatTokenizer, SamplingParams
from server.scheduling import LookupHit, RequestCost, price
from tests.conftest import make_tiny_model, tiny_loaded
from tests.engine_support import make_engine, run


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RequestCost]]:
    """Every RequestCost the scheduler prices, in order."""
    seen: list[RequestCost] = []
    original = scheduler_mod.request_cost

    def spy(prompt_tokens: int, max_tokens: int, hit: LookupHit) -> RequestCost:
        cost = original(prompt_tokens, max_tokens, hit)
        seen.append(cost)
        return cost

    monkeypatch.setattr(scheduler_mod, "request_cost", spy)
    yield seen


@pytest.mark.parametrize("chunk", [16, 64])
def test_turn_peak_is_within_its_price(
    chunk: int, gguf_tokenizer: ChatTokenizer, costs: list[RequestCost]
) -> None:
    engine = make_engine(
        tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3), context=4096), segmented=True, chunk=chunk
    )
    try:
        history: list[int] = []
        merged = 0
        for turn, (n_new, max_tokens) in enumerate([(600, 40), (300, 40), (900, 24)]):
            prompt = history + [100 + (i * 7 + turn) % 5000 for i in range(n_new)]
            req = GenerationRequest(
                f"t{turn}", tuple(prompt), max_tokens, SamplingParams(temperature=0.0), session_id="s"
            )
            gc.collect()
            mx.synchronize()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            (res,) = run(engine, [req])
            peak = mx.get_peak_memory() - base
            assert res.failed is None and len(res.tokens) == max_tokens
            cost = costs[-1]
            merged += cost.merge_rows
            priced = price(cost, engine.scheduler.limits).total_bytes
            assert peak <= priced <= 2 * peak, f"turn {turn}: peak {peak} B, price {priced} B"
            history = prompt + res.tokens
        assert merged > 0, "no turn merged segments: the merge price went untested"
    finally:
        engine.stop()
