"""OpenAI request bodies (pydantic) and response builders.

Owns: `ChatCompletionRequest`, `CompletionRequest`, and the JSON shapes of responses and
stream chunks. Types are strict (`"10"` is not an integer, `"yes"` not a boolean: a 400
naming the field, never a silent coercion). Unknown fields are refused (extra="forbid").

Leniency where nothing changes, refusal where something would: fields that do not change
the output are accepted (`metadata`, `store: false`, `user`, `service_tier`,
`response_format {"type": "text"}`, empty `tools`, `tool_choice: "none"` without tools,
empty `logit_bias`, `refusal: null` and the other null keys of an SDK `message.model_dump()`).
`null` for any optional top-level field (and inside `stream_options`) means unset: the key
is dropped before validation and the default applies (`NullIsUnset`), as SDKs and agent
frameworks send `temperature: null`, `stream: null`, ... for parameters they leave alone.
`reasoning_effort` is accepted: it reaches the chat template as a variable (templates of
reasoning models read it); for a model whose template does not, it changes nothing.
OpenAI fields that would change the output and are not built are refused by name
(`_UNSUPPORTED_UNLESS`) unless they carry their no-op value, with a pydantic error of type
`unsupported_parameter` whose context names the field: `segserve.server.http.openai_api.validate` (the one
place validation errors become HTTP errors) turns it into a 400 with
`code: "unsupported_parameter"` and `param` = the field. Nothing is accepted and silently
ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed
MAX_LOGIT_BIAS = 300  # entries (OpenAI documents no limit; this bounds the per-step work)
# Choices per request (OpenAI allows up to 128): each is a decode row of the batch and a
# tail of up to max_tokens rows, so this bounds one request's share of a step.
MAX_N = 16

# Fields of OpenAI's API we know but do not implement, and the values that mean "off".
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "suffix": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "verbosity": (None,),
}


def unsupported(param: str, detail: str = "") -> PydanticCustomError:
    """A validation error that the HTTP layer answers with `unsupported_parameter`."""
    msg = f"unsupported parameter: {param}" + (f" ({detail})" if detail else "")
    return PydanticCustomError("unsupported_parameter", "{detail}", {"param": param, "detail": msg})


def bad_param(param: str, message: str) -> PydanticCustomError:
    """A validation error raised above field level that still names its field."""
    return PydanticCustomError("invalid_param", "{detail}", {"param": param, "detail": message})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NullIsUnset(BaseModel):
    """A model whose fields read `null` as absent (the default applies). Only its own
    fields: an unknown key is refused whatever its value. `segserve.server.http.openapi` documents null on
    every optional property of such a body model."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items() if v is not None or k not in names}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    # The SDK's stream/parse helpers add the arguments parsed on the client; a history
    # dumped from them carries it back. A copy of `arguments`: accepted, not used.
    parsed_arguments: Any = Field(None, exclude=True)


class ToolCallIn(_Strict):
    """An assistant message's earlier tool call, as the API returned it."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    # The SDK's stream helper keeps each streamed call's `index`: accepted, not used.
    index: int | None = Field(None, exclude=True)


class Message(_Strict):
    """A chat message. `role: "tool"` answers a tool call (`tool_call_id`); an assistant
    message may carry `tool_calls` with `content: null`. The null keys an SDK
    `message.model_dump()` carries (`refusal`, `audio`, `function_call`, `annotations`)
    are accepted as null, and the parse helpers' client-side copies (`parsed`,
    `function.parsed_arguments`) are accepted and not used; `name` reaches the chat
    template."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    # An earlier answer's thinking, as this server returns it: templates of reasoning models
    # read it (Qwen3's shows it within the current tool loop, drops it for earlier turns).
    reasoning_content: str | None = None
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None
    # The SDK's parse helpers' copy of `content` parsed on the client: accepted, not used.
    parsed: Any = Field(None, exclude=True)

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id is only allowed on tool messages")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if isinstance(self.content, list) and self.role != "assistant" and any(
            isinstance(p, RefusalPart) for p in self.content
        ):
            raise ValueError("refusal parts are only allowed on assistant messages")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as OpenAI's wire shape, None keys dropped (see
        `segserve.server.chat.template.normalize_messages`, which turns it into template shape)."""
        return self.model_dump(exclude_none=True)


# Template variables the server itself passes (`segserve.server.chat.template.render`'s parameters
# and the messages), so `chat_template_kwargs` cannot replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversations", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
})

# OpenAI's rules for a function's name and a JSON schema's name (both APIs use these).
FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
SCHEMA_NAME = r"^[A-Za-z0-9_\-]{1,64}$"


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    name: str = Field(pattern=SCHEMA_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]


class StreamOptions(_Strict, NullIsUnset):
    include_usage: bool = False


class _Common(NullIsUnset):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1)
    # Sampling fields left out (or null) take the model's defaults (`--generation-config`),
    # else OpenAI's: temperature 1, top_p 1, top_k and min_p off, repetition_penalty 1.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=-1, description="Sample from the k most likely tokens; 0 or -1: off."
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # what mx.random.key accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(
        1, description="Choices: one prefill, n forks of the prompt decoded together.",
        json_schema_extra={"minimum": 1, "maximum": MAX_N},  # checked by `_n_in_range`
    )
    user: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=128)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, off in _UNSUPPORTED_UNLESS.items():
            if name in data:
                if not any(data[name] == o and type(data[name]) is type(o) for o in off):
                    raise unsupported(name)
                data = {k: v for k, v in data.items() if k != name}
        return data

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in v.items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequences must be non-empty")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking).",
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="Reaches the chat template as a variable; changes nothing for a "
        "model whose template does not read it (non-reasoning models).",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"these names are set by the server, not by kwargs: {taken}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options requires stream=true")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise bad_param("tool_choice", "tool_choice 'required' or a named function needs a non-empty tools list")
        if isinstance(choice, NamedToolChoice) and self.tools and all(
            t.function.name != choice.function.name for t in self.tools
        ):
            raise bad_param(
                "tool_choice", f"tool_choice names function {choice.function.name!r}, which is not in tools"
            )
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise bad_param("tools", "function names in tools must be unique")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools the chat template presents: all given, whatever `tool_choice` says (as
        vLLM does by default), so a turn with "none" keeps the prompt prefix, and the
        stored segments, of the turns around it."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_variables(self) -> dict[str, Any]:
        """Extra variables for the chat template: `chat_template_kwargs`, and
        `reasoning_effort` when given (kwargs win, as in vLLM)."""
        out: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        out.update(self.chat_template_kwargs or {})
        return out

    def calls_tools(self) -> bool:
        """Whether the answer is parsed for tool calls (tools given, choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_choice_value(self) -> str | dict[str, Any]:
        c = self.tool_choice
        if c is None:
            return "auto"
        return c if isinstance(c, str) else c.model_dump()

    def response_format_value(self) -> dict[str, Any] | None:
        rf = self.response_format
        if rf is None or isinstance(rf, ResponseFormatText):
            return None
        return rf.model_dump(by_alias=True, exclude_none=True)


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
