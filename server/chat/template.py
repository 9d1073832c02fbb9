"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them.

Owns: turning a chat template (jinja text) plus OpenAI-style messages and tools into the
prompt string; turning OpenAI request messages into the shape templates are written against
(`normalize_messages`); loading a `--chat-template FILE` override (`load_template_file`).

Why transformers' renderer and not our own jinja sandbox: model authors test their templates
with `apply_chat_template`. Its environment has `{% break %}`/`{% continue %}`
(loopcontrols), the `{% generation %}` block, `strftime_now` (the real current time),
`raise_exception`, a `tojson` that keeps key order and does not HTML-escape, and a sandbox
hardened against the known escapes. Re-implementing that drifted from it, so `render`
calls `transformers.utils.chat_template_utils.render_jinja_template`,
the function `apply_chat_template` itself calls, with the same inputs it would pass.

Invariants:
- `render(t, msgs, ...)` == `tokenizer.apply_chat_template(msgs, tokenize=False, ...)` for a
  tokenizer whose `chat_template` is `t` and whose special tokens are the ones passed here
  (the parity tests check this on the embedded model's template and on two tool templates).
  Like transformers, keys whose value is None are dropped from each message first.
- `normalize_messages` only reshapes what the OpenAI API allows into what templates read;
  it never invents content (a missing or null `content` renders as "", as vLLM and
  llama-server do). What it does, and why, is listed on the function.
- `with_tool_prompt` is used only for templates that do not read `tools`: it puts the tool
  definitions into a system block in Hermes syntax, and writes earlier tool calls and
  results in that syntax into the messages, so the model sees the whole tool loop.
- A template that fails (syntax, `raise_exception`, undefined access) raises
  `TemplateRenderError`; the HTTP layer answers 400 with the message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

# `render_jinja_template` is what `PreTrainedTokenizerBase.apply_chat_template` calls after
# normalizing the messages; importing this module does not import torch.
from transformers.utils import chat_template_utils as _hf


class TemplateRenderError(ValueError):
    """The chat template could not render these messages (its message says why)."""


class TemplateLoadError(ValueError):
    """A `--chat-template` file could not be read or is not a valid template."""


class UnsupportedContentError(ValueError):
    """A message content part has a type this text-only server cannot render."""

    def __init__(self, part_type: str, index: int) -> None:
        super().__init__(
            f"messages[{index}].content: content part type {part_type!r} is not supported "
            "(only 'text' parts are)"
        )
        self.part_type = part_type
        self.index = index


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A template with the special tokens it is rendered with.

    `origin` says where the text came from ("gguf", "tokenizer_config", "file:<path>"), for
    logs and the model card; it does not change rendering.
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = ""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        return render(
            self.source,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    @property
    def uses_tools(self) -> bool:
        """Whether the template reads the `tools` variable (so it can present tool schemas)."""
        return template_reads(self.source, "tools")


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (already in template shape, see `normalize_messages`) to a prompt.

    `bos_token`/`eos_token` are passed only when not None, as transformers passes only the
    special tokens a tokenizer has. `extra` reaches the template as variables (e.g.
    `enable_thinking=False`, `unk_token=...`), overriding the special tokens like
    `apply_chat_template(**kwargs)` does.
    """
    if not messages:
        raise TemplateRenderError("cannot render an empty conversation")
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    variables: dict[str, Any] = {}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(extra)
    try:
        # annotated `-> str` upstream, but it returns (rendered chats, generation indices)
        result: Any = _hf.render_jinja_template(
            conversations=[chat],
            tools=[dict(t) for t in tools] if tools is not None else None,
            documents=[dict(d) for d in documents] if documents is not None else None,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:  # includes raise_exception, undefined, sandbox
        raise TemplateRenderError(f"chat template failed: {exc}") from exc
    except (TypeError, ValueError) as exc:  # bad tool / message shapes
        raise TemplateRenderError(f"chat template inputs rejected: {exc}") from exc
    return str(result[0][0])


def check_template(template: str) -> None:
    """Compile `template` in transformers' environment; raise `TemplateLoadError` if invalid.

    Rendering zero conversations compiles the template without running it, so a template
    that calls `raise_exception` for some inputs still passes.
    """
    try:
        _hf.render_jinja_template(conversations=[], chat_template=template)
    except jinja2.TemplateError as exc:
        raise TemplateLoadError(f"invalid chat template: {exc}") from exc


@functools.lru_cache(maxsize=32)  # asked per request; parsing a template costs ~ms
def template_reads(template: str, variable: str) -> bool:
    """Whether the template references the top-level variable `variable` (e.g. "tools")."""
    try:
        names: frozenset[str] = _hf._get_template_variables(template)
    except Exception:  # private helper: fall back to a plain text search if it moves
        return variable in template
    return variable in names


def load_template_file(path: str | Path, *, name: str | None = None) -> ChatTemplate:
    """Read a `--chat-template FILE`.

    Accepts a plain jinja file, or a JSON file holding either a string or a
    `tokenizer_config.json` object whose `chat_template` is a string or a list of
    `{"name", "template"}` (then `name`, or "default", is taken). The template is compiled
    here so a broken file fails at start-up, not at the first request. Special tokens come
    from the JSON's `bos_token`/`eos_token` when it has them (string or `{"content": ...}`).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateLoadError(f"cannot read chat template {p}: {exc}") from exc
    bos: str | None = None
    eos: str | None = None
    source = text
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TemplateLoadError(f"{p} is not valid JSON: {exc}") from exc
        if isinstance(data, Mapping):
            source = _pick_named_template(data.get("chat_template"), name, p)
            bos = _token_text(data.get("bos_token"))
            eos = _token_text(data.get("eos_token"))
        elif isinstance(data, str):
            source = data
        else:
            raise TemplateLoadError(f"{p}: expected a string or an object with chat_template")
    if not source.strip():
        raise TemplateLoadError(f"{p}: the chat template is empty")
    check_template(source)
    return ChatTemplate(source=source, bos_token=bos, eos_token=eos, origin=f"file:{p}")


def _pick_named_template(value: Any, name: str | None, p: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            str(t.get("name")): str(t.get("template", "")) for t in value if isinstance(t, Mapping)
        }
        want = name or "default"
        if want in named:
            return named[want]
        raise TemplateLoadError(f"{p}: no chat template named {want!r} (has {sorted(named)})")
    raise TemplateLoadError(f"{p}: no chat_template string in the JSON object")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages → the dicts chat templates are written against.

    - Keys whose value is None are dropped (`refusal: null`, `audio: null`,
      `function_call: null` from `message.model_dump()`), as transformers does: templates
      test for presence, and many crash on None.
    - A missing or null `content` (an assistant turn that only called tools, sent back by an
      SDK as `content: null` or left out by `model_dump(exclude_none=True)`) becomes "":
      many templates read `message['content']` unconditionally (SmolLM2's does), and vLLM
      and llama-server render it as "" too.
    - `content` as a list of parts: the `text` parts (and an assistant's `refusal` parts)
      are joined with "\\n" into one string; any other part type raises
      `UnsupportedContentError` (the HTTP layer maps it to 400 naming the message).
    - `role: "developer"` becomes "system" (same meaning; templates know only "system").
    - assistant `tool_calls[i].function.arguments`, a JSON string on the wire, is parsed to
      the object templates expect (transformers' tool-use docs pass a dict; templates apply
      `tojson` to it). Arguments that are not valid JSON stay a string, so nothing is lost.
      `id` and `type` are kept.
    - `role: "tool"` keeps `tool_call_id` and `content`; when it has no `name`, the name is
      taken from the assistant tool call with that id (some templates label results with
      it). Any `name` given on any message is kept.
    """
    calls_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        msg = {k: v for k, v in dict(message).items() if v is not None}
        msg.setdefault("content", "")
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if "content" in msg and isinstance(msg["content"], list):
            msg["content"] = _join_parts(msg["content"], index)
        if msg.get("role") == "assistant" and "tool_calls" in msg:
            calls = [_template_tool_call(c) for c in msg["tool_calls"]]
            msg["tool_calls"] = calls
            for c in calls:
                fn = c.get("function", {})
                if "id" in c and isinstance(fn, Mapping) and "name" in fn:
                    calls_by_id[str(c["id"])] = str(fn["name"])
        if msg.get("role") == "tool" and "name" not in msg:
            name = calls_by_id.get(str(msg.get("tool_call_id", "")))
            if name is not None:
                msg["name"] = name
        out.append(msg)
    return out


def _join_parts(parts: list[Any], index: int) -> str:
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = str(part.get("type", "")) if isinstance(part, Mapping) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise UnsupportedContentError(kind, index)
    return "\n".join(texts)


def _template_tool_call(call: Any) -> dict[str, Any]:
    c = {k: v for k, v in dict(call).items() if v is not None}
    fn = c.get("function")
    if isinstance(fn, Mapping):
        f = {k: v for k, v in dict(fn).items() if v is not None}
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                f["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text as the model wrote it
        c["function"] = f
    return c


# The system block for templates without tool syntax: Hermes' own wording and markup, which
# the tool-call parser (`segserve.server.chat.tool_calls`, HERMES) and the forced-call grammar read.
TOOL_PROMPT_HEAD = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools:\n<tools>\n"
)
TOOL_PROMPT_TAIL = (
    "</tools>\nFor each function call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-dict>}\n</tool_call>'
)


def tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The documented tool system block: one `tojson` line per tool inside `<tools>`."""
    lines = "".join(json.dumps(dict(t), ensure_ascii=False) + "\n" for t in tools)
    return TOOL_PROMPT_HEAD + lines + TOOL_PROMPT_TAIL


def hermes_call_text(name: str, arguments: Any) -> str:
    """One call as the forced-call grammar writes it (so a sent-back turn re-renders to the
    tokens that were generated, and the bank's prefix match covers them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(
        arguments, ensure_ascii=False, separators=(", ", ": ")
    )
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def with_tool_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Messages in template shape for a template that does not read `tools`.

    The tool block goes at the end of the first system message (or is the system message
    when there is none); an assistant turn's `tool_calls` become `<tool_call>` text after its
    content; a tool result becomes `<tool_response>` text. Arguments are written from the
    wire text (`_template_tool_call` keeps a string that is not JSON) re-serialized with the
    grammar's separators.
    """
    out = [dict(m) for m in messages]
    block = tool_prompt(tools)
    if out and out[0].get("role") == "system":
        first = str(out[0].get("content") or "")
        out[0]["content"] = f"{first}\n\n{block}" if first else block
    else:
        out.insert(0, {"role": "system", "content": block})
    for m in out:
        calls = m.pop("tool_calls", None) if m.get("role") == "assistant" else None
        if calls:
            texts = [
                hermes_call_text(str(c["function"]["name"]), c["function"].get("arguments", {}))
                for c in calls
                if isinstance(c.get("function"), Mapping) and "name" in c["function"]
            ]
            head = str(m.get("content") or "")
            m["content"] = "\n".join(([head] if head else []) + texts)
        if m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    return out
