"""Tokenizer and chat template: built from GGUF metadata, or taken from an mlx-lm load.

Owns: the `ChatTokenizer` facade the engine and HTTP layer use (encode, decode, a token's
exact bytes, chat rendering with tools, EOS ids, the template hash that the bank namespaces
by, the `tokenizers` backend that grammar-constrained decoding builds its vocabulary from).

Chat templates render through `segserve.server.chat.template` (transformers' own renderer, so
`{% break %}`, `{% generation %}`, `strftime_now` and `tojson` behave as model authors
tested them); messages are given in template shape (`segserve.server.chat.template.normalize_messages`).

GGUF route: `tokenizer.ggml.model == "gpt2"` is GPT-2 style byte-level BPE. The tokenizer is
built by transformers' GGUF converter (`convert_gguf_tokenizer`, in one of `_GGUF_MODULES`:
vocabulary, merges, control tokens (type 3) and user-defined tokens (type 4) kept whole, its
pre-tokenizer split for `tokenizer.ggml.pre`), fed with the metadata the model load already
read. Not through `from_pretrained(..., gguf_file=...)`: that reads the file with transformers' own GGUF reader, which imports torch at module level (transformers
5.24: `integrations/gguf/reader.py` → `ModuleNotFoundError: No module named 'torch'`; torch is
not installed here), and the PyPI `gguf` package is not used on transformers' tokenizer path at
all, so it is not a dependency. Measured on the embedded SmolLM2 GGUF (tests/
test_gguf_tokenizer_parity.py; bench/tokenizer_gguf.py, 2 shared CPU cores): identical
vocabulary, special tokens, token bytes and ids to the hand build on a varied corpus (English,
code, digit runs, emoji, CJK, whitespace runs, rendered conversations, `<|im_start|>`); encode
speed equal (9,800 tokens: 24.97 against 24.89 ms median, 15.4 against 15.5 ms min); build
~0.06-0.1 s slower (0.20 against 0.11 s median, once at model load), taken for the converter's wider coverage
(user-defined tokens, respelled vocabularies, more `tokenizer.ggml.pre` splits, kept upstream).

SentencePiece GGUFs (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral v0.1-0.3, Phi-3,
Gemma 2/3) are built by the same converter (`sentencepiece`), with llama.cpp's space-prefix
rule; checked against llama.cpp's own test vectors and SentencePiece itself
(tests/test_gguf_sentencepiece.py). Their end-of-generation ids follow llama.cpp: EOS, the
file's EOT/EOM ids and the control tokens it ends on (`<end_of_turn>`, `<|end|>`, ...).

Hand-written parts kept, each because transformers' converter does worse:
- the pre-tokenizer for `tokenizer.ggml.pre` values transformers has no split for
  (`PRE_TOKENIZERS`: "smollm" splits every digit, as llama.cpp and SmolLM's tokenizer.json do;
  transformers silently uses GPT-2's, which groups digit runs: other ids than the hand build
  on "½ ² ³ ٣٤٥ ४२ Ⅻ ① 𝟙𝟚 一二三", same elsewhere in the corpus). A value neither table knows
  is a load error naming it (transformers silently falls back to GPT-2's).
- no post-processor: transformers' TemplateProcessing adds nothing to what we encode and
  cost ~7-10 % of encode time (median and min, before it was dropped).
- `build_bpe`, the whole hand build, as the fallback when transformers cannot build a GGUF
  (its converter raises, or its vocabulary size differs from the file's: `GPT2Tokenizer` adds
  `<|endoftext|>` when the vocabulary lacks it); the reason is logged once.

Encoding never holds the GIL: `tokenizers`' `encode` holds it for the whole call (11 s for
3.9 MB of digits, every other thread stalled, the event loop included), `encode_batch`
releases it, with the same ids (tests/test_no_stall.py). mlx-lm's fast tokenizers already
go through transformers' `encode_batch`.

`ChatTokenizer.max_token_chars`, computed once at load (`longest_token_chars`): the most
characters one token can stand for (the longest token's bytes, special tokens' text
included). A text longer than `context × max_token_chars` characters cannot fit the
context, so it is refused before it is tokenized (`char_limit`). The bound holds only when
no stage of the tokenizer drops or fuses characters (a normalizer that strips, a
pre-tokenizer that removes whitespace, an unknown token that swallows a run of
characters); for any other tokenizer it is None and nothing is refused early.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from segserve.server.chat.template import ChatTemplate, TemplateRenderError

log = logging.getLogger("segserve.runner")

CONTROL_TOKEN_TYPE = 3

# The chat template could not render these messages (kept under its old name).
TemplateError = TemplateRenderError


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    @property
    def backend(self) -> Tokenizer | None: ...


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    codec: TextCodec
    chat_template: str
    eos_ids: frozenset[int]
    bos_token: str
    eos_token: str
    vocab_size: int
    max_token_chars: int | None = None  # see the module doc; None: no bound known

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def char_limit(self, tokens: int) -> int | None:
        """The most characters a text of `tokens` tokens can have (None: no bound known).
        Each character is at least one byte and no token stands for more bytes than the
        longest one, so a longer text needs more than `tokens` tokens."""
        return None if self.max_token_chars is None else tokens * self.max_token_chars

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a piece of a multi-byte character stays that piece, not
        U+FFFD): what OpenAI's logprob `bytes` holds. Special tokens give their text."""
        return self.codec.token_bytes(int(token_id))

    @property
    def backend(self) -> Tokenizer | None:
        """The `tokenizers` tokenizer (for llguidance), when the codec has one."""
        return self.codec.backend

    def template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self.bos_token or None, self.eos_token or None)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """`messages` in template shape → the prompt, with the generation prompt added.
        Raises `TemplateError` (= `segserve.server.chat.template.TemplateRenderError`)."""
        return self.template().render(messages, tools=tools or None, **extra)

    @property
    def fingerprint(self) -> str:
        """Hash of the template and vocabulary size: part of every bank key."""
        h = hashlib.blake2b(digest_size=12)
        h.update(self.chat_template.encode())
        h.update(str(self.vocab_size).encode())
        h.update(json.dumps(sorted(self.eos_ids)).encode())
        return h.hexdigest()


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in characters → the bytes they stand for (the
    GPT-2 scheme: printable Latin-1 bytes stand for themselves, the others are shifted to
    U+0100 and up in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    shift = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def piece_bytes(piece: str, *, byte_level: bool) -> bytes:
    """A vocabulary entry's bytes: byte-level BPE pieces map char by char back to bytes;
    SentencePiece pieces are `<0xNN>` byte fallbacks or text with U+2581 for spaces."""
    if byte_level and all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    m = _BYTE_FALLBACK.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _is_byte_level(tok: Tokenizer) -> bool:
    try:
        decoder = json.loads(tok.to_str()).get("decoder") or {}
        return bool(decoder.get("type") == "ByteLevel")
    except (ValueError, AttributeError):
        return False


class _HFCodec:
    """`tokenizers.Tokenizer` with special tokens kept on decode off (they are text we strip)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._byte_level = _is_byte_level(tok)
        self._special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it runs; encode does not (see the module doc).
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode("utf-8")
        return piece_bytes(piece, byte_level=self._byte_level)

    @property
    def backend(self) -> Tokenizer:
        return self._tok


# `tokenizer.ggml.pre` (what llama.cpp's converter writes) → the pre-tokenizer it names.
# Ours: GPT-2's (an absent key, as llama.cpp reads it) and SmolLM's digit split, which
# transformers' converter lacks (measured: identical ids on the embedded model, see
# tests/test_openai_fidelity.py). Every other name comes from transformers' own table of
# split regexes (`GGUF_PRE_TOKENIZER_SPLITS`: llama3/llama-bpe, qwen2, tekken, gpt-4o ...).


# Where transformers keeps its torch-free GGUF tokenizer pieces: 5.2x has them in
# `integrations/gguf/gguf_tokenizer_mapping.py`; other releases keep the key renaming table in
# `integrations/ggml.py` (with one of those, reading it from the first module only failed every
# GGUF at start-up with an AttributeError instead of using the hand-built fallback).
_GGUF_MODULES = ("transformers.integrations.gguf.gguf_tokenizer_mapping", "transformers.integrations.ggml")


@dataclass(frozen=True)
class _GGUFConverter:
    keys: Mapping[str, str]  # GGUF `tokenizer.*` key -> the converter's name for it
    convert: Callable[[str, dict[str, Any]], Any]  # (architecture, tokenizer dict) -> (Tokenizer, ...)
    splits: Mapping[str, str]  # `tokenizer.ggml.pre` -> its split regex (empty: none known)

    def build(self, arch: str, d: dict[str, Any]) -> Tokenizer:
        """The converter's tokenizer for `d` (`_tokenizer_dict`); `GGUFTokenizerUnsupported`
        where it fails, gives no `Tokenizer`, or its vocabulary size differs from the file's."""
        try:
            tok, _ = self.convert(arch, d)
        except Exception as e:  # noqa: BLE001 - any converter failure: the caller's fallback or error
            raise GGUFTokenizerUnsupported(f"transformers' GGUF converter failed: {type(e).__name__}: {e}") from e
        if not isinstance(tok, Tokenizer):
            raise GGUFTokenizerUnsupported(f"transformers' GGUF converter gave {type(tok).__name__}")
        size = len(d.get("tokens") or ())
        if tok.get_vocab_size(with_added_tokens=True) != size:
            raise GGUFTokenizerUnsupported(
                f"transformers' GGUF tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, the file {size}"
            )
        return tok


@lru_cache(maxsize=1)
def _gguf_converter() -> _GGUFConverter | None:
    """transformers' GGUF tokenizer converter, from whichever of `_GGUF_MODULES` this release
    has it in (never its GGUF file reader, which imports torch); None when it has none."""
    found: dict[str, Any] = {}
    for name in _GGUF_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing or torch-needing module: look elsewhere
            continue
        for attr in ("GGUF_TOKENIZER_MAPPING", "convert_gguf_tokenizer", "GGUF_PRE_TOKENIZER_SPLITS"):
            if attr not in found and hasattr(module, attr):
                found[attr] = getattr(module, attr)
    table, convert = found.get("GGUF_TOKENIZER_MAPPING"), found.get("convert_gguf_tokenizer")
    if not isinstance(table, Mapping) or not isinstance(table.get("tokenizer"), Mapping) or not callable(convert):
        return None
    return _GGUFConverter(table["tokenizer"], convert, found.get("GGUF_PRE_TOKENIZER_SPLITS") or {})


def _converter() -> _GGUFConverter:
    conv = _gguf_converter()
    if conv is None:
        import transformers

        raise GGUFTokenizerUnsupported(
            f"transformers {transformers.__version__} has no GGUF tokenizer converter "
            f"(GGUF_TOKENIZER_MAPPING and convert_gguf_tokenizer in {' or '.join(_GGUF_MODULES)})")
    return conv


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS: dict[str, Any] = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
}


def _transformers_splits() -> dict[str, str]:
    conv = _gguf_converter()
    return {str(k): str(v) for k, v in conv.splits.items()} if conv is not None else {}


class UnknownPreTokenizer(ValueError):
    """The GGUF names a pre-tokenizer (`tokenizer.ggml.pre`) this server does not know."""


def pre_tokenizer_for(name: str | None) -> pre_tokenizers.PreTokenizer:
    """`tokenizer.ggml.pre` → pre-tokenizer. Absent → "default" (GPT-2's), as llama.cpp
    reads an absent key; unknown → `UnknownPreTokenizer` (a start-up error naming it)."""
    key = (name or "default").strip().lower()
    make = PRE_TOKENIZERS.get(key)
    if make is not None:
        return make()  # type: ignore[no-any-return]
    splits = _transformers_splits()
    if key in splits:
        return _split_then_bytes(splits[key])
    known = sorted({*PRE_TOKENIZERS, *splits})
    raise UnknownPreTokenizer(
        f"GGUF tokenizer.ggml.pre {name!r} is not supported; known: {', '.join(known)}"
    )


def build_bpe(
    tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str | None = "smollm"
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)  # type: ignore[arg-type]
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer_for(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == CONTROL_TOKEN_TYPE
    ]
    tok.add_special_tokens(specials)
    return tok


def _plain(value: Any) -> Any:
    """A metadata value as Python data (mx.load gives scalars and numeric arrays as mx.array)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


class GGUFTokenizerUnsupported(ValueError):
    """transformers' converter cannot build this GGUF's tokenizer (the hand build is used)."""


def transformers_bpe(meta: Mapping[str, Any]) -> Tokenizer:
    """The GGUF tokenizer as transformers' converter builds it from the file's metadata, with
    the pre-tokenizer of `tokenizer.ggml.pre` (`pre_tokenizer_for`) where transformers has no
    split for that name. Raises `GGUFTokenizerUnsupported` where the converter fails or its
    vocabulary differs in size from the file's, `UnknownPreTokenizer` for an unknown `pre`."""
    conv = _converter()
    tokenizer_dict = _tokenizer_dict(meta, conv)
    pre = tokenizer_dict.get("pre_tokenizer_type")
    own_pre = pre_tokenizer_for(None if pre is None else str(pre))  # unknown: fails here
    tok = conv.build(str(meta.get("general.architecture", "")), tokenizer_dict)  # failing: the hand build
    if str(pre or "default").strip().lower() not in _transformers_splits():
        tok.pre_tokenizer = own_pre
    # Its post-processor (a TemplateProcessing from add_bos/add_eos) adds nothing to what we
    # encode (add_special_tokens=False: the chat template writes BOS itself) yet costs ~7-10 % of
    # encode time (bench/tokenizer_gguf.py).
    tok.post_processor = None
    return tok


def gguf_bpe(meta: Mapping[str, Any]) -> tuple[Tokenizer, str]:
    """(tokenizer, route): transformers' build, or the hand build (`build_bpe`) with the
    reason logged when transformers cannot build this GGUF."""
    try:
        return transformers_bpe(meta), "transformers"
    except GGUFTokenizerUnsupported as e:
        log.warning("GGUF tokenizer: hand-built fallback: %s", e)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in _plain(meta["tokenizer.ggml.token_type"])]
    pre = meta.get("tokenizer.ggml.pre")
    tok = build_bpe(tokens, list(meta["tokenizer.ggml.merges"]), types, str(pre) if pre is not None else None)
    return tok, "hand-built"


# `tokenizer.ggml.model` values built as SentencePiece (llama.cpp's SPM vocabulary type).
# "gemma4" is transformers' name for the same shape without merges. UGM ("t5"), WPM ("bert")
# and RWKV vocabularies are refused by name: no served architecture uses them.
SENTENCEPIECE = frozenset({"llama", "gemma4"})

# Token texts llama.cpp ends generation on besides EOS (`llama-vocab.cpp`'s end-of-generation
# list, the ones a SentencePiece chat model uses): a chat template ends its turns with these.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<EOT>", "<|end_of_text|>"})


def _tokenizer_dict(meta: Mapping[str, Any], conv: _GGUFConverter) -> dict[str, Any]:
    return {name: _plain(meta[f"tokenizer.{key}"]) for key, name in conv.keys.items() if f"tokenizer.{key}" in meta}


def sentencepiece(meta: Mapping[str, Any]) -> Tokenizer:
    """A SentencePiece GGUF vocabulary (`tokenizer.ggml.model` "llama": tokens, scores, token
    types; merges from the file or, as llama.cpp's SPM tokenizer does, implied by the scores)
    built by transformers' converter, which also picks the per-architecture shape (gemma:
    merges in file order and respelled whitespace tokens; phi3: a prefix-space normalizer).

    The space prefix follows llama.cpp (`tokenizer.ggml.add_space_prefix`, true when absent
    for SPM): every text fragment that starts the input or follows a special token gets one
    space, even a fragment that already starts with a space. transformers' Llama tokenizer
    uses `Metaspace`, which adds none before a leading space (other ids on " Hello": llama.cpp's
    test vectors `ggml-vocab-llama-spm.gguf.out` say [29871, 15043]), so "llama"-architecture
    files get the prepend-and-replace normalizer of Llama 2's own tokenizer.json instead.
    Raises `GGUFTokenizerUnsupported` where the converter fails or the vocabulary size differs."""
    from tokenizers import normalizers

    conv = _converter()
    d = _tokenizer_dict(meta, conv)
    arch = str(meta.get("general.architecture", ""))
    tok = conv.build(arch, d)  # failing: named in the start-up error
    if d.get("tokenizer_type") == "llama" and not arch.startswith("gemma"):
        add_prefix = bool(d.get("add_prefix_space", True))
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
        tok.pre_tokenizer = None
    tok.post_processor = None  # BOS comes from the chat template (see `transformers_bpe`)
    return tok


def _eos_ids(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> frozenset[int]:
    """EOS, the file's EOT/EOM ids, and control tokens llama.cpp treats as end of generation."""
    ids = {int(_plain(meta["tokenizer.ggml.eos_token_id"]))}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta:
            ids.add(int(_plain(meta[key])))
    ids.update(i for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
               if ty == CONTROL_TOKEN_TYPE and t in _EOG_TEXTS)
    return frozenset(ids)


def from_gguf_metadata(meta: dict[str, Any]) -> tuple[ChatTokenizer, Tokenizer]:
    kind = str(meta.get("tokenizer.ggml.model", ""))
    if kind != "gpt2" and kind not in SENTENCEPIECE:
        raise ValueError(
            f"GGUF tokenizer {kind!r} is not supported (gpt2 byte-level BPE; SentencePiece: "
            f"{', '.join(sorted(SENTENCEPIECE))})"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    template = str(meta.get("tokenizer.chat_template", ""))
    if not template:
        raise ValueError("GGUF has no tokenizer.chat_template")
    eos = int(_plain(meta["tokenizer.ggml.eos_token_id"]))
    bos = int(_plain(meta["tokenizer.ggml.bos_token_id"]))
    if kind == "gpt2":
        tok, _ = gguf_bpe(meta)
        # <|endoftext|> ends documents; the chat template ends turns with eos (<|im_end|>).
        eos_ids = frozenset({eos, int(_plain(meta.get("tokenizer.ggml.unknown_token_id", eos)))})
    else:
        try:
            tok = sentencepiece(meta)
        except GGUFTokenizerUnsupported as e:
            raise ValueError(f"GGUF SentencePiece tokenizer: {e}") from e
        types = [int(t) for t in _plain(meta["tokenizer.ggml.token_type"])]
        eos_ids = _eos_ids(meta, tokens, types)
    codec = _HFCodec(tok)
    longest = longest_token_chars(tok, codec.token_bytes)
    chat = ChatTokenizer(codec, template, eos_ids, tokens[bos], tokens[eos], len(tokens), longest)
    return chat, tok


# Tokenizer stages that never drop characters nor fuse a run of them into one token
# (`tokenizers`' JSON type names). Anything else makes `longest_token_chars` None.
_KEEPS_CHARACTERS = frozenset({
    "Sequence", "ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts",
    "Prepend", "Lowercase", "NFD", "NFKD",  # decomposing or prepending only adds characters
    "Split", "Replace",  # checked further in `_keeps_characters`
})


def _keeps_characters(stage: Any) -> bool:
    """Whether a normalizer / pre-tokenizer (its JSON form) keeps every character."""
    if stage is None:
        return True
    kind = stage.get("type")
    if kind not in _KEEPS_CHARACTERS:
        return False
    if kind == "Split" and str(stage.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":
        pattern = stage.get("pattern") or {}
        if "String" not in pattern or len(str(stage.get("content", ""))) < len(pattern["String"]):
            return False
    parts = stage.get("normalizers") or stage.get("pretokenizers") or []
    return all(_keeps_characters(p) for p in parts)


def _may_fuse_unknowns(model: Mapping[str, Any]) -> bool:
    """An unknown token that may stand for a run of characters (BPE's `fuse_unk`, Unigram,
    which always fuses, or a word-level model's whole unknown word)."""
    kind = model.get("type")
    if kind == "BPE":
        return bool(model.get("fuse_unk")) and model.get("unk_token") is not None and not model.get("byte_fallback")
    if kind == "Unigram":
        return model.get("unk_id") is not None and not model.get("byte_fallback")
    return True


def longest_token_chars(tok: Tokenizer, token_bytes: Callable[[int], bytes]) -> int | None:
    """The most characters one token of `tok` can stand for: its longest token in bytes
    (`token_bytes(id)`; a character is at least one byte), or None where the tokenizer may
    drop or fuse characters (see the module doc). One pass over the vocabulary at load
    (~0.08 s for 49,152 tokens)."""
    try:
        spec = json.loads(tok.to_str())
    except ValueError:
        return None
    if _may_fuse_unknowns(spec.get("model") or {}):
        return None
    if not (_keeps_characters(spec.get("normalizer")) and _keeps_characters(spec.get("pre_tokenizer"))):
        return None
    size = tok.get_vocab_size(with_added_tokens=True)
    return max((len(token_bytes(i)) for i in range(size)), default=0) or None


class _MlxLmCodec:
    def __init__(self, wrapper: Any) -> None:
        self._w = wrapper
        backend = self.backend
        self._bytes = _HFCodec(backend) if backend is not None else None

    def encode(self, text: str) -> list[int]:
        return list(self._w.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._w.decode(list(ids), skip_special_tokens=True))

    @property
    def backend(self) -> Tokenizer | None:
        hf = getattr(self._w, "_tokenizer", None)
        backend = getattr(hf, "backend_tokenizer", None)
        return backend if isinstance(backend, Tokenizer) else None

    def token_bytes(self, token_id: int) -> bytes:
        if self._bytes is not None:
            return self._bytes.token_bytes(token_id)
        return self.decode([token_id]).encode("utf-8")


def from_mlx_lm(wrapper: Any) -> ChatTokenizer:
    """Facade over mlx-lm's TokenizerWrapper (HF tokenizer + its chat template)."""
    template = getattr(wrapper, "chat_template", None) or ""
    if not template:
        raise ValueError("the model's tokenizer has no chat template")
    eos_ids = frozenset(int(i) for i in getattr(wrapper, "eos_token_ids", {wrapper.eos_token_id}))
    codec = _MlxLmCodec(wrapper)
    backend = codec.backend
    return ChatTokenizer(
        codec,
        str(template),
        eos_ids,
        str(getattr(wrapper, "bos_token", "") or ""),
        str(getattr(wrapper, "eos_token", "") or ""),
        int(getattr(wrapper, "vocab_size", 0) or len(wrapper.get_vocab())),
        # a slow (pure Python) tokenizer has no `tokenizers` form: no bound
        longest_token_chars(backend, codec.token_bytes) if backend is not None else None,
    )
