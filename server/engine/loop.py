"""The engine thread: the one owner of MLX. Each turn is schedule -> execute -> update.

Owns: `Engine` (thread, inbox, session-API calls, the published state) and the delivery of
each request's events. What runs is decided by `segserve.server.scheduling.Scheduler` (model-free),
how it runs by `segserve.server.runner.ModelRunner`; this loop only carries plans and outputs
between them and turns the results into events:

    plan = scheduler.schedule(now)                # admit, refuse, choose chunk and batch
    out = runner.execute(plan)                    # prefill chunk, decode batch, sampling
    update = scheduler.update_from_output(plan, out)   # who finished, and why
    deliver(plan, out, update)                    # Started / Token / Done / Failed
    guard()                                       # real memory vs the budget

Web side -> engine: `submit()` puts a `RequestHandle` on a thread-safe queue; `call()` runs a
function between steps (the session API). Engine -> web side: typed events through each
handle (`segserve.server.engine.events`).

Turn boundaries: the KV cache is sealed at the end of the prompt and again after
generation, and the turn's snapshot goes to the session store once, when the request ends
(or what was sealed of it, when it was cancelled or failed, unless the request says
`store_unfinished=False`). With `n` > 1 choices the stored turn is choice 0's, stored when
choice 0 ends; each choice ends with its own `Done`, and the request is released (pin and
reservation) with its last choice.

Failure boundary (one request never takes the engine down): an exception while admitting,
prefilling, decoding, sampling or storing a request ends THAT request with a `Failed` event
(its pin and reservation released, what was sealed of its prompt kept) and is counted by
phase (`EngineObserver.request_failed`). An exception outside any one request (a loop turn)
is logged; when the next turn fails too, every request in flight is ended (phase "engine")
so the loop cannot spin on a persistent fault. `stop()` ends the requests still in flight
with `ShuttingDown` (HTTP 503, or an error event in a started stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from segserve.bank import Bank
from segserve.server.engine.errors import (
    EngineError,
    EngineFailure,
    EngineUnavailable,
    InsufficientMemory,
    ShuttingDown,
)
from segserve.server.engine.events import (
    Done,
    Failed,
    GenerationRequest,
    RequestHandle,
    Started,
    Token,
)
from segserve.server.engine.mailbox import Mailbox
from segserve.server.engine.observer import EngineObserver, NullObserver
from segserve.server.engine.refusals import queue_full_error, refusal_error
from segserve.server.engine.state import EngineState, MemoryReadings, read_state
from segserve.server.runner import ModelRunner, WarmUpReport
from segserve.server.scheduling import (
    FinishReason,
    Phase,
    Refused,
    Running,
    Scheduler,
    SnapshotStore,
    StepOutput,
    StepPlan,
    StepUpdate,
)
from segserve.server.scheduling.params import TokenLogprob

log = logging.getLogger("segserve.engine")


@dataclass(eq=False)
class _Timing:
    started_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    steps: int = 0  # steps that sampled for the request (one token per live choice each)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler[RequestHandle],
        *,
        observer: EngineObserver | None = None,
        memory_in_use: Callable[[], int] = mx.get_active_memory,
        peak_memory: Callable[[], int] = mx.get_peak_memory,
        on_idle: Callable[[], None] | None = None,
        warm_up: Callable[[Callable[[], bool]], WarmUpReport] | None = None,
    ) -> None:
        """`on_idle`: called on the engine thread when the last running request has ended
        and none waits (the server hands freed heap back to the system there, on the CPU).
        `warm_up(stopped)`: run on the engine thread before its first step (its compiled
        graphs are per thread); requests queue meanwhile and the server is not ready;
        `stopped()` says a shutdown began (the warm-up ends early)."""
        self.runner = runner
        self._on_idle = on_idle
        self._warm_up = warm_up
        self._warmed = threading.Event()
        self.warm_report: WarmUpReport | None = None
        self.scheduler = scheduler
        self.store: SnapshotStore = scheduler.store
        # The session bank behind the store, for what the scheduler does not ask of a store
        # (stats, forks, stored turns); None for another store (tests' fakes).
        self._bank: Bank | None = self.store if isinstance(self.store, Bank) else None
        self.obs: EngineObserver = observer or NullObserver()
        self._memory_in_use = memory_in_use
        self._mail = Mailbox()
        self._handles: dict[str, RequestHandle] = {}  # queued or running, by request id
        self._timing: dict[str, _Timing] = {}
        self._thread = threading.Thread(target=self._run, name="segserve-engine", daemon=True)
        self._stop = threading.Event()
        self.error: str | None = None
        # Published by the engine thread as immutable dicts, read by the event loop.
        self._bank_state: dict[str, Any] = {}
        self._kv_state: dict[str, Any] = self._compute_kv_state()
        self._readings = MemoryReadings(mx.get_active_memory, peak_memory, mx.get_cache_memory)
        self._state: EngineState = self._read_state()

    # ---- web side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still in flight end with `ShuttingDown` (sealed prompt
        rows are stored first), session-API calls not yet run are refused."""
        self._stop.set()
        self._mail.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def warming(self) -> bool:
        """The start-up warm-up runs (the thread started, its first step not yet)."""
        return self._warm_up is not None and not self._warmed.is_set()

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def submit(self, handle: RequestHandle) -> None:
        self._mail.submit(handle)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the engine thread between steps (the store is engine-thread only)."""
        return self._mail.call(fn)

    def kv_state(self) -> dict[str, Any]:
        return self._kv_state

    def bank_state(self) -> dict[str, Any]:
        return self._bank_state

    def state(self) -> EngineState:
        """The state published after the last step (any thread; an immutable value)."""
        return self._state

    # ---- published state -------------------------------------------------------------
    def _compute_kv_state(self) -> dict[str, Any]:
        self._bank_state = dataclasses.asdict(self._bank.stats()) if self._bank is not None else {}
        return {
            "seals": self.runner.seals,
            "merges": self.runner.merges,
            "spec": {"drafted": self.runner.spec_drafted, "accepted": self.runner.spec_accepted},
            # Distinct segments the bank holds (running requests' new ones join at the end).
            "live_segments": int(self._bank_state.get("segments") or 0),
            "bytes": {"segments": self.store.ram_bytes(), "tail": sum(self.runner.tail_bytes().values())},
            "rows": {"tail": sum(_tail_rows(r) for r in self.scheduler.running)},
        }

    def _publish(self) -> None:
        self._kv_state = self._compute_kv_state()
        self._state = self._read_state()

    def _read_state(self) -> EngineState:
        """Counts, admission and memory now; kv/bank as of the last `_publish` (the bank's
        stats walk every node: once per finished request or session call, not per step)."""
        return read_state(self.scheduler, self._kv_state, self._bank_state, self.store.ram_bytes(),
                          self._readings, time.monotonic())

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        # MLX streams belong to the thread that made them (a GPU stream of the main thread
        # cannot be used here): this thread gets its own on the default device.
        stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(stream):
                self._warm()
                self._loop()
                self._end_all(ShuttingDown())
        except BaseException as exc:  # noqa: BLE001 — the thread's death must be visible
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine thread died")
            self._fail_all(EngineFailure("engine stopped: " + self.error, phase="engine"))

    def _warm(self) -> None:
        try:
            if self._warm_up is not None:
                self.warm_report = self._warm_up(self._stop.is_set)
        finally:
            self._warmed.set()

    def _loop(self) -> None:
        """Run turns until stopped; a turn that raises outside any one request is logged
        and counted, and a second one in a row ends every request in flight."""
        failed_turns = 0
        while not self._stop.is_set():
            try:
                self._turn()
                failed_turns = 0
            except Exception:
                failed_turns += 1
                log.exception("engine loop turn failed (%d in a row)", failed_turns)
                if failed_turns > 1:
                    self._end_all_in_flight()

    def _turn(self) -> None:
        """Take new requests and session-API calls, then one schedule -> execute -> update
        step and the memory guard."""
        sch = self.scheduler
        self._take_new(block=not sch.running and not sch.waiting)
        self._run_calls()
        plan = sch.schedule(time.monotonic())
        self._apply_admission(plan)
        busy = bool(sch.running)
        # A pipelined decode step may still be in flight (`ModelRunner.inflight`): the
        # update consumes the step that finished, one step behind the one launched.
        if plan.runs_model or self.runner.inflight:
            out = self.runner.execute(plan)
            self._deliver(out, sch.update_from_output(plan, out))
        self.obs.running(len(sch.running))
        if sch.running:
            self._guard()
        elif busy and not sch.waiting and self._on_idle is not None:
            self._on_idle()
        self._state = self._read_state()
        if not sch.running and sch.waiting:
            time.sleep(0.01)  # waiting for memory with nothing running: re-check

    def _take_new(self, *, block: bool) -> None:
        for handle in self._mail.take(block=block, stop=self._stop):
            try:
                if self.scheduler.enqueue(handle, time.monotonic()):
                    self._handles[handle.request.request_id] = handle
                else:
                    self._refuse_queue_full(handle)
            except Exception as exc:  # taken off the inbox: it must be answered here
                handle.emit(Failed(self._failure("admit", handle.request.request_id, exc)))
            self.obs.waiting(len(self.scheduler.waiting))

    def _stored_turn(self, session_id: str | None, req: GenerationRequest) -> int | None:
        if session_id is None or self._bank is None:
            return None
        return self._bank.turn_index(session_id, salt=req.salt)

    def _run_calls(self) -> None:
        if self._mail.run_calls(self._after_call):
            self.obs.waiting(len(self.scheduler.waiting))

    def _after_call(self) -> None:
        """A session-API call may have released memory (a DELETE): the waiting head is
        decided again; the state is published before the caller hears back, so /health
        and /metrics read next reflect the call."""
        self.scheduler.note_change()
        self._publish()

    # ---- admission results -----------------------------------------------------------
    def _apply_admission(self, plan: StepPlan) -> None:
        for rid in plan.dropped:
            self._handles.pop(rid, None)
        for lookup in plan.lookups:
            self.obs.lookup(lookup)
        for decision, reason in plan.decisions:
            self.obs.decision(decision, reason)
        for r in plan.refused:
            self._refuse(r)
        for f in plan.admit_failed:
            self._handles.pop(f.request_id).emit(Failed(self._failure("admit", f.request_id, f.error)))
        for a in plan.admitted:
            handle = self._handles[a.request_id]
            self.obs.waited(a.waited_s)
            try:
                self.runner.begin(handle.request, a.hit, speculate=a.speculate)
            except Exception as exc:  # nothing streamed yet: a plain HTTP error, nothing held
                self.scheduler.release(a.request_id)
                del self._handles[a.request_id]
                handle.emit(Failed(self._failure("admit", a.request_id, exc)))
                continue
            # TTFT includes queueing, lookup and SSD restore.
            self._timing[a.request_id] = _Timing(handle.submitted_at)
            req = handle.request
            handle.emit(Started(len(req.prompt), a.hit.reused_tokens, req.session_id))
        if not self.scheduler.waiting:
            self.obs.waiting(0)
        for rid in plan.cancelled:
            self._end_cancelled(rid)

    def _refuse_queue_full(self, handle: RequestHandle) -> None:
        self.obs.decision("reject_queue_full", "queue_full")
        handle.emit(Failed(queue_full_error(len(self.scheduler.waiting), self.scheduler.retry_after())))

    def _refuse(self, r: Refused) -> None:
        if r.kind == "timeout":  # admission refusals were counted with the decisions
            self.obs.decision("reject_timeout", "wait_timeout")
        self._handles.pop(r.request_id).emit(Failed(refusal_error(r)))

    # ---- step results ----------------------------------------------------------------
    def _deliver(self, out: StepOutput, update: StepUpdate) -> None:
        """Tokens out, finished requests stored and ended, failed ones ended alone."""
        if out.prefilled_tokens:
            self.obs.prefilled_tokens(out.prefilled_tokens)
        ends = {(f.request_id, f.choice): f for f in update.finished}
        failed = {f.request_id for f in out.failed}
        stepped: set[str] = set()
        # A speculative step samples several tokens of one row: the row ends after its last.
        last_of = {(s.request_id, s.choice): i for i, s in enumerate(out.sampled)}
        for i, s in enumerate(out.sampled):
            if s.request_id in failed or s.request_id not in self._handles:
                continue  # failed, or ended by a failed store of an earlier choice
            if s.request_id not in stepped:  # latencies per step, not per choice
                stepped.add(s.request_id)
                self._observe_token(s.request_id)
            if not s.eos:
                lp = s.logprob if isinstance(s.logprob, TokenLogprob) else None
                self._handles[s.request_id].emit(Token(s.text, s.token_id, lp, s.choice))
            end = ends.get((s.request_id, s.choice))
            if end is not None and last_of[(s.request_id, s.choice)] == i:
                self._finish(end.request_id, end.reason, end.choice, end.last)
        for rid in dict.fromkeys(f.request_id for f in out.failed):  # once per request
            f = next(f for f in out.failed if f.request_id == rid)
            self._end_failed(rid, self._failure(f.phase, rid, f.error), f.phase)

    def _observe_token(self, request_id: str) -> None:
        t = self._timing[request_id]
        now = time.perf_counter()
        if t.last_token_at is None:
            t.first_token_at = now
            self.obs.first_token(now - t.started_at)
        else:
            self.obs.inter_token(now - t.last_token_at)
        t.last_token_at = now
        t.steps += 1

    def _finish(self, request_id: str, reason: FinishReason, choice: int = 0, last: bool = True) -> None:
        """One choice ended: seal and store the turn (choice 0), or drop the choice's tail;
        with the last choice also release and publish; then `Done` (a client that reads
        /health right after its last byte sees the state this request left)."""
        run = self.scheduler.get(request_id)
        assert run is not None
        handle = self._handles[request_id]
        req = handle.request
        try:
            turn = self.runner.finish(request_id, choice)
            session_id = self.scheduler.store_turn(request_id, turn.snapshot, req.session_id, req.salt)
        except Exception as exc:
            self._end_failed(request_id, self._failure("store", request_id, exc), "store")
            return
        completion, cached = run.per_choice[choice], run.cached
        if last:
            self._observe_finish(request_id, reason, len(req.prompt), run.generated)
            self._release(request_id)
            self.obs.cached_tokens(cached)  # the same number the client reads in its usage
        if last or turn.snapshot is not None:
            self._publish()
        if turn.snapshot is not None:
            self.obs.session_segments(len(turn.snapshot.segments))
        stored = self._stored_turn(session_id, req) if turn.snapshot is not None else None
        handle.emit(Done(reason, len(req.prompt), completion, cached, session_id, turn.tail_text, choice,
                         turn.spec.drafted, turn.spec.accepted, stored))

    def _observe_finish(self, request_id: str, reason: FinishReason, prompt: int, generated: int) -> None:
        """`reason` is the last choice's; the time per token is per step (all choices of a
        step were sampled together)."""
        t = self._timing.get(request_id)
        if t is None:
            return
        now = time.perf_counter()
        per_token = None
        if t.first_token_at is not None and t.last_token_at is not None and t.steps > 1:
            per_token = (t.last_token_at - t.first_token_at) / (t.steps - 1)
        self.obs.request_finished(reason, prompt, generated, now - t.started_at, per_token)

    def _end_cancelled(self, request_id: str) -> None:
        handle = self._handles[request_id]
        req = handle.request
        try:
            snapshot = self.runner.abandon(request_id)  # the sealed prompt stays, the tails go
            if req.store_unfinished:
                self.scheduler.store_turn(request_id, snapshot, req.session_id, req.salt)
        except Exception as exc:
            self._end_failed(request_id, self._failure("store", request_id, exc), "store")
            return
        self._release(request_id)
        self.obs.cancelled()

    def _end_failed(self, request_id: str, exc: EngineError, phase: Phase | str) -> None:
        """End a request with `exc`. Never raises: it is the failure path of the others.
        What was sealed (the prompt, once prefilled) is stored unless storing failed."""
        handle = self._handles.get(request_id)
        try:
            snapshot = self.runner.abandon(request_id)
            if phase != "store" and handle is not None and handle.request.store_unfinished:
                req = handle.request
                self.scheduler.store_turn(request_id, snapshot, req.session_id, req.salt)
        except Exception:
            log.exception("request %s: storing its sealed rows failed", request_id)
        try:
            self._release(request_id)
        except Exception:
            log.exception("request %s: releasing its pin failed", request_id)
        if handle is not None:
            handle.emit(Failed(exc))
        try:
            self._publish()
        except Exception:
            log.exception("publishing the engine state failed")

    def _release(self, request_id: str) -> None:
        """The request leaves: its pin and reservation dropped (once)."""
        self._handles.pop(request_id, None)
        t = self._timing.pop(request_id, None)
        seconds = time.perf_counter() - t.started_at if t is not None else None
        self.scheduler.release(request_id, seconds)
        # Before the caller emits Done: a client that scrapes /metrics right after its
        # last byte must not see itself still running.
        self.obs.running(len(self.scheduler.running))

    def _failure(self, phase: str, request_id: str, exc: Exception) -> EngineError:
        """Count and log a request's failure; the error its client gets."""
        self.obs.request_failed(phase)
        if isinstance(exc, EngineError):
            log.warning("request %s failed in %s: %s", request_id, phase, exc.message)
            return exc
        log.error("request %s failed in %s", request_id, phase, exc_info=exc)
        return EngineFailure(f"{phase} failed: {type(exc).__name__}: {exc}", phase=phase)

    # ---- memory guard ----------------------------------------------------------------
    def _guard(self) -> None:
        """Real usage vs the budget after each step; the policy is the scheduler's. The
        server's reading (`segserve.server.runner.MemoryMeter`) is the larger of active memory and
        MLX's peak since the previous step, so a transient that passed the budget inside a
        step is acted on too."""
        outcome = self.scheduler.guard(self._memory_in_use(), self.runner.tail_bytes())
        for reason, detail in outcome.interventions:
            self.obs.intervention(reason)
            log.warning("memory guard: %s (%s)", reason, detail)
        if outcome.end_request is not None:
            self._end_failed(outcome.end_request, InsufficientMemory(
                "the request grew past the memory it was admitted with and the "
                "budget is exhausted; it was stopped", reason="memory_guard",
            ), "guard")

    # ---- ending everything -----------------------------------------------------------
    def _end_all_in_flight(self) -> None:
        """After repeated loop failures: end every running and waiting request (the loop
        itself carries on and serves what comes next)."""
        exc = EngineFailure("the engine hit an internal error; the request was ended", phase="engine")
        for run in list(self.scheduler.running):
            self.obs.request_failed("engine")
            self._end_failed(run.request_id, exc, "engine")
        for handle in self.scheduler.drop_waiting():
            self.obs.request_failed("engine")
            self._handles.pop(handle.request.request_id, None)
            handle.emit(Failed(exc))

    def _end_all(self, exc: EngineError) -> None:
        """Stop: end every request still here (releasing pins, storing sealed rows)."""
        for run in list(self.scheduler.running):
            self._end_failed(run.request_id, exc, "shutdown")
        for handle in self.scheduler.drop_waiting():
            self._handles.pop(handle.request.request_id, None)
            handle.emit(Failed(exc))
        self._mail.close(exc)

    def _fail_all(self, exc: EngineError) -> None:
        """The thread is dying: answer everyone, touching nothing that might raise again."""
        for handle in list(self._handles.values()):
            handle.emit(Failed(exc))
        self._handles.clear()
        self._mail.close(EngineUnavailable(exc.message))


def _tail_rows(run: Running[RequestHandle]) -> int:
    """Rows of a running request not sealed yet: its prompt rows while prefilling (the
    prompt is sealed when its prefill ends), its live choices' generated rows after."""
    if run.prefilled < run.prompt_tokens:
        return run.prefilled - run.cached
    return run.live_generated
