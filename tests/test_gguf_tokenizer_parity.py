"""The GGUF tokenizer built by transformers' converter (the default route) against the hand
build (`build_bpe`, the fallback): same vocabulary, special tokens, ids and decoded text on a
varied corpus, on the embedded SmolLM2 GGUF. Figures: bench/tokenizer_gguf.py."""

from __future__ import annotations

import json
import logging
from typing import Any

import mlx.core as mx
import pytest
from tokenizers import Tokenizer

from segserve.server.runner import embedded_model_path
from segserve.server.runner.tokenizer import (
    ChatTokenizer,
    UnknownPreTokenizer,
    _HFCodec,
    build_bpe,
    from_gguf_metadata,
    gguf_bpe,
    transformers_bpe,
)

CORPUS: list[str] = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Isn't it? We'll see; they'd've said so.",
    "DON'T SHOUT, I'M HERE — 'quoted' and \"double quoted\" text…",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12345678))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 3.14159; }\r\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "12345678 1234567 123 0.5 1e-9 -42 3,141,592 +1 (555) 010-9999",
    "½ ² ³ ٣٤٥ ४२ Ⅻ ① 𝟙𝟚 一二三",
    "emoji: 😀 🚀 👩‍💻 🇫🇷 ❤️ 👍🏽",
    "中文测试：你好，世界！ 日本語のテキスト、カタカナ。 한국어 문장입니다.",
    "café naïve résumé Ελληνικά Русский текст العربية עברית",
    "combining: e\u0301 a\u0308 \u0915\u094d\u0937 zero\u200bwidth",
    "  leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tand\n\n\nnewlines\n",
    "        eight spaces then text",
    " \n \n\t \r\n  ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><|im_start|>assistant\n<|im_end|><|im_end|>",
    "text<|im_start|>glued<|im_end|>text <|im_start|> spaced <|im_end|>",
    "<|im_start  not special |im_end|>",
    "",
    " ",
    "a",
]


def _conversations(chat: ChatTokenizer) -> list[str]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    system = {"role": "system", "content": "You are terse. Answer in 1 line."}
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "What's 12345678 * 9? 🤔"},
        {"role": "assistant", "content": "111111102"},
        {"role": "user", "content": "Now in 中文, with   spaces\n\tand tabs."},
    ]
    return [
        chat.render([turns[0]]),
        chat.render([system, *turns]),
        chat.render([system, turns[0]], tools=tools),
    ]


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    loaded: Any = mx.load(str(embedded_model_path()), return_metadata=True)
    return dict(loaded[1])


@pytest.fixture(scope="module")
def both(meta: dict[str, Any]) -> tuple[Tokenizer, Tokenizer]:
    ours = build_bpe(
        list(meta["tokenizer.ggml.tokens"]),
        list(meta["tokenizer.ggml.merges"]),
        [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()],
        str(meta["tokenizer.ggml.pre"]),
    )
    return transformers_bpe(meta), ours


def test_converter_is_found_where_a_transformers_release_keeps_it(
    meta: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releases move the GGUF tokenizer pieces between modules: found in any of the listed
    modules; where none has them, the hand build serves (never an AttributeError)."""
    import sys
    import types

    from segserve.server.runner import tokenizer as tk

    real = tk._gguf_converter()
    assert real is not None
    moved = types.ModuleType("segserve_test_ggml")
    moved.GGUF_TOKENIZER_MAPPING = {"tokenizer": dict(real.keys)}  # type: ignore[attr-defined]
    moved.convert_gguf_tokenizer = real.convert  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "segserve_test_ggml", moved)
    monkeypatch.setattr(tk, "_GGUF_MODULES", ("segserve_test_missing", "segserve_test_ggml"))
    tk._gguf_converter.cache_clear()
    try:
        tok, route = gguf_bpe(meta)
        assert route == "transformers" and tk._transformers_splits() == {}
        monkeypatch.setattr(tk, "_GGUF_MODULES", ("segserve_test_missing",))
        tk._gguf_converter.cache_clear()
        hand, route = gguf_bpe(meta)
        assert route == "hand-built"
        text = "Hello world 12345 <|im_start|>user\ncode() {}"
        assert hand.encode(text).ids == tok.encode(text).ids
    finally:
        tk._gguf_converter.cache_clear()


def test_default_route_is_transformers(meta: dict[str, Any]) -> None:
    _, route = gguf_bpe(meta)
    assert route == "transformers"
    chat, tok = from_gguf_metadata(meta)
    assert chat.backend is tok
    assert chat.vocab_size == tok.get_vocab_size() == len(meta["tokenizer.ggml.tokens"])


def test_same_vocabulary_and_special_tokens(both: tuple[Tokenizer, Tokenizer]) -> None:
    tf, ours = both
    assert tf.get_vocab(with_added_tokens=True) == ours.get_vocab(with_added_tokens=True)
    spec = {i: (t.content, t.special, t.normalized) for i, t in tf.get_added_tokens_decoder().items()}
    assert spec == {i: (t.content, t.special, t.normalized) for i, t in ours.get_added_tokens_decoder().items()}
    assert {1: "<|im_start|>", 2: "<|im_end|>"}.items() <= {i: c for i, (c, _, _) in spec.items()}.items()
    # SmolLM's digit rule is kept: transformers has no split for "smollm"
    assert json.loads(tf.to_str())["pre_tokenizer"] == json.loads(ours.to_str())["pre_tokenizer"]


def test_same_ids_and_text_on_corpus(both: tuple[Tokenizer, Tokenizer], gguf_tokenizer: ChatTokenizer) -> None:
    tf, ours = both
    texts = [*CORPUS, *_conversations(gguf_tokenizer), "\n".join(CORPUS)]
    for text in texts:
        a = tf.encode(text, add_special_tokens=False).ids
        b = ours.encode(text, add_special_tokens=False).ids
        assert a == b, text
        for skip in (True, False):
            assert tf.decode(a, skip_special_tokens=skip) == ours.decode(b, skip_special_tokens=skip), text
    digits = tf.encode("12345678", add_special_tokens=False).ids
    assert len(digits) == 8  # one token per digit


def test_same_token_bytes(both: tuple[Tokenizer, Tokenizer]) -> None:
    a, b = (_HFCodec(t) for t in both)
    for i in range(both[0].get_vocab_size()):
        assert a.token_bytes(i) == b.token_bytes(i), i


def _tiny_meta(tokens: list[str], pre: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": mx.array([1] * (len(tokens) - 1) + [3], dtype=mx.int32),
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def test_fallback_when_transformers_cannot(caplog: pytest.LogCaptureFixture) -> None:
    # no <|endoftext|> in the vocabulary: transformers' GPT2Tokenizer adds one, so its
    # vocabulary no longer matches the file's ids -> the hand build, with the reason logged
    tokens = ["a", "b", "ab", "Ġ", "<eos>"]
    with caplog.at_level(logging.WARNING, logger="segserve.runner"):
        tok, route = gguf_bpe(_tiny_meta(tokens, "smollm"))
    assert route == "hand-built"
    assert tok.get_vocab_size() == len(tokens)
    assert tok.encode("ab a", add_special_tokens=False).ids == [2, 3, 0]
    assert [r.getMessage() for r in caplog.records] == [
        "GGUF tokenizer: hand-built fallback: transformers' GGUF tokenizer has 6 tokens, the file 5"
    ]


def test_unknown_pre_is_an_error_on_both_routes() -> None:
    with pytest.raises(UnknownPreTokenizer, match="'mystery-pre'"):
        gguf_bpe(_tiny_meta(["<|endoftext|>", "a", "b", "ab", "<eos>"], "mystery-pre"))
    tok, route = gguf_bpe(_tiny_meta(["<|endoftext|>", "a", "b", "ab", "<eos>"], "qwen2"))
    assert route == "transformers"
    assert json.loads(tok.to_str())["pre_tokenizer"]["type"] == "Sequence"
