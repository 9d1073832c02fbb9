"""Tiered merging policy: which trailing segments to merge after a seal (pure numbers).

Owns: `plan_merge`. No MLX, no state: the caller passes segment row counts (oldest first)
and applies the plan.

Rule: merge the last two segments while the older one is less than `fanout` times the
newer one AND the result stays within `max_merge_rows`. Sizes therefore decrease
geometrically towards the tail (so the list is about log_fanout(history/turn) long), and a
segment larger than `max_merge_rows` is never rewritten: the big old history is copied at
most a bounded number of times, and never once it is big.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MergePlan:
    start: int  # merge segments [start, end) into one
    end: int
    rows: int


def plan_merge(
    rows: Sequence[int], *, fanout: int = 4, max_merge_rows: int = 16384
) -> MergePlan | None:
    """The trailing run to merge, or None when the list is already in shape."""
    if fanout < 2:
        raise ValueError("fanout must be >= 2")
    sizes = list(rows)
    start = len(sizes)
    merged = 0
    while start >= 2:
        newer = merged if merged else sizes[start - 1]
        older = sizes[start - 2]
        if older >= fanout * newer or older + newer > max_merge_rows:
            break
        merged = older + newer
        start -= 1
    if merged == 0:
        return None
    return MergePlan(start - 1, len(sizes), merged)
