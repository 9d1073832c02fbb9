"""The scheduler: a bounded FIFO wait queue, memory reservations, and the memory guard.

Owns: `Scheduler`, `Waiting`, `BankNumbers`, `GuardAction`. Plain numbers only (no MLX, no
model): the engine thread asks it what to do and carries the answer out, nano-vllm style
(`plan = schedule()` → run → `finish()`).

Policy:
- FIFO: only the head of the queue is decided, so a large request is not starved by small
  ones behind it. A head that must wait blocks the queue (it would fit once running
  requests finish, so holding the line is what lets it run).
- Each admitted request reserves its price (`server.admission.price`) until it finishes;
  the reservation is what "running" holds when the next request is priced.
- A wait longer than `queue_timeout_s` ends with 503 + Retry-After; a request that would
  have to wait while the queue is full gets 429 + Retry-After; 507 only when the request
  cannot fit even with every evictable byte gone and nothing running (admission decides).
- The guard compares real usage (what MLX reports) with the budget after every step; over
  budget it sheds bank entries first, then ends the request that outgrew its price the
  most. Every intervention is counted with its reason.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from server.admission import (
    AdmissionDecision,
    MemoryState,
    RequestCost,
    SchedulerLimits,
    decide,
    retry_after_seconds,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BankNumbers:
    ram_bytes: int
    evictable_bytes: int


@dataclass(eq=False)
class Waiting(Generic[T]):
    item: T
    request_id: str
    enqueued_at: float


@dataclass(frozen=True, slots=True)
class GuardAction:
    kind: Literal["none", "shed_bank", "end_request"]
    reason: str
    bytes_over: int = 0
    request_id: str | None = None


@dataclass
class Scheduler(Generic[T]):
    limits: SchedulerLimits
    weights_bytes: int
    waiting: deque[Waiting[T]] = field(default_factory=deque)
    reserved: dict[str, int] = field(default_factory=dict)
    mean_request_s: float = 5.0
    last_refusal: dict[str, object] | None = None

    def enqueue(self, item: T, request_id: str, now: float) -> bool:
        """False when the queue is full (the caller answers 429 with `retry_after()`)."""
        if len(self.waiting) >= max(1, self.limits.max_queue + 1):
            self.last_refusal = {"decision": "reject_queue_full", "reason": "queue_full"}
            return False
        self.waiting.append(Waiting(item, request_id, now))
        return True

    def head(self) -> Waiting[T] | None:
        return self.waiting[0] if self.waiting else None

    def decide_head(self, cost: RequestCost, bank: BankNumbers) -> AdmissionDecision:
        """Decide for the head of the queue (it is not counted as queued itself)."""
        state = MemoryState(
            weights_bytes=self.weights_bytes,
            active_bytes=sum(self.reserved.values()),
            bank_ram_bytes=bank.ram_bytes,
            bank_evictable_bytes=min(bank.evictable_bytes, bank.ram_bytes),
            running_requests=len(self.reserved),
            # The head is already queued: the bound is enforced by `enqueue`.
            queued_requests=0,
        )
        d = decide(cost, self.limits, state, mean_request_s=self.mean_request_s)
        if d.decision not in ("admit", "wait"):
            self.last_refusal = {"decision": d.decision, "reason": d.reason, "needed": d.price_bytes}
        return d

    def admit_head(self, price_bytes: int) -> Waiting[T]:
        w = self.waiting.popleft()
        self.reserved[w.request_id] = price_bytes
        return w

    def drop_head(self) -> Waiting[T]:
        return self.waiting.popleft()

    def timed_out(self, now: float) -> list[Waiting[T]]:
        """Remove and return every waiter older than the queue timeout."""
        keep: deque[Waiting[T]] = deque()
        out: list[Waiting[T]] = []
        for w in self.waiting:
            (out if now - w.enqueued_at > self.limits.queue_timeout_s else keep).append(w)
        self.waiting = keep
        return out

    def retry_after(self) -> float:
        return retry_after_seconds(
            queued_requests=len(self.waiting),
            running_requests=len(self.reserved),
            mean_request_s=self.mean_request_s,
        )

    def finish(self, request_id: str, seconds: float | None = None) -> None:
        self.reserved.pop(request_id, None)
        if seconds is not None:
            # An exponential average: Retry-After hints follow the recent request length.
            self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * seconds

    def guard(self, in_use_bytes: int, usage_by_request: dict[str, int]) -> GuardAction:
        """What to do when real usage passes the budget (a pricing bug or a leak)."""
        over = in_use_bytes - self.limits.budget_bytes
        if over <= 0:
            return GuardAction("none", "within_budget")
        worst, excess = None, 0
        for rid, used in usage_by_request.items():
            e = used - self.reserved.get(rid, 0)
            if e > excess:
                worst, excess = rid, e
        if worst is None:
            return GuardAction("shed_bank", "over_budget", over)
        return GuardAction("end_request", "request_outgrew_price", over, worst)

