"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the same sessions.

Owns: the two routes, Anthropic's answer and SSE event shapes, and Anthropic's error shape
for every answer under `/v1/messages` (`owns(path)`; `segserve.server.http.app` asks it once per error).
A Messages body is translated to the chat route's `ChatCompletionRequest`
(`segserve.server.http.anthropic_schemas.chat_data`), then prepared (`prepare_chat`: template, tool
presentation, grammar for a forced tool), submitted (`start_generation`: sessions by
`X-Session-Id` or the longest stored token prefix, admission) and parsed for tool calls by
the chat route's own code. So a conversation is stored in the same bank under the same
tokens whichever API carries it, and an agent loop that resends its history reuses its rows.

Usage, as Anthropic counts it: `cache_read_input_tokens` = prompt tokens whose rows were
reused from the bank, `input_tokens` = the rest (prefilled by this request), and
`cache_creation_input_tokens` = 0 (storing a turn costs nothing extra here, and every turn
is stored). `count_tokens` answers the whole prompt: input + cache read of the same request.

`stop_reason`: "max_tokens" (the limit), "tool_use" (the answer holds tool calls),
"stop_sequence" (one of `stop_sequences` ended it: `stop_sequence` names which; found by
decoding the answer's tokens once, since the stop string itself is never emitted), else
"end_turn". A forced tool (`tool_choice` any/tool) answers only tool_use blocks.

Streaming: `message_start` (usage with the input counts), `ping`, then per block
`content_block_start`, deltas (`text_delta`, or `input_json_delta` whose `partial_json`
pieces concatenate to the call's input as the model wrote it), `content_block_stop`; then
`message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. A failure after
the stream started is an `error` event, then the stream ends. Refusals before it started
(429/503/507) keep their status code, as on the chat route.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from segserve.server.chat.tool_calls import (
    ContentDelta,
    Delta,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
)
from segserve.server.engine import Done, Failed, RequestHandle, Started, Token
from segserve.server.http.anthropic_schemas import CountTokensRequest, MessagesRequest, chat_data
from segserve.server.http.errors import EngineDead, ServerError, Unauthorized, from_engine
from segserve.server.http.openai_api import (
    ChatPlan,
    ErrorResponse,
    _EngineStream,
    _session_id,
    _ToolOutput,
    _unless_disconnected,
    off_loop,
    prepare_chat,
    read_body,
    start_generation,
    validate,
)
from segserve.server.http.schemas import ChatCompletionRequest
from segserve.server.http.serving import Serving
from segserve.server.http.tenants import safe_header_value

PREFIX = "/v1/messages"

# Our statuses → Anthropic's error types (the status itself is kept).
_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
    503: "overloaded_error", 507: "overloaded_error",
}


def owns(path: str) -> bool:
    """Whether errors on this path are answered in Anthropic's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(exc: ServerError) -> str:
    if isinstance(exc, Unauthorized):
        return "authentication_error"
    if isinstance(exc, EngineDead):
        return "api_error"  # not load: the engine thread is gone until a restart
    return _TYPE_BY_STATUS.get(exc.status, "api_error")


def error_body(exc: ServerError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; details our errors carry (what a
    507 needs and holds, when a retry can succeed) ride along inside `error`."""
    return {"type": "error", "error": {"type": error_type(exc), "message": exc.message, **exc.extra}}


def error_response(exc: ServerError) -> Response:
    return ErrorResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def internal_error() -> Response:
    return JSONResponse({"type": "error", "error": {"type": "api_error", "message": "internal error"}},
                        status_code=500)


def _toolu_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _msg_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "output_tokens": output,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


async def _prepare(rt: Serving, body: CountTokensRequest) -> tuple[ChatCompletionRequest, ChatPlan]:
    cbody: ChatCompletionRequest = validate(ChatCompletionRequest, chat_data(body))
    return cbody, await prepare_chat(rt, cbody)


async def count_tokens(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: CountTokensRequest = await read_body(request, CountTokensRequest, rt.settings.max_request_bytes)
    _, plan = await _prepare(rt, body)
    return JSONResponse({"input_tokens": len(plan.prompt)})


async def messages(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: MessagesRequest = await read_body(request, MessagesRequest, rt.settings.max_request_bytes)
    cbody, plan = await _prepare(rt, body)
    handle, first = await start_generation(
        request, rt, cbody, plan.prompt, plan.sampling, prefix="msg",
        session_id=_session_id(request, cbody), matcher=plan.matcher,
    )
    echo = safe_header_value(first.session_id)
    headers = {"X-Session-Id": echo} if echo else {}
    turn = _Turn(rt, _msg_id(), plan.tools, cbody.stops())
    if body.stream:
        gen = _stream(turn, handle, first, request)
        return _EngineStream(handle, gen, media_type="text/event-stream", headers=headers)
    try:
        text, ids, done = await _unless_disconnected(request, handle, lambda: _collect(handle))
    finally:
        handle.cancel()  # no-op once Done; frees the request if we leave early
    request.scope["state"]["tokens"] = done.completion_tokens
    return JSONResponse(await turn.message(text, ids, done), headers=headers)


async def _collect(handle: RequestHandle) -> tuple[str, list[int], Done]:
    parts: list[str] = []
    ids: list[int] = []
    while True:
        ev = await handle.queue.get()
        if isinstance(ev, Token):
            parts.append(ev.text)
            ids.append(ev.token_id)
        elif isinstance(ev, Failed):
            raise from_engine(ev.error)
        elif isinstance(ev, Done):
            parts.append(ev.tail_text)
            return "".join(parts), ids, ev


class _Turn:
    """One Messages answer: its id, how its text is read, and how it ended."""

    def __init__(self, rt: Serving, mid: str, tools: _ToolOutput | None, stops: list[str]) -> None:
        self.rt, self.id, self.tools, self.stops = rt, mid, tools, stops

    def shell(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.rt.model_id,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage,
        }

    async def ending(self, text: str, ids: list[int], done: Done, calls: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of an answer whose emitted text is `text`."""
        if done.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if done.finish_reason == "stop" and self.stops:
            # The stop string is held back, never emitted: it starts where the text ends
            # in the decoded tokens (the earliest one wins, then the first listed).
            full = await off_loop(self.rt, self.rt.tokenizer.decode, ids)
            found = [(full.find(s, max(0, len(text) - len(s))), i, s) for i, s in enumerate(self.stops)]
            hits = sorted((at, i, s) for at, i, s in found if 0 <= at <= len(text))
            if hits:
                return "stop_sequence", hits[0][2]
        return "end_turn", None

    async def message(self, text: str, ids: list[int], done: Done) -> dict[str, Any]:
        blocks: list[dict[str, Any]] = []
        content = text
        if self.tools is not None:
            parsed = parse_tool_calls(text, self.tools.family, id_factory=_toolu_id)
            calls = parsed.tool_calls if self.tools.parallel else parsed.tool_calls[:1]
            content = "" if self.tools.forced else parsed.content
            blocks = [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                      for c in calls]
        if content or not blocks:
            blocks.insert(0, {"type": "text", "text": content})
        reason, seq = await self.ending(text, ids, done, any(b["type"] == "tool_use" for b in blocks))
        out = self.shell(_usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens))
        out.update(content=blocks, stop_reason=reason, stop_sequence=seq)
        return out


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Blocks:
    """Parsed deltas → content block events, one block open at a time."""

    def __init__(self, tools: _ToolOutput | None) -> None:
        self.parallel = tools.parallel if tools is not None else True
        self.forced = tools.forced if tools is not None else False  # text is cut-off markup
        self.count = 0
        self.open: str | None = None  # "text" or "tool:<call index>"
        self.calls = 0

    def _start(self, key: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = key
        return [*out, _event("content_block_start", index=self.count, content_block=block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]

    def feed(self, deltas: list[Delta]) -> list[str]:
        out: list[str] = []
        for d in deltas:
            if isinstance(d, ContentDelta) and d.text and not self.forced:
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", index=self.count,
                                  delta={"type": "text_delta", "text": d.text}))
            elif isinstance(d, ToolCallDelta) and (self.parallel or d.index == 0):
                key = f"tool:{d.index}"
                if self.open != key:
                    self.calls += 1
                    out += self._start(key, {"type": "tool_use", "id": d.id or _toolu_id(),
                                             "name": d.name or "", "input": {}})
                if d.arguments:
                    out.append(_event("content_block_delta", index=self.count,
                                      delta={"type": "input_json_delta", "partial_json": d.arguments}))
        return out

    def end(self) -> list[str]:
        """Close the open block; an answer with no block at all gets an empty text block."""
        if self.count == 0 and self.open is None:
            return [*self._start("text", {"type": "text", "text": ""}), *self.close()]
        return self.close()


async def _stream(turn: _Turn, handle: RequestHandle, first: Started, request: Request) -> AsyncIterator[str]:
    calls: ToolCallStream | None = (
        ToolCallStream(turn.tools.family, id_factory=_toolu_id) if turn.tools is not None else None
    )
    blocks = _Blocks(turn.tools)
    parts: list[str] = []
    ids: list[int] = []
    try:
        yield _event("message_start", message=turn.shell(_usage(first.prompt_tokens, first.cached_tokens, 0)))
        yield _event("ping")
        while True:
            ev = await handle.queue.get()
            if isinstance(ev, Token):
                parts.append(ev.text)
                ids.append(ev.token_id)
                deltas: list[Delta] = calls.feed(ev.text) if calls is not None else [ContentDelta(ev.text)]
                for s in blocks.feed(deltas):
                    yield s
            elif isinstance(ev, Failed):
                yield _event("error", error=error_body(from_engine(ev.error))["error"])
                return
            elif isinstance(ev, Done):
                parts.append(ev.tail_text)
                tail: list[Delta] = (calls.feed(ev.tail_text) + calls.finish() if calls is not None
                                     else [ContentDelta(ev.tail_text)])
                for s in [*blocks.feed(tail), *blocks.end()]:
                    yield s
                request.scope["state"]["tokens"] = ev.completion_tokens
                reason, seq = await turn.ending("".join(parts), ids, ev, blocks.calls > 0)
                usage = _usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
                yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=usage)
                yield _event("message_stop")
                return
    except ServerError as exc:
        yield _event("error", error=error_body(exc)["error"])
    finally:
        handle.cancel()


def anthropic_routes() -> list[Route]:
    return [
        Route(PREFIX, messages, methods=["POST"]),
        Route(PREFIX + "/count_tokens", count_tokens, methods=["POST"]),
    ]


__all__ = ["anthropic_routes", "error_body", "error_response", "owns"]
