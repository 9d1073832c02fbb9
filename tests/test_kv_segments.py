"""kv/: segments, snapshots, the segmented cache, the merge policy, the cache contract."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kv.merge_policy import plan_merge
from kv.protocol import LayerCache
from kv.segment import ROOT_DIGEST, Segment, Snapshot, chain_digest
from kv.segmented import SegmentedCache, SegmentedLayerCache
from kv.stock import StockCache


def _rows(n: int, heads: int = 2, dim: int = 8, fill: float | None = None) -> mx.array:
    if fill is not None:
        return mx.full((1, heads, n, dim), fill)
    return mx.random.normal((1, heads, n, dim))


def _write(cache: SegmentedCache | StockCache, tokens: list[int]) -> None:
    for layer in cache.layers:
        k = _rows(len(tokens))
        layer.update_and_fetch(k, k * 2)
    cache.record_tokens(tokens)


# ---- segment / snapshot ------------------------------------------------------------------
def test_seal_digest_and_bytes(fake_segment: Callable[..., Segment]) -> None:
    seg = fake_segment(5)
    assert seg.rows == 5
    assert seg.digest == chain_digest(ROOT_DIGEST, range(5))
    assert seg.nbytes == 2 * 2 * (2 * 5 * 8 * 4)


def test_prefix_is_a_view_and_snapshot_prefix(fake_segment: Callable[..., Segment]) -> None:
    a = fake_segment(4)
    b = fake_segment(3, parent=a.digest, start=4)
    snap = Snapshot((a, b))
    p = snap.prefix(5)
    assert p.tokens == (0, 1, 2, 3, 4)
    assert p.segments[0] is a  # whole segment: the same object, no copy
    assert p.segments[1].owner is b and p.segments[1].nbytes == 0
    assert mx.array_equal(p.segments[1].keys[0], b.keys[0][:, :, :1, :]).item()
    assert snap.prefix(0).rows == 0
    with pytest.raises(ValueError):
        snap.prefix(8)


def test_seal_rejects_rows_tokens_mismatch() -> None:
    with pytest.raises(ValueError):
        Segment.seal([_rows(3)], [_rows(3)], [1, 2], ROOT_DIGEST)


# ---- segmented cache -----------------------------------------------------------------------
def test_tail_rows_and_offsets() -> None:
    c = SegmentedCache(2)
    _write(c, [1, 2, 3])
    assert c.offset == 3 and c.layers[0].offset == 3
    snap = c.seal()
    assert snap.rows == 3 and snap.tokens == (1, 2, 3)
    assert c.tail_nbytes() == 0
    _write(c, [4])
    assert c.offset == 4 and c.tokens == (1, 2, 3, 4)
    k, _ = c.layers[0].update_and_fetch(_rows(2), _rows(2))
    assert k.shape[2] == 3  # the tail rows only: segments are read by the attention hook


def test_fork_copies_nothing_and_parent_stays_intact() -> None:
    parent = SegmentedCache(2)
    _write(parent, list(range(10)))
    snap = parent.seal()
    before = [mx.array(k) for k in snap.segments[0].keys]
    ids = [id(k) for k in snap.segments[0].keys]
    fork = SegmentedCache(2, snap)
    assert fork.base is snap
    assert fork.nbytes == snap.nbytes  # nothing allocated by forking
    _write(fork, [99, 98])
    assert fork.tail_nbytes() > 0
    fsnap = fork.seal()
    assert fsnap.segments[0] is snap.segments[0]
    assert [id(k) for k in snap.segments[0].keys] == ids
    for b, k in zip(before, snap.segments[0].keys, strict=True):
        assert mx.array_equal(b, k).item()
    assert snap.rows == 10 and fsnap.rows == 12


def test_rollback_is_an_older_snapshot() -> None:
    c = SegmentedCache(2)
    _write(c, [1, 2])
    turn1 = c.seal()
    _write(c, [3, 4])
    c.seal()
    back = SegmentedCache(2, turn1)
    assert back.offset == 2 and back.tokens == (1, 2)


def test_seal_exact_copy_when_capacity_is_mostly_spare() -> None:
    c = SegmentedCache(1)
    c.reserve(512)
    _write(c, [1, 2, 3])
    seg = c.seal().segments[-1]
    assert seg.keys[0].shape[2] == 3
    assert seg.nbytes == 2 * (2 * 3 * 8 * 4)


def test_drop_tail_keeps_base() -> None:
    c = SegmentedCache(2)
    _write(c, [1, 2])
    base = c.seal()
    _write(c, [3])
    c.drop_tail()
    assert c.offset == 2 and c.base is base


def test_merge_runs_and_preserves_rows() -> None:
    c = SegmentedCache(1, max_merge_rows=100, fanout=4)
    _write(c, list(range(40)))
    c.seal()
    _write(c, list(range(40, 45)))
    c.seal()
    _write(c, list(range(45, 50)))
    snap = c.seal()
    assert c.merges >= 1
    assert snap.tokens == tuple(range(50))
    assert [s.rows for s in snap.segments] == [50] or len(snap.segments) <= 2


def test_make_mask() -> None:
    c = SegmentedCache(1)
    assert c.layers[0].make_mask(1) is None
    assert c.layers[0].make_mask(4) == "causal"
    with pytest.raises(NotImplementedError):
        c.layers[0].make_mask(4, window_size=16)


def test_trim_tail_only() -> None:
    c = SegmentedCache(1)
    _write(c, [1, 2])
    c.seal()
    _write(c, [3, 4, 5])
    assert c.layers[0].trim(10) == 3
    assert c.offset == 2


# ---- merge policy (numbers only) ------------------------------------------------------------
def test_plan_merge_basic() -> None:
    assert plan_merge([]) is None
    assert plan_merge([100]) is None
    assert plan_merge([1000, 10]) is None  # older >= 4x newer: in shape
    p = plan_merge([1000, 10, 10])
    assert p is not None and (p.start, p.end, p.rows) == (1, 3, 20)


def test_plan_merge_never_rewrites_big_segments() -> None:
    p = plan_merge([20000, 3000, 3000], max_merge_rows=16384)
    assert p is not None and p.start == 1  # the 20000-row segment is left alone
    assert plan_merge([16000, 16000]) is None


def test_twelve_turns_at_50k_stay_within_3_to_5_segments() -> None:
    sizes: list[int] = []
    for _ in range(12):
        for rows in (3800, 400):
            sizes.append(rows)
            plan = plan_merge(sizes)
            if plan:
                sizes = sizes[: plan.start] + [plan.rows]
    assert sum(sizes) == 12 * 4200
    assert 3 <= len(sizes) <= 5
    assert max(sizes) <= 16384


# ---- the cache contract: every implementation, and mlx-lm's own KVCache -------------------
def _segmented_layer() -> Any:
    return SegmentedCache(1).layers[0]


def _stock_layer() -> Any:
    return StockCache(1).layers[0]


@pytest.mark.parametrize("factory", [_segmented_layer, _stock_layer, KVCache], ids=["segmented", "stock", "mlx_lm"])
def test_layer_cache_contract(factory: Callable[[], Any]) -> None:
    cache = factory()
    assert isinstance(cache, LayerCache)
    assert cache.offset == 0 and cache.empty()
    k, v = cache.update_and_fetch(_rows(3, fill=1.0), _rows(3, fill=2.0))
    assert cache.offset == 3 and not cache.empty()
    assert k.shape == (1, 2, 3, 8) and v.shape == (1, 2, 3, 8)
    assert mx.array_equal(v, _rows(3, fill=2.0)).item()
    k, v = cache.update_and_fetch(_rows(1, fill=3.0), _rows(1, fill=4.0))
    assert cache.offset == 4
    assert mx.array_equal(k[:, :, -1:, :], _rows(1, fill=3.0)).item()
    # mlx-lm models call make_mask(N, return_array=..., window_size=...) by keyword.
    assert cache.make_mask(1, return_array=False, window_size=None) is None
    assert cache.is_trimmable()
    assert cache.trim(1) == 1 and cache.offset == 3
    assert cache.nbytes > 0
    assert cache.state is not None


def test_segmented_layer_is_the_hook_type() -> None:
    assert isinstance(SegmentedCache(1).layers[0], SegmentedLayerCache)
