"""TextStream's incremental decoding against a full decode, and its cost per token.

Differential: for id sequences of the embedded tokenizer (random ids, byte tokens that split
multi-byte characters, real text), the pushed pieces plus `flush()` equal one decode of all
ids (less an incomplete character at the very end). Cost: the ids decoded per token stay
bounded however long the output gets (counted, not timed).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from segserve.server.runner import ChatTokenizer, TextStream


def _stream(decode: Callable[[Sequence[int]], str], ids: Sequence[int], stops: Sequence[str] = ()) -> str:
    ts = TextStream(decode, stops)
    return "".join(ts.push(i) for i in ids) + ts.flush()


def _partial_byte_ids(tok: ChatTokenizer) -> list[int]:
    """Ids whose bytes are not whole UTF-8 (lead or continuation bytes of a character)."""
    out = []
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


@pytest.fixture(scope="module")
def partial_ids(gguf_tokenizer: ChatTokenizer) -> list[int]:
    ids = _partial_byte_ids(gguf_tokenizer)
    assert len(ids) > 50  # byte-level BPE: every byte >= 0x80 alone is such a token
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_equal_full_decode(gguf_tokenizer: ChatTokenizer, partial_ids: list[int], seed: int) -> None:
    rng = random.Random(seed)
    ids = []
    for _ in range(400):  # about a third split characters: partial bytes in a row
        ids.append(rng.choice(partial_ids) if rng.random() < 0.35 else rng.randrange(gguf_tokenizer.vocab_size))
    full = gguf_tokenizer.decode(ids)
    assert _stream(gguf_tokenizer.decode, ids) == full.rstrip("\ufffd")


@pytest.mark.parametrize("text", ["🎉👩‍💻 emoji", "日本語のテキストです。", "mixed héllo 🎉 wörld\n\tend", " lead space"])
def test_split_characters_equal_full_decode(gguf_tokenizer: ChatTokenizer, text: str) -> None:
    # Encoding then splitting each token into its bytes' single-byte tokens makes every
    # multi-byte character arrive over several tokens.
    byte_id = {gguf_tokenizer.token_bytes(i): i for i in range(gguf_tokenizer.vocab_size)}
    ids = [byte_id[bytes([b])] for b in text.encode("utf-8")]
    pieces = []
    ts = TextStream(gguf_tokenizer.decode, [])
    for i in ids:
        piece = ts.push(i)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) + ts.flush() == text == gguf_tokenizer.decode(ids)


def test_stops_match_full_decode_rule(gguf_tokenizer: ChatTokenizer) -> None:
    text = "alpha beta STOP gamma"
    ids = gguf_tokenizer.encode(text)
    assert _stream(gguf_tokenizer.decode, ids, ["STOP"]) == "alpha beta "
    assert _stream(gguf_tokenizer.decode, ids, ["zzz"]) == text


def test_long_invalid_run_is_bounded_and_equal(gguf_tokenizer: ChatTokenizer) -> None:
    byte_id = {gguf_tokenizer.token_bytes(i): i for i in range(gguf_tokenizer.vocab_size)}
    ids = [byte_id[b"\xe2"]] * 100 + gguf_tokenizer.encode(" done")  # lone lead bytes
    calls: list[int] = []

    def counted(window: Sequence[int]) -> str:
        calls.append(len(window))
        return gguf_tokenizer.decode(window)

    assert _stream(counted, ids) == gguf_tokenizer.decode(ids)
    assert max(calls) <= 2 * 34  # the window never outgrows the pending cap (plus context)


def test_cost_per_token_does_not_grow(gguf_tokenizer: ChatTokenizer) -> None:
    ids = gguf_tokenizer.encode("The quick brown fox jumps over the lazy dog. 日本語 🎉\n" * 80)
    assert len(ids) > 1500
    decoded: list[int] = []

    def counted(window: Sequence[int]) -> str:
        decoded.append(len(window))
        return gguf_tokenizer.decode(window)

    ts = TextStream(counted, ["never appears"])
    per_token = []
    for i in ids:
        before = sum(decoded)
        ts.push(i)
        per_token.append(sum(decoded) - before)
    ts.flush()
    # A full re-decode would cost len(prefix) ids at token n; the window costs a handful.
    assert max(per_token) <= 16
    assert sum(per_token[-200:]) <= sum(per_token[:200]) * 1.5 + 50
