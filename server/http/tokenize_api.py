"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes.

Owns: the two routes and their bodies. `/tokenize` takes either `{model, prompt,
add_special_tokens}` (the text as `/v1/completions` would tokenize it) or `{model, messages,
add_generation_prompt, tools, chat_template_kwargs}` (the prompt `/v1/chat/completions`
would run: same normalization, same tool presentation, same template), and answers
`{count, max_model_len, tokens}` (+ `token_strs` when `return_token_strs`).
`/detokenize` takes `{model, tokens}` and answers `{prompt}`: the text as generated text is
decoded (special tokens such as `<|im_start|>` are left out, as in answers).

Invariant: the ids `/tokenize` returns for `messages` are exactly the prompt a chat request
with those messages, tools and kwargs would be given (it calls the chat route's own
preparation, `prepare_chat`), so a client can count context before sending.
`add_special_tokens` is accepted only as false for text prompts: the tokenizer here adds
no BOS of its own (the chat template writes any special tokens), so true would be a
promise this route cannot keep differently from false; it is refused by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from segserve.server.http.errors import InvalidRequest
from segserve.server.http.openai_api import (
    _check_model,
    off_loop,
    prepare_chat,
    read_body,
    validate,
)
from segserve.server.http.schemas import ChatCompletionRequest, Message, NullIsUnset, Tool
from segserve.server.http.serving import Serving


class TokenizeRequest(NullIsUnset):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = "default"
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise ValueError("tools and chat_template_kwargs go with messages, not prompt")
        if not self.add_generation_prompt and self.messages is None:
            raise ValueError("add_generation_prompt goes with messages, not prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = "default"
    tokens: list[int] = Field(min_length=0)


async def tokenize(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: TokenizeRequest = await read_body(request, TokenizeRequest, rt.settings.max_request_bytes)
    _check_model(rt, body.model)
    if body.add_special_tokens:
        raise InvalidRequest(
            "unsupported parameter: add_special_tokens (this tokenizer adds no special "
            "tokens of its own; the chat template writes them)",
            param="add_special_tokens", code="unsupported_parameter",
        )
    if body.messages is not None:
        chat = _chat_request(body)
        if body.add_generation_prompt:
            tokens = (await prepare_chat(rt, chat)).prompt
        else:
            tokens = await off_loop(rt, _without_generation_prompt, rt, chat)
    else:
        assert body.prompt is not None
        tokens = await off_loop(rt, rt.encode_prompt, body.prompt, "prompt")
    out: dict[str, Any] = {
        "count": len(tokens), "max_model_len": rt.context_length, "tokens": list(tokens),
    }
    if body.return_token_strs:
        out["token_strs"] = [rt.tokenizer.decode([t]) for t in tokens]
    return JSONResponse(out)


def _chat_request(body: TokenizeRequest) -> ChatCompletionRequest:
    data: dict[str, Any] = {
        "model": body.model, "messages": [m.model_dump(exclude_none=True) for m in body.messages or []],
    }
    if body.tools is not None:
        data["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.chat_template_kwargs is not None:
        data["chat_template_kwargs"] = body.chat_template_kwargs
    out: ChatCompletionRequest = validate(ChatCompletionRequest, data)
    return out


def _without_generation_prompt(rt: Serving, chat: ChatCompletionRequest) -> list[int]:
    """The chat route's rendering with `add_generation_prompt=False` (worker thread)."""
    from segserve.server.http.openai_api import _present_tools, _template_messages

    msgs, shown = _present_tools(rt, _template_messages(chat), chat.template_tools())
    variables = {**chat.template_variables(), "add_generation_prompt": False}
    return rt.encode_chat(msgs, shown or None, variables)


async def detokenize(request: Request) -> Response:
    rt: Serving = request.app.state.serving
    body: DetokenizeRequest = await read_body(request, DetokenizeRequest, rt.settings.max_request_bytes)
    _check_model(rt, body.model)
    vocab = rt.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"tokens: id {bad[0]} is outside the vocabulary (0 .. {vocab - 1})", param="tokens"
        )
    text = await off_loop(rt, rt.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


def tokenize_routes() -> list[Route]:
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
