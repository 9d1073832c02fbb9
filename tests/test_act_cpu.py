"""The gated MLP activation op (kernels/native act_op.cpp, `segserve.kernels.act_cpu`).

The op against float64 truth and against MLX's own ops (SiLU: mlx-lm's `swiglu`; GELU-tanh:
`nn.gelu_approx(g) * u`) over ordinary, extreme and special values, views and arrays long
enough to be split over the worker pool; then `install` on tiny llama and Gemma 3 models:
the routed forward equals MLX's, the routed names point at the op, `uninstall` restores them.
Skipped as a whole, with the reason, when the extension is not built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import activations, gemma3_text, llama
from mlx_lm.models.cache import KVCache

from segserve.kernels import act_cpu
from tests.conftest import make_tiny_model

_OK, _WHY = act_cpu.available()
if not _OK:
    pytest.skip(f"gated activation op unavailable: {_WHY}", allow_module_level=True)

from segserve.kernels.native import _segattn  # noqa: E402


def _truth(g: np.ndarray, u: np.ndarray, act: int) -> np.ndarray:
    """float64 values; GELU-tanh as x * sigmoid(2 z), equal to 0.5 x (1 + tanh(z)) and
    free of its cancellation where tanh(z) is -1 to float64's precision."""
    x = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if act == act_cpu.SILU:
            return x / (1.0 + np.exp(-x)) * u.astype(np.float64)
        z = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
        return x / (1.0 + np.exp(-2.0 * z)) * u.astype(np.float64)


def _rtol(g: np.ndarray, act: int) -> np.ndarray:
    """2e-6, times the exponent's argument where it is large: float32 rounds the argument
    itself (relative 6e-8), and exp turns that into a relative error of |arg| times it."""
    x = g.astype(np.float64)
    arg = np.abs(x) if act == act_cpu.SILU else np.abs(2 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))
    tol: np.ndarray = 2e-6 * np.maximum(1.0, np.nan_to_num(arg, posinf=1e300))
    return tol


def _mlx(g: mx.array, u: mx.array, act: int) -> mx.array:
    out: mx.array = activations.swiglu(g, u) if act == act_cpu.SILU else nn.gelu_approx(g) * u
    return out


@pytest.fixture(autouse=True)
def _stock_after() -> Iterator[None]:
    yield
    vars(llama)["swiglu"] = activations.swiglu  # whatever a test installed, the next starts from mlx-lm


@pytest.mark.parametrize("act", [act_cpu.SILU, act_cpu.GELU_TANH])
def test_matches_float64_truth_and_mlx(act: int) -> None:
    """Relative error against float64 within 2e-6 (float32 rounding of a few operations);
    against MLX's ops within the same, except where MLX itself is further from the truth
    (its GELU computes 1 + tanh(z), which cancels in the negative tail)."""
    g = mx.concatenate([mx.random.normal((4000,), key=mx.random.key(1)) * 6.0,
                        mx.linspace(-30.0, 30.0, 3001)])
    u = mx.random.normal(g.shape, key=mx.random.key(2))
    got = _segattn.gated_act(g, u, act)
    assert got is not None and got.dtype == mx.float32 and got.shape == g.shape
    truth = _truth(np.array(g), np.array(u), act)
    ours = np.abs(np.array(got).astype(np.float64) - truth)
    scale = np.maximum(np.abs(truth), 1e-30)
    rtol = _rtol(np.array(g), act)
    assert np.all(ours <= rtol * scale), np.max(ours / scale / rtol)
    theirs = np.abs(np.array(_mlx(g, u, act)).astype(np.float64) - truth)
    assert np.all(ours <= np.maximum(theirs, rtol * scale))


@pytest.mark.parametrize("act", [act_cpu.SILU, act_cpu.GELU_TANH])
def test_extremes_and_specials_as_mlx(act: int) -> None:
    vals = [-1e30, -200.0, -90.0, -88.0, -87.5, -20.0, -1e-8, 0.0, -0.0, 1e-8, 20.0, 87.5, 88.5, 100.0, 1e30,
            math.inf, -math.inf, math.nan]
    g = mx.array(vals)
    u = mx.ones_like(g)
    got = np.array(_segattn.gated_act(g, u, act))
    ref = np.array(_mlx(g, u, act))
    truth = _truth(np.array(g), np.array(u), act)
    for x, a, b, t in zip(vals, got, ref, truth, strict=True):
        if math.isnan(b):
            assert math.isnan(a), x
        elif not math.isfinite(b) or abs(b) > 1e-3:
            assert a == b, (x, a, b)
        else:  # tiny values: as close to the truth as float32 holds them
            assert abs(a - t) <= max(float(_rtol(np.array([x]), act)[0]) * abs(t), 1e-37), (x, a, t)


def test_views_shapes_and_the_worker_pool() -> None:
    """A transposed view (gathered first), column slices (rows at a stride, read in place),
    the halves of a fused gate|up product as the model's MLP gets them, a row broadcast,
    a [1, L, F] prefill shape, and arrays over many pool chunks (16K elements each) and
    rows longer than one chunk."""
    base = mx.random.normal((96, 700), key=mx.random.key(3)) * 4
    up = mx.random.normal((700, 96), key=mx.random.key(4))
    fused = mx.random.normal((1, 37, 2 * 2816), key=mx.random.key(7)) * 3
    gate_half, up_half = mx.split(fused, 2, axis=-1)
    long_rows = mx.random.normal((3, 40000), key=mx.random.key(8))
    cases = [(base.T, up), (base[:, 100:196], up[:96, :96].T), (gate_half, up_half),
             (base[:, :96], mx.broadcast_to(up[0, :96], (96, 96))), (long_rows, long_rows[::-1])]
    for g, u in cases:
        got = _segattn.gated_act(g, u, act_cpu.SILU)
        assert got is not None
        want = _truth(np.array(g), np.array(u), act_cpu.SILU)
        assert np.all(np.abs(np.array(got) - want) <= _rtol(np.array(g), act_cpu.SILU) * np.abs(want) + 1e-37)
    big = mx.random.normal((1, 300, 2816), key=mx.random.key(5)) * 5
    ub = mx.random.normal(big.shape, key=mx.random.key(6))
    got = _segattn.gated_act(big, ub, act_cpu.GELU_TANH)
    assert got is not None and got.shape == big.shape
    want = _truth(np.array(big), np.array(ub), act_cpu.GELU_TANH)
    assert np.all(np.abs(np.array(got) - want) <= _rtol(np.array(big), act_cpu.GELU_TANH) * np.abs(want) + 1e-37)


def test_declines_what_it_does_not_serve() -> None:
    g = mx.random.normal((8, 16))
    assert _segattn.gated_act(g.astype(mx.float16), g.astype(mx.float16), 0) is None
    assert _segattn.gated_act(g, g[:, :8], 0) is None  # shapes differ
    assert _segattn.gated_act(g, g, 2) is None  # no such activation
    assert act_cpu.gated(g.astype(mx.bfloat16), g.astype(mx.bfloat16), act_cpu.SILU) is None
    # The routed swiglu falls back to mlx-lm's for those.
    h = g.astype(mx.float16)
    assert mx.array_equal(act_cpu.swiglu(h, h), activations.swiglu(h, h)).item()


def _logits(model: nn.Module, prompt: list[int]) -> mx.array:
    cache = [KVCache() for _ in range(len(model.layers))]
    out: mx.array = model(mx.array([prompt]), cache=cache)
    mx.eval(out)
    return out


def _tiny_gemma3() -> gemma3_text.Model:
    mx.random.seed(7)
    m = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
        sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=64, max_position_embeddings=512))
    m.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_install_routes_a_model_and_keeps_its_outputs(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model: nn.Module = make_tiny_model(seed=5) if kind == "llama" else _tiny_gemma3()
    prompt = list(range(3, 40))
    ref = _logits(model, prompt)
    calls = [0]
    real = _segattn.gated_act

    def counted(g: mx.array, u: mx.array, act: int) -> mx.array | None:
        calls[0] += 1
        return real(g, u, act)

    monkeypatch.setattr(_segattn, "gated_act", counted)
    routed = act_cpu.install(model)
    assert routed and act_cpu.installed(model)
    if kind == "llama":
        assert routed == ["mlx_lm.models.llama"] and vars(llama)["swiglu"] is act_cpu.swiglu
    else:
        assert routed == ["_Gemma3MLP x 2"]
    got = _logits(model, prompt)
    assert calls[0] == 2  # one call per layer's MLP
    assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(ref, axis=-1)).item()
    assert act_cpu.install(model) == routed  # idempotent
    act_cpu.uninstall(model)
    assert not act_cpu.installed(model)
    assert vars(llama)["swiglu"] is activations.swiglu
    assert all(type(m) is not act_cpu._Gemma3MLP for _, m in model.named_modules())
    calls[0] = 0
    assert mx.array_equal(_logits(model, prompt), ref).item() and calls[0] == 0


def test_a_routed_gemma3_still_decodes_batched() -> None:
    """Batched decode checks each layer's MLP by exact type: the routed class stands for
    Gemma 3's own MLP there (a routed model once lost its batched decode)."""
    from segserve.server.runner.batched import _structure_gap, batch_support
    from tests.conftest import decode_backend

    model = _tiny_gemma3()
    assert act_cpu.install(model) == ["_Gemma3MLP x 2"]
    assert act_cpu.stock_type(act_cpu._Gemma3MLP) is gemma3_text.MLP
    assert act_cpu.stock_type(llama.MLP) is llama.MLP
    assert _structure_gap(model) is None
    assert batch_support(decode_backend(model)).ok
