"""Soft-capped attention logits (gemma2) served over segments.

Differential tests: the composed route with `softcap` against the model's own formula over
the concatenated K/V (`reference_attention`: scaled scores, cap * tanh(s / cap), mask,
softmax), decode and prefill, one-graph and tiled, with a window; a tiny random gemma2
served segmented (sealing often: many segments and a tail) gives the greedy tokens of
mlx-lm's own attention on its KVCache, directly and through the engine; the start-up
self-check catches a route that ignores the cap; the route factory picks the composed
route for a capped model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models import gemma2
from mlx_lm.models.cache import KVCache

from segserve.kernels.composed import KVPair, attend_segments
from segserve.kernels.factory import ComposedRoute, select_route
from segserve.kernels.hook import (
    RoutedGemma2Attention,
    install,
    installed,
    layer_windows,
    support_check,
)
from segserve.kernels.selfcheck import reference_attention, self_check
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import ChatTokenizer, SamplingParams, logits_last, model_shape
from segserve.server.runtime import choose_kv
from tests.conftest import tiny_loaded
from tests.engine_support import make_engine, run

CAP = 5.0  # small against the scores below, so the cap changes the result
# float32 matmuls on a CUDA GPU run as TF32 (10-bit mantissa inputs): ~1e-3 relative.
F32_TOL = 2e-5 if mx.default_device() == mx.cpu else 2e-3


def _kv(key: mx.array, rows: int, dtype: mx.Dtype) -> KVPair:
    a, b = mx.random.split(key)
    return (mx.random.normal((1, 2, rows, 64), key=a).astype(dtype),
            mx.random.normal((1, 2, rows, 64), key=b).astype(dtype))


def _problem(seed: int, seg_rows: tuple[int, ...], tail_rows: int, n_q: int,
             dtype: mx.Dtype = mx.float32) -> tuple[mx.array, list[KVPair], KVPair]:
    keys = mx.random.split(mx.random.key(seed), len(seg_rows) + 2)
    segs = [_kv(keys[i], r, dtype) for i, r in enumerate(seg_rows)]
    tail = _kv(keys[-2], tail_rows, dtype)
    q = 3.0 * mx.random.normal((1, 4, n_q, 64), key=keys[-1])  # scores well past the cap
    return q.astype(dtype), segs, tail


def _want(q: mx.array, segs: list[KVPair], tail: KVPair, causal: bool, softcap: float) -> mx.array:
    k = mx.concatenate([s[0] for s in segs] + [tail[0]], axis=2)
    v = mx.concatenate([s[1] for s in segs] + [tail[1]], axis=2)
    mask = "causal" if causal and q.shape[2] > 1 else None
    return reference_attention(q, k, v, scale=0.125, mask=mask, softcap=softcap)


def _err(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype,tol", [(mx.float32, F32_TOL), (mx.float16, 4e-3)])
@pytest.mark.parametrize("seg_rows,tail_rows,n_q", [
    ((), 9, 1), ((), 9, 5), ((20,), 7, 1), ((20, 1, 33), 7, 4), ((20, 33), 12, 12),
])
def test_route_matches_the_capped_formula(dtype: mx.Dtype, tol: float, seg_rows: tuple[int, ...],
                                          tail_rows: int, n_q: int) -> None:
    q, segs, tail = _problem(len(seg_rows) + n_q, seg_rows, tail_rows, n_q, dtype)
    want = _want(q, segs, tail, True, CAP)
    for compiled in (True, False):
        got = attend_segments(q, segs, tail, scale=0.125, causal=True, compiled=compiled, softcap=CAP)
        assert got.dtype == q.dtype and _err(got, want) <= tol
    # The cap matters here: the uncapped attention is far from it.
    assert _err(_want(q, segs, tail, True, 0.0), want) > 50 * tol


def test_tiled_walk_and_window_keep_the_cap() -> None:
    q, segs, tail = _problem(3, (40, 70), 16, 6)
    want = _want(q, segs, tail, True, CAP)
    got = attend_segments(q, segs, tail, scale=0.125, causal=True, softcap=CAP, scratch_elements=64 * 4 * 6)
    assert _err(got, want) <= F32_TOL
    # A window of 30 keys: the same formula with mlx-lm's window mask.
    from mlx_lm.models.base import create_causal_mask

    k = mx.concatenate([s[0] for s in segs] + [tail[0]], axis=2)
    v = mx.concatenate([s[1] for s in segs] + [tail[1]], axis=2)
    mask = create_causal_mask(6, k.shape[2] - 6, window_size=30)
    want_w = reference_attention(q, k, v, scale=0.125, mask=mask, softcap=CAP)
    got_w = attend_segments(q, segs, tail, scale=0.125, causal=True, softcap=CAP, window=30)
    assert _err(got_w, want_w) <= F32_TOL


def test_self_check_holds_the_route_to_the_cap() -> None:
    def check(route: Any) -> Any:
        # float16 on a GPU: its TF32 float32 matmuls miss the float32 tolerance (2e-5).
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
        return self_check(route, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=dtype, softcap=CAP)

    assert check(ComposedRoute()).ok

    class Uncapped:
        name = "uncapped"

        def __call__(self, queries: mx.array, segments: Any, tail: Any, *, scale: float, causal: bool,
                     softcap: float = 0.0) -> mx.array:
            return attend_segments(queries, segments, tail, scale=scale, causal=causal)

    verdict = check(Uncapped())
    assert not verdict.ok and "softcap=5" in verdict.detail


def test_a_capped_model_gets_a_route_that_caps_on_each_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA route compiles the cap into its kernels (the GPU test of the kernels:
    # tests/test_fused_cuda.py::test_soft_capped_scores_equal_the_composed_route); the CPU
    # op caps per call (test_cpu_op_caps_*); elsewhere only the composed route caps.
    from segserve.kernels import fused_cuda
    from segserve.kernels.factory import FusedRouteSpec, RouteQuery

    seen: list[RouteQuery] = []

    def build(q: RouteQuery) -> ComposedRoute:
        seen.append(q)
        return ComposedRoute(name="fake_cuda")

    fake = (FusedRouteSpec("fake_cuda", applies=lambda q: q.backend == "cuda", build=build),)
    choice = select_route("cuda", head_dim=64, n_q_heads=4, n_kv_heads=2, dtype=mx.bfloat16, softcap=CAP,
                          registry=fake)
    assert choice.name == "fake_cuda" and seen[0].softcap == CAP
    monkeypatch.setattr(fused_cuda, "wide_available", lambda d, t, k=0: (True, "stand-in"))
    assert fused_cuda.build(seen[0]).softcap == CAP
    choice = select_route("metal", head_dim=64, n_q_heads=4, n_kv_heads=2, dtype=mx.float32, softcap=CAP)
    assert choice.name == "composed" and "soft-capped at 5" in choice.reason


def _gemma2(seed: int = 0, layers: int = 2) -> gemma2.Model:
    mx.random.seed(seed)
    model = gemma2.Model(gemma2.ModelArgs(
        model_type="gemma2", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, head_dim=64, rms_norm_eps=1e-6, vocab_size=256,
        num_key_value_heads=2, attn_logit_softcapping=CAP, query_pre_attn_scalar=64.0,
    ))
    # Larger weights: scores past the cap, greedy choices well separated.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def _logits(model: nn.Module, caches: list[Any], tokens: list[int], seg: SegmentedCache | None = None) -> mx.array:
    """Logits after the first 21 tokens, then after each further one (teacher-forced):
    [n - 20, V]. With `seg`, rows are sealed often: many segments and a tail."""
    def after(chunk: list[int]) -> None:
        if seg is not None:
            seg.record_tokens(chunk)
            if len(chunk) > 1 or seg.offset % 3 == 0:
                seg.seal()

    rows = [logits_last(model, tokens[:21], caches)]
    after(tokens[:21])
    for tok in tokens[21:]:
        rows.append(logits_last(model, [tok], caches))
        after([tok])
    return mx.stack([r.reshape(-1) for r in rows])


def test_gemma2_is_served_over_segments_with_its_cap() -> None:
    model = _gemma2()
    verdict = support_check(model, model_shape(model))
    assert verdict.ok and verdict.softcap == CAP and "soft-capped at 5" in verdict.reason
    tokens = [(13 * i) % 250 + 1 for i in range(33)]
    want = _logits(model, [KVCache() for _ in model.layers], tokens)
    assert install(model) == ["RoutedGemma2Attention"] and installed(model)
    assert install(model) == []  # idempotent
    # Stock caches after the swap: mlx-lm's own code, the same logits.
    assert _err(_logits(model, [KVCache() for _ in model.layers], tokens), want) == 0.0
    windows = layer_windows(model)
    assert not isinstance(windows, str)
    seg = SegmentedCache(2, fanout=100, route=attend_segments, windows=windows)
    got = _logits(model, list(seg.layers), tokens, seg)
    assert len(seg.base.segments) > 3
    assert _err(got, want) <= 1e-3 * (1.0 + _err(want, mx.zeros_like(want)))
    # The cap is what makes them agree: the same cache without it is far off.
    uncapped = SegmentedCache(2, fanout=100, windows=windows,
                              route=lambda q, s, t, *, scale, causal, softcap: attend_segments(
                                  q, s, t, scale=scale, causal=causal))
    assert _err(_logits(model, list(uncapped.layers), tokens, uncapped), want) > 50 * _err(got, want) + 1e-3
    assert all(type(layer.self_attn) is RoutedGemma2Attention for layer in model.layers)


def test_gemma2_through_the_engine_matches_stock_mode(gguf_tokenizer: ChatTokenizer, make_request: Any,
                                                      settings_factory: Any) -> None:
    loaded = tiny_loaded(gguf_tokenizer, _gemma2(seed=3))
    verdict, route = choose_kv(settings_factory(), loaded)
    from segserve.kernels import fused_cpu

    want_route = "fused_cpu" if fused_cpu.available()[0] else "composed"
    assert verdict.mode == "segmented" and verdict.route == want_route and verdict.self_check_ok, verdict
    out = {}
    for segmented in (False, True):
        eng = make_engine(loaded, segmented=segmented)
        try:
            # Seeded sampling: a tiny random gemma2 repeats its input token under greedy.
            reqs = [make_request([(7 * i + 3 * j) % 250 + 1 for i in range(30 + 5 * j)], 10,
                                 sampling=SamplingParams(temperature=1.0, seed=11 + j)) for j in range(2)]
            out[segmented] = [r.tokens for r in run(eng, reqs)]
        finally:
            eng.stop()
    assert out[True] == out[False] and all(len(t) == 10 for t in out[True])
    assert len({tok for t in out[True] for tok in t}) > 2  # not one repeated token


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_last_row_and_window_logits_equal_the_models_forward(family: str) -> None:
    # The server computes logits from the trunk and the head (the last row, or a verify
    # window); what the model's own forward does after the head (gemma2's soft cap,
    # granite's scaling) must follow. Quantized, as a GGUF is served: the tied head is
    # found and routed instead of the forward's full-width product.
    from segserve.kernels import qmm_cpu
    from segserve.server.runner.model import tied_head
    from segserve.server.spec.verify import logits_window
    from tests.test_batched_families import make_family

    model = make_family(family)
    nn.quantize(model, group_size=32, bits=8)
    assert tied_head(model)  # gemma2 always ties (no flag); granite by its args here
    if qmm_cpu.available()[0]:
        qmm_cpu.install(model, model_shape(model))
    tokens = [3, 17, 99, 5, 250, 41]
    want = model(mx.array([tokens]), cache=None)[0]
    got_last = logits_last(model, tokens, [KVCache() for _ in model.layers])
    got_window = logits_window(model, tokens, [KVCache() for _ in model.layers])
    scale = 1.0 + _err(want, mx.zeros_like(want))
    assert _err(got_last, want[-1]) <= 1e-4 * scale and _err(got_window, want) <= 1e-4 * scale


needs_op = pytest.mark.skipif(not __import__("segserve.kernels.fused_cpu", fromlist=["available"]).available()[0],
                              reason="native extension not built")


@needs_op
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-5), (mx.float16, 4e-3)])
@pytest.mark.parametrize("seg_rows,tail_rows,n_q", [
    ((), 9, 1), ((), 9, 5), ((20,), 7, 1), ((20, 1, 33), 7, 4), ((200, 90), 12, 12), ((700,), 3, 1),
])
def test_cpu_op_caps_its_scores(dtype: mx.Dtype, tol: float, seg_rows: tuple[int, ...], tail_rows: int,
                                n_q: int) -> None:
    from segserve.kernels.fused_cpu import FusedCpuRoute

    def no_fallback(*_a: Any, **_k: Any) -> mx.array:
        raise AssertionError("the op must serve these inputs itself")

    route = FusedCpuRoute(fallback=no_fallback)
    with mx.stream(mx.cpu):
        q, segs, tail = _problem(len(seg_rows) + 7 * n_q, seg_rows, tail_rows, n_q, dtype)
        want = _want(q, segs, tail, True, CAP)
        got = route(q, segs, tail, scale=0.125, causal=True, softcap=CAP)
        assert got.dtype == q.dtype and _err(got, want) <= tol
        assert _err(route(q, segs, tail, scale=0.125, causal=True), want) > 50 * tol  # the cap is used
        if dtype == mx.float32:  # extreme scores saturate to +-cap, never NaN
            big = route(q * 1e4, segs, tail, scale=0.125, causal=True, softcap=CAP)
            assert _err(big, _want(q * 1e4, segs, tail, True, CAP)) <= 10 * tol


@needs_op
def test_every_isa_caps_the_same() -> None:
    from segserve.kernels.fused_cpu import FusedCpuRoute
    from segserve.kernels.native import _segattn

    before = _segattn.isa()
    route = FusedCpuRoute()
    try:
        with mx.stream(mx.cpu):
            q, segs, tail = _problem(9, (37, 5), 11, 3)
            want = _want(q, segs, tail, True, CAP)
            for isa in _segattn.supported_isas():
                _segattn.set_isa(isa)
                assert _err(route(q, segs, tail, scale=0.125, causal=True, softcap=CAP), want) <= 2e-5, isa
    finally:
        _segattn.set_isa(before)


@needs_op
def test_cpu_op_caps_with_a_window_and_passes_the_self_check() -> None:
    from mlx_lm.models.base import create_causal_mask

    from segserve.kernels.fused_cpu import FusedCpuRoute

    route = FusedCpuRoute()
    with mx.stream(mx.cpu):
        q, segs, tail = _problem(5, (40, 70), 16, 6)
        k = mx.concatenate([s[0] for s in segs] + [tail[0]], axis=2)
        v = mx.concatenate([s[1] for s in segs] + [tail[1]], axis=2)
        mask = create_causal_mask(6, k.shape[2] - 6, window_size=30)
        want = reference_attention(q, k, v, scale=0.125, mask=mask, softcap=CAP)
        got = route(q, segs, tail, scale=0.125, causal=True, softcap=CAP, window=30)
        assert _err(got, want) <= 2e-5
        assert self_check(route, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32, softcap=CAP).ok
        choice = select_route("cpu", head_dim=64, n_q_heads=4, n_kv_heads=2, dtype=mx.float32, softcap=CAP)
        assert choice.name == "fused_cpu"


def test_a_capped_model_without_a_capping_kernel_is_served_in_stock_mode(gguf_tokenizer: ChatTokenizer,
                                                                   settings_factory: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Where neither the CPU op nor the CUDA kernels serve, only the composed route caps
    # scores, slower than stock there: stock mode, with the reason.
    from segserve.server import runtime

    loaded = tiny_loaded(gguf_tokenizer, _gemma2(seed=4))
    monkeypatch.setattr(runtime, "current_backend", lambda: "metal")
    verdict, route = choose_kv(settings_factory(), loaded)
    assert route is None and verdict.mode == "stock" and verdict.supported
    assert "soft-capped (5)" in verdict.reason and "on metal" in verdict.reason
