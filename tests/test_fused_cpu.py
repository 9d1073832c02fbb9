"""The fused CPU route (one MLX op, kernels/native) vs stock SDPA over the concatenated K/V.

Same contract and tolerances as the composed route (tests/test_kernels_composed.py, whose
reference and case helpers are reused). Every SIMD body this CPU can run is exercised
(`_segattn.supported_isas()`: avx2 / avx512 / generic on x86-64), one and two threads
(two threads split the keys of a decode step and merge them). Skipped as a whole, with the
reason, only when the extension is not built (`python -m segserve.kernels.native.build`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import pytest

from segserve.kernels import fused_cpu
from segserve.kernels.composed import KVPair

_OK, _WHY = fused_cpu.available()
if not _OK:
    pytest.skip(f"fused_cpu extension unavailable: {_WHY}", allow_module_level=True)

from segserve.kernels.factory import select_route  # noqa: E402
from segserve.kernels.fused_cpu import FusedCpuRoute  # noqa: E402
from segserve.kernels.native import _segattn  # noqa: E402
from segserve.kernels.selfcheck import self_check  # noqa: E402
from tests.test_kernels_composed import (  # noqa: E402
    DTYPES,
    LAYOUTS,
    TOL,
    kv,
    queries,
    reference,
    scalar,
)

ISAS = _segattn.supported_isas()


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    isa, threads = _segattn.isa(), _segattn.threads()
    yield
    _segattn.set_isa(isa)
    _segattn.set_threads(threads)


def no_fallback(*args: Any, **kwargs: Any) -> mx.array:
    raise AssertionError("the fused op did not serve this call (fell back to composed)")


ROUTE = FusedCpuRoute(fallback=no_fallback)


def tail_view(rows: int, n_kv: int = 2, dim: int = 64, dtype: mx.Dtype = mx.float32, b: int = 1) -> KVPair:
    """A tail as the segmented cache hands it over: the first `rows` of a bigger buffer,
    so the row stride inside a head differs from the head stride."""
    k, v = kv(rows + 37, n_kv, dim, dtype, b)
    return k[:, :, :rows, :], v[:, :, :rows, :]


def check(
    q: mx.array,
    segments: Sequence[KVPair],
    tail: KVPair | None,
    causal: bool = True,
    route: FusedCpuRoute = ROUTE,
) -> mx.array:
    scale = q.shape[-1] ** -0.5
    got = route(q, segments, tail, scale=scale, causal=causal)
    want = reference(q, segments, tail, scale, causal)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not mx.isnan(got).any().item()
    err = scalar(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert err <= TOL[q.dtype], f"max abs error {err} > {TOL[q.dtype]}"
    return got


# --- differential vs stock SDPA ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n_q", [1, 8])
def test_segment_layouts_match_stock(layout: tuple[int, ...], n_q: int, dtype: mx.Dtype) -> None:
    # 1 to 13 segments (empty and one-row ones) plus a strided tail longer than L.
    segments = [kv(r, dtype=dtype) for r in layout]
    check(queries(8, n_q, dtype=dtype), segments, tail_view(n_q + 3, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("n_kv", "n_q"), [(2, 2), (2, 4), (2, 8), (2, 16), (1, 8), (3, 9)])
def test_head_dims_and_gqa_match_stock(head_dim: int, n_kv: int, n_q: int, dtype: mx.Dtype) -> None:
    # G = n_q / n_kv from 1 to 8; decode and an 8-row causal window.
    segments = [kv(r, n_kv, head_dim, dtype) for r in (50, 1, 0, 20)]
    tail = tail_view(9, n_kv, head_dim, dtype)
    for n_rows in (1, 8):
        check(queries(n_q, n_rows, head_dim, dtype), segments, tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [64, 300])
def test_long_windows_match_stock(n_q: int, causal: bool, dtype: mx.Dtype) -> None:
    # Prefill-sized windows: several row blocks and key tiles, causal tail longer than L.
    segments = [kv(r, 3, 64, dtype) for r in (130, 0, 70)]
    check(queries(9, n_q, 64, dtype), segments, tail_view(n_q + 20, 3, 64, dtype), causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [1, 8, 64])
@pytest.mark.parametrize("tail_rows", [None, 0, 1, 20])
def test_tail_variants_match_stock(tail_rows: int | None, n_q: int, causal: bool) -> None:
    # tail_rows < L leaves rows that see only the segments.
    tail = None if tail_rows is None else tail_view(tail_rows, 2)
    check(queries(4, n_q), [kv(30), kv(1), kv(12)], tail, causal=causal)


@pytest.mark.parametrize("n_q", [1, 8, 300])
def test_tail_only_matches_stock(n_q: int) -> None:
    check(queries(4, n_q), [kv(0)], tail_view(n_q + 5))


def test_rows_that_see_nothing_are_zeros() -> None:
    # No segments, tail shorter than the window: rows 0..L-T-1 see no key -> exact zeros.
    q, tail = queries(4, 6), tail_view(2)
    got = check(q, [], tail)
    assert mx.array_equal(got[:, :, :4], mx.zeros_like(got[:, :, :4])).item()
    assert scalar(mx.abs(got[:, :, 4:]).max()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [None, 0])
def test_all_empty_gives_zeros(dtype: mx.Dtype, tail: int | None) -> None:
    q = queries(8, 4, dtype=dtype)
    t = None if tail is None else kv(tail, dtype=dtype)
    got = ROUTE(q, [kv(0, dtype=dtype), kv(0, dtype=dtype)], t, scale=0.1, causal=True)
    assert got.dtype == dtype and got.shape == q.shape
    assert mx.array_equal(got, mx.zeros_like(q)).item()


def test_batch_of_two_matches_stock() -> None:
    segments = [kv(r, b=2) for r in (17, 1, 40)]
    check(queries(4, 4, b=2), segments, tail_view(6, b=2))


def test_strided_queries_and_keys_match_stock() -> None:
    # Queries as the model makes them ([B, L, H, D] transposed: the head stride is D) and
    # K/V whose head_dim is not unit-stride (a transposed buffer): read through strides.
    q = mx.random.normal((1, 5, 8, 64)).transpose(0, 2, 1, 3)  # q: [1, 8, 5, 64] view
    k_t = mx.random.normal((1, 2, 64, 90))
    v_t = mx.random.normal((1, 2, 64, 90))
    seg = (k_t.swapaxes(-1, -2), v_t.swapaxes(-1, -2))  # [1, 2, 90, 64], d-stride 90
    check(q, [seg, kv(33)], tail_view(7))


def test_decode_steps_with_a_growing_tail() -> None:
    segments = [kv(25), kv(9)]
    k, v = kv(40)
    for rows in range(1, 6):  # the tail grows one row per step inside one buffer
        check(queries(4, 1), segments, (k[:, :, :rows], v[:, :, :rows]))


# --- every SIMD body, one and two threads ---------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_and_thread_count_matches_stock(isa: str, threads: int, dtype: mx.Dtype) -> None:
    _segattn.set_isa(isa)
    _segattn.set_threads(threads)
    for head_dim in (64, 128, 256):
        segments = [kv(r, 3, head_dim, dtype) for r in (1100, 1, 0, 1000)]  # > 2 tiles per split
        tail = tail_view(13, 3, head_dim, dtype)
        for n_rows in (1, 8):  # decode splits the keys over two threads (3 kv heads)
            check(queries(9, n_rows, head_dim, dtype), segments, tail)
    check(queries(2, 37, 64, dtype), [kv(5, dtype=dtype)], tail_view(40, dtype=dtype))


def test_default_isa_is_supported() -> None:
    assert _segattn.isa() in ISAS and ISAS[-1] == "generic"
    with pytest.raises(ValueError):
        _segattn.set_isa("no-such-isa")


# --- one op, no gather, compiles ------------------------------------------------------------


def test_route_never_concatenates(monkeypatch: pytest.MonkeyPatch) -> None:
    segments = [kv(r) for r in (200, 1, 64, 0, 130)]
    tail, q = tail_view(20), queries(8, 4)
    want = reference(q, segments, tail, 0.125, True)  # concatenates: before the patch

    def no_join(*args: object, **kwargs: object) -> mx.array:
        raise AssertionError("the route gathered arrays")

    monkeypatch.setattr(mx, "concatenate", no_join)
    monkeypatch.setattr(mx, "stack", no_join)
    got = ROUTE(q, segments, tail, scale=0.125, causal=True)
    mx.eval(got)
    monkeypatch.undo()
    assert scalar(mx.abs(got - want).max()) <= TOL[mx.float32]


@pytest.mark.parametrize("shapeless", [False, True])
def test_op_inside_mx_compile(shapeless: bool) -> None:
    segments = [kv(r) for r in (30, 7)]
    k, v = kv(20)
    mx.eval(segments, k, v)  # captured by the compiled function as constants

    def step(q: mx.array, tk: mx.array, tv: mx.array) -> mx.array:
        return ROUTE(q * 1.0, segments, (tk, tv), scale=0.125, causal=True) + 0.0

    fn = mx.compile(step, shapeless=shapeless)
    for rows, n_q in ((5, 1), (9, 1), (12, 4)):  # shapeless: one trace, several shapes
        q = queries(4, n_q)
        tail = (k[:, :, :rows], v[:, :, :rows])
        got = fn(q, *tail)
        want = reference(q, segments, tail, 0.125, True)
        assert scalar(mx.abs(got - want).max()) <= TOL[mx.float32]


# --- what the op does not serve goes to the composed route ---------------------------------


def test_unserved_calls_fall_back_to_composed() -> None:
    seen: list[str] = []

    def spy(q: mx.array, segs: Sequence[KVPair], tail: KVPair | None, **kw: Any) -> mx.array:
        from segserve.kernels.composed import attend_segments

        seen.append(f"{q.dtype} {q.shape[-1]}")
        return attend_segments(q, segs, tail, **kw)

    route = FusedCpuRoute(fallback=spy)
    check(queries(4, 2, dim=96), [kv(10, dim=96)], tail_view(3, dim=96), route=route)  # head_dim
    seg32 = kv(10)
    out = route(queries(4, 1, dtype=mx.float16), [seg32], None, scale=0.125, causal=True)  # f32 K/V, f16 Q
    assert out.shape == (1, 4, 1, 64) and len(seen) == 2


# --- factory, self-check, inside a model -----------------------------------------------------


def test_factory_picks_fused_cpu_on_cpu() -> None:
    choice = select_route("cpu", head_dim=64, n_q_heads=9, n_kv_heads=3, dtype=mx.float32)
    assert choice.name == "fused_cpu" and isinstance(choice.route, FusedCpuRoute)
    other = select_route("cpu", head_dim=96, n_q_heads=9, n_kv_heads=3, dtype=mx.float32)
    assert other.name == "composed"


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_check_passes_fused_cpu_at_smollm2_shapes(dtype: mx.Dtype) -> None:
    result = self_check(FusedCpuRoute(), n_q_heads=9, n_kv_heads=3, head_dim=64, dtype=dtype)
    assert result.ok, result.detail


def test_segmented_llama_through_hook_matches_stock_greedy() -> None:
    from mlx_lm.models.cache import KVCache

    from segserve.kernels import hook
    from segserve.kv.segmented import SegmentedCache
    from tests.test_hook_models import _greedy, _model

    model = _model("llama")
    hook.install(model)
    prompt = [(11 * i) % 250 + 1 for i in range(40)]
    stock = _greedy(model, [KVCache() for _ in range(2)], prompt, 10)
    seg = SegmentedCache(2, fanout=100, route=FusedCpuRoute(fallback=no_fallback))

    def record_and_seal(tokens: list[int]) -> None:
        seg.record_tokens(tokens)
        if len(tokens) > 1 or seg.offset % 3 == 0:  # seal often: many segments + tail
            seg.seal()

    assert _greedy(model, list(seg.layers), prompt, 10, record_and_seal) == stock
    assert len(seg.base.segments) >= 2
