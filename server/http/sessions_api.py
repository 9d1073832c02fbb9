"""The session API beside the OpenAI one: list, inspect, delete and fork sessions.

Owns: the `/v1/sessions` routes. Every bank call runs on the engine thread through
`Engine.call` (the bank is engine-thread only); bank errors map to OpenAI-shaped errors.
Every route is scoped to the caller's tenant (API key) and `X-Cache-Salt`
(`segserve.server.http.openai_api.request_salt`): another tenant's sessions are "not found".
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from segserve.bank import BankError, SessionNotFound
from segserve.server.http.errors import EngineDead, InvalidRequest, NotFound
from segserve.server.http.jsonbody import parse_json
from segserve.server.http.openai_api import request_salt, validate
from segserve.server.runtime import Runtime


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    turn: int | None = Field(None, ge=0)


def _bank(rt: Runtime) -> Any:
    bank = getattr(rt.engine.store, "bank", None)
    if bank is None:
        raise NotFound("this server runs without a session bank")
    return bank


async def _on_engine(rt: Runtime, fn: Any) -> Any:
    if not rt.engine.alive:
        raise EngineDead("the engine thread is not running; see /health")
    try:
        return await rt.engine.call(fn)
    except SessionNotFound as exc:
        raise NotFound(f"session not found: {exc}", code="session_not_found") from exc
    except BankError as exc:
        raise InvalidRequest(str(exc)) from exc


_salt = request_salt


async def list_sessions(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    bank, salt = _bank(rt), _salt(request)
    infos = await _on_engine(rt, lambda: bank.list_sessions(salt=salt))
    return JSONResponse({"object": "list", "data": [asdict(i) for i in infos]})


async def get_session(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    bank, sid, salt = _bank(rt), request.path_params["sid"], _salt(request)
    info = await _on_engine(rt, lambda: bank.info(sid, salt=salt))
    return JSONResponse(asdict(info))


async def delete_session(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    bank, sid, salt = _bank(rt), request.path_params["sid"], _salt(request)
    await _on_engine(rt, lambda: bank.delete(sid, salt=salt))
    return JSONResponse({"id": sid, "deleted": True})


async def fork_session(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    bank, sid, salt = _bank(rt), request.path_params["sid"], _salt(request)
    raw = await request.body()  # bounded by segserve.server.http.http_guard.BodyGuard
    data = parse_json(raw, "fork body") if raw.strip() else {}
    if not isinstance(data, dict):
        raise InvalidRequest('fork body must be {"turn": k}', param="turn")
    body = validate(ForkBody, data)
    new_id = await _on_engine(rt, lambda: bank.fork(sid, body.turn, salt=salt))
    info = await _on_engine(rt, lambda: bank.info(new_id, salt=salt))
    return JSONResponse({"id": new_id, "forked_from": sid, **asdict(info)}, status_code=201)


def session_routes() -> list[Route]:
    return [
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{sid}", get_session, methods=["GET"]),
        Route("/v1/sessions/{sid}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{sid}/fork", fork_session, methods=["POST"]),
    ]

