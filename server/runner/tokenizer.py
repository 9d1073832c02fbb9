"""Tokenizer and chat template: built from GGUF metadata, or taken from an mlx-lm load.

Owns: the `ChatTokenizer` facade the engine and HTTP layer use (encode, decode, chat
rendering, EOS ids, the template hash that the bank namespaces by).

GGUF route: `tokenizer.ggml.model == "gpt2"` is GPT-2 style byte-level BPE; the
`tokenizers` library builds it from `tokenizer.ggml.tokens` / `.merges`. Token type 3
marks control tokens (`<|im_start|>` ...), which must never be split by BPE.
The "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL_TOKEN_TYPE = 3


class TemplateError(ValueError):
    """The chat template could not render these messages."""


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    codec: TextCodec
    chat_template: str
    eos_ids: frozenset[int]
    bos_token: str
    eos_token: str
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(list(ids))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        try:
            template = _ENV.from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    @property
    def fingerprint(self) -> str:
        """Hash of the template and vocabulary size: part of every bank key."""
        h = hashlib.blake2b(digest_size=12)
        h.update(self.chat_template.encode())
        h.update(str(self.vocab_size).encode())
        h.update(json.dumps(sorted(self.eos_ids)).encode())
        return h.hexdigest()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


# A sandbox: chat templates come from model files, which are data, not code.
_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENV.globals["raise_exception"] = _raise


class _HFCodec:
    """`tokenizers.Tokenizer` with special tokens kept on decode off (they are text we strip)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    @property
    def backend(self) -> Tokenizer:
        return self._tok


def build_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)  # type: ignore[arg-type]
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == CONTROL_TOKEN_TYPE
    ]
    tok.add_special_tokens(specials)
    return tok


def from_gguf_metadata(meta: dict[str, Any]) -> tuple[ChatTokenizer, Tokenizer]:
    kind = str(meta.get("tokenizer.ggml.model", ""))
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (gpt2 byte-level BPE only)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    tok = build_bpe(tokens, list(meta["tokenizer.ggml.merges"]), types)
    eos = int(meta["tokenizer.ggml.eos_token_id"].item())
    bos = int(meta["tokenizer.ggml.bos_token_id"].item())
    template = str(meta.get("tokenizer.chat_template", ""))
    if not template:
        raise ValueError("GGUF has no tokenizer.chat_template")
    # <|endoftext|> ends documents; the chat template ends turns with eos (<|im_end|>).
    eos_ids = frozenset({eos, int(meta.get("tokenizer.ggml.unknown_token_id", eos).item())})
    chat = ChatTokenizer(_HFCodec(tok), template, eos_ids, tokens[bos], tokens[eos], len(tokens))
    return chat, tok


class _MlxLmCodec:
    def __init__(self, wrapper: Any) -> None:
        self._w = wrapper

    def encode(self, text: str) -> list[int]:
        return list(self._w.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._w.decode(list(ids), skip_special_tokens=True))


def from_mlx_lm(wrapper: Any) -> ChatTokenizer:
    """Facade over mlx-lm's TokenizerWrapper (HF tokenizer + its chat template)."""
    template = getattr(wrapper, "chat_template", None) or ""
    if not template:
        raise ValueError("the model's tokenizer has no chat template")
    eos_ids = frozenset(int(i) for i in getattr(wrapper, "eos_token_ids", {wrapper.eos_token_id}))
    return ChatTokenizer(
        _MlxLmCodec(wrapper),
        str(template),
        eos_ids,
        str(getattr(wrapper, "bos_token", "") or ""),
        str(getattr(wrapper, "eos_token", "") or ""),
        int(getattr(wrapper, "vocab_size", 0) or len(wrapper.get_vocab())),
    )
