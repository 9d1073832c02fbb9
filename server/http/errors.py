"""Errors defined once, mapped once to HTTP (OpenAI's error shape).

Owns: the `ServerError` hierarchy and `error_body`. The Starlette exception handlers in
`segserve.server.http.app` are the only place these become responses; inside a started SSE stream the
same body is sent as an error event instead (the status line is already gone).
"""

from __future__ import annotations

from typing import Any


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
