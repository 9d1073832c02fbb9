"""What a client is told when its request leaves the queue without running.

Owns: `refusal_error` (a scheduler `Refused` -> the `EngineError` its client gets) and
`queue_full_error`. Pure functions, called on the engine thread; they return domain values
(`segserve.server.engine.errors`), and the HTTP side maps them to 429 (queue full), 503 (wait
timed out) or 507 (cannot fit).
"""

from __future__ import annotations

from segserve.server.engine.errors import EngineError, InsufficientMemory, QueueFull, WaitTimedOut
from segserve.server.scheduling import Refused


def queue_full_error(queue_length: int, retry_after_s: float) -> EngineError:
    """The wait queue is full at submission (429). `queue_length` is the scheduler's whole
    queue; its head is the request being admitted, so what waits (and what `--max-queue`
    bounds, `queue_has_room`) is the rest."""
    waiting = max(0, queue_length - 1)
    return QueueFull(
        f"{waiting} requests are already waiting for memory; retry later",
        retry_after_s=retry_after_s, waiting=waiting,
    )


def refusal_error(r: Refused) -> EngineError:
    d = r.decision
    if r.kind == "timeout":
        return WaitTimedOut(
            "waited too long for memory held by running requests; retry later",
            retry_after_s=r.retry_after_s,
        )
    if r.kind == "insufficient_memory" and d is not None:
        return InsufficientMemory(
            f"this request needs {d.price_bytes} bytes of KV memory but at most "
            f"{d.detail.capacity_when_idle_bytes} can ever be free under the "
            f"{d.detail.budget_bytes}-byte budget; "
            + (f"max_tokens <= {d.detail.max_tokens_that_fit} would fit"
               if d.detail.shorter_request_could_fit else "a shorter prompt is needed"),
            detail=d.detail.to_dict(),
        )
    # max_queue == 0 and it would have to wait
    return QueueFull(
        "the request would have to wait and waiting is disabled",
        retry_after_s=r.retry_after_s,
    )
