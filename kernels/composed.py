"""Composed reference route: attention over a list of KV segments plus a tail.

Owns: `attend_segments`, the portable (any MLX backend) way to attend over segmented KV
memory. It reads every piece where it lies and merges the per-piece results by
log-sum-exp; it never gathers the history into one buffer (a test patches
`mx.concatenate` in this module to raise, and checks peak memory).

Math, per query row and piece p with keys K_p, values V_p (s = scale * q.K_p^T):
    m_p = max(s)    denom_p = sum(exp(s - m_p))    acc_p = exp(s - m_p) @ V_p
    lse_p = m_p + log(denom_p)                     (the piece's log-sum-exp)
    out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) denom_p,   M = max_p m_p
which equals softmax over the concatenated keys (it is the LSE merge with the log folded
away). The LSE lives only inside this module, factored as (m_p, denom_p), each
[B, H_kv, G*L, 1] float32, stacked to [n, ...] for the merge; callers get the output.

Prefill windows over long histories (many query rows) walk the keys in tiles instead
(`_attend_tiled`): the same partials per tile, merged online into a running (max, sum,
accumulator), evaluated tile by tile, so one call never holds more than `scratch_bytes`
whatever the history length. Short windows (decode, verify) take the one-graph route above,
whose scores for every piece fit that same bound.

Invariants:
- Segment rows are visible to every query; tail row j is visible to query row i iff
  not causal or j <= T - L + i (bottom-right aligned, as SDPA's mask="causal").
- Per-piece outputs and LSEs are float32; the result is rounded once, to the query dtype.
- A row that sees no key at all comes out as zeros, never NaN.
- Exactly one non-empty piece: stock `mx.fast.scaled_dot_product_attention` on it, as is.
- GQA without repeating K/V: query head h reads KV head h // G (MLX's convention), so
  queries [B, Hq, L, D] reshape to [B, H_kv, G*L, D] with rows ordered (g, l); only the
  (small) queries may be copied by that reshape, never K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial

import mlx.core as mx

from segserve.kernels.thread_compile import compile_per_thread
from segserve.kernels.window import clip_to_window, visibility_bias

KVPair = tuple[mx.array, mx.array]  # (k, v), each [B, H_kv, S, D]

# Head sizes segment attention serves (every route, the hook's support check): one place.
SUPPORTED_HEAD_DIMS = (64, 128, 256)

# Keys a query must not see (causal tail, window start) get the additive bias
# `segserve.kernels.window.HIDDEN`, finite (not -inf) so that a row that sees no key of a piece gets
# a huge negative LSE, hence weight exp(-1e30 - LSE) == 0 in the merge, instead of
# exp(-inf - -inf) == NaN inside the piece.

_LOG2E = 1.4426950408889634


def _exp_cpu(x: mx.array) -> mx.array:
    """exp(x) as 2^(x * log2 e), for the CPU.

    Why: MLX 0.32.4's CPU `exp` costs ~25 ns per element here, and a 4K-token decode
    computes G*L*S of them per layer; `power` measured 1.5-2.7x faster with the same
    accuracy against float64 (~2e-6 relative on [-42, 0]), and still fuses under
    mx.compile (a polynomial exp was faster alone but split into several kernels, with a
    float32 temporary per step). exp(-inf) and the HIDDEN bias still give exactly 0.
    """
    return mx.power(2.0, x * _LOG2E)


def _piece(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    bias: mx.array | None,
    one_row: bool,
    exp: Callable[[mx.array], mx.array],
    normalise: bool,
    softcap: float = 0.0,
) -> tuple[mx.array, mx.array, mx.array]:
    """Partial attention of pre-scaled queries over one piece: (acc, m, denom), float32.

    The piece's LSE is m + log(denom); it is kept factored so the merge needs no log.
    acc = sum_j exp(s_j - m) v_j, divided by denom when `normalise` (float16, see below).
    """
    # q: [B, H_kv, G*L, D] (already * scale); k, v: [B, H_kv, S, D]; bias: [G*L, S] | None
    # Matmuls run in the input dtype, like stock SDPA's composed fallback: no float32 copy
    # of the piece's K/V (that copy would be as big as the segment, per layer, per call).
    s = q @ k.swapaxes(-1, -2)  # s: [B, H_kv, G*L, S]
    if s.dtype != mx.float32:  # skipping a same-dtype astype saves one op per piece
        s = s.astype(mx.float32)
    if softcap:
        # Soft-capped logits (gemma2): cap * tanh(s / cap) of the scaled scores, before the
        # mask, as the model's own attention computes them.
        s = mx.tanh(s * (1.0 / softcap)) * softcap
    if bias is not None:
        s = s + bias
    if one_row:
        # S == 1: softmax over one key is 1, and MLX 0.32.4 segfaults on a reduction over
        # a size-1 axis inside a shapeless compiled graph, so reduce nothing here.
        # Broadcast by arithmetic, not broadcast_to(shape): an explicit shape would be
        # baked into the shapeless graph and be wrong for the next G*L.
        acc = mx.zeros_like(s) + v  # acc: [B, H_kv, G*L, D] float32 (s is float32)
        return acc, s, mx.ones_like(s)
    m = s.max(axis=-1, keepdims=True)  # m: [B, H_kv, G*L, 1]   (LSE, part 1)
    e = exp(s - m)  # e: [B, H_kv, G*L, S] in [0, 1]
    denom = e.sum(axis=-1, keepdims=True)  # denom: [B, H_kv, G*L, 1] >= 1  (LSE, part 2)
    if normalise:
        # sum_j e_j v_j can reach S * max|v| and overflow float16 at long context;
        # the normalised weights keep the result a convex combination of V rows.
        e = e / denom
    # Weights in [0, 1] round to the cache dtype only when the queries have it too: float32
    # queries over float16 K/V (a float32 model with a half-precision cache) keep float32
    # weights, as stock SDPA does (rounding them costs ~1e-3 against its 2e-5).
    acc = (e if q.dtype == mx.float32 else e.astype(v.dtype)) @ v  # acc: [B, H_kv, G*L, D]
    if acc.dtype != mx.float32:
        acc = acc.astype(mx.float32)
    return acc, m, denom


def _attend_pieces(
    scale: float,
    one_row: tuple[bool, ...],
    cpu_exp: bool,
    softcap: float,
    biased: tuple[bool, ...],
    q: mx.array,
    *args: mx.array,
) -> mx.array:
    """Scale, attend over every piece, merge by LSE, round once.
    args = the biases of the pieces flagged in `biased` (in order), then k0, v0, k1, v1, ..."""
    # q: [B, H_kv, G*L, D] in the query dtype; bias i: [G*L, S_i] (causal tail, window).
    n_bias = sum(biased)
    biases, kv = iter(args[:n_bias]), args[n_bias:]
    qs = q * scale
    normalise = q.dtype == mx.float16
    exp = _exp_cpu if cpu_exp else mx.exp
    n = len(kv) // 2
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    for i in range(n):
        bias = next(biases) if biased[i] else None
        parts.append(_piece(qs, kv[2 * i], kv[2 * i + 1], bias, one_row[i], exp, normalise, softcap))
    if n == 1:  # the route sends one piece to SDPA; kept so no caller hits the size-1 reduce
        acc, _, denom = parts[0]
        return (acc if normalise else acc / denom).astype(q.dtype)
    acc = mx.stack([p[0] for p in parts])  # acc: [n, B, H_kv, G*L, D] float32
    m = mx.stack([p[1] for p in parts])  # m: [n, B, H_kv, G*L, 1]
    denom = mx.stack([p[2] for p in parts])  # denom: [n, B, H_kv, G*L, 1]
    # With M = max_p m_p: sum_j exp(s_j - M) = sum_p exp(m_p - M) * denom_p, which is
    # exp(LSE - M) of the whole row; M is finite because some segment is visible.
    w = mx.exp(m - m.max(axis=0, keepdims=True))  # w: [n, B, H_kv, G*L, 1] in [0, 1]
    total = (w * denom).sum(axis=0)  # total: [B, H_kv, G*L, 1] >= 1
    acc_w = w * denom if normalise else w  # normalised pieces carry 1/denom already
    merged = (acc_w * acc).sum(axis=0) / total  # merged: [B, H_kv, G*L, D] float32
    return merged.astype(q.dtype)


@lru_cache(maxsize=256)
def _compiled(
    scale: float, one_row: tuple[bool, ...], cpu_exp: bool, softcap: float, biased: tuple[bool, ...]
) -> Callable[..., mx.array]:
    """One compiled graph per key; the piece count is len(one_row), dtypes retrace inside.

    one_row[i] says piece i has exactly one row; biased[i] that it takes a bias. shapeless=True
    is correct because the graph has no reshape or broadcast_to (they bake shapes in) and
    branches on no shape (one_row is in the key instead): matmul, reductions, broadcasting
    and stack follow the inputs. Without it a decode step (tail grows by one row) would
    recompile every token.
    """

    def run(q: mx.array, *args: mx.array) -> mx.array:
        return _attend_pieces(scale, one_row, cpu_exp, softcap, biased, q, *args)

    return compile_per_thread(run, shapeless=True)


def _eager(
    scale: float, one_row: tuple[bool, ...], cpu_exp: bool, softcap: float, biased: tuple[bool, ...],
    q: mx.array, *args: mx.array,
) -> mx.array:
    return _attend_pieces(scale, one_row, cpu_exp, softcap, biased, q, *args)


# Float32 score elements one call holds per key tile (2^25: 128 MiB of scores, the same
# again for their exponentials while a tile is reduced). Past it the call walks the keys in
# tiles with a running max and sum, so its scratch no longer grows with the history
# (measured: one untiled call over 32K rows with 256 query rows held 3.3 GB on the H200).
SCRATCH_ELEMENTS = 1 << 25
_TILE_ALIGN = 64  # tile rows are a multiple of this (and never fewer)


def key_tile_rows(score_rows: int, scratch_elements: int = SCRATCH_ELEMENTS) -> int:
    """Key rows per tile when `score_rows` (= B * Hq * L) query rows attend at once."""
    rows = scratch_elements // max(1, score_rows)
    return max(_TILE_ALIGN, rows // _TILE_ALIGN * _TILE_ALIGN)


def scratch_bytes(score_rows: int, head_dim: int, scratch_elements: int = SCRATCH_ELEMENTS) -> int:
    """Upper bound of what one call allocates besides its output, in bytes.

    Scores and their exponentials for one tile (float32), plus the scaled queries, the
    running accumulator, max and sum and one tile's partial (float32, three sets).
    Independent of the history length; admission prices the same tile
    (`key_tile_rows`, server/runtime.py) and tests hold one call to this bound.
    """
    tile = key_tile_rows(score_rows, scratch_elements)
    scores = 2 * score_rows * tile * 4
    running = 3 * score_rows * (head_dim + 2) * 4
    return scores + running


def _tile_step(
    one_row: bool,
    cpu_exp: bool,
    softcap: float,
    normalise: bool,
    first: bool,
    qs: mx.array,
    k: mx.array,
    v: mx.array,
    bias: mx.array | None,
    *running: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """Fold one key tile into the running (m, denom, acc) of the online softmax.

    acc is the float32 sum of exp(s - m) v over the keys seen so far (never divided), so
    merging is a rescale by exp(m_old - M) and exp(m_tile - M), M = max of the two.
    """
    exp = _exp_cpu if cpu_exp else mx.exp
    acc_t, m_t, d_t = _piece(qs, k, v, bias, one_row, exp, normalise, softcap)
    if normalise:
        acc_t = acc_t * d_t  # float32 from here: the float16 overflow concern is gone
    if first:
        return m_t, d_t, acc_t
    m, denom, acc = running
    top = mx.maximum(m, m_t)
    alpha = mx.exp(m - top)
    beta = mx.exp(m_t - top)
    return top, denom * alpha + d_t * beta, acc * alpha + acc_t * beta


@lru_cache(maxsize=64)
def _compiled_step(
    one_row: bool, cpu_exp: bool, softcap: float, normalise: bool, first: bool, has_bias: bool
) -> Callable[..., tuple[mx.array, mx.array, mx.array]]:
    """One graph per key; shapeless for the same reasons as `_compiled`."""

    Step = tuple[mx.array, mx.array, mx.array]

    def with_bias(qs: mx.array, k: mx.array, v: mx.array, bias: mx.array, *running: mx.array) -> Step:
        return _tile_step(one_row, cpu_exp, softcap, normalise, first, qs, k, v, bias, *running)

    def without_bias(qs: mx.array, k: mx.array, v: mx.array, *running: mx.array) -> Step:
        return _tile_step(one_row, cpu_exp, softcap, normalise, first, qs, k, v, None, *running)

    return compile_per_thread(with_bias if has_bias else without_bias, shapeless=True)


def _attend_tiled(
    qg: mx.array,
    pieces: list[KVPair],
    *,
    groups: int,
    tile: int,
    scale: float,
    masked: bool,
    compiled: bool,
    origin: int = 0,
    window: int | None = None,
    softcap: float = 0.0,
) -> mx.array:
    """Online softmax over key tiles of every piece, in order; the last piece is the tail
    (causally masked when `masked`). `origin`: the absolute position of the first piece's
    first key, for the window's bias (`segserve.kernels.window.visibility_bias`).

    Only one tile's scores exist at a time: the running values are evaluated after each
    tile (see the comment in the loop), so a tile's scores are freed before the next tile's
    are allocated. Pieces are sliced (views), never copied or joined.
    """
    qs = qg * scale  # qs: [B, H_kv, G*L, D]
    normalise = qg.dtype == mx.float16
    cpu_exp = mx.default_device() == mx.cpu
    n_q = qg.shape[2] // groups  # query positions L; qg rows are ordered (g, l)
    running: tuple[mx.array, ...] = ()
    first_query = origin + sum(k.shape[2] for k, _ in pieces) - n_q
    pos = origin  # absolute position of the current piece's first key
    for index, (k, v) in enumerate(pieces):
        rows = k.shape[2]
        last_piece = index == len(pieces) - 1  # the tail, when there is one
        for start in range(0, rows, tile):
            stop = min(rows, start + tile)
            kt, vt = k[:, :, start:stop], v[:, :, start:stop]
            bias = visibility_bias(
                groups, n_q, first_query, pos + start, pos + stop,
                causal=masked and last_piece, window=window,
            )  # bias: [G*L, stop-start] or None (every query sees the whole tile)
            one_row = stop - start == 1
            first = not running
            args = (qs, kt, vt) + ((bias,) if bias is not None else ()) + running
            if compiled:
                step = _compiled_step(one_row, cpu_exp, softcap, normalise, first, bias is not None)
                running = step(*args)
            else:
                running = _tile_step(one_row, cpu_exp, softcap, normalise, first, qs, kt, vt, bias, *running)
            if not (last_piece and stop == rows):
                # MLX's evaluator allocates each op's output when it encodes the op and runs
                # ahead of the compute until the memory limit, so a lazy chain of tiles keeps
                # every tile's scores alive at once (measured: all of them, with or without
                # mx.depends edges). Evaluating the running values after each tile is what
                # bounds the scratch; the last step stays lazy.
                mx.eval(running)
        pos += rows
    _, denom, acc = running
    return (acc / denom).astype(qg.dtype)


def _tail_only_causal(queries: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Single causal tail piece; rows before the tail starts (T < L) see nothing -> zeros."""
    n_q, n_tail = queries.shape[2], k.shape[2]
    if n_tail >= n_q:
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal")
    # Stock SDPA would give masked-out rows the mean of V; our contract says zeros.
    out = mx.fast.scaled_dot_product_attention(
        queries[:, :, n_q - n_tail :], k, v, scale=scale, mask="causal"
    )  # out: [B, Hq, T, D]
    return mx.pad(out, [(0, 0), (0, 0), (n_q - n_tail, 0), (0, 0)])


def attend_segments(
    queries: mx.array,
    segments: Sequence[KVPair],
    tail: KVPair | None,
    *,
    scale: float,
    causal: bool,
    compiled: bool = True,
    scratch_elements: int = SCRATCH_ELEMENTS,
    window: int | None = None,
    softcap: float = 0.0,
) -> mx.array:
    """Attention of `queries` over every segment and the tail, as if concatenated.

    `scratch_elements` bounds the float32 scores one call holds at a time (see
    `key_tile_rows`); tests lower it to exercise the tiled walk on small shapes.

    `compiled=False` runs the same graph op by op (`--compile false`: for debugging and
    for A/B timing of the compile choice).

    `window` (a sliding-window layer's W): query l, at absolute position p, sees only the
    keys at positions (p - W, p] (`segserve.kernels.window`): segments before every query's window
    are not read, the straddling piece is sliced, and a prefill call whose queries see
    different key ranges takes a per-query bias.

    `softcap` (> 0: gemma2's attn_logit_softcapping): every scaled score s becomes
    softcap * tanh(s / softcap) before the mask and the softmax; MLX's fused SDPA has no
    such step, so those calls never take it.

    queries: [B, Hq, L, D]; each segment (k, v): [B, H_kv, S_i, D] (S_i may be 0);
    tail (k, v): [B, H_kv, T, D] or None. Returns [B, Hq, L, D] in the query dtype.
    """
    b, n_q_heads, n_q, head_dim = queries.shape
    origin = 0  # absolute position of the first key read
    if window is not None:
        view = clip_to_window(segments, tail, n_q, window)
        segments, tail, origin = view.segments, view.tail, view.first
        if not view.masked:
            window = None  # every query sees every kept key: the plain route below is exact
    pieces = [(k, v) for k, v in segments if k.shape[2] > 0]
    masked = False  # whether the tail needs the causal bias
    if tail is not None and tail[0].shape[2] > 0:
        masked = causal and n_q > 1  # L == 1 sees the whole (non-empty) tail
        if not pieces and window is None and not softcap:
            if masked:
                return _tail_only_causal(queries, tail[0], tail[1], scale)
            return mx.fast.scaled_dot_product_attention(queries, *tail, scale=scale)
        pieces.append(tail)
    if not pieces:  # nothing to attend to at all: defined as zeros
        return mx.zeros(queries.shape, dtype=queries.dtype)
    if len(pieces) == 1 and not masked and window is None and not softcap:
        return mx.fast.scaled_dot_product_attention(queries, *pieces[0], scale=scale)

    n_kv_heads = pieces[0][0].shape[1]
    groups = n_q_heads // n_kv_heads
    # head h -> kv head h // G; K/V are never repeated per query head.
    qg = queries.reshape(b, n_kv_heads, groups * n_q, head_dim)  # qg: [B, H_kv, G*L, D]
    tile = key_tile_rows(b * n_q_heads * n_q, scratch_elements)
    if sum(k.shape[2] for k, _ in pieces) > tile:
        # Scores for every piece at once would pass the scratch bound: walk key tiles.
        out = _attend_tiled(
            qg, pieces, groups=groups, tile=tile, scale=float(scale), masked=masked,
            compiled=compiled, origin=origin, window=window, softcap=float(softcap),
        )
        return out.reshape(b, n_q_heads, n_q, head_dim)
    # Per piece, the bias of the keys some query must not see (causal tail, window start).
    first_query = origin + sum(k.shape[2] for k, _ in pieces) - n_q
    biases: list[mx.array | None] = []
    pos = origin
    for index, (k, _) in enumerate(pieces):
        rows = k.shape[2]
        last = index == len(pieces) - 1
        biases.append(visibility_bias(
            groups, n_q, first_query, pos, pos + rows, causal=masked and last, window=window,
        ))  # bias: [G*L, rows] or None
        pos += rows
    flat = [a for bias in biases if bias is not None for a in (bias,)]
    flat += [a for kv in pieces for a in kv]
    one_row = tuple(k.shape[2] == 1 for k, _ in pieces)
    biased = tuple(bias is not None for bias in biases)
    cpu_exp = mx.default_device() == mx.cpu  # GPUs' exp is fast: keep mx.exp there
    if compiled:
        fn = _compiled(float(scale), one_row, cpu_exp, float(softcap), biased)
    else:
        fn = partial(_eager, float(scale), one_row, cpu_exp, float(softcap), biased)
    out = fn(qg, *flat)
    return out.reshape(b, n_q_heads, n_q, head_dim)  # out: [B, Hq, L, D]
