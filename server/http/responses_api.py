"""OpenAI's Responses API (`/v1/responses`) on the session bank.

Owns: the `/v1/responses` routes, the translation of a Responses request into the chat
route's `ChatCompletionRequest` (validated by the same model, prepared by the same
`segserve.server.http.openai_api.prepare_chat`, submitted by the same `start_generation`, read back by
the same tool-call parser): there is one generation path, this module only translates.
A field the chat path does not support is refused by name (`unsupported_parameter`).

How a response id maps to bank state: response `resp_X` owns the bank session `resp_X`
(in the caller's salt scope). A request without `previous_response_id` runs with that
session id, so its turn (prompt + answer rows) is stored there. With
`previous_response_id=P`, the request carries `continue_from=(P's session, P's turn)`: the
engine forks it into the new id on its own thread just before the lookup (no rows copied,
no separate trip), then runs the request on it, and its `Done` says which turn was stored
(the record keeps it for the next continuation): the bank's session lookup
finds P's rows, only the new input is prefilled, and the new turn is appended to the new
session only. P's session is never appended to (every continuation forks it), so P is an
immutable snapshot and can be continued any number of times; each branch adds only its
own rows. The record stores the conversation as chat messages (without the instructions,
which, as in OpenAI's API, do not carry over); the continuation's prompt is the chat
template over [instructions] + that conversation + the new input, so it begins with the
tokens of P's prompt and answer (the answer's text is stored exactly as generated) and
the bank's prefix match covers them.

Restart: the records are in `responses.sqlite3` next to the bank's SSD tier
(`segserve.server.http.responses_store`), the sessions in the bank's manifest: both survive a restart
(and `kill -9` after a commit). RAM-only bank: records are kept in memory.

An unknown id, a deleted one, or another tenant's: 404 `response_not_found`, the same
answer in each case. A stored response whose bank rows are gone (evicted without an SSD
tier, an SSD block lost, another model since): the conversation is re-prefilled from the
stored text instead of failing. Chosen because the record, not the KV cache, is the
conversation: the rows are a cache of it and the answer is the same either way; only
`cached_tokens` shows the difference (and the prefix index may still reuse part).

`store: false`: the turn runs on a temporary bank session that is deleted after the
answer; nothing is recorded (the id cannot be continued or read).

A turn that is not committed leaves nothing in the bank: a client that disconnects (while
queued, mid-stream, or before a non-streamed answer is sent), a refusal or a failure drops
the turn's bank session (the fork of P included). The request runs with
`store_unfinished=False`, so the engine never stores a cancelled or failed turn's sealed
prompt after that drop (which would race it); the drop itself runs shielded from the
disconnect's cancellation, and a commit that began is finished before the drop is decided. Streaming sends the
Responses event sequence (`response.created` ... `response.completed`, or `error`), each
with a `sequence_number`; the record is committed before `response.completed` is sent.
`GET .../input_items` lists the items sent with that request (not earlier turns').
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from segserve.server.chat.tool_calls import ContentDelta, ToolCallDelta, ToolCallStream
from segserve.server.engine import Done, Failed, RequestHandle, Token
from segserve.server.engine.errors import SessionRefused, UnknownSession
from segserve.server.http.errors import (
    InvalidRequest,
    NotFound,
    ServerError,
    error_body,
    from_engine,
)
from segserve.server.http.openai_api import (
    ChatPlan,
    _collect,
    _EngineStream,
    _Formatter,
    _unless_disconnected,
    prepare_chat,
    read_body,
    request_salt,
    start_generation,
    validate,
)
from segserve.server.http.responses_store import ResponseRecord, ResponseStore, scope_of
from segserve.server.http.schemas import (
    FUNCTION_NAME,
    SCHEMA_NAME,
    ChatCompletionRequest,
    NullIsUnset,
    unsupported,
)
from segserve.server.http.serving import Serving

T = TypeVar("T")

# Responses fields we know but do not implement, and the values that mean "off".
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None,),
    "context_management": (None,),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=SCHEMA_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


# `include` values that add nothing here: they ask for parts of items this server never
# produces (hosted-tool calls, image inputs, reasoning items). Others are refused by name.
INCLUDE_NO_OPS = frozenset({
    "web_search_call.action.sources", "web_search_call.results",
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
})


class Reasoning(_Strict):
    """`effort` reaches the chat template as `reasoning_effort` (as in chat; "none" also
    switches thinking off for a template with `enable_thinking`); `summary` is accepted and
    no summary is made (`summary: []`). A reasoning model's thinking comes back as a
    `reasoning` item whatever these say (see `segserve.server.chat.reasoning`)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict, NullIsUnset):
    model: str = "default"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] = Field(
        "disabled", description="auto: drop the oldest turns so the input fits the context."
    )
    reasoning: Reasoning | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        include = data.get("include")
        if isinstance(include, list):
            for i, v in enumerate(include):
                if isinstance(v, str) and v not in INCLUDE_NO_OPS:
                    raise unsupported(f"include.{i}", f"{v!r} cannot be produced here")
        for name, off in _UNSUPPORTED_UNLESS.items():
            if name in data:
                if not any(data[name] == o and type(data[name]) is type(o) for o in off):
                    raise unsupported(name)
                data = {k: v for k, v in data.items() if k != name}
        tools = data.get("tools")
        if isinstance(tools, list):
            for i, t in enumerate(tools):
                if isinstance(t, dict) and t.get("type") != "function":
                    raise unsupported(f"tools.{i}.type", f"only function tools, not {t.get('type')!r}")
        return data

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return v


def _hex() -> str:
    return uuid.uuid4().hex


# ---- input items -> chat messages --------------------------------------------------------

_TEXT_PARTS = {"input_text", "output_text", "text"}


def _parts_text(content: Any, where: str) -> list[dict[str, Any]] | str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: content must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(
                f"unsupported parameter: {where}.content.{j} ({kind} parts; this model reads text)",
                param=f"{where}.content.{j}", code="unsupported_parameter",
            )
        else:
            raise InvalidRequest(f"{where}.content.{j}: expected a text part", param=f"{where}.content.{j}")
    return parts


def _item_view(content: list[dict[str, Any]] | str, role: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    texts = [content] if isinstance(content, str) else [p["text"] for p in content]
    if role == "assistant":
        return [{"type": kind, "text": t, "annotations": [], "logprobs": []} for t in texts]
    return [{"type": kind, "text": t} for t in texts]


def translate_input(raw: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Responses input → (chat messages in wire shape, stored input items with ids)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], [
            {"id": f"msg_{_hex()}", "type": "message", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": raw}]}
        ]
    if not raw:
        raise InvalidRequest("input must not be empty", param="input")
    msgs: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    thinking: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, it in enumerate(raw):
        where = f"input.{i}"
        kind = it.get("type", "message")
        if thinking is not None:
            if kind in ("message", "function_call") and it.get("role", "assistant") == "assistant":
                msgs.append({"role": "assistant", "content": None, "reasoning_content": thinking})
            thinking = None  # a reasoning item without an answer after it renders nothing
        if kind == "reasoning":
            thinking = _reasoning_text(it, where)
            items.append({"id": it.get("id") or f"rs_{_hex()}", "type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": thinking}], "status": "completed"})
        elif kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{where}.role: must be user, assistant, system or developer", param=f"{where}.role")
            content = _parts_text(it.get("content"), where)
            last = msgs[-1] if msgs else None
            if role == "assistant" and last is not None and _bare_thinking(last):
                last["content"] = content  # the answer that followed its reasoning item
            else:
                msgs.append({"role": role, "content": content})
            items.append({"id": it.get("id") or f"msg_{_hex()}", "type": "message", "role": role,
                          "status": "completed", "content": _item_view(content, role)})
        elif kind == "function_call":
            call_id, name, args = it.get("call_id"), it.get("name"), it.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
                raise InvalidRequest(f"{where}: a function_call needs call_id, name and arguments (strings)", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            items.append({"id": it.get("id") or f"fc_{_hex()}", "type": "function_call", "call_id": call_id,
                          "name": name, "arguments": args, "status": "completed"})
        elif kind == "function_call_output":
            call_id, output = it.get("call_id"), it.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.call_id: required (string)", param=f"{where}.call_id")
            content = _parts_text(output, f"{where}.output")
            text = content if isinstance(content, str) else "".join(p["text"] for p in content)
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": text})
            items.append({"id": it.get("id") or f"fco_{_hex()}", "type": "function_call_output",
                          "call_id": call_id, "output": text, "status": "completed"})
        else:
            raise InvalidRequest(
                f"unsupported parameter: {where}.type ({kind!r} items)", param=f"{where}.type",
                code="unsupported_parameter",
            )
    return msgs, items


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text (its `reasoning_text` parts; a summary alone gives "")."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
        for p in parts
    ):
        raise InvalidRequest(f"{where}.content: expected reasoning_text parts", param=f"{where}.content")
    return "".join(p["text"] for p in parts)


def _bare_thinking(msg: dict[str, Any]) -> bool:
    """An assistant message made for a reasoning item, still waiting for its answer."""
    return msg["role"] == "assistant" and msg.get("content") is None and not msg.get("tool_calls")


def check_call_outputs(raw: str | list[dict[str, Any]], conversation: list[dict[str, Any]]) -> None:
    """Every `function_call_output` answers a function call of this input or of the previous
    response's conversation, by `call_id` (as OpenAI checks): an orphan output is a 400
    naming it, not a tool message the model reads as if it had asked for it."""
    if isinstance(raw, str):
        return
    calls = {c.get("id") for m in conversation for c in m.get("tool_calls") or ()}
    for i, it in enumerate(raw):
        if it.get("type") == "function_call_output" and it.get("call_id") not in calls:
            raise InvalidRequest(
                f"no function call found for function_call_output with call_id {it.get('call_id')!r} "
                "(in this input or the previous response)", param=f"input.{i}.call_id",
            )


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request means (validated by the chat model)."""
    data: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.max_output_tokens is not None:
        data["max_completion_tokens"] = body.max_output_tokens
    if body.reasoning is not None and body.reasoning.effort is not None:
        data["reasoning_effort"] = body.reasoning.effort  # a template variable, as in chat
    for name in ("temperature", "top_p", "seed", "user", "parallel_tool_calls"):
        value = getattr(body, name)
        if value is not None:
            data[name] = value
    if body.tools:
        data["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        data["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        data["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        data["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        data["response_format"] = {"type": "json_schema", "json_schema": spec}
    out: ChatCompletionRequest = validate(ChatCompletionRequest, data)
    return out


# ---- output ------------------------------------------------------------------------------


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id, "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


class _Turn:
    """One Responses turn: the request, where it runs in the bank, and the response object."""

    def __init__(
        self, rt: Serving, body: ResponsesRequest, cbody: ChatCompletionRequest, rid: str,
        salt: str | None, session: str | None, conv: list[dict[str, Any]], items: list[dict[str, Any]],
    ) -> None:
        self.rt, self.body, self.cbody, self.rid = rt, body, cbody, rid
        self.salt, self.session, self.conv, self.items = salt, session, conv, items
        self.created = time.time()
        self.settled = False  # committed or dropped
        self.stored_turn: int | None = None  # the engine's `Done.turn` of this turn

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        choice: Any = b.tool_choice.model_dump() if isinstance(b.tool_choice, FunctionChoice) else (b.tool_choice or "auto")
        done = status in ("completed", "incomplete")
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "completed_at": time.time() if done else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "model": self.rt.model_id,
            "output": output,
            "parallel_tool_calls": self.cbody.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": self.cbody.temperature,
            "top_p": self.cbody.top_p,
            "text": {"format": fmt},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": b.truncation,
            "reasoning": b.reasoning.model_dump() if b.reasoning else {"effort": None, "summary": None},
            "user": b.user,
            "usage": usage,
        }

    async def commit(
        self, store: ResponseStore | None, resp: dict[str, Any], assistant: dict[str, Any]
    ) -> None:
        """The turn finished: record it (store=true) or drop its temporary bank session.
        Shielded: a disconnect while committing does not leave half a commit."""
        with anyio.CancelScope(shield=True):
            await self._finish(store, resp, assistant)
        self.settled = True

    async def drop(self) -> None:
        """The turn did not finish: its bank session goes (once; nothing after a commit).
        Shielded: it runs in the cancelled scope of a disconnect too."""
        if self.settled:
            return
        self.settled = True
        with anyio.CancelScope(shield=True):
            await self._finish(None, {}, {})

    async def _finish(
        self, store: ResponseStore | None, resp: dict[str, Any], assistant: dict[str, Any]
    ) -> None:
        """Record the response (store=true) or drop its (temporary) bank session."""
        engine = self.rt.engine
        turn: int | None = None
        sid, salt = self.session, self.salt
        if engine.has_sessions and sid is not None:
            if store is None:
                await _engine_quiet(self.rt, engine.delete_session(sid, salt))
                return
            turn = self.stored_turn  # from `Done`: no engine trip to learn it
        if store is None:
            return
        rec = ResponseRecord(
            self.rid, scope_of(self.salt), self.created, resp, [*self.conv, assistant], self.items,
            self.session if turn is not None else None, turn,
        )
        await _thread(store.put, rec)


def _assistant_message(chat_json: dict[str, Any]) -> dict[str, Any]:
    msg = dict(chat_json["choices"][0]["message"])
    return {k: v for k, v in msg.items() if v is not None or k == "content"}


def _output_items(chat_json: dict[str, Any], status: str) -> list[dict[str, Any]]:
    msg = chat_json["choices"][0]["message"]
    out: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        # an unterminated thinking cut by max_output_tokens is incomplete; a closed one is done
        cut = status == "incomplete" and not msg.get("content") and not msg.get("tool_calls")
        out.append(_reasoning_item(f"rs_{_hex()}", msg["reasoning_content"], "incomplete" if cut else "completed"))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        out.append(_message_item(f"msg_{_hex()}", msg.get("content") or "", status))
    for c in calls:
        fn = c["function"]
        out.append(_call_item(f"fc_{_hex()}", c["id"], fn["name"], fn["arguments"], "completed"))
    return out


# ---- helpers -----------------------------------------------------------------------------


async def _fitted(
    rt: Serving, body: ResponsesRequest, system: list[dict[str, Any]], conv: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, ChatPlan]:
    """The chat request and its plan; with `truncation: "auto"`, the oldest turns (each from
    a user message up to the next) are left out of the prompt until prompt + max output
    tokens fit the context, as OpenAI documents. The record keeps the whole conversation.
    A conversation that still does not fit (one turn left) gets the usual 400.
    The chat request is validated once: leaving turns out slices its validated messages."""
    cbody = chat_body(body, [*system, *conv])
    lead = len(system)
    while True:
        plan: ChatPlan = await prepare_chat(rt, cbody)
        need = cbody.token_limit() or 1
        if body.truncation != "auto" or len(plan.prompt) + need <= rt.context_length:
            return cbody, plan
        starts = [i for i, m in enumerate(conv) if m.get("role") == "user" and i > 0]
        if not starts:
            return cbody, plan
        conv = conv[starts[0]:]
        msgs = cbody.messages
        cbody = cbody.model_copy(update={"messages": [*msgs[:lead], *msgs[lead + starts[0]:]]})


async def _thread(fn: Callable[..., T], *args: Any) -> T:
    return await anyio.to_thread.run_sync(fn, *args)


async def _engine_quiet(rt: Serving, call: Coroutine[Any, Any, T]) -> T | None:
    """A session command; None when the session is gone or the bank refuses it."""
    if not rt.engine.alive:
        call.close()  # never awaited: nothing was sent
        return None
    try:
        return await call
    except (UnknownSession, SessionRefused):
        return None


def _store(request: Request) -> ResponseStore:
    """The app's response store: next to the bank's SSD tier when it has one."""
    serving: Serving = request.app.state.serving
    return serving.responses()


def _not_found(rid: str, param: str | None = None) -> NotFound:
    return NotFound(
        f"Response with id {rid!r} not found (unknown, deleted, or not stored).",
        param=param, code="response_not_found",
    )


async def _record(request: Request, rid: str, param: str | None = None) -> ResponseRecord:
    rec = await _thread(_store(request).get, scope_of(request_salt(request)), rid)
    if rec is None:
        raise _not_found(rid, param)
    return rec


# ---- routes ------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: ResponsesRequest = await read_body(request, ResponsesRequest, rt.settings.max_request_bytes)
    salt = request_salt(request)
    prev = await _record(request, body.previous_response_id, "previous_response_id") if body.previous_response_id else None
    new_msgs, items = translate_input(body.input)
    conv = [*(prev.conversation if prev else []), *new_msgs]
    check_call_outputs(body.input, conv)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    cbody, plan = await _fitted(rt, body, system, conv)
    rid = f"resp_{_hex()}"
    turn = _Turn(rt, body, cbody, rid, salt, None, conv, items)
    sid: str | None = None
    continue_from: tuple[str, int | None] | None = None
    if rt.engine.has_sessions:
        sid = rid if body.store else f"tmp-{rid}"
        if prev is not None and prev.bank_session is not None:
            # P's rows, shared (no copy): the engine forks them into `sid` before its lookup,
            # in the same trip; if they are gone, the text is prefilled again.
            continue_from = (prev.bank_session, prev.bank_turn)
    turn.session = sid
    store = _store(request) if body.store else None
    try:
        handle, _ = await start_generation(
            request, rt, cbody, plan.prompt, plan.sampling, prefix="resp", session_id=sid,
            matcher=plan.matcher, store_unfinished=False, continue_from=continue_from,
        )
    except BaseException:
        await turn.drop()
        raise
    fmt = _Formatter(rt.model_id, rid, True, rt, plan.tools, plan.reasoning)
    if body.stream:
        gen = _stream(turn, handle, fmt, store, request)
        return _EngineStream(handle, gen, media_type="text/event-stream")
    try:
        result = await _unless_disconnected(request, handle, lambda: _collect(handle, fmt, request))
    except BaseException:
        await turn.drop()  # a turn that did not finish leaves nothing
        raise
    finally:
        handle.cancel()
    turn.stored_turn = request.scope["state"].get("stored_turn")
    status = "incomplete" if result["choices"][0]["finish_reason"] == "length" else "completed"
    u = result["usage"]
    thinking = u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    usage = _usage(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"], thinking)
    resp = turn.response(status, _output_items(result, status), usage)
    await turn.commit(store, resp, _assistant_message(result))
    return JSONResponse(resp)


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(
    turn: _Turn, handle: RequestHandle, fmt: _Formatter, store: ResponseStore | None, request: Request
) -> AsyncIterator[str]:
    ev = _Events()
    calls: ToolCallStream | None = fmt.tools.stream() if fmt.tools is not None else None
    parallel = fmt.tools.parallel if fmt.tools is not None else True
    # forced tool_choice: text outside a call is a cut-off call, never a message item
    forced = fmt.tools.forced if fmt.tools is not None else False
    split = fmt.split()  # a reasoning model's thinking goes to a `reasoning` item first
    reason_index: int | None = None
    reason_parts: list[str] = []
    output: list[dict[str, Any]] = []  # by output_index
    msg_index: int | None = None
    call_index: dict[int, int] = {}  # tool call index -> output index
    yield ev("response.created", response=turn.response("in_progress", [], None))
    yield ev("response.in_progress", response=turn.response("in_progress", [], None))

    def open_message() -> list[str]:
        nonlocal msg_index
        msg_index = len(output)
        item = _message_item(f"msg_{_hex()}", "", "in_progress")
        item["content"] = []
        output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            ev("response.output_item.added", output_index=msg_index, item=dict(item, content=[])),
            ev("response.content_part.added", item_id=item["id"], output_index=msg_index,
               content_index=0, part=part),
        ]

    text_parts: list[str] = []

    def text(delta: str) -> list[str]:
        if not delta:
            return []
        out = open_message() if msg_index is None else []
        assert msg_index is not None
        text_parts.append(delta)
        out.append(ev("response.output_text.delta", item_id=output[msg_index]["id"], output_index=msg_index,
                      content_index=0, delta=delta, logprobs=[]))
        return out

    def tool(d: ToolCallDelta) -> list[str]:
        if not parallel and d.index > 0:
            return []
        out: list[str] = []
        if d.index not in call_index:
            call_index[d.index] = len(output)
            item = _call_item(f"fc_{_hex()}", d.id or f"call_{_hex()}", d.name or "", "", "in_progress")
            output.append(item)
            out.append(ev("response.output_item.added", output_index=call_index[d.index], item=dict(item)))
        oi = call_index[d.index]
        if d.arguments:
            output[oi]["arguments"] += d.arguments
            out.append(ev("response.function_call_arguments.delta", item_id=output[oi]["id"],
                          output_index=oi, delta=d.arguments))
        return out

    def answer(s: str) -> list[str]:
        if calls is None:
            return text(s)
        out: list[str] = []
        for d in calls.feed(s):
            out += (text(d.text) if not forced else []) if isinstance(d, ContentDelta) else tool(d) if isinstance(d, ToolCallDelta) else []
        return out

    def reason(delta: str) -> list[str]:
        nonlocal reason_index
        out: list[str] = []
        if reason_index is None:
            reason_index = len(output)
            item = _reasoning_item(f"rs_{_hex()}", "", "in_progress")
            output.append(item)
            out += [
                ev("response.output_item.added", output_index=reason_index, item=dict(item, content=[])),
                ev("response.content_part.added", item_id=item["id"], output_index=reason_index,
                   content_index=0, part={"type": "reasoning_text", "text": ""}),
            ]
        reason_parts.append(delta)
        out.append(ev("response.reasoning_text.delta", item_id=output[reason_index]["id"],
                      output_index=reason_index, content_index=0, delta=delta))
        return out

    def end_reasoning(status: str) -> list[str]:
        """The reasoning item's done events, once, when the answer begins or the turn ends."""
        if reason_index is None or output[reason_index]["status"] != "in_progress":
            return []
        item = output[reason_index]
        full = "".join(reason_parts)
        item.update(_reasoning_item(item["id"], full, status))
        return [
            ev("response.reasoning_text.done", item_id=item["id"], output_index=reason_index,
               content_index=0, text=full),
            ev("response.content_part.done", item_id=item["id"], output_index=reason_index,
               content_index=0, part=item["content"][0]),
            ev("response.output_item.done", output_index=reason_index, item=item),
        ]

    def feed(s: str, tokens: int = 1) -> list[str]:
        if split is None:
            return answer(s)
        out: list[str] = []
        for p in split.feed(s, tokens):
            out += reason(p.text) if p.reasoning else end_reasoning("completed") + answer(p.text)
        return out

    try:
        while True:
            e = await handle.queue.get()
            if isinstance(e, Token):
                for s in feed(e.text):
                    yield s
            elif isinstance(e, Failed):
                err = error_body(from_engine(e.error))["error"]
                await turn.drop()
                yield ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                return
            elif isinstance(e, Done):
                request.scope["state"]["tokens"] = e.completion_tokens
                turn.stored_turn = e.turn
                out = feed(e.tail_text, 0)
                if split is not None:
                    for p in split.finish():
                        out += reason(p.text) if p.reasoning else end_reasoning("completed") + answer(p.text)
                    cut = e.finish_reason == "length" and split.thinking
                    out += end_reasoning("incomplete" if cut else "completed")
                if calls is not None:
                    for d in calls.finish():
                        out += (text(d.text) if not forced else []) if isinstance(d, ContentDelta) else tool(d) if isinstance(d, ToolCallDelta) else []
                for s in out:
                    yield s
                status = "incomplete" if e.finish_reason == "length" else "completed"
                if msg_index is None and not call_index:
                    for s in open_message():
                        yield s
                full = "".join(text_parts)
                for oi, item in enumerate(output):
                    if item["type"] == "reasoning":
                        continue  # its done events went out when the thinking ended
                    if item["type"] == "message":
                        item.update(_message_item(item["id"], full, status))
                        part = item["content"][0]
                        yield ev("response.output_text.done", item_id=item["id"], output_index=oi,
                                 content_index=0, text=full, logprobs=[])
                        yield ev("response.content_part.done", item_id=item["id"], output_index=oi,
                                 content_index=0, part=part)
                    else:
                        item["status"] = "completed"
                        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=oi,
                                 arguments=item["arguments"])
                    yield ev("response.output_item.done", output_index=oi, item=item)
                thinking = split.reasoning_tokens if split is not None else 0
                resp = turn.response(status, output, _usage(e.prompt_tokens, e.completion_tokens, e.cached_tokens, thinking))
                assistant: dict[str, Any] = {"role": "assistant", "content": full}
                fcalls = [o for o in output if o["type"] == "function_call"]
                if fcalls:
                    assistant = {"role": "assistant", "content": full or None, "tool_calls": [
                        {"id": o["call_id"], "type": "function",
                         "function": {"name": o["name"], "arguments": o["arguments"]}} for o in fcalls
                    ]}
                if split is not None and split.reasoning:
                    assistant["reasoning_content"] = split.reasoning
                await turn.commit(store, resp, assistant)
                yield ev("response.completed", response=resp)
                return
    except ServerError as exc:
        err = error_body(exc)["error"]
        yield ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
    finally:
        handle.cancel()
        await turn.drop()  # no-op once committed; a client that left mid-stream ends here


async def get_response(request: Request) -> Response:
    rec = await _record(request, request.path_params["rid"])
    return JSONResponse(rec.response)


async def delete_response(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    rid, salt = request.path_params["rid"], request_salt(request)
    rec = await _record(request, rid)
    if not await _thread(_store(request).delete, rec.scope, rid):
        raise _not_found(rid)
    sid = rec.bank_session
    if rt.engine.has_sessions and sid is not None:
        # Segments shared with continuations stay (they are theirs too).
        await _engine_quiet(rt, rt.engine.delete_session(sid, salt))
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request) -> Response:
    rec = await _record(request, request.path_params["rid"])
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    items = list(rec.input_items if order == "asc" else reversed(rec.input_items))
    after = q.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return JSONResponse({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit,
    })


def response_routes() -> list[Route]:
    return [
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{rid}", get_response, methods=["GET"]),
        Route("/v1/responses/{rid}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{rid}/input_items", list_input_items, methods=["GET"]),
    ]


__all__ = ["ResponsesRequest", "chat_body", "response_routes", "translate_input"]
