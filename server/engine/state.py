"""What the engine publishes about itself: one immutable `EngineState` per step.

Owns: `EngineState` and its parts (`MemoryFigures`, `AdmissionFigures`) and `read_state`,
which the engine thread calls after each step and after each session-API call. Everything
in it is read ON the engine thread (the scheduler, the store and MLX's memory counters are
engine-thread only), so `/health` and `/metrics` on the event loop read a finished value
and never touch MLX or the bank themselves.

Invariant: a request's `Done` is emitted after the state it leaves is published, so a
client that reads `/health` right after its last byte sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """Bytes. `active`/`cache` are MLX's counters at publish time; `peak` the largest MLX
    memory in use since start; `bank` the bank's RAM tier."""

    active: int
    peak: int
    cache: int
    weights: int
    budget: int
    bank: int

    def as_dict(self) -> dict[str, int]:
        return {"active": self.active, "peak": self.peak, "cache": self.cache,
                "weights": self.weights, "budget": self.budget, "bank": self.bank}


@dataclass(frozen=True, slots=True)
class AdmissionFigures:
    budget_bytes: int
    reserved_bytes: int
    in_use_bytes: int
    running: int
    queue_length: int
    max_queue: int
    last_refusal: Mapping[str, object] | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes, "reserved_bytes": self.reserved_bytes,
            "in_use_bytes": self.in_use_bytes, "running": self.running,
            "queue_length": self.queue_length, "max_queue": self.max_queue,
            "last_refusal": dict(self.last_refusal) if self.last_refusal is not None else None,
        }


@dataclass(frozen=True, slots=True)
class EngineState:
    """The engine as of its last step. `alive`/`error` are the thread's (read when asked,
    by `EngineClient.state`): a dead thread publishes nothing more."""

    running: int
    waiting: int
    kv: Mapping[str, Any]  # seals, merges, spec, live_segments, bytes, rows
    bank: Mapping[str, Any]  # the store's stats (empty without a bank)
    memory: MemoryFigures
    admission: AdmissionFigures
    alive: bool = True
    error: str | None = None
    warming: bool = False  # the start-up warm-up still runs (requests queue; not ready)
    warm_up: Mapping[str, Any] | None = None  # what it ran and for how long, once done
    published_at: float = 0.0  # time.monotonic() on the engine thread


class _Limits(Protocol):
    @property
    def budget_bytes(self) -> int: ...
    @property
    def max_queue(self) -> int: ...


class _Scheduler(Protocol):
    """What `read_state` reads of `segserve.server.scheduling.Scheduler`."""

    @property
    def limits(self) -> _Limits: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def reserved(self) -> Mapping[str, int]: ...
    @property
    def last_refusal(self) -> Mapping[str, object] | None: ...
    @property
    def running(self) -> Any: ...
    @property
    def waiting(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class MemoryReadings:
    """How the engine thread reads memory (MLX's counters in the server; fakes in tests)."""

    active: Callable[[], int]
    peak: Callable[[], int]
    cache: Callable[[], int]


def read_state(
    scheduler: _Scheduler,
    kv: Mapping[str, Any],
    bank: Mapping[str, Any],
    bank_ram_bytes: int,
    memory: MemoryReadings,
    now: float,
) -> EngineState:
    """The state to publish. Engine thread only."""
    active = int(memory.active())
    limits = scheduler.limits
    return EngineState(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        # Read-only views: the engine replaces these dicts whole, never edits one it published.
        kv=MappingProxyType(kv) if isinstance(kv, dict) else kv,
        bank=MappingProxyType(bank) if isinstance(bank, dict) else bank,
        memory=MemoryFigures(
            active=active, peak=int(memory.peak()), cache=int(memory.cache()),
            weights=scheduler.weights_bytes, budget=limits.budget_bytes, bank=bank_ram_bytes,
        ),
        admission=AdmissionFigures(
            budget_bytes=limits.budget_bytes,
            reserved_bytes=sum(scheduler.reserved.values()),
            in_use_bytes=active,
            running=len(scheduler.reserved),
            queue_length=len(scheduler.waiting),
            max_queue=limits.max_queue,
            last_refusal=scheduler.last_refusal,
        ),
        published_at=now,
    )
