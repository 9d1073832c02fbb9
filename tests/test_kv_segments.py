"""kv/: segments, snapshots, the segmented cache, the merge policy, the cache contract."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from segserve.kv.merge_policy import (
    MAX_SEGMENTS,
    plan_merge,
    rows_copied_by_seals,
    seal_onto,
    size_tier,
)
from segserve.kv.protocol import LayerCache
from segserve.kv.segment import ROOT_DIGEST, Segment, Snapshot, chain_digest
from segserve.kv.segmented import SegmentedCache, SegmentedLayerCache
from segserve.kv.stock import StockCache


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
    c = SegmentedCache(1, max_merge_rows=1000, fanout=4)
    start = 0
    for n in (40, 5, 5, 7):  # four tier-0 seals -> one tier-1 segment
        _write(c, list(range(start, start + n)))
        start += n
        snap = c.seal()
    assert c.merges == 1
    assert snap.tokens == tuple(range(57))
    assert [(s.rows, s.level) for s in snap.segments] == [(57, 1)]
    assert snap.segments[0].parent_digest == ROOT_DIGEST


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
def _replay(seals: list[int], fanout: int = 4, max_rows: int = 65536) -> tuple[list[tuple[int, int]], int]:
    """Apply the policy to a sequence of seals; returns [(rows, level)] and rows copied."""
    levels: list[int] = []
    rows: list[int] = []
    plan = functools.partial(plan_merge, fanout=fanout, max_merge_rows=max_rows)
    copied = 0
    for n in seals:
        copied += sum(p.rows for p in seal_onto(levels, rows, n, plan))
    return list(zip(rows, levels, strict=True)), copied


def test_plan_merge_basic() -> None:
    assert plan_merge([], []) is None
    assert plan_merge([0, 0, 0], [5, 5, 5]) is None  # fewer than fanout
    assert plan_merge([1, 0, 0, 0], [50, 5, 5, 5]) is None  # mixed tiers
    p = plan_merge([1, 0, 0, 0, 0], [50, 5, 6, 7, 8])
    assert p is not None and (p.start, p.end, p.rows, p.level) == (1, 5, 26, 1)


def test_plan_merge_never_rewrites_big_segments() -> None:
    assert plan_merge([0, 0, 0, 0], [20000, 20000, 20000, 20000], max_merge_rows=65536) is None
    p = plan_merge([2, 0, 0, 0, 0], [70000, 10, 10, 10, 10], max_merge_rows=65536)
    assert p is not None and p.start == 1  # the big tier-2 segment is left alone


def test_twelve_turns_at_50k_stay_within_3_to_5_segments() -> None:
    segs, copied = _replay([3800, 400] * 12)
    assert sum(r for r, _ in segs) == 12 * 4200
    assert 3 <= len(segs) <= 5
    assert copied <= 2 * 12 * 4200  # each row copied at most once per tier (2 tiers here)


def test_small_turns_copy_each_row_a_bounded_number_of_times() -> None:
    seals = [500, 48] * 40  # 40 short turns
    segs, copied = _replay(seals)
    total = sum(seals)
    assert sum(r for r, _ in segs) == total
    assert copied <= 3 * total  # log4(80 seals) ~ 3 tiers: each row copied <= 3 times
    assert len(segs) <= 3 * 4  # at most fanout - 1 per tier


def test_a_long_first_prompt_is_not_copied_by_the_turns_after_it() -> None:
    # An 8K document, then short turns: the turns merge among themselves; the document's
    # 7,616 rows are copied only once the turns after it add up to its tier.
    seals = [7616, 64] + [512, 64] * 3
    segs, copied = _replay(seals)
    assert segs[0] == (7616, 0) and copied <= sum(seals[1:])
    # Turns of ~600 rows reach the document's tier (4,096+ rows) after ~8 turns; by then
    # it is rewritten at most once.
    segs, copied = _replay([7616, 64] + [512, 64] * 40)
    assert copied <= 7616 + 3 * 40 * 576


def test_alternating_sizes_stay_bounded() -> None:
    # Seals of two size tiers in turn (2,000-row prompts, 100-row answers) never form a
    # run of one tier: the run counts the tier-1 ones and takes the answers along.
    seals = [2000, 100] * 60
    segs, copied = _replay(seals)
    assert sum(r for r, _ in segs) == sum(seals)
    assert len(segs) <= 8 and copied <= 4 * sum(seals)


@pytest.mark.parametrize("seed", range(5))
def test_random_seals_keep_the_list_short_and_copies_bounded(seed: int) -> None:
    rng = random.Random(seed)
    seals = [rng.choice([1, 8, 64, 300, 900, 2500, 6000]) for _ in range(300)]
    total = sum(seals)
    longest = max(len(_replay(seals[:k], max_rows=10**9)[0]) for k in range(1, len(seals) + 1, 3))
    segs, copied = _replay(seals, max_rows=10**9)
    assert sum(r for r, _ in segs) == total
    assert longest <= MAX_SEGMENTS  # the count rule takes the stranded segments
    assert copied <= (size_tier(total) + 1) * total  # each row at most once per tier


def test_the_cache_merges_what_admission_prices() -> None:
    # Admission prices a turn's merges with rows_copied_by_seals (the same policy, replayed
    # on numbers); the cache must copy exactly those rows, turn after turn, count rule
    # included (30 turns of mixed sizes strand segments behind bigger ones).
    rng = random.Random(7)  # the count rule fires in these turns (19 segments without it)
    c = SegmentedCache(1)
    start = 0
    for _ in range(30):
        turn = [rng.choice([1, 8, 64, 300, 900, 2500, 6000]) for _ in range(2)]  # prompt, reply
        segs = c.base.segments
        want = rows_copied_by_seals([s.level for s in segs], [s.rows for s in segs], turn)
        before = c.merged_rows
        for n in turn:
            _write(c, list(range(start, start + n)))
            start += n
            c.seal()
        assert c.merged_rows - before == want
        assert c.base.tokens == tuple(range(start))
        assert len(c.base.segments) <= MAX_SEGMENTS


def test_the_count_rule_runs_when_the_tier_rule_is_too_big() -> None:
    # Four 20,000-row segments (tier 3) qualify but would pass max_merge_rows; after them
    # tiers 2, 1, 0 in turn never gather four of one tier. 13 segments is over
    # MAX_SEGMENTS, so the count rule merges the nine small trailing ones instead.
    rows = [20000] * 4 + [5000, 2000, 100] * 3
    levels = [0] * len(rows)
    assert plan_merge(levels, rows, max_segments=100) is None
    p = plan_merge(levels, rows)
    assert p is not None and (p.start, p.end, p.rows) == (4, 13, 21300)


def test_size_tier() -> None:
    assert [size_tier(r) for r in (1, 1023, 1024, 4095, 4096, 16384, 65536)] == [0, 0, 1, 1, 2, 3, 4]


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


def test_prompt_reserve_does_not_size_the_decode_tail() -> None:
    from segserve.kv.segmented import TAIL_STEP

    c = SegmentedCache(1)
    c.reserve(512)  # the known prompt
    _write(c, [1, 2, 3])
    c.seal()
    _write(c, [4])  # first decode row: a fresh tail of one step, not 512 rows
    assert c.tail_nbytes() == 2 * (2 * TAIL_STEP * 8 * 4)
