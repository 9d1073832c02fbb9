"""A decoder layer's decode step outside attention as two native ops on the CPU.

Owns: `NativeBlock` (one layer: `pre(h, offsets) -> q, k, v`, `post(h, o) -> h` and
`layer(h, offsets, pieces, start, scale) -> h`),
`for_layer` (does a layer have the structure the ops serve?), `available` and `agree` (the
start-up comparison with the MLX ops they replace). Used by `segserve.server.runner.batched` for
every decode step; engine thread only.

Why: with 4-bit weights through the quantized matmul extension, a SmolLM2 decode step
was ~2,000 MLX nodes: MLX has no CPU kernel for RMSNorm or RoPE (each decomposes into
~25 small ops), plus reshapes, splits and slices, and MLX's CPU evaluation costs a few
microseconds per node, more than the weight products themselves. The ops
(`kernels/native/block_op.cpp`) do norm + q/k/v product + RoPE in one node and output
projection + residual + norm + SwiGLU MLP + residual in another, with the quantized
matmul's own kernel bodies and worker pool; attention and the cache write stay with the
cache and its route, but for one session on the CPU's fused route `NativeBlock.layer` runs
the whole layer (both ops, the cache write into the tail buffers the cache hands out, and
attention) as one node. Measured with `python bench/profile_decode.py` (both variants in one
run; README, CPU section).

Served: one parameterised block (`BlockShape`, the same description
`segserve.server.runner.batched` runs MLX's ops from) for every family batched decode serves:
norms before and/or after attention and MLP (RMSNorm, gemma's 1 + w), q/k RMSNorm per head
or over all heads, q/k/v and MLP biases, q/k/v and gate/up as one weight or apart, RoPE
as a vector of inverse frequencies (plain with a position scale, Llama 3, YaRN; LongRoPE as
two vectors, each row picking one by its position;
split-half or interleaved pairs; smollm3's layers without RoPE as all-zero frequencies), SiLU or GELU-tanh gate, residual multipliers. Weights
are 4/8-bit affine through `segserve.kernels.qmm_cpu.install` (`CpuQuantizedLinear`), norm
weights and biases float32, activations float32. Any other piece (another RoPE or norm
module, float weights) keeps MLX's ops, as does the setting `cpu_native_layers=false`
(benchmarks compare both); the start-up comparison (`agree`) decides per model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama, smollm3
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from segserve.kernels.qmm_cpu import CpuQuantizedLinear, FusedQuantizedPart, error_and_tolerance

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
    from segserve.kernels.qmm_cpu import available

    if not available()[0]:
        return None
    from segserve.kernels.native import _segattn

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


def _projections(owner: Any, fused: str | None, names: tuple[str, ...]) -> list[CpuQuantizedLinear] | None:
    """The quantized weights whose outputs, side by side, are the group `names`: the
    family's own fused projection, the one `segserve.kernels.qmm_cpu.install` fused, or each apart."""
    if fused is not None:
        one = getattr(owner, fused, None)
        return [one] if type(one) is CpuQuantizedLinear else None
    head = _fused_head(getattr(owner, names[0], None), len(names))
    if head is not None:
        return [head]
    parts = [getattr(owner, n, None) for n in names]
    return parts if all(type(p) is CpuQuantizedLinear for p in parts) else None  # type: ignore[return-value]


def _bias(parts: list[Any]) -> mx.array | None | bool:
    """The projections' biases side by side (float32), None without any, False when only
    some have one or in another dtype (not served)."""
    have = ["bias" in p for p in parts]
    if not any(have):
        return None
    if not all(have) or any(p.bias.dtype != mx.float32 for p in parts):
        return False
    return mx.concatenate([p.bias for p in parts]) if len(parts) > 1 else parts[0].bias


def _norm_weight(norm: Any, plus_one: bool) -> mx.array | None:
    """The multiplier a norm applies (gemma: 1 + w), float32, else None (not served)."""
    if plus_one and type(norm) not in (gemma3_text.RMSNorm, gemma2.RMSNorm):  # both scale by 1 + w
        return None
    if not plus_one and type(norm) is not nn.RMSNorm:
        return None
    w: mx.array = norm.weight
    if w.dtype != mx.float32 or w.ndim != 1:
        return None
    return 1.0 + w if plus_one else w


class _Rope(NamedTuple):
    """`block_pre`'s RoPE arguments, named as the op takes them."""

    rope_dims: int
    traditional: bool
    rope_base: float
    rope_scale: float  # position scale
    inv_freqs: mx.array | None  # None: from rope_base
    rope_mscale: float
    long_inv_freqs: mx.array | None = None  # LongRoPE: the set of positions >= rope_switch
    long_mscale: float = 1.0
    rope_switch: int = 0


def _rope(rope: Any) -> _Rope | None:
    """The arguments of the RoPE modules whose arithmetic the op reproduces, else None."""
    if type(rope) is nn.RoPE:
        return _Rope(int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale), None, 1.0)
    if getattr(type(rope), "two_frequency_sets", False):  # segserve.server.runner.longrope.LongRoPE
        dims, half = int(rope.dims), int(rope.dims) // 2
        if rope._short.shape != (half,) or rope._long.shape != (half,):
            return None
        short, long = mx.reciprocal(rope._short), mx.reciprocal(rope._long)
        mx.eval(short, long)
        return _Rope(dims, False, 0.0, 1.0, short, float(rope.short_mscale), long, float(rope.long_mscale),
                     int(rope.original))
    if type(rope) is Llama3RoPE:
        dims, trad, ms = int(rope.dims), bool(rope.traditional), 1.0
    elif type(rope) is YarnRoPE:
        dims, trad, ms = int(rope.dims), bool(rope.traditional), float(rope.mscale)
    elif type(rope) is SuScaledRoPE:  # scales the rotated dims of its input first
        dims, trad, ms = int(rope.dim), False, float(rope._scale)
    elif getattr(type(rope), "rope_by_freqs", False):  # GGUF rope_freqs (the loader's FreqRoPE)
        dims, trad, ms = int(rope.dims), bool(rope.traditional), 1.0
    else:
        return None
    freqs = rope._freqs
    if freqs.ndim != 1 or freqs.shape[0] != dims // 2:
        return None
    inv = mx.reciprocal(freqs.astype(mx.float32))  # mx.fast.rope's own inversion
    mx.eval(inv)
    return _Rope(dims, trad, 0.0, 1.0, inv, ms)


class NativeBlock:
    """One layer's `pre` and `post` through the native ops (arrays shared with the layer;
    gemma's 1 + w norm multipliers and side-by-side biases are small copies)."""

    def __init__(self, pre_args: dict[str, Any], post_args: dict[str, Any], hidden: int) -> None:
        self._ops = _ext()
        self._pre_args = pre_args
        self._post_args = post_args
        # The whole layer as one op (`layer`): built from one lazy output of each op, which
        # carries the parameters and weights; never evaluated.
        h = mx.zeros((1, 1, hidden), mx.float32)
        q, _, _ = self.pre(h, mx.zeros((1,), mx.int32))
        self._plan = self._ops.BlockLayer(q, self.post(h, mx.zeros(q.shape, mx.float32)))
        # The shape of one new K/V row (`segserve.kv.segmented.SegmentedCache.write_with`).
        self.kv_row = mx.zeros((1, pre_args["n_kv_heads"], 1, pre_args["head_dim"]), mx.float32)

    def pre(self, h: mx.array, offsets: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if h.dtype != mx.float32:  # a quantized embedding's rows come out in its scale dtype
            h = h.astype(mx.float32)
        out = self._ops.block_pre(h, offsets, **self._pre_args)
        if out is None:
            raise ValueError(f"native block declined h {h.shape} {h.dtype}")
        q, k, v = out
        return q, k, v

    def post(self, h: mx.array, o: mx.array) -> mx.array:
        if h.dtype != mx.float32:
            h = h.astype(mx.float32)
        out = self._ops.block_post(h, o, **self._post_args)
        if out is None:
            raise ValueError(f"native block declined h {h.shape}, o {o.shape}")
        return out  # type: ignore[no-any-return]

    def layer(self, h: mx.array, offsets: mx.array, pieces: list[mx.array], start: int, scale: float,
              softcap: float = 0.0, tail_from: int = 0) -> mx.array | None:
        """One session's decode row through the whole layer in one op: `pre`, the K/V row
        written into the tail buffers (the last two `pieces`, after the segments k0, v0,
        ...) at row `start`, attention over the segments and the tail's rows [tail_from,
        start + 1), `post`. h [1, 1, H] -> h' [1, 1, H]; None when the op does not serve it.
        `tail_from` > 0: a sliding window that starts inside the tail (`pieces` are then the
        buffers alone).

        Why: per layer it replaces three nodes and their host work (`pre`, the fused
        route's write-and-attend, `post`) with one; measured with
        `python bench/profile_decode.py` (`step` against `step_three_ops`)."""
        if h.dtype != mx.float32:
            h = h.astype(mx.float32)
        out: mx.array | None = self._plan.step(h, offsets, pieces, start, scale, softcap, tail_from)
        return out


def _triples(parts: list[CpuQuantizedLinear]) -> list[mx.array]:
    return [a for p in parts for a in (p.weight, p.scales, p.biases)]


def for_layer(layer: Any, shape: BlockShape | None = None) -> NativeBlock | None:
    """A `NativeBlock` for a layer built as `shape` says (None: mlx-lm's llama block),
    when the ops serve its pieces; else None (the caller keeps MLX's ops)."""
    if shape is None:
        if type(layer) is not llama.TransformerBlock or type(layer.mlp) is not llama.MLP:
            return None
        shape = BlockShape()
    if not available():
        return None
    attn: Any = layer.self_attn  # mlx-lm's annotations leave n_kv_heads optional
    mlp: Any = layer.mlp
    # smollm3's no-RoPE layers: every angle 0 (cos 1, sin 0), the op's identity, exactly.
    nope = type(attn.rope) is smollm3.NoPE
    rope = None if nope else _rope(attn.rope)
    qkv = _projections(attn, shape.fused_qkv, ("q_proj", "k_proj", "v_proj"))
    gate_up = _projections(mlp, shape.fused_gate_up, ("gate_proj", "up_proj"))
    o, d = attn.o_proj, mlp.down_proj
    if (rope is None and not nope) or qkv is None or gate_up is None:
        return None
    if type(o) is not CpuQuantizedLinear or type(d) is not CpuQuantizedLinear:
        return None
    norms: dict[str, mx.array | None] = {}
    eps: set[float] = set()
    for role in ("in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"):
        name = getattr(shape, role)
        if name is None:
            norms[role] = None
            continue
        w = _norm_weight(getattr(layer, name), shape.norm_plus_one)
        if w is None:
            return None
        norms[role] = w
        eps.add(float(getattr(layer, name).eps))
    if len(eps) > 1:  # one eps for the block's norms
        return None
    n_heads, n_kv = int(attn.n_heads), int(attn.n_kv_heads)
    width = sum(int(p.weight.shape[0]) for p in qkv)
    if width % (n_heads + 2 * n_kv) != 0:
        return None
    head_dim = width // (n_heads + 2 * n_kv)
    if rope is None:  # the no-RoPE layer (checked above)
        rope = _Rope(head_dim, False, 0.0, 1.0, mx.zeros((head_dim // 2,), mx.float32), 1.0)
    qk_norm, qn, kn, qk_eps = 0, None, None, 0.0
    if shape.qk_norm is not None:
        qk_norm = 1 if shape.qk_norm == "head" else 2
        qn = _norm_weight(attn.q_norm, shape.norm_plus_one)
        kn = _norm_weight(attn.k_norm, shape.norm_plus_one)
        if qn is None or kn is None or float(attn.q_norm.eps) != float(attn.k_norm.eps):
            return None
        qk_eps = float(attn.q_norm.eps)
    biases = [_bias(qkv), _bias(gate_up), _bias([o]), _bias([d])]
    if any(b is False for b in biases):
        return None
    x8 = {p.x8 for p in (*qkv, o, *gate_up, d)}  # one per model (`qmm_cpu.install`)
    if len(x8) != 1:
        return None
    pre_args = dict(
        norm_w=norms["in_norm"], eps=eps.pop() if eps else 0.0, proj=_triples(qkv),
        gs=[p.group_size for p in qkv], bits=[p.bits for p in qkv], bias=biases[0],
        qk_norm=qk_norm, q_norm_w=qn, k_norm_w=kn, qk_eps=qk_eps, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, **rope._asdict(), x8=x8.pop(),
    )
    post_args = dict(
        wo=_triples([o]), o_bias=biases[2], attn_out_norm_w=norms["attn_out_norm"],
        mlp_in_norm_w=norms["mlp_in_norm"], gate_up=_triples(gate_up), gate_up_bias=biases[1],
        down=_triples([d]), down_bias=biases[3], mlp_out_norm_w=norms["mlp_out_norm"],
        gs=[p.group_size for p in (o, *gate_up, d)], bits=[p.bits for p in (o, *gate_up, d)],
        eps=pre_args["eps"], act=1 if shape.gelu_gate else 0,
        residual_multiplier=float(layer.residual_multiplier) if shape.residual_multiplier else 1.0,
        x8=pre_args["x8"],
    )
    mx.eval([v for v in (*pre_args.values(), *post_args.values()) if isinstance(v, mx.array)])
    return NativeBlock(pre_args, post_args, int(o.weight.shape[0]))  # o_proj's output: the hidden size


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
