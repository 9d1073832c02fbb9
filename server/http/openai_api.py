"""OpenAI endpoints: chat completions, completions, models.

Owns: turning validated bodies into `GenerationRequest`s, and events back into OpenAI JSON
(non-streaming) or SSE chunks (streaming). Runs on the event loop; never touches MLX.
Template rendering, tokenizing and grammar compiling run in a worker thread (at most two
at once), so a multi-megabyte prompt or a large JSON schema never stalls other clients.
Validation errors become HTTP errors in one place (`validate`): pydantic errors of type
`unsupported_parameter` answer `code: "unsupported_parameter"` with `param` = the field.

Tools (`segserve.server.chat`): the active tools go to the chat template; `tool_choice` "required"
or a named function compiles a grammar (`compile_tool_choice`) that the runner applies as
`GenerationRequest.matcher`, so the model cannot but call; `response_format` json_object /
json_schema compiles the same way. Generated text is parsed for tool calls in the family's
markup (`parse_tool_calls` whole, `ToolCallStream` streamed: `delta.tool_calls` with the id
and name first, then argument fragments); a reply with calls has `finish_reason:
"tool_calls"` and `content` null when nothing else was said.
An SSE stream is only started after the engine said `Started`, so refusals (429/503/507)
keep their status code; a failure after that is sent as an error event, then the stream
ends with `data: [DONE]` (a shutdown that outlasts `--shutdown-timeout` ends streams the
same way). A client that leaves cancels its engine request: while it waits in the queue
and while a non-streaming answer is collected, a watcher on the connection's `receive`
notices the disconnect at once; a stream's `finally` (and the response wrapper, should the
stream never start) does the same.
Client-chosen ids are echoed into `X-Session-Id` only when they are a safe header value
(`segserve.server.http.tenants.safe_header_value`); otherwise the header is left out.

`n` > 1 (up to `MAX_N`): one request to the engine, which prefills the prompt once and
decodes n forks of it together (`GenerationRequest.n`); choice i samples with `seed + i`
when a seed is given, has its own logprobs, finish_reason, tool-call parsing and grammar
matcher (a copy per choice, so `response_format` and forced tools work with n > 1). The
answer has choices 0..n-1; a stream's chunks carry each choice's `index` (a role chunk per
choice first, each choice's finish chunk when it ends). `usage` counts the prompt once and
sums the completion tokens of all choices. Sessions (`X-Session-Id` / `prompt_cache_key`):
choice 0's turn is stored as the session's next turn; the other choices are not stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from segserve.server.chat.grammar import GrammarError, compile_response_format, compile_tool_choice
from segserve.server.chat.reasoning import (
    ReasoningMode,
    ReasoningStream,
    Start,
    ThinkingGate,
    resolve_family,
    start_from_prompt,
    think_vocab,
)
from segserve.server.chat.template import (
    UnsupportedContentError,
    normalize_messages,
    template_reads,
    with_tool_prompt,
)
from segserve.server.chat.tool_calls import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolFamily,
    parse_tool_calls,
)
from segserve.server.engine import (
    Done,
    Failed,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    Started,
    Token,
    TokenLogprob,
)
from segserve.server.engine.errors import EngineError
from segserve.server.http.errors import (
    ClientClosed,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServerError,
    ShuttingDown,
    error_body,
    from_engine,
)
from segserve.server.http.jsonbody import parse_json
from segserve.server.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    usage,
)
from segserve.server.http.serving import Serving
from segserve.server.http.tenants import bank_salt, check_cache_salt, safe_header_value

T = TypeVar("T")
_TOKENIZE_THREADS = 2
log = logging.getLogger("segserve")


async def read_body(request: Request, model_cls: type[Any], limit: int) -> Any:
    raw = await request.body()  # already bounded by segserve.server.http.http_guard.BodyGuard
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object")
    return validate(model_cls, data)


def validate(model_cls: type[Any], data: Any) -> Any:
    """The one place request validation errors become HTTP errors."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        ctx = first.get("ctx") or {}
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "unsupported_parameter":
            raise InvalidRequest(msg, param=str(ctx["param"]), code="unsupported_parameter") from exc
        if first["type"] == "invalid_param":
            named = str(ctx["param"])
            raise InvalidRequest(f"{named}: {msg}", param=named) from exc
        param = ".".join(str(p) for p in first["loc"]) or None
        raise InvalidRequest(f"{param}: {msg}" if param else msg, param=param) from exc


async def off_loop(rt: Serving, fn: Callable[..., T], *args: Any) -> T:
    """Run CPU-bound request work (template, tokenizer) in a worker thread."""
    if rt.cpu_limiter is None:
        rt.cpu_limiter = anyio.CapacityLimiter(_TOKENIZE_THREADS)
    return await anyio.to_thread.run_sync(fn, *args, limiter=rt.cpu_limiter)


def _check_model(rt: Serving, name: str) -> None:
    if name not in (rt.model_id, "default"):
        raise ModelNotFound(
            f"model {name!r} is not served here; use {rt.model_id!r} or 'default'",
            param="model",
        )


def _limit_tokens(rt: Serving, prompt_len: int, asked: int | None) -> int:
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


def _sampling(rt: Serving, body: Any, logprobs: bool, top_logprobs: int) -> SamplingParams:
    bias = body.logit_bias_pairs()
    vocab = rt.vocab_size
    for tid, _ in bias:
        if tid >= vocab:
            raise InvalidRequest(
                f"logit_bias: token id {tid} is outside the vocabulary (0 .. {vocab - 1})",
                param="logit_bias",
            )
    own = rt.model.sampling_defaults  # the model's (empty with --generation-config none)
    return SamplingParams(
        temperature=own.pick("temperature", body.temperature, 1.0),
        top_p=own.pick("top_p", body.top_p, 1.0),
        seed=body.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        top_k=max(0, int(own.pick("top_k", body.top_k, 0))),
        min_p=own.pick("min_p", body.min_p, 0.0),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=own.pick("repetition_penalty", body.repetition_penalty, 1.0),
        logit_bias=bias,
    )


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    try:
        return normalize_messages([m.for_template() for m in body.messages])
    except UnsupportedContentError as exc:
        raise InvalidRequest(str(exc), param=f"messages.{exc.index}.content") from exc


def _compile_matcher(rt: Serving, body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> Any:
    """The request's grammar matcher, or None (worker thread: compiling can be slow)."""
    choice = body.tool_choice_value()
    forced = body.calls_tools() and choice != "auto"
    # A forced call's reply is calls only, no text, so response_format (which shapes text)
    # has nothing to shape: accepted, as OpenAI does. Agent loops send both on their first
    # step (the OpenAI Agents SDK's output_type with tool_choice "required", pydantic-ai's
    # output tools), then drop the forced choice and get the formatted answer.
    rf = None if forced else body.response_format_value()
    if not forced and rf is None:
        return None
    try:
        vocab = rt.grammar_vocab()
        if forced:
            compiled = compile_tool_choice(
                rt.tool_family, tools, choice, vocab, parallel_tool_calls=body.parallel_tool_calls
            )
        else:
            compiled = compile_response_format(rf, vocab)
    except GrammarError as exc:
        code = "unsupported_parameter" if "cannot be compiled" in exc.message else None
        raise InvalidRequest(exc.message, param=exc.param, code=code) from exc
    return compiled.matcher() if compiled is not None else None


async def chat_completions(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: ChatCompletionRequest = await read_body(
        request, ChatCompletionRequest, rt.settings.max_request_bytes
    )
    plan = await prepare_chat(rt, body)
    return await _serve(
        request, rt, body, plan.prompt, plan.sampling, chat=True, matcher=plan.matcher,
        tools=plan.tools, reasoning=plan.reasoning,
    )


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A validated chat request made ready for the engine (shared with `/v1/responses`)."""

    prompt: list[int]
    sampling: SamplingParams
    matcher: Any
    tools: _ToolOutput | None
    reasoning: ReasoningMode | None = None  # None: the answer is not split


async def prepare_chat(rt: Serving, body: ChatCompletionRequest) -> ChatPlan:
    """Model check, sampling, template + tokenize, grammar: the chat route's preparation,
    also used by `segserve.server.http.responses_api` (one code path for both APIs)."""
    _check_model(rt, body.model)
    sampling = _sampling(rt, body, body.logprobs, body.top_logprobs or 0)
    msgs = _template_messages(body)
    tools = body.template_tools()
    msgs, shown = _present_tools(rt, msgs, tools)
    variables = body.template_variables()
    template = rt.tokenizer.chat_template
    if (body.reasoning_effort == "none" and "enable_thinking" not in variables
            and template_reads(template, "enable_thinking")):
        variables["enable_thinking"] = False  # the template's own thinking switch
    args: tuple[Any, ...] = (msgs, shown or None, variables) if variables else (
        (msgs, shown) if shown else (msgs,)
    )
    prompt = await off_loop(rt, rt.encode_chat, *args)
    matcher = await off_loop(rt, _compile_matcher, rt, body, tools)
    family = rt.tool_family if body.calls_tools() else None
    forced = body.tool_choice_value() != "auto"
    out = _ToolOutput(family, body.parallel_tool_calls, forced) if family is not None else None
    reasoning = _reasoning_mode(rt, prompt)
    if matcher is not None and reasoning is not None and reasoning.thinks:
        matcher = await off_loop(rt, _gate, rt, matcher, reasoning.start)
    return ChatPlan(prompt, sampling, matcher, out, reasoning)


def _reasoning_mode(rt: Serving, prompt: list[int]) -> ReasoningMode | None:
    """How this request's answer is split (`--reasoning-parser`), and where its output
    starts: read from the prompt's last tokens (their own bytes, special tokens included)."""
    fam = resolve_family(rt.tokenizer.chat_template, rt.settings.reasoning_parser)
    if fam is None:
        return None
    tail = b"".join(rt.tokenizer.token_bytes(t) for t in prompt[-32:])
    return ReasoningMode(fam, start_from_prompt(tail.decode("utf-8", errors="replace")))


def _gate(rt: Serving, matcher: Any, start: Start) -> ThinkingGate:
    """The grammar behind the thinking (worker thread: the first call scans the vocabulary)."""
    tok = rt.tokenizer
    return ThinkingGate(matcher, think_vocab(tok, rt.vocab_size, tok.eos_ids), start)


_told: set[tuple[str, str]] = set()  # (template fingerprint, what was logged): log once


def _present_tools(
    rt: Serving, msgs: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools for the template). A template that reads `tools` gets them as they
    are; one that does not (the embedded model's) gets them as a Hermes system block
    (`--tool-prompt auto`, `segserve.server.chat.template.with_tool_prompt`), or not at all
    (`--tool-prompt none`, today's behaviour before the block existed). Logged once."""
    if not tools or template_reads(rt.tokenizer.chat_template, "tools"):
        return msgs, tools
    key = rt.tokenizer.fingerprint
    if rt.settings.tool_prompt == "none" or rt.tool_family is not ToolFamily.HERMES:
        why = "--tool-prompt none" if rt.settings.tool_prompt == "none" else (
            f"the tool parser is {rt.tool_family.value}, the block is Hermes syntax"
        )
        if (key, "none") not in _told:
            _told.add((key, "none"))
            log.info("the chat template does not present tools and %s: tools are left out "
                     "of the prompt", why)
        return msgs, []
    if (key, "auto") not in _told:
        _told.add((key, "auto"))
        log.info("the chat template does not present tools: they go in a system block in "
                 "Hermes syntax (<tools>, answers in <tool_call>); --tool-prompt none turns "
                 "this off")
    return with_tool_prompt(msgs, tools), []


async def completions(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: CompletionRequest = await read_body(request, CompletionRequest, rt.settings.max_request_bytes)
    _check_model(rt, body.model)
    n_lp = body.logprobs or 0
    sampling = _sampling(rt, body, body.logprobs is not None, n_lp)
    if isinstance(body.prompt, str):
        prompt = await off_loop(rt, rt.encode_prompt, body.prompt, "prompt")
    else:
        if any(not 0 <= t < rt.tokenizer.vocab_size for t in body.prompt):
            raise InvalidRequest("prompt token id out of the vocabulary", param="prompt")
        prompt = list(body.prompt)
    return await _serve(request, rt, body, prompt, sampling, chat=False)


@dataclass(frozen=True, slots=True)
class _ToolOutput:
    """How a chat answer's text is read for tool calls."""

    family: ToolFamily
    parallel: bool
    # tool_choice "required" or a named function: the grammar admits only calls, so any
    # text outside a parsed call is a call cut off by max_tokens, never content.
    forced: bool = False

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.family)


async def start_generation(
    request: Request,
    rt: Serving,
    body: Any,
    prompt: list[int],
    sampling: SamplingParams,
    *,
    prefix: str,
    session_id: str | None,
    matcher: Any = None,
    store_unfinished: bool = True,
    continue_from: tuple[str, int | None] | None = None,
) -> tuple[RequestHandle, Started]:
    """Build the `GenerationRequest`, submit it, and wait for `Started` (a refusal raises
    with its status code). Shared by chat, completions and `/v1/responses`."""
    if not prompt:
        raise InvalidRequest("the prompt is empty after templating", param="messages")
    max_tokens = _limit_tokens(rt, len(prompt), body.token_limit())
    req = GenerationRequest(
        new_id(prefix),
        tuple(prompt),
        max_tokens,
        sampling,
        tuple(body.stops()),
        session_id,
        request_salt(request),
        matcher=matcher,
        n=body.n,
        store_unfinished=store_unfinished,
        continue_from=continue_from,
    )
    if rt.draining:
        raise ShuttingDown()
    state = request.scope.setdefault("state", {})
    state["user"] = body.user  # OpenAI's end-user id: recorded (escaped) in the access log
    try:
        handle = rt.engine.generate(req)
    except EngineError as exc:
        raise from_engine(exc) from None
    try:
        first = await _unless_disconnected(request, handle, handle.queue.get)
        if isinstance(first, Failed):
            raise from_engine(first.error)
        assert isinstance(first, Started)
    except BaseException:
        handle.cancel()
        raise
    state["session_id"] = first.session_id
    return handle, first


async def _serve(
    request: Request,
    rt: Serving,
    body: Any,
    prompt: list[int],
    sampling: SamplingParams,
    *,
    chat: bool,
    matcher: Any = None,
    tools: _ToolOutput | None = None,
    reasoning: ReasoningMode | None = None,
) -> Response:
    handle, first = await start_generation(
        request, rt, body, prompt, sampling, prefix="chatcmpl" if chat else "cmpl",
        session_id=_session_id(request, body), matcher=matcher,
    )
    req = handle.request
    fmt = _Formatter(rt.model_id, req.request_id, chat, rt, tools, reasoning)
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

    def __init__(self, handle: RequestHandle, content: AsyncIterator[str | bytes], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.cancel()
            # A stream the client left may be suspended at a `yield`: close it here, so its
            # own cleanup (`finally`) runs now rather than whenever it is collected; shielded,
            # as this runs inside the cancelled scope of a disconnect.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


async def _collect(handle: RequestHandle, fmt: _Formatter, request: Request) -> dict[str, Any]:
    n = handle.request.n
    parts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    # fed token by token (not split once at the end) to count the thinking's tokens
    splits = [fmt.split() for _ in range(n)]
    dones: dict[int, Done] = {}
    while len(dones) < n:
        ev = await handle.queue.get()
        if isinstance(ev, Token):
            parts[ev.index].append(ev.text)
            if (s := splits[ev.index]) is not None:
                s.feed(ev.text)
            if ev.logprob is not None:
                lps[ev.index].append(ev.logprob)
        elif isinstance(ev, Failed):
            raise from_engine(ev.error)
        elif isinstance(ev, Done):
            parts[ev.index].append(ev.tail_text)
            if (s := splits[ev.index]) is not None:
                s.feed(ev.tail_text, 0)
                s.finish()
            dones[ev.index] = ev
    ends = [dones[i] for i in range(n)]
    request.scope["state"]["tokens"] = sum(d.completion_tokens for d in ends)
    request.scope["state"]["spec"] = _acceptance(ends)
    request.scope["state"]["stored_turn"] = ends[0].turn  # read by /v1/responses
    return fmt.full(["".join(p) for p in parts], lps, ends, splits)


def _acceptance(ends: list[Done]) -> str:
    """Speculative decoding of a request for the access log: accepted/drafted tokens."""
    return f"{sum(d.accepted_tokens for d in ends)}/{sum(d.draft_tokens for d in ends)}"


async def _stream(
    handle: RequestHandle, fmt: _Formatter, include_usage: bool, request: Request
) -> AsyncIterator[str | bytes]:
    n = handle.request.n
    calls = [fmt.tools.stream() if fmt.tools is not None else None for _ in range(n)]
    splits = [fmt.split() for _ in range(n)]
    dones: dict[int, Done] = {}
    try:
        if fmt.chat:
            for i in range(n):
                yield _sse(fmt.chunk(role=True, index=i))
        while len(dones) < n:
            ev = await handle.queue.get()
            if isinstance(ev, Token):
                if calls[ev.index] is None and splits[ev.index] is None and ev.logprob is None:
                    if ev.text:  # the common token: plain text, pre-encoded frame
                        yield fmt.text_event(ev.text, ev.index)
                    continue
                for out in _token_chunks(fmt, calls[ev.index], ev, splits[ev.index]):
                    yield _sse(out)
            elif isinstance(ev, Failed):
                yield _sse(error_body(from_engine(ev.error)))
                break
            elif isinstance(ev, Done):
                dones[ev.index] = ev
                for out in _end_chunks(fmt, calls[ev.index], ev, splits[ev.index]):
                    yield _sse(out)
        if len(dones) == n:
            ends = [dones[i] for i in range(n)]
            request.scope["state"]["tokens"] = sum(d.completion_tokens for d in ends)
            request.scope["state"]["spec"] = _acceptance(ends)
            if include_usage:
                yield _sse(fmt.usage_chunk(ends, splits))
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


def _token_chunks(
    fmt: _Formatter, calls: ToolCallStream | None, ev: Token, split: ReasoningStream | None = None
) -> list[dict[str, Any]]:
    if split is None:
        return _content_chunks(fmt, calls, ev.text, ev.logprob, ev.index)
    # thinking first (`delta.reasoning_content`), then the answer, which alone is read
    # for tool calls; the token's logprob rides on its first chunk
    out: list[dict[str, Any]] = []
    lp = ev.logprob
    for p in split.feed(ev.text):
        if p.reasoning:
            out.append(fmt.chunk(delta={"reasoning_content": p.text}, logprob=lp, index=ev.index))
        else:
            out += _content_chunks(fmt, calls, p.text, lp, ev.index)
        lp = None if out else lp
    if not out and lp is not None:
        out.append(fmt.chunk(delta={}, logprob=lp, index=ev.index))
    return out


def _content_chunks(
    fmt: _Formatter, calls: ToolCallStream | None, text: str, lp: TokenLogprob | None, index: int
) -> list[dict[str, Any]]:
    if calls is not None:
        return fmt.tool_chunks(calls.feed(text), lp, index)
    if text or lp is not None:
        return [fmt.chunk(text=text, logprob=lp, index=index)]
    return []


def _end_chunks(
    fmt: _Formatter, calls: ToolCallStream | None, ev: Done, split: ReasoningStream | None = None
) -> list[dict[str, Any]]:
    """A choice's held-back text (or its last tool-call deltas), then its finish chunk."""
    out: list[dict[str, Any]] = []
    finish: str = ev.finish_reason
    tail = ev.tail_text
    if split is not None:
        pieces = split.feed(tail, 0) + split.finish()
        out += [fmt.chunk(delta={"reasoning_content": p.text}, index=ev.index)
                for p in pieces if p.reasoning]
        tail = "".join(p.text for p in pieces if not p.reasoning)
    if calls is not None:
        out += fmt.tool_chunks(calls.feed(tail) + calls.finish(), None, ev.index)
        if calls.tool_calls and finish != "length":
            finish = "tool_calls"
    elif tail:
        out.append(fmt.chunk(text=tail, index=ev.index))
    out.append(fmt.chunk(finish=finish, index=ev.index))
    return out


# Stands for the text in text_event's frame; private-use characters that json.dumps keeps as
# they are (ensure_ascii=False) and that no other field of a chunk contains.
_TEXT_MARK = "\ue000segserve-text\ue001"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Formatter:
    def __init__(
        self, model: str, rid: str, chat: bool, rt: Serving, tools: _ToolOutput | None = None,
        reasoning: ReasoningMode | None = None,
    ) -> None:
        self.model, self.rid, self.chat, self.rt = model, rid, chat, rt
        self.tools = tools
        self.reasoning = reasoning if chat else None
        self.created = now()
        self._frames: dict[int, tuple[bytes, bytes] | None] = {}  # choice index -> text_event's frame

    def text_event(self, text: str, index: int) -> bytes:
        """The SSE event of `chunk(text=text, index=index)`, from a frame serialized once per
        choice: only the text is encoded per token. Why: streaming re-serialized the whole
        chunk for every token, a visible share of the event loop's work per token on a
        small CPU, where that thread competes with decode for the cores."""
        if index not in self._frames:
            mark = json.dumps(_TEXT_MARK, ensure_ascii=False)
            whole = _sse(self.chunk(text=_TEXT_MARK, index=index))
            head, _, tail = whole.partition(mark)
            # (a model name holding the mark itself: no frame, every chunk serialized whole)
            self._frames[index] = (head.encode(), tail.encode()) if whole.count(mark) == 1 else None
        frame = self._frames[index]
        if frame is None:
            return _sse(self.chunk(text=text, index=index)).encode()
        return b"".join((frame[0], json.dumps(text, ensure_ascii=False).encode(), frame[1]))

    def split(self) -> ReasoningStream | None:
        """A choice's thinking/answer splitter (None: the text is all answer)."""
        return self.reasoning.stream() if self.reasoning is not None else None

    def _usage(self, dones: list[Done], splits: list[ReasoningStream | None]) -> dict[str, Any]:
        completion = sum(d.completion_tokens for d in dones)
        out = usage(dones[0].prompt_tokens, completion, dones[0].cached_tokens)
        if self.reasoning is not None:
            thinking = sum(s.reasoning_tokens for s in splits if s is not None)
            out["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return out

    def _lp_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        def one(tid: int, val: float) -> dict[str, Any]:
            s = self.rt.tokenizer.decode([tid])
            # the token's own bytes: a piece of a multi-byte character is not U+FFFD's
            return {"token": s, "logprob": val, "bytes": list(self.rt.tokenizer.token_bytes(tid))}

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

    def full(
        self, texts: list[str], lps: list[list[TokenLogprob]], dones: list[Done],
        splits: list[ReasoningStream | None] | None = None,
    ) -> dict[str, Any]:
        """The whole answer: one choice per text (index i), usage with the prompt once."""
        splits = splits or [None] * len(texts)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                self._choice(i, *c) for i, c in enumerate(zip(texts, lps, dones, splits, strict=True))
            ],
            "usage": self._usage(dones, splits),
        }

    def _choice(
        self, index: int, text: str, lps: list[TokenLogprob], done: Done, split: ReasoningStream | None
    ) -> dict[str, Any]:
        logprobs = self._lp_block(lps) if lps else None
        choice: dict[str, Any] = {"index": index, "finish_reason": done.finish_reason, "logprobs": logprobs}
        thinking = ""
        if split is not None:  # tool calls and content are read from the answer only
            thinking, text = split.reasoning, split.content
        if self.chat and self.tools is not None:
            parsed = parse_tool_calls(text, self.tools.family)
            calls: tuple[ToolCall, ...] = parsed.tool_calls
            if not self.tools.parallel:
                calls = calls[:1]
            content = "" if self.tools.forced else parsed.content
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [c.to_openai() for c in calls]
                if done.finish_reason != "length":
                    choice["finish_reason"] = "tool_calls"
            choice["message"] = message
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if thinking:  # left out when there was none, as vLLM does
            choice["message"]["reasoning_content"] = thinking
        return choice

    def chunk(
        self,
        *,
        text: str = "",
        role: bool = False,
        finish: str | None = None,
        logprob: TokenLogprob | None = None,
        delta: dict[str, Any] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        lp = self._lp_block([logprob]) if logprob is not None else None
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": lp}
        if self.chat and delta is not None:
            choice["delta"] = delta
        elif self.chat:
            delta = {}
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

    def tool_chunks(
        self, deltas: list[Delta], logprob: TokenLogprob | None, index: int = 0
    ) -> list[dict[str, Any]]:
        """Stream chunks for parsed deltas; a token's logprob rides on its first chunk (or
        on an empty delta when the token only advanced markup)."""
        out: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ToolCallDelta):
                if self.tools is not None and not self.tools.parallel and d.index > 0:
                    continue
                delta: dict[str, Any] = {"tool_calls": [d.to_openai()]}
            elif isinstance(d, ContentDelta) and d.text:
                if self.tools is not None and self.tools.forced:
                    continue  # a cut-off forced call's markup (see `_ToolOutput.forced`)
                delta = d.to_openai()
            else:
                continue
            out.append(self.chunk(delta=delta, logprob=logprob if not out else None, index=index))
        if not out and logprob is not None:
            out.append(self.chunk(delta={}, logprob=logprob, index=index))
        return out

    def usage_chunk(
        self, dones: list[Done], splits: list[ReasoningStream | None] | None = None
    ) -> dict[str, Any]:
        out = self.chunk()
        out["choices"] = []
        out["usage"] = self._usage(dones, splits or [])
        return out


async def list_models(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    return JSONResponse(
        {
            "object": "list",
            "data": [model_card(rt)],
        }
    )


def model_card(rt: Serving) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": rt.model_id, "object": "model", "created": rt.started, "owned_by": "segserve",
    }
    defaults = rt.model.sampling_defaults.as_dict()
    if defaults:  # what a request that leaves these fields out samples with
        card["sampling_defaults"] = defaults
    return card


async def retrieve_model(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    model_id = request.path_params["model_id"]
    if model_id not in (rt.model_id, "default"):
        raise ModelNotFound(f"the model {model_id!r} does not exist", param="model")
    return JSONResponse(model_card(rt))


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote client text (a field name, a
    lone surrogate) that UTF-8 cannot encode; escaped, it always can."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: ServerError) -> JSONResponse:
    return ErrorResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
