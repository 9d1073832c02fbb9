"""segserve.server.chat.tool_calls: family detection, whole-text parsing and the streaming parser."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from segserve.server.chat.tool_calls import (
    ContentDelta,
    Delta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolFamily,
    detect_family,
    family_from_name,
    new_call_id,
    parse_tool_calls,
    resolve_family,
)

H = ToolFamily.HERMES
L = ToolFamily.LLAMA3_JSON


def _ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def _parse(text: str, fam: ToolFamily) -> ParsedOutput:
    ids = _ids()
    return parse_tool_calls(text, fam, id_factory=lambda: next(ids))


def _split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def _stream(pieces: list[str], fam: ToolFamily) -> tuple[ToolCallStream, list[Delta]]:
    ids = _ids()
    s = ToolCallStream(fam, id_factory=lambda: next(ids))
    deltas: list[Delta] = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return s, deltas


def _assemble(deltas: list[Delta]) -> ParsedOutput:
    """What a client (e.g. the OpenAI SDK's stream helpers) rebuilds from the deltas."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
            continue
        if d.index not in calls:
            assert d.id is not None and d.name is not None, "first delta of a call names it"
            assert d.arguments == ""
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return ParsedOutput(
        content,
        tuple(ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())),
    )


HERMES_TEXTS = [
    "No tools needed: 2 < 3 and <tool> is not a marker.",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
    # parallel calls, braces and the closing marker inside argument strings
    '<tool_call>\n{"name": "a", "arguments": {"q": "}{ </tool_call> \\" x", "n": [1, {"k": null}]}}\n'
    '</tool_call>\n<tool_call>{"name":"b","arguments":{}}</tool_call>\nDone.',
    # keys in the other order: parsed once the block is complete
    '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>',
    # no closing tag at the end of generation
    '<tool_call>\n{"name": "f", "arguments": {"x": true}}\n',
    # malformed before commit → content, verbatim
    "<tool_call>\nnot json at all\n</tool_call> trailing",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "ends with a partial marker <tool_ca",
]
LLAMA_TEXTS = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, "}"]}}',
    '  {"parameters": {"y": 2}, "name": "other_order"}',
    "Plain answer with a {brace} later.",
    '{"answer": 42, "note": "json but not a call"}',
    '{"name": "cut", "param',
]


@pytest.mark.parametrize("fam,text", [(H, t) for t in HERMES_TEXTS] + [(L, t) for t in LLAMA_TEXTS])
def test_stream_in_random_pieces_equals_whole_text(fam: ToolFamily, text: str) -> None:
    whole = _parse(text, fam)
    for seed in range(60):
        stream, deltas = _stream(_split(text, random.Random(seed)), fam)
        assert stream.broken == 0
        assert stream.result() == whole
        assert _assemble(deltas) == whole, f"seed {seed}"
        for d in deltas:
            if isinstance(d, ContentDelta):
                assert "<tool_call>" not in d.text or whole.content.count("<tool_call>")
    _, one_char = _stream(list(text), fam)
    assert _assemble(one_char) == whole


def test_hermes_results() -> None:
    r = _parse(HERMES_TEXTS[1], H)
    assert r.content == "Let me check.\n"
    assert r.tool_calls == (ToolCall("call_0", "get_weather", '{"city": "Zürich"}'),)
    r = _parse(HERMES_TEXTS[2], H)
    assert [c.name for c in r.tool_calls] == ["a", "b"]
    assert json.loads(r.tool_calls[0].arguments) == {
        "q": '}{ </tool_call> " x',
        "n": [1, {"k": None}],
    }
    assert r.tool_calls[1].arguments == "{}"
    assert r.content == "Done."  # whitespace between and after blocks is markup
    assert _parse(HERMES_TEXTS[3], H).tool_calls[0].arguments == '{"x": 1}'
    assert _parse(HERMES_TEXTS[4], H).tool_calls[0].name == "f"
    assert _parse(HERMES_TEXTS[0], H) == ParsedOutput(HERMES_TEXTS[0], ())


@pytest.mark.parametrize("text", HERMES_TEXTS[5:7])
def test_malformed_json_stays_content(text: str) -> None:
    assert _parse(text, H) == ParsedOutput(text, ())


def test_malformed_after_commit() -> None:
    """Arguments that break after the name was sent: whole text → content; stream → broken."""
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call> bye'
    assert _parse(text, H) == ParsedOutput(text, ())
    stream, deltas = _stream(_split(text, random.Random(1)), H)
    assert stream.broken == 1 and stream.tool_calls == ()
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == "Hi  bye"
    assert not any("tool_call" in d.text for d in deltas if isinstance(d, ContentDelta))


def test_marker_is_held_back_until_decided() -> None:
    s = ToolCallStream(H, id_factory=lambda: "call_x")
    assert s.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert s.feed('_call>\n{"name": "f", ') == []
    assert s.feed('"arguments": {"a"') == [
        ToolCallDelta(0, "call_x", "f", ""),
        ToolCallDelta(0, None, None, '{"a"'),
    ]
    assert s.feed(": 1}}\n</tool_call>") == [ToolCallDelta(0, None, None, ": 1}")]
    assert s.feed(" <tool") == []
    assert s.finish() == [ContentDelta("<tool")]  # whitespace after a call is markup
    assert s.result() == ParsedOutput("Hello <tool", (ToolCall("call_x", "f", '{"a": 1}'),))


def test_llama_results() -> None:
    r = _parse(LLAMA_TEXTS[0], L)
    assert r == ParsedOutput("", (ToolCall("call_0", "get_weather", '{"city": "Oslo"}'),))
    r = _parse(LLAMA_TEXTS[1], L)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [
        ("a", {}),
        ("b", {"x": [1, "}"]}),
    ]
    assert _parse(LLAMA_TEXTS[2], L).tool_calls[0].arguments == '{"y": 2}'
    for text in LLAMA_TEXTS[3:]:
        assert _parse(text, L) == ParsedOutput(text if text[0] != " " else text.lstrip(), ())


def test_deltas_are_openai_shaped() -> None:
    assert ToolCallDelta(1, "call_a", "f", "").to_openai() == {
        "index": 1,
        "id": "call_a",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(1, None, None, '{"a"').to_openai() == {
        "index": 1,
        "function": {"arguments": '{"a"'},
    }
    assert ToolCall("call_a", "f", "{}").to_openai()["function"] == {"name": "f", "arguments": "{}"}
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_family_detection_and_override() -> None:
    assert detect_family("{% for t in tools %}<tool_call>{% endfor %}") is H
    assert detect_family("<|start_header_id|>ipython<|end_header_id|> parameters") is L
    assert detect_family("{{ '<|python_tag|>' }}") is L
    embedded = "{% for message in messages %}{{'<|im_start|>' + message['role'] }}{% endfor %}"
    assert detect_family(embedded) is None
    assert resolve_family(embedded, "qwen") is H
    assert resolve_family("<tool_call>", "llama3_json") is L
    assert resolve_family("<tool_call>", "auto") is H
    assert family_from_name("Hermes") is H and family_from_name("auto") is None
    with pytest.raises(ValueError, match="unknown tool parser"):
        family_from_name("mistral9")


HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'
LLAMA_CALL = '{"name": "g", "parameters": {"b": {"c": null}}}'
FRAGMENTS = {
    H: [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "_call>",
        "\n",
        " ",
        "text",
        '"',
        "{",
        "}",
        '{"name": "f", "arguments": ',
        '{"a": [1, "}"]}',
        '"name"',
        ": ",
        ", ",
        '"x"',
        "<",
        ">",
        HERMES_CALL,
        HERMES_CALL,
        HERMES_CALL,
        '<tool_call>{"arguments": {}, "name": "k"}</tool_call>',
    ],
    L: [
        "<|python_tag|>",
        "{",
        "}",
        ";",
        " ",
        "\n",
        "text",
        '"',
        '{"name": "g", "parameters": ',
        '{"b": {"c": null}}',
        '"arguments"',
        ": ",
        ", ",
        "[",
        "]",
        "1",
        LLAMA_CALL,
        LLAMA_CALL,
        LLAMA_CALL,
        "; ",
    ],
}


@pytest.mark.parametrize("fam", [H, L])
def test_fuzz_chunking_never_matters(fam: ToolFamily) -> None:
    """Random texts built from markup fragments: any split gives the whole-text result, and
    (no broken call) the deltas rebuild it; markup never leaks into content deltas."""
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS[fam]) for _ in range(rng.randint(1, 14)))
        whole = _parse(text, fam)
        for seed in range(3):
            stream, deltas = _stream(_split(text, random.Random(seed)), fam)
            assert stream.result() == whole, text
            if stream.broken == 0:
                assert _assemble(deltas) == whole, text
            if fam is H and "<tool_call>" not in whole.content:
                streamed = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
                assert "<tool_call>" not in streamed, text


# ------------------------------------------------------------------ repeated calls
def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'


def _llama(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}; '


@pytest.mark.parametrize("fam,block", [(H, _hermes), (L, _llama)])
def test_exact_repeats_are_dropped_and_indices_stay_contiguous(fam: ToolFamily, block: Any) -> None:
    """The same call again (key order and spacing aside) is dropped; the same name with other
    arguments is a call of its own (`1` and `true` differ as JSON even though 1 == True)."""
    text = "".join([
        block("f", '{"a": 1, "b": [1, 2]}'),
        block("f", '{"b":[1,2],"a":1}'),  # a repeat, written differently
        block("g", "{}"),
        block("f", '{"a": true, "b": [1, 2]}'),  # not a repeat
        block("f", '{"a": 1, "b": [1, 2]}'),
        block("g", "{}"),
    ])
    whole = _parse(text, fam)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("call_0", "f", {"a": 1, "b": [1, 2]}),
        ("call_2", "g", {}),
        ("call_3", "f", {"a": True, "b": [1, 2]}),
    ]
    assert whole.content == ""  # a dropped repeat is not content either
    for seed in range(40):
        stream, deltas = _stream(_split(text, random.Random(seed)), fam)
        assert stream.result() == whole and stream.duplicates == 3 and stream.broken == 0
        assert _assemble(deltas) == whole, f"seed {seed}"  # indices 0, 1, 2: no gaps


def test_a_runaway_required_call_ends_as_one_call() -> None:
    """tool_choice "required" + parallel calls: the model writes one call until max_tokens
    cuts it inside a copy. One call reaches the client; the cut copy was held (its name
    repeats), so nothing malformed is sent either."""
    call = _hermes("get_weather", '{"city": "Oslo"}')
    cut = call[: call.index("Oslo")]  # inside the arguments: the call was committed
    text = call * 50 + cut
    stream, deltas = _stream(_split(text, random.Random(3)), H)
    assert stream.tool_calls == (ToolCall("call_0", "get_weather", '{"city": "Oslo"}'),)
    assert stream.duplicates == 49 and stream.broken == 1
    assert _assemble(deltas) == ParsedOutput("", stream.tool_calls)
    assert stream.result() == _parse(text, H)  # the cut block is content, as for any broken call
    assert stream.result().content == cut


def test_only_a_call_that_may_repeat_is_held() -> None:
    s = ToolCallStream(H, id_factory=iter(["call_a", "call_b", "call_c"]).__next__)
    first = s.feed('<tool_call>{"name": "f", "arguments": {"x"')
    assert first == [ToolCallDelta(0, "call_a", "f", ""), ToolCallDelta(0, None, None, '{"x"')]
    assert s.feed(": 1}}</tool_call>") == [ToolCallDelta(0, None, None, ": 1}")]
    # a new name streams at once
    assert s.feed('<tool_call>{"name": "g", "arguments": {"y"') == [
        ToolCallDelta(1, "call_b", "g", ""), ToolCallDelta(1, None, None, '{"y"')]
    assert s.feed(": 2}}</tool_call>") == [ToolCallDelta(1, None, None, ": 2}")]
    # "f" again: nothing until the call is complete, then all of it (other arguments: kept)
    assert s.feed('<tool_call>{"name": "f", "arguments": {"x": 2') == []
    assert s.feed("}}</tool_call>") == [
        ToolCallDelta(2, "call_c", "f", ""), ToolCallDelta(2, None, None, '{"x": 2}')]
    assert s.finish() == [] and s.duplicates == 0
