"""The session API beside the OpenAI one: list, inspect, delete and fork sessions.

Owns: the `/v1/sessions` routes. Each is one typed command of the engine client
(`segserve.server.engine.client.EngineClient`: the bank lives on the engine thread); its
refusals are domain errors, mapped to OpenAI-shaped errors by `from_engine`.
Every route is scoped to the caller's tenant (API key) and `X-Cache-Salt`
(`segserve.server.http.openai_api.request_salt`): another tenant's sessions are "not found".
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import asdict
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from segserve.server.engine.client import EngineClient
from segserve.server.engine.errors import EngineError
from segserve.server.http.errors import InvalidRequest, NotFound, from_engine
from segserve.server.http.jsonbody import parse_json
from segserve.server.http.openai_api import request_salt, validate
from segserve.server.http.serving import Serving

T = TypeVar("T")


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    turn: int | None = Field(None, ge=0)


def _engine(request: Request) -> EngineClient:
    serving: Serving = request.app.state.serving
    return serving.engine


async def _mapped(call: Awaitable[T]) -> T:
    """A session command's refusal (unknown session 404, refused 400, no bank 404, engine
    gone 503) as the HTTP error it maps to."""
    try:
        return await call
    except EngineError as exc:
        raise from_engine(exc) from None


async def list_sessions(request: Request) -> Response:
    infos = await _mapped(_engine(request).list_sessions(request_salt(request)))
    return JSONResponse({"object": "list", "data": [asdict(i) for i in infos]})


async def get_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    info = await _mapped(_engine(request).session_info(sid, request_salt(request)))
    return JSONResponse(asdict(info))


async def delete_session(request: Request) -> Response:
    sid = request.path_params["sid"]
    await _mapped(_engine(request).delete_session(sid, request_salt(request)))
    return JSONResponse({"id": sid, "deleted": True})


async def fork_session(request: Request) -> Response:
    engine, sid, salt = _engine(request), request.path_params["sid"], request_salt(request)
    if not engine.has_sessions:  # before reading the body: no bank, nothing to fork
        raise NotFound("this server runs without a session bank")
    raw = await request.body()  # bounded by segserve.server.http.http_guard.BodyGuard
    data = parse_json(raw, "fork body") if raw.strip() else {}
    if not isinstance(data, dict):
        raise InvalidRequest('fork body must be {"turn": k}', param="turn")
    body = validate(ForkBody, data)
    info = await _mapped(engine.fork_session(sid, body.turn, salt))  # fork + info: one trip
    return JSONResponse({"id": info.id, "forked_from": sid, **asdict(info)}, status_code=201)


def session_routes() -> list[Route]:
    return [
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{sid}", get_session, methods=["GET"]),
        Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{sid}/fork", fork_session, methods=["POST"]),
    ]

