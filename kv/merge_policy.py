"""Tiered merging policy: which trailing segments to merge after a seal (pure numbers).

Owns: `plan_merge`. No MLX, no state: the caller passes the segments' tiers and row counts
(oldest first) and applies the plan, then asks again (merges cascade).

Size-tiered, as in LSM stores: a segment sealed from a tail is tier 0; `fanout` adjacent
segments of the same tier at the end of the list merge into one segment of the next tier.
So every row is copied at most once per tier (log_fanout of the number of seals), the list
holds at most fanout - 1 segments per tier, and a merge whose result would pass
`max_merge_rows` never happens: big old segments are never rewritten. Example, fanout 4,
12 turns of ~3,800 prompt + ~400 generated tokens (24 seals, ~50K tokens): one tier-2
segment of 16 seals plus two tier-1 segments of 4 seals each = 3 segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MergePlan:
    start: int  # merge segments [start, end) into one
    end: int
    rows: int
    level: int  # tier of the merged segment


def plan_merge(
    levels: Sequence[int],
    rows: Sequence[int],
    *,
    fanout: int = 4,
    max_merge_rows: int = 65536,
) -> MergePlan | None:
    """The trailing run of `fanout` same-tier segments to merge, or None."""
    if fanout < 2:
        raise ValueError("fanout must be >= 2")
    if len(levels) != len(rows):
        raise ValueError("levels and rows differ in length")
    if len(levels) < fanout:
        return None
    start = len(levels) - fanout
    tail_levels = set(levels[start:])
    if len(tail_levels) != 1:
        return None
    total = sum(rows[start:])
    if total > max_merge_rows:
        return None
    return MergePlan(start, len(levels), total, levels[-1] + 1)


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
    copied = 0
    for sealed in sealed_rows:
        if sealed <= 0:
            continue  # an empty tail seals nothing
        lv.append(0)
        rw.append(sealed)
        while (plan := plan_merge(lv, rw, fanout=fanout, max_merge_rows=max_merge_rows)) is not None:
            copied += plan.rows
            lv[plan.start :] = [plan.level]
            rw[plan.start :] = [plan.rows]
    return copied
