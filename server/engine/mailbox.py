"""The engine thread's mailbox: requests and session-API calls from the web side.

Owns: `Mailbox`. The web side (any thread) `submit`s request handles and `call`s functions
to run between steps (the session store is engine-thread only), answered on the caller's
event loop. The engine thread `take`s new handles and `run_calls`. Once the engine has
answered everything it ever will, `close` refuses what is queued and everything later at
once, instead of leaving it unanswered. A caller whose event loop has closed is simply not
answered (nobody is waiting any more).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from segserve.server.engine.errors import EngineError
from segserve.server.engine.events import Failed, RequestHandle

_Call = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class Mailbox:
    def __init__(self) -> None:
        self._inbox: queue.Queue[RequestHandle | None] = queue.Queue()
        self._calls: queue.Queue[_Call] = queue.Queue()
        self._closed: EngineError | None = None
        self._lock = threading.Lock()  # closing and posting never interleave

    # ---- web side --------------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> None:
        with self._lock:
            closed = self._closed
            if closed is None:
                self._inbox.put(handle)
        if closed is not None:
            handle.emit(Failed(closed))

    def call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            closed = self._closed
            if closed is None:
                self._calls.put((fn, loop, fut))
                self._inbox.put(None)  # wake the engine thread if it is idle
        if closed is not None:
            fut.set_exception(closed)
        return fut

    def wake(self) -> None:
        self._inbox.put(None)

    # ---- engine thread ---------------------------------------------------------------
    def take(self, *, block: bool, stop: threading.Event) -> list[RequestHandle]:
        """New requests (cancelled ones left out); waits up to 0.5 s for the first when
        `block`, never once `stop` is set."""
        out: list[RequestHandle] = []
        while True:
            try:
                handle = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return out
            block = False
            if handle is None:
                if stop.is_set():
                    return out
                continue
            if not handle.cancelled:
                out.append(handle)

    def run_calls(self, before_answer: Callable[[], None]) -> bool:
        """Run every queued call; `before_answer` runs between a call and its answer, so
        what the caller reads next already reflects it. True if any ran."""
        ran = False
        while True:
            try:
                fn, loop, fut = self._calls.get_nowait()
            except queue.Empty:
                return ran
            try:
                result, exc = fn(), None
            except Exception as e:  # delivered to the caller, who maps it to HTTP
                result, exc = None, e
            ran = True
            before_answer()
            _settle_threadsafe(loop, fut, result, exc)

    def close(self, exc: EngineError) -> None:
        """From now on, submissions and calls are answered with `exc` at once; those
        already queued are answered here."""
        with self._lock:
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
                return
            _settle_threadsafe(loop, fut, None, exc)


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
