"""Admission prices what a turn really allocates: measured peak <= price <= 2 x peak.

A tiny random-weight llama runs three turns of one session through the engine (segmented
mode, the default) at two prefill chunk sizes, without speculation; MLX's peak memory above
the turn's start is compared with the price admission computed for that turn (with
speculation only the upper bound). The turns are sized so that the
tiered merge runs during one of them (its copy is part of the price).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from segserve.server.engine import GenerationRequest
from segserve.server.runner import ChatTokenizer, SamplingParams
from segserve.server.scheduling import RequestCost
from segserve.server.scheduling.admission import price
from tests.conftest import cycling_loaded, make_tiny_model, tiny_loaded
from tests.engine_support import check_turns_within_price, make_engine, price_spy, run, with_peak


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RequestCost]]:
    """Every RequestCost the scheduler prices, in order."""
    yield price_spy(monkeypatch)


@pytest.mark.parametrize("chunk", [16, 64])
def test_turn_peak_is_within_its_price(
    chunk: int, gguf_tokenizer: ChatTokenizer, costs: list[RequestCost]
) -> None:
    engine = make_engine(
        tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3), context=4096), segmented=True, chunk=chunk,
        settings_over={"speculative": "off"},
    )
    try:
        check_turns_within_price(engine, costs)
    finally:
        engine.stop()


def test_speculating_turn_peak_is_within_its_price(gguf_tokenizer: ChatTokenizer, costs: list[RequestCost]) -> None:
    """With speculation the price holds a verify window of 1 + K rows for every step and
    the turn's draft index: a bound the turn stays under while its drafts verify (how many
    steps verify, and how wide, depends on what the drafts match, so the price is not
    within 2x here)."""
    # A model whose greedy text cycles (its drafts verify), without an end of text.
    engine = make_engine(cycling_loaded(gguf_tokenizer), segmented=True, chunk=16,
                         settings_over={"speculative": "auto"})
    try:
        prompt = tuple(100 + (i * 7) % 5000 for i in range(600))
        req = GenerationRequest("s0", prompt, 64, SamplingParams(temperature=0.0))
        (res,), peak = with_peak(lambda: run(engine, [req]))
        assert res.failed is None and len(res.tokens) == 64
        assert res.done is not None and res.done.accepted_tokens > 0  # windows were verified
        priced = price(costs[-1], engine.scheduler.limits).total_bytes
        assert costs[-1].speculate and peak <= priced, f"peak {peak} B, price {priced} B"
    finally:
        engine.stop()
