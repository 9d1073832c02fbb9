"""The engine's admission and memory-guard phases (split out of `server.engine`).

Owns: `AdmissionPhases`, a mixin the `Engine` inherits: deciding the head of the wait
queue (admit / wait / 429 / 507), expiring waits (503), and the memory guard. Runs on the
engine thread only, between steps; the numbers come from `server.scheduler` and the
pricing rule from `server.admission` (both model-free). An exception while looking up,
pricing or starting one request fails that request alone (phase "admit" of the engine's
failure boundary, see `server.engine`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kv.merge_policy import rows_copied_by_seals
from server.admission import AdmissionDecision, RequestCost
from server.errors import (
    InsufficientMemory,
    QueueFull,
    ServerError,
    WaitTimedOut,
)
from server.events import Failed, GenerationRequest, RequestHandle
from server.scheduler import BankNumbers
from server.store import LookupHit

if TYPE_CHECKING:
    from collections.abc import Callable

    from server.observer import EngineObserver
    from server.scheduler import Scheduler
    from server.store import SnapshotStore

log = logging.getLogger("segserve.engine")


class AdmissionPhases:
    """Admission and guard phases; expects the attributes the `Engine` defines."""

    scheduler: Scheduler[RequestHandle]
    store: SnapshotStore
    obs: EngineObserver
    _running: list[Any]
    _changes: int
    _decided: tuple[str, int] | None
    _guard_episode: bool
    _memory_in_use: Callable[[], int]

    def _resolve(self, req: GenerationRequest) -> LookupHit:
        raise NotImplementedError

    def _begin(self, handle: RequestHandle, hit: LookupHit) -> Any:
        raise NotImplementedError

    def _finish_failed(self, act: Any, exc: ServerError) -> None:
        raise NotImplementedError

    def _failure(self, phase: str, request_id: str, exc: Exception) -> ServerError:
        raise NotImplementedError

    def _refuse_queue_full(self, handle: RequestHandle) -> None:
        after = self.scheduler.retry_after()
        self.obs.decision("reject_queue_full", "queue_full")
        handle.emit(Failed(QueueFull(
            f"{len(self.scheduler.waiting)} requests are already waiting for memory; retry later",
            headers={"Retry-After": str(int(after))},
        )))

    def _expire_waiting(self) -> None:
        for w in self.scheduler.timed_out(time.monotonic()):
            after = self.scheduler.retry_after()
            self.obs.decision("reject_timeout", "wait_timeout")
            w.item.emit(Failed(WaitTimedOut(
                "waited too long for memory held by running requests; retry later",
                headers={"Retry-After": str(int(after))},
            )))

    def _admit_waiting(self) -> None:
        """FIFO: decide for the head until one has to wait (phase 1 of each loop turn)."""
        while (w := self.scheduler.head()) is not None:
            handle = w.item
            if handle.cancelled:
                self.scheduler.drop_head()
                continue
            if self._decided == (w.request_id, self._changes):
                return  # nothing finished or freed since this head was told to wait
            self._decided = (w.request_id, self._changes)
            try:
                hit = self._resolve(handle.request)
                decision = self.scheduler.decide_head(
                    self._cost(handle.request, hit), self._bank_numbers()
                )
            except Exception as exc:  # a bug in lookup or pricing fails this request only
                self.scheduler.drop_head()
                handle.emit(Failed(self._failure("admit", w.request_id, exc)))
                continue
            self.obs.decision(decision.decision, decision.reason)
            if decision.decision == "wait" and self.scheduler.limits.max_queue > 0:
                return
            self.scheduler.drop_head()
            if decision.decision == "admit":
                self._admit(handle, hit, decision, time.monotonic() - w.enqueued_at)
            else:
                self._refuse(handle, decision)
        self.obs.waiting(0)

    def _admit(self, handle: RequestHandle, hit: LookupHit, d: AdmissionDecision, waited: float) -> None:
        """Reserve and start the request; any failure here ends it alone with nothing
        held (no reservation; `_begin` pins last)."""
        rid = handle.request.request_id
        try:
            if d.evict_bytes > 0:
                self.store.ensure_free(d.evict_bytes)
            self.scheduler.reserved[rid] = d.price_bytes
            self.obs.waited(waited)
            self._running.append(self._begin(handle, hit))
        except Exception as exc:
            self.scheduler.finish(rid)
            self._changes += 1
            handle.emit(Failed(self._failure("admit", rid, exc)))
        self.obs.running(len(self._running))

    def _refuse(self, handle: RequestHandle, d: AdmissionDecision) -> None:
        detail = d.detail.to_dict()
        if d.decision == "reject_insufficient_memory":
            exc: ServerError = InsufficientMemory(
                f"this request needs {d.price_bytes} bytes of KV memory but at most "
                f"{d.detail.capacity_when_idle_bytes} can ever be free under the "
                f"{d.detail.budget_bytes}-byte budget; "
                + (f"max_tokens <= {d.detail.max_tokens_that_fit} would fit"
                   if d.detail.shorter_request_could_fit else "a shorter prompt is needed"),
                extra={"detail": detail},
            )
        else:  # queue full (max_queue == 0 and it would have to wait)
            exc = QueueFull("the request would have to wait and waiting is disabled",
                            headers={"Retry-After": str(int(self.scheduler.retry_after()))})
        handle.emit(Failed(exc))

    def _cost(self, req: GenerationRequest, hit: LookupHit) -> RequestCost:
        # The bank may restore whole segments of which only a prefix is reused: the restore
        # is priced in full, the history held already is what remains (never negative).
        new_prompt = len(req.prompt) - hit.reused_tokens
        segs = hit.snapshot.segments
        # The turn seals twice (end of prompt, end of generation); price what that merges.
        merge_rows = rows_copied_by_seals(
            [s.level for s in segs], [s.rows for s in segs], [new_prompt, req.max_tokens]
        )
        return RequestCost(
            new_prompt_tokens=new_prompt,
            max_tokens=req.max_tokens,
            history_tokens=max(0, hit.reused_tokens - hit.restore_tokens),
            restore_from_ssd_tokens=hit.restore_tokens,
            merge_rows=merge_rows,
        )

    def _bank_numbers(self) -> BankNumbers:
        return BankNumbers(self.store.ram_bytes(), self.store.evictable_bytes())

    def _guard(self) -> None:
        """Real usage vs the budget after each step; see server.scheduler for the policy.
        The server's reading (`server.device_memory.MemoryMeter`) is the larger of active
        memory and MLX's peak since the previous step, so a transient that passed the
        budget inside a step is acted on too."""
        usage = {a.req.request_id: a.cache.tail_nbytes() for a in self._running}
        action = self.scheduler.guard(self._memory_in_use(), usage)
        if action.kind == "none":
            self._guard_episode = False
            return
        freed = self.store.ensure_free(action.bytes_over)
        if freed > 0:
            self._intervene("shed_bank", f"freed {freed} bytes of idle sessions")
        if action.kind == "end_request" and freed < action.bytes_over:
            self._end_outgrown(action.request_id)
        elif freed == 0 and not self._guard_episode:
            # Over budget with nothing to shed and no request past its price: report once.
            self._intervene("over_budget_unresolved", f"{action.bytes_over} bytes over budget")
        self._guard_episode = True

    def _intervene(self, reason: str, detail: str) -> None:
        self.obs.intervention(reason)
        log.warning("memory guard: %s (%s)", reason, detail)

    def _end_outgrown(self, request_id: str | None) -> None:
        for act in list(self._running):
            if act.req.request_id == request_id:
                self._intervene("request_outgrew_price", f"ended {request_id}")
                self._finish_failed(act, InsufficientMemory(
                    "the request grew past the memory it was admitted with and the "
                    "budget is exhausted; it was stopped", code="memory_guard",
                ))

