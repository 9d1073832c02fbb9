"""Anthropic Messages API request bodies (pydantic) and their translation to a chat request.

Owns: `MessagesRequest` (`POST /v1/messages`), `CountTokensRequest`
(`POST /v1/messages/count_tokens`), their content blocks, tools and tool choices, and
`chat_data`: the OpenAI chat body (`segserve.server.http.schemas.ChatCompletionRequest`) a Messages request
means. There is one prompt path: the chat route's template, tool presentation, grammar and
sessions serve both APIs, so a client that resends its history reuses the same stored rows
whichever API it speaks.

Translation (invariants):
- `system` (a string or text blocks) becomes the first, system, message.
- A user message's blocks keep their order: `text` blocks join into user messages,
  each `tool_result` becomes a `role: "tool"` message answering `tool_use_id` (its content a
  string or text blocks; `is_error: true` prefixes the text with "Error: ", so the model
  reads that the tool failed).
- An assistant message's `text` blocks become its content and its `tool_use` blocks its
  `tool_calls` (`input` serialized as the call's JSON arguments).
- `tools` become function tools (`input_schema` is the parameters' schema); `tool_choice`
  `auto`/`any`/`tool`/`none` become chat's "auto"/"required"/a named function/"none";
  `disable_parallel_tool_use` is chat's `parallel_tool_calls: false`.

Refused by name (400, `unsupported_parameter`): `image`, `document` and any other non-text
block (this model reads text), `thinking` blocks, server tools (`bash_...`, `web_search_...`),
`thinking` enabled, `mcp_servers`, `container`, `context_management`, `output_config`,
`diagnostics`, and a final
assistant message (prefill: the chat template always opens a new assistant turn).
Accepted because they change nothing here: `cache_control` on any block or tool (every turn
is cached by the session bank anyway), `metadata.user_id` (recorded in the access log),
`service_tier`, `inference_geo`, `speed`, `thinking: {"type": "disabled"}`, and the `anthropic-version` header.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from segserve.server.http.schemas import MAX_STOP, NullIsUnset, bad_param, unsupported

TOOL_NAME = r"^[A-Za-z0-9_\-]{1,64}$"  # Anthropic allows 128; chat tools (and OpenAI) 64

# Top-level fields we know but do not implement, and the values that mean "off".
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "mcp_servers": (None, []),
    "container": (None,),
    "context_management": (None,),
    "output_config": (None, {}),
    "diagnostics": (None,),
}
_TEXT_ONLY = "this model reads text"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """Accepted, changes nothing: the session bank caches every turn's rows anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]]

    @model_validator(mode="after")
    def _by_role(self) -> InputMessage:
        if isinstance(self.content, list):
            wrong, kind = (ToolUseBlock, "tool_use") if self.role == "user" else (ToolResultBlock, "tool_result")
            if any(isinstance(b, wrong) for b in self.content):
                raise ValueError(f"{kind} blocks are not allowed in a {self.role} message")
        return self


class CustomTool(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema with "type": "object"')
        return v


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str = Field(pattern=TOOL_NAME)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


def _refuse_blocks(data: dict[str, Any]) -> None:
    """Non-text content and server tools, refused naming where they are."""
    for i, m in enumerate(data.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, b in enumerate(content if isinstance(content, list) else []):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "tool_result" and isinstance(b.get("content"), list):
                for k, part in enumerate(b["content"]):
                    pk = part.get("type") if isinstance(part, dict) else None
                    if isinstance(pk, str) and pk != "text":
                        raise unsupported(f"{where}.content.{k}", f"{pk} blocks; {_TEXT_ONLY}")
            elif isinstance(kind, str) and kind not in ("text", "tool_use", "tool_result"):
                raise unsupported(where, f"{kind} blocks; {_TEXT_ONLY}")
    for i, t in enumerate(data.get("tools") or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise unsupported(f"tools.{i}.type", f"server tool {kind!r}; only custom tools")


class CountTokensRequest(_Strict, NullIsUnset):
    """What decides the prompt: the body of `/v1/messages/count_tokens`."""

    model: str = "default"
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _refuse_blocks(data)
        for name, off in _UNSUPPORTED_UNLESS.items():
            if name in data:
                if not any(data[name] == o and type(data[name]) is type(o) for o in off):
                    raise unsupported(name)
                data = {k: v for k, v in data.items() if k != name}
        return data

    @model_validator(mode="after")
    def _check(self) -> CountTokensRequest:
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            raise unsupported(f"messages.{last}", "a final assistant message (prefill)")
        if self.tools and len({t.name for t in self.tools}) != len(self.tools):
            raise bad_param("tools", "tool names must be unique")
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not self.tools:
            raise bad_param("tool_choice", f"tool_choice {choice.type!r} needs a non-empty tools list")
        if isinstance(choice, ToolChoiceTool) and all(t.name != choice.name for t in self.tools or []):
            raise bad_param("tool_choice", f"tool_choice names tool {choice.name!r}, which is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    """The body of `POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="Sample from the k most likely tokens; 0: off.")
    stream: bool = False
    metadata: Metadata | None = None
    # Accepted, change nothing here: the answer is the same whatever tier, region or speed
    # mode is asked for, and every turn is cached (automatic caching is always on).
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = Field(None, max_length=64)
    speed: Literal["standard", "fast"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty")
        return v


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else [
            {"type": "text", "text": b.text} for b in body.system
        ]
        out.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            texts = [{"type": "text", "text": b.text} for b in m.content if isinstance(b, TextBlock)]
            calls = [
                {"id": b.id, "type": "function",
                 "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in m.content if isinstance(b, ToolUseBlock)
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            texts = []
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    if texts:
                        out.append({"role": "user", "content": texts})
                        texts = []
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                elif isinstance(b, TextBlock):
                    texts.append({"type": "text", "text": b.text})
            if texts or not m.content:
                out.append({"role": "user", "content": texts or ""})
    return out


def chat_data(body: CountTokensRequest) -> dict[str, Any]:
    """The chat body (wire shape, to be validated by `ChatCompletionRequest`) this means."""
    data: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body)}
    if body.tools:
        data["tools"] = [
            {"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {}),
            }} for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None and body.tools:
        if isinstance(choice, ToolChoiceTool):
            data["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            data["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
            data["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        data["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                data[name] = getattr(body, name)
        if body.stop_sequences:
            data["stop"] = list(body.stop_sequences)
        if body.metadata is not None and body.metadata.user_id is not None:
            data["user"] = body.metadata.user_id
    return data


__all__ = ["CountTokensRequest", "MessagesRequest", "chat_data"]
