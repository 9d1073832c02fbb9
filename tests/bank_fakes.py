"""Model-free fakes for bank tests: segments whose K/V rows are a function of (token, position).

Owns nothing stateful. Engine-thread rules apply (it creates MLX arrays).
Because every row's values follow from its token id and absolute position, a test can check
any snapshot the bank returns against what it *must* hold (`assert_rows_match`): a restore
of another conversation's rows, a wrong offset or a corrupt block cannot pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from segserve.kv.segment import ROOT_DIGEST, Segment, Snapshot

if TYPE_CHECKING:
    from segserve.bank import Bank

LAYERS, HEADS, DIM = 2, 2, 8


def expected_rows(
    tokens: Sequence[int], start: int, *, layers: int = LAYERS, heads: int = HEADS, dim: int = DIM
) -> tuple[np.ndarray, np.ndarray]:
    """K and V as float32 [layers, 1, heads, rows, dim]; exact in float16 and bfloat16."""
    t = np.asarray(tokens, dtype=np.int64)[None, None, None, :, None]
    pos = np.arange(start, start + len(tokens), dtype=np.int64)[None, None, None, :, None]
    lay = np.arange(layers, dtype=np.int64)[:, None, None, None, None]
    h = np.arange(heads, dtype=np.int64)[None, None, :, None, None]
    d = np.arange(dim, dtype=np.int64)[None, None, None, None, :]
    k = ((t * 31 + pos * 7 + lay * 3 + h) % 61 + d) / 4.0
    v = -((t * 17 + pos * 5 + lay * 11 + h * 2) % 53 + d) / 4.0
    return k.astype(np.float32), v.astype(np.float32)


def fake_segment(
    tokens: Sequence[int],
    start: int = 0,
    parent: str = ROOT_DIGEST,
    *,
    dtype: mx.Dtype = mx.float16,
    layers: int = LAYERS,
) -> Segment:
    k, v = expected_rows(tokens, start, layers=layers)
    keys = [mx.array(k[i]).astype(dtype) for i in range(layers)]
    values = [mx.array(v[i]).astype(dtype) for i in range(layers)]
    mx.eval(*keys, *values)
    return Segment.seal(keys, values, tokens, parent)


def extend(snapshot: Snapshot, tokens: Sequence[int], *, dtype: mx.Dtype = mx.float16) -> Snapshot:
    """The snapshot plus one new segment for `tokens` (a sealed turn)."""
    seg = fake_segment(tokens, snapshot.rows, snapshot.digest, dtype=dtype)
    return Snapshot((*snapshot.segments, seg))


def chain(*turns: Sequence[int], dtype: mx.Dtype = mx.float16) -> Snapshot:
    snap = Snapshot()
    for t in turns:
        snap = extend(snap, t, dtype=dtype)
    return snap


def merge_tail(snapshot: Snapshot, n: int) -> Snapshot:
    """Replace the last `n` segments by one (what tiered merging does)."""
    keep, run = snapshot.segments[:-n], snapshot.segments[-n:]
    start = sum(s.rows for s in keep)
    tokens = [t for s in run for t in s.tokens]
    dtype = run[0].keys[0].dtype
    return Snapshot((*keep, fake_segment(tokens, start, run[0].parent_digest, dtype=dtype)))


def assert_rows_match(snapshot: Snapshot, tokens: Sequence[int]) -> None:
    """The snapshot holds exactly the rows `tokens[:rows]` must have, bit for bit."""
    assert tuple(snapshot.tokens) == tuple(tokens[: snapshot.rows])
    pos = 0
    for seg in snapshot.segments:
        k, v = expected_rows(seg.tokens, pos, layers=seg.num_layers)
        for i in range(seg.num_layers):
            got_k = np.array(seg.keys[i].astype(mx.float32))
            got_v = np.array(seg.values[i].astype(mx.float32))
            assert np.array_equal(got_k, k[i]), f"K rows differ in layer {i} at {pos}"
            assert np.array_equal(got_v, v[i]), f"V rows differ in layer {i} at {pos}"
        pos += seg.rows


class _Checked:
    """Proxy that runs `check_invariants()` after every public call of the wrapped bank."""

    def __init__(self, bank: Bank) -> None:
        self._bank = bank

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._bank, name)
        if name.startswith("_") or name in ("close", "check_invariants") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            self._bank.check_invariants()
            return out

        return call


def checked(bank: Bank) -> Bank:
    """`bank`, with its invariants checked after every operation (tests)."""
    return cast("Bank", _Checked(bank))
