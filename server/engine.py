"""The engine thread: the one owner of MLX. Prefill, decode, seal, store.

Owns: `Engine` (thread, inbox, running set) and per-request `_Active` state.
Web side → engine: `submit()` puts a `RequestHandle` on a thread-safe queue.
Engine → web side: typed events through each handle (`server.events`).

Scheduling policy (README "Scheduling"): round-robin over running requests, one step each
per turn of the loop, where a step is one prefill chunk (`prefill_chunk` tokens) or one
decode token. A long prompt therefore never starves the streams of others.

Turn boundaries: the KV cache is sealed at the end of the prompt and again after
generation (a segment boundary at each), and the turn's snapshot goes to the session store
once, when the request ends (or what was sealed of it, when it was cancelled). Lookups
match the longest common token prefix, views included, so a follow-up whose re-rendered
assistant text differs from the generated tokens still reuses everything up to the first
difference.

Failure boundary (one request never takes the engine down): an exception while admitting,
prefilling, decoding, sampling or storing a request ends THAT request with a `Failed` event
(its pin and reservation released, what was sealed of its prompt kept) and is counted by
phase (`EngineObserver.request_failed`); the loop goes on with the next request. A batched
decode step that raises is rewound and retried one request at a time, so only the request
that fails alone is ended. An exception outside any one request (a loop turn) is logged;
when the next turn fails too, every request in flight is ended (counted as phase "engine")
so the loop cannot spin on a persistent fault. `stop()` ends the requests still in flight
with `ShuttingDown` (HTTP 503, or an error event in a started stream).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx

from kv.segmented import SegmentedCache
from kv.stock import StockCache
from server.batched import batch_supported, decode_batch
from server.engine_admission import AdmissionPhases
from server.errors import (
    EngineDead,
    GenerationFailed,
    ServerError,
    ShuttingDown,
)
from server.events import Done, Failed, GenerationRequest, RequestHandle, Started, Token
from server.forward import logits_last
from server.model import LoadedModel
from server.observer import EngineObserver, NullObserver
from server.sampling import Sampler
from server.scheduler import Scheduler
from server.store import LookupHit, SnapshotStore
from server.textstream import TextStream

log = logging.getLogger("segserve.engine")


@dataclass(eq=False)
class _Active:
    handle: RequestHandle
    cache: Any  # SegmentedCache | StockCache
    pinned: Any  # the Snapshot pinned in the store while this request runs
    session_id: str | None
    pending: list[int]  # prompt tokens not yet prefilled
    cached: int
    sampler: Sampler
    text: TextStream
    generated: list[int] = field(default_factory=list)
    next_logits: mx.array | None = None
    started_at: float = field(default_factory=time.perf_counter)
    released: bool = False
    last_token_at: float | None = None
    phase: str = "prefill"  # what a failure is counted as: prefill, decode, sample, store

    @property
    def req(self) -> GenerationRequest:
        return self.handle.request


class Engine(AdmissionPhases):
    def __init__(
        self,
        loaded: LoadedModel,
        store: SnapshotStore,
        *,
        segmented: bool,
        scheduler: Scheduler[RequestHandle],
        prefill_chunk: int = 256,
        observer: EngineObserver | None = None,
        memory_in_use: Callable[[], int] = mx.get_active_memory,
        batch_decode: bool = True,
    ) -> None:
        self.loaded = loaded
        self.scheduler = scheduler
        self._memory_in_use = memory_in_use
        self.store = store
        self.segmented = segmented
        self.prefill_chunk = prefill_chunk
        self._batching = batch_decode and batch_supported(loaded.model)
        self.obs: EngineObserver = observer or NullObserver()
        self._inbox: queue.Queue[RequestHandle | None] = queue.Queue()
        self._running: list[_Active] = []
        self._thread = threading.Thread(target=self._run, name="segserve-engine", daemon=True)
        self._stop = threading.Event()
        self.error: str | None = None
        self.kv_seals = 0
        self.kv_merges = 0
        # Published by the engine thread as one immutable dict, read by the event loop.
        self._kv_state: dict[str, Any] = self._compute_kv_state()
        self._guard_episode = False
        self._changes = 0  # bumps when memory is released: a waiting head is re-decided
        self._decided: tuple[str, int] | None = None
        self._calls: queue.Queue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]] = queue.Queue()
        # Set (under the lock) once the engine thread has answered everything it will ever
        # answer: later submissions and calls are refused at once instead of never settling.
        self._closed: ServerError | None = None
        self._close_lock = threading.Lock()

    # ---- web side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still in flight end with `ShuttingDown` (sealed prompt
        rows are stored first), session-API calls not yet run are refused."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, handle: RequestHandle) -> None:
        with self._close_lock:
            closed = self._closed
            if closed is None:
                self._inbox.put(handle)
        if closed is not None:
            handle.emit(Failed(closed))

    def call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the engine thread between steps (the store is engine-thread only)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._close_lock:
            closed = self._closed
            if closed is None:
                self._calls.put((fn, loop, fut))
                self._inbox.put(None)  # wake the loop if it is idle
        if closed is not None:
            fut.set_exception(closed)
        return fut

    def _run_calls(self) -> None:
        while True:
            try:
                fn, loop, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, exc = fn(), None
            except Exception as e:  # delivered to the caller, who maps it to HTTP
                result, exc = None, e
            self._changes += 1
            _settle_threadsafe(loop, fut, result, exc)
        self._publish()

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_state(self) -> dict[str, Any]:
        return self._kv_state

    def bank_state(self) -> dict[str, Any]:
        return self._bank_state

    def _compute_kv_state(self, exclude: _Active | None = None) -> dict[str, Any]:
        running = [a for a in self._running if a is not exclude]
        self._bank_state = self.store.stats()
        tails = sum(a.cache.tail_nbytes() for a in running)
        return {
            "seals": self.kv_seals,
            "merges": self.kv_merges,
            # Distinct segments the bank holds (running requests' new ones join at the end).
            "live_segments": int(self._bank_state.get("segments", 0)),
            "bytes": {"segments": self.store.ram_bytes(), "tail": tails},
        }

    def _publish(self, exclude: _Active | None = None) -> None:
        self._kv_state = self._compute_kv_state(exclude)

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        # MLX streams belong to the thread that made them (a GPU stream of the main thread
        # cannot be used here): this thread gets its own on the default device.
        stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(stream):
                self._loop()
                self._end_all(ShuttingDown())
        except BaseException as exc:  # noqa: BLE001 — the thread's death must be visible
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine thread died")
            self._fail_all(GenerationFailed("engine stopped: " + self.error))

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
        """Take new requests, run session-API calls, expire and admit waiters, then one
        round of steps for the running requests and the memory guard."""
        self._take_new(block=not self._running and not self.scheduler.waiting)
        self._run_calls()
        self._expire_waiting()
        self._admit_waiting()
        if self._running:
            self._step_round()
            self._guard()
        elif self.scheduler.waiting:
            time.sleep(0.01)  # waiting for memory with nothing running: re-check

    def _end_all_in_flight(self) -> None:
        """After repeated loop failures: end every running and waiting request (the loop
        itself carries on and serves what comes next)."""
        exc = GenerationFailed("the engine hit an internal error; the request was ended")
        for act in list(self._running):
            self.obs.request_failed("engine")
            self._finish_failed(act, exc)
        while self.scheduler.waiting:
            self.obs.request_failed("engine")
            self.scheduler.drop_head().item.emit(Failed(exc))
        self._decided = None

    def _take_new(self, *, block: bool) -> None:
        while True:
            try:
                handle = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if handle is None:
                if self._stop.is_set():
                    return
                continue
            if handle.cancelled:
                continue
            try:
                if not self.scheduler.enqueue(handle, handle.request.request_id, time.monotonic()):
                    self._refuse_queue_full(handle)
            except Exception as exc:  # taken off the inbox: it must be answered here
                handle.emit(Failed(self._failure("admit", handle.request.request_id, exc)))
            self.obs.waiting(len(self.scheduler.waiting))

    def _begin(self, handle: RequestHandle, hit: LookupHit) -> _Active:
        """Everything that can fail comes before the pin and `Started`: a failure here
        holds nothing and the client gets a plain HTTP error, not a cut stream."""
        req = handle.request
        sampler = Sampler(req.sampling)
        text = TextStream(self.loaded.tokenizer.decode, req.stops)
        cache = self._make_cache(hit)
        pending = list(req.prompt[hit.reused_tokens :])
        cache.reserve(len(pending))
        self.store.pin(cache.base)
        act = _Active(
            handle=handle,
            cache=cache,
            pinned=cache.base,
            session_id=req.session_id,
            pending=pending,
            cached=hit.reused_tokens,
            sampler=sampler,
            text=text,
            started_at=handle.submitted_at,  # TTFT includes queueing, lookup and SSD restore
        )
        handle.emit(Started(len(req.prompt), hit.reused_tokens, req.session_id))
        return act

    def _resolve(self, req: GenerationRequest) -> LookupHit:
        hit = self.store.lookup(req.prompt, session_id=req.session_id, salt=req.salt)
        # The last prompt token must run to give logits: reuse at most len - 1 tokens.
        if hit.reused_tokens >= len(req.prompt):
            n = len(req.prompt) - 1
            hit = hit.cut(n)
        self.obs.lookup(hit.kind)
        return hit

    def _make_cache(self, hit: LookupHit) -> SegmentedCache | StockCache:
        n = self.loaded.num_layers
        base = hit.snapshot if hit.reused_tokens else None
        return SegmentedCache(n, base) if self.segmented else StockCache(n, base)

    def _step_round(self) -> None:
        """One loop turn: a prefill chunk for the next prefilling request (round-robin), then
        one decode token for every decoding request (one batched forward when it can)."""
        for act in [a for a in self._running if a.handle.cancelled]:
            self._guarded(act, self._finish_cancelled)
        pre = next((a for a in self._running if a.pending), None)
        if pre is not None:
            self._running.remove(pre)
            self._running.append(pre)  # the next round serves the next prefilling request
            self._guarded(pre, self._prefill_chunk)
        feeds: list[tuple[_Active, int]] = []
        for act in [a for a in self._running if not a.pending and a.next_logits is not None]:
            token = self._guarded(act, self._emit_next)
            if token is not None:
                feeds.append((act, token))
        if feeds:
            self._feed(feeds)
        self.obs.running(len(self._running))

    def _guarded(self, act: _Active, fn: Callable[[_Active], Any]) -> Any:
        """Run one request's step; a failure ends that request alone."""
        try:
            return fn(act)
        except Exception as exc:  # a bug or an MLX failure in one request: fail it alone
            self._finish_failed(act, self._failure(act.phase, act.req.request_id, exc))
        return None

    def _failure(self, phase: str, request_id: str, exc: Exception) -> ServerError:
        """Count and log a request's failure; the error its client gets."""
        self.obs.request_failed(phase)
        if isinstance(exc, ServerError):
            log.warning("request %s failed in %s: %s", request_id, phase, exc.message)
            return exc
        log.error("request %s failed in %s", request_id, phase, exc_info=exc)
        return GenerationFailed(f"{phase} failed: {type(exc).__name__}: {exc}")

    def _prefill_chunk(self, act: _Active) -> None:
        act.phase = "prefill"
        chunk = act.pending[: self.prefill_chunk]
        logits = logits_last(self.loaded.model, chunk, act.cache.layers)
        mx.eval(logits)
        act.cache.record_tokens(chunk)
        del act.pending[: len(chunk)]
        self.obs.prompt_tokens(len(chunk))
        if not act.pending:
            self._seal(act)  # turn boundary 1: the end of the prompt
            act.next_logits = logits

    def _emit_next(self, act: _Active) -> int | None:
        """Sample from the pending logits, stream it, and say whether to feed it back."""
        act.phase = "sample"
        logits = act.next_logits
        assert logits is not None
        act.next_logits = None
        token = int(act.sampler(logits).item())
        lp = act.sampler.logprob(logits, token) if act.req.sampling.logprobs else None
        act.generated.append(token)
        self._observe_token(act)
        if token in self.loaded.tokenizer.eos_ids:
            self._finish(act, "stop")
            return None
        text = act.text.push(token)
        act.handle.emit(Token(text, token, lp))
        if act.text.stopped:
            self._finish(act, "stop")
        elif len(act.generated) >= act.req.max_tokens:
            self._finish(act, "length")
        else:
            return token
        return None

    def _feed(self, feeds: list[tuple[_Active, int]]) -> None:
        """Run the sampled tokens through the model: batched when more than one.

        A batched step that raises cannot say whose request caused it: every cache is
        rewound to where the step began and each request is retried alone, so only a
        request that also fails alone is ended."""
        for act, _ in feeds:
            act.phase = "decode"
        if self._batching:  # B = 1 too: the compiled decode path
            marks = [a.cache.offset for a, _ in feeds]  # every layer is there between steps
            try:
                logits = decode_batch(self.loaded.model, [t for _, t in feeds], [a.cache.layers for a, _ in feeds])
                mx.eval(logits)
            except Exception:
                log.warning("batched decode of %d requests failed; retrying them one by one",
                            len(feeds), exc_info=True)
                for (act, token), mark in zip(feeds, marks, strict=True):
                    self._guarded(act, partial(self._retry_one, token=token, offset=mark))
                return
            for i, (act, token) in enumerate(feeds):
                act.next_logits = logits[i]
                act.cache.record_tokens([token])
            return
        for act, token in feeds:
            self._guarded(act, partial(self._feed_one, token=token))

    def _retry_one(self, act: _Active, token: int, offset: int) -> None:
        """Undo a failed batched step's writes to this request's cache (the layers it
        reached), then feed the token alone."""
        for layer in act.cache.layers:
            if layer.offset > offset:
                layer.trim(layer.offset - offset)
        # A trimmed last layer also drops its token record: put back what the cache held
        # before the step (the prompt and every generated token but the one being fed).
        expected = (*act.req.prompt, *act.generated[:-1])
        have = len(act.cache.tokens)
        if have < len(expected):
            act.cache.record_tokens(expected[have:])
        if act.cache.offset != len(expected) or act.cache.tokens != expected:
            raise RuntimeError("the cache could not be rewound after a failed batched step")
        self._feed_one(act, token)

    def _feed_one(self, act: _Active, token: int) -> None:
        act.next_logits = logits_last(self.loaded.model, [token], act.cache.layers)
        mx.eval(act.next_logits)
        act.cache.record_tokens([token])

    def _observe_token(self, act: _Active) -> None:
        now = time.perf_counter()
        if act.last_token_at is None:
            self.obs.first_token(now - act.started_at)
        else:
            self.obs.inter_token(now - act.last_token_at)
        act.last_token_at = now
        self.obs.generated_tokens(1)

    def _seal(self, act: _Active) -> None:
        before = act.cache.merges
        act.cache.seal()
        self.kv_seals += 1
        self.kv_merges += act.cache.merges - before

    def _store_turn(self, act: _Active) -> None:
        """The turn's snapshot goes to the bank once, when the request ends."""
        act.phase = "store"
        if act.cache.base.rows > act.pinned.rows:
            act.session_id = self.store.put(act.session_id, act.cache.base, salt=act.req.salt)

    def _release(self, act: _Active) -> None:
        """The request leaves: off the running list, its pin and reservation dropped (once)."""
        if act in self._running:
            self._running.remove(act)
        if act.released:
            return
        act.released = True
        self._changes += 1
        try:
            self.store.unpin(act.pinned)
        finally:  # the reservation goes even when the unpin raised
            self.scheduler.finish(act.req.request_id, time.perf_counter() - act.started_at)

    def _finish(self, act: _Active, reason: str) -> bool:
        act.phase = "store"
        self._seal(act)  # turn boundary 2: after generation
        self._store_turn(act)
        tail = act.text.flush()  # held-back text that never became a stop string
        self._release(act)
        self._publish(exclude=act)  # before Done: a client that reads /health next sees it
        req = act.req
        act.handle.emit(
            Done(
                "stop" if reason == "stop" else "length",
                len(req.prompt),
                len(act.generated),
                act.cached,
                act.session_id,
                tail,
            )
        )
        return True

    def _finish_cancelled(self, act: _Active) -> None:
        act.phase = "store"
        act.cache.drop_tail()  # the prompt segment (if sealed) stays; the turn's tail goes
        self._store_turn(act)
        self._release(act)
        self.obs.cancelled()

    def _finish_failed(self, act: _Active, exc: ServerError) -> None:
        """End a request with `exc`. Never raises: it is the failure path of the others.
        What was sealed (the prompt, once prefilled) is stored unless storing failed."""
        if not act.released:
            try:
                failed_in_store = act.phase == "store"
                act.cache.drop_tail()
                if not failed_in_store:
                    self._store_turn(act)
            except Exception:
                log.exception("request %s: storing its sealed rows failed", act.req.request_id)
        try:
            self._release(act)
        except Exception:
            log.exception("request %s: releasing its pin failed", act.req.request_id)
        act.handle.emit(Failed(exc))
        try:
            self._publish()
        except Exception:
            log.exception("publishing the engine state failed")

    def _close(self, exc: ServerError) -> None:
        """From now on, submissions and calls are answered with `exc` at once; those
        already queued are answered here."""
        with self._close_lock:
            self._closed = exc
        while True:
            try:
                h = self._inbox.get_nowait()
            except queue.Empty:
                break
            if h is not None:
                h.emit(Failed(exc))
        while True:
            try:
                _, loop, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            _settle_threadsafe(loop, fut, None, exc)

    def _end_all(self, exc: ServerError) -> None:
        """Stop: end every request still here (releasing pins, storing sealed rows)."""
        for act in list(self._running):
            self._finish_failed(act, exc)
        while self.scheduler.waiting:
            self.scheduler.drop_head().item.emit(Failed(exc))
        self._close(exc)

    def _fail_all(self, exc: ServerError) -> None:
        """The thread is dying: answer everyone, touching nothing that might raise again."""
        while self._running:
            self._running.pop(0).handle.emit(Failed(exc))
        while self.scheduler.waiting:
            self.scheduler.drop_head().item.emit(Failed(exc))
        self._close(EngineDead(exc.message))


def _settle_threadsafe(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any, exc: Exception | None
) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, result, exc)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is waiting for this any more


def _settle(fut: asyncio.Future[Any], result: Any, exc: Exception | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
