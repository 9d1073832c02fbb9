"""bench/capacity.py: the session counts follow from the admission price function.

For each row the count N fits the budget and N + 1 does not, with every turn priced by
`price` itself (not the script's copy of it); segmented turns copy no history, stock turns
copy all of it; forks share a history in segmented mode only.
"""

from __future__ import annotations

import pytest

from bench import capacity
from segserve.server.scheduling.admission import RequestCost, price

GB = 10**9


def _memory(budget: int, weights: int, history: int, turn: int, n: int, branches: int) -> int:
    return weights + -(-n // branches) * history + n * turn


@pytest.mark.parametrize(("device", "memory"), [("gpu", 141 * GB), ("cpu", 64 * GB)])
@pytest.mark.parametrize("branches", [1, 4])
def test_counts_are_the_largest_that_the_price_admits(device: str, memory: int, branches: int) -> None:
    shape = capacity.Shape()
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token
    out = capacity.run(shape, device, memory, [8192, 32768], 512, 256, branches)
    budget = out["budget_bytes"]
    assert budget == (memory * 90 // 100 if device == "gpu" else memory * 75 // 100)
    for row in out["rows"]:
        ctx = row["context"]
        history = ctx * shape.kv_bytes_per_token
        for mode in ("segmented", "stock"):
            lim = capacity.limits(shape, budget, memory, mode == "segmented")
            turn = price(RequestCost(512, 256, history_tokens=ctx, history_segments=1), lim)
            got = row[mode]
            assert got["turn_price_bytes"] == turn.total_bytes
            n = got["sessions"]
            assert _memory(budget, shape.weights_bytes, history, turn.total_bytes, n, branches) <= budget
            assert _memory(budget, shape.weights_bytes, history, turn.total_bytes, n + 1, branches) > budget
        assert row["segmented"]["history_copy_bytes"] == 0
        assert row["stock"]["history_copy_bytes"] == history
        assert row["segmented"]["sessions"] > row["stock"]["sessions"]


def test_nothing_fits_when_the_weights_fill_the_budget() -> None:
    assert capacity.sessions_that_fit(budget=10, weights=10, history=1, turn=1, branches=1) == 0
    assert capacity.sessions_that_fit(budget=15, weights=10, history=1, turn=1, branches=1) == 2
    # Two sessions forking one history hold it once.
    assert capacity.sessions_that_fit(budget=15, weights=10, history=1, turn=1, branches=2) == 3
