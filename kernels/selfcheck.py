"""Start-up self-check: does a route agree with stock SDPA at the model's real shapes?

Owns: `self_check`, `check_owned` and their typed answer `SelfCheckResult`. Run once per
chosen route at model load (engine thread), before the route serves; a failed check means
the server falls back (to the composed route, or to stock mode; for the owned launches of a
batched decode step, to one call per history) and says why.

Invariants:
- Never raises because the route is wrong: a crash, a wrong shape or dtype, NaN, or an
  error over tolerance all come back as `ok=False` with the reason in `detail`.
- Deterministic for a given seed (its own PRNG key; global MLX random state untouched).
- The reference concatenates the K/V pieces into one buffer: that is fine here (a few
  dozen rows, once) and is exactly what the routes themselves must never do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from segserve.kernels.composed import KVPair

Route = Callable[..., mx.array]  # an AttentionRoute; kept loose to avoid an import cycle

# Max abs error allowed against stock SDPA, per query dtype. Outputs are averages of
# N(0, 1) values (|out| < 2 here); both sides round scores and the output to the dtype,
# so allow ~2 units in the last place at magnitude 2 (float16 ulp 2^-9, bfloat16 2^-6);
# float32 only differs by summation order.
TOLERANCE: dict[mx.Dtype, float] = {
    mx.float32: 2e-5,
    mx.float16: 4e-3,
    mx.bfloat16: 3.2e-2,
}
# float32 on a GPU: stock SDPA and the fused kernels round differently there (TF32 products,
# 10-bit mantissa inputs, and the device's fast exp), so their outputs differ by more than
# summation order: 8.6e-5 at the embedded model's shapes on an H100, where 2e-5 turned
# segmented mode off. 1e-3 is TF32's two units in the last place at magnitude 2; a wrong
# mask or a missed piece still shows as errors of 0.1 and more.
GPU_FLOAT32_TOLERANCE = 1e-3


def tolerance_for(dtype: mx.Dtype, *, gpu: bool) -> float | None:
    """The max abs error allowed for queries of `dtype` (None: no tolerance known)."""
    if dtype == mx.float32 and gpu:
        return GPU_FLOAT32_TOLERANCE
    return TOLERANCE.get(dtype)

# (segment lengths, tail length, query rows L, causal): decode, and a causal prefill chunk.
# Lengths include an empty and a one-row segment, the edge cases a route gets wrong first.
_CASES: tuple[tuple[tuple[int, ...], int, int, bool], ...] = (
    ((37, 0, 1, 20), 5, 1, True),
    ((37, 0, 1, 20), 11, 8, True),
)


@dataclass(frozen=True, slots=True)
class SelfCheckResult:
    ok: bool
    max_abs_err: float
    tolerance: float
    detail: str


def _random_kv(key: mx.array, n_kv_heads: int, rows: int, head_dim: int, dtype: mx.Dtype) -> KVPair:
    kk, kv = mx.random.split(key)
    shape = (1, n_kv_heads, rows, head_dim)
    return (
        mx.random.normal(shape, key=kk).astype(dtype),
        mx.random.normal(shape, key=kv).astype(dtype),
    )


def reference_attention(
    queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
    mask: str | mx.array | None, softcap: float = 0.0,
) -> mx.array:
    """Attention over contiguous K/V as the model computes it: MLX's SDPA, or with a soft
    cap (gemma2) the model's own steps (scaled scores, cap * tanh(s / cap), mask, softmax)
    in float32. queries [B, Hq, L, D]; keys/values [B, H_kv, S, D]; `mask` "causal"
    (bottom-right), a boolean or additive array [L, S], or None."""
    if not softcap:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    b, n_q_heads, n_q, d = queries.shape
    n_kv = keys.shape[1]
    g = n_q_heads // n_kv
    q = (queries.astype(mx.float32) * scale).reshape(b, n_kv, g, n_q, d)
    s = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # s: [B, H_kv, G, L, S]
    s = mx.tanh(s / softcap) * softcap
    bias = create_causal_mask(n_q, keys.shape[2] - n_q) if isinstance(mask, str) else mask
    if bias is not None:
        s = mx.where(bias, s, -mx.inf) if bias.dtype == mx.bool_ else s + bias
    p = mx.softmax(s, axis=-1)
    out = p @ values.astype(mx.float32)[:, :, None]  # out: [B, H_kv, G, L, D]
    return out.reshape(b, n_q_heads, n_q, d).astype(queries.dtype)


def _check_case(
    route: Route,
    key: mx.array,
    shape: tuple[int, int, int, mx.Dtype, mx.Dtype],
    case: tuple[tuple[int, ...], int, int, bool],
    window: int | None = None,
    softcap: float = 0.0,
) -> tuple[float, str | None]:
    """Error of `route` on one case vs stock SDPA (or `reference_attention` with a
    soft cap); (err, failure reason or None)."""
    n_q_heads, n_kv_heads, head_dim, dtype, qdt = shape
    seg_rows, tail_rows, n_q, causal = case
    keys = mx.random.split(key, len(seg_rows) + 2)
    segments = [_random_kv(keys[i], n_kv_heads, r, head_dim, dtype) for i, r in enumerate(seg_rows)]
    tail = _random_kv(keys[-2], n_kv_heads, tail_rows, head_dim, dtype)
    queries = mx.random.normal((1, n_q_heads, n_q, head_dim), key=keys[-1]).astype(qdt)
    scale = head_dim**-0.5
    all_k = mx.concatenate([k for k, _ in segments] + [tail[0]], axis=2)  # k: [1, H_kv, S, D]
    all_v = mx.concatenate([v for _, v in segments] + [tail[1]], axis=2)
    # tail_rows >= n_q, so bottom-right causal over the whole buffer hides only tail rows.
    mask: str | mx.array | None = "causal" if causal and n_q > 1 else None
    extra: dict[str, Any] = {}
    if window is not None:  # mlx-lm's window mask: the query at p sees keys (p - W, p]
        total = all_k.shape[2]
        mask = create_causal_mask(n_q, total - n_q, window_size=window)
        extra["window"] = window
    if softcap:
        extra["softcap"] = softcap
    want = reference_attention(queries, all_k, all_v, scale=scale, mask=mask, softcap=softcap)
    where = f"L={n_q}, segments={seg_rows}, tail={tail_rows}, window={window}, softcap={softcap:g}"
    try:
        got = route(queries, segments, tail, scale=scale, causal=causal, **extra)
        mx.eval(got)
    except Exception as exc:  # a broken route must not take start-up down with it
        return float("inf"), f"route raised {type(exc).__name__}: {exc} ({where})"
    if not isinstance(got, mx.array) or got.shape != want.shape or got.dtype != want.dtype:
        got_desc = f"{got.shape} {got.dtype}" if isinstance(got, mx.array) else type(got).__name__
        return float("inf"), f"got {got_desc}, want {want.shape} {want.dtype} ({where})"
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    err = cast(float, diff.max().item())  # float32 array: item() is a float
    if err != err:  # NaN anywhere makes max NaN
        return float("inf"), f"route returned NaN ({where})"
    return err, None


def self_check(
    route: Route,
    *,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    query_dtype: mx.Dtype | None = None,
    seed: int = 0,
    windows: tuple[int, ...] = (),
    softcap: float = 0.0,
) -> SelfCheckResult:
    """Compare `route` with stock SDPA over the concatenated K/V, decode and prefill.
    K/V are made in `dtype` (the cache's), queries in `query_dtype` (default: the same).
    `windows`: the model's sliding windows; each case runs again with each of them, and
    with windows that start inside a segment and inside the tail. `softcap`: the model's
    attention logit cap (every case runs with it)."""
    qdt = query_dtype or dtype
    # Both sides read the same rounded K/V, so the output's dtype (and the device's float32
    # arithmetic) sets the tolerance.
    tolerance = tolerance_for(qdt, gpu=mx.default_device() != mx.cpu)
    if tolerance is None:
        return SelfCheckResult(False, float("inf"), 0.0, f"no tolerance known for {qdt}")
    shape = (n_q_heads, n_kv_heads, head_dim, dtype, qdt)
    # Per case: no window, then the model's windows and two that clip the case's pieces
    # (start inside the 20-row segment; inside the tail).
    runs: list[tuple[int, tuple[tuple[int, ...], int, int, bool], int | None]] = []
    for i, case in enumerate(_CASES):
        runs.append((i, case, None))
        if windows:
            runs += [(i, case, w) for w in sorted({*windows, 15, 3})]
    keys = mx.random.split(mx.random.key(seed), len(_CASES))
    worst = 0.0
    for i, case, window in runs:
        err, failure = _check_case(route, keys[i], shape, case, window, softcap)
        worst = max(worst, err)
        if failure is not None:
            return SelfCheckResult(False, worst, tolerance, failure)
        if err > tolerance:
            where = f"L={case[2]}, segments={case[0]}, tail={case[1]}, window={window}, softcap={softcap:g}"
            return SelfCheckResult(
                False, worst, tolerance, f"max abs error {err:.3g} > {tolerance:.3g} ({where})"
            )
    name = getattr(route, "name", type(route).__name__)
    detail = f"{name}: {len(runs)} cases within {tolerance:.3g} (max abs error {worst:.3g})"
    return SelfCheckResult(True, worst, tolerance, detail)


# `check_owned`'s sessions, rows of their own segments: one piece, two of uneven lengths,
# and one longer than a decode launch's smallest chunk (256 rows).
_OWNED_SESSIONS: tuple[tuple[int, ...], ...] = ((40,), (20, 70), (300,))


def check_owned(
    route: Any, *, n_q_heads: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype, seed: int = 0,
) -> SelfCheckResult:
    """Compare a route's owned launches (`attend_owned`: the decode rows of sessions whose
    histories differ, each reading only its own segments) with stock SDPA per session over
    its concatenated segments. A route without them passes: nothing to check."""
    name = getattr(route, "name", type(route).__name__)
    owned = getattr(route, "attend_owned", None)
    if owned is None:
        return SelfCheckResult(True, 0.0, 0.0, f"{name}: no owned launches")
    tolerance = tolerance_for(dtype, gpu=mx.default_device() != mx.cpu)
    if tolerance is None:
        return SelfCheckResult(False, float("inf"), 0.0, f"no tolerance known for {dtype}")
    n = len(_OWNED_SESSIONS)
    keys = iter(mx.random.split(mx.random.key(seed), 1 + sum(len(rows) for rows in _OWNED_SESSIONS)))
    q = mx.random.normal((n, n_q_heads, 1, head_dim), key=next(keys)).astype(dtype)
    sessions = [[_random_kv(next(keys), n_kv_heads, r, head_dim, dtype) for r in rows] for rows in _OWNED_SESSIONS]
    scale = head_dim**-0.5
    try:
        out, _ = owned(q, sessions, scale)
        want = mx.concatenate([
            reference_attention(q[i : i + 1], mx.concatenate([k for k, _ in pieces], axis=2),
                                mx.concatenate([v for _, v in pieces], axis=2), scale=scale, mask=None)
            for i, pieces in enumerate(sessions)
        ])
        if out.shape != want.shape:
            return SelfCheckResult(False, float("inf"), tolerance,
                                   f"owned launches returned shape {out.shape}, expected {want.shape}")
        err = cast(float, mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item())
    except Exception as exc:  # a route that raises is a failed check, never a crash here
        return SelfCheckResult(False, float("inf"), tolerance, f"owned launches raised {type(exc).__name__}: {exc}")
    if err != err or err > tolerance:  # NaN compares false
        return SelfCheckResult(False, err, tolerance,
                               f"owned launches: max abs error {err:.3g} > {tolerance:.3g}")
    return SelfCheckResult(True, err, tolerance,
                           f"owned launches: {n} sessions within {tolerance:.3g} (max abs error {err:.3g})")
