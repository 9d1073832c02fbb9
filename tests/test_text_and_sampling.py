"""TextStream (stop strings, UTF-8 hold-back), sampling (seeded, top-p), tokenizer round trips."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import pytest

from segserve.server.runner import ChatTokenizer, TextStream
from segserve.server.runner.sampling import Sampler, SamplingParams


def _chars(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def _feed(ts: TextStream, text: str) -> str:
    out = "".join(ts.push(ord(c)) for c in text)
    return out + ts.flush()


def test_stop_string_is_never_emitted() -> None:
    ts = TextStream(_chars, ["END"])
    out = _feed(ts, "hello ENDworld")
    assert out == "hello " and ts.stopped


def test_partial_stop_is_held_then_released() -> None:
    ts = TextStream(_chars, ["END"])
    assert ts.push(ord("a")) == "a"
    assert ts.push(ord("E")) == ""  # could become "END"
    assert ts.push(ord("N")) == ""
    assert ts.push(ord("x")) == "ENx"
    assert ts.flush() == ""


def test_held_text_flushed_at_end() -> None:
    ts = TextStream(_chars, ["END"])
    assert _feed(ts, "abcEN") == "abcEN"


def test_incomplete_utf8_is_held(gguf_tokenizer: ChatTokenizer) -> None:
    ids = gguf_tokenizer.encode("🎉 ok")
    ts = TextStream(gguf_tokenizer.decode, [])
    outs = [ts.push(i) for i in ids]
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + ts.flush() == "🎉 ok"


@pytest.mark.parametrize(
    "text",
    ["plain ascii", "héllo wörld ñ", "日本語のテキスト", "emoji 🎉👩‍💻 mix", "tabs\tand\nnew\r\nlines", "digits 1234567890 3.14", "  leading and trailing  "],
)
def test_tokenizer_round_trip(gguf_tokenizer: ChatTokenizer, text: str) -> None:
    assert gguf_tokenizer.decode(gguf_tokenizer.encode(text)) == text


def test_digits_split_individually(gguf_tokenizer: ChatTokenizer) -> None:
    ids = gguf_tokenizer.encode("2024")
    assert len(ids) == 4


def test_control_tokens_are_single_ids(gguf_tokenizer: ChatTokenizer) -> None:
    ids = gguf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert 2 in gguf_tokenizer.eos_ids


def test_chat_template_renders(gguf_tokenizer: ChatTokenizer) -> None:
    text = gguf_tokenizer.render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text


def test_greedy_is_argmax() -> None:
    logits = mx.array([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(temperature=0.0))(logits).item() == 1


def test_same_seed_same_tokens() -> None:
    logits = mx.random.normal((500,))
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    c = Sampler(SamplingParams(temperature=1.0, seed=8))
    sa = [a(logits).item() for _ in range(20)]
    assert sa == [b(logits).item() for _ in range(20)]
    assert sa != [c(logits).item() for _ in range(20)]


def test_top_p_keeps_smallest_set() -> None:
    logits = mx.log(mx.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert {int(s(logits).item()) for _ in range(200)} == {0, 1}  # type: ignore[arg-type]  # item() of a 0-d integer array
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.1, seed=1))
    assert {int(s(logits).item()) for _ in range(50)} == {0}  # type: ignore[arg-type]  # item() of a 0-d integer array


def test_logprobs_top_sorted() -> None:
    logits = mx.array([1.0, 3.0, 2.0, 0.0])
    s = Sampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2))
    lp = s.logprob(logits, 1)
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.logprob == pytest.approx(lp.top[0][1])
    assert lp.logprob < 0
