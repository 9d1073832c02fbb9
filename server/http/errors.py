"""Errors defined once, mapped once to HTTP (OpenAI's error shape).

Owns: the `ServerError` hierarchy, `error_body`, and `from_engine`: the one mapping from the
engine's refusals and failures (`segserve.server.engine.errors`, plain values) to a status and
a body (queue full 429, wait timed out 503, cannot fit 507, engine gone 503, failed 500,
unknown session 404, a refused session command 400). The
Starlette exception handlers in `segserve.server.http.app` are the only place these become
responses (Anthropic's shape under `/v1/messages`, else OpenAI's); inside a started SSE stream
the same body is sent as an error event instead (the status line is already gone).
"""

from __future__ import annotations

from typing import Any

from segserve.server.engine import errors as engine_errors


class ServerError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}
        self.extra = extra or {}


class InvalidRequest(ServerError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(ServerError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(ServerError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class RequestTimeout(InvalidRequest):
    """The client took longer than `--body-timeout` to send the request body."""

    status = 408
    code = "request_timeout"


class ClientClosed(ServerError):
    """The client closed the connection before the answer: nobody reads this response
    (logged as 499, like nginx); the engine work was cancelled."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class QueueFull(ServerError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class WaitTimedOut(ServerError):
    status = 503
    type = "server_error"
    code = "wait_timeout"


class EngineDead(ServerError):
    status = 503
    type = "server_error"
    code = "engine_unavailable"


class ShuttingDown(ServerError):
    """The server got SIGTERM/SIGINT: new requests are refused, and requests still running
    when `--shutdown-timeout` ends are ended with this error."""

    status = 503
    type = "server_error"
    code = "shutting_down"

    def __init__(self, message: str = "the server is shutting down; retry later") -> None:
        super().__init__(message, headers={"Retry-After": "5"})


class InsufficientMemory(ServerError):
    status = 507
    type = "server_error"
    code = "insufficient_memory"


class GenerationFailed(ServerError):
    status = 500
    type = "server_error"
    code = "generation_failed"


def error_body(exc: ServerError) -> dict[str, Any]:
    err: dict[str, Any] = {
        "message": exc.message,
        "type": exc.type,
        "param": exc.param,
        "code": exc.code,
    }
    err.update(exc.extra)
    return {"error": err}


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(int(seconds))}


def from_engine(exc: engine_errors.EngineError) -> ServerError:
    """The HTTP error a client gets for what the engine refused or ended."""
    e = engine_errors
    if isinstance(exc, e.QueueFull):
        return QueueFull(exc.message, headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, e.WaitTimedOut):
        return WaitTimedOut(exc.message, headers=_retry_after(exc.retry_after_s))
    if isinstance(exc, e.InsufficientMemory):
        extra: dict[str, Any] = {"detail": exc.detail} if exc.detail is not None else {}
        return InsufficientMemory(exc.message, code=exc.reason, extra=extra)
    if isinstance(exc, e.ShuttingDown):
        out = ShuttingDown(exc.message)
        out.headers = _retry_after(exc.retry_after_s)
        return out
    if isinstance(exc, e.EngineUnavailable):
        return EngineDead(exc.message)
    if isinstance(exc, e.UnknownSession):
        return NotFound(exc.message, code="session_not_found")
    if isinstance(exc, e.NoSessionStore):
        return NotFound(exc.message)
    if isinstance(exc, e.SessionRefused):
        return InvalidRequest(exc.message)
    return GenerationFailed(exc.message)
