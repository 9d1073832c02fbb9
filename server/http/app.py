"""The Starlette application: routes, auth, tenants, access log, error mapping.

Owns: `create_app(rt)`. Errors are mapped to HTTP in exactly one place (the exception
handlers below); the access log and request metrics are one pure-ASGI middleware so
streaming responses are not buffered. The API key picks the request's tenant
(`segserve.server.http.tenants`); the body is read under `segserve.server.http.http_guard.BodyGuard`'s limits.

Errors take OpenAI's shape, and Anthropic's under `/v1/messages` (`_error_response`, the one
place that chooses). The key comes as `Authorization: Bearer KEY` or `x-api-key: KEY`.
An unexpected exception becomes a 500 in that shape and the keep-alive connection
stays usable (Starlette re-raises after its handler answered; that re-raise stops here,
once the response is complete, instead of making uvicorn drop the connection).
`/health` without a valid key (when keys are set) says only whether the server is alive
and ready; the details (model, bank, admission) need the key. With `--cors-allow-origins`,
Starlette's CORSMiddleware wraps it all (preflights answered before the key check).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from segserve.server.engine.errors import EngineError
from segserve.server.http import anthropic_api, openai_api
from segserve.server.http.errors import (
    InvalidRequest,
    NotFound,
    ServerError,
    Unauthorized,
    from_engine,
)
from segserve.server.http.http_guard import BodyGuard
from segserve.server.http.serving import Serving
from segserve.server.http.tenants import KeyTable, load_keys, log_safe

access_log = logging.getLogger("segserve.access")
log = logging.getLogger("segserve")

_OPEN_PATHS = {"/health"}


class AccessAndAuth:
    """Checks the API key (its tenant goes to `scope["state"]["tenant"]`), then logs one
    line per request and counts it."""

    def __init__(self, app: ASGIApp, rt: Serving, keys: KeyTable) -> None:
        self.app = app
        self.rt = rt
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        progress = {"code": 0, "complete": False}
        state = scope.setdefault("state", {})

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Logged before the last byte leaves, so a client that has its answer can
                # rely on the line (and the request counter) being there already.
                if not progress["complete"]:
                    self._log(scope, int(progress["code"]), time.perf_counter() - start)
                progress["complete"] = True
            await send(message)

        self.rt.inflight += 1  # a graceful shutdown waits for these (segserve.server.lifecycle)
        try:
            tenant = self._tenant(scope) if self.keys.enabled else ""
            state["tenant"] = tenant or ""
            state["authenticated"] = tenant is not None
            if tenant is None and scope["path"] not in _OPEN_PATHS:
                exc = Unauthorized("missing or wrong API key (Authorization: Bearer <key>, or x-api-key: <key>)")
                await _error_response(scope["path"], exc)(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        except Exception:
            if progress["complete"]:
                pass  # answered (and logged) by the 500 handler; keep the connection
            elif progress["code"]:
                raise  # a started response cannot be finished: uvicorn closes it
            else:
                log.exception("unhandled error on %s", scope["path"])
                await _internal_error(scope["path"])(scope, receive, send_wrapper)
        finally:
            self.rt.inflight -= 1
            if not progress["complete"]:
                code = progress["code"] or (499 if state.get("client_gone") else 500)
                self._log(scope, int(code), time.perf_counter() - start)

    def _tenant(self, scope: Scope) -> str | None:
        """The tenant of the presented key: `Authorization: Bearer KEY`, else (Anthropic's
        clients) `x-api-key: KEY`; either header works on every route."""
        api_key: bytes | None = None
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value.startswith(b"Bearer "):
                return self.keys.tenant_for(value[7:])
            if name == b"x-api-key":
                api_key = value
        return self.keys.tenant_for(api_key) if api_key is not None else None

    def _log(self, scope: Scope, status: int, seconds: float) -> None:
        path = scope["path"]
        st = scope["state"]
        access_log.info(
            "%s %s %d tokens=%s spec=%s %.3fs session=%s user=%s", scope["method"], log_safe(path),
            status, st.get("tokens", "-"), st.get("spec", "-"), seconds, log_safe(st.get("session_id") or "-"),
            log_safe(st.get("user") or "-"),
        )
        endpoint = path if path in _KNOWN else (
            "/v1/sessions/*" if path.startswith("/v1/sessions/")
            else "/v1/models/*" if path.startswith("/v1/models/") else "other"
        )
        self.rt.metrics.request(endpoint, status)


def _error_response(path: str, exc: ServerError) -> Response:
    """The one place an error picks its shape: Anthropic's under `/v1/messages`, else OpenAI's."""
    if anthropic_api.owns(path):
        return anthropic_api.error_response(exc)
    return openai_api.error_response(exc)


def _internal_error(path: str) -> Response:
    if anthropic_api.owns(path):
        return anthropic_api.internal_error()
    body = {"error": {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}}
    return JSONResponse(body, status_code=500)


async def _server_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServerError)
    return _error_response(request.url.path, exc)


async def _engine_error(request: Request, exc: Exception) -> Response:
    """An engine refusal that reached the app unmapped (a session-API call refused because
    the engine stopped): mapped here like every other."""
    assert isinstance(exc, EngineError)
    return _error_response(request.url.path, from_engine(exc))


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
    return _error_response(request.url.path, err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _internal_error(request.url.path)


async def health(request: Request) -> Response:
    """Liveness and readiness for everyone; the details only with the key (if one is set)."""
    rt: Serving = request.app.state.serving
    # 503 while warming up too: a load balancer's readiness check (status only) waits for it.
    code = 200 if rt.ready else 503
    if not request.scope.get("state", {}).get("authenticated", True):
        return JSONResponse(rt.health_minimal(), status_code=code)
    return JSONResponse(rt.health(), status_code=code)


async def metrics(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    data, ctype = rt.metrics.render()
    return Response(data, media_type=ctype)


def _routes() -> list[Route]:
    from segserve.server.http.responses_api import response_routes
    from segserve.server.http.sessions_api import session_routes
    from segserve.server.http.tokenize_api import tokenize_routes

    return session_routes() + response_routes() + tokenize_routes() + anthropic_api.anthropic_routes() + [
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", openai_api.retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


async def openapi(request: Request) -> Response:
    """The OpenAPI document, generated from the request models (`segserve.server.http.openapi`)."""
    from segserve.server.http.openapi import openapi_document
    from segserve.server.version import __version__

    return JSONResponse(openapi_document(_routes(), version=__version__))


_KNOWN = {r.path for r in _routes()}


def create_app(
    rt: Serving, extra_routes: list[Route] | None = None, keys: KeyTable | None = None
) -> Any:
    """The ASGI app: auth and access log, then the body limits, then the routes. `keys`
    defaults to those of the settings (`--api-key`, `--api-key-file`)."""
    if keys is None:
        keys = load_keys(rt.settings.api_key, rt.settings.api_key_file)
    app = Starlette(
        routes=_routes() + (extra_routes or []),
        exception_handlers={
            ServerError: _server_error,
            EngineError: _engine_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.serving = rt
    guarded = BodyGuard(app, rt.settings.max_request_bytes, rt.settings.body_timeout)
    served: ASGIApp = AccessAndAuth(guarded, rt, keys)
    origins = rt.settings.cors_origins()
    if origins:
        # Outside the key check: a browser's preflight carries no Authorization header.
        # Every answer, errors included, then carries the CORS headers.
        served = CORSMiddleware(
            served, allow_origins=list(origins), allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"], expose_headers=["X-Session-Id", "Retry-After"],
        )
    return served
