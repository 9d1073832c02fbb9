"""Tool calls in generated text: which markup a model uses, and parsing it whole or streamed.

Owns: the tool-call families (`ToolFamily`), detecting the family from a chat template
(`detect_family`) or a `--tool-parser` name (`family_from_name`), the whole-text parser
(`parse_tool_calls`) and the incremental one (`ToolCallStream`) that turns generated text
pieces into OpenAI `delta` shapes.

Families:
- HERMES (Hermes, Qwen 2/2.5/3, many fine-tunes): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with ordinary content
  before, between and after them.
- LLAMA3_JSON (Llama 3.1/3.2/3.3 JSON tool calling): the whole message is one or more JSON
  objects `{"name": ..., "parameters"|"arguments": {...}}`, separated by `;` or whitespace,
  optionally after `<|python_tag|>`. Text before the first `{` makes the message content.

Invariants:
- Markup never reaches content: the stream holds back a tail that could still become
  `<tool_call>` (or, for LLAMA3_JSON, anything from a leading `{` on) until it is decided.
- Whitespace that only separates HERMES blocks (or follows the last one) is markup too, so
  a reply made only of tool calls has content "".
- Chunking does not matter: the stream decides on the text, never on piece boundaries, so
  whole text and any split of it give the same calls and the same content (tests check it,
  with a fuzz over random markup). `parse_tool_calls(text)` is the stream fed `text` at once.
- Malformed calls stay content: a block whose JSON does not parse, lacks a string `name`, or
  has arguments that are not an object, is returned as content verbatim (markup included),
  exactly as generated. One case cannot be honoured by a stream: once a call's id and name
  have been sent (its JSON reached `"arguments": {`), text sent after that cannot be taken
  back. If those arguments then turn out malformed (or the text ends inside them), the
  stream closes that call with what it sent (`ToolCallStream.broken` counts them) and drops
  the rest of its block from the deltas; its `tool_calls` leave the call out and its
  `result()`, like `parse_tool_calls` on the same text, returns the block as content. Constrained decoding
  (`tool_choice` "required" or a named function, see grammar.py) cannot produce this case.
- Arguments are sent as the model wrote them (raw JSON text of the object), so streamed
  fragments concatenate to exactly `ToolCall.arguments`. Calls whose keys came in another
  order (arguments before name) are re-serialized with `json.dumps` once complete.
- Ids are `call_` + 24 random hex digits (`new_call_id`), unique per call.
- A call that repeats an earlier one of the same message exactly (same name, same arguments
  as JSON values, key order and spacing aside) is dropped: neither a call nor content, and
  the indices of the calls kept stay 0, 1, 2, ... (`ToolCallStream.duplicates` counts the
  dropped). A model under `tool_choice: "required"` with parallel calls can otherwise write
  the same call again and again until max_tokens, and a client would run each copy. So that
  nothing has to be taken back, the deltas of a call whose name an earlier kept call has are
  held until the call is complete; other calls stream as they are generated. A held call
  that turns out malformed is not sent at all (nothing to close; `broken` counts it, and
  `result()` has its block as content, as for any broken call).
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ToolFamily(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


# `--tool-parser` names (lower case) → family. "auto" means: detect from the template.
PARSER_NAMES: dict[str, ToolFamily] = {
    "hermes": ToolFamily.HERMES,
    "qwen": ToolFamily.HERMES,
    "qwen2_5": ToolFamily.HERMES,
    "qwen3": ToolFamily.HERMES,
    "llama3_json": ToolFamily.LLAMA3_JSON,
    "llama3": ToolFamily.LLAMA3_JSON,
    "llama": ToolFamily.LLAMA3_JSON,
}

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def family_from_name(name: str) -> ToolFamily | None:
    """`--tool-parser NAME` → family; "auto" → None (detect). Unknown names raise ValueError."""
    key = name.strip().lower()
    if key == "auto":
        return None
    if key not in PARSER_NAMES:
        raise ValueError(
            f"unknown tool parser {name!r}; choose one of: auto, {', '.join(sorted(PARSER_NAMES))}"
        )
    return PARSER_NAMES[key]


def detect_family(template: str) -> ToolFamily | None:
    """The family a chat template writes tool calls in, or None if it shows no tool markup.

    `<tool_call>` → HERMES; `<|python_tag|>`, or an `ipython` role with a "parameters" key,
    → LLAMA3_JSON. The engine uses `resolve_family` for the override-then-detect rule.
    """
    if HERMES_OPEN in template:
        return ToolFamily.HERMES
    if PYTHON_TAG in template or ("ipython" in template and "parameters" in template):
        return ToolFamily.LLAMA3_JSON
    return None


def resolve_family(template: str, override: str | None = None) -> ToolFamily | None:
    """`--tool-parser` wins when given (and not "auto"); else detect from the template."""
    if override:
        fam = family_from_name(override)
        if fam is not None:
            return fam
    return detect_family(template)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str  # may be "" (the HTTP layer sends null when there are tool calls)
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One `delta.tool_calls[]` entry: the first for an index carries id and name."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


Delta = ContentDelta | ToolCallDelta

# `{"name": "<name>", "arguments": {` with free whitespace; group 1 is the quoted name.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)


class _ObjectScanner:
    """Finds where a JSON object ends, fed one character at a time (strings and escapes
    respected); validity is checked with `json.loads` once it has ended."""

    __slots__ = ("depth", "in_string", "escape")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def push(self, ch: str) -> bool:
        """Feed one char; True when it closed the outermost object."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _call_from_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) when `text` is a JSON object that is a tool call."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _same_call_key(name: str, args: str) -> tuple[str, str]:
    """Equal for calls that differ only in key order or spacing (`1` and `true` differ)."""
    return name, json.dumps(json.loads(args), sort_keys=True, separators=(",", ":"))


class _Call:
    __slots__ = ("index", "id", "name", "args", "raw", "broken", "duplicate", "held", "unsent")

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index = index
        self.id = call_id
        self.name = name
        self.args = ""
        self.raw = ""
        self.broken = False
        self.duplicate = False
        # Deltas not sent yet because the call may repeat an earlier one; None: sent as made.
        self.held: list[Delta] | None = None
        self.unsent = False  # dropped while held: no delta of it ever left the stream


class ToolCallStream:
    """Incremental parser: `feed(piece)` → deltas; `finish()` at the end of generation.

    After `finish()`, `result()` gives the assembled `ParsedOutput` (as `parse_tool_calls`
    would, except for broken calls, see the module docstring) and `tool_calls` the calls.
    """

    def __init__(self, family: ToolFamily, *, id_factory: Callable[[], str] = new_call_id) -> None:
        self.family = family
        self._new_id = id_factory
        self._pending = ""  # text not yet decided
        self._state = "start" if family is ToolFamily.LLAMA3_JSON else "text"
        self._call: _Call | None = None
        self._scan = _ObjectScanner()
        self._scanned = 0  # chars of `_pending` already pushed through `_scan` (head state)
        self._calls: list[_Call] = []
        self._segments: list[str | _Call] = []  # content pieces and calls, in order
        self._finished = False
        self._after_call = False
        self._kept: set[tuple[str, str]] = set()  # `_same_call_key` of every complete call kept

    # ------------------------------------------------------------------ public
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(c.id, c.name, c.args) for c in self._calls if not (c.broken or c.duplicate)
        )

    @property
    def broken(self) -> int:
        return sum(1 for c in self._calls if c.broken)

    @property
    def duplicates(self) -> int:
        """Calls dropped because they repeated an earlier call of this message."""
        return sum(1 for c in self._calls if c.duplicate)

    def feed(self, piece: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[Delta] = []
        self._pending += piece
        self._advance(out, final=False)
        return _merge(out)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if not self._finished:
            self._advance(out, final=True)
            self._finished = True
        return _merge(out)

    def result(self) -> ParsedOutput:
        if not self._finished:
            raise RuntimeError("result() before finish()")
        content = "".join(
            s if isinstance(s, str) else s.raw
            for s in self._segments
            if isinstance(s, str) or s.broken  # a duplicate is neither a call nor content
        )
        return ParsedOutput(content, self.tool_calls)

    # ----------------------------------------------------------------- helpers
    def _content(self, out: list[Delta], text: str) -> None:
        if text:
            out.append(ContentDelta(text))
            self._segments.append(text)

    def _commit(self, out: list[Delta], name: str) -> _Call:
        # Every earlier call is decided by now (sent, or dropped while held), so counting
        # the ones sent keeps the indices a client sees contiguous.
        index = sum(1 for c in self._calls if not c.unsent)
        call = _Call(index, self._new_id(), name)
        if any(n == name for n, _ in self._kept):
            call.held = []
        self._calls.append(call)
        self._segments.append(call)
        self._send(out, call, ToolCallDelta(call.index, call.id, call.name, ""))
        return call

    def _send(self, out: list[Delta], call: _Call, delta: ToolCallDelta) -> None:
        (out if call.held is None else call.held).append(delta)

    def _complete(self, out: list[Delta], call: _Call) -> None:
        """The call's block has ended well-formed: keep it, or drop it as a repeat."""
        key = _same_call_key(call.name, call.args)
        if key in self._kept:
            call.duplicate = call.unsent = True  # held since its first delta
            call.held = None
            return
        self._kept.add(key)
        if call.held is not None:
            out.extend(call.held)
            call.held = None

    def _whole(self, out: list[Delta], name: str, args: str) -> None:
        call = self._commit(out, name)
        call.args = args
        self._send(out, call, ToolCallDelta(call.index, None, None, args))
        self._complete(out, call)

    def _advance(self, out: list[Delta], *, final: bool) -> None:
        while True:
            before = (self._state, len(self._pending))
            step = getattr(self, "_st_" + self._state)
            step(out, final)
            if (self._state, len(self._pending)) == before:
                return

    # ------------------------------------------------------------------ HERMES
    def _st_text(self, out: list[Delta], final: bool) -> None:
        """HERMES content: everything up to `<tool_call>`, holding a tail that may start it.
        Whitespace right after a call belongs to the markup (it separates blocks)."""
        if self._after_call:
            text = self._pending.lstrip()
            if not text:
                if final:
                    self._pending = ""
                return
            self._pending = text
            self._after_call = False
        at = self._pending.find(HERMES_OPEN)
        if at >= 0:
            self._content(out, self._pending[:at])
            self._pending = self._pending[at:]
            self._state = "head"
            return
        keep = 0 if final else _partial_suffix(self._pending, HERMES_OPEN)
        self._content(out, self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]

    def _st_head(self, out: list[Delta], final: bool) -> None:
        """`_pending` starts with the opener; wait for the header or the end of the call."""
        hermes = self.family is ToolFamily.HERMES
        body_from = len(HERMES_OPEN) if hermes else 0
        body = self._pending[body_from:]
        end = body.find(HERMES_CLOSE) if hermes else -1
        scope = body if end < 0 else body[:end]
        m = _HEADER.match(scope)
        if m is not None:
            name = json.loads(m.group(1))
            call = self._commit(out, name)
            call.raw = self._pending[: body_from + m.end() - 1]
            self._pending = self._pending[body_from + m.end() - 1 :]  # from the '{'
            self._call = call
            self._scan = _ObjectScanner()
            self._state = "args"
            return
        if hermes:
            if end >= 0:
                self._close_slow(
                    out, body[:end], self._pending[: body_from + end + len(HERMES_CLOSE)]
                )
                return
            if final:
                self._close_slow(out, body, self._pending)
            return
        # LLAMA3_JSON: the object's end decides (a header may still come if keys differ);
        # `_scan`/`_scanned` carry the scan over pieces so each char is looked at once.
        for i in range(self._scanned, len(self._pending)):
            if self._scan.push(self._pending[i]):
                self._close_slow(out, self._pending[: i + 1], self._pending[: i + 1])
                return
        self._scanned = len(self._pending)
        if final:
            self._give_up(out)

    def _close_slow(self, out: list[Delta], body: str, raw: str) -> None:
        parsed = _call_from_object(body.strip())
        if parsed is None:
            self._give_up(out, upto=len(raw))
            return
        self._whole(out, *parsed)
        self._pending = self._pending[len(raw) :]
        self._state = "text" if self.family is ToolFamily.HERMES else "between"
        self._after_call = True

    def _give_up(self, out: list[Delta], upto: int | None = None) -> None:
        """Not a tool call: the held text is content (LLAMA3_JSON: all the rest is)."""
        if self.family is ToolFamily.HERMES:
            n = len(self._pending) if upto is None else upto
            self._content(out, self._pending[:n])
            self._pending = self._pending[n:]
            self._state = "text"
        else:
            self._content(out, self._pending)
            self._pending = ""
            self._state = "plain"

    def _st_args(self, out: list[Delta], final: bool) -> None:
        call = self._call
        assert call is not None
        for i, ch in enumerate(self._pending):
            if self._scan.push(ch):
                frag = self._pending[: i + 1]
                call.args += frag
                call.raw += frag
                if frag:
                    self._send(out, call, ToolCallDelta(call.index, None, None, frag))
                self._pending = self._pending[i + 1 :]
                try:
                    args_ok = isinstance(json.loads(call.args), dict)
                except json.JSONDecodeError:
                    args_ok = False
                if not args_ok:
                    self._break(out)
                    return
                self._state = "close"
                return
        frag = self._pending
        if frag:
            call.args += frag
            call.raw += frag
            self._send(out, call, ToolCallDelta(call.index, None, None, frag))
            self._pending = ""
        if final:
            self._break(out)

    def _st_close(self, out: list[Delta], final: bool) -> None:
        """After the arguments: `}` then (HERMES) `</tool_call>`, whitespace allowed."""
        call = self._call
        assert call is not None
        hermes = self.family is ToolFamily.HERMES
        text = self._pending
        stripped = text.lstrip()
        if not stripped:
            if final:
                self._break(out)
            return
        if stripped[0] != "}":
            self._break(out)
            return
        rest = stripped[1:]
        if not hermes:
            call.raw += text[: len(text) - len(rest)]
            self._pending = rest
            self._call = None
            self._state = "between"
            self._complete(out, call)
            return
        r = rest.lstrip()
        if r.startswith(HERMES_CLOSE) or (final and not r):
            used = len(text) - len(r) + (len(HERMES_CLOSE) if r else 0)
            call.raw += text[:used]
            self._pending = text[used:]
            self._call = None
            self._state = "text"
            self._after_call = True
            self._complete(out, call)
            return
        if r and not HERMES_CLOSE.startswith(r[: len(HERMES_CLOSE)]):
            self._break(out)
        elif final:
            self._break(out)

    def _break(self, out: list[Delta]) -> None:
        """A committed call turned out malformed: keep what was sent and mark it broken; the
        rest of its block is skipped. For `result()` its raw text is content."""
        call = self._call
        assert call is not None
        call.broken = True
        if call.held is not None:  # nothing sent yet: send nothing malformed
            call.held = None
            call.unsent = True
        self._state = "skip"

    def _st_skip(self, out: list[Delta], final: bool) -> None:
        """Drop the rest of a broken call: to `</tool_call>` (HERMES) or the end (LLAMA3_JSON)."""
        call = self._call
        assert call is not None
        rest = self._pending
        end = rest.find(HERMES_CLOSE) if self.family is ToolFamily.HERMES else -1
        if end >= 0:
            cut = end + len(HERMES_CLOSE)
        elif final or self.family is not ToolFamily.HERMES:
            cut = len(rest)
        else:
            cut = len(rest) - _partial_suffix(rest, HERMES_CLOSE)
        call.raw += rest[:cut]
        self._pending = rest[cut:]
        if end >= 0 or final:
            self._call = None
            self._state = "text" if self.family is ToolFamily.HERMES else "plain"

    # -------------------------------------------------------------- LLAMA3_JSON
    def _st_start(self, out: list[Delta], final: bool) -> None:
        text = self._pending.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :].lstrip()
        if not text:
            if final:
                self._content(out, self._pending)
                self._pending = ""
                self._state = "plain"
            return
        if PYTHON_TAG.startswith(text) and not final:
            return  # could still be the tag
        if text[0] == "{":
            self._enter_head(text)
        else:
            self._state = "plain"

    def _enter_head(self, text: str) -> None:
        self._pending = text
        self._state = "head"
        self._scan = _ObjectScanner()
        self._scanned = 0

    def _st_plain(self, out: list[Delta], final: bool) -> None:
        self._content(out, self._pending)
        self._pending = ""

    def _st_between(self, out: list[Delta], final: bool) -> None:
        text = self._pending.lstrip(" \t\r\n;")
        if not text:
            if final:
                self._pending = ""
            return
        if text[0] == "{":
            self._enter_head(text)
        else:
            self._pending = text
            self._state = "plain"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Join neighbouring content deltas and argument fragments of the same call."""
    out: list[Delta] = []
    for d in deltas:
        prev = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(prev, ContentDelta):
            out[-1] = ContentDelta(prev.text + d.text)
        elif (
            isinstance(d, ToolCallDelta)
            and isinstance(prev, ToolCallDelta)
            and d.id is None
            and prev.id is None
            and prev.index == d.index
        ):
            out[-1] = ToolCallDelta(prev.index, prev.id, prev.name, prev.arguments + d.arguments)
        else:
            out.append(d)
    return out


def parse_tool_calls(
    text: str, family: ToolFamily, *, id_factory: Callable[[], str] = new_call_id
) -> ParsedOutput:
    """Whole generated text → content and tool calls (malformed blocks stay content)."""
    stream = ToolCallStream(family, id_factory=id_factory)
    stream.feed(text)
    stream.finish()
    return stream.result()
