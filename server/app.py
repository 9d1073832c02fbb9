"""The Starlette application: routes, auth, access log, error mapping.

Owns: `create_app(rt)`. Errors are mapped to HTTP in exactly one place (the exception
handlers below); the access log and request metrics are one pure-ASGI middleware so
streaming responses are not buffered.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import openai_api
from server.errors import InvalidRequest, NotFound, ServerError, Unauthorized, error_body
from server.runtime import Runtime

access_log = logging.getLogger("segserve.access")
log = logging.getLogger("segserve")

_OPEN_PATHS = {"/health"}


class AccessAndAuth:
    """Checks the API key, then logs one line per request and counts it."""

    def __init__(self, app: ASGIApp, rt: Runtime) -> None:
        self.app = app
        self.rt = rt
        key = rt.settings.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}
        scope.setdefault("state", {})

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.rt.inflight += 1  # a graceful shutdown waits for these (server.lifecycle)
        try:
            if self._key is not None and scope["path"] not in _OPEN_PATHS and not self._authorized(scope):
                exc = Unauthorized("missing or wrong API key (Authorization: Bearer <key>)")
                await openai_api.error_response(exc)(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            self.rt.inflight -= 1
            self._log(scope, status["code"], time.perf_counter() - start)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value.startswith(b"Bearer "):
                assert self._key is not None
                return hmac.compare_digest(value[7:], self._key)
        return False

    def _log(self, scope: Scope, status: int, seconds: float) -> None:
        path = scope["path"]
        st = scope["state"]
        access_log.info(
            "%s %s %d tokens=%s %.3fs session=%s user=%s", scope["method"], path, status,
            st.get("tokens", "-"), seconds, st.get("session_id") or "-", st.get("user") or "-",
        )
        endpoint = path if path in _KNOWN else ("/v1/sessions/*" if path.startswith("/v1/sessions/") else "other")
        self.rt.metrics.request(endpoint, status)


async def _server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServerError)
    return openai_api.error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: ServerError = NotFound(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        err = InvalidRequest(f"method {request.method} not allowed on {request.url.path}")
        err.status = 405
    else:
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
    return JSONResponse(error_body(err), status_code=err.status)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    body = {"error": {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}}
    return JSONResponse(body, status_code=500)


async def health(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    body = rt.health()
    return JSONResponse(body, status_code=200 if rt.engine.alive and not rt.draining else 503)


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    data, ctype = rt.metrics.render()
    return Response(data, media_type=ctype)


def _routes() -> list[Route]:
    from server.sessions_api import session_routes

    return session_routes() + [
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


_KNOWN = {r.path for r in _routes()}


def create_app(rt: Runtime, extra_routes: list[Route] | None = None) -> Any:
    app = Starlette(
        routes=_routes() + (extra_routes or []),
        exception_handlers={
            ServerError: _server_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.rt = rt
    return AccessAndAuth(app, rt)
