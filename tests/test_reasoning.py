"""Reasoning models: thinking split from the answer (`segserve.server.chat.reasoning`).

Parser units run every split of sample texts into pieces against the whole-text result;
the grammar gate runs against a scripted inner matcher; end to end, a tiny random-weight
model behind Qwen3- and R1-style templates (written here) says scripted text: a test matcher
(`_Forced`) allows only the script's next token, and, where a grammar is under test, hands
over to the request's own matcher (the gate) token by token, so production code is unchanged.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest

from segserve.config.settings import load_settings
from segserve.server.chat.reasoning import (
    ReasoningFamily,
    ReasoningMode,
    Start,
    ThinkingGate,
    ThinkVocab,
    detect_family,
    resolve_family,
    split_reasoning,
    start_from_prompt,
)
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

R1 = ReasoningMode(ReasoningFamily.DEEPSEEK_R1, Start.MODEL)
R1_INSIDE = ReasoningMode(ReasoningFamily.DEEPSEEK_R1, Start.THINKING)
QWEN = ReasoningMode(ReasoningFamily.QWEN3, Start.MODEL)
QWEN_INSIDE = ReasoningMode(ReasoningFamily.QWEN3, Start.THINKING)
QWEN_OFF = ReasoningMode(ReasoningFamily.QWEN3, Start.ANSWER)

# (text, mode, expected reasoning, expected content)
CASES: list[tuple[str, ReasoningMode, str, str]] = [
    ("<think>\nplan it\n</think>\n\nThe answer.", QWEN, "plan it", "The answer."),
    ("<think>\nplan it\n</think>\n\nThe answer.", R1, "plan it", "The answer."),
    ("plan it\n</think>\n\nThe answer.", R1_INSIDE, "plan it", "The answer."),
    ("<think>plan</think>ans", R1_INSIDE, "plan", "ans"),  # a repeated opening tag is markup
    ("plan it</think>The answer.", QWEN_INSIDE, "plan it", "The answer."),
    ("Just an answer.", QWEN, "", "Just an answer."),  # no thinking
    ("  Just an answer. ", QWEN, "", "  Just an answer. "),  # left exactly as generated
    ("No tags at all", R1, "No tags at all", ""),  # R1: no </think>, all thinking
    ("<think>\nstill thinking when cut  ", QWEN, "still thinking when cut", ""),  # unterminated
    ("still thinking", R1_INSIDE, "still thinking", ""),
    ("<thinking is not a tag>", QWEN, "", "<thinking is not a tag>"),  # looks like a tag
    ("<thi", QWEN, "", "<thi"),  # ends while it could still be one
    ("<think>a </thinker> b</think>c", QWEN, "a </thinker> b", "c"),
    ("<think>a</think>b</think>c", QWEN, "a", "b</think>c"),  # only the first block
    ("Hi <think>x</think>", QWEN, "", "Hi <think>x</think>"),  # a tag mid-answer is text
    ("<think></think>\n\nAnswer", QWEN, "", "Answer"),  # empty thinking
    ("<think>x</think>y", QWEN_OFF, "", "<think>x</think>y"),  # thinking off: all answer
    ("ünïcode ✓ plan</think>\n答え", R1_INSIDE, "ünïcode ✓ plan", "答え"),
]


def _splits(text: str) -> Iterator[list[str]]:
    """Every split into up to three pieces, and one character per piece."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("text", "mode", "reasoning", "content"), CASES)
def test_every_split_gives_the_whole_text_result(text: str, mode: ReasoningMode, reasoning: str, content: str) -> None:
    assert split_reasoning(text, mode) == (reasoning, content)
    for pieces in _splits(text):
        s = mode.stream()
        out = [p for piece in pieces for p in s.feed(piece)] + s.finish()
        got_r = "".join(p.text for p in out if p.reasoning)
        got_c = "".join(p.text for p in out if not p.reasoning)
        assert (got_r, got_c) == (reasoning, content), pieces
        assert (s.reasoning, s.content) == (reasoning, content)
        # thinking always comes before the answer, never after it
        kinds = [p.reasoning for p in out]
        assert kinds == sorted(kinds, reverse=True), pieces
        assert not any("<think>" in p.text or "</think>" in p.text for p in out if p.reasoning)


def test_a_split_tag_is_held_until_decided() -> None:
    s = QWEN.stream()
    assert s.feed("<thi") == []
    out = s.feed("nk>Plan")
    assert [(p.reasoning, p.text) for p in out] == [(True, "Plan")]
    out = s.feed(" more </th")  # the space before "</th" waits with it: it may end the thinking
    assert [(p.reasoning, p.text) for p in out] == [(True, " more")]
    out = s.feed("ey")
    assert [(p.reasoning, p.text) for p in out] == [(True, " </they")]
    s = QWEN.stream()
    assert s.feed("<thin") == []
    assert [(p.reasoning, p.text) for p in s.feed("g")] == [(False, "<thing")]


def test_reasoning_tokens_count_until_the_thinking_ends() -> None:
    s = QWEN.stream()
    for piece in ["<think>", "a", " b", "</", "think>\n\nAn", "swer", "."]:
        s.feed(piece)
    s.finish()
    assert s.reasoning_tokens == 5  # the token that completed </think> included
    s = QWEN.stream()
    for piece in ["<th", "inking", " is fun"]:
        s.feed(piece)
    s.finish()
    assert s.reasoning_tokens == 0
    s = R1.stream()
    for piece in ["x", "y", "z"]:
        s.feed(piece)
    s.finish()
    assert s.reasoning_tokens == 3  # unterminated: all of them


def test_family_and_start() -> None:
    assert detect_family("{{ messages }}") is None
    assert detect_family("<|im_start|>{% if enable_thinking %}<think>{% endif %}") is ReasoningFamily.QWEN3
    assert detect_family("<｜Assistant｜><think>\n") is ReasoningFamily.DEEPSEEK_R1
    assert resolve_family("<think>", "none") is None
    assert resolve_family("plain", "qwen3") is ReasoningFamily.QWEN3
    assert resolve_family("<|im_start|><think>", "deepseek_r1") is ReasoningFamily.DEEPSEEK_R1
    assert start_from_prompt("Assistant: <think>\n") is Start.THINKING
    assert start_from_prompt("assistant\n<think>\n\n</think>\n\n") is Start.ANSWER
    assert start_from_prompt("<|im_start|>assistant\n") is Start.MODEL
    # a tag in the user's own text earlier in the prompt decides nothing
    assert start_from_prompt("user: what is <think>?<|im_end|>\n<|im_start|>assistant\n") is Start.MODEL


# ---- the grammar gate ---------------------------------------------------------------------

VOCAB = [b"<", b"think", b">", b"</", b"x", b"{", b"}", b"<think>", b" ", b""]
EOS = 9


class _Script:
    """An inner grammar matcher that allows exactly `want` (token ids), then EOS."""

    def __init__(self, want: list[int]) -> None:
        self.want, self.k, self.fed = want, 0, list[int]()

    def mask(self) -> mx.array:
        m = np.zeros(len(VOCAB), dtype=np.bool_)
        m[self.want[self.k] if self.k < len(self.want) else EOS] = True
        return mx.array(m)

    def accept(self, t: int) -> bool:
        if self.k >= len(self.want) or t != self.want[self.k]:
            return False
        self.k += 1
        self.fed.append(t)
        return True

    def is_finished(self) -> bool:
        return self.k == len(self.want)

    def copy(self) -> _Script:
        c = _Script(self.want)
        c.k, c.fed = self.k, list(self.fed)
        return c


def _vocab() -> ThinkVocab:
    return ThinkVocab.build(lambda t: VOCAB[t], len(VOCAB), [EOS])


def _allowed(g: ThinkingGate) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.array(g.mask()))}


def test_gate_inside_thinking_frees_everything_but_eos_until_the_close() -> None:
    inner = _Script([5, 6])  # "{" "}"
    g = ThinkingGate(inner, _vocab(), Start.THINKING)
    assert _allowed(g) == set(range(len(VOCAB))) - {EOS}
    for t in [4, 8, 3, 1]:  # "x", " ", "</", "think"
        assert g.accept(t) and not g.is_finished()
    assert inner.fed == []  # the grammar saw none of the thinking
    assert g.accept(2)  # ">" completes "</think>"
    assert _allowed(g) == {5}
    assert g.accept(5) and g.accept(6) and g.is_finished()


def test_gate_at_a_model_start_opens_thinking_or_hands_over() -> None:
    v = _vocab()
    g = ThinkingGate(_Script([0, 4]), v, Start.MODEL)  # a grammar that itself starts with "<"
    assert _allowed(g) == {0, 7}  # "<" (both ways) and "<think>"
    assert g.accept(0)
    assert _allowed(g) == {1, 4}  # "think" continues the tag, "x" the grammar
    assert g.accept(1) and g.accept(2)  # "<think>": now thinking; the grammar starts over
    assert _allowed(g) == set(range(len(VOCAB))) - {EOS}
    for t in [3, 1, 2]:
        assert g.accept(t)
    assert _allowed(g) == {0}  # fresh grammar, from its first token
    g2 = ThinkingGate(_Script([0, 4]), v, Start.MODEL)
    assert g2.accept(0) and g2.accept(4)  # "<x": not a tag, the grammar keeps what it took
    assert g2.is_finished()
    g3 = ThinkingGate(_Script([5]), v, Start.MODEL)
    assert not g3.accept(4)  # neither the grammar nor the tag
    g4 = ThinkingGate(_Script([5]), v, Start.MODEL)
    c = g4.copy()
    assert g4.accept(7) and _allowed(c) == {0, 7, 5}  # a copy keeps its own state


# ---- end to end ---------------------------------------------------------------------------

QWEN_TEMPLATE = """{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}"""

R1_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'user' %}User: {{ m.content }}
{% elif m.role == 'assistant' %}Assistant: {{ m.content }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}Assistant: <think>
{% endif -%}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class _Forced:
    """A test matcher: only the script's next token, then `then` (or the end)."""

    def __init__(self, ids: list[int], vocab: int, then: Any = None) -> None:
        self.ids, self.vocab, self.then, self.k = ids, vocab, then, 0

    def mask(self) -> mx.array:
        if self.k >= len(self.ids):
            out: mx.array = self.then.mask()
            return out
        m = np.zeros(self.vocab, dtype=np.bool_)
        m[self.ids[self.k]] = True
        if self.then is not None:
            self.then.mask()  # the gate reads its grammar's mask before each accept
        return mx.array(m)

    def accept(self, t: int) -> bool:
        forced = self.k < len(self.ids)
        self.k += forced
        return bool(self.then.accept(t)) if self.then is not None else forced

    def is_finished(self) -> bool:
        return self.k >= len(self.ids) and (self.then is None or bool(self.then.is_finished()))

    def copy(self) -> _Forced:
        c = _Forced(self.ids, self.vocab, self.then.copy() if self.then is not None else None)
        c.k = self.k
        return c


@pytest.fixture(scope="module")
def tok(gguf_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return gguf_tokenizer


def _server(tok: ChatTokenizer, template: str, tmp: Path, **settings: str) -> Any:
    path = tmp / "template.jinja"
    path.write_text(template)
    values = {"max_tokens_default": "64", "bank_dir": "none", "chat_template": str(path), **settings}
    rt = tiny_runtime(tiny_loaded(tok, context=2048), load_settings(values, environ={}))
    return rt


@pytest.fixture(scope="module")
def qwen(tok: ChatTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Runtime]]:
    rt = _server(tok, QWEN_TEMPLATE, tmp_path_factory.mktemp("qwen"))
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            yield url, rt
    finally:
        rt.engine.stop()


@pytest.fixture(scope="module")
def r1(tok: ChatTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Runtime]]:
    rt = _server(tok, R1_TEMPLATE, tmp_path_factory.mktemp("r1"))
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            yield url, rt
    finally:
        rt.engine.stop()


def _say(monkeypatch: pytest.MonkeyPatch, rt: Runtime, text: str, *, grammar: bool = False) -> list[int]:
    """Make the model say `text` (then stop, or continue under the request's grammar)."""
    ids: list[int] = rt.tokenizer.encode(text)
    submit = rt.engine.submit

    def forced(handle: Any) -> None:
        then = handle.request.matcher if grammar else None
        handle.request = replace(handle.request, matcher=_Forced(ids, rt.vocab_size, then))
        submit(handle)

    monkeypatch.setattr(rt.engine, "submit", forced)
    return ids


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, trust_env=False)


def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


ASK = [{"role": "user", "content": "What is 2+2?"}]
SAID = "<think>\nAdd two and two.\n</think>\n\nIt is 4."


def test_chat_splits_thinking(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    ids = _say(monkeypatch, rt, SAID)
    r = _post(url, "/v1/chat/completions", {"messages": ASK})
    assert r.status_code == 200, r.text
    body = r.json()
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add two and two."}
    close = rt.tokenizer.encode("<think>\nAdd two and two.\n</think>")
    u = body["usage"]
    assert u["completion_tokens"] == len(ids)
    # the thinking's tokens: up to the one that completed </think> (tokenized with the text
    # around it, so between the tag's own length and one token more)
    assert len(close) - 1 <= u["completion_tokens_details"]["reasoning_tokens"] <= len(close) + 1
    assert u["completion_tokens_details"]["reasoning_tokens"] < len(ids)


def test_chat_stream_sends_reasoning_before_content(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    _say(monkeypatch, rt, SAID)
    chunks = _events(url, "/v1/chat/completions", {"messages": ASK, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds[0] == "reasoning_content" and kinds[-1] == "content"
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # no thinking after the answer
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Add two and two."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_enable_thinking_false_is_all_content(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    _say(monkeypatch, rt, "Plain </think> answer.")
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = _post(url, "/v1/chat/completions", {"messages": ASK, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Plain </think> answer."}
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    # the same output with thinking on: a Qwen3 answer without <think> is all content too
    r = _post(url, "/v1/chat/completions", {"messages": ASK})
    assert r.json()["choices"][0]["message"]["content"] == "Plain </think> answer."


def test_r1_prompt_already_inside_thinking(r1: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = r1
    _say(monkeypatch, rt, "Count: 2, then 4.\n</think>\nFour.")
    r = _post(url, "/v1/chat/completions", {"messages": ASK})
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant", "content": "Four.", "reasoning_content": "Count: 2, then 4."}
    chunks = _events(url, "/v1/chat/completions", {"messages": ASK})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Count: 2, then 4."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."


def test_tool_calls_are_read_from_the_answer_only(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _say(monkeypatch, rt, f"<think>Maybe {call.replace('Paris', 'Rome')}?</think>\n\n{call}")
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    msg = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}]
    assert "Rome" in msg["reasoning_content"] and msg["content"] is None
    chunks = _events(url, "/v1/chat/completions", body)
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_history_with_reasoning_content_is_accepted(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    _say(monkeypatch, rt, "Yes.")
    history = [*ASK, {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add."},
               {"role": "user", "content": "Sure?"}]
    r = _post(url, "/v1/chat/completions", {"messages": history})
    assert r.status_code == 200, r.text
    text = rt.loaded.tokenizer.render(history)
    assert "<think>\nAdd.\n</think>" in text  # the template read it


def test_json_schema_constrains_only_after_thinking(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    _say(monkeypatch, rt, "<think>\nI need JSON: {not json yet\n</think>", grammar=True)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = _post(url, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 60, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    })
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "I need JSON: {not json yet"
    if choice["finish_reason"] == "stop":  # random weights may run out of tokens mid-number
        assert isinstance(json.loads(choice["message"]["content"])["n"], int)
    else:
        assert choice["message"]["content"].lstrip().startswith("{")


def test_responses_reasoning_item_and_events(qwen: tuple[str, Runtime], monkeypatch: pytest.MonkeyPatch) -> None:
    url, rt = qwen
    _say(monkeypatch, rt, SAID)
    r = _post(url, "/v1/responses", {"input": "What is 2+2?"})
    assert r.status_code == 200, r.text
    resp = r.json()
    kinds = [o["type"] for o in resp["output"]]
    assert kinds == ["reasoning", "message"]
    item = resp["output"][0]
    assert item["summary"] == [] and item["content"] == [{"type": "reasoning_text", "text": "Add two and two."}]
    assert item["id"].startswith("rs_")
    assert resp["output"][1]["content"][0]["text"] == "It is 4."
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    # the next turn continues from it, and sends its output items back as input
    _say(monkeypatch, rt, "Yes.")
    again = _post(url, "/v1/responses", {"previous_response_id": resp["id"], "input": "Sure?"})
    assert again.status_code == 200, again.text
    manual = _post(url, "/v1/responses", {"input": [
        {"role": "user", "content": "What is 2+2?"}, *resp["output"], {"role": "user", "content": "Sure?"}]})
    assert manual.status_code == 200, manual.text

    _say(monkeypatch, rt, SAID)
    events = _events(url, "/v1/responses", {"input": "What is 2+2?"})
    types = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    first_text = types.index("response.output_text.delta")
    assert types.index("response.reasoning_text.delta") < types.index("response.reasoning_text.done") < first_text
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert deltas == done["text"] == "Add two and two."
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "Add two and two."
    assert final["output"][0]["status"] == "completed"
    assert final["output"][1]["content"][0]["text"] == "It is 4."
