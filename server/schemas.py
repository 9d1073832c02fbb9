"""OpenAI request bodies (pydantic) and response builders.

Owns: `ChatCompletionRequest`, `CompletionRequest`, and the JSON shapes of responses and
stream chunks. Types are strict (`"10"` is not an integer, `"yes"` not a boolean: a 400
naming the field, never a silent coercion). Unknown fields are refused
(extra="forbid"); OpenAI fields that segserve
does not implement are refused by name unless they carry their no-op value (e.g.
`n=1`, `frequency_penalty=0`), so nothing is ever accepted and silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed

# Fields of OpenAI's API we know but do not implement, and the value that means "off".
_UNSUPPORTED_UNLESS: dict[str, Any] = {
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "parallel_tool_calls": None,
    "response_format": None,
    "logit_bias": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
    "reasoning_effort": None,
    "service_tier": None,
    "metadata": None,
    "store": False,
    "suffix": None,
    "echo": False,
    "best_of": 1,
    "verbosity": None,
}
_ZERO_ONLY = ("frequency_penalty", "presence_penalty")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # what mx.random.key accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=128)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, off in _UNSUPPORTED_UNLESS.items():
            if name in data and data[name] is not None and data[name] != off:
                raise ValueError(f"unsupported parameter: {name}")
            data.pop(name, None)
        for name in _ZERO_ONLY:
            if data.get(name) not in (None, 0, 0.0):
                raise ValueError(f"unsupported parameter: {name} (only 0 is supported)")
        if data.get("n", 1) != 1:
            raise ValueError("unsupported parameter: n (only n=1 is supported)")
        return data

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


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options requires stream=true")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
