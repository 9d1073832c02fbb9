"""Batched segmented attention for one decode step of B sessions.

Owns: `BatchPlan` (what a decode step's attention looks like, built once per step on the
host and reused by every layer), `plan_batch`, `attend_batch`, `plain_lse` (the portable
per-piece attention with its log-sum-exp) and `batchable` (whether a batch's caches take
this path). Engine thread only.

Why: per-session attention costs each session its own launches, slices and host work per
layer (~240 us per session and layer on an H200 at B = 8), and sessions forked from one
history read that history's K/V once each. Here a layer's attention for the whole batch is

    shared part   for every group of sessions whose segment list is the same (a fork of
                  one banked history): ONE call whose queries are the group's sessions
                  stacked as query positions, [1, Hq, n, D], non-causal over the segments:
                  each K/V tile is read once for the group (the fused CUDA kernel packs
                  G x positions rows per block and LSE-merges its chunks; more pieces than
                  one launch takes are grouped and merged by LSE inside the route).
                  Sessions whose history is their own (groups of one, as unrelated users
                  are) go together through the route's `attend_owned` where it has one:
                  a launch per ~16 of their segments, each block reading its own
                  session's pieces, instead of a call per session.
    tail part     every session's tail, stacked [B, H_kv, T_pad, D] (views of the tail
                  buffers, padded to a common capacity; the previous step's stack itself
                  when the same sessions step again), one batched product with a length
                  mask from the step's int32 table (device memory, built once per step).
    merge         per session, the two parts by their LSEs, fused with the tail part
                  (`_tail_and_merge`, one compiled graph).

So a layer costs O(groups) attention launches plus a fixed handful of ops, not O(B);
per session only its row of the stack is recorded (host work, no kernel).

Invariants: equals per-session `route(q_i, segments_i, tail_i, causal=True)` for one query
row per session (float rounding); the new rows are written to each session's tail exactly
as `update_and_fetch` writes them; a session with no segments gets the tail part alone
(shared LSE = -inf, weight 0). Sliding-window layers and caches whose storage dtype differs
from the queries' are not batched (`batchable` says no; the caller falls back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import mlx.core as mx

from segserve.kernels.composed import KVPair
from segserve.kernels.fused_cuda import merge_by_lse
from segserve.kernels.thread_compile import compile_per_thread

# (queries [1, Hq, n, D], pieces) -> (out [1, Hq, n, D] float32, lse [1, Hq, n] float32),
# every piece visible to every query (natural-log LSE).
LseFn = Callable[[mx.array, Sequence[KVPair], float], tuple[mx.array, mx.array]]
# (queries [n, Hq, 1, D], each row's own pieces) -> (out [n, Hq, 1, D] float32, lse
# [n, Hq, 1] float32): row i over every piece of session i.
OwnedFn = Callable[[mx.array, Sequence[Sequence[KVPair]], float], tuple[mx.array, mx.array]]

TAIL_PAD = 64  # the stacked tails' rows are a multiple of this (= the tails' growth step)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One decode step's attention layout, the same for every layer.

    groups: per distinct segment list, the sessions (batch rows) that share it; groups
    of several sessions first, then the `singles` groups of one;
    order: int32 [B] (device), batch row -> its row in the groups' concatenated outputs
    (sessions without segments point past them, at a zero / -inf row);
    lengths: int32 [B, 1, 1, 1] (device), tail rows each session attends to, its new row
    included; tail_pad: the stacked tails' rows (every session's tail buffer is brought
    to exactly this many, so the stack is one concatenation of the buffers)."""

    groups: tuple[tuple[int, ...], ...]
    singles: int  # trailing groups of one session each
    order: mx.array
    lengths: mx.array
    tail_pad: int
    n_without: int  # sessions with no segments
    written: list[int]  # tail rows per session before this step's row (every layer)
    new_row: mx.array  # bool [B, 1, tail_pad, 1] (device): where this step's row goes


def _segment_key(cache: Any) -> tuple[int, ...]:
    # Forks of one history share its Segment objects (and so every layer's K/V arrays).
    return tuple(id(s) for s in cache.parent.base.segments)


def plan_batch(caches: Sequence[Any]) -> BatchPlan:
    """The plan for one step from the first layer's caches (every layer holds the same
    rows once a forward finishes: `segserve.kv.segmented`'s invariant)."""
    by_key: dict[tuple[int, ...], list[int]] = {}
    without: list[int] = []
    for i, cache in enumerate(caches):
        key = _segment_key(cache)
        if key and cache.parent.base.rows > 0:
            by_key.setdefault(key, []).append(i)
        else:
            without.append(i)
    shared = [tuple(rows) for rows in by_key.values() if len(rows) > 1]
    alone = [tuple(rows) for rows in by_key.values() if len(rows) == 1]
    groups = tuple(shared + alone)
    order = [0] * len(caches)
    pos = 0
    for rows in groups:
        for i in rows:
            order[i] = pos
            pos += 1
    for i in without:
        order[i] = pos  # one shared zero / -inf row after the groups' outputs
    before = [int(c.parent._written[c.layer]) for c in caches]
    pad = -(-(max(before) + 1) // TAIL_PAD) * TAIL_PAD
    prev = mx.array(before, dtype=mx.int32).reshape(-1, 1, 1, 1)
    return BatchPlan(
        groups=groups,
        singles=len(alone),
        order=mx.array(order, dtype=mx.int32),
        lengths=prev + 1,  # + this step's row
        tail_pad=pad,
        n_without=len(without),
        written=before,
        new_row=(mx.arange(pad, dtype=mx.int32).reshape(1, 1, pad, 1) == prev),
    )


def batchable(caches: Sequence[Any], query_dtype: mx.Dtype) -> bool:
    """Whether these layer caches take the batched path: segmented, global attention in
    every layer (the plan serves them all), tails stored in the queries' dtype."""
    for c in caches:
        parent = getattr(c, "parent", None)
        if parent is None or not hasattr(parent, "adopt_stack"):
            return False
        if any(w is not None for w in parent.windows):
            return False
        if parent.dtype is not None and parent.dtype != query_dtype:
            return False
    return True


def plain_lse(q: mx.array, pieces: Sequence[KVPair], scale: float) -> tuple[mx.array, mx.array]:
    """Attention of q [1, Hq, n, D] over every piece (all visible), out float32 and LSE;
    plain MLX ops (any backend): the reference and the CPU's shared part."""
    _, n_q, n, d = q.shape
    n_kv = pieces[0][0].shape[1]
    g = n_q // n_kv
    qg = (q.astype(mx.float32) * scale).reshape(1, n_kv, g * n, d)
    outs, lses = [], []
    for k, v in pieces:
        s = qg @ k.astype(mx.float32).swapaxes(-1, -2)  # s: [1, H_kv, G*n, S]
        m = s.max(axis=-1, keepdims=True)
        p = mx.exp(s - m)
        den = p.sum(axis=-1, keepdims=True)
        outs.append(((p @ v.astype(mx.float32)) / den).reshape(1, n_q, n, d))
        lses.append((m + mx.log(den)).reshape(1, n_q, n))
    if len(outs) == 1:
        return outs[0], lses[0]
    out = merge_by_lse(outs, lses)
    lse = mx.logsumexp(mx.stack(lses), axis=0)
    return out, lse


def _tail_part(q: mx.array, k: mx.array, v: mx.array, lengths: mx.array,
               scale: float) -> tuple[mx.array, mx.array]:
    """q [B, Hq, 1, D] over stacked tails k/v [B, H_kv, T, D], row j visible iff j < length."""
    b, n_q, _, d = q.shape
    n_kv, t = k.shape[1], k.shape[2]
    qg = (q * scale).reshape(b, n_kv, n_q // n_kv, d)  # qg: [B, H_kv, G, D]
    s = (qg @ k.swapaxes(-1, -2)).astype(mx.float32)  # s: [B, H_kv, G, T]
    # where, not an additive bias: rows past a tail's length may hold stale values.
    s = mx.where(mx.arange(t, dtype=mx.int32) < lengths, s, -mx.inf)
    m = s.max(axis=-1, keepdims=True)  # finite: every session sees its own new row
    p = mx.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    acc = (p.astype(v.dtype) @ v).astype(mx.float32) / den  # acc: [B, H_kv, G, D]
    return acc.reshape(b, n_q, 1, d), (m + mx.log(den)).reshape(b, n_q, 1)


@lru_cache(maxsize=16)
def _tail_compiled(scale: float) -> Callable[..., tuple[mx.array, mx.array]]:
    """`_tail_part` compiled for one scale (a constant of the graph): the elementwise ops
    of the mask and softmax fuse, and the host builds one node instead of ~10."""
    return compile_per_thread(partial(_tail_part, scale=scale))


def _kept_stack(caches: Sequence[Any], pad: int) -> tuple[mx.array, mx.array] | None:
    """The previous step's stacked tails when this step's sessions are that stack's rows
    in order, each tail still exactly its row (`SegmentedCache.kept_stack`), at this step's
    padding; else None."""
    first = caches[0].parent.kept_stack(caches[0].layer)
    if first is None:
        return None
    k_t, v_t, _ = first
    if k_t.shape[0] != len(caches) or k_t.shape[2] != pad:
        return None
    for i, cache in enumerate(caches):
        kept = cache.parent.kept_stack(cache.layer)
        if kept is None or kept[0] is not k_t or kept[2] != i:
            return None
    return k_t, v_t


def _restack(caches: Sequence[Any], pad: int, like: mx.array) -> tuple[mx.array, mx.array, list[int]]:
    """The step's stacked tails [B, H_kv, pad, D] and each session's written rows, when the
    previous stack cannot be taken whole (a session joined or left the batch, the order or
    the padding changed). Consecutive sessions that are consecutive rows of one earlier
    stack, their tails untouched since (`SegmentedCache.kept_stack`), come as ONE slice of
    it; other tails one by one (`padded_tail`). Why: a server's batch changes whenever a
    request arrives or ends, and re-stacking every tail costs the host a few slices per
    session and layer (the step's host work grew with B at each change); with runs a
    change costs a few slices per layer."""
    ks: list[mx.array] = []
    vs: list[mx.array] = []
    written: list[int] = []
    run: list[Any] | None = None  # [stack keys, stack values, first row, last row]

    def close_run() -> None:
        if run is not None:
            ks.append(_fit_rows(run[0][run[2] : run[3] + 1], pad))
            vs.append(_fit_rows(run[1][run[2] : run[3] + 1], pad))

    for cache in caches:
        held = cache.parent.kept_stack(cache.layer)
        if held is not None:
            k_s, v_s, row = held
            if run is not None and run[0] is k_s and run[3] + 1 == row:
                run[3] = row
            else:
                close_run()
                run = [k_s, v_s, row, row]
            written.append(int(cache.parent._written[cache.layer]))
            continue
        close_run()
        run = None
        k_i, v_i, prev = cache.parent.padded_tail(cache.layer, pad, like)
        ks.append(k_i)
        vs.append(v_i)
        written.append(prev)
    close_run()
    if len(ks) == 1:
        return ks[0], vs[0], written
    return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0), written


def _fit_rows(stack: mx.array, pad: int) -> mx.array:
    """`stack` [n, H_kv, cap, D] at exactly `pad` rows: a view of the first `pad`, or zero
    rows appended (rows past a session's length are masked, whatever they hold)."""
    cap = stack.shape[2]
    if cap == pad:
        return stack
    if cap > pad:
        return stack[:, :, :pad, :]
    n, h, _, d = stack.shape
    return mx.concatenate([stack, mx.zeros((n, h, pad - cap, d), stack.dtype)], axis=2)


def _tail_and_merge(q: mx.array, k: mx.array, v: mx.array, lengths: mx.array, seg_out: mx.array,
                    seg_lse: mx.array, scale: float) -> mx.array:
    """The tail part (`_tail_part`) merged with the shared part's output and LSE by their
    weights, in the query dtype: [B, Hq, 1, D]. Two parts, so no stacking: every op is
    elementwise after the tail's reductions, which `mx.compile` fuses."""
    tail_out, tail_lse = _tail_part(q, k, v, lengths, scale)
    top = mx.maximum(seg_lse, tail_lse)
    top = mx.where(top == -mx.inf, 0.0, top)  # the tail always has its new row: finite
    w_seg = mx.exp(seg_lse - top)[..., None]
    w_tail = mx.exp(tail_lse - top)[..., None]
    return ((w_seg * seg_out + w_tail * tail_out) / (w_seg + w_tail)).astype(q.dtype)


@lru_cache(maxsize=16)
def _merged_compiled(scale: float) -> Callable[..., mx.array]:
    """`_tail_and_merge` compiled for one scale: per layer the host builds one node for
    the tail and the merge, and the device runs a few kernels instead of ~25."""
    return compile_per_thread(partial(_tail_and_merge, scale=scale))


def attend_batch(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    caches: Sequence[Any],
    plan: BatchPlan,
    scale: float,
    shared: LseFn,
    owned: OwnedFn | None = None,
) -> mx.array:
    """Write each session's new K/V row and attend: q [B, Hq, 1, D], keys/values
    [B, H_kv, 1, D] -> [B, Hq, 1, D] in the query dtype. `shared` serves the segments
    (the fused CUDA route's `attend_lse`, or `plain_lse`); `owned`, where given, the
    sessions whose history no other session of the step shares, together (the route's
    `attend_owned`)."""
    b = q.shape[0]
    # The tails are stacked, the new rows written into the stack by one select, and each
    # session keeps its row of the stack (`adopt_stack`: no view is made unless it reads
    # its tail alone): a constant number of ops per layer. Per-session writes cost the
    # host ~25 us per session and layer (two slice_updates and their slices), which
    # dominated a step at B >= 32. The next step
    # of the same sessions takes the stack back (`_kept_stack`) instead of concatenating
    # the views again: a concatenation is one copy per session on the GPU (measured on an
    # H100 at 32 x 2K: 8 ms of a 21 ms step went to the tail part).
    kept = _kept_stack(caches, plan.tail_pad)
    if kept is not None:
        k_t, v_t = kept
        written = [int(c.parent._written[c.layer]) for c in caches]
    else:
        k_t, v_t, written = _restack(caches, plan.tail_pad, keys[:1])
    if written != plan.written:
        raise AssertionError(f"tail rows {written} differ from the step's plan {plan.written}")
    k_t = mx.where(plan.new_row, keys, k_t)  # keys [B, H_kv, 1, D] into row `written`
    v_t = mx.where(plan.new_row, values, v_t)
    for i, (cache, prev) in enumerate(zip(caches, written, strict=True)):
        cache.parent.adopt_stack(cache.layer, k_t, v_t, i, prev + 1)
    if not plan.groups:
        tail_out, _ = _tail_compiled(float(scale))(q, k_t, v_t, plan.lengths)
        return tail_out.astype(q.dtype)
    outs, lses = [], []
    together = plan.singles if owned is not None and plan.singles > 1 else 0
    for rows in plan.groups[: len(plan.groups) - together]:
        segs = caches[rows[0]].segment_kv()
        idx = mx.array(rows, dtype=mx.int32) if len(rows) < b else None
        qs = q if idx is None else q[idx]
        # The group's sessions as query positions of one call: [1, Hq, n, D].
        o, lse = shared(qs.transpose(2, 1, 0, 3), segs, scale)
        outs.append(o.transpose(2, 1, 0, 3))  # [n, Hq, 1, D]
        lses.append(lse.transpose(2, 1, 0))  # [n, Hq, 1]
    if together:
        alone = [g[0] for g in plan.groups[len(plan.groups) - together :]]
        qs = q if alone == list(range(b)) else q[mx.array(alone, dtype=mx.int32)]
        assert owned is not None
        o, lse = owned(qs, [caches[i].segment_kv() for i in alone], scale)
        outs.append(o)  # [n, Hq, 1, D]: already one row per session
        lses.append(lse)
    if plan.n_without:
        outs.append(mx.zeros((1, *q.shape[1:]), mx.float32))
        lses.append(mx.full((1, q.shape[1], 1), -mx.inf, mx.float32))
    seg_out = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    seg_lse = mx.concatenate(lses, axis=0) if len(lses) > 1 else lses[0]
    if len(plan.groups) > 1 or plan.n_without or any(rows != tuple(range(b)) for rows in plan.groups):
        seg_out, seg_lse = seg_out[plan.order], seg_lse[plan.order]
    return _merged_compiled(float(scale))(q, k_t, v_t, plan.lengths, seg_out, seg_lse)
