"""Scheduling: what runs next, and whether memory allows it. Model-free, plain numbers.

Owns: the wait queue, lookup and pin, admission pricing (`price`, `decide`), eviction
requests to the store, reservations, the choice of prefill chunk and decode batch (the
typed `StepPlan`), `update_from_output`, the memory guard, and the default memory budget
(sizes are parsed by `segserve.config.sizes`, re-exported here).
May import: `segserve.kv.merge_policy` and `segserve.config.sizes` (pure), the standard library;
`segserve.kv.segment` for types only.
Never imports mlx, a model, `segserve.server.engine` or `segserve.server.runner`: its tests run on numbers.
"""

from segserve.server.scheduling.admission import (
    AdmissionDecision,
    AdmissionDetail,
    MemoryState,
    PriceBreakdown,
    RequestCost,
    SchedulerLimits,
    decide,
    price,
    queue_has_room,
    retry_after_seconds,
)
from segserve.server.scheduling.memory_budget import (
    default_budget,
    parse_memory_budget,
    parse_percent,
)
from segserve.server.scheduling.plan import (
    AdmitFailed,
    Admitted,
    Finished,
    FinishReason,
    Phase,
    PrefillChunk,
    Refused,
    RunFailure,
    Sampled,
    StepOutput,
    StepPlan,
    StepUpdate,
)
from segserve.server.scheduling.scheduler import (
    GuardOutcome,
    Running,
    Scheduler,
    Waiting,
    request_cost,
)
from segserve.server.scheduling.store import LookupHit, SnapshotStore, reusable_tokens

__all__ = [
    "AdmissionDecision", "AdmissionDetail", "AdmitFailed", "Admitted", "FinishReason",
    "Finished", "GuardOutcome", "LookupHit", "MemoryState", "Phase", "PrefillChunk",
    "PriceBreakdown", "Refused", "RequestCost", "RunFailure", "Running", "Sampled",
    "Scheduler", "SchedulerLimits", "SnapshotStore", "StepOutput", "StepPlan", "StepUpdate",
    "Waiting", "decide", "default_budget", "parse_memory_budget", "parse_percent", "price",
    "queue_has_room", "request_cost", "retry_after_seconds", "reusable_tokens",
]
