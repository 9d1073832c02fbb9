"""Scheduler on plain numbers: bounded FIFO queue, reservations, timeouts, the guard."""

from __future__ import annotations

from server.admission import RequestCost, SchedulerLimits
from server.scheduler import BankNumbers, Scheduler

KV = 1000  # bytes per token


def _limits(budget: int = 100_000, max_queue: int = 2, timeout: float = 5.0) -> SchedulerLimits:
    return SchedulerLimits(
        budget_bytes=budget,
        kv_bytes_per_token=KV,
        prefill_chunk_tokens=10,
        prefill_transient_bytes_per_token=0,
        dense_decode_ceiling_bytes=10**9,
        max_queue=max_queue,
        queue_timeout_s=timeout,
        segmented=True,
    )


def _sched(**kw: object) -> Scheduler[str]:
    return Scheduler(_limits(**kw), weights_bytes=10_000)  # type: ignore[arg-type]


NO_BANK = BankNumbers(0, 0)


def test_fifo_admit_and_reserve() -> None:
    s = _sched()
    assert s.enqueue("a", "a", 0.0) and s.enqueue("b", "b", 0.0)
    d = s.decide_head(RequestCost(new_prompt_tokens=20, max_tokens=10), NO_BANK)
    assert d.decision == "admit" and d.price_bytes == 30 * KV
    assert s.admit_head(d.price_bytes).item == "a"
    assert s.reserved == {"a": 30_000}
    assert s.head() is not None and s.head().item == "b"  # type: ignore[union-attr]


def test_wait_until_running_finishes() -> None:
    s = _sched()
    s.reserved["r"] = 80_000
    s.enqueue("x", "x", 0.0)
    cost = RequestCost(new_prompt_tokens=20, max_tokens=10)  # 30k; free 10k
    assert s.decide_head(cost, NO_BANK).decision == "wait"
    s.finish("r", seconds=2.0)
    assert s.decide_head(cost, NO_BANK).decision == "admit"


def test_eviction_shortfall_and_507() -> None:
    s = _sched()
    s.enqueue("x", "x", 0.0)
    bank = BankNumbers(ram_bytes=80_000, evictable_bytes=80_000)
    d = s.decide_head(RequestCost(new_prompt_tokens=20, max_tokens=10), bank)
    assert d.decision == "admit" and d.evict_bytes == 30_000 - (100_000 - 10_000 - 80_000)
    d = s.decide_head(RequestCost(new_prompt_tokens=200, max_tokens=10), bank)
    assert d.decision == "reject_insufficient_memory"
    assert s.last_refusal is not None and s.last_refusal["decision"] == "reject_insufficient_memory"


def test_queue_bound() -> None:
    s = _sched(max_queue=2)
    assert all(s.enqueue(str(i), str(i), 0.0) for i in range(3))  # head + 2 waiting
    assert not s.enqueue("late", "late", 0.0)
    assert s.last_refusal == {"decision": "reject_queue_full", "reason": "queue_full"}
    assert s.retry_after() >= 1


def test_timeouts_leave_the_rest_in_order() -> None:
    s = _sched(timeout=5.0)
    s.enqueue("old", "old", 0.0)
    s.enqueue("new", "new", 4.0)
    out = s.timed_out(now=6.0)
    assert [w.item for w in out] == ["old"]
    assert [w.item for w in s.waiting] == ["new"]


def test_guard() -> None:
    s = _sched(budget=100_000)
    s.reserved.update({"a": 10_000, "b": 10_000})
    assert s.guard(90_000, {"a": 50_000, "b": 5_000}).kind == "none"
    act = s.guard(120_000, {"a": 50_000, "b": 5_000})
    assert act.kind == "end_request" and act.request_id == "a" and act.bytes_over == 20_000
    act = s.guard(120_000, {"a": 5_000, "b": 5_000})
    assert act.kind == "shed_bank" and act.request_id is None


def test_mean_request_time_moves_retry_after() -> None:
    s = _sched()
    before = s.mean_request_s
    s.reserved["r"] = 1
    s.finish("r", seconds=100.0)
    assert s.mean_request_s > before
