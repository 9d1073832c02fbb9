"""The scheduler: queue, lookup and pin, admission, reservations, step plans, memory guard.

Owns: `Scheduler`, `Waiting`, `Running`, `GuardOutcome`, `request_cost`. Plain numbers and
the store protocol only (no MLX, no model): the engine thread asks `schedule()` for a
`StepPlan`, has the runner execute it, and hands the output back to `update_from_output`
(the shape of vLLM v1's `schedule()` / `update_from_output` and nano-vllm's step).

Policy:
- FIFO: only the head of the queue is decided, so a large request is not starved by small
  ones behind it. A head that must wait blocks the queue (it would fit once running
  requests finish, so holding the line is what lets it run). A head told to wait is not
  decided again until something was released (`note_change`).
- Deciding a head is (fork) -> lookup -> pin -> price -> evict -> reserve; the fork runs
  once, for a request that continues a stored turn (`continue_from`). The pin comes before the
  price by construction, so the request's own history is protected (never counted as
  evictable) when the shortfall is evicted. A head that waits or is refused is unpinned.
- Each admitted request reserves its price (`segserve.server.scheduling.admission.price`) until it
  is released; the reservations are what "running" holds when the next head is priced.
- A wait longer than `queue_timeout_s` ends with 503 + Retry-After; a request that would
  wait while the queue is full gets 429 + Retry-After; 507 only when the request cannot fit
  even with every evictable byte gone and nothing running (admission decides).
- Choices (`n` > 1): admitted and priced as one prompt plus `n` tails (`request_cost`);
  once the prompt ends every choice decodes in the same step, each ends on its own
  (`Finished.choice`), and the request is released when its last choice ended.
- Step composition: one prefill chunk (`prefill_chunk_tokens`) plus one decode token for
  every request that decodes, so a long prompt never starves the streams of others and
  every decoding request moves every step. Which prompt gets the chunk (`prefill_order`):
  "shortest" (default), the running request with the fewest prompt tokens left (ties: the
  earliest admitted), except that every `OLDEST_EVERY`-th chunk goes to the earliest
  admitted prompt, so a long prompt keeps at least that share under a stream of short
  ones. Why: prompts taking turns chunk by chunk (the "round-robin" order) made every
  prompt of a burst wait for nearly all the others; shortest-first ends them one after
  another (a burst of equal prompts: the order they came in), the least mean time to
  first token, and a short prompt never waits behind a long one.
- The guard compares real usage with the budget after every step; over budget it sheds
  bank entries first, then ends the request that outgrew its price the most.

Threads: engine thread only. Invariants: `reserved` has exactly the running requests'
ids; every running request holds one pin on the snapshot it reuses until `release`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from segserve.kv.merge_policy import rows_copied_by_seals
from segserve.server.scheduling.admission import (
    AdmissionDecision,
    MemoryState,
    RequestCost,
    SchedulerLimits,
    decide,
    queue_has_room,
    retry_after_seconds,
)
from segserve.server.scheduling.plan import (
    AdmitFailed,
    Admitted,
    Finished,
    FinishReason,
    PrefillChunk,
    Refused,
    StepOutput,
    StepPlan,
    StepUpdate,
)
from segserve.server.scheduling.store import LookupHit, SnapshotStore, reusable_tokens

if TYPE_CHECKING:
    from segserve.kv.segment import Snapshot


class RequestSpec(Protocol):
    """What the scheduler reads of a request (`segserve.server.engine.GenerationRequest` fits)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt(self) -> tuple[int, ...]: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def salt(self) -> str | None: ...
    @property
    def n(self) -> int: ...  # choices: decode rows over one prefilled prompt
    @property
    def plain_greedy(self) -> bool: ...  # prices the smaller step scratch (admission)
    @property
    def continue_from(self) -> tuple[str, int | None] | None: ...  # (session, turn) to fork


class Ticket(Protocol):
    """What the scheduler queues (`segserve.server.engine.RequestHandle` fits)."""

    @property
    def request(self) -> RequestSpec: ...
    @property
    def cancelled(self) -> bool: ...


T = TypeVar("T", bound=Ticket)


PREFILL_ORDERS = ("shortest", "round-robin")
OLDEST_EVERY = 4  # "shortest" order: this share of the chunks goes to the oldest prompt


@dataclass(eq=False)
class Waiting(Generic[T]):
    item: T
    request_id: str
    enqueued_at: float
    continued: bool = False  # its `continue_from` fork was made (once, at its first lookup)


@dataclass(eq=False)
class Running(Generic[T]):
    item: T
    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached: int  # prompt tokens reused from the store
    pinned: Snapshot
    prefilled: int  # prompt tokens in the cache (reused ones included)
    generated: int = 0  # tokens sampled, every choice together
    n: int = 1  # choices
    per_choice: list[int] = field(init=False)  # tokens sampled by each choice
    ended: set[int] = field(default_factory=set)  # choices that finished

    def __post_init__(self) -> None:
        self.per_choice = [0] * self.n

    @property
    def pending(self) -> int:
        return self.prompt_tokens - self.prefilled

    @property
    def decoding(self) -> bool:
        return self.pending == 0 and self.generated > 0 and len(self.ended) < self.n

    @property
    def live_generated(self) -> int:
        """Generated rows of the choices still running (the tails not sealed or dropped)."""
        return sum(g for i, g in enumerate(self.per_choice) if i not in self.ended)


@dataclass(frozen=True, slots=True)
class GuardOutcome:
    """What the guard did (`interventions`: (reason, detail)) and whom to end, if anyone."""

    interventions: tuple[tuple[str, str], ...] = ()
    end_request: str | None = None


def request_cost(
    prompt_tokens: int, max_tokens: int, hit: LookupHit, n: int = 1, plain_greedy: bool = False
) -> RequestCost:
    """Token counts of one turn after lookup. The bank may restore whole segments of which
    only a prefix is reused: the restore is priced in full, the history held already is
    what remains (never negative). The turn seals twice (end of prompt, end of
    generation); the price includes what those seals make the tiered merge copy. With `n`
    choices only choice 0's generation is sealed (it is the turn that is stored); the
    others' tails are dropped when they end."""
    new_prompt = prompt_tokens - hit.reused_tokens
    segs = hit.snapshot.segments
    merge_rows = rows_copied_by_seals(
        [s.level for s in segs], [s.rows for s in segs], [new_prompt, max_tokens]
    )
    return RequestCost(
        new_prompt_tokens=new_prompt,
        max_tokens=max_tokens,
        history_tokens=max(0, hit.reused_tokens - hit.restore_rows_from_ssd),
        restore_from_ssd_tokens=hit.restore_rows_from_ssd,
        merge_rows=merge_rows,
        choices=n,
        history_segments=len(segs),
        plain_greedy=plain_greedy,
    )


@dataclass(eq=False)
class Scheduler(Generic[T]):
    limits: SchedulerLimits
    weights_bytes: int
    store: SnapshotStore
    waiting: deque[Waiting[T]] = field(default_factory=deque)
    running: list[Running[T]] = field(default_factory=list)
    reserved: dict[str, int] = field(default_factory=dict)
    mean_request_s: float = 5.0
    prefill_order: str = "shortest"  # or "round-robin" (the module docstring says why)
    last_refusal: dict[str, object] | None = None
    _chunks: int = 0  # prefill chunks planned so far (every OLDEST_EVERY-th: the oldest prompt)
    _changes: int = 0  # bumps when memory is released: a waiting head is decided again
    _decided: tuple[str, int] | None = None
    _guard_episode: bool = False

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, not {self.prefill_order!r}")

    # ---- queue -----------------------------------------------------------------------
    def enqueue(self, item: T, now: float) -> bool:
        """False when the queue is full (the caller answers 429 with `retry_after()`).
        The head is decided at once, so `max_queue` counts the requests behind it."""
        if not queue_has_room(len(self.waiting) - 1, self.limits):
            self.last_refusal = {"decision": "reject_queue_full", "reason": "queue_full"}
            return False
        self.waiting.append(Waiting(item, item.request.request_id, now))
        return True

    def drop_waiting(self) -> list[T]:
        """Empty the queue (shutdown or a failing engine); returns what was waiting."""
        out = [w.item for w in self.waiting]
        self.waiting.clear()
        self._decided = None
        return out

    def retry_after(self) -> float:
        return retry_after_seconds(
            queued_requests=len(self.waiting),
            running_requests=len(self.reserved),
            mean_request_s=self.mean_request_s,
        )

    def note_change(self) -> None:
        """Memory may have been released outside a request (e.g. a session DELETE)."""
        self._changes += 1

    # ---- schedule --------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """The next step: expire and admit waiters, then choose the prefill chunk and the
        decode batch among the running requests."""
        refused = self._expire(now)
        dropped = self._drop_cancelled_head()
        admitted, admit_refused, failed, lookups, decisions = self._admit_waiting(now)
        cancelled = tuple(r.request_id for r in self.running if r.item.cancelled)
        live = [r for r in self.running if not r.item.cancelled]
        prefill = self._next_prefill(live)
        decode = tuple(
            r.request_id for r in live
            if r.decoding and (prefill is None or r.request_id != prefill.request_id)
        )
        return StepPlan(
            admitted=admitted,
            refused=refused + admit_refused,
            admit_failed=failed,
            cancelled=cancelled,
            dropped=dropped,
            prefill=prefill,
            decode=decode,
            lookups=lookups,
            decisions=decisions,
        )

    def _expire(self, now: float) -> tuple[Refused, ...]:
        """Every waiter older than the queue timeout leaves (503 + Retry-After)."""
        old = [w for w in self.waiting if now - w.enqueued_at > self.limits.queue_timeout_s]
        if not old:
            return ()
        self.waiting = deque(w for w in self.waiting if w not in old)
        after = self.retry_after()  # what the ones still waiting make the next one wait
        return tuple(Refused(w.request_id, "timeout", after) for w in old)

    def _drop_cancelled_head(self) -> tuple[str, ...]:
        """Waiters whose client went away leave once they reach the head (they hold nothing;
        one further back waits its turn or its timeout)."""
        out: list[str] = []
        while self.waiting and self.waiting[0].item.cancelled:
            out.append(self.waiting.popleft().request_id)
        return tuple(out)

    def _admit_waiting(
        self, now: float
    ) -> tuple[
        tuple[Admitted, ...], tuple[Refused, ...], tuple[AdmitFailed, ...],
        tuple[str, ...], tuple[tuple[str, str], ...],
    ]:
        """FIFO: decide for the head until one has to wait."""
        admitted: list[Admitted] = []
        refused: list[Refused] = []
        failed: list[AdmitFailed] = []
        lookups: list[str] = []
        decisions: list[tuple[str, str]] = []
        while self.waiting:
            w = self.waiting[0]
            if w.item.cancelled:
                break  # dropped at the start of the next step
            if self._decided == (w.request_id, self._changes):
                break  # nothing was released since this head was told to wait
            self._decided = (w.request_id, self._changes)
            try:
                self._continue(w)
                hit, d, speculate = self._decide(w.item.request, lookups)
            except Exception as exc:  # a bug in lookup or pricing fails this request only
                self.waiting.popleft()
                failed.append(AdmitFailed(w.request_id, exc))
                continue
            decisions.append((d.decision, d.reason))
            if d.decision == "wait":
                break
            self.waiting.popleft()
            if d.decision == "admit":
                try:
                    admitted.append(self._start(w, hit, d, now, speculate))
                except Exception as exc:  # eviction raised: nothing is held
                    failed.append(AdmitFailed(w.request_id, exc))
            else:
                refused.append(Refused(
                    w.request_id,
                    "insufficient_memory" if d.decision == "reject_insufficient_memory" else "queue_full",
                    self.retry_after(), d,
                ))
        return tuple(admitted), tuple(refused), tuple(failed), tuple(lookups), tuple(decisions)

    def _continue(self, w: Waiting[T]) -> None:
        """A request continuing a stored turn (`continue_from`, e.g. a Responses
        `previous_response_id`) gets that turn forked into its own session just before its
        first lookup, which then finds it: continuation is part of the lookup, not a trip of
        its own. A source that is gone leaves the request to prefill its history from text."""
        req = w.item.request
        if w.continued or req.continue_from is None or req.session_id is None:
            return
        w.continued = True
        source, turn = req.continue_from
        self.store.continue_session(source, turn, salt=req.salt, new_id=req.session_id)

    def _decide(self, req: RequestSpec, lookups: list[str]) -> tuple[LookupHit, AdmissionDecision, bool]:
        """Lookup -> pin -> price. The pin protects the history this request reuses, so the
        bank numbers the price sees count it as held, not as evictable. A head that does
        not start here is unpinned again. The flag: the request may verify drafts. Drafts
        are a speed-up, never a reason to wait or refuse: a request that fits only without
        their price (a verify window's scratch, a draft index) starts without them."""
        hit = self.store.lookup(
            req.prompt, session_id=req.session_id, salt=req.salt,
            max_reuse=reusable_tokens(len(req.prompt)),
        )
        lookups.append(hit.kind)
        self.store.pin(hit.snapshot)
        try:
            cost = request_cost(len(req.prompt), req.max_tokens, hit, req.n, req.plain_greedy)
            d = self.decide(cost)
            speculate = bool(self.limits.draft_tokens)
            if d.decision != "admit" and speculate:
                plain = self.decide(replace(cost, speculate=False))
                # A refusal states what the request needs at least: its price without drafts.
                if plain.decision == "admit" or d.decision != "wait":
                    d, speculate = plain, False
            if d.decision not in ("admit", "wait"):
                self.last_refusal = {"decision": d.decision, "reason": d.reason, "needed": d.price_bytes}
        except BaseException:
            self.store.unpin(hit.snapshot)
            raise
        if d.decision != "admit":
            self.store.unpin(hit.snapshot)
        return hit, d, speculate

    def decide(self, cost: RequestCost) -> AdmissionDecision:
        """Price `cost` against what is held now (the head is not counted as queued: the
        bound was enforced by `enqueue`). Records nothing: `_decide` keeps the refusal it
        acts on as `last_refusal`."""
        ram = self.store.ram_bytes()
        state = MemoryState(
            weights_bytes=self.weights_bytes,
            active_bytes=sum(self.reserved.values()),
            bank_ram_bytes=ram,
            bank_evictable_bytes=min(self.store.evictable_bytes(), ram),
            running_requests=len(self.reserved),
            queued_requests=0,
        )
        return decide(cost, self.limits, state, mean_request_s=self.mean_request_s)

    def _start(self, w: Waiting[T], hit: LookupHit, d: AdmissionDecision, now: float,
               speculate: bool = True) -> Admitted:
        try:
            if d.evict_bytes > 0:
                self.store.release(d.evict_bytes)
        except BaseException:
            self.store.unpin(hit.snapshot)
            raise
        req = w.item.request
        self.reserved[w.request_id] = d.price_bytes
        self.running.append(Running(
            w.item, w.request_id, len(req.prompt), req.max_tokens, hit.reused_tokens,
            hit.snapshot, prefilled=hit.reused_tokens, n=req.n,
        ))
        return Admitted(w.request_id, hit, now - w.enqueued_at, speculate)

    def _next_prefill(self, live: list[Running[T]]) -> PrefillChunk | None:
        pending = [r for r in live if r.pending > 0]  # admission order (`running` is)
        if not pending:
            return None
        self._chunks += 1
        if self.prefill_order == "round-robin":
            r = pending[0]
            self.running.remove(r)
            self.running.append(r)  # the next step serves the next prompt
        elif self._chunks % OLDEST_EVERY == 0:
            r = pending[0]
        else:
            r = min(pending, key=lambda p: p.pending)  # the first of equals: the oldest
        n = min(self.limits.prefill_chunk_tokens, r.pending)
        return PrefillChunk(r.request_id, r.prefilled, n, last=n == r.pending)

    # ---- update ----------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, out: StepOutput) -> StepUpdate:
        """Advance the running requests by what the runner did; say who finished.
        Failed requests are left to the caller (`release` them after storing)."""
        failed = {f.request_id for f in out.failed}
        by_id = {r.request_id: r for r in self.running}
        chunk = plan.prefill
        if chunk is not None and chunk.request_id not in failed and chunk.request_id in by_id:
            by_id[chunk.request_id].prefilled += chunk.tokens
        finished: list[Finished] = []
        for s in out.sampled:
            r = by_id.get(s.request_id)
            if r is None or s.request_id in failed or s.choice in r.ended:
                continue
            r.generated += 1
            r.per_choice[s.choice] += 1
            reason: FinishReason
            if s.eos or s.stop_string or s.grammar_done:
                reason = "stop"
            elif r.per_choice[s.choice] >= r.max_tokens:
                reason = "length"
            else:
                continue
            r.ended.add(s.choice)
            finished.append(Finished(s.request_id, reason, s.choice, last=len(r.ended) == r.n))
        return StepUpdate(tuple(finished))

    def get(self, request_id: str) -> Running[T] | None:
        return next((r for r in self.running if r.request_id == request_id), None)

    def store_turn(self, request_id: str, snapshot: Snapshot | None, session_id: str | None,
                   salt: str | None) -> str | None:
        """The turn's snapshot goes to the store once, when the request ends, if it grew
        past what was pinned; returns the session id (a new one for a new session)."""
        r = self.get(request_id)
        if r is not None and snapshot is not None and snapshot.rows > r.pinned.rows:
            return self.store.put(session_id, snapshot, salt=salt)
        return session_id

    def release(self, request_id: str, seconds: float | None = None) -> None:
        """The request leaves: its pin and reservation are dropped (the reservation even when
        the unpin raises). Releasing twice is a no-op."""
        r = self.get(request_id)
        if r is None:
            return
        self.running.remove(r)
        self._changes += 1
        try:
            self.store.unpin(r.pinned)
        finally:
            self.reserved.pop(request_id, None)
            if seconds is not None:
                # An exponential average: Retry-After hints follow the recent request length.
                self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * seconds

    # ---- memory guard ----------------------------------------------------------------
    def guard(self, in_use_bytes: int, usage_by_request: dict[str, int]) -> GuardOutcome:
        """Real usage vs the budget after a step (a pricing bug or a leak): shed idle bank
        entries first; if that is not enough, end the request that outgrew its price the
        most; with nothing to shed and nobody past its price, report once per episode."""
        over = in_use_bytes - self.limits.budget_bytes
        if over <= 0:
            self._guard_episode = False
            return GuardOutcome()
        worst, excess = None, 0
        for rid, used in usage_by_request.items():
            e = used - self.reserved.get(rid, 0)
            if e > excess:
                worst, excess = rid, e
        out: list[tuple[str, str]] = []
        freed = self.store.release(over)
        if freed > 0:
            out.append(("shed_bank", f"freed {freed} bytes of idle sessions"))
        end = None
        if worst is not None and freed < over:
            end = worst
            out.append(("request_outgrew_price", f"ended {worst}"))
        elif freed == 0 and not self._guard_episode:
            out.append(("over_budget_unresolved", f"{over} bytes over budget"))
        self._guard_episode = True
        return GuardOutcome(tuple(out), end)
