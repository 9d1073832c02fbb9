"""Structured output: grammar-constrained decoding through llguidance.

Owns: compiling `response_format` (`json_object`, `json_schema` with `strict`) and forced
tool calls (`tool_choice` "required" or a named function, in the tool-call family's markup
with each function's `parameters` schema) into a per-request `GrammarMatcher` that gives a
token mask over the model's vocabulary for each decode step.

Why llguidance (1.9.1), not xgrammar (0.2.8), measured on this machine (Linux x86-64 CPU):
- Install: llguidance is one 3 MB abi3 wheel with no dependencies (checked: manylinux
  x86-64 and aarch64, macOS arm64). `pip install xgrammar==0.2.8` pulls torch 2.14 and
  the CUDA 13 runtime (triton, cuDNN, NCCL, ... gigabytes) even on a CPU machine (seen with
  `pip install --dry-run`; not installed for that reason), and its mask helpers fill torch
  tensors: it would make torch a server dependency for a job that needs a bitmask.
- Tokenizer: llguidance builds its token trie straight from a `tokenizers` JSON
  (`Tokenizer.to_str()`), so the tokenizer we build from GGUF metadata works as it is
  (byte-level BPE, control tokens marked special, our EOS ids).
- Mask cost (bench/grammar_mask.py, this 2-core CPU, 49 152-token embedded vocabulary):
  computing the bitmask (GIL released) ~0.15 ms, unpacking it to a bool mx.array and
  `mx.where` over the logits ~0.12-0.15 ms, `accept` ~0.015 ms: ~0.3 ms per token against
  a ~136 ms decode step, ~0.2 % (goal: 10 %).

Mask form: `GrammarMatcher.mask()` returns a bool `mx.array` of shape [vocab] (True =
allowed); `apply(logits)` / `apply_masks` set the rest to -inf with `mx.where`, which works
for [vocab] and [batch, vocab] logits on every MLX backend. (llguidance ships an MLX helper,
but it is a Metal kernel, so not usable on the CPU or CUDA backends.)

JSON formatting is fixed to `{"key": value, "key2": value}` (", " and ": " separators, no
other whitespace): models write that form most often, and unbounded free whitespace lets a
weak model loop on newlines forever without ever closing the object.

Invariants:
- Every token sequence the mask allows decodes to a prefix of a string in the language; the
  matcher allows EOS only where the language may end, and `is_finished()` turns true once
  nothing but EOS can follow (or EOS was accepted), so the engine can stop there.
- A schema or grammar llguidance cannot compile raises `GrammarError` with `param` (the
  request field to name in the 400: "response_format" or "tools") and the reason, at
  compile time, never in the decode loop.
- `strict: true` (`json_schema`, or a tool's `function.strict`) compiles the schema as
  given and rejects keywords llguidance does not implement; otherwise such keywords are
  ignored (llguidance's `lenient`), as OpenAI's non-strict mode is best effort too.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from segserve.server.chat.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolFamily

_JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHE_SIZE = 64
# Functions one forced-call grammar may hold (OpenAI takes at most 128 tools). Past ~1,000
# the parallel grammar's chain of rules overflows llguidance's stack (a segmentation fault
# at 1,300: the process dies) and ~2,000 alternatives hit its symbol limit (a panic).
MAX_GRAMMAR_FUNCTIONS = 512


class GrammarError(ValueError):
    """A request's grammar could not be compiled; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True, eq=False)
class GrammarVocab:
    """The model's vocabulary as llguidance sees it. Build once per model (~0.4 s)."""

    tokenizer: llg.LLTokenizer
    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    eos_ids: tuple[int, ...]
    _compiled: OrderedDict[str, llg.LLMatcher] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, *, vocab_size: int, eos_ids: Iterable[int]
    ) -> GrammarVocab:
        eos = tuple(sorted(set(int(i) for i in eos_ids)))
        if not eos:
            raise ValueError("a grammar vocabulary needs at least one EOS id")
        lt = llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos))
        return cls(lt, vocab_size, eos)

    def _marker(self, text: str) -> str:
        """A literal for lark: a special token's `<[id]>` when `text` is one, else quoted text."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def _prototype(self, grammar: str, param: str, what: str) -> llg.LLMatcher:
        """A compiled, never-advanced matcher for `grammar` (LRU-cached: clients repeat
        their schemas, and compiling one costs ~1-2 ms, more for large schemas)."""
        with self._lock:
            proto = self._compiled.get(grammar)
            if proto is not None:
                self._compiled.move_to_end(grammar)
                return proto
        # The constructor compiles and never raises: a bad grammar leaves it in error state.
        proto = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise GrammarError(param, f"{what} cannot be compiled: {compiler_reason(proto.get_error())}")
        with self._lock:
            self._compiled[grammar] = proto
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return proto


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A compiled constraint; `matcher()` gives a fresh per-request state (cheap copy)."""

    kind: str  # "json_object", "json_schema:<name>", "tool_call:required", "tool_call:<fn>"
    grammar: str  # llguidance grammar text (for logs / debugging)
    vocab: GrammarVocab
    _proto: llg.LLMatcher = field(repr=False)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._proto.deep_copy(), self.vocab.vocab_size, self.kind)


class GrammarMatcher:
    """Per-request state: `mask()` before sampling, `accept(token)` after, per decode step."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int, kind: str) -> None:
        self._m = matcher
        self.kind = kind
        self.vocab_size = vocab_size
        self._bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def mask(self) -> mx.array:
        """Bool [vocab]: the tokens allowed next (EOS among them where the text may end).
        After a rejected token (matcher in error) only EOS is allowed, so the row ends."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return mx.array(allowed[: self.vocab_size].astype(np.bool_))

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` ([vocab] or [1, vocab]) with disallowed tokens at -inf."""
        return apply_mask(logits, self.mask())

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False (and `error` set) if the grammar forbids it."""
        return bool(self._m.consume_token(int(token_id)))

    def is_finished(self) -> bool:
        """Nothing but EOS may follow (or EOS was accepted, or the matcher failed)."""
        return bool(self._m.is_stopped())

    def copy(self) -> GrammarMatcher:
        """An independent matcher in this one's state (each of `n` choices needs its own)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.kind)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))


def apply_masks(logits: mx.array, masks: Sequence[mx.array | None]) -> mx.array:
    """[batch, vocab] logits; rows whose mask is None (unconstrained) pass unchanged."""
    if all(m is None for m in masks):
        return logits
    full = mx.ones((logits.shape[-1],), dtype=mx.bool_)
    stacked = mx.stack([full if m is None else m for m in masks])
    return apply_mask(logits, stacked)


# ------------------------------------------------------------------ compilation

_REASON_CHARS = 400


def compiler_reason(text: str) -> str:
    """llguidance's error text as a client may read it. A Rust panic inside the compiler
    (e.g. 2,000 tools: `assertion failed: grammar.symbols.len() < u16::MAX as usize - 10`)
    comes back with a native backtrace holding build paths: only the first line is kept."""
    head = text.split("<backtrace>", 1)[0].strip()
    first = head.splitlines()[0].strip() if head else ""
    if first.startswith("panic:"):
        first = "the grammar is beyond the compiler's limits (" + first.removeprefix("panic:").strip() + ")"
    if len(first) > _REASON_CHARS:
        first = first[:_REASON_CHARS] + "..."
    return first or "the grammar compiler failed"



# Keywords whose values are schemas (or lists / maps of schemas) that `_close_objects` visits.
_SUB_SCHEMA = ("items", "additionalProperties", "not", "contains")
_SUB_SCHEMAS = ("anyOf", "oneOf", "prefixItems")
_SUB_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def _close_objects(schema: Any) -> Any:
    """The schema with every object that lists `properties` and says nothing about other
    keys closed (`additionalProperties: false`): what the model may write, not what the
    schema accepts. JSON Schema leaves such objects open, and a weak model given room keeps
    inventing keys (SmolLM2 under LangChain's and pydantic's default tool schemas, which omit
    it, wrote `"type"`, `"description"`, ... until max_tokens). Every closed output is still
    valid against the schema as given (xgrammar's default strict mode, used by vLLM and
    SGLang, does the same). Left alone: objects that set it or `patternProperties` /
    `unevaluatedProperties`, that use `allOf` or `$ref` beside their own properties, or that
    require keys they do not list; `allOf` branches (closing one would forbid its siblings'
    keys)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUB_SCHEMA or key in _SUB_SCHEMAS:
            out[key] = _close_objects(value)
        elif key in _SUB_SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {k: _close_objects(v) for k, v in value.items()}
        else:
            out[key] = value
    props = schema.get("properties")
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")
    if (isinstance(props, Mapping) and not any(k in schema for k in open_keys)
            and set(schema.get("required") or ()) <= set(props)):
        out["additionalProperties"] = False
    return out


def _schema_options(schema: Mapping[str, Any], strict: bool) -> dict[str, Any]:
    out = dict(_close_objects(schema))
    opts = dict(_JSON_FORMAT)
    opts["lenient"] = not strict
    out["x-guidance"] = opts
    return out


def compile_response_format(
    response_format: Mapping[str, Any] | None, vocab: GrammarVocab
) -> CompiledGrammar | None:
    """OpenAI `response_format` → grammar; None for absent or `{"type": "text"}`."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Mapping[str, Any] = {"type": "object"}
        label, strict = "json_object", False
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise GrammarError("response_format", "response_format.json_schema must be an object")
        name = str(spec.get("name", "")) or "schema"
        schema = spec.get("schema") or {}
        strict = bool(spec.get("strict", False))
        label = f"json_schema:{name}"
    else:
        raise GrammarError(
            "response_format",
            f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
        )
    what = f"response_format {label.replace(':', ' ')!s}"
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(_schema_options(schema, strict))
        )
    except (ValueError, TypeError) as exc:
        raise GrammarError("response_format", f"{what} cannot be compiled: {compiler_reason(str(exc))}") from exc
    proto = vocab._prototype(grammar, "response_format", what)
    return CompiledGrammar(label, grammar, vocab, proto)


def compile_tool_choice(
    family: ToolFamily,
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any],
    vocab: GrammarVocab,
    *,
    parallel_tool_calls: bool = True,
) -> CompiledGrammar | None:
    """`tool_choice` "required" or `{"type": "function", "function": {"name": ...}}` →
    a grammar for one (or, when parallel and "required", one or more) tool calls in the
    family's markup; "auto" and "none" → None (no constraint).

    Parallel "required" calls each function at most once, in the order of `tools`, and the
    grammar ends after the last function: a grammar cannot remember which calls were made
    without listing every order, and without a bound a model that keeps writing calls
    (SmolLM2 repeats the same one) runs to max_tokens and ends cut off inside a call."""
    if tool_choice in ("auto", "none"):
        return None
    functions = {
        str(t["function"]["name"]): t["function"]
        for t in tools
        if isinstance(t, Mapping)
        and isinstance(t.get("function"), Mapping)
        and "name" in t["function"]
    }
    if not functions:
        raise GrammarError("tools", "tool_choice needs at least one function in tools")
    if tool_choice == "required":
        chosen = list(functions)
        label = "tool_call:required"
        many = parallel_tool_calls
    elif isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if name not in functions:
            raise GrammarError("tool_choice", f"tool_choice names function {name!r}, not in tools")
        chosen = [str(name)]
        label = f"tool_call:{name}"
        many = False
    else:
        raise GrammarError("tool_choice", f"tool_choice {tool_choice!r} is not supported")

    if len(chosen) > MAX_GRAMMAR_FUNCTIONS:
        raise GrammarError(
            "tools", f"tools for {label} cannot be compiled: {len(chosen)} functions, at most "
            f"{MAX_GRAMMAR_FUNCTIONS} in one grammar",
        )
    rules: list[str] = []
    alts: list[str] = []
    for i, name in enumerate(chosen):
        fn = functions[name]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise GrammarError(
                "tools", f"function {name!r}: parameters must be a JSON schema object"
            )
        schema = json.dumps(_schema_options(params, bool(fn.get("strict", False))))
        rules.append(f"args_{i}: %json {schema}")
        alts.append(_call_rule(family, name, f"args_{i}", vocab))
    sep = '"\\n"' if family is ToolFamily.HERMES else '"; "'
    if many:
        # seq_i: call i, then optionally the calls that begin at a later function;
        # from_i: a seq_j with j >= i. Linear in the number of functions: listing every
        # later seq_j in each seq_i is quadratic (1,000 tools: 5 s to compile; 1,300:
        # llguidance crashes the process with a segmentation fault).
        n = len(alts)
        seqs = []
        for i, alt in enumerate(alts):
            seqs.append(f"seq_{i}: ({alt})" + (f" ({sep} from_{i + 1})?" if i + 1 < n else ""))
            seqs.append(f"from_{i}: seq_{i}" + (f" | from_{i + 1}" if i + 1 < n else ""))
        start = "start: from_0"
        lark = "\n".join(["%llguidance {}", start, *seqs, *rules])
    else:
        call = " | ".join(f"({a})" for a in alts)
        lark = "\n".join(["%llguidance {}", "start: call", f"call: {call}", *rules])
    try:
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:
        raise GrammarError("tools", f"tools for {label} cannot be compiled: {compiler_reason(str(exc))}") from exc
    proto = vocab._prototype(grammar, "tools", f"tools for {label}")
    return CompiledGrammar(label, grammar, vocab, proto)


def _call_rule(family: ToolFamily, name: str, args_rule: str, vocab: GrammarVocab) -> str:
    quoted = json.dumps(name, ensure_ascii=False)
    if family is ToolFamily.HERMES:
        head = json.dumps(f'\n{{"name": {quoted}, "arguments": ')
        return (
            f'{vocab._marker(HERMES_OPEN)} {head} {args_rule} "}}\\n" {vocab._marker(HERMES_CLOSE)}'
        )
    head = json.dumps(f'{{"name": {quoted}, "parameters": ')
    return f'{head} {args_rule} "}}"'
