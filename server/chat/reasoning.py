"""Reasoning models: the thinking split from the answer, whole or streamed.

Owns: the reasoning families (`ReasoningFamily`), choosing one from a chat template or a
`--reasoning-parser` name (`resolve_family`), where a turn's output starts (`start_from_prompt`:
inside the thinking, after a thinking block the template closed, or up to the model), the
incremental splitter (`ReasoningStream`) and the whole-text one (`split_reasoning`), and the
grammar gate (`ThinkingGate`) that lets a `response_format` / forced-tool grammar constrain
only the answer.

Families (the markup is `<think>` ... `</think>` for both; what differs is the default):
- DEEPSEEK_R1: the output is thinking until `</think>`; the chat template's generation
  prompt may already end with `<think>` (then the output starts inside the thinking), and a
  leading `<think>` in the output is markup too. No `</think>` at all: everything is thinking.
- QWEN3: thinking is optional; the output is an answer unless it starts with `<think>`
  (leading whitespace aside). `enable_thinking: false` makes the template close an empty
  thinking block in the prompt, so the whole output is the answer.
Either way, a prompt that ends inside an open `<think>` starts in the thinking, and one
that ends with a closed thinking block starts in the answer (`Start`).

Invariants:
- Chunking does not matter: the stream decides on the text, never on piece boundaries; a
  tag split across pieces (`<thi` + `nk>`) never leaks, and text that merely starts like a
  tag (`<thinking`) is released as soon as it cannot be one. `split_reasoning(text)` is the
  stream fed `text` at once (tests check every split of sample texts).
- Tags are markup: neither `<think>` nor `</think>` reaches the reasoning or the content.
  Whitespace next to the tags is markup too (leading and trailing whitespace of the
  thinking, leading whitespace of the answer after `</think>`), so the two texts read
  clean; an answer without any thinking is left exactly as generated.
- Only the first thinking block is parsed: after `</think>` everything is content.
- `reasoning_tokens` counts the tokens generated until the thinking ended (the token that
  completed `</think>` included), or all of them while it has not ended.
- Special tokens the tokenizer skips when decoding do not reach the text, so a model whose
  `<think>` is a *special* token cannot be split here (Qwen3 and DeepSeek R1 mark theirs
  as ordinary added tokens).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

OPEN = "<think>"
CLOSE = "</think>"
PARSER_NAMES = ("auto", "none", "deepseek_r1", "qwen3")


class ReasoningFamily(enum.Enum):
    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


class Start(enum.Enum):
    """Where a turn's output starts, read from the end of its prompt."""

    THINKING = "thinking"  # the generation prompt opened `<think>`
    ANSWER = "answer"  # the generation prompt closed a thinking block (thinking off)
    MODEL = "model"  # neither: the family's default decides


def detect_family(template: str) -> ReasoningFamily | None:
    """A template that mentions `<think>` gets a parser: QWEN3 when thinking is switchable
    (`enable_thinking`) or the template is ChatML (`<|im_start|>`), else DEEPSEEK_R1."""
    if OPEN not in template and CLOSE not in template:
        return None
    if "enable_thinking" in template or "<|im_start|>" in template:
        return ReasoningFamily.QWEN3
    return ReasoningFamily.DEEPSEEK_R1


def resolve_family(template: str, setting: str) -> ReasoningFamily | None:
    """`--reasoning-parser`: a family name wins, `none` turns splitting off, `auto` detects."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_family(template)
    return ReasoningFamily(setting)


def start_from_prompt(tail: str) -> Start:
    """`tail`: the last characters of the rendered prompt. A `<think>` followed only by
    whitespace means the output starts inside the thinking; a `</think>` followed only by
    whitespace means thinking was switched off. A tag earlier in the prompt (a user's text,
    an earlier turn) decides nothing."""
    stripped = tail.rstrip()
    if stripped.endswith(OPEN):
        return Start.THINKING
    if stripped.endswith(CLOSE):
        return Start.ANSWER
    return Start.MODEL


@dataclass(frozen=True, slots=True)
class ReasoningMode:
    """How one request's output is split: the family and where the output starts."""

    family: ReasoningFamily
    start: Start

    @property
    def thinks(self) -> bool:
        """Whether the output can hold thinking (False: it is all answer)."""
        return self.start is not Start.ANSWER

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of output text: thinking (`reasoning`) or answer."""

    reasoning: bool
    text: str


class _State(enum.Enum):
    START = 0  # output start: a `<think>` (after whitespace) may still open the thinking
    THINKING = 1
    AFTER = 2  # right after `</think>`: whitespace before the answer is dropped
    ANSWER = 3


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Generated text pieces in, `Piece`s out (see the module invariants)."""

    def __init__(self, mode: ReasoningMode) -> None:
        self._fallback_thinking = mode.start is Start.THINKING or (
            mode.start is Start.MODEL and mode.family is ReasoningFamily.DEEPSEEK_R1
        )
        self._state = _State.ANSWER if mode.start is Start.ANSWER else _State.START
        self._held = ""  # text not decided yet (a possible tag, leading whitespace)
        self._begun = False  # the thinking text has begun (its leading whitespace dropped)
        self._ws = ""  # the thinking's trailing whitespace, sent once more thinking follows
        self._tokens = 0
        self._reasoning_tokens = 0
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning_tokens

    @property
    def thinking(self) -> bool:
        """Inside the thinking (or still undecided at the output's start)."""
        return self._state in (_State.START, _State.THINKING)

    def feed(self, text: str, tokens: int = 1) -> list[Piece]:
        """The next generated text (`tokens`: how many tokens it is, 0 for held-back text)."""
        self._tokens += tokens
        out: list[Piece] = []
        self._held += text
        while self._held and self._step(out):
            pass
        if self._state is _State.THINKING:
            self._reasoning_tokens = self._tokens
        return _merged(out)

    def finish(self) -> list[Piece]:
        """The output ended: release what was held (a partial tag is text after all)."""
        out: list[Piece] = []
        held, self._held = self._held, ""
        if self._state is _State.START:
            if self._fallback_thinking:
                self._think(held, out)
                self._reasoning_tokens = self._tokens
            else:
                self._answer(held, out)
        elif self._state is _State.THINKING:
            self._think(held, out)
        elif self._state is _State.ANSWER:
            self._answer(held, out)
        self._ws = ""  # trailing whitespace of an unterminated thinking is markup-like
        return _merged(out)

    def _step(self, out: list[Piece]) -> bool:
        """Consume what can be decided of `_held`; False when the rest must wait."""
        held = self._held
        if self._state is _State.START:
            s = held.lstrip()
            if s.startswith(OPEN):
                self._held = s[len(OPEN):]
                self._state = _State.THINKING
                return True
            if not s or OPEN.startswith(s):
                return False
            self._state = _State.THINKING if self._fallback_thinking else _State.ANSWER
            return True
        if self._state is _State.THINKING:
            i = held.find(CLOSE)
            if i >= 0:
                self._think(held[:i], out)
                self._ws = ""
                self._held = held[i + len(CLOSE):]
                self._state = _State.AFTER
                self._reasoning_tokens = self._tokens
                return True
            k = _partial_suffix(held, CLOSE)
            self._think(held[: len(held) - k], out)
            self._held = held[len(held) - k:]
            return False
        if self._state is _State.AFTER:
            s = held.lstrip()
            self._held = s
            if not s:
                return False
            self._state = _State.ANSWER
            return True
        self._answer(held, out)
        self._held = ""
        return False

    def _think(self, text: str, out: list[Piece]) -> None:
        if not self._begun:
            text = text.lstrip()
            if not text:
                return
            self._begun = True
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._reasoning.append(body)
            out.append(Piece(True, body))

    def _answer(self, text: str, out: list[Piece]) -> None:
        if text:
            self._content.append(text)
            out.append(Piece(False, text))


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].reasoning == p.reasoning:
            out[-1] = Piece(p.reasoning, out[-1].text + p.text)
        else:
            out.append(p)
    return out


def split_reasoning(text: str, mode: ReasoningMode) -> tuple[str, str]:
    """(reasoning, content) of a whole output: the stream fed `text` at once."""
    s = mode.stream()
    s.feed(text, 0)
    s.finish()
    return s.reasoning, s.content


# ---- grammar after the thinking ----------------------------------------------------------


class Matcher(Protocol):
    """`segserve.server.runner.TokenMatcher`'s shape (the runner's grammar state)."""

    def mask(self) -> mx.array: ...
    def accept(self, token_id: int) -> bool: ...
    def is_finished(self) -> bool: ...
    def copy(self) -> Matcher: ...


@dataclass(frozen=True, slots=True)
class ThinkVocab:
    """What the gate needs of a vocabulary: each token's bytes, a mask without EOS, and for
    each proper prefix of `<think>` the tokens that continue it (toward or through the tag)."""

    token_bytes: tuple[bytes, ...]
    no_eos: mx.array
    opens: tuple[mx.array, ...]  # opens[len(prefix)]

    @classmethod
    def build(cls, token_bytes: Callable[[int], bytes], vocab_size: int, eos_ids: Iterable[int]) -> ThinkVocab:
        tag = OPEN.encode()
        pieces = tuple(token_bytes(t) for t in range(vocab_size))
        no_eos = np.ones(vocab_size, dtype=np.bool_)
        no_eos[[e for e in eos_ids if 0 <= e < vocab_size]] = False
        opens = []
        for n in range(len(tag)):
            ok = np.zeros(vocab_size, dtype=np.bool_)
            for t, b in enumerate(pieces):
                nb = tag[:n] + b
                if b and (tag.startswith(nb) or nb.startswith(tag)):
                    ok[t] = True
            opens.append(mx.array(ok))
        return cls(pieces, mx.array(no_eos), tuple(opens))


_VOCABS: OrderedDict[int, tuple[Any, ThinkVocab]] = OrderedDict()


def think_vocab(tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> ThinkVocab:
    """`ThinkVocab` of a tokenizer, built once (a pass over the vocabulary, ~0.1 s per 50K
    tokens; call it off the event loop). The tokenizer is kept with it, so its id stays its own."""
    key = id(tokenizer)
    hit = _VOCABS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    v = ThinkVocab.build(tokenizer.token_bytes, vocab_size, eos_ids)
    _VOCABS[key] = (tokenizer, v)
    while len(_VOCABS) > 4:
        _VOCABS.popitem(last=False)
    return v


class ThinkingGate:
    """A grammar matcher that constrains only the answer of a reasoning model.

    Phases: "maybe" (Start.MODEL: the output may open `<think>`; allowed = the grammar's
    tokens or those that continue `<think>`; the grammar is fed speculatively and put back
    to its start if the tag completes), "think" (anything but EOS, so the answer the grammar
    promises still comes; ends at the token that completes `</think>`), "grammar" (the inner
    matcher alone). Text after `</think>` inside that same token is not seen by the grammar.
    """

    def __init__(self, inner: Matcher, vocab: ThinkVocab, start: Start) -> None:
        self._inner = inner
        self._v = vocab
        self._phase = "think" if start is Start.THINKING else "maybe" if start is Start.MODEL else "grammar"
        self._fresh: Matcher | None = inner.copy() if self._phase == "maybe" else None
        self._inner_ok = True
        self._buf = b""  # "maybe": output bytes so far; "think": the last bytes seen
        self._inner_mask: mx.array | None = None

    def copy(self) -> ThinkingGate:
        g = ThinkingGate.__new__(ThinkingGate)
        g._inner, g._v, g._phase = self._inner.copy(), self._v, self._phase
        g._fresh = self._fresh.copy() if self._fresh is not None else None
        g._inner_ok, g._buf, g._inner_mask = self._inner_ok, self._buf, None
        return g

    @property
    def error(self) -> str | None:
        return getattr(self._inner, "error", None)

    def mask(self) -> mx.array:
        if self._phase == "grammar":
            return self._inner.mask()
        if self._phase == "think":
            return self._v.no_eos
        self._inner_mask = self._inner.mask() if self._inner_ok else None
        opens = self._v.opens[len(self._buf)]
        return opens if self._inner_mask is None else mx.logical_or(opens, self._inner_mask)

    def accept(self, token_id: int) -> bool:
        if self._phase == "grammar":
            return self._inner.accept(token_id)
        b = self._v.token_bytes[token_id] if 0 <= token_id < len(self._v.token_bytes) else b""
        if self._phase == "think":
            seen = self._buf + b
            if CLOSE.encode() in seen:
                self._phase, self._buf = "grammar", b""
            else:
                self._buf = seen[-len(CLOSE):]
            return True
        tag = OPEN.encode()
        nb = self._buf + b
        opens = bool(b) and (tag.startswith(nb) or nb.startswith(tag))
        if self._inner_ok:
            allowed = self._inner_mask is None or bool(self._inner_mask[token_id].item())
            self._inner_ok = allowed and self._inner.accept(token_id)
        if opens and nb.startswith(tag):
            assert self._fresh is not None
            self._inner, self._fresh, self._phase = self._fresh, None, "think"
            self._buf = nb[len(tag):][-len(CLOSE):]
            return True
        if opens:
            self._buf = nb
            return True
        if self._inner_ok:
            self._phase, self._fresh = "grammar", None
            return True
        return False

    def is_finished(self) -> bool:
        if self._phase == "think":
            return False
        if self._phase == "maybe" and len(self._buf) > 0:
            return False
        return self._inner_ok and self._inner.is_finished()
