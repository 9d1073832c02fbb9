"""Tests for `segserve.kernels.fused_cuda`: the fused CUDA route against stock SDPA and float32.

GPU cases (marker `gpu`) run only where MLX has a CUDA GPU; elsewhere (CI's CPU) they are
skipped, and the CPU cases check availability reporting, the composed fallback and the
pure-Python launch planning. Reference: stock `mx.fast.scaled_dot_product_attention` over
the concatenated K/V (same dtype), and an explicit-mask float32 computation that also
covers the cases SDPA cannot express (a causal tail shorter than the window).
"""

from __future__ import annotations

import random
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels import fused_cuda
from segserve.kernels.composed import KVPair, attend_segments
from segserve.kernels.fused_cuda import (
    DEFAULT_MAX_WINDOW,
    MAX_ROWS,
    MAX_WINDOW,
    TILE,
    WEIGHT_FLOATS,
    FusedCudaRoute,
    applies,
    fused_available,
    merge_by_lse,
    plan_launch,
    plan_owned,
    query_windows,
    split_groups,
    supports,
)
from segserve.kernels.fused_cuda_source import HEADER, MergeMode, kernel_source

HAS_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX with a CUDA GPU")
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU fallback")

# Max abs error against the float32 reference, inputs N(0, 1), outputs |x| < ~3.
# Both routes round the output once to the dtype (bf16 ulp at 2..4 is 2^-6, f16 2^-9);
# the kernel also rounds P to the dtype before P.V (relative 2^-9 / 2^-12 per weight).
TOL = {mx.bfloat16: 3.2e-2, mx.float16: 4e-3}
# Relative Frobenius error ||out - ref|| / ||ref|| against float32.
REL = {mx.bfloat16: 1e-2, mx.float16: 2e-3}


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _kv(key: mx.array, b: int, h: int, rows: int, d: int, dtype: mx.Dtype) -> KVPair:
    k1, k2 = mx.random.split(key)
    return (
        mx.random.normal((b, h, rows, d), key=k1).astype(dtype),
        mx.random.normal((b, h, rows, d), key=k2).astype(dtype),
    )


def _problem(
    seed: int,
    seg_rows: list[int],
    tail_rows: int | None,
    *,
    d: int = 128,
    group: int = 4,
    n_kv: int = 2,
    n_q: int = 1,
    b: int = 1,
    dtype: mx.Dtype = mx.bfloat16,
) -> tuple[mx.array, list[KVPair], KVPair | None]:
    keys = mx.random.split(mx.random.key(seed), len(seg_rows) + 2)
    segs = [_kv(keys[i], b, n_kv, r, d, dtype) for i, r in enumerate(seg_rows)]
    tail = None if tail_rows is None else _kv(keys[-2], b, n_kv, tail_rows, d, dtype)
    q = mx.random.normal((b, n_kv * group, n_q, d), key=keys[-1]).astype(dtype)
    return q, segs, tail


def _reference(
    q: mx.array, segs: list[KVPair], tail: KVPair | None, scale: float, causal: bool
) -> mx.array:
    """float32 attention with an explicit mask; rows that see no key are zeros."""
    return _reference_lse(q, segs, tail, scale, causal)[0]


def _reference_lse(
    q: mx.array, segs: list[KVPair], tail: KVPair | None, scale: float, causal: bool
) -> tuple[mx.array, mx.array]:
    """(out [B, Hq, L, D], lse [B, Hq, L]) in float32; no visible key: 0 and -inf.

    Runs on the CPU stream: a GPU float32 matmul may use TF32 (~1e-3), too coarse here.
    """
    with mx.stream(mx.cpu):
        out, lse = _reference_on_stream(q, segs, tail, scale, causal)
        mx.eval(out, lse)
    return out, lse


def _reference_on_stream(
    q: mx.array, segs: list[KVPair], tail: KVPair | None, scale: float, causal: bool
) -> tuple[mx.array, mx.array]:
    b, n_q, n_win, d = q.shape
    pieces = [*segs, *([tail] if tail is not None else [])]
    n_seg = sum(k.shape[2] for k, _ in segs)
    t_rows = tail[0].shape[2] if tail is not None else 0
    if n_seg + t_rows == 0:
        return mx.zeros(q.shape, dtype=mx.float32), mx.full(q.shape[:3], -mx.inf)
    k = mx.concatenate([p[0] for p in pieces], axis=2).astype(mx.float32)
    v = mx.concatenate([p[1] for p in pieces], axis=2).astype(mx.float32)
    group = n_q // k.shape[1]
    k, v = mx.repeat(k, group, axis=1), mx.repeat(v, group, axis=1)  # [B, Hq, S, D]
    s = (q.astype(mx.float32) @ k.swapaxes(-1, -2)) * scale  # s: [B, Hq, L, S]
    col = mx.arange(n_seg + t_rows)[None, :]
    row = mx.arange(n_win)[:, None]
    visible = (col < n_seg) | (not causal) | (col - n_seg <= t_rows - n_win + row)
    s = mx.where(visible, s, -mx.inf)
    top = s.max(axis=-1, keepdims=True)
    ref = mx.where(top == -mx.inf, 0.0, top)
    p = mx.exp(s - ref)
    den = p.sum(axis=-1, keepdims=True)
    out = mx.where(den > 0, (p @ v) / mx.maximum(den, 1e-30), 0.0)
    lse = mx.where(den > 0, ref + mx.log(mx.maximum(den, 1e-30)), -mx.inf)
    return out, lse[..., 0]


def _stock(
    q: mx.array, segs: list[KVPair], tail: KVPair | None, scale: float, causal: bool
) -> mx.array:
    pieces = [*segs, *([tail] if tail is not None else [])]
    k = mx.concatenate([p[0] for p in pieces], axis=2)
    v = mx.concatenate([p[1] for p in pieces], axis=2)
    mask = "causal" if causal and q.shape[2] > 1 else None
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _check(
    got: mx.array,
    q: mx.array,
    segs: list[KVPair],
    tail: KVPair | None,
    causal: bool,
    *,
    stock: bool = True,
) -> float:
    """Assert `got` matches float32 (and stock SDPA when it can express the case)."""
    scale = q.shape[-1] ** -0.5
    assert got.shape == q.shape and got.dtype == q.dtype
    ref = _reference(q, segs, tail, scale, causal)
    err = mx.abs(got.astype(mx.float32) - ref)
    max_err = _scalar(err.max())
    rel = _scalar(mx.sqrt((err * err).sum()) / mx.maximum(mx.sqrt((ref * ref).sum()), 1e-30))
    assert max_err <= TOL[q.dtype], f"max abs error {max_err:.3g} vs float32"
    assert rel <= REL[q.dtype], f"relative error {rel:.3g} vs float32"
    if stock:
        want = _stock(q, segs, tail, scale, causal).astype(mx.float32)
        diff = _scalar(mx.abs(got.astype(mx.float32) - want).max())
        assert diff <= TOL[q.dtype], f"max abs error {diff:.3g} vs stock SDPA"
    return max_err


def _scalar(a: mx.array) -> float:
    return float(a.item())  # type: ignore[arg-type]  # .item() is typed int|float|complex


def _rows(seed: int, n: int, lo: int, hi: int) -> list[int]:
    r = mx.random.randint(lo, hi, (n,), key=mx.random.key(seed))
    return [int(_scalar(x)) for x in r]


# ---------------------------------------------------------------------------------------
# CPU: availability, fallback, planning (run everywhere)
# ---------------------------------------------------------------------------------------
@cpu_only
def test_unavailable_on_cpu_with_reason() -> None:
    ok, reason = fused_available()
    assert not ok
    assert reason


@cpu_only
def test_falls_back_to_composed_on_cpu() -> None:
    q, segs, tail = _problem(1, [33, 0, 7], 9, d=64, n_q=4, dtype=mx.bfloat16)
    route = FusedCudaRoute()
    assert route.name == "fused_cuda"
    got = route(q, segs, tail, scale=0.125, causal=True)
    want = attend_segments(q, segs, tail, scale=0.125, causal=True)
    assert mx.array_equal(got, want).item()


@cpu_only
def test_registry_predicate_false_on_cpu() -> None:
    class Query:
        backend = "cpu"
        head_dim, n_q_heads, n_kv_heads, dtype = 128, 32, 8, mx.bfloat16

    assert applies(Query()) is False


@pytest.mark.parametrize(
    ("args", "ok"),
    [
        ((128, 32, 8, mx.bfloat16, 1), True),
        ((64, 9, 3, mx.float16, 16), True),
        ((256, 8, 8, mx.bfloat16, 8), True),
        ((128, 32, 8, mx.float32, 1), False),  # float32 composes
        ((128, 32, 8, mx.bfloat16, 1025), False),  # past MAX_WINDOW: composes
        ((96, 32, 8, mx.bfloat16, 1), False),
        ((128, 36, 8, mx.bfloat16, 1), False),  # not a multiple
        ((128, 80, 8, mx.bfloat16, 1), False),  # group 10 > 8
    ],
)
def test_supports(args: tuple[int, int, int, mx.Dtype, int], ok: bool) -> None:
    got, reason = supports(*args)
    assert got is ok and reason


def test_plan_chunks_cover_pieces_and_fit_merge_scratch() -> None:
    rows = [32768, 5, 700, 64]
    plan = plan_launch(rows, n_groups=8, n_query_rows=4, target_blocks=528)
    chunk = plan.chunk_tiles * TILE
    assert plan.n_chunks == sum(-(-r // chunk) for r in rows)
    assert plan.n_chunks * plan.rows + plan.rows <= WEIGHT_FLOATS
    assert 264 <= plan.n_chunks * plan.n_groups <= 528  # fills the GPU, no ragged wave
    wide = plan_launch([200_000] * 17, n_groups=1, n_query_rows=MAX_ROWS, target_blocks=4096)
    small = plan_launch([8000], n_groups=8, n_query_rows=4, target_blocks=792, min_chunk_tiles=4)
    assert small.chunk_tiles == 4 and small.n_chunks == 32
    assert wide.n_chunks * MAX_ROWS + MAX_ROWS <= WEIGHT_FLOATS
    with pytest.raises(ValueError):
        plan_launch([10, 0], 1, 4, 64)
    with pytest.raises(ValueError):
        plan_launch([10], 1, MAX_ROWS + 1, 64)


def test_owned_plan_gives_every_session_its_share() -> None:
    sessions = [[2048], [300, 65], [8192, 64, 1]]
    plan = plan_owned(sessions, n_kv_heads=8, n_query_rows=4, target_blocks=528, min_chunk_tiles=4)
    chunk = plan.chunk_tiles * TILE
    per_session = [sum(-(-r // chunk) for r in rows) for rows in sessions]
    assert plan.n_groups == 24 and plan.n_live == 6
    assert plan.n_chunks == max(per_session)  # the grid's chunks: the most any session has
    assert max(per_session) <= 528 // 24  # each session's chunks fit its groups' share
    assert plan.chunk_tiles >= 4
    # A smaller chunk would give the longest session more chunks than its share.
    assert sum(-(-r // (chunk - TILE)) for r in sessions[2]) > 528 // 24
    assert plan.ws_floats(128) == 24 * (plan.n_chunks + plan.n_runs) * 4 * 130
    with pytest.raises(ValueError):
        plan_owned([[10], []], 8, 4, 528)
    with pytest.raises(ValueError):
        plan_owned([[10]], 8, MAX_ROWS + 1, 528)


def test_plan_leaves_light_pieces_out_of_the_count() -> None:
    # A prefill call's own rows (the tail) are a light piece: the history's chunks alone
    # fill the per-group budget; the tail adds one short chunk.
    plan = plan_launch([32768 - 272, 272], n_groups=64, n_query_rows=64, target_blocks=264, light=4)
    assert plan.chunk_tiles == 127 and plan.n_chunks == 5
    plain = plan_launch([32768 - 272, 272], n_groups=64, n_query_rows=64, target_blocks=264)
    assert plain.chunk_tiles == 170 and plain.n_chunks == 4
    # Pieces comparable to the chunk still count; more pieces than the budget: one each.
    many = plan_launch([8000] * 6 + [100], n_groups=64, n_query_rows=64, target_blocks=264, light=4)
    assert many.chunk_tiles == 125 and many.n_chunks == 7
    # Light chunks stay within the two-pass merge scratch.
    tiny = plan_launch([64] * 16 + [200_000], 1, MAX_ROWS, 100_000, light=4)
    assert tiny.n_chunks * MAX_ROWS + MAX_ROWS <= WEIGHT_FLOATS


def test_split_groups_and_windows() -> None:
    assert split_groups(5, 17) == [(0, 5)]
    assert split_groups(18, 17) == [(0, 17), (17, 18)]
    assert split_groups(40, 17) == [(0, 17), (17, 34), (34, 40)]
    assert query_windows(16, 4) == (16, 1)
    assert query_windows(16, 8) == (8, 2)
    assert query_windows(13, 5) == (12, 2)  # the last window is padded
    assert query_windows(256, 4) == (16, 16)
    assert query_windows(1, 8) == (1, 1)


def test_merge_by_lse_matches_whole() -> None:
    q, segs, _ = _problem(3, [50, 70], None, d=64, n_q=3, dtype=mx.float32)
    scale = 0.125

    def part(kv: KVPair) -> tuple[mx.array, mx.array]:
        k = mx.repeat(kv[0], 4, axis=1)
        v = mx.repeat(kv[1], 4, axis=1)
        s = (q @ k.swapaxes(-1, -2)) * scale
        lse = mx.logsumexp(s, axis=-1)
        return mx.softmax(s, axis=-1) @ v, lse

    o1, l1 = part(segs[0])
    o2, l2 = part(segs[1])
    got = merge_by_lse([o1, o2], [l1, l2])
    want = _reference(q, segs, None, scale, False)
    assert mx.allclose(got, want, atol=1e-5).item()
    empty = merge_by_lse([o1 * 0], [mx.full(l1.shape, -mx.inf)])
    assert mx.array_equal(empty, mx.zeros_like(o1)).item()


def _stand_in_kernel(
    merge: str, n_pieces: int, head_dim: int, stages: int, paired: bool = False
) -> Callable[..., list[mx.array]]:
    """What the CUDA kernel computes, from the same inputs, in float32 (CPU plumbing test)."""

    def kernel(
        *,
        inputs: list[mx.array],
        template: list[tuple[str, Any]],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: list[Sequence[int]],
        output_dtypes: list[mx.Dtype],
    ) -> list[mx.array]:
        t = dict(template)
        q, cfg, slots = inputs[0], inputs[1], inputs[3:]
        n_live, chunk, run, win = cfg.shape[0], cfg.shape[1] * TILE, cfg.shape[2], cfg.shape[3]
        pieces = list(zip(slots[:n_pieces], slots[n_pieces:], strict=True))[:n_live]
        b, n_q, n_win, d = q.shape
        n_kv = pieces[0][0].shape[1]
        n_windows = -(-n_win // win)  # query windows of one launch, the last one padded
        assert (n_q // n_kv) * win <= MAX_ROWS and (n_windows - 1) * win < n_win
        n_chunks = sum(-(-k.shape[2] // chunk) for k, _ in pieces)
        assert paired == (t["WIDE"] >= 2)  # paired launches: their own kernel object
        n_z = -(-n_windows // 2) if paired else n_windows  # a paired block: two windows
        assert grid == (n_chunks * 128, n_kv, b * n_z) and threadgroup == (128, 1, 1)
        assert t["D"] == d == head_dim and t["T"] == q.dtype and t["NST"] == stages
        assert run * run >= n_chunks and (run - 1) ** 2 < n_chunks  # runs of ~sqrt(NC)
        slots_ = n_chunks + -(-n_chunks // run)  # chunk partials + first-level partials
        groups = b * n_kv * n_windows
        assert list(output_shapes[2]) == [groups * slots_ * (n_q // n_kv) * win * (d + 2)]
        scale = struct.unpack("<f", struct.pack("<i", t["SCALE_BITS"]))[0]
        if t["CAUSAL"]:  # the kernel masks the last live piece
            out, lse = _reference_lse(q, pieces[:-1], pieces[-1], scale, True)
        else:
            out, lse = _reference_lse(q, pieces, None, scale, False)
        return [out.astype(t["OT"]), lse, mx.zeros(tuple(output_shapes[2]))]

    return kernel



@cpu_only
def test_layers_replay_the_first_layers_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The layers of one step share a call shape: the first plans the launch, the others
    # replay it over their own K/V (each result still its own layer's attention), and a
    # step that grows the tail plans again.
    monkeypatch.setattr(fused_cuda, "fused_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(fused_cuda, "_attention_kernel", _stand_in_kernel)
    route = FusedCudaRoute(waves=0.2, min_chunk_rows=64)
    plans: list[int] = []
    real_plan = route._plan_call

    def counted_plan(*args: Any) -> object:
        plans.append(1)
        return real_plan(*args)

    monkeypatch.setattr(route, "_plan_call", counted_plan)
    for tail_rows in (9, 10):
        for layer in range(3):
            q, segs, tail = _problem(40 + layer, [300, 0, 70], tail_rows, d=64, n_q=1)
            got = route(q, segs, tail, scale=0.125, causal=True)
            _check(got, q, segs, tail, True, stock=False)
    assert len(plans) == 2
    # A call the kernel does not serve is remembered as such: it goes to the fallback.
    calls: list[int] = []

    def fallback(*args: Any, **kwargs: Any) -> mx.array:
        calls.append(1)
        return mx.zeros((1,))

    route.fallback = fallback
    q, segs, tail = _problem(50, [64], 4, d=64, n_q=1, dtype=mx.float32)
    for _ in range(2):
        route(q, segs, tail, scale=0.125, causal=True)
    assert len(calls) == 2 and len(plans) == 3

@cpu_only
@pytest.mark.parametrize(
    ("seg_rows", "tail_rows", "n_q", "group", "causal"),
    [
        ([300, 20, 5], 9, 1, 4, True),
        ([130, 1, 77], 30, 16, 8, True),  # two query windows in one launch
        ([700, 2], 300, 256, 4, True),  # a prefill chunk: 16 windows
        ([40, 9], 3, 8, 4, True),  # tail shorter than the window
        ([30] * 20, 6, 3, 2, True),  # 21 pieces: two launches merged by LSE
        ([50, 0, 60], None, 4, 4, False),
        ([], 12, 5, 1, True),
    ],
)
def test_route_plumbing_with_stand_in_kernel(
    monkeypatch: pytest.MonkeyPatch,
    seg_rows: list[int],
    tail_rows: int | None,
    n_q: int,
    group: int,
    causal: bool,
) -> None:
    monkeypatch.setattr(fused_cuda, "fused_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(fused_cuda, "_attention_kernel", _stand_in_kernel)
    q, segs, tail = _problem(5 + n_q, seg_rows, tail_rows, d=64, group=group, n_q=n_q)
    route = FusedCudaRoute(waves=0.2, min_chunk_rows=64, max_window=1024)
    assert route.accepts(q, segs, tail)[0]
    got = route(q, segs, tail, scale=0.125, causal=causal)
    _check(got, q, segs, tail, causal, stock=False)


@cpu_only
def test_prefill_calls_are_paced(monkeypatch: pytest.MonkeyPatch) -> None:
    # A route with in_flight=2 schedules each prefill call (several query windows) itself,
    # after waiting for the paced call two back; decode and verify calls (one window) are
    # left to the caller's evaluation, and every result is still its layer's attention.
    monkeypatch.setattr(fused_cuda, "fused_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(fused_cuda, "_attention_kernel", _stand_in_kernel)
    events: list[tuple[str, int]] = []
    handles: dict[int, int] = {}  # id(handle) -> the call that made it

    def schedule(handle: mx.array) -> None:
        events.append(("schedule", handles.setdefault(id(handle), len(handles))))
        mx.async_eval(handle)  # type: ignore[no-untyped-call]

    def wait(handle: mx.array) -> None:
        events.append(("wait", handles[id(handle)]))
        mx.eval(handle)

    monkeypatch.setattr(fused_cuda, "_schedule", schedule)
    monkeypatch.setattr(fused_cuda, "_wait", wait)
    route = FusedCudaRoute(waves=0.2, min_chunk_rows=64, max_window=1024, in_flight=2)
    for layer in range(4):  # one prefill chunk of four layers: 40 positions, G=4: 3 windows
        q, segs, tail = _problem(60 + layer, [200, 30], 40, d=64, n_q=40)
        got = route(q, segs, tail, scale=0.125, causal=True)
        _check(got, q, segs, tail, True, stock=False)
    assert events == [("schedule", 0), ("schedule", 1), ("wait", 0), ("schedule", 2),
                      ("wait", 1), ("schedule", 3)]
    for n_q in (1, 8):  # decode and a verify window (32 packed rows): not paced
        q, segs, tail = _problem(70 + n_q, [200, 30], 40, d=64, n_q=n_q)
        _check(route(q, segs, tail, scale=0.125, causal=True), q, segs, tail, True, stock=False)
    assert len(events) == 6
    with pytest.raises(ValueError):
        FusedCudaRoute(in_flight=-1)


def test_build_paces_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    from segserve.kernels.factory import KernelOptions, RouteQuery

    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16)
    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (True, "stand-in"))
    assert fused_cuda.build(query).in_flight == fused_cuda.IN_FLIGHT_PREFILL
    assert FusedCudaRoute().in_flight == 0  # kernel benches time chains of calls unpaced
    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16, KernelOptions(fused_inflight=0))
    assert fused_cuda.build(query).in_flight == 0
    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16, KernelOptions(fused_wide="off", fused_inflight=3))
    assert fused_cuda.build(query).in_flight == 3
    assert fused_cuda.build(query, 1).in_flight == 1  # a caller's own bound wins (benches)


def test_build_takes_the_owned_launches_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from segserve.kernels.factory import KernelOptions, RouteQuery

    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (True, "stand-in"))
    assert fused_cuda.build(RouteQuery("cuda", 128, 32, 8, mx.bfloat16)).owned_launches is False
    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16, KernelOptions(fused_owned=True))
    assert fused_cuda.build(query).owned_launches is True
    assert FusedCudaRoute().owned_launches is True  # benches compare the batched step with and without


def test_build_takes_the_sm_count_setting_else_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from segserve.kernels.factory import KernelOptions, RouteQuery

    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (True, "stand-in"))
    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16, KernelOptions(sm_count=78))
    assert fused_cuda.build(query).sm_count == 78
    monkeypatch.setattr(fused_cuda, "device_sm_count", lambda: 114)
    assert fused_cuda.build(RouteQuery("cuda", 128, 32, 8, mx.bfloat16)).sm_count == 114
    monkeypatch.setattr(fused_cuda, "device_sm_count", lambda: None)
    assert fused_cuda.build(RouteQuery("cuda", 128, 32, 8, mx.bfloat16)).sm_count == fused_cuda.H200_SMS


@cpu_only
@pytest.mark.parametrize(
    ("n_q", "group", "d", "wide", "pair_keys", "want"),
    [
        (256, 4, 128, True, 64, 2),  # prefill chunk: 16 windows of 64 rows, in 8 pairs
        (256, 4, 128, True, 32, 3),  # the same, 32 keys per update
        (200, 3, 64, True, 64, 2),  # 10 windows of 63 rows, the last padded
        (40, 4, 128, True, 64, 2),  # 3 windows: the last pair has one
        (256, 4, 128, True, 0, 1),  # one window per block (the unpaired wide path)
        (13, 4, 128, True, 64, 1),  # 52 rows, one window: nothing to pair
        (12, 4, 128, True, 64, 0),  # 48 rows: narrow (warps split the keys)
        (1, 8, 128, True, 64, 0),  # decode
        (256, 4, 256, True, 64, 0),  # D=256 stays narrow (the wide step spills)
        (256, 4, 64, False, 64, 0),  # route without the wide path
    ],
)
def test_wide_path_for_prefill_rows(
    monkeypatch: pytest.MonkeyPatch, n_q: int, group: int, d: int, wide: bool, pair_keys: int,
    want: int,
) -> None:
    seen: list[tuple[int, tuple[int, int, int]]] = []

    def recording(
        merge: str, n_pieces: int, head_dim: int, stages: int, paired: bool = False
    ) -> Callable[..., list[mx.array]]:
        inner = _stand_in_kernel(merge, n_pieces, head_dim, stages, paired)

        def kernel(**kw: Any) -> list[mx.array]:
            seen.append((dict(kw["template"])["WIDE"], kw["grid"]))
            return inner(**kw)

        return kernel

    monkeypatch.setattr(fused_cuda, "fused_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(fused_cuda, "_attention_kernel", recording)
    q, segs, tail = _problem(3 + n_q, [5000, 70], 300, d=d, group=group, n_q=n_q)
    route = FusedCudaRoute(wide=wide, pair_keys=pair_keys)
    _check(route(q, segs, tail, scale=d**-0.5, causal=True), q, segs, tail, True, stock=False)
    assert [w for w, _ in seen] == [want]
    win, n_windows = query_windows(n_q, group)
    if want >= 2:
        per_sm, n_z = fused_cuda.BLOCKS_PER_SM_PAIRED[(d, 2)], -(-n_windows // 2)
    elif want == 1:
        per_sm, n_z = fused_cuda._wide_blocks_per_sm(d, 2, 4, "in_kernel"), n_windows
    else:
        per_sm, n_z = fused_cuda.BLOCKS_PER_SM[(d, 2)], n_windows
    light = fused_cuda.LIGHT_PIECE if want >= 2 else 0
    plan = plan_launch(
        [5000, 70, 300], 2 * n_z, group * win, route.sm_count * per_sm, route.min_chunk_tiles, light
    )
    assert seen[0][1] == (plan.n_chunks * 128, 2, n_z)


@cpu_only
@pytest.mark.parametrize("pair_keys", [0, 32, 64])
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(32, 8, 128), (9, 3, 64), (8, 1, 128), (64, 8, 64)])
def test_wide_plans_within_priced_workspace(
    monkeypatch: pytest.MonkeyPatch, pair_keys: int, n_q: int, n_kv: int, d: int
) -> None:
    # What admission prices for a wide route (`scratch_bytes`, and `fused_workspace_bytes`
    # over `workspace_terms`) covers the paired plans too: a paired block serves two
    # windows, so its wave per group is up to twice the unpaired one.
    from segserve.server.scheduling.admission import fused_workspace_bytes

    monkeypatch.setattr(fused_cuda, "_attention_kernel", _stand_in_kernel)
    route = FusedCudaRoute(wide=True, pair_keys=pair_keys)
    per_slot, chunk_rows, window, max_pieces, wave = route.workspace_terms(n_q, n_kv, d)
    rng = random.Random(n_q * 1000 + d + pair_keys)
    for _ in range(120):
        positions = rng.choice([16, 40, 64, 200, 256, 512, 1024])
        n_pieces = rng.randint(1, max_pieces)
        rows = [rng.randint(1, 140_000) for _ in range(n_pieces)]
        q = mx.zeros((1, n_q, positions, d), dtype=mx.bfloat16)
        recipe = route._recipe(q, n_kv, rows, True, d**-0.5, mx.bfloat16, (), False)
        need = recipe.plan.ws_floats(d) * 4
        assert need <= route.scratch_bytes(n_q, n_kv, d, positions), (positions, rows)
        bound = fused_workspace_bytes(positions, sum(rows), n_pieces, per_slot, chunk_rows, window, wave, n_kv)
        assert need <= bound, (positions, rows)
        # Paired exactly where there are windows to pair (grid z: one per pair).
        n_windows = query_windows(positions, n_q // n_kv)[1]
        paired = dict(recipe.template)["WIDE"] >= 2
        assert paired == (pair_keys > 0 and n_windows >= 2)
        assert recipe.grid[2] == (-(-n_windows // 2) if paired else n_windows)


def test_wide_tables_within_narrow_bound() -> None:
    # scratch_bytes prices every plan with BLOCKS_PER_SM; the wide path must never plan
    # more resident blocks than that bound assumes.
    for (d, stages), blocks in fused_cuda.BLOCKS_PER_SM_WIDE.items():
        assert blocks <= fused_cuda.BLOCKS_PER_SM[(d, stages)]
        for n_slots in fused_cuda.SLOT_COUNTS:
            for merge in ("in_kernel", "two_pass"):
                assert 1 <= fused_cuda._wide_blocks_per_sm(d, stages, n_slots, merge) <= blocks
    assert fused_cuda._wide_blocks_per_sm(128, 2, 8, "in_kernel") == 2


def test_build_honours_wide_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from segserve.kernels.factory import KernelOptions, RouteQuery

    def with_wide(mode: str) -> RouteQuery:
        return RouteQuery("cuda", 128, 32, 8, mx.bfloat16, KernelOptions(fused_wide=mode))

    query = RouteQuery("cuda", 128, 32, 8, mx.bfloat16)
    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (True, "stand-in"))
    route = fused_cuda.build(query)
    assert route.wide and route.pair_keys == fused_cuda.DEFAULT_PAIR_KEYS  # the default
    assert not fused_cuda.build(with_wide("off")).wide
    assert fused_cuda.build(with_wide("paired")).pair_keys == fused_cuda.DEFAULT_PAIR_KEYS
    route = fused_cuda.build(with_wide("single"))  # one window per block
    assert route.wide and route.pair_keys == 0
    # The paired path failed its check here: the unpaired one, then the narrow one.
    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (k == 0, "stand-in"))
    route = fused_cuda.build(query)
    assert route.wide and route.pair_keys == 0
    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (False, "stand-in"))
    assert not fused_cuda.build(query).wide
    with pytest.raises(ValueError):
        FusedCudaRoute(pair_keys=16)


@cpu_only
def test_wide_unavailable_without_cuda() -> None:
    ok, why = fused_cuda.wide_available(128, mx.bfloat16)
    assert not ok and why
    assert not fused_cuda.wide_available(256, mx.bfloat16)[0]
    assert not fused_cuda.wide_available(128, mx.bfloat16, 64)[0]


def test_kernel_source_shape() -> None:
    merges: tuple[MergeMode, ...] = ("in_kernel", "two_pass")
    for merge in merges:
        src = kernel_source(merge)
        assert re.search(r"\buint\b", src) is None  # MLX's CUDA JIT has no `uint`
        assert "k16_strides" in src and "v16_strides" in src and "k17" not in src
        assert "wide_step" in src and "if (WIDE)" in src and "wide2_step" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in HEADER


# ---------------------------------------------------------------------------------------
# GPU: kernel vs stock SDPA / float32
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
def test_available_on_gpu() -> None:
    ok, reason = fused_available()
    assert ok, reason


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n_seg", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode(d: int, group: int, n_seg: int, dtype: mx.Dtype) -> None:
    seed = d * 1000 + group * 100 + n_seg
    q, segs, tail = _problem(
        seed, _rows(seed, n_seg, 1, 300), 1 + seed % 70, d=d, group=group, dtype=dtype
    )
    got = FusedCudaRoute()(q, segs, tail, scale=d**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("group", [1, 4, 8])  # 8 x 16 > 64 rows: two sub-windows
@pytest.mark.parametrize("n_q", list(range(1, 17)))
def test_windows(n_q: int, group: int, dtype: mx.Dtype) -> None:
    seed = 7000 + n_q * 10 + group
    q, segs, tail = _problem(seed, [130, 1, 77], 20 + n_q, d=128, group=group, n_q=n_q, dtype=dtype)
    got = FusedCudaRoute()(q, segs, tail, scale=128**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n_q", [1, 5])
@pytest.mark.parametrize("n_seg", [*range(1, 17), 17, 18, 24, 40])  # 17+: grouped launches
def test_segment_counts(n_seg: int, n_q: int) -> None:
    seed = 9000 + n_seg * 10 + n_q
    q, segs, tail = _problem(seed, _rows(seed, n_seg, 1, 120), 8, d=64, group=4, n_q=n_q)
    got = FusedCudaRoute()(q, segs, tail, scale=0.125, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("seg_rows", "tail_rows", "n_q", "causal", "stock"),
    [
        ([0, 1, 0, 1, 64, 65], 1, 1, True, True),  # empty and one-row segments
        ([100, 3], None, 1, True, True),  # no tail
        ([100, 3], None, 4, False, True),
        ([], 30, 1, True, True),  # tail only
        ([], 20, 8, True, True),
        ([40, 9], 3, 8, True, False),  # tail shorter than the window: segments only
        ([], 3, 8, True, False),  # ... and no segments: first rows see nothing (zeros)
        ([50], 12, 6, False, True),  # non-causal window
        ([5000, 777], 130, 1, True, True),  # multi-tile chunks
        ([20000], 64, 4, True, True),
    ],
)
def test_edges(
    seg_rows: list[int], tail_rows: int | None, n_q: int, causal: bool, stock: bool
) -> None:
    q, segs, tail = _problem(len(seg_rows) + n_q, seg_rows, tail_rows, n_q=n_q)
    got = FusedCudaRoute()(q, segs, tail, scale=128**-0.5, causal=causal)
    _check(got, q, segs, tail, causal, stock=stock)


@pytest.mark.gpu
@needs_gpu
def test_nothing_to_attend_is_zeros() -> None:
    q, _, _ = _problem(1, [], None, n_q=2)
    got = FusedCudaRoute()(q, [], None, scale=0.1, causal=True)
    assert mx.array_equal(got, mx.zeros_like(q)).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n_q", [1, 8])
def test_views_are_read_in_place(n_q: int) -> None:
    """Tail sliced from a bigger buffer, prefix-view segments, strided queries and a
    piece whose head_dim is not the contiguous axis (the kernel's slow load path)."""
    key = mx.random.split(mx.random.key(11), 6)
    buf_k, buf_v = _kv(key[0], 1, 2, 256, 128, mx.bfloat16)
    tail = (buf_k[:, :, :37], buf_v[:, :, :37])  # as segserve.kv.segmented hands it over
    big_k, big_v = _kv(key[1], 1, 2, 500, 128, mx.bfloat16)
    prefix = (big_k[:, :, :321], big_v[:, :, :321])  # Segment.prefix view
    tk, tv = _kv(key[2], 1, 2, 128, 90, mx.bfloat16)  # [.., D=128, S=90] -> swap
    strided = (tk.swapaxes(2, 3), tv.swapaxes(2, 3))  # d stride 90: scalar loads
    plain = _kv(key[3], 1, 2, 60, 128, mx.bfloat16)
    q = mx.random.normal((1, n_q, 8, 128), key=key[4]).astype(mx.bfloat16).swapaxes(1, 2)
    segs = [prefix, strided, plain]
    got = FusedCudaRoute()(q, segs, tail, scale=128**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
def test_batch_of_two() -> None:
    q, segs, tail = _problem(21, [90, 45], 10, b=2, n_q=3)
    got = FusedCudaRoute()(q, segs, tail, scale=128**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("seg_rows", "n_q"), [([300, 20, 5], 1), ([300, 20, 5], 7), ([30] * 20, 2)]
)
def test_two_pass_merge(seg_rows: list[int], n_q: int) -> None:
    q, segs, tail = _problem(31 + n_q, seg_rows, 16, n_q=n_q)
    got = FusedCudaRoute(merge="two_pass")(q, segs, tail, scale=128**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
def test_many_calls_in_one_graph_and_determinism() -> None:
    """Independent launches share the counter array (by regions): all must be right."""
    route = FusedCudaRoute()
    cases = [_problem(100 + i, [200 + i, 31], 5, n_q=1 + i % 4) for i in range(40)]
    outs = [route(q, s, t, scale=128**-0.5, causal=True) for q, s, t in cases]
    mx.eval(outs)
    for (q, s, t), got in zip(cases, outs, strict=True):
        _check(got, q, s, t, True, stock=False)
    again = route(*cases[0][:2], cases[0][2], scale=128**-0.5, causal=True)
    assert mx.array_equal(again, outs[0]).item()
    # Every counter is back to zero once the launches are done (no fill launch needed).
    regions = route._regions
    assert regions and all(_scalar(r.max()) == 0 for r in regions)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(("seg_rows", "n_q"), [([900, 40, 7], 1), ([900, 40, 7], 6)])
def test_three_stage_pipeline(d: int, seg_rows: list[int], n_q: int) -> None:
    q, segs, tail = _problem(51 + d + n_q, seg_rows, 30, d=d, n_q=n_q)
    got = FusedCudaRoute(stages=3, min_chunk_rows=64)(q, segs, tail, scale=d**-0.5, causal=True)
    _check(got, q, segs, tail, True)


@pytest.mark.gpu
@needs_gpu
def test_unsupported_calls_delegate_to_composed() -> None:
    q, segs, tail = _problem(41, [64, 10], 4, n_q=20)  # L=20 > the route's max_window
    got = FusedCudaRoute(max_window=16)(q, segs, tail, scale=0.1, causal=True)
    assert mx.array_equal(got, attend_segments(q, segs, tail, scale=0.1, causal=True)).item()
    q32, segs32, tail32 = _problem(42, [64, 10], 4, dtype=mx.float32)
    got32 = FusedCudaRoute()(q32, segs32, tail32, scale=0.1, causal=True)
    want32 = attend_segments(q32, segs32, tail32, scale=0.1, causal=True)
    assert mx.array_equal(got32, want32).item()


@needs_gpu
@pytest.mark.parametrize(
    ("wide", "pair_keys"), [(False, 0), (True, 0), (True, 64)], ids=["narrow", "wide", "paired"]
)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("n_win,tail_rows", [(64, 64), (256, 300), (256, 256), (300, 1200)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_windows_match_reference(
    n_win: int, tail_rows: int, group: int, dtype: mx.Dtype, wide: bool, pair_keys: int
) -> None:
    # Prefill chunks as sub-windows: causal tail bottom-right aligned, several segments.
    q, segs, tail = _problem(n_win + group, [700, 1, 2100], tail_rows, n_q=n_win, group=group, dtype=dtype)
    route = FusedCudaRoute(max_window=1024, wide=wide, pair_keys=pair_keys)
    assert route.accepts(q, segs, tail)[0]
    _check(route(q, segs, tail, scale=q.shape[-1] ** -0.5, causal=True), q, segs, tail, True)


def test_route_window_limit() -> None:
    # The kernel serves windows up to MAX_WINDOW; a route object may take fewer (wider ones
    # then go to the composed route, which tiles them).
    assert supports(128, 32, 8, mx.bfloat16, 17)[0]
    assert not supports(128, 32, 8, mx.bfloat16, MAX_WINDOW + 1)[0]
    with pytest.raises(ValueError):
        FusedCudaRoute(max_window=0)
    assert FusedCudaRoute().max_window == DEFAULT_MAX_WINDOW


@pytest.mark.parametrize("n_win", [1, 8, 16, 256, 300, 1024])
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(32, 8, 128), (9, 3, 64), (16, 16, 256)])
def test_scratch_bytes_bounds_every_launch_plan(n_win: int, n_q: int, n_kv: int, d: int) -> None:
    # What admission prices for one call must cover the workspace of any plan the route
    # makes for that window, whatever the history and piece count.
    route = FusedCudaRoute()
    bound = route.scratch_bytes(n_q, n_kv, d, n_win)
    win, n_windows = query_windows(n_win, n_q // n_kv)
    resident = route.sm_count * fused_cuda.BLOCKS_PER_SM[(d, route.stages)]
    for rows in ([1], [64, 1], [130_000, 7], [5000] * 16 + [3], [1] * 17, [300_000, 20_000, 64]):
        plan = plan_launch(rows, n_kv * n_windows, (n_q // n_kv) * win, resident, route.min_chunk_tiles)
        assert plan.ws_floats(d) * 4 <= bound, (rows, plan)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_wide_available_on_gpu(d: int) -> None:
    for dtype in (mx.bfloat16, mx.float16):
        for pair_keys in (0, *fused_cuda.PAIR_KEYS):
            ok, reason = fused_cuda.wide_available(d, dtype, pair_keys)
            assert ok, (pair_keys, reason)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    ("seg_rows", "tail_rows", "n_q", "group", "stock"),
    [
        ([5000, 777], 130, 64, 4, True),  # multi-tile chunks, partial last tiles
        ([130, 1, 77], 20, 13, 4, True),  # 52 rows (smallest wide launch), tiny pieces
        ([300], 200, 200, 3, True),  # G=3: 21 positions x 3 = 63 rows, padded last window
        ([40, 9], 3, 16, 4, False),  # tail shorter than the window: hidden steps skipped
        ([], 300, 256, 4, True),  # tail only, causal (half the steps fully hidden)
        ([20000], 64, 32, 8, True),
    ],
)
def test_wide_matches_reference(
    seg_rows: list[int], tail_rows: int, n_q: int, group: int, stock: bool, d: int, dtype: mx.Dtype
) -> None:
    q, segs, tail = _problem(
        len(seg_rows) * 31 + n_q + d, seg_rows, tail_rows, d=d, group=group, n_q=n_q, dtype=dtype
    )
    for pair_keys in (0, *fused_cuda.PAIR_KEYS):  # one window per block, then paired
        for merge in ("in_kernel", "two_pass"):
            route = FusedCudaRoute(wide=True, merge=merge, pair_keys=pair_keys)
            _check(route(q, segs, tail, scale=d**-0.5, causal=True), q, segs, tail, True, stock=stock)
        # many chunks, 3 stages
        small = FusedCudaRoute(wide=True, min_chunk_rows=TILE, stages=3, pair_keys=pair_keys)
        _check(small(q, segs, tail, scale=d**-0.5, causal=True), q, segs, tail, True, stock=stock)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_admission_bounds_the_planned_workspace(group: int) -> None:
    # Admission prices a fused call's partials from (positions, keys, pieces) alone
    # (`fused_workspace_bytes` over `workspace_terms`); the launch plan must never need more.
    # Not absurdly more either: within ~3x plus a few slots per position.
    from segserve.server.scheduling.admission import fused_workspace_bytes

    route = FusedCudaRoute()
    d, n_kv = 128, 8
    n_q = n_kv * group
    per_slot, chunk_rows, window, max_pieces, wave = route.workspace_terms(n_q, n_kv, d)
    rng = random.Random(group)
    for _ in range(300):
        positions = rng.choice([1, 2, 8, 16, 64, 255, 256, 512])
        n_pieces = rng.randint(1, max_pieces)
        rows = [rng.randint(1, 40_000) for _ in range(n_pieces)]
        win, n_windows = query_windows(positions, group)
        plan = plan_launch(rows, n_kv * n_windows, group * win, wave, route.min_chunk_tiles)
        need = plan.ws_floats(d) * 4
        bound = fused_workspace_bytes(
            positions, sum(rows), n_pieces, per_slot, chunk_rows, window, wave, n_kv
        )
        assert need <= bound, (positions, rows)
        # What admission reserves: the smaller of this and the any-history bound.
        priced = min(bound, route.scratch_bytes(n_q, n_kv, d, positions))
        assert need <= priced <= 3 * need + per_slot * n_windows * win * (n_pieces + 4), (positions, rows)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("d", "n_q", "wide", "pair_keys"),
    [
        (128, 1, False, 0),  # decode, narrow path
        (256, 1, False, 0),  # Gemma 2's head size (narrow at every L)
        (128, 5, False, 0),  # a verify window
        (256, 64, True, 64),  # a prefill chunk at D=256: narrow
        (128, 256, True, 0),  # prefill, unpaired wide path
        (128, 256, True, 64),  # prefill, paired wide path
        (64, 256, True, 32),  # paired, 32 keys per update
    ],
)
def test_soft_capped_scores_equal_the_composed_route(d: int, n_q: int, wide: bool, pair_keys: int) -> None:
    """Gemma 2's cap (C * tanh(s / C) on every scaled score) inside the kernels, against
    the composed route's own capping in float32; the cap is small enough to change the
    output, so a kernel that skipped it would fail."""
    cap = 2.0
    q, segs, tail = _problem(50 + n_q, [700, 90], max(n_q, 9), d=d, n_q=n_q)
    q = (q.astype(mx.float32) * 4).astype(q.dtype)  # scaled scores well past the cap
    route = FusedCudaRoute(wide=wide, pair_keys=pair_keys, softcap=cap)
    got = route(q, segs, tail, scale=d**-0.5, causal=True, softcap=cap).astype(mx.float32)
    assert tail is not None
    with mx.stream(mx.cpu):

        def f32(kv: KVPair) -> KVPair:
            return kv[0].astype(mx.float32), kv[1].astype(mx.float32)

        args = (q.astype(mx.float32), [f32(kv) for kv in segs], f32(tail))
        want = attend_segments(*args, scale=d**-0.5, causal=True, softcap=cap)
        plain = attend_segments(*args, scale=d**-0.5, causal=True)
        mx.eval(want, plain)
    err = _scalar(mx.abs(got - want).max())
    assert err <= TOL[mx.bfloat16], f"max abs error {err:.3g} against the composed route"
    assert _scalar(mx.abs(plain - want).max()) > 10 * TOL[mx.bfloat16]
    with pytest.raises(ValueError, match="soft cap"):
        route(q, segs, tail, scale=d**-0.5, causal=True)  # a route serves its own cap only
