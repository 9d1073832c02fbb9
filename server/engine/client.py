"""The one door from the HTTP side into the engine: `EngineClient`.

Owns: the `EngineClient` protocol (what a route may ask of the engine) and `LocalEngineClient`,
its implementation over an in-process `Engine`. A route generates with `generate(request)`
(a `RequestHandle` whose queue yields `Started`/`Token`/`Done`/`Failed`), runs typed session
commands (list, info, delete, fork; each one trip to the engine thread, where the bank
lives), and reads `state()`, the `EngineState` the engine published after its last step.

Errors are domain values (`segserve.server.engine.errors`): an unknown session is
`UnknownSession`, a refused command `SessionRefused`, no bank `NoSessionStore`, a dead engine
`EngineUnavailable`. The bank's own exceptions never leave this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from segserve.bank import Bank, BankError, SessionInfo, SessionNotFound
from segserve.server.engine.errors import (
    EngineUnavailable,
    NoSessionStore,
    SessionRefused,
    UnknownSession,
)
from segserve.server.engine.events import GenerationRequest, RequestHandle
from segserve.server.engine.loop import Engine
from segserve.server.engine.state import EngineState

T = TypeVar("T")

DEAD = "the engine thread is not running; see /health"


class EngineClient(Protocol):
    @property
    def alive(self) -> bool:
        """The engine thread runs and has not died."""

    @property
    def warming(self) -> bool:
        """The start-up warm-up still runs: requests queue until it ends."""

    @property
    def has_sessions(self) -> bool:
        """Sessions are kept (the store is the session bank)."""

    def generate(self, request: GenerationRequest) -> RequestHandle:
        """Queue `request`; its events arrive on the returned handle's queue (call on the
        event loop that reads them). Raises `EngineUnavailable` when the engine is dead."""

    async def list_sessions(self, salt: str | None) -> list[SessionInfo]: ...

    async def session_info(self, session_id: str, salt: str | None) -> SessionInfo: ...

    async def delete_session(self, session_id: str, salt: str | None) -> None: ...

    async def fork_session(
        self, session_id: str, turn: int | None, salt: str | None, new_id: str | None = None
    ) -> SessionInfo:
        """Fork `session_id` at `turn` (None: its latest) into a new session (`new_id`, or a
        generated id) sharing its segments; the fork's info, in the same trip."""

    def state(self) -> EngineState:
        """The last published state, with the thread's liveness read now."""

    def cold_root(self) -> Path | None:
        """The bank's SSD directory (None: RAM only, or no bank)."""


class LocalEngineClient:
    """`EngineClient` over an `Engine` in this process."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        store = engine.store
        self._bank: Bank | None = store if isinstance(store, Bank) else None

    @property
    def alive(self) -> bool:
        return self._engine.alive

    @property
    def warming(self) -> bool:
        return self._engine.warming

    @property
    def has_sessions(self) -> bool:
        return self._bank is not None

    def generate(self, request: GenerationRequest) -> RequestHandle:
        if not self._engine.alive:
            raise EngineUnavailable(DEAD)
        handle = RequestHandle(request, asyncio.get_running_loop())
        self._engine.submit(handle)
        return handle

    async def list_sessions(self, salt: str | None) -> list[SessionInfo]:
        bank = self._need_bank()
        return await self._on_engine(lambda: bank.list_sessions(salt=salt))

    async def session_info(self, session_id: str, salt: str | None) -> SessionInfo:
        bank = self._need_bank()
        return await self._on_engine(lambda: bank.info(session_id, salt=salt))

    async def delete_session(self, session_id: str, salt: str | None) -> None:
        bank = self._need_bank()
        await self._on_engine(lambda: bank.delete(session_id, salt=salt))

    async def fork_session(
        self, session_id: str, turn: int | None, salt: str | None, new_id: str | None = None
    ) -> SessionInfo:
        bank = self._need_bank()

        def fork() -> SessionInfo:
            return bank.info(bank.fork(session_id, turn, salt=salt, new_id=new_id), salt=salt)

        return await self._on_engine(fork)

    def state(self) -> EngineState:
        eng = self._engine
        st = eng.state()
        bank = st.bank
        if self._bank is not None and bank:
            # The SSD writer's queue, read now (thread-safe by the bank's contract): writes
            # finish on the writer thread while the engine may be idle and publish nothing.
            jobs, held = self._bank.writer_queue()
            bank = {**bank, "writes_pending": jobs, "write_queue_bytes": held}
        report = eng.warm_report
        return dataclasses.replace(st, alive=eng.alive, error=eng.error, bank=bank, warming=eng.warming,
                                   warm_up=report.as_dict() if report is not None else None)

    def cold_root(self) -> Path | None:
        return self._bank.cold_root if self._bank is not None else None

    def _need_bank(self) -> Bank:
        if self._bank is None:
            raise NoSessionStore("this server runs without a session bank")
        return self._bank

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        """`fn` between engine steps (the bank is engine-thread only), its errors as values."""
        if not self._engine.alive:
            raise EngineUnavailable(DEAD)
        try:
            result: T = await self._engine.call(fn)
        except SessionNotFound as exc:
            raise UnknownSession(f"session not found: {exc}", session_id=str(exc)) from exc
        except BankError as exc:
            raise SessionRefused(str(exc)) from exc
        return result
