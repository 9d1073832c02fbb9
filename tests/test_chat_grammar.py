"""segserve.server.chat.grammar on the embedded model's real vocabulary: random tokens drawn only
from what the mask allows always decode to JSON that parses and fits the schema."""

from __future__ import annotations

import importlib
import json
import random
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer

from segserve.server.chat.grammar import (
    GrammarError,
    GrammarMatcher,
    GrammarVocab,
    apply_masks,
    compile_response_format,
    compile_tool_choice,
)
from segserve.server.chat.tool_calls import ToolFamily, parse_tool_calls

SEEDS = 100
MAX_STEPS = 400


def embedded_tokenizer() -> tuple[Tokenizer, int, frozenset[int]]:
    """The embedded SmolLM2 GGUF's tokenizer, built the way the server builds it."""
    gguf = importlib.import_module("segserve.server.runner.gguf")
    tokmod = importlib.import_module("segserve.server.runner.tokenizer")
    _, meta = mx.load(str(gguf.embedded_model_path()), return_metadata=True)
    chat, tok = tokmod.from_gguf_metadata(meta)
    return tok, int(chat.vocab_size), frozenset(chat.eos_ids)


@pytest.fixture(scope="module")
def embedded() -> tuple[Tokenizer, GrammarVocab]:
    tok, vocab_size, eos = embedded_tokenizer()
    return tok, GrammarVocab.from_tokenizer(tok, vocab_size=vocab_size, eos_ids=eos)


@pytest.fixture(scope="module")
def closers(embedded: tuple[Tokenizer, GrammarVocab]) -> np.ndarray:
    """Tokens that can end a string/array/object: drawing them half the time keeps random
    walks short (a uniform draw inside a string almost never picks a quote)."""
    tok, vocab = embedded
    texts = [tok.id_to_token(i) or "" for i in range(vocab.vocab_size)]
    flags = [any(c in t for c in '"}],') for t in texts]
    for e in vocab.eos_ids:
        flags[e] = True
    return np.array(flags, dtype=np.bool_)


def _walk(m: GrammarMatcher, tok: Tokenizer, closers: np.ndarray, seed: int) -> str:
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        if m.is_finished():
            break
        allowed = np.array(m.mask())
        choices = np.flatnonzero(allowed)
        assert choices.size, "mask allows nothing"
        preferred = np.flatnonzero(allowed & closers)
        pool = preferred if preferred.size and rng.random() < 0.5 else choices
        t = int(pool[rng.randrange(pool.size)])
        assert m.accept(t), m.error
        ids.append(t)
    assert m.is_finished(), f"seed {seed}: not finished in {MAX_STEPS} steps"
    return str(tok.decode(ids, skip_special_tokens=True))


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "score", "tags", "kind", "ok", "pos", "note"],
    "additionalProperties": False,
}


def _check(value: Any, schema: dict[str, Any]) -> None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    # by hand, for SCHEMA
    assert isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert type(value["score"]) in (int, float)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in ("a", "b", "c") for t in value["tags"])
    assert value["kind"] in ("cat", "dog") and type(value["ok"]) is bool
    assert set(value["pos"]) == {"x", "y"} and all(type(v) is int for v in value["pos"].values())
    assert value["note"] is None or isinstance(value["note"], str)


def test_json_schema_strict_always_valid(
    embedded: tuple[Tokenizer, GrammarVocab], closers: np.ndarray
) -> None:
    tok, vocab = embedded
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    g = compile_response_format(rf, vocab)
    assert g is not None and g.kind == "json_schema:person"
    for seed in range(SEEDS):
        text = _walk(g.matcher(), tok, closers, seed)
        _check(json.loads(text), SCHEMA)


def test_json_object_always_parses(
    embedded: tuple[Tokenizer, GrammarVocab], closers: np.ndarray
) -> None:
    tok, vocab = embedded
    g = compile_response_format({"type": "json_object"}, vocab)
    assert g is not None
    for seed in range(SEEDS):
        assert isinstance(json.loads(_walk(g.matcher(), tok, closers, seed)), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize("family", [ToolFamily.HERMES, ToolFamily.LLAMA3_JSON])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse(
    family: ToolFamily, choice: str, embedded: tuple[Tokenizer, GrammarVocab], closers: np.ndarray
) -> None:
    tok, vocab = embedded
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    g = compile_tool_choice(family, [WEATHER, TIME], tool_choice, vocab)
    assert g is not None
    names = set()
    for seed in range(30):
        text = _walk(g.matcher(), tok, closers, seed)
        parsed = parse_tool_calls(text, family)
        assert parsed.content == "" and parsed.tool_calls, text
        for call in parsed.tool_calls:
            names.add(call.name)
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
            else:
                assert args == {}
        if choice == "named":
            assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert names == ({"get_weather", "get_time"} if choice == "required" else {"get_weather"})


def test_no_constraint_and_errors(embedded: tuple[Tokenizer, GrammarVocab]) -> None:
    _, vocab = embedded
    assert compile_response_format(None, vocab) is None
    assert compile_response_format({"type": "text"}, vocab) is None
    assert compile_tool_choice(ToolFamily.HERMES, [WEATHER], "auto", vocab) is None
    with pytest.raises(GrammarError) as err:
        compile_response_format(
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}},
                    },
                },
            },
            vocab,
        )
    assert err.value.param == "response_format" and "bad" in str(err.value)
    with pytest.raises(GrammarError, match="Invalid type"):
        compile_response_format(
            {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "tuple"}}},
            vocab,
        )
    with pytest.raises(GrammarError) as err:
        compile_response_format({"type": "yaml"}, vocab)
    assert err.value.param == "response_format"
    with pytest.raises(GrammarError) as err:
        compile_tool_choice(
            ToolFamily.HERMES, [WEATHER], {"type": "function", "function": {"name": "nope"}}, vocab
        )
    assert err.value.param == "tool_choice"


def test_mask_applies_to_mlx_logits(embedded: tuple[Tokenizer, GrammarVocab]) -> None:
    tok, vocab = embedded
    g = compile_response_format({"type": "json_object"}, vocab)
    assert g is not None
    m = g.matcher()
    mask = m.mask()
    assert mask.shape == (vocab.vocab_size,) and mask.dtype == mx.bool_
    logits = mx.zeros((vocab.vocab_size,))
    best = int(mx.argmax(m.apply(logits + mx.arange(vocab.vocab_size) * 1e-6)).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
    assert tok.decode([best]).startswith("{")
    batch = apply_masks(mx.zeros((2, vocab.vocab_size)), [mask, None])
    assert int(mx.sum(batch[0] == 0).item()) == int(mx.sum(mask).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
    assert bool(mx.all(batch[1] == 0).item())
    assert not m.accept(tok.encode("hello").ids[0]) and m.error
    assert set(np.flatnonzero(np.array(m.mask())).tolist()) == set(vocab.eos_ids)
    assert m.is_finished()


def test_bad_tool_parameters_name_the_tools(embedded: tuple[Tokenizer, GrammarVocab]) -> None:
    _, vocab = embedded
    bad = {
        "type": "function",
        "function": {
            "name": "odd",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "string", "format": "no-such-format"}},
            },
        },
    }
    with pytest.raises(GrammarError) as err:
        compile_tool_choice(ToolFamily.HERMES, [bad], "required", vocab)
    assert err.value.param == "tools" and "no-such-format" in err.value.message
    with pytest.raises(GrammarError) as err:
        compile_tool_choice(ToolFamily.HERMES, [], "required", vocab)
    assert err.value.param == "tools"
