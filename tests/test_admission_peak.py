"""Admission prices what a turn really allocates: measured peak <= price <= 2 x peak.

A tiny random-weight llama runs three turns of one session through the engine (segmented
mode, the default) at two prefill chunk sizes; MLX's peak memory above the turn's start is
compared with the price admission computed for that turn. The turns are sized so that the
tiered merge runs during one of them (its copy is part of the price).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from segserve.server.runner import ChatTokenizer
from segserve.server.scheduling import RequestCost
from tests.conftest import make_tiny_model, tiny_loaded
from tests.engine_support import check_turns_within_price, make_engine, price_spy


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RequestCost]]:
    """Every RequestCost the scheduler prices, in order."""
    yield price_spy(monkeypatch)


@pytest.mark.parametrize("chunk", [16, 64])
def test_turn_peak_is_within_its_price(
    chunk: int, gguf_tokenizer: ChatTokenizer, costs: list[RequestCost]
) -> None:
    engine = make_engine(
        tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3), context=4096), segmented=True, chunk=chunk
    )
    try:
        check_turns_within_price(engine, costs)
    finally:
        engine.stop()
