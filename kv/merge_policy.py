"""Tiered merging policy: which trailing segments to merge after a seal (pure numbers).

Owns: `plan_merge`. No MLX, no state: the caller passes the segments' tiers and row counts
(oldest first) and applies the plan, then asks again (merges cascade).

Size-tiered, as in LSM stores. A segment's tier is the larger of its recorded level (how
many merges made it) and its size tier (`size_tier`: 0 below `unit_rows * fanout` rows,
one more per factor of `fanout`). A merge happens at the smallest tier T whose trailing
run (the segments after the last one of a higher tier) holds `fanout` segments of tier T:
the run becomes one segment of tier T + 1 or its own size tier. So:
- a tier-rule merge copies a row at most once per tier (its tier grows each time);
- the list holds at most fanout - 1 segments of each tier after its last higher one;
- a big segment is never rewritten to absorb small ones: a long first prompt (say 7,600
  rows, tier 2) stays as it is while the turns after it merge among themselves, until
  they add up to its tier. A policy counting seals only made it tier 0, and the fourth
  seal of the conversation copied it whole (1 GiB for an 8B model at 8K, the follow-up
  turn's peak in bench/results/gpu_peak_breakdown_h200.json);
- a merge whose result would pass `max_merge_rows` never happens.
Smaller segments sealed just before a bigger one are stranded: no trailing run reaches
them without the bigger one. When the list passes `max_segments`, the count rule merges
the smallest tier's trailing run of `fanout` segments of any tier, stranded ones
included, keeping the run's highest tier (promoting there, as the tier rule does,
inflated the tiers until four segments of one tier passed `max_merge_rows` and merging
stopped).
Trailing runs only: a segment's digest chains its parent's (`segserve.kv.segment.chain_digest`),
so merging in the middle would orphan the segments after.
Replayed on numbers (`python bench/merge_replay.py`, bench/results/merge_replay.json),
against the seal-counting rule: a document then 60 short turns, 10 segments either way,
the document first copied at seal 48 instead of seal 3; an agent loop (800 seals) and a
chat (400 seals) at most 12 segments (seal counting: 14), ~4 and ~3 copies per row
either way; 300 random seals of 1-6,000 rows (~90K rows: once segments reach ~16K rows,
four of them pass the 65,536-row `max_merge_rows` and stay apart) 20-24 segments (seal
counting 20-23) and 1.8-2.1 copies per row (1.9-2.1). Example, fanout 4, 12 turns of ~3,800 prompt + ~400 generated tokens (24
seals, ~50K tokens): 3-5 segments (tests/test_kv_segments.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

# Rows of the size-tier unit: segments under unit * fanout rows (1,024 at fanout 4) are
# tier 0 whatever their history, so merging fanout of them copies at most ~4K rows.
TIER_UNIT_ROWS = 256
# Segments a list keeps at most before stranded ones are merged (the count rule): under
# the fused CUDA kernel's 16 segments per launch (segserve.kernels.fused_cuda_source.MAX_PIECES).
MAX_SEGMENTS = 12


@dataclass(frozen=True, slots=True)
class MergePlan:
    start: int  # merge segments [start, end) into one
    end: int
    rows: int
    level: int  # tier of the merged segment


def size_tier(rows: int, fanout: int = 4, unit_rows: int = TIER_UNIT_ROWS) -> int:
    """0 below unit_rows * fanout rows, then one more per factor of fanout."""
    tier, bound = 0, unit_rows * fanout
    while rows >= bound:
        tier += 1
        bound *= fanout
    return tier


def _trailing_run(tiers: Sequence[int], tier: int) -> int:
    """Start of the run after the last segment of a tier above `tier`."""
    start = len(tiers)
    while start and tiers[start - 1] <= tier:
        start -= 1
    return start


def plan_merge(
    levels: Sequence[int],
    rows: Sequence[int],
    *,
    fanout: int = 4,
    max_merge_rows: int = 65536,
    unit_rows: int = TIER_UNIT_ROWS,
    max_segments: int = MAX_SEGMENTS,
) -> MergePlan | None:
    """The trailing run to merge (see the module docstring), or None."""
    if fanout < 2:
        raise ValueError("fanout must be >= 2")
    if len(levels) != len(rows):
        raise ValueError("levels and rows differ in length")
    tiers = [max(lv, size_tier(r, fanout, unit_rows)) for lv, r in zip(levels, rows, strict=True)]
    by_tier = sorted(set(tiers))
    # The tier rule, then the count rule (stranded segments): the smallest tier either way.
    for counts_all in (False, True):
        if counts_all and len(tiers) <= max_segments:
            break
        for tier in by_tier:
            start = _trailing_run(tiers, tier)
            run = tiers[start:]
            if (len(run) if counts_all else run.count(tier)) < fanout:
                continue
            total = sum(rows[start:])
            if total > max_merge_rows:
                break  # a run at a higher tier is longer still (the count rule may fit)
            # The tier rule promotes (each row copied once per tier); the count rule keeps
            # the run's highest tier, so absorbing stranded segments inflates no tier.
            level = max(run) if counts_all else tier + 1
            return MergePlan(start, len(tiers), total, max(level, size_tier(total, fanout, unit_rows)))
    return None


def seal_onto(
    levels: list[int],
    rows: list[int],
    sealed: int,
    plan: Callable[[Sequence[int], Sequence[int]], MergePlan | None] = plan_merge,
) -> list[MergePlan]:
    """Seal a segment of `sealed` rows onto the list (tier 0, last) and apply merges until
    none applies, cascades included, as `segserve.kv.segmented.SegmentedCache.seal` does with real
    segments: `levels` and `rows` are updated in place. Returns the merges, in order.
    `plan`: the policy (`plan_merge` with its defaults unless given)."""
    levels.append(0)
    rows.append(sealed)
    applied: list[MergePlan] = []
    while (p := plan(levels, rows)) is not None:
        applied.append(p)
        levels[p.start : p.end] = [p.level]
        rows[p.start : p.end] = [p.rows]
    return applied


def rows_copied_by_seals(
    levels: Sequence[int],
    rows: Sequence[int],
    sealed_rows: Sequence[int],
    *,
    fanout: int = 4,
    max_merge_rows: int = 65536,
) -> int:
    """Rows the merges copy when segments of `sealed_rows` (in order) are sealed onto this
    list, cascades included. Admission prices a turn's merges with it: a merge allocates
    the merged segment while its parts stay referenced by older snapshots."""
    lv, rw = list(levels), list(rows)
    plan = partial(plan_merge, fanout=fanout, max_merge_rows=max_merge_rows)
    copied = 0
    for sealed in sealed_rows:
        if sealed > 0:  # an empty tail seals nothing
            copied += sum(p.rows for p in seal_onto(lv, rw, sealed, plan))
    return copied
