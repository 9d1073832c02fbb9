"""OpenAI endpoints: chat completions, completions, models.

Owns: turning validated bodies into `GenerationRequest`s, and events back into OpenAI JSON
(non-streaming) or SSE chunks (streaming). Runs on the event loop; never touches MLX.
Template rendering and tokenizing run in a worker thread (at most two at once), so a
multi-megabyte prompt never stalls other clients.
An SSE stream is only started after the engine said `Started`, so refusals (429/503/507)
keep their status code; a failure after that is sent as an error event, then the stream
ends with `data: [DONE]` (a shutdown that outlasts `--shutdown-timeout` ends streams the
same way). A client that leaves cancels its engine request: while it waits in the queue
and while a non-streaming answer is collected, a watcher on the connection's `receive`
notices the disconnect at once; a stream's `finally` (and the response wrapper, should the
stream never start) does the same.
Client-chosen ids are echoed into `X-Session-Id` only when they are a safe header value
(`server.tenants.safe_header_value`); otherwise the header is left out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.engine import Done, Failed, GenerationRequest, RequestHandle, Started, Token
from server.errors import (
    ClientClosed,
    ContextLengthExceeded,
    EngineDead,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServerError,
    ShuttingDown,
    error_body,
)
from server.jsonbody import parse_json
from server.runner import SamplingParams, TokenLogprob
from server.runtime import Runtime
from server.schemas import ChatCompletionRequest, CompletionRequest, new_id, now, usage
from server.tenants import bank_salt, check_cache_salt, safe_header_value

T = TypeVar("T")
_TOKENIZE_THREADS = 2


async def read_body(request: Request, model_cls: type[Any], limit: int) -> Any:
    raw = await request.body()  # already bounded by server.http_guard.BodyGuard
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    return validate(model_cls, data)


def validate(model_cls: type[Any], data: Any) -> Any:
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {msg}" if param else msg, param=param) from exc


async def off_loop(rt: Runtime, fn: Callable[..., T], *args: Any) -> T:
    """Run CPU-bound request work (template, tokenizer) in a worker thread."""
    if rt.cpu_limiter is None:
        rt.cpu_limiter = anyio.CapacityLimiter(_TOKENIZE_THREADS)
    return await anyio.to_thread.run_sync(fn, *args, limiter=rt.cpu_limiter)


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


def request_salt(request: Request) -> str | None:
    """The bank salt of this request: its tenant (from the API key) + `X-Cache-Salt`."""
    try:
        salt = check_cache_salt(request.headers.get("x-cache-salt"))
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="X-Cache-Salt") from None
    tenant = request.scope.get("state", {}).get("tenant", "")
    return bank_salt(tenant, salt)


async def chat_completions(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    body: ChatCompletionRequest = await read_body(
        request, ChatCompletionRequest, rt.settings.max_request_bytes
    )
    _check_model(rt, body.model)
    msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = await off_loop(rt, rt.encode_chat, msgs)
    sampling = SamplingParams(
        body.temperature, body.top_p, body.seed, body.logprobs, body.top_logprobs or 0
    )
    return await _serve(request, rt, body, prompt, sampling, chat=True)


async def completions(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    body: CompletionRequest = await read_body(request, CompletionRequest, rt.settings.max_request_bytes)
    _check_model(rt, body.model)
    if isinstance(body.prompt, str):
        prompt = await off_loop(rt, rt.tokenizer.encode, body.prompt)
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
        request_salt(request),
    )
    if rt.draining:
        raise ShuttingDown()
    if not rt.engine.alive:
        raise EngineDead("the engine thread is not running; see /health")
    handle = RequestHandle(req, asyncio.get_running_loop())
    state = request.scope.setdefault("state", {})
    state["user"] = body.user  # OpenAI's end-user id: recorded (escaped) in the access log
    rt.engine.submit(handle)
    try:
        first = await _unless_disconnected(request, handle, handle.queue.get)
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Started)
    except BaseException:
        handle.cancel()
        raise
    state["session_id"] = first.session_id
    fmt = _Formatter(rt.model_id, req.request_id, chat, rt)
    echo = safe_header_value(first.session_id)
    headers = {"X-Session-Id": echo} if echo else {}
    if body.stream:
        gen = _stream(handle, fmt, body.include_usage(), request)
        return _EngineStream(handle, gen, media_type="text/event-stream", headers=headers)
    try:
        result = await _unless_disconnected(request, handle, lambda: _collect(handle, fmt, request))
    finally:
        handle.cancel()  # no-op once Done; frees the request if we leave early
    return JSONResponse(result, headers=headers)


async def _unless_disconnected(
    request: Request, handle: RequestHandle, work: Callable[[], Awaitable[T]]
) -> T:
    """`work()`, unless the client disconnects first: then the engine request is
    cancelled and `ClientClosed` is raised (its response goes nowhere)."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnect(request.receive))
    finished = False
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finished = task in done
    finally:
        watch.cancel()
        if not finished:
            task.cancel()
            handle.cancel()
    if not finished:
        request.scope.setdefault("state", {})["client_gone"] = True
        raise ClientClosed("the client closed the connection; the request was cancelled")
    return task.result()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EngineStream(StreamingResponse):
    """A stream that cancels its engine request however the response ends, including
    when it fails before the body iterator ever started."""

    def __init__(self, handle: RequestHandle, content: AsyncIterator[str], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.cancel()


async def _collect(handle: RequestHandle, fmt: _Formatter, request: Request) -> dict[str, Any]:
    parts: list[str] = []
    lps: list[TokenLogprob] = []
    while True:
        ev = await handle.queue.get()
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


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote client text (a field name, a
    lone surrogate) that UTF-8 cannot encode; escaped, it always can."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: ServerError) -> JSONResponse:
    return ErrorResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
