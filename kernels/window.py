"""Sliding-window attention over segments: which keys a windowed query may see.

Owns: `WindowView` (the pieces a windowed call reads, as views), `clip_to_window`,
`clip_segments`, and
`visibility_bias` (the additive mask of one block of keys, in absolute positions). Every
route (`segserve.kernels.composed`, `segserve.kernels.fused_cpu`, `segserve.kernels.fused_cuda`) takes its window
through these, so the rule is written once.

The rule is mlx-lm 0.32.2's (`RotatingKVCache` with max_size W, `create_causal_mask(...,
window_size=W)`): the query at absolute position p sees the keys at positions (p - W, p],
its own key included, so W keys once p >= W - 1. Queries are the last L positions of the
history (bottom-right aligned): p_i = total - L + i.

Invariants:
- A segment wholly before the first query's window is not read at all; the piece that
  straddles the window's start is sliced (a view: no K/V is copied here); everything else
  is passed as it is. The cache keeps every segment, so forks and rewinds still share them.
- Keys from `WindowView.full` on are inside every query's window; keys in
  [`first`, `full`) are inside some queries' windows only, so a call with L > 1 whose view
  has `first < full` needs a per-query mask (`masked`). A decode step (L == 1) never does:
  its window is a contiguous range of keys and the slicing is the whole mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

KVPair = tuple[mx.array, mx.array]  # (k, v), each [B, H_kv, S, D]

# Additive bias for a hidden key; the same finite value as segserve.kernels.composed uses (a row
# whose piece is wholly hidden gets weight exp(-1e30 - M) == 0 in the merge, never NaN).
HIDDEN = -1e30


@dataclass(frozen=True, slots=True)
class WindowView:
    """The pieces a windowed call reads, each a view of the cache's rows."""

    segments: tuple[KVPair, ...]
    tail: KVPair | None
    first: int  # absolute position of the first key kept
    full: int  # keys at positions >= full are inside every query's window
    total: int  # keys in the history (segments + tail), before clipping

    @property
    def masked(self) -> bool:
        """Some kept key is hidden from some query (needs a per-query bias)."""
        return self.first < self.full


def _rows(kv: KVPair) -> int:
    return int(kv[0].shape[2])


def _from(kv: KVPair, start: int) -> KVPair:
    return (kv[0][:, :, start:, :], kv[1][:, :, start:, :]) if start > 0 else kv


def clip_to_window(
    segments: Sequence[KVPair], tail: KVPair | None, n_queries: int, window: int
) -> WindowView:
    """Drop the pieces no query's window reaches, slice the one that straddles the start."""
    if window < 1:
        raise ValueError(f"sliding window must be at least 1 key, got {window}")
    seg_rows = sum(_rows(kv) for kv in segments)
    total = seg_rows + (_rows(tail) if tail is not None else 0)
    first = max(0, total - n_queries - window + 1)  # the first query's lowest visible key
    full = max(first, total - window)  # the last query's lowest visible key
    clipped_tail = None
    if tail is not None:
        clipped_tail = _from(tail, max(0, first - seg_rows))
    return WindowView(clip_segments(segments, first), clipped_tail, first, full, total)


def clip_segments(segments: Sequence[KVPair], first: int) -> tuple[KVPair, ...]:
    """The segments' keys from absolute position `first` on: earlier segments dropped, the
    one holding `first` sliced from it (a view), empty ones dropped."""
    kept: list[KVPair] = []
    pos = 0
    for kv in segments:
        rows = _rows(kv)
        if pos + rows > first and rows > 0:
            kept.append(_from(kv, max(0, first - pos)))
        pos += rows
    return tuple(kept)


def visibility_bias(
    n_groups: int,
    n_queries: int,
    first_query: int,
    start: int,
    stop: int,
    *,
    causal: bool,
    window: int | None,
) -> mx.array | None:
    """Bias rows [G*L] (ordered (g, l)) x key columns [start, stop) in absolute positions,
    or None when every query sees every key of the block. Query l sits at position
    first_query + l; it sees key j iff (not causal or j <= p) and (no window or j > p - W)."""
    last_query = first_query + n_queries - 1
    hides_causal = causal and stop - 1 > first_query
    hides_window = window is not None and start <= last_query - window
    if not (hides_causal or hides_window):
        return None
    pos = mx.arange(first_query, last_query + 1)[:, None]  # pos: [L, 1]
    cols = mx.arange(start, stop)[None, :]  # cols: [1, stop - start]
    seen = mx.ones((n_queries, stop - start), dtype=mx.bool_)
    if causal:
        seen = seen & (cols <= pos)
    if window is not None:
        seen = seen & (cols > pos - window)
    bias = mx.where(seen, 0.0, HIDDEN).astype(mx.float32)  # bias: [L, stop - start]
    width = stop - start
    return mx.broadcast_to(bias[None], (n_groups, n_queries, width)).reshape(-1, width)
