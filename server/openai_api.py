"""OpenAI endpoints: chat completions, completions, models.

Owns: turning validated bodies into `GenerationRequest`s, and events back into OpenAI JSON
(non-streaming) or SSE chunks (streaming). Runs on the event loop; never touches MLX.
An SSE stream is only started after the engine said `Started`, so refusals (429/503/507)
keep their status code; a failure after that is sent as an error event, then the stream
ends with `data: [DONE]` (a shutdown that outlasts `--shutdown-timeout` ends streams the
same way). Leaving the stream (client gone) cancels the engine request in `finally`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.errors import (
    ContextLengthExceeded,
    EngineDead,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServerError,
    ShuttingDown,
    error_body,
)
from server.events import Done, Failed, GenerationRequest, RequestHandle, Started, Token
from server.runtime import Runtime
from server.sampling import SamplingParams, TokenLogprob
from server.schemas import ChatCompletionRequest, CompletionRequest, new_id, now, usage

_DISCONNECT_POLL_S = 0.5


async def read_body(request: Request, model_cls: type[Any], limit: int) -> Any:
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {msg}" if param else msg, param=param) from exc


def _check_model(rt: Runtime, name: str) -> None:
    if name not in (rt.model_id, "default"):
        raise ModelNotFound(
            f"model {name!r} is not served here; use {rt.model_id!r} or 'default'",
            param="model",
        )


def _limit_tokens(rt: Runtime, prompt_len: int, asked: int | None) -> int:
    ctx = rt.context_length
    if asked is None:
        room = ctx - prompt_len
        if room < 1:
            raise ContextLengthExceeded(
                f"prompt has {prompt_len} tokens; the model's context is {ctx}", param="messages"
            )
        return min(rt.settings.max_tokens_default, room)
    if prompt_len + asked > ctx:
        raise ContextLengthExceeded(
            f"prompt ({prompt_len} tokens) + max_tokens ({asked}) = {prompt_len + asked} "
            f"exceeds the model's context of {ctx} tokens",
            param="max_tokens",
        )
    return asked


def _session_id(request: Request, body: Any) -> str | None:
    header = request.headers.get("x-session-id")
    if header is not None and not (0 < len(header) <= 128):
        raise InvalidRequest("X-Session-Id must be 1 to 128 characters", param="X-Session-Id")
    return header or body.prompt_cache_key


def _salt(request: Request) -> str | None:
    return request.headers.get("x-cache-salt") or None


async def chat_completions(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    body: ChatCompletionRequest = await read_body(
        request, ChatCompletionRequest, rt.settings.max_request_bytes
    )
    _check_model(rt, body.model)
    msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = rt.encode_chat(msgs)
    sampling = SamplingParams(
        body.temperature, body.top_p, body.seed, body.logprobs, body.top_logprobs or 0
    )
    return await _serve(request, rt, body, prompt, sampling, chat=True)


async def completions(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    body: CompletionRequest = await read_body(request, CompletionRequest, rt.settings.max_request_bytes)
    _check_model(rt, body.model)
    if isinstance(body.prompt, str):
        prompt = rt.tokenizer.encode(body.prompt)
    else:
        if any(not 0 <= t < rt.tokenizer.vocab_size for t in body.prompt):
            raise InvalidRequest("prompt token id out of the vocabulary", param="prompt")
        prompt = list(body.prompt)
    n_lp = body.logprobs or 0
    sampling = SamplingParams(body.temperature, body.top_p, body.seed, body.logprobs is not None, n_lp)
    return await _serve(request, rt, body, prompt, sampling, chat=False)


async def _serve(
    request: Request,
    rt: Runtime,
    body: Any,
    prompt: list[int],
    sampling: SamplingParams,
    *,
    chat: bool,
) -> Response:
    if not prompt:
        raise InvalidRequest("the prompt is empty after templating", param="messages")
    max_tokens = _limit_tokens(rt, len(prompt), body.token_limit())
    req = GenerationRequest(
        new_id("chatcmpl" if chat else "cmpl"),
        tuple(prompt),
        max_tokens,
        sampling,
        tuple(body.stops()),
        _session_id(request, body),
        _salt(request),
    )
    if rt.draining:
        raise ShuttingDown()
    if not rt.engine.alive:
        raise EngineDead("the engine thread is not running; see /health")
    handle = RequestHandle(req, asyncio.get_running_loop())
    rt.engine.submit(handle)
    try:
        first = await handle.queue.get()
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Started)
    except BaseException:
        handle.cancel()
        raise
    state = request.scope.setdefault("state", {})
    state["session_id"] = first.session_id
    state["user"] = body.user  # OpenAI's end-user id: recorded in the access log
    fmt = _Formatter(rt.model_id, req.request_id, chat, rt)
    headers = {"X-Session-Id": first.session_id} if first.session_id else {}
    if body.stream:
        gen = _stream(handle, fmt, body.include_usage(), request)
        return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
    return JSONResponse(await _collect(handle, fmt, request), headers=headers)


async def _next_event(handle: RequestHandle, request: Request) -> Any:
    while True:
        try:
            return await asyncio.wait_for(handle.queue.get(), _DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                handle.cancel()
                raise asyncio.CancelledError("client disconnected") from None


async def _collect(handle: RequestHandle, fmt: _Formatter, request: Request) -> dict[str, Any]:
    parts: list[str] = []
    lps: list[TokenLogprob] = []
    try:
        while True:
            ev = await _next_event(handle, request)
            if isinstance(ev, Token):
                parts.append(ev.text)
                if ev.logprob is not None:
                    lps.append(ev.logprob)
            elif isinstance(ev, Failed):
                raise ev.error
            elif isinstance(ev, Done):
                parts.append(ev.tail_text)
                request.scope["state"]["tokens"] = ev.completion_tokens
                return fmt.full("".join(parts), lps, ev)
    finally:
        handle.cancel()  # no-op once Done; frees the request if we leave early


async def _stream(
    handle: RequestHandle, fmt: _Formatter, include_usage: bool, request: Request
) -> AsyncIterator[str]:
    try:
        if fmt.chat:
            yield _sse(fmt.chunk(role=True))
        while True:
            ev = await handle.queue.get()
            if isinstance(ev, Token):
                if ev.text or ev.logprob is not None:
                    yield _sse(fmt.chunk(text=ev.text, logprob=ev.logprob))
            elif isinstance(ev, Failed):
                yield _sse(error_body(ev.error))
                break
            elif isinstance(ev, Done):
                request.scope["state"]["tokens"] = ev.completion_tokens
                if ev.tail_text:
                    yield _sse(fmt.chunk(text=ev.tail_text))
                yield _sse(fmt.chunk(finish=ev.finish_reason))
                if include_usage:
                    yield _sse(fmt.usage_chunk(ev))
                break
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Formatter:
    def __init__(self, model: str, rid: str, chat: bool, rt: Runtime) -> None:
        self.model, self.rid, self.chat, self.rt = model, rid, chat, rt
        self.created = now()

    def _lp_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(tid: int, val: float) -> dict[str, Any]:
            s = self.rt.tokenizer.decode([tid])
            return {"token": s, "logprob": val, "bytes": list(s.encode())}

        entry = one(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in lp.top]
        return entry

    def _lp_block(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._lp_entry(lp) for lp in lps]}
        toks = [self.rt.tokenizer.decode([lp.token_id]) for lp in lps]
        return {
            "tokens": toks,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {self.rt.tokenizer.decode([t]): v for t, v in lp.top} for lp in lps
            ],
        }

    def full(self, text: str, lps: list[TokenLogprob], done: Done) -> dict[str, Any]:
        logprobs = self._lp_block(lps) if lps else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
        }

    def chunk(
        self,
        *,
        text: str = "",
        role: bool = False,
        finish: str | None = None,
        logprob: TokenLogprob | None = None,
    ) -> dict[str, Any]:
        lp = self._lp_block([logprob]) if logprob is not None else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": lp}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text:
                delta = {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        out = self.chunk()
        out["choices"] = []
        out["usage"] = usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        return out


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": rt.model_id, "object": "model", "created": rt.started, "owned_by": "segserve"}
            ],
        }
    )


def error_response(exc: ServerError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
