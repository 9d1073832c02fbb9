"""Composed attention route vs stock SDPA over the concatenated K/V; factory; self-check.

The reference here concatenates K/V on purpose (tests only): the route must give the same
answer without ever doing so, which `test_route_never_concatenates` and
`test_peak_memory_stays_below_concatenated_history` check.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import cast

import mlx.core as mx
import pytest

from segserve.kernels import composed
from segserve.kernels.composed import KVPair, attend_segments
from segserve.kernels.factory import (
    AttentionRoute,
    ComposedRoute,
    FusedRouteSpec,
    RouteQuery,
    select_route,
)
from segserve.kernels.hook import shape_support
from segserve.kernels.selfcheck import self_check, tolerance_for

# Max abs error vs stock SDPA, by dtype. Outputs are averages of N(0, 1) values, so
# |out| < 2; both routes round the scores and the output to the dtype, so allow about two
# units in the last place at magnitude 2 (float16 ulp 2^-9, bfloat16 2^-6). float32 only
# differs by summation order (observed <= 1e-6).
TOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3.2e-2}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def scalar(a: mx.array) -> float:
    return cast(float, a.item())


def _key() -> Iterator[mx.array]:
    key = mx.random.key(1234)
    while True:
        key, sub = mx.random.split(key)
        yield sub


_KEYS = _key()


def kv(rows: int, n_kv: int = 2, dim: int = 64, dtype: mx.Dtype = mx.float32, b: int = 1) -> KVPair:
    k = mx.random.normal((b, n_kv, rows, dim), key=next(_KEYS)).astype(dtype)
    v = mx.random.normal((b, n_kv, rows, dim), key=next(_KEYS)).astype(dtype)
    return k, v


def queries(
    n_q: int, rows: int, dim: int = 64, dtype: mx.Dtype = mx.float32, b: int = 1
) -> mx.array:
    return mx.random.normal((b, n_q, rows, dim), key=next(_KEYS)).astype(dtype)


def reference(
    q: mx.array, segments: Sequence[KVPair], tail: KVPair | None, scale: float, causal: bool
) -> mx.array:
    """Stock SDPA over one concatenated buffer, with the route's visibility rules."""
    pieces = [p for p in [*segments, *([tail] if tail is not None else [])] if p[0].shape[2]]
    if not pieces:
        return mx.zeros(q.shape, dtype=q.dtype)
    k = mx.concatenate([p[0] for p in pieces], axis=2)  # k: [B, H_kv, S_total, D]
    v = mx.concatenate([p[1] for p in pieces], axis=2)
    n_q, n_tail = q.shape[2], 0 if tail is None else tail[0].shape[2]
    if not causal or n_q == 1 or n_tail == 0:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    # Segment columns always visible; tail column j visible to row i iff j <= T - L + i.
    n_hist = k.shape[2] - n_tail
    col = mx.arange(k.shape[2])[None, :]
    row = mx.arange(n_q)[:, None]
    visible = (col < n_hist) | (col - n_hist <= row + n_tail - n_q)  # visible: [L, S_total]
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=visible)
    return mx.where(visible.any(axis=1)[:, None], out, 0.0)  # rows that see nothing -> 0


def check(
    q: mx.array, segments: Sequence[KVPair], tail: KVPair | None, causal: bool = True
) -> mx.array:
    scale = q.shape[-1] ** -0.5
    got = attend_segments(q, segments, tail, scale=scale, causal=causal)
    want = reference(q, segments, tail, scale, causal)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not mx.isnan(got).any().item()
    err = scalar(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert err <= TOL[q.dtype], f"max abs error {err} > {TOL[q.dtype]}"
    return got


# --- differential: composed route vs stock SDPA ------------------------------------------

LAYOUTS = [  # segment lengths, 1 to 13 segments, with empty and one-row ones
    (40,),
    (0,),
    (1,),
    (1, 1),
    (0, 0, 0),
    (23, 0, 1),
    (300, 1, 0, 77),
    (5, 9, 0, 1, 17, 3),
    (64, 1, 2, 0, 31, 8, 1, 0, 45, 3, 12, 1, 90),  # 13 segments
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n_q", [1, 4, 16])
def test_segment_layouts_match_stock(layout: tuple[int, ...], n_q: int, dtype: mx.Dtype) -> None:
    # Tolerance: TOL[dtype] (see TOL). Tail longer than L: the usual prefill/decode case.
    segments = [kv(r, dtype=dtype) for r in layout]
    check(queries(8, n_q, dtype=dtype), segments, kv(n_q + 3, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("n_kv", "n_q"), [(2, 2), (2, 4), (2, 8), (2, 16), (1, 8), (3, 9)])
def test_head_dims_and_gqa_match_stock(head_dim: int, n_kv: int, n_q: int, dtype: mx.Dtype) -> None:
    # Tolerance: TOL[dtype]; G = n_q / n_kv from 1 to 8, K/V never repeated per head.
    segments = [kv(r, n_kv, head_dim, dtype) for r in (50, 1, 0, 20)]
    tail = kv(7, n_kv, head_dim, dtype)
    for n_rows in (1, 4):  # decode, then a causal chunk, through the same cached graphs
        check(queries(n_q, n_rows, head_dim, dtype), segments, tail)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [1, 4, 16])
@pytest.mark.parametrize("tail_rows", [None, 0, 1, 20])
def test_tail_variants_match_stock(tail_rows: int | None, n_q: int, causal: bool) -> None:
    # Tolerance: TOL[float32]. tail_rows 1 < L leaves rows that only see the segments.
    tail = None if tail_rows is None else kv(tail_rows)
    check(queries(4, n_q), [kv(30), kv(1), kv(12)], tail, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_q", "tail_rows", "causal"), [(1, 9, True), (4, 9, True), (4, 9, False), (16, 16, True)]
)
def test_tail_only_is_stock_sdpa(n_q: int, tail_rows: int, causal: bool, dtype: mx.Dtype) -> None:
    # Tolerance: 0. One non-empty piece goes to stock SDPA itself, so it is the same call.
    q, tail = queries(4, n_q, dtype=dtype), kv(tail_rows, dtype=dtype)
    got = attend_segments(q, [kv(0, dtype=dtype)], tail, scale=0.125, causal=causal)
    mask = "causal" if causal and n_q > 1 else None
    want = mx.fast.scaled_dot_product_attention(q, *tail, scale=0.125, mask=mask)
    assert mx.array_equal(got, want).item()


def test_tail_shorter_than_queries_gives_zero_rows() -> None:
    # Tolerance: exact zeros for rows 0..L-T-1, which see no key at all (not V's mean).
    q, tail = queries(4, 6), kv(2)
    got = check(q, [], tail)
    assert mx.array_equal(got[:, :, :4], mx.zeros_like(got[:, :, :4])).item()
    assert scalar(mx.abs(got[:, :, 4:]).max()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [None, 0])
def test_all_empty_gives_zeros(dtype: mx.Dtype, tail: int | None) -> None:
    # Tolerance: exact. No key anywhere -> zeros of the query's shape and dtype, no NaN.
    q = queries(8, 4, dtype=dtype)
    t = None if tail is None else kv(tail, dtype=dtype)
    got = attend_segments(q, [kv(0, dtype=dtype), kv(0, dtype=dtype)], t, scale=0.1, causal=True)
    assert got.dtype == dtype and got.shape == q.shape
    assert mx.array_equal(got, mx.zeros_like(q)).item()


def test_single_segment_calls_sdpa_on_the_same_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exactly one non-empty piece: one stock SDPA call on the caller's arrays (no copy).
    calls: list[tuple[mx.array, ...]] = []
    stock = mx.fast.scaled_dot_product_attention

    def spy(*args: mx.array, **kwargs: object) -> mx.array:
        calls.append(args)
        return stock(*args, **kwargs)  # type: ignore[arg-type]  # passes the caller's arguments through

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    seg, q = kv(33), queries(4, 4)
    attend_segments(q, [kv(0), seg], None, scale=0.125, causal=True)
    assert len(calls) == 1 and calls[0][1] is seg[0] and calls[0][2] is seg[1]


def test_batch_of_two_matches_stock() -> None:
    # Tolerance: TOL[float32]; B > 1 goes through the same reshape.
    segments = [kv(r, b=2) for r in (17, 1, 40)]
    check(queries(4, 4, b=2), segments, kv(6, b=2))


def test_decode_steps_reuse_graphs_across_shapes() -> None:
    # Tolerance: TOL[float32]. The compiled graphs are shapeless: a tail growing one row a
    # step (T = 1 is a one-row piece), and a new G*L under the same piece kinds, must not
    # reuse any shape baked in by an earlier trace.
    segments = [kv(25), kv(9)]
    for rows in range(1, 6):
        check(queries(4, 1), segments, kv(rows))
    check(queries(2, 1), segments, kv(3))
    check(queries(8, 1), segments, kv(3))


def test_random_shapes_through_shared_graphs() -> None:
    # Tolerance: TOL[dtype]. Few pieces, so compiled graphs are shared by many shapes
    # (B, G*L, S, T, dtype) in a random order: catches any shape baked in by a trace.
    rng = random.Random(7)
    for _ in range(150):
        dtype = rng.choice(DTYPES)
        n_kv, dim, b = rng.choice([1, 2, 3]), rng.choice([64, 128]), rng.choice([1, 2])
        n_q = rng.choice([1, 2, 5])
        layout = [rng.choice([0, 1, 2, rng.randint(3, 70)]) for _ in range(rng.randint(1, 3))]
        tail_rows = rng.choice([None, 0, 1, n_q, n_q + rng.randint(1, 9)])
        tail = None if tail_rows is None else kv(tail_rows, n_kv, dim, dtype, b)
        q = queries(n_kv * rng.choice([1, 2, 4]), n_q, dim, dtype, b)
        check(q, [kv(r, n_kv, dim, dtype, b) for r in layout], tail, rng.random() < 0.8)


def test_cpu_exp_matches_mx_exp() -> None:
    # Tolerance: 1e-6 relative on [-40, 0]; both sides are ~2e-6 from float64 exp because
    # of the float32 range reduction, and differ from each other by far less.
    x = -mx.linspace(0, 40, 100_001)
    rel = mx.abs(composed._exp_cpu(x) - mx.exp(x)) / mx.exp(x)
    assert scalar(rel.max()) < 1e-6
    edge = composed._exp_cpu(mx.array([0.0, -1e30, -float("inf")]))
    assert edge.tolist() == [1.0, 0.0, 0.0]  # exact: no key, no weight


# --- the history is never gathered into one buffer ---------------------------------------


def test_route_never_concatenates(monkeypatch: pytest.MonkeyPatch) -> None:
    segments = [kv(r) for r in (200, 1, 64, 0, 130)]
    tail, q = kv(20), queries(8, 4)
    want = reference(q, segments, tail, 0.125, True)  # concatenates: before the patch
    biggest_segment = max(k.nbytes for k, _ in segments)
    stack = mx.stack

    def no_concatenate(*args: object, **kwargs: object) -> mx.array:
        raise AssertionError("the route concatenated arrays")

    def small_stack(arrays: Sequence[mx.array], *args: object, **kwargs: object) -> mx.array:
        assert all(a.nbytes < biggest_segment for a in arrays), "stacked K/V-sized arrays"
        return stack(arrays, *args, **kwargs)  # type: ignore[arg-type]  # passes the caller's arguments through

    monkeypatch.setattr(mx, "concatenate", no_concatenate)
    monkeypatch.setattr(mx, "stack", small_stack)
    composed._compiled.cache_clear()  # re-trace, so the patched functions are really hit
    got = attend_segments(q, segments, tail, scale=0.125, causal=True)
    monkeypatch.undo()
    composed._compiled.cache_clear()  # drop graphs traced through the patched functions
    assert scalar(mx.abs(got - want).max()) <= TOL[mx.float32]


def test_peak_memory_stays_below_concatenated_history() -> None:
    # 8 segments x 2048 rows, float32, D=128, 2 KV heads: K and V are 16 MiB each in all.
    segments = [kv(2048, dim=128) for _ in range(8)]
    tail, q = kv(16, dim=128), queries(8, 1, dim=128)
    mx.eval(segments, tail, q)
    history = sum(k.nbytes + v.nbytes for k, v in segments)
    attend_segments(q, segments, tail, scale=0.1, causal=True)  # trace outside the window
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(attend_segments(q, segments, tail, scale=0.1, causal=True))
    route_peak = mx.get_peak_memory() - base
    mx.reset_peak_memory()
    mx.eval(reference(q, segments, tail, 0.1, True))  # shows the meter sees a gather
    gather_peak = mx.get_peak_memory() - base
    assert gather_peak >= history
    assert route_peak < history / 16, f"route peak {route_peak} B vs history {history} B"


# --- key-tiled walk (prefill windows over long histories) ---------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [(100,), (100, 37, 1), (5, 300, 64), (0, 129, 0)])
@pytest.mark.parametrize("tail_rows", [None, 1, 40, 200])
@pytest.mark.parametrize("n_q", [1, 8, 33])
@pytest.mark.parametrize("compiled", [True, False])
def test_tiled_walk_matches_stock(
    layout: tuple[int, ...], tail_rows: int | None, n_q: int, dtype: mx.Dtype, compiled: bool
) -> None:
    # A scratch bound of 64 key rows forces every piece longer than that into several tiles,
    # tail tiles with and without the causal bias, and one-row tiles.
    segments = [kv(r, dtype=dtype) for r in layout]
    tail = kv(tail_rows, dtype=dtype) if tail_rows else None
    q = queries(6, n_q, dtype=dtype)
    for causal in (True, False):
        want = reference(q, segments, tail, 0.125, causal)
        got = attend_segments(
            q, segments, tail, scale=0.125, causal=causal, compiled=compiled,
            scratch_elements=6 * n_q * 64,
        )
        assert got.shape == q.shape and got.dtype == q.dtype
        err = scalar(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        assert err <= _tol(dtype), f"max abs error {err} > {_tol(dtype)}"


def _tol(dtype: mx.Dtype) -> float:
    # CUDA's float32 matmuls run on tensor cores (TF32 inputs): measured 1.2e-4 on the H200.
    return 2e-4 if dtype == mx.float32 and mx.default_device() != mx.cpu else TOL[dtype]


def test_key_tile_rows_bounds_scores() -> None:
    assert composed.key_tile_rows(1) == composed.SCRATCH_ELEMENTS
    assert composed.key_tile_rows(9 * 256) * 9 * 256 <= composed.SCRATCH_ELEMENTS
    assert composed.key_tile_rows(10**9) == 64  # never fewer than one aligned tile
    assert composed.key_tile_rows(1000, 64_000) % 64 == 0


def test_tiled_walk_never_concatenates(monkeypatch: pytest.MonkeyPatch) -> None:
    segments, tail, q = [kv(r) for r in (500, 3, 260)], kv(90), queries(4, 40)
    want = reference(q, segments, tail, 0.125, True)

    def no_join(*args: object, **kwargs: object) -> mx.array:
        raise AssertionError("the tiled walk joined arrays")

    monkeypatch.setattr(mx, "concatenate", no_join)
    monkeypatch.setattr(mx, "stack", no_join)
    composed._compiled_step.cache_clear()
    got = attend_segments(q, segments, tail, scale=0.125, causal=True, scratch_elements=4 * 40 * 64)
    mx.eval(got)
    monkeypatch.undo()
    composed._compiled_step.cache_clear()
    assert scalar(mx.abs(got - want).max()) <= _tol(mx.float32)


def _call_peak(segments: list[KVPair], tail: KVPair, q: mx.array, scratch: int) -> int:
    def run() -> mx.array:
        return attend_segments(q, segments, tail, scale=0.1, causal=True, scratch_elements=scratch)

    mx.eval(run())  # trace outside the window
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(run())
    return mx.get_peak_memory() - base


def test_prefill_window_scratch_is_bounded_whatever_the_history() -> None:
    # A 128-row prefill window (8 query heads) over 4K and then 16K history rows: the peak
    # of one call stays within scratch_bytes + the output, the same at both lengths, and far
    # below the untiled scores (8 x 128 x 16K float32 = 64 MiB).
    scratch = 1 << 20  # 4 MiB of scores per tile
    q, tail = queries(8, 128), kv(128)
    bound = composed.scratch_bytes(8 * 128, 64, scratch) + q.nbytes * 2
    peaks = []
    for rows in (4096, 16384):
        segments = [kv(rows // 4) for _ in range(4)]
        mx.eval(segments, tail, q)
        peaks.append(_call_peak(segments, tail, q, scratch))
        del segments
    untiled = 8 * 128 * 16384 * 4
    if mx.default_device() == mx.cpu:  # GPU libraries add workspaces of their own
        assert max(peaks) <= bound, f"peaks {peaks} B vs bound {bound} B"
    assert max(peaks) < untiled / 4
    assert peaks[1] <= peaks[0] * 1.25 + (2 << 20), f"peak grew with the history: {peaks}"


# --- factory and support check -----------------------------------------------------------


def test_select_route_defaults_to_composed() -> None:
    choice = select_route(
        "cpu", head_dim=64, n_q_heads=9, n_kv_heads=3, dtype=mx.float32, registry=()
    )
    assert choice.name == "composed" and isinstance(choice.route, ComposedRoute)
    assert "composed" in choice.reason and choice.reason


class _FakeFused:
    name = "fake-fused"

    def __call__(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
    ) -> mx.array:
        return attend_segments(queries, segments, tail, scale=scale, causal=causal, window=window)


def _fake_spec(backend: str, seen: list[RouteQuery]) -> FusedRouteSpec:
    def build(query: RouteQuery) -> AttentionRoute:
        seen.append(query)
        return _FakeFused()

    return FusedRouteSpec("fake", applies=lambda q: q.backend == backend, build=build)


def test_registered_fused_route_is_consulted_first() -> None:
    seen: list[RouteQuery] = []
    registry = [_fake_spec("metal", []), _fake_spec("cuda", seen)]
    choice = select_route(
        "cuda", head_dim=128, n_q_heads=32, n_kv_heads=8, dtype=mx.bfloat16, registry=registry
    )
    assert choice.name == "fake-fused" and isinstance(choice.route, _FakeFused)
    assert seen == [RouteQuery("cuda", 128, 32, 8, mx.bfloat16)]
    assert "fake" in choice.reason
    assert self_check(choice.route, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32).ok


def test_registered_route_that_does_not_apply_falls_back_to_composed() -> None:
    choice = select_route(
        "cpu",
        head_dim=64,
        n_q_heads=9,
        n_kv_heads=3,
        dtype=mx.float32,
        registry=[_fake_spec("cuda", [])],
    )
    assert choice.name == "composed" and "none of the 1 fused routes" in choice.reason


@pytest.mark.parametrize(
    ("head_dim", "n_q", "n_kv", "ok", "words"),
    [
        (64, 9, 3, True, "supported"),
        (128, 32, 8, True, "supported"),
        (256, 8, 8, True, "supported"),
        (96, 8, 2, False, "head_dim 96"),
        (80, 8, 2, False, "head_dim 80"),
        (64, 9, 2, False, "not a multiple"),
        (64, 8, 0, False, "positive"),
    ],
)
def test_shape_support(head_dim: int, n_q: int, n_kv: int, ok: bool, words: str) -> None:
    got_ok, reason = shape_support(head_dim, n_q, n_kv)
    assert got_ok is ok and words in reason


# --- self-check --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_check_passes_composed_at_smollm2_shapes(dtype: mx.Dtype) -> None:
    result = self_check(ComposedRoute(), n_q_heads=9, n_kv_heads=3, head_dim=64, dtype=dtype)
    assert result.ok, result.detail
    assert result.max_abs_err <= result.tolerance


def _ignores_tail(
    q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, *, scale: float, **kw: object
) -> mx.array:
    return attend_segments(q, segs, None, scale=scale, causal=True)


def _never_causal(
    q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, *, scale: float, **kw: object
) -> mx.array:
    return attend_segments(q, segs, tail, scale=scale, causal=False)


def _raises(q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, **kw: object) -> mx.array:
    raise RuntimeError("kernel launch failed")


def _nan(q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, **kw: object) -> mx.array:
    return mx.full(q.shape, float("nan"), dtype=q.dtype)


def _wrong_dtype(
    q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, *, scale: float, **kw: object
) -> mx.array:
    return attend_segments(q.astype(mx.float16), segs, tail, scale=scale, causal=True)


@pytest.mark.parametrize(
    ("route", "words"),
    [
        (_ignores_tail, "max abs error"),
        (_never_causal, "L=8"),  # decode passes; only the causal chunk tells them apart
        (_raises, "RuntimeError"),
        (_nan, "NaN"),
        (_wrong_dtype, "float16"),
    ],
)
def test_self_check_rejects_wrong_routes(route: AttentionRoute, words: str) -> None:
    result = self_check(route, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32)
    assert not result.ok and words in result.detail, result.detail


def test_float32_tolerance_follows_the_device() -> None:
    """float32 on a GPU allows TF32's rounding (an H100 measured 8.6e-5 against stock SDPA at
    the embedded model's shapes); the CPU keeps summation order's 2e-5; a misplaced row is
    far over either."""
    cpu, gpu = tolerance_for(mx.float32, gpu=False), tolerance_for(mx.float32, gpu=True)
    assert cpu is not None and gpu is not None and cpu < 8.6e-5 < gpu < 1e-2
    assert tolerance_for(mx.float16, gpu=True) == tolerance_for(mx.float16, gpu=False)
    assert tolerance_for(mx.int32, gpu=True) is None


def test_self_check_unknown_dtype_is_not_ok() -> None:
    result = self_check(ComposedRoute(), n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.int32)
    assert not result.ok and "tolerance" in result.detail


def test_uncompiled_route_matches_compiled() -> None:
    """`--compile false` runs the same math op by op."""
    from segserve.kernels.composed import attend_segments as route

    mx.random.seed(3)
    q = mx.random.normal((1, 4, 3, 64))
    segs = [(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))) for n in (5, 1, 9)]
    tail = (mx.random.normal((1, 2, 4, 64)), mx.random.normal((1, 2, 4, 64)))
    a = route(q, segs, tail, scale=0.125, causal=True, compiled=True)
    b = route(q, segs, tail, scale=0.125, causal=True, compiled=False)
    # Same ops, fused or not: float32 rounding differences only.
    assert mx.allclose(a, b, atol=1e-5).item()


def test_default_registry_on_cpu() -> None:
    """On CPU the fused CPU route serves when its extension is built, else composed; the
    fused CUDA route is registered but never applies here (nor imports CUDA code)."""
    from segserve.kernels import fused_cpu
    from segserve.kernels.factory import FUSED_ROUTES, select_route

    assert [s.name for s in FUSED_ROUTES] == ["fused_cuda", "fused_cpu"]
    choice = select_route("cpu", head_dim=64, n_q_heads=9, n_kv_heads=3, dtype=mx.float32)
    want = "fused_cpu" if fused_cpu.available()[0] else "composed"
    assert choice.name == want and choice.reason


@pytest.mark.parametrize("windows", [(), (8,)])
def test_float32_queries_over_half_rows_pass_the_float32_self_check(windows: tuple[int, ...]) -> None:
    """A float32 model with a float16 cache (a GGUF on the CPU): the attention weights stay
    float32 as in stock SDPA, so the route meets float32's tolerance, windows included."""
    route = select_route("cpu", head_dim=64, n_q_heads=4, n_kv_heads=2, dtype=mx.float16, registry=()).route
    check = self_check(route, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float16,
                       query_dtype=mx.float32, windows=windows)
    assert check.ok, check.detail
