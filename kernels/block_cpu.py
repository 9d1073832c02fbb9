"""A llama layer's decode step outside attention as two native ops on the CPU.

Owns: `NativeBlock` (one layer: `pre(h, offsets) -> q, k, v` and `post(h, o) -> h`),
`for_layer` (does a layer have the structure the ops serve?), `available` and `agree` (the
start-up comparison with the MLX ops they replace). Used by `server.runner.batched` for
every decode step; engine thread only.

Why: with 4-bit weights through the quantized matmul extension, a SmolLM2 decode step
was ~2,000 MLX nodes: MLX has no CPU kernel for RMSNorm or RoPE (each decomposes into
~25 small ops), plus reshapes, splits and slices, and MLX's CPU evaluation costs a few
microseconds per node, more than the weight products themselves. The ops
(`kernels/native/block_op.cpp`) do norm + q/k/v product + RoPE in one node and output
projection + residual + norm + SwiGLU MLP + residual in another, with the quantized
matmul's own kernel bodies and worker pool; attention and the cache write stay with the
cache and its route. Measured with `python bench/profile_decode.py` (both variants in one
run; README, CPU section).

Served: mlx-lm's llama `TransformerBlock` whose q/k/v and gate/up products were fused by
`kernels.qmm_cpu.install` (4/8-bit affine, no biases), `nn.RMSNorm` with float32 weights,
plain `nn.RoPE`, float32 activations. Anything else keeps MLX's ops, as does the setting
`cpu_native_layers=false` (benchmarks compare both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from kernels.qmm_cpu import CpuQuantizedLinear, FusedQuantizedPart, error_and_tolerance

# The model attribute `server.runner.model.load_model` sets from the `cpu_native_layers`
# setting; `server.runner.batched` reads it (absent: on).
NATIVE_LAYERS_ATTR = "_segserve_native_layers"

PreFn = Callable[[mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]
PostFn = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What a family's decoder block is made of, as attribute names on the layer (None:
    absent). Every family here is: [norm] -> q/k/v -> [q/k norm] -> RoPE -> attention ->
    o_proj -> [norm] -> residual (x multiplier) -> [norm] -> gated MLP -> [norm] ->
    residual (x multiplier)."""

    in_norm: str | None = "input_layernorm"  # before attention (olmo2: none)
    attn_out_norm: str | None = None  # on the attention output, before the residual
    mlp_in_norm: str | None = "post_attention_layernorm"  # before the MLP (olmo2: none)
    mlp_out_norm: str | None = None  # on the MLP output, before the residual
    qk_norm: str | None = None  # "head": per head (qwen3, gemma3); "all": over all heads (olmo2)
    fused_qkv: str | None = None  # one q|k|v projection on the attention (phi3: qkv_proj)
    fused_gate_up: str | None = None  # one gate|up projection on the MLP (phi3: gate_up_proj)
    gelu_gate: bool = False  # GELU (tanh approximation) gate instead of SiLU (gemma3)
    norm_plus_one: bool = False  # RMSNorm scales by 1 + w (gemma)
    residual_multiplier: bool = False  # both residual branches scaled (granite)
    clip_residual: bool = False  # float16 residual sums clipped to its range (gemma3)


def _ext() -> Any:
    from kernels.qmm_cpu import available

    if not available()[0]:
        return None
    from kernels.native import _segattn

    return _segattn if hasattr(_segattn, "block_pre") else None


def available() -> bool:
    """The ops are built into the extension and this is the CPU."""
    return mx.default_device() == mx.cpu and _ext() is not None


def _fused_head(part: Any, parts: int) -> CpuQuantizedLinear | None:
    """The fused weight behind the first projection of a group of `parts`, else None."""
    if type(part) is not FusedQuantizedPart or part._index != 0:
        return None
    shared = part._shared[0]
    layer = shared.layer
    if len(shared.splits) != parts - 1 or type(layer) is not CpuQuantizedLinear or "bias" in layer:
        return None
    return layer


def _rms(norm: Any) -> bool:
    return type(norm) is nn.RMSNorm and norm.weight.dtype == mx.float32 and norm.weight.ndim == 1


class NativeBlock:
    """One layer's `pre` and `post` through the native ops (arrays shared with the layer)."""

    def __init__(self, layer: Any, qkv: CpuQuantizedLinear, gate_up: CpuQuantizedLinear) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self._ops = _ext()
        rope = attn.rope
        self._pre_args = (
            layer.input_layernorm.weight, float(layer.input_layernorm.eps),
            qkv.weight, qkv.scales, qkv.biases, qkv.group_size, qkv.bits,
            int(attn.n_heads), int(attn.n_kv_heads), int(qkv.weight.shape[0]) // (attn.n_heads + 2 * attn.n_kv_heads),
            int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale),
        )
        o, d, n2 = attn.o_proj, mlp.down_proj, layer.post_attention_layernorm
        self._post_args = (
            o.weight, o.scales, o.biases, o.group_size, o.bits,
            n2.weight, float(n2.eps),
            gate_up.weight, gate_up.scales, gate_up.biases, gate_up.group_size, gate_up.bits,
            d.weight, d.scales, d.biases, d.group_size, d.bits,
        )

    def pre(self, h: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        a = self._pre_args
        if h.dtype != mx.float32:  # a quantized embedding's rows come out in its scale dtype
            h = h.astype(mx.float32)
        out = self._ops.block_pre(h, offsets, *a)
        if out is None:
            raise ValueError(f"native block declined h {h.shape} {h.dtype}")
        q, k, v = out
        return q, k, v

    def post(self, h: mx.array, o: mx.array) -> mx.array:
        if h.dtype != mx.float32:
            h = h.astype(mx.float32)
        out = self._ops.block_post(h, o, *self._post_args)
        if out is None:
            raise ValueError(f"native block declined h {h.shape}, o {o.shape}")
        return out  # type: ignore[no-any-return]


def for_layer(layer: Any) -> NativeBlock | None:
    """A `NativeBlock` for a layer the ops serve, else None (the caller keeps MLX's ops)."""
    if not available() or type(layer) is not llama.TransformerBlock:
        return None
    attn: Any = layer.self_attn  # mlx-lm's annotations leave n_kv_heads optional
    mlp: Any = layer.mlp
    if type(mlp) is not llama.MLP or type(attn.rope) is not nn.RoPE:
        return None
    if not (_rms(layer.input_layernorm) and _rms(layer.post_attention_layernorm)):
        return None
    qkv, gate_up = _fused_head(attn.q_proj, 3), _fused_head(mlp.gate_proj, 2)
    if qkv is None or gate_up is None:
        return None
    for proj in (attn.o_proj, mlp.down_proj):
        if type(proj) is not CpuQuantizedLinear or "bias" in proj:
            return None
    if int(qkv.weight.shape[0]) % (attn.n_heads + 2 * attn.n_kv_heads) != 0:
        return None
    return NativeBlock(layer, qkv, gate_up)


def agree(block: NativeBlock, pre: PreFn, post: PostFn, hidden: int, rows: tuple[int, ...] = (1, 3)) -> tuple[bool, str]:
    """The native ops against MLX's ops (`pre`, `post`) on random inputs: (ok, reason)."""
    worst = 0.0
    for b in rows:
        kh, ko = mx.random.split(mx.random.key(4321 + b))
        h = mx.random.normal((b, 1, hidden), key=kh)
        offsets = mx.array([17 + 301 * i for i in range(b)], dtype=mx.int32)
        try:
            got_pre = block.pre(h, offsets)
            ref_pre = pre(h, offsets)
            o = mx.random.normal(ref_pre[0].shape, key=ko)
            pairs = [*zip(got_pre, ref_pre, strict=True), (block.post(h, o), post(h, o))]
            mx.eval(pairs)
        except Exception as exc:  # a failing op must not stop the server: MLX's ops serve
            return False, f"{type(exc).__name__}: {exc}"
        for got, ref in pairs:
            if got.shape != ref.shape:
                return False, f"shape {got.shape} != {ref.shape} at {b} row(s)"
            err, tol = error_and_tolerance(got, ref)
            if not err <= tol:
                return False, f"mismatch {err:.3g} > {tol:.3g} at {b} row(s)"
            worst = max(worst, err)
    return True, f"matched MLX's ops (max abs error {worst:.2g})"
