"""Why the engine refused or ended a request, as plain values (no HTTP here).

Owns: `EngineError` and its kinds. The engine thread puts one in a `Failed` event, or sets it
on a session-API call's future once it can answer nothing more. Each carries only what the
engine knows (seconds until a retry can succeed, what admission priced, the phase that
failed); `segserve.server.http.errors.from_engine` is the one place a kind becomes a status
code and an error body (OpenAI's shape, or Anthropic's under `/v1/messages`).
"""

from __future__ import annotations

from collections.abc import Mapping


class EngineError(Exception):
    """A request the engine could not serve; `message` is what its client reads."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(EngineError):
    """The wait queue is full (or waiting is disabled): transient, retry after a while."""

    def __init__(self, message: str, *, retry_after_s: float, waiting: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.waiting = waiting


class WaitTimedOut(EngineError):
    """Waited longer than the queue allows for memory held by running requests."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InsufficientMemory(EngineError):
    """The request cannot fit, even with every evictable snapshot gone (`reason`
    "insufficient_memory", `detail`: admission's pricing), or it grew past what it was
    admitted with while the budget is exhausted (`reason` "memory_guard")."""

    def __init__(
        self,
        message: str,
        *,
        reason: str = "insufficient_memory",
        detail: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.detail = dict(detail) if detail is not None else None


class EngineFailure(EngineError):
    """Admitting, running or storing this request raised; the engine carries on."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase


class EngineUnavailable(EngineError):
    """The engine thread has died: nothing more can be served by this process."""


class ShuttingDown(EngineError):
    """The server is stopping: new work is refused, work still running is ended."""

    def __init__(
        self, message: str = "the server is shutting down; retry later", *, retry_after_s: float = 5.0
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoSessionStore(EngineError):
    """This engine keeps no sessions (its store is not the session bank)."""


class UnknownSession(EngineError):
    """No such session for this tenant (another tenant's sessions are unknown too)."""

    def __init__(self, message: str, *, session_id: str) -> None:
        super().__init__(message)
        self.session_id = session_id


class SessionRefused(EngineError):
    """The bank refused a session command (e.g. a turn index the session does not have)."""
