"""The scheduler on plain numbers: queue, lookup -> pin -> price, reservations, timeouts,
step composition and fairness, update from the runner's output, and the guard.

No model and no MLX: the store is a fake over byte counts, requests are small dataclasses.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from segserve.server.scheduling import (
    RequestCost,
    Sampled,
    Scheduler,
    SchedulerLimits,
    StepOutput,
    StepPlan,
    reusable_tokens,
)

KV = 1000  # bytes per token


# ---- fakes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class FakeSnap:
    """A stored history: `rows` tokens of `KV` bytes each (no segments: no merges)."""

    name: str = ""
    rows: int = 0
    segments: tuple[object, ...] = ()

    def prefix(self, n: int) -> FakeSnap:
        return FakeSnap(self.name, min(n, self.rows))


EMPTY = FakeSnap()


@dataclass(frozen=True)
class FakeHit:
    """A lookup's result as the scheduler reads it (`segserve.server.scheduling.LookupHit`)."""

    snapshot: FakeSnap
    reused_tokens: int
    kind: str
    restore_rows_from_ssd: int = 0


@dataclass
class FakeStore:
    """Sessions by id, each a snapshot of `rows * KV` bytes in RAM; pinned ones are never
    evictable; `release` drops unpinned sessions, oldest first."""

    sessions: dict[str, FakeSnap] = field(default_factory=dict)
    pins: Counter[str] = field(default_factory=Counter)
    dropped: list[str] = field(default_factory=list)
    puts: list[tuple[str | None, int]] = field(default_factory=list)
    lookups: list[int] = field(default_factory=list)  # max_reuse of each lookup
    forks: list[tuple[str, int | None, str]] = field(default_factory=list)

    def continue_session(self, session_id: str, turn: int | None, *, salt: str | None,
                         new_id: str) -> bool:
        self.forks.append((session_id, turn, new_id))
        src = self.sessions.get(session_id)
        if src is None or new_id in self.sessions:
            return False
        self.sessions[new_id] = FakeSnap(new_id, src.rows)
        return True

    def lookup(self, tokens: Sequence[int], *, session_id: str | None, salt: str | None,
               max_reuse: int) -> FakeHit:
        self.lookups.append(max_reuse)
        snap = self.sessions.get(session_id or "")
        if snap is None:
            return FakeHit(EMPTY, 0, "miss")
        n = min(snap.rows, max_reuse)
        return FakeHit(snap.prefix(n), n, "session")

    def put(self, session_id: str | None, snapshot: FakeSnap, *, salt: str | None) -> str | None:
        sid = session_id or f"new{len(self.puts)}"
        self.puts.append((sid, snapshot.rows))
        self.sessions[sid] = FakeSnap(sid, snapshot.rows)
        return sid

    def pin(self, snapshot: FakeSnap) -> None:
        if snapshot.name:
            self.pins[snapshot.name] += 1

    def unpin(self, snapshot: FakeSnap) -> None:
        if snapshot.name:
            self.pins[snapshot.name] -= 1
            assert self.pins[snapshot.name] >= 0

    def ram_bytes(self) -> int:
        return sum(s.rows * KV for s in self.sessions.values())

    def evictable_bytes(self) -> int:
        return sum(s.rows * KV for k, s in self.sessions.items() if not self.pins[k])

    def release(self, nbytes: int) -> int:
        freed = 0
        for k in list(self.sessions):
            if freed >= nbytes:
                break
            if not self.pins[k]:
                freed += self.sessions.pop(k).rows * KV
                self.dropped.append(k)
        return freed


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    session_id: str | None = None
    salt: str | None = None
    n: int = 1
    plain_greedy: bool = False
    continue_from: tuple[str, int | None] | None = None


@dataclass
class Tk:
    request: Req
    cancelled: bool = False


def _limits(budget: int = 100_000, max_queue: int = 2, timeout: float = 5.0, chunk: int = 10) -> SchedulerLimits:
    return SchedulerLimits(
        budget_bytes=budget,
        kv_bytes_per_token=KV,
        prefill_chunk_tokens=chunk,
        prefill_transient_bytes_per_token=0,
        dense_decode_ceiling_bytes=10**9,
        max_queue=max_queue,
        queue_timeout_s=timeout,
        segmented=True,
    )


def _sched(store: FakeStore | None = None, **kw: float) -> Scheduler[Tk]:
    return Scheduler(_limits(**kw), weights_bytes=10_000, store=store or FakeStore())  # type: ignore[arg-type]  # FakeStore for a SnapshotStore


def _tk(rid: str, prompt: int, max_tokens: int, session: str | None = None) -> Tk:
    return Tk(Req(rid, tuple(range(prompt)), max_tokens, session))


def _sample(plan: StepPlan, *, eos: Sequence[str] = ()) -> StepOutput:
    """What a runner would return: one token for the chunk that ends a prompt and for each
    request of the decode batch."""
    rids = [*([plan.prefill.request_id] if plan.prefill and plan.prefill.last else []), *plan.decode]
    sampled = tuple(Sampled(r, 7, "x", None, eos=r in eos, stop_string=False) for r in rids)
    return StepOutput(sampled, (), plan.prefill.tokens if plan.prefill else 0)


# ---- the package boundary ----------------------------------------------------------------
def test_scheduling_imports_no_mlx() -> None:
    import subprocess

    code = "import sys, segserve.server.scheduling; sys.exit('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- admission ---------------------------------------------------------------------------
def test_fifo_admit_and_reserve() -> None:
    s = _sched()
    assert s.enqueue(_tk("a", 20, 10), 0.0) and s.enqueue(_tk("b", 20, 10), 0.0)
    plan = s.schedule(0.0)
    assert [a.request_id for a in plan.admitted] == ["a", "b"]
    assert plan.decisions == (("admit", "fits"), ("admit", "fits"))
    # A miss reuses nothing: the whole prompt + max_tokens is priced.
    assert s.reserved == {"a": 30 * KV, "b": 30 * KV}
    assert not s.waiting


def test_plain_greedy_requests_are_priced_with_their_step_scratch() -> None:
    lim = dataclasses.replace(_limits(), step_scratch_bytes=4_000, greedy_step_scratch_bytes=2_000)
    s: Scheduler[Tk] = Scheduler(lim, weights_bytes=10_000, store=FakeStore())  # type: ignore[arg-type]  # FakeStore for a SnapshotStore
    s.enqueue(Tk(Req("g", tuple(range(20)), 10, plain_greedy=True)), 0.0)
    s.enqueue(_tk("o", 20, 10), 0.0)
    s.schedule(0.0)
    assert s.reserved == {"g": 30 * KV + 2_000, "o": 30 * KV + 4_000}


def test_drafts_never_make_a_request_wait_or_be_refused() -> None:
    """A request priced with speculation (a verify window's step scratch, a draft index)
    that fits only without it starts without it; one that fits with it speculates; a
    refusal states the price without drafts."""
    lim = dataclasses.replace(_limits(), step_scratch_bytes=4_000, draft_tokens=8, draft_index_bytes_per_token=3)
    s: Scheduler[Tk] = Scheduler(lim, weights_bytes=10_000, store=FakeStore())  # type: ignore[arg-type]  # FakeStore for a SnapshotStore
    s.enqueue(_tk("spec", 20, 10), 0.0)  # 30 rows + 9 x 4_000 + 30 x 3: fits the 90_000 free
    (a,) = s.schedule(0.0).admitted
    assert a.speculate and s.reserved == {"spec": 30 * KV + 9 * 4_000 + 30 * 3}
    s.release("spec")
    s.enqueue(_tk("plain", 50, 10), 0.0)  # 96_180 with drafts, 64_000 without
    (b,) = s.schedule(0.0).admitted
    assert not b.speculate and s.reserved == {"plain": 60 * KV + 4_000}
    assert s.last_refusal is None
    s.release("plain")
    s.enqueue(_tk("big", 100, 10), 0.0)  # fits neither way
    plan = s.schedule(0.0)
    assert not plan.admitted and plan.refused[0].kind == "insufficient_memory"
    assert s.last_refusal is not None and s.last_refusal["needed"] == 110 * KV + 4_000


def test_reuse_is_capped_at_len_minus_one() -> None:
    store = FakeStore({"s": FakeSnap("s", 40)})
    s = _sched(store)
    s.enqueue(_tk("a", 40, 5, session="s"), 0.0)  # the whole prompt is stored
    (adm,) = s.schedule(0.0).admitted
    assert store.lookups == [reusable_tokens(40)] == [39]
    assert adm.hit.reused_tokens == 39


def test_a_continuation_forks_once_just_before_its_first_lookup() -> None:
    """`continue_from`: the stored turn becomes the request's own session inside the
    scheduler's decision, so the lookup that follows reuses it; a head that waits is not
    forked again when it is decided anew; a source that is gone is a plain miss."""
    store = FakeStore({"p": FakeSnap("p", 10)})
    s = _sched(store)
    s.enqueue(_tk("big", 60, 10), 0.0)  # holds most of the budget: the next head waits
    s.enqueue(Tk(Req("c", tuple(range(20)), 10, "p-next", continue_from=("p", 0))), 0.0)
    plan = s.schedule(0.0)
    assert [a.request_id for a in plan.admitted] == ["big"]
    assert store.forks == [("p", 0, "p-next")]  # forked before its (waiting) decision
    s.release("big", seconds=1.0)
    (adm,) = s.schedule(0.1).admitted
    assert store.forks == [("p", 0, "p-next")]  # decided again: not forked again
    assert store.dropped == []
    assert adm.request_id == "c" and adm.hit.kind == "session" and adm.hit.reused_tokens == 10
    s.enqueue(Tk(Req("g", tuple(range(20)), 10, "q-next", continue_from=("gone", None))), 0.2)
    (adm,) = s.schedule(0.2).admitted
    assert adm.hit.kind == "miss" and "q-next" not in store.sessions


def test_wait_until_running_finishes_and_no_redecision_meanwhile() -> None:
    s = _sched()
    s.enqueue(_tk("big", 60, 10), 0.0)  # 70k of the 90k free
    s.enqueue(_tk("x", 20, 10), 0.0)  # 30k: must wait behind
    plan = s.schedule(0.0)
    assert [a.request_id for a in plan.admitted] == ["big"]
    assert plan.decisions[-1] == ("wait", "wait_for_running")
    # Nothing was released: the head is not looked up or priced again.
    assert s.schedule(0.1).decisions == ()
    s.release("big", seconds=2.0)
    plan = s.schedule(0.2)
    assert [a.request_id for a in plan.admitted] == ["x"] and s.reserved == {"x": 30 * KV}


def test_eviction_shortfall_and_507() -> None:
    store = FakeStore({"o1": FakeSnap("o1", 40), "o2": FakeSnap("o2", 40)})
    s = _sched(store)
    s.enqueue(_tk("x", 20, 10), 0.0)  # 30k; free = 100k - 10k - 80k = 10k
    plan = s.schedule(0.0)
    assert plan.decisions == (("admit", "fits_after_eviction"),)
    assert store.dropped == ["o1"]  # 20k short: one 40k session goes
    s.enqueue(_tk("huge", 200, 10), 0.0)
    plan = s.schedule(0.0)
    (r,) = plan.refused
    assert r.kind == "insufficient_memory" and r.decision is not None
    assert s.last_refusal is not None and s.last_refusal["decision"] == "reject_insufficient_memory"


def test_admission_cannot_evict_the_history_it_reuses() -> None:
    """Tight budget: the request's own session is the only big evictable entry. Pinned
    before pricing, it is held, not evictable: admission may not drop it to make room."""
    store = FakeStore({"own": FakeSnap("own", 70), "other": FakeSnap("other", 10)})
    s = _sched(store)
    s.enqueue(_tk("r", 90, 10, session="own"), 0.0)  # reuses 70, adds 20 + 10 = 30k; free 10k
    plan = s.schedule(0.0)
    assert "own" not in store.dropped
    assert not plan.admitted  # only 10k of others could go: it cannot fit now
    assert store.pins["own"] == 0  # a request that does not start holds no pin
    # With room for the new rows alone, it starts, and its history is pinned while it runs.
    store2 = FakeStore({"own": FakeSnap("own", 50), "other": FakeSnap("other", 30)})
    s2 = _sched(store2)
    s2.enqueue(_tk("r", 70, 10, session="own"), 0.0)  # adds 30k; free 10k; other frees 30k
    (adm,) = s2.schedule(0.0).admitted
    assert adm.hit.reused_tokens == 50 and store2.dropped == ["other"]
    assert store2.pins["own"] == 1
    s2.release("r")
    assert store2.pins["own"] == 0


def test_queue_bound() -> None:
    s = _sched(max_queue=2)
    assert all(s.enqueue(_tk(str(i), 1, 1), 0.0) for i in range(3))  # head + 2 waiting
    assert not s.enqueue(_tk("late", 1, 1), 0.0)
    assert s.last_refusal == {"decision": "reject_queue_full", "reason": "queue_full"}
    assert s.retry_after() >= 1


def test_no_waiting_allowed_refuses_instead_of_waiting() -> None:
    s = _sched(max_queue=0)
    s.enqueue(_tk("big", 60, 10), 0.0)
    s.schedule(0.0)
    assert s.enqueue(_tk("x", 20, 10), 0.0)  # the head itself is always taken
    (r,) = s.schedule(0.0).refused
    assert r.kind == "queue_full" and r.request_id == "x"


def test_timeouts_leave_the_rest_in_order() -> None:
    s = _sched(timeout=5.0)
    s.reserved["running"] = 80_000  # held by a running request: everyone waits
    s.enqueue(_tk("old", 20, 10), 0.0)
    s.enqueue(_tk("new", 20, 10), 4.0)
    plan = s.schedule(6.0)
    assert [(r.request_id, r.kind) for r in plan.refused if r.kind == "timeout"] == [("old", "timeout")]
    assert [w.request_id for w in s.waiting] == ["new"]


def test_lookup_failure_fails_that_request_alone() -> None:
    class Broken(FakeStore):
        def lookup(self, tokens: Sequence[int], **kw: object) -> FakeHit:
            if len(tokens) == 3:
                raise RuntimeError("injected")
            return super().lookup(tokens, **kw)  # type: ignore[arg-type]  # passes the keywords through

    s = _sched(Broken())
    s.enqueue(_tk("bad", 3, 1), 0.0)
    s.enqueue(_tk("good", 4, 1), 0.0)
    plan = s.schedule(0.0)
    assert [f.request_id for f in plan.admit_failed] == ["bad"]
    assert [a.request_id for a in plan.admitted] == ["good"]


# ---- step composition and fairness -------------------------------------------------------
def test_step_is_one_prefill_chunk_plus_every_decoder() -> None:
    s = _sched(chunk=10, budget=10**9)
    s.enqueue(_tk("a", 25, 3), 0.0)
    plan = s.schedule(0.0)
    assert plan.prefill is not None and (plan.prefill.start, plan.prefill.tokens, plan.prefill.last) == (0, 10, False)
    s.update_from_output(plan, _sample(plan))
    plan = s.schedule(0.0)
    assert plan.prefill is not None and (plan.prefill.start, plan.prefill.tokens) == (10, 10)
    s.update_from_output(plan, _sample(plan))
    plan = s.schedule(0.0)
    assert plan.prefill is not None and (plan.prefill.tokens, plan.prefill.last) == (5, True)
    assert plan.decode == ()  # its first token is sampled by the chunk that ends the prompt
    upd = s.update_from_output(plan, _sample(plan))
    assert upd.finished == ()
    plan = s.schedule(0.0)
    assert plan.prefill is None and plan.decode == ("a",)


def _chunk_order(s: Scheduler[Tk], prompts: list[tuple[str, int]], steps: int,
                 arrivals: dict[int, tuple[str, int]] | None = None) -> tuple[list[str], int]:
    """Which request each step's prefill chunk served (chunk 10) and how many steps the
    decoder "d" (a 5-token prompt first in line, 100 tokens to go) moved; `arrivals`:
    a prompt enqueued before that step."""
    s.enqueue(_tk("d", 5, 100), 0.0)
    for rid, n in prompts:
        s.enqueue(_tk(rid, n, 1), 0.0)
    chunks: list[str] = []
    decoded = 0
    for step in range(steps):
        if arrivals and step in arrivals:
            s.enqueue(_tk(*arrivals[step], 1), 0.0)
        plan = s.schedule(0.0)
        if plan.prefill is not None:
            chunks.append(plan.prefill.request_id)
        decoded += plan.decode.count("d")
        s.update_from_output(plan, _sample(plan))
    return chunks, decoded


def test_prefill_round_robin_takes_turns_and_decoders_move_every_step() -> None:
    s = _sched(chunk=10, budget=10**9, max_queue=8)
    s.prefill_order = "round-robin"
    chunks, decoded = _chunk_order(s, [("p1", 40), ("p2", 40)], 9)
    # One chunk per step, the prompts taking turns; the decoder moved on every later step.
    assert chunks == ["d", "p1", "p2", "p1", "p2", "p1", "p2", "p1", "p2"]
    assert decoded == 8


def test_prefill_shortest_first_ends_a_burst_one_prompt_after_another() -> None:
    """Equal prompts: the first one in line runs to its end, then the next (round robin
    would end them all together, at the last step); the decoder moves every step."""
    chunks, decoded = _chunk_order(_sched(chunk=10, budget=10**9, max_queue=8), [("p1", 20), ("p2", 20), ("p3", 20)], 7)
    assert chunks == ["d", "p1", "p1", "p2", "p2", "p3", "p3"]
    assert decoded == 6


def test_prefill_shortest_first_lets_a_short_prompt_pass_and_the_oldest_keep_a_share() -> None:
    """A long prompt in line, short ones arriving: each short one goes first (it has the
    fewest tokens left), but every 4th chunk still goes to the oldest prompt."""
    arrivals = {3: ("s1", 10), 4: ("s2", 10), 5: ("s3", 10), 6: ("s4", 10), 7: ("s5", 10)}
    chunks, _ = _chunk_order(_sched(chunk=10, budget=10**9, max_queue=8), [("long", 100)], 10, arrivals)
    # Chunks 4 and 8 are the oldest's; the others go to the fewest tokens left, the
    # earlier admitted of equals.
    assert chunks == ["d", "long", "long", "long", "s1", "s2", "s3", "long", "s4", "s5"]


def test_an_unknown_prefill_order_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_order"):
        Scheduler(_limits(), weights_bytes=10_000, store=FakeStore(), prefill_order="lifo")  # type: ignore[arg-type]  # FakeStore for a SnapshotStore


def test_update_finishes_on_eos_and_exactly_at_max_tokens() -> None:
    s = _sched(chunk=100, budget=10**9)
    s.enqueue(_tk("len", 5, 3), 0.0)
    s.enqueue(_tk("eos", 5, 50), 0.0)
    finished: dict[str, tuple[str, int]] = {}
    for step in range(6):
        plan = s.schedule(0.0)
        upd = s.update_from_output(plan, _sample(plan, eos=["eos"] if step == 2 else []))
        for f in upd.finished:
            r = s.get(f.request_id)
            assert r is not None
            finished[f.request_id] = (f.reason, r.generated)
            s.release(f.request_id)
    assert finished == {"len": ("length", 3), "eos": ("stop", 2)}
    assert s.reserved == {} and not s.running


def test_cancelled_requests_are_planned_out() -> None:
    s = _sched(budget=10**9)
    t = _tk("a", 30, 5)
    s.enqueue(t, 0.0)
    s.schedule(0.0)
    t.cancelled = True
    plan = s.schedule(0.0)
    assert plan.cancelled == ("a",) and plan.prefill is None and plan.decode == ()


def test_store_turn_only_when_it_grew() -> None:
    store = FakeStore({"s": FakeSnap("s", 10)})
    s = _sched(store, budget=10**9)
    s.enqueue(_tk("a", 20, 5, session="s"), 0.0)
    s.schedule(0.0)
    assert s.store_turn("a", FakeSnap("x", 10), "s", None) == "s"  # type: ignore[arg-type]  # a FakeSnap for a Snapshot
    assert store.puts == []
    assert s.store_turn("a", FakeSnap("x", 25), "s", None) == "s"  # type: ignore[arg-type]  # a FakeSnap for a Snapshot
    assert store.puts == [("s", 25)]


# ---- the guard ---------------------------------------------------------------------------
def test_guard() -> None:
    store = FakeStore({"idle": FakeSnap("idle", 5)})
    s = _sched(store, budget=100_000)
    s.reserved.update({"a": 10_000, "b": 10_000})
    assert s.guard(90_000, {"a": 50_000, "b": 5_000}).interventions == ()
    out = s.guard(120_000, {"a": 50_000, "b": 5_000})  # 20k over; the bank frees 5k only
    assert out.end_request == "a"
    assert [r for r, _ in out.interventions] == ["shed_bank", "request_outgrew_price"]
    out = s.guard(120_000, {"a": 5_000, "b": 5_000})  # nobody past its price, nothing to shed
    assert out.end_request is None and [r for r, _ in out.interventions] == []  # reported once
    assert s.guard(1, {}).interventions == ()
    out = s.guard(120_000, {})
    assert [r for r, _ in out.interventions] == ["over_budget_unresolved"]


def test_mean_request_time_moves_retry_after() -> None:
    s = _sched(budget=10**9)
    s.enqueue(_tk("r", 1, 1), 0.0)
    s.schedule(0.0)
    before = s.mean_request_s
    s.release("r", seconds=100.0)
    assert s.mean_request_s > before


@pytest.mark.parametrize("n", [1, 2, 100])
def test_reusable_tokens(n: int) -> None:
    assert reusable_tokens(n) == n - 1


def test_decide_prices_against_reservations() -> None:
    s = _sched()
    s.reserved["r"] = 80_000
    assert s.decide(RequestCost(new_prompt_tokens=20, max_tokens=10)).decision == "wait"


def test_a_cancelled_waiter_is_dropped_at_the_head_holding_nothing() -> None:
    store = FakeStore({"s": FakeSnap("s", 10)})
    s = _sched(store)
    s.reserved["running"] = 80_000  # everyone waits
    t = _tk("gone", 20, 10, session="s")
    s.enqueue(t, 0.0)
    s.enqueue(_tk("next", 20, 10), 0.0)
    assert s.schedule(0.0).decisions == (("wait", "wait_for_running"),)
    t.cancelled = True
    plan = s.schedule(0.1)
    assert plan.dropped == ("gone",) and [w.request_id for w in s.waiting] == ["next"]
    assert store.pins["s"] == 0
