"""Sliding-window layers served over segments (Gemma 3's local layers, Laguna's SWA).

Differential tests of the windowed routes against stock SDPA over the concatenated K/V with
mlx-lm's window mask (query at p sees keys (p - W, p]); end-to-end, tiny random-weight
gemma3 models served segmented give the greedy tokens of mlx-lm's own RotatingKVCache path
over prompts longer than the window, across a follow-up turn and a fork; soft-capped
attention the hook does not route is refused by name.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models import gemma2, gemma3, gemma3_text, laguna
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from segserve.kernels import fused_cpu, fused_cuda
from segserve.kernels.composed import KVPair, attend_segments
from segserve.kernels.factory import ComposedRoute
from segserve.kernels.hook import install, layer_windows, support_check
from segserve.kernels.selfcheck import self_check
from segserve.kernels.window import clip_to_window
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import ChatTokenizer, logits_last, model_shape
from segserve.server.runner.gemma2_window import install_gemma2_windows
from tests.conftest import tiny_loaded
from tests.engine_support import make_engine, run

ON_CPU = mx.default_device() == mx.cpu
# Max abs error against the float32-free SDPA reference, by K/V dtype (outputs |x| < ~3):
# float32 differs by summation order only; float16 K/V round scores and P once more. A CUDA
# GPU's float32 products are TF32 (10-bit mantissa inputs): an H100 measured 4.6e-4 here.
F32_TOL = 2e-5 if ON_CPU else 2e-3
TOL = {mx.float32: F32_TOL, mx.float16: 4e-3}
# Logits of a 2-layer random model (|x| < ~8) by two computations: an H100's TF32 measured
# 8.3e-3 where the CPU's float32 stays under 1e-4.
LOGITS_TOL = 1e-4 if ON_CPU else 3e-2
FUSED_OK = fused_cpu.available()[0]


def _max_abs(diff: mx.array) -> float:
    return float(mx.abs(diff).max().item())  # type: ignore[arg-type]  # float32: item() is a float


def _kv(key: mx.array, rows: int, dtype: mx.Dtype, h: int = 2, d: int = 64) -> KVPair:
    a, b = mx.random.split(key)
    return (mx.random.normal((1, h, rows, d), key=a).astype(dtype),
            mx.random.normal((1, h, rows, d), key=b).astype(dtype))


def _problem(seed: int, seg_rows: tuple[int, ...], tail_rows: int, n_q: int,
             dtype: mx.Dtype = mx.float32) -> tuple[mx.array, list[KVPair], KVPair]:
    keys = mx.random.split(mx.random.key(seed), len(seg_rows) + 2)
    segs = [_kv(keys[i], r, dtype) for i, r in enumerate(seg_rows)]
    tail = _kv(keys[-2], tail_rows, dtype)
    q = mx.random.normal((1, 4, n_q, 64), key=keys[-1])  # float32 queries, 2 KV heads (G=2)
    return q.astype(mx.float32 if dtype == mx.float16 else dtype), segs, tail


def _reference(q: mx.array, segs: list[KVPair], tail: KVPair, window: int) -> mx.array:
    k = mx.concatenate([s[0] for s in segs] + [tail[0]], axis=2).astype(mx.float32)
    v = mx.concatenate([s[1] for s in segs] + [tail[1]], axis=2).astype(mx.float32)
    total, n_q = k.shape[2], q.shape[2]
    # mlx-lm's own mask for the last n_q positions: (p - W, p], causal.
    mask = create_causal_mask(n_q, total - n_q, window_size=window)
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=0.125, mask=mask)


def _routes() -> list[tuple[str, Any]]:
    routes: list[tuple[str, Any]] = [
        ("composed", ComposedRoute()),
        ("composed-eager", ComposedRoute(compiled=False)),
        ("composed-tiled", lambda *a, **k: attend_segments(*a, scratch_elements=64 * 8, **k)),
    ]
    if FUSED_OK:
        routes.append(("fused_cpu", fused_cpu.FusedCpuRoute()))
    return routes


# (segment rows, tail rows, query rows L): decode and prefill chunks, with empty and 1-row
# segments; windows below put the window start inside the tail, inside a segment, on a
# segment boundary, before everything (no clipping), and at W = 1.
CASES = [
    ((37, 0, 1, 20), 5, 1),
    ((37, 0, 1, 20), 16, 16),
    ((1,) * 9, 3, 1),
    ((1,) * 9, 4, 3),
    ((30, 1, 12), 24, 24),
    ((), 20, 20),
    ((64, 64), 1, 1),
]
WINDOWS = [1, 2, 4, 5, 6, 17, 21, 26, 40, 63, 200]


@pytest.mark.parametrize("name,route", _routes(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_windowed_route_matches_sdpa_with_window_mask(
    name: str, route: Any, case: tuple[tuple[int, ...], int, int], dtype: mx.Dtype
) -> None:
    seg_rows, tail_rows, n_q = case
    q, segs, tail = _problem(len(seg_rows) * 7 + tail_rows, seg_rows, tail_rows, n_q, dtype)
    for window in WINDOWS:
        got = route(q, segs, tail, scale=0.125, causal=True, window=window)
        want = _reference(q, segs, tail, window)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = _max_abs(got.astype(mx.float32) - want)
        assert err < TOL[dtype], (name, case, window, err)


def test_window_changes_the_answer() -> None:
    # The cases above would pass for any window if the window were ignored: make sure it isn't.
    q, segs, tail = _problem(3, (37, 0, 1, 20), 16, 16)
    full = attend_segments(q, segs, tail, scale=0.125, causal=True)
    windowed = attend_segments(q, segs, tail, scale=0.125, causal=True, window=17)
    assert _max_abs(full - windowed) > 0.1


def test_clip_skips_outside_slices_straddling_without_copy() -> None:
    _, segs, tail = _problem(0, (10, 0, 7, 5), 4, 1)
    view = clip_to_window(segs, tail, 1, 8)  # total 26: the query (p=25) sees 18..25
    assert view.first == 18 and view.full == 18 and not view.masked
    assert [s[0].shape[2] for s in view.segments] == [4]  # segment 3 from its row 1
    assert view.tail is not None and view.tail[0].shape[2] == 4
    prefill = clip_to_window(segs, tail, 4, 8)  # p = 22..25: first 15, full 18
    assert (prefill.first, prefill.full, prefill.masked) == (15, 18, True)
    assert [s[0].shape[2] for s in prefill.segments] == [2, 5]  # seg 2 sliced from row 5


@pytest.mark.skipif(not FUSED_OK, reason="native extension not built")
def test_fused_cpu_serves_windowed_decode_itself() -> None:
    """Decode steps (L = 1) run on the op over the clipped views, and so does a prefill
    chunk straddling a window start (the op masks each query's own window start)."""
    used: list[int] = []

    def fallback(q: mx.array, *a: Any, **k: Any) -> mx.array:
        used.append(q.shape[2])
        return attend_segments(q, *a, **k)

    route = fused_cpu.FusedCpuRoute(fallback=fallback)
    q, segs, tail = _problem(5, (37, 0, 1, 20), 5, 1)
    for window in (3, 10, 30, 200):
        route(q, segs, tail, scale=0.125, causal=True, window=window)
    assert used == []
    q, segs, tail = _problem(6, (37, 0, 1, 20), 16, 16)
    route(q, segs, tail, scale=0.125, causal=True, window=200)  # nothing straddles
    assert used == []
    route(q, segs, tail, scale=0.125, causal=True, window=30)
    assert used == []


@pytest.mark.skipif(not FUSED_OK, reason="native extension not built")
def test_fused_cpu_append_with_window_matches_plain() -> None:
    seg = SegmentedCache(1, fanout=100, route=fused_cpu.FusedCpuRoute(), windows=[6])
    plain = SegmentedCache(1, fanout=100, route=attend_segments, windows=[6])
    layer, ref = seg.layers[0], plain.layers[0]
    for step in range(20):
        key = mx.random.key(100 + step)
        q = mx.random.normal((1, 4, 1, 64), key=key)
        k, v = _kv(mx.random.split(key)[0], 1, mx.float32)
        got = layer.write_attend(q, k, v, 0.125)
        if got is None:  # the window starts inside the tail: the plain write + route
            kk, vv = layer.update_and_fetch(k, v)
            assert seg.route is not None
            got = seg.route(q, layer.segment_kv(), (kk, vv), scale=0.125, causal=False, window=6)
        kk, vv = ref.update_and_fetch(k, v)
        want = attend_segments(q, ref.segment_kv(), (kk, vv), scale=0.125, causal=False, window=6)
        assert _max_abs(got - want) < F32_TOL, step
        if step % 4 == 3:
            for c in (seg, plain):
                c.record_tokens([0] * c._written[-1])
                c.seal()


def test_fused_cuda_route_clips_before_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU plumbing of the CUDA route: a windowed decode call plans over the clipped pieces
    only (segments before the window never reach the launch); a straddling prefill chunk
    goes to the fallback with the window."""
    planned: list[tuple[int, ...]] = []
    route = fused_cuda.FusedCudaRoute(fallback=attend_segments)
    fallback_calls: list[Any] = []

    def plan(queries: mx.array, segments: Any, tail: Any, scale: float, causal: bool) -> object:
        planned.append(tuple(s[0].shape[2] for s in segments) + (tail[0].shape[2],))
        return fused_cuda._FALLBACK

    def fallback(*a: Any, **k: Any) -> mx.array:
        fallback_calls.append(k.get("window"))
        return attend_segments(*a, **k)

    monkeypatch.setattr(route, "_plan_call", plan)
    route.fallback = fallback
    q, segs, tail = _problem(7, (37, 0, 1, 20), 5, 1)
    got = route(q, segs, tail, scale=0.125, causal=True, window=10)
    assert planned == [(5, 5)]  # the last 10 keys: 5 of segment 3, then the tail
    assert _max_abs(got - _reference(q, segs, tail, 10)) < F32_TOL
    q, segs, tail = _problem(8, (37, 0, 1, 20), 16, 16)
    got = route(q, segs, tail, scale=0.125, causal=True, window=30)
    assert fallback_calls[-1] == 30 and len(planned) == 1
    assert _max_abs(got - _reference(q, segs, tail, 30)) < F32_TOL


# ---------------------------------------------------------------------------------------
# Inside real mlx-lm model code
# ---------------------------------------------------------------------------------------
WINDOW = 8


def _gemma3(layers: int = 3, pattern: int = 3, vocab: int = 256, seed: int = 2,
            window: int = WINDOW) -> nn.Module:
    mx.random.seed(seed)
    m = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=vocab,
        sliding_window=window, sliding_window_pattern=pattern, query_pre_attn_scalar=64,
        max_position_embeddings=512,
    ))
    m.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return m


def _gemma2(layers: int = 3, vocab: int = 256, seed: int = 2, window: int = WINDOW) -> nn.Module:
    """A tiny Gemma 2 (soft-capped attention and logits) with its windows: layers 0 and 2
    slide over `window` positions, layer 1 is global."""
    mx.random.seed(seed)
    m = gemma2.Model(gemma2.ModelArgs(
        model_type="gemma2", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=vocab,
        rms_norm_eps=1e-6, query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
    ))
    # x2 (not gemma3's x3): larger weights saturate the capped logits into one token.
    m.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return install_gemma2_windows(m, window)


def _greedy(model: nn.Module, caches: list[Any], prompt: list[int], n: int,
            after: Any = None) -> list[int]:
    logits = logits_last(model, prompt, caches)
    if after is not None:
        after(prompt)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        out.append(tok)
        logits = logits_last(model, [tok], caches)
        if after is not None:
            after([tok])
    return out


def _sealer(seg: SegmentedCache) -> Any:
    def after(tokens: list[int]) -> None:
        seg.record_tokens(tokens)
        if len(tokens) > 1 or seg.offset % 3 == 0:  # seal often: many segments + tail
            seg.seal()
    return after


def _seg_routes() -> list[Any]:
    return [attend_segments] + ([fused_cpu.FusedCpuRoute()] if FUSED_OK else [])


def test_gemma3_is_supported_with_its_windows() -> None:
    model = _gemma3(layers=6, pattern=3)
    verdict = support_check(model, model_shape(model))
    assert verdict.ok, verdict.reason
    assert "4 sliding-window layers" in verdict.reason and "window 8" in verdict.reason
    assert layer_windows(model) == (8, 8, None, 8, 8, None)
    wrapper = gemma3.Model(gemma3.ModelArgs(model_type="gemma3", text_config={"model_type": "gemma3_text",
        "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128, "head_dim": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8,
        "sliding_window_pattern": 3}, vocab_size=256))
    assert support_check(wrapper, model_shape(wrapper)).ok and support_check(wrapper, model_shape(wrapper)).n_q_heads == 4


def test_gemma2_is_supported_with_its_windows() -> None:
    model = _gemma2()
    assert layer_windows(model) == (8, None, 8)
    verdict = support_check(model, model_shape(model))
    assert verdict.ok and verdict.softcap == 5.0 and verdict.windows == (8,), verdict.reason
    assert "2 sliding-window layers" in verdict.reason
    # A configuration without a window leaves mlx-lm's model as it is (every layer global).
    plain = gemma2.Model(gemma2.ModelArgs(
        model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256, rms_norm_eps=1e-6))
    assert install_gemma2_windows(plain, None) is plain and type(plain) is gemma2.Model
    assert layer_windows(plain) == (None, None)


def test_gemma2_windows_match_a_whole_sequence_forward() -> None:
    """mlx-lm's rotating caches fed one token at a time give the logits of one forward over
    the whole sequence with each layer's mask of its kind (the windows' reference)."""
    model = _gemma2()
    tokens = [(11 * i) % 250 + 1 for i in range(30)]
    whole = model(mx.array([tokens]))[0]
    caches = model.make_cache()
    logits_last(model, tokens[:5], caches)
    for i in range(5, len(tokens)):
        step = logits_last(model, [tokens[i]], caches)
        assert _max_abs(step - whole[i]) < LOGITS_TOL, i


@pytest.mark.parametrize("route", _seg_routes(), ids=lambda r: getattr(r, "name", "composed"))
def test_gemma2_segmented_logits_match_rotating_cache(route: Any) -> None:
    """Logits, not just greedy tokens (a tiny Gemma 2 repeats itself): the same stream fed
    to mlx-lm's rotating caches and to segments sealed every few tokens, five windows long,
    then a follow-up chunk of several tokens after the rotating caches wrapped."""
    model = _gemma2()
    install(model)
    windows = layer_windows(model)
    assert isinstance(windows, tuple)
    stream = [(11 * i) % 250 + 1 for i in range(40)]
    stock = model.make_cache()
    seg = SegmentedCache(3, fanout=100, route=route, windows=windows)
    after = _sealer(seg)
    for chunk in [stream[:6], *([t] for t in stream[6:]), [(5 * i) % 250 + 3 for i in range(13)]]:
        want = logits_last(model, chunk, stock)
        got = logits_last(model, chunk, list(seg.layers))
        after(chunk)
        assert _max_abs(got - want) < max(1e-3, LOGITS_TOL), len(seg.base.tokens)
    assert len(seg.base.segments) >= 3


@pytest.mark.parametrize("make", [_gemma3, _gemma2], ids=["gemma3", "gemma2"])
@pytest.mark.parametrize("route", _seg_routes(), ids=lambda r: getattr(r, "name", "composed"))
def test_segmented_matches_rotating_cache(route: Any, make: Any) -> None:
    """Two turns and a fork, prompts longer than the window, against mlx-lm's own caches
    (RotatingKVCache on the local layers) fed the same token stream."""
    model = make()
    install(model)
    windows = layer_windows(model)
    assert isinstance(windows, tuple)
    prompt = [(11 * i) % 250 + 1 for i in range(40)]  # 5x the window
    stock = model.make_cache()
    assert any(isinstance(c, RotatingKVCache) for c in stock)
    want1 = _greedy(model, stock, prompt, 12)
    seg = SegmentedCache(3, fanout=100, route=route, windows=windows)
    assert _greedy(model, list(seg.layers), prompt, 12, _sealer(seg)) == want1
    assert len(seg.base.segments) >= 3
    turn1 = seg.seal()
    # Follow-up turn (multi-token prefill after the rotating cache wrapped around).
    follow = [(5 * i) % 250 + 3 for i in range(19)]
    want2 = _greedy(model, stock, follow, 10)
    assert _greedy(model, list(seg.layers), follow, 10, _sealer(seg)) == want2
    # Fork from the end of turn 1: shares its segments, its own follow-up.
    other = [(13 * i) % 250 + 2 for i in range(11)]
    fork = SegmentedCache(3, turn1, fanout=100, route=route, windows=windows)
    fresh = model.make_cache()
    history = list(turn1.tokens)
    logits_last(model, history, fresh)
    want3 = _greedy(model, fresh, other, 10)
    assert _greedy(model, list(fork.layers), other, 10, _sealer(fork)) == want3
    assert fork.base.segments[: len(turn1.segments)] == turn1.segments  # shared, not copied


@pytest.mark.parametrize("make", [_gemma3, _gemma2], ids=["gemma3", "gemma2"])
def test_the_tiny_model_needs_its_window(make: Any) -> None:
    """The same weights with a window no prompt here reaches (every layer in effect global)
    answer differently: the tests above would catch a window that was dropped."""
    model, unwindowed = make(), make(window=4096)
    prompt = [(11 * i) % 250 + 1 for i in range(40)]
    want = _greedy(model, model.make_cache(), prompt, 12)
    assert _greedy(unwindowed, unwindowed.make_cache(), prompt, 12) != want
    windowed = logits_last(model, prompt, model.make_cache())
    everything = logits_last(unwindowed, prompt, [KVCache() for _ in range(3)])
    assert _max_abs(windowed - everything) > 0.1


@pytest.mark.parametrize("make", [_gemma3, _gemma2], ids=["gemma3", "gemma2"])
def test_served_through_the_engine(gguf_tokenizer: ChatTokenizer, make_request: Any, make: Any) -> None:
    """The runner makes window-aware caches: segmented greedy tokens equal the model's own
    rotating-cache path, for a first turn and a follow-up that reuses the stored prefix."""
    model = make(vocab=49152)
    loaded = tiny_loaded(gguf_tokenizer, model)
    prompt = [(11 * i) % 4000 + 100 for i in range(40)]
    engine = make_engine(loaded, segmented=True)
    try:
        first = run(engine, [make_request(prompt, max_tokens=10)])[0]
        follow = prompt + first.tokens + [(7 * i) % 4000 + 50 for i in range(13)]
        second = run(engine, [make_request(follow, max_tokens=10)])[0]
    finally:
        engine.stop()
    assert first.failed is None and second.failed is None
    assert _greedy(model, model.make_cache(), prompt, 10) == first.tokens
    assert _greedy(model, model.make_cache(), follow, 10) == second.tokens
    assert second.started is not None and second.started.cached_tokens >= len(prompt)


def test_laguna_sliding_layers_match_rotating_cache() -> None:
    mx.random.seed(4)
    model = laguna.Model(laguna.ModelArgs(
        model_type="laguna", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        head_dim=64, max_position_embeddings=512, tie_word_embeddings=False, gating=True,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    assert support_check(model, model_shape(model)).ok
    install(model)
    prompt = [(11 * i) % 250 + 1 for i in range(30)]
    want = _greedy(model, model.make_cache(), prompt, 10)
    seg = SegmentedCache(2, fanout=100, route=attend_segments, windows=layer_windows(model))  # type: ignore[arg-type]
    assert _greedy(model, list(seg.layers), prompt, 10, _sealer(seg)) == want


def test_soft_capping_outside_gemma2_attention_is_refused_with_reason() -> None:
    # gemma2's attention is routed with its cap (tests/test_softcap.py); a capped model whose
    # attention code the hook does not route is refused by name.
    import dataclasses

    from tests.conftest import make_tiny_model

    model = make_tiny_model()
    shape = dataclasses.replace(model_shape(model), attn_logit_softcapping=30.0)
    verdict = support_check(model, shape)
    assert not verdict.ok and "attn_logit_softcapping=30.0" in verdict.reason


def test_a_mask_for_another_window_is_refused() -> None:
    seg = SegmentedCache(2, windows=[8, None])
    assert seg.layers[0].make_mask(4, window_size=8) == "causal"
    with pytest.raises(NotImplementedError, match="sliding window 4"):
        seg.layers[0].make_mask(4, window_size=4)
    with pytest.raises(NotImplementedError, match="window is None"):
        seg.layers[1].make_mask(1, window_size=8)
    with pytest.raises(ValueError, match="1 layer windows for 2 layers"):
        SegmentedCache(2, windows=[8])


class _WindowBlindRoute:
    """Attends over everything whatever the window: the start-up check must catch it."""

    name = "window-blind"

    def __call__(self, queries: mx.array, segments: Any, tail: Any, *, scale: float,
                 causal: bool, window: int | None = None) -> mx.array:
        return attend_segments(queries, segments, tail, scale=scale, causal=causal)


def test_self_check_covers_the_models_windows() -> None:
    model = _gemma3()
    sup = support_check(model, model_shape(model))
    assert sup.windows == (WINDOW,)
    shapes: dict[str, Any] = dict(n_q_heads=4, n_kv_heads=2, head_dim=64, dtype=mx.float32)
    good = self_check(ComposedRoute(), windows=sup.windows, **shapes)
    assert good.ok, good.detail
    assert self_check(_WindowBlindRoute(), **shapes).ok  # no window asked: nothing to see
    blind = self_check(_WindowBlindRoute(), windows=sup.windows, **shapes)
    assert not blind.ok and "window=" in blind.detail
    if FUSED_OK:
        fused = self_check(fused_cpu.FusedCpuRoute(), windows=sup.windows, **shapes)
        assert fused.ok, fused.detail


def test_choose_kv_serves_gemma3_segmented(gguf_tokenizer: ChatTokenizer) -> None:
    from segserve.config.settings import load_settings
    from segserve.server import runtime

    verdict, route = runtime.choose_kv(load_settings({}, environ={}), tiny_loaded(gguf_tokenizer, _gemma3()))
    assert route is not None and verdict.mode == "segmented", verdict
    assert "sliding-window layers" in verdict.reason and "window=" not in verdict.self_check_detail


@pytest.mark.skipif(not FUSED_OK, reason="native extension not built")
@pytest.mark.parametrize("n_q", [1, 7, 130])
def test_fused_cpu_windowed_prefill_over_long_pieces(n_q: int) -> None:
    """Long pieces (keys split over the worker threads, several row blocks and tiles), 3 KV
    heads, float16 K/V under float32 queries: the op's own window masking against SDPA with
    mlx-lm's window mask, the window start in a segment, on a boundary, in the tail."""
    used: list[int] = []

    def fallback(q: mx.array, *a: Any, **k: Any) -> mx.array:
        used.append(q.shape[2])
        return attend_segments(q, *a, **k)

    route = fused_cpu.FusedCpuRoute(fallback=fallback)
    keys = mx.random.split(mx.random.key(11), 4)
    segs = [_kv(keys[0], 300, mx.float16, h=3), _kv(keys[1], 517, mx.float16, h=3)]
    tail = _kv(keys[2], 160, mx.float16, h=3)
    q = mx.random.normal((1, 6, n_q, 64), key=keys[3])
    for window in (5, 64, 200, 300, 700, 900, 5000):
        got = route(q, segs, tail, scale=0.125, causal=True, window=window)
        want = _reference(q, segs, tail, window)
        assert _max_abs(got - want) < TOL[mx.float16], (n_q, window)
    assert used == []
