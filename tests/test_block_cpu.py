"""The native decode-layer ops (kernels/native block_op.cpp) against the MLX ops they replace.

Differential: `block_pre` (norm, q/k/v product(s), q/k norm, RoPE at each row's position)
and `block_post` (output projection, norms, residuals, gated MLP) against the same layer's
MLX code (`segserve.server.runner.batched._CompiledLayer._pre/_post`, uncompiled): on tiny
quantized llamas (bits 4/8, group sizes 32/64, traditional and split-half RoPE, a RoPE
scale, 1 and 3 rows at different positions, strided inputs) and on every family batched
decode serves (Llama 3 RoPE, qwen2 biases, qwen3 and olmo2 q/k norms, phi3's fused
weights, granite's multipliers, gemma3's sandwich norms and GELU gate; 4 and 8 bits).
Then whole decode steps (`decode_batch`) with the ops on and off give the same logits and
greedy tokens, and a self-check that disagrees keeps MLX's ops. Skipped when the
extension lacks the ops.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache

from segserve.kernels import block_cpu, qmm_cpu
from segserve.server.runner import DecodeBackend, batched, model_shape
from tests.conftest import decode_backend, make_tiny_model

if not qmm_cpu.available()[0] or block_cpu._ext() is None:
    pytest.skip("native block ops unavailable (extension not built)", allow_module_level=True)


def _model(bits: int = 4, gs: int = 32, **over: Any) -> Any:
    m = make_tiny_model(seed=11, **over)
    nn.quantize(m, group_size=gs, bits=bits)
    qmm_cpu.install(m, model_shape(m))
    return m


def _close(got: mx.array, ref: mx.array) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype == mx.float32
    err = mx.max(mx.abs(got - ref)).item()
    peak = mx.max(mx.abs(ref)).item()
    assert isinstance(err, float) and isinstance(peak, float)
    assert err <= 2e-5 * max(1.0, peak), (err, peak)


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_ops_match_the_mlx_layer(bits: int, gs: int, traditional: bool, rows: int) -> None:
    m = _model(bits, gs, rope_traditional=traditional)
    hidden = m.args.hidden_size
    for i, layer in enumerate(m.layers):
        native = block_cpu.for_layer(layer)
        assert native is not None
        ref = batched._CompiledLayer(layer)
        h = mx.random.normal((rows, 1, hidden), key=mx.random.key(i)) * 2.0
        offsets = mx.array([5 + 97 * r for r in range(rows)], dtype=mx.int32)
        got_qkv, ref_qkv = native.pre(h, offsets), ref._pre(h, offsets)
        for g, r in zip(got_qkv, ref_qkv, strict=True):
            _close(g, r)
        o = mx.random.normal(ref_qkv[0].shape, key=mx.random.key(100 + i))
        _close(native.post(h, o), ref._post(h, o))


def test_ops_round_x_as_their_products_ask() -> None:
    """A model whose products round x ("on": a K-quant GGUF's, `install`'s `x8`) gets the
    same rounding inside the native ops: they match the MLX layer over those products, and
    differ from the same ops on float x by more than the tolerance."""
    from segserve.kernels.native import _segattn

    assert _segattn.qmm_x8() == "auto"  # the products' own mode is taken on auto only
    rounded = make_tiny_model(seed=11)
    nn.quantize(rounded, group_size=32, bits=4)
    qmm_cpu.install(rounded, model_shape(rounded), x8="on")
    plain = _model(4, 32)
    h = mx.random.normal((1, 1, rounded.args.hidden_size), key=mx.random.key(3)) * 2.0
    offsets = mx.array([7], dtype=mx.int32)
    for layer, twin in zip(rounded.layers, plain.layers, strict=True):
        native, ref = block_cpu.for_layer(layer), batched._CompiledLayer(layer)
        float_x = block_cpu.for_layer(twin)
        assert native is not None and float_x is not None
        got_q, ref_q = native.pre(h, offsets)[0], ref._pre(h, offsets)[0]
        _close(got_q, ref_q)
        o = mx.random.normal(ref_q.shape, key=mx.random.key(4))
        _close(native.post(h, o), ref._post(h, o))
        moved = mx.max(mx.abs(native.post(h, o) - float_x.post(h, o))).item()
        assert isinstance(moved, float) and moved > 1e-3


def test_rope_scale_and_strided_inputs() -> None:
    m = _model(rope_scaling={"type": "linear", "factor": 4.0})
    layer = m.layers[0]
    assert isinstance(layer.self_attn.rope, nn.RoPE) and layer.self_attn.rope.scale == 0.25
    native = block_cpu.for_layer(layer)
    assert native is not None
    ref = batched._CompiledLayer(layer)
    big = mx.random.normal((4, 1, 2 * m.args.hidden_size), key=mx.random.key(3))
    h = big[::2, :, ::2]  # strided view: rows 0 and 2, every other column
    offsets = mx.array([3, 1000], dtype=mx.int32)
    for g, r in zip(native.pre(h, offsets), ref._pre(h, offsets), strict=True):
        _close(g, r)
    o = mx.random.normal((2, 1, 4, 64), key=mx.random.key(4)).transpose(0, 2, 1, 3)  # [B, Hq, 1, D] view
    _close(native.post(h, o), ref._post(h, o))
    h16 = h.astype(mx.float16)  # a quantized embedding's rows arrive in its scale dtype
    _close(native.pre(h16, offsets)[0], ref._pre(h16.astype(mx.float32), offsets)[0])


def test_what_the_ops_do_not_serve() -> None:
    plain = make_tiny_model(seed=2)  # float weights: no quantized products to fuse
    assert block_cpu.for_layer(plain.layers[0]) is None
    m = make_tiny_model(seed=2)
    nn.quantize(m, group_size=32, bits=4)
    qmm_cpu.install(m, model_shape(m), fuse=False)  # q, k, v apart: three products in the one op
    assert block_cpu.for_layer(m.layers[0]) is not None
    m = _model()
    assert block_cpu.for_layer(m.layers[0]) is not None
    m.layers[0].self_attn.rope = nn.ALiBi()  # a position module the op does not reproduce
    assert block_cpu.for_layer(m.layers[0]) is None
    ext = block_cpu._ext()
    layer = m.layers[1]
    w = layer.self_attn.q_proj.fused
    args = dict(norm_w=layer.input_layernorm.weight, eps=1e-5, proj=[w.weight, w.scales, w.biases], gs=[32],
                bits=[4], bias=None, qk_norm=0, q_norm_w=None, k_norm_w=None, qk_eps=0.0, n_heads=4,
                n_kv_heads=2, head_dim=64, rope_dims=64, traditional=True, rope_base=1e4, rope_scale=1.0,
                inv_freqs=None, rope_mscale=1.0)
    offs = mx.zeros((2,), dtype=mx.int32)
    assert ext.block_pre(mx.zeros((2, 1, 64)), offs, **args) is not None
    # float16 activations, wrong offsets length, a q/k norm without weights: declined
    assert ext.block_pre(mx.zeros((2, 1, 64), dtype=mx.float16), offs, **args) is None
    assert ext.block_pre(mx.zeros((2, 1, 64)), mx.zeros((3,), dtype=mx.int32), **args) is None
    assert ext.block_pre(mx.zeros((2, 1, 64)), offs, **{**args, "qk_norm": 1}) is None


def _greedy(dec: DecodeBackend, steps: int = 8) -> tuple[list[list[int]], mx.array]:
    """Two sessions at different positions, decoded together through `decode_batch`."""
    from segserve.server.runner import logits_last

    model = dec.model
    caches = [[KVCache() for _ in model.layers] for _ in range(2)]
    last = []
    for c, n in zip(caches, (7, 19), strict=True):
        last.append(int(mx.argmax(logits_last(model, list(range(3, 3 + n)), c)).item()))  # type: ignore[arg-type]
    toks: list[list[int]] = [[], []]
    first = None
    for _ in range(steps):
        logits = batched.decode_batch(dec, last, caches)
        first = logits if first is None else first
        picked = mx.argmax(logits, axis=-1).tolist()
        assert isinstance(picked, list)
        last = [int(t) for t in picked]  # type: ignore[arg-type]
        for i, t in enumerate(last):
            toks[i].append(t)
    assert first is not None
    return toks, first


def test_decode_steps_equal_with_the_ops_on_and_off() -> None:
    on = decode_backend(_model())
    layers = batched._compiled_layers(on)
    assert layers is not None and all(c.native is not None for c in layers)
    off = decode_backend(_model(), native_layers=False)  # cpu_native_layers=false
    layers_off = batched._compiled_layers(off)
    assert layers_off is not None and all(c.native is None for c in layers_off)
    a, la = _greedy(on)
    b, lb = _greedy(off)
    assert a == b
    assert mx.allclose(la, lb, atol=1e-3).item()


def test_a_disagreeing_self_check_keeps_mlx_ops(caplog: pytest.LogCaptureFixture) -> None:
    m = _model()
    built = [batched._CompiledLayer(layer, block_cpu.for_layer(layer)) for layer in m.layers]
    native = built[0].native
    assert native is not None
    native._pre_args = {**native._pre_args, "norm_w": native._pre_args["norm_w"] * 2.0}  # a wrong norm weight
    with caplog.at_level("WARNING", logger="segserve.runner"):
        kept = batched._checked_native(built, m.args.hidden_size)
    assert all(c.native is None for c in kept)
    assert "disagree" in caplog.text


FAMILY_NAMES = ["llama", "llama3-rope", "qwen2", "qwen3", "phi3", "olmo2", "granite", "gemma3", "gemma2"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_native_equals_mlx_ops(family: str, bits: int) -> None:
    """One parameterised op per layer against that family's MLX layer code, every layer
    (gemma3: sliding and global RoPE; phi3: its own fused weights; qwen2: q/k/v apart
    with biases), then whole batched steps with the ops on and off; products with x in
    float32 (`qmm_cpu.float_x`, as the start-up check: 8-bit x would turn the two plans'
    float32 differences into code steps)."""
    with qmm_cpu.float_x():
        _each_family_native_equals_mlx_ops(family, bits)


def _each_family_native_equals_mlx_ops(family: str, bits: int) -> None:
    from tests.test_batched_families import make_family

    m = make_family(family, bits)
    hidden = m.args.hidden_size
    for i, layer in enumerate(m.layers):
        native = block_cpu.for_layer(layer, batched._BLOCKS[type(layer)][2])
        assert native is not None, family
        ref = batched._CompiledLayer(layer)
        h = mx.random.normal((3, 1, hidden), key=mx.random.key(i)) * 2.0
        offsets = mx.array([5, 102, 199], dtype=mx.int32)
        ref_qkv = ref._pre(h, offsets)
        for g, r in zip(native.pre(h, offsets), ref_qkv, strict=True):
            _close(g, r)
        o = mx.random.normal(ref_qkv[0].shape, key=mx.random.key(100 + i))
        _close(native.post(h, o), ref._post(h, o))
    dec = decode_backend(m)
    on = batched._compiled_layers(dec)
    assert on is not None and all(c.native is not None for c in on)
    off = decode_backend(make_family(family, bits), native_layers=False)
    a, la = _greedy(dec)
    b, lb = _greedy(off)
    assert a == b
    assert mx.allclose(la, lb, atol=1e-3).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_longrope_rows_pick_their_set_by_position(bits: int) -> None:
    """Phi-3 LongRoPE (two frequency sets and mscales, switched at the original context)
    through the native op: rows before, at and past the switch in one batch equal the
    model's own LongRoPE module through MLX's ops."""
    from segserve.server.runner.longrope import LongRoPE, default_mscale, install_longrope
    from tests.test_batched_families import make_family

    m = make_family("phi3", bits)
    dims = m.layers[0].self_attn.rope.dims
    switch = 40
    short = [1.0 + 0.1 * i for i in range(dims // 2)]
    long = [1.0 + 3.0 * i for i in range(dims // 2)]
    install_longrope(m, LongRoPE(dims, 10000.0, switch, short, long, 1.0, default_mscale(2048, switch)))
    hidden = m.args.hidden_size
    layer = m.layers[0]
    native = block_cpu.for_layer(layer, batched._BLOCKS[type(layer)][2])
    assert native is not None
    ref = batched._CompiledLayer(layer)
    h = mx.random.normal((4, 1, hidden), key=mx.random.key(7)) * 2.0
    offsets = mx.array([3, switch - 1, switch, switch + 57], dtype=mx.int32)
    for g, r in zip(native.pre(h, offsets), ref._pre(h, offsets), strict=True):
        _close(g, r)
    # Not vacuous: the op with the short set alone misses the rows past the switch.
    one_set = block_cpu.NativeBlock({**native._pre_args, "long_inv_freqs": None}, native._post_args, hidden)
    q_one, q_ref = one_set.pre(h, offsets)[0], ref._pre(h, offsets)[0]
    _close(q_one[:2], q_ref[:2])
    assert not mx.allclose(q_one[2:], q_ref[2:], atol=1e-2).item()
