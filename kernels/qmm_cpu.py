"""CPU quantized matmul route: MLX's affine 4/8-bit linear layers through the extension.

Owns: `available`, `quantized_matmul` (the op or MLX's own), `CpuQuantizedLinear` (the
drop-in for `nn.QuantizedLinear`), `CpuQuantizedHead` (a tied quantized embedding's output
projection), `Q6KLinear` / `Q6KEmbedding` (GGUF Q6_K blocks), `K8Linear` (GGUF Q4_K/Q5_K
with their compact scales), `install` (swap them into a
model) and `self_check` (the op against `mx.quantized_matmul` on given shapes, run at
start-up before serving with it).

The op is the C++ primitive `_segattn.qmm` in `kernels/native/` (qmm_op.cpp,
qmm_kernel.cpp; built by `python -m segserve.kernels.native.build`): y = x @ dequant(W).T read
straight from the packed uint32 rows for decode and small batches, and for 24+ rows
(prefill) a packed-panel GEMM that dequantizes one small panel of W at a time into an
L1-sized float buffer shared by all rows (never a whole dequantized copy), SIMD body chosen at run time
(AVX-512 / AVX2+FMA+F16C / portable), output columns split over the cores. It answers
None for what it does not serve (x not float32, bits not 4/8, group size not 32/64/128):
that call, and every call on another device, goes to `mx.quantized_matmul` unchanged.
Weights are the ones MLX's `QuantizedLinear` holds (same arrays, same format), so a model
keeps loading as it does.

GGUF's Q6_K (bits 6, group size 16 in the op's terms; kernels/native/qmm.h) is served in the
file's own blocks by `Q6KLinear` (6.56 bits per weight, exact): MLX has no 16-weight groups,
so without this a Q6_K matrix is re-gridded to 8-bit affine at 9 bits per weight. Its
product without the extension (or where the op declines) dequantizes with MLX ops
(`dequantize_q6k` in `mlx_product`, also the self-check's reference).

GGUF's Q4_K (and Q5_K, widened to 8-bit codes) keep their scales in the file's compact form
(`K8Linear`: per 256 weights a float16 factor and eight uint8 multipliers for the scales,
and for the biases; the op's QMM_K8, kernels/native/qmm.h): 4.625 bits per Q4_K weight
against 5 with a float16 scale and bias per 32, and exact where float16 per group rounds
d * sc. MLX's ops take them expanded to float32 (`expand_k8`).

Symmetric affine layers (GGUF Q4_0 and Q8_0: d * (q - centre), so every bias is exactly
-centre * scale, centre 8 or 128) are routed without their biases array (`symmetric`;
`CpuQuantizedLinear` holds biases of shape [n, 0], the op derives each group's bias from
its scale): Q8_0 stays at the file's 8.5 bits per weight instead of 9, Q4_0 at 4.5 instead
of 5, and a decode step reads that much less. MLX's ops take the biases rebuilt
(`full_biases`).

Products of Q6_K weights (decode rows and the prefill GEMM) round x to 8 bits (decode rows
per block of 256 values, llama.cpp's Q8_K, so a block's products stay in integers; the GEMM
per 32) and multiply codes by codes in integers (kernels/native/qmm_dot8.cpp), as llama.cpp's
CPU backend does; with `--qmm-x8 on` 4-bit weights too, and the prefill products
of 8-bit ones; `off` none: `x8_serves` says which products
do, `x8_product` computes the same with MLX ops (the differential reference,
`reference_product` picks it), and `self_check` compares against that.

Not differentiable (no vjp), CPU only; the op keeps one node under `mx.compile`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.kernels.split_product import LayerPart, SharedLayer
from segserve.kernels.thread_compile import compile_per_thread
from segserve.kv.shape import ModelShape

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
Q6K_BITS, Q6K_GROUP = 6, 16  # how the op names GGUF's Q6_K blocks
K8_BYTES = 10  # QMM_K8 scales: bytes per 8 groups of 32 (kernels/native/qmm.h)


@lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Can the CPU quantized matmul run here? (ok, reason); imports the extension once."""
    from segserve.kernels.fused_cpu import available as ext_available

    ok, why = ext_available()
    if not ok:
        return False, why
    from segserve.kernels.native import _segattn

    if not hasattr(_segattn, "qmm"):
        return False, "extension lacks qmm (rebuild: `python -m segserve.kernels.native.build --force`)"
    return True, f"segserve.kernels.native._segattn.qmm, {_segattn.qmm_isa()} kernel, {_segattn.qmm_threads()} thread(s)"


def _op() -> Callable[..., mx.array | None] | None:
    if not available()[0]:
        return None
    from segserve.kernels.native import _segattn

    return _segattn.qmm


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int
) -> mx.array:
    """x @ dequant(w).T: the extension on the CPU where it serves, else MLX's own op."""
    op = _op()
    if op is not None and mx.default_device() == mx.cpu:
        y = op(x, w, scales, biases, group_size, bits)
        if y is not None:
            return y
    return mlx_product(x, w, scales, biases, group_size, bits)


def dequantize_q6k(weight: mx.array, scales: mx.array, d: mx.array) -> mx.array:
    """Q6_K blocks (`Q6KLinear`'s arrays) → float32 [rows, cols], with MLX ops."""
    rows, nb = int(weight.shape[0]), int(d.shape[1])
    codes = weight.reshape(rows, nb, 192).astype(mx.int32)  # per block: ql[128], qh[64]
    ql = codes[..., :128].reshape(rows, nb, 2, 64)  # per half of the block
    qh = codes[..., 128:].reshape(rows, nb, 2, 32)
    ql0, ql1 = ql[..., :32], ql[..., 32:]
    q = mx.stack([(ql0 & 15) | ((qh & 3) << 4), (ql1 & 15) | (((qh >> 2) & 3) << 4),
                  (ql0 >> 4) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | ((qh >> 6) << 4)], axis=3)
    q = (q.reshape(rows, nb, 16, 16) - 32).astype(mx.float32)  # [rows, block, sub-block, 16]
    step = d.astype(mx.float32).reshape(rows, nb, 1) * scales.astype(mx.float32).reshape(rows, nb, 16)
    return (q * step[..., None]).reshape(rows, nb * 256)


_dequantize_q6k_compiled = compile_per_thread(dequantize_q6k)


def expand_k8(packed: mx.array) -> mx.array:
    """QMM_K8 scales or biases (uint8 [rows, cols/256*K8_BYTES]: per 8 groups a float16
    factor, then 8 multipliers) → float32 [rows, cols/32], exact."""
    rows = int(packed.shape[0])
    blocks = packed.reshape(rows, -1, K8_BYTES).astype(mx.uint16)
    factor = mx.view(blocks[..., 0] | (blocks[..., 1] << 8), mx.float16).astype(mx.float32)
    return (factor[..., None] * blocks[..., 2:].astype(mx.float32)).reshape(rows, -1)


def symmetric_bias(bits: int) -> float:
    """The bias per unit of scale of a symmetric group (kernels/native/qmm.h): -centre."""
    return -8.0 if bits == 4 else -128.0


def symmetric(scales: mx.array, biases: mx.array, bits: int) -> bool:
    """Whether every group's bias is exactly -centre * scale (GGUF Q4_0, Q8_0), so the op
    can derive it: affine 4/8-bit weights with float scales. Exact in the scales' dtype
    (a power-of-two multiple) unless it overflows."""
    if bits not in BITS or scales.dtype == mx.uint8 or biases.shape != scales.shape:
        return False
    # Finite too: the op forms -centre * scale in float32, where a float16 product that
    # overflowed to -inf would be finite.
    derived = scales * symmetric_bias(bits)
    return bool((mx.array_equal(biases, derived) & mx.all(mx.isfinite(derived))).item())


def without_biases(scales: mx.array) -> mx.array:
    """The biases of a symmetric layer as the op takes them: [n, 0]."""
    return mx.zeros((scales.shape[0], 0), dtype=scales.dtype)


def full_biases(scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """Biases of shape of `scales`: as held, or rebuilt for a symmetric layer (MLX's ops)."""
    if biases.size == 0 and scales.size != 0:
        return scales * symmetric_bias(bits)
    return biases


def _float_scales(scales: mx.array, biases: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    if scales.dtype == mx.uint8:  # QMM_K8
        return expand_k8(scales), expand_k8(biases)
    return scales, full_biases(scales, biases, bits)


def mlx_product(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """x @ dequant(W).T with MLX's ops (where the op declines, and the self-check's
    reference): `mx.quantized_matmul` for the affine formats (K8 scales expanded),
    `dequantize_q6k` for Q6_K."""
    if bits == Q6K_BITS:
        return x @ dequantize_q6k(w, scales, biases).T.astype(x.dtype)
    scales, biases = _float_scales(scales, biases, bits)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def x8_serves(rows: int, k: int, bits: int) -> bool:
    """Whether the op computes a product of `rows` rows x [rows, k] with x rounded to 8 bits
    (kernels/native/qmm_dot8.cpp: Q6_K weights, and with `--qmm-x8 on` 4-bit ones, decode
    rows and the GEMM's; 8-bit ones with `on`, likewise; `off`: none)."""
    if not available()[0]:
        return False
    from segserve.kernels.native import _segattn

    return bool(_segattn.qmm_x8_takes(rows, k, bits))


def x8_block(rows: int, k: int, bits: int) -> int:
    """How many values of x share one 8-bit rounding scale in the op's product of `rows`
    rows (256: Q6_K decode rows, as llama.cpp's Q8_K; 32: the rest), 0 where x stays float."""
    if not available()[0]:
        return 0
    from segserve.kernels.native import _segattn

    return int(_segattn.qmm_x8_block(rows, k, bits))


def x8_product(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, block: int = 32
) -> mx.array:
    """What the op's 8-bit-x path computes, with MLX's ops (its differential reference):
    x rounded per `block` values (`x8_block`) to d * round(x / d), d = max|x| / 127; the
    weights' codes centred (affine 4-bit: q - 8, 8-bit: q - 128; Q6_K: its own q - 32) meet
    the rounded x, the rest of each affine weight (bias + centre * scale) the exact x."""
    k = x.shape[-1]
    blocks = x.reshape(-1, k // block, block)
    d = mx.max(mx.abs(blocks), axis=-1, keepdims=True) / 127.0
    inv = mx.where(d > 0, 1.0 / mx.where(d > 0, d, 1.0), 0.0)
    xhat = (mx.round(blocks * inv) * d).reshape(x.shape)
    if bits == Q6K_BITS:
        return mlx_product(xhat, w, scales, biases, group_size, bits)
    scales, biases = _float_scales(scales, biases, bits)
    centre = -symmetric_bias(bits)
    residual = (x - xhat).reshape(*x.shape[:-1], k // group_size, group_size).sum(axis=-1)
    offset = (biases.astype(mx.float32) + centre * scales.astype(mx.float32)).T  # [groups, n]
    return mlx_product(xhat, w, scales, biases, group_size, bits) + residual @ offset


@contextmanager
def float_x() -> Iterator[None]:
    """Ops built inside keep x in float32 (`--qmm-x8 off`) whatever the setting; the setting
    is back after. For the start-up comparisons of two plans of the same arithmetic (the
    batched step against the model's forward, the native layer ops against MLX's ops):
    rounding x to 8 bits would turn those plans' float32 differences into whole code steps
    (~0.5 % of a product) and fail a check of the structure for no structural reason. The
    rounding is checked on its own (`self_check` against `x8_product`). The mode is read
    when an op is built, so only the thread building graphs here sees it."""
    if not available()[0]:
        yield
        return
    from segserve.kernels.native import _segattn

    before = _segattn.qmm_x8()
    _segattn.qmm_set_x8("off")
    try:
        yield
    finally:
        _segattn.qmm_set_x8(before)


def reference_product(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """The op's product with MLX's ops, x rounded as the op rounds it (`x8_product`) or not."""
    rows = 1
    for dim in x.shape[:-1]:
        rows *= int(dim)
    block = x8_block(rows, int(x.shape[-1]), bits)
    if block:
        return x8_product(x, w, scales, biases, group_size, bits, block)
    return mlx_product(x, w, scales, biases, group_size, bits)


def _empty_q6k(rows: int, cols: int) -> tuple[mx.array, mx.array, mx.array]:
    """Zeroed Q6_K blocks of a [rows, cols] matrix (codes, sub-block scales, super-scales),
    to be filled by load_weights."""
    return (mx.zeros((rows, cols // 256 * 192), dtype=mx.uint8), mx.zeros((rows, cols // 16), dtype=mx.int8),
            mx.zeros((rows, cols // 256), dtype=mx.float16))


class Q6KLinear(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """A linear layer whose matrix is GGUF Q6_K blocks: weight uint8 [out, in/256*192] (the
    codes), scales int8 [out, in/16], biases float16 [out, in/256] (the super-scales).
    Served by the op on the CPU, else through `dequantize_q6k`."""

    group_size = Q6K_GROUP
    bits = Q6K_BITS
    mode = "q6_k"

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__()
        self.weight, self.scales, self.biases = _empty_q6k(output_dims, input_dims)
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def like(cls, linear: Any) -> Q6KLinear:
        """An empty one of `linear`'s shape (an `nn.Linear`), to be filled by load_weights."""
        out_dims, in_dims = (int(n) for n in linear.weight.shape)
        return cls(in_dims, out_dims, bias="bias" in linear)

    def __call__(self, x: mx.array) -> mx.array:
        y = mlx_product(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y + self.bias if "bias" in self else y


class K8Linear(nn.Module):  # type: ignore[misc]
    """An affine 4/8-bit linear layer, group size 32, whose scales and biases are in the
    compact QMM_K8 form (uint8 [out, in/256*K8_BYTES]; GGUF Q4_K/Q5_K). `install` routes it
    through the op; without the extension its product expands them (`mlx_product`)."""

    group_size = 32
    mode = "affine"

    def __init__(self, input_dims: int, output_dims: int, bits: int, bias: bool = False) -> None:
        super().__init__()
        self.bits = bits
        self.weight = mx.zeros((output_dims, input_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // 256 * K8_BYTES), dtype=mx.uint8)
        self.biases = mx.zeros_like(self.scales)
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def like(cls, linear: Any) -> K8Linear:
        """An empty one of `linear`'s shape (an `nn.QuantizedLinear`), to be filled by load_weights."""
        bits = int(linear.bits)
        out_dims, in_dims = int(linear.weight.shape[0]), int(linear.weight.shape[1]) * 32 // bits
        return cls(in_dims, out_dims, bits, bias="bias" in linear)

    def __call__(self, x: mx.array) -> mx.array:
        y = mlx_product(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y + self.bias if "bias" in self else y


class Q6KEmbedding(nn.Module):  # type: ignore[misc]
    """An embedding table kept in GGUF Q6_K blocks (`Q6KLinear`'s arrays), rows dequantized
    on lookup; `as_linear` is its product as a tied output projection (`CpuQuantizedHead`
    serves it through the op).

    Why: a tied Q6_K table (the embedding and output of most small models' Q4_K_M/Q5_K_M
    files: Llama 3.2 1B/3B, Qwen 2.5, Gemma) re-gridded to 8-bit affine costs 9 bits per
    weight against the file's 6.56, and the output projection reads all of it at every
    decoded token; the rows were also only near the file's values. Here both are exact.
    A lookup touches a few rows: `dequantize_q6k` on them, compiled (one decode row 0.10 ms
    against 0.27 uncompiled and 0.14 for an 8-bit affine table's lookup, in a one-off timing
    on the 2-core CPU), its output in `rows_dtype`: float16, the precision a GGUF's quantized
    rows are served in."""

    group_size = Q6K_GROUP
    bits = Q6K_BITS
    mode = "q6_k"

    def __init__(self, num_embeddings: int, dims: int) -> None:
        super().__init__()
        self.weight, self.scales, self.biases = _empty_q6k(num_embeddings, dims)
        self.rows_dtype = mx.float16  # a plain attribute (nn.Module keeps only arrays as parameters)

    @classmethod
    def like(cls, embedding: Any) -> Q6KEmbedding:
        """An empty one of `embedding`'s shape (an `nn.Embedding`), to be filled by load_weights."""
        n, dims = (int(d) for d in embedding.weight.shape)
        return cls(n, dims)

    def __call__(self, ids: mx.array) -> mx.array:
        flat = ids.reshape(-1)
        rows: mx.array = _dequantize_q6k_compiled(self.weight[flat], self.scales[flat], self.biases[flat])
        return rows.astype(self.rows_dtype).reshape(*ids.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        # the op where it serves x: MLX's ops would dequantize the whole table (the model's
        # own forward, e.g. the start-up checks, took ~1.3 GB more at its peak that way)
        return quantized_matmul(x, self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)


class CpuQuantizedLinear(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """`nn.QuantizedLinear` (affine mode) whose product runs through the extension on CPU.

    Holds the same parameters (weight, scales, biases[, bias]) under the same names, so
    parameter trees are unchanged; a symmetric layer's biases are [n, 0] (`symmetric`:
    the op derives them), which byte counts see."""

    def __init__(self, layer: Any, op: Callable[..., mx.array | None], x8: str = "") -> None:
        super().__init__()
        self.weight = layer.weight
        self.scales = layer.scales
        self.biases = layer.biases
        if symmetric(layer.scales, layer.biases, int(layer.bits)):
            self.biases = without_biases(layer.scales)
        if "bias" in layer:
            self.bias = layer.bias
        self.group_size = int(layer.group_size)
        self.bits = int(layer.bits)
        # This product's rounding of x where the process runs `--qmm-x8` auto, as llama.cpp
        # rounds it (`install`'s `x8`): "gemm" 4/8-bit weights' prefill rows, "on" their
        # decode rows too (K-quant and Q8_0 files); "" the process's. The native layer ops take it too.
        self.x8 = x8
        self._op = [op]  # a list: not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        y = self._op[0](x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.x8)
        if y is None:
            y = mlx_product(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y + self.bias if "bias" in self else y


class CpuQuantizedHead(nn.Module):  # type: ignore[misc]
    """Output projection of a tied `nn.QuantizedEmbedding` (its `as_linear`) via the op.
    Shares the embedding's arrays (no copy); not a parameter holder of its own. `x8`: as
    `CpuQuantizedLinear.x8`."""

    def __init__(self, embedding: Any, op: Callable[..., mx.array | None], x8: str = "") -> None:
        super().__init__()
        self._emb = [embedding]
        self._op = [op]
        self.x8 = x8

    def __call__(self, x: mx.array) -> mx.array:
        e = self._emb[0]
        y = self._op[0](x, e.weight, e.scales, e.biases, int(e.group_size), int(e.bits), self.x8)
        if y is None:
            return e.as_linear(x)  # type: ignore[no-any-return]
        return y


class FusedQuantizedPart(LayerPart):
    """One quantized projection of a fused group (q/k/v, gate/up): one op call instead of
    three (or two), each ~15-20 us of fixed cost at decode."""


def _fuse(parent: Any, names: tuple[str, ...], op: Callable[..., mx.array | None]) -> bool:
    mods = [getattr(parent, n, None) for n in names]
    if not all(type(m) is CpuQuantizedLinear and "bias" not in m for m in mods):
        return False
    first = mods[0]
    if any(m.bits != first.bits or m.group_size != first.group_size  # type: ignore[union-attr]
           or m.scales.dtype != first.scales.dtype or m.weight.shape[1] != first.weight.shape[1]  # type: ignore[union-attr]
           or m.biases.shape[1] != first.biases.shape[1]  # type: ignore[union-attr]  # symmetric or not, alike
           for m in mods):
        return False
    widths = [int(m.weight.shape[0]) for m in mods]  # type: ignore[union-attr]
    splits = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    gs, bits = first.group_size, first.bits  # type: ignore[union-attr]
    # a holder, refilled below
    fused = Q6KLinear(256, 1) if bits == Q6K_BITS else nn.QuantizedLinear(gs, 1, bias=False, group_size=gs, bits=bits)
    fused.weight = mx.concatenate([m.weight for m in mods], axis=0)  # type: ignore[union-attr]
    fused.scales = mx.concatenate([m.scales for m in mods], axis=0)  # type: ignore[union-attr]
    fused.biases = mx.concatenate([m.biases for m in mods], axis=0)  # type: ignore[union-attr]
    # Now, not with the whole model: the parts' old rows go as soon as each copy is made, so
    # loading peaks at one group's copy above the weights, not all of them (+68 MB of peak
    # RSS on a 28-layer 0.4B Q8_0 file when evaluated at the end).
    mx.eval(fused.weight, fused.scales, fused.biases)
    shared = SharedLayer(CpuQuantizedLinear(fused, op, first.x8), splits)  # type: ignore[union-attr]
    for i, n in enumerate(names):
        setattr(parent, n, FusedQuantizedPart(shared, i))
    return True


def _affine(layer: Any) -> bool:
    return getattr(layer, "mode", "affine") == "affine" and int(layer.bits) in BITS and int(layer.group_size) in GROUP_SIZES


def install(model: nn.Module, shape: ModelShape, *, fuse: bool = True, x8: str = "",
            after_fusing: Callable[[], None] | None = None) -> int:
    """Route the model's quantized linear layers (and a tied quantized head: `shape` says
    whether the head is the embedding table) through the op;
    with `fuse`, q/k/v and gate/up become one product each (concatenated rows). `x8`: the
    layers' own rounding of x where the process runs auto (`CpuQuantizedLinear.x8`).
    `after_fusing`: called after each layer's groups are fused (the loader hands back the
    freed parts' heap there: the fused copies rarely fit the parts' holes, and a 28-layer
    0.4B Q4_K_M model's start-up peaked ~50 MB higher without it).

    Returns how many projections were routed (0 when the extension is unavailable). Call
    once at load, on the CPU."""
    op = _op()
    if op is None:
        return 0
    count = 0
    for _, mod in model.named_modules():
        for name, child in list(mod.children().items()):
            if (type(child) in (nn.QuantizedLinear, K8Linear) and _affine(child)) or type(child) is Q6KLinear:
                setattr(mod, name, CpuQuantizedLinear(child, op, x8))
                count += 1
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        embed is not None
        and shape.tie_word_embeddings
        and ((type(embed) is nn.QuantizedEmbedding and _affine(embed)) or type(embed) is Q6KEmbedding)
        and "tied_head" not in model
    ):
        model.tied_head = CpuQuantizedHead(embed, op, x8)
        count += 1
    if fuse:
        groups = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
        # Parents only: a list of every module would keep each replaced part's rows alive
        # until the end, and loading would peak at a second copy of the fused layers.
        parents = [mod for _, mod in model.named_modules() if any(g[0] in mod for g in groups)]
        for mod in parents:
            for group in groups:
                _fuse(mod, group, op)
            if after_fusing is not None:
                after_fusing()
    return count


def quantized_shapes(model: nn.Module) -> list[tuple[int, int, int, int, mx.Dtype, bool]]:
    """Distinct (N, K, bits, group_size, scale dtype, symmetric) of the model's affine
    quantized layers and Q6_K ones (bits 6); symmetric: routed without biases (`symmetric`;
    a tied embedding keeps its own for the lookup)."""
    seen: dict[tuple[int, int, int, int, str, bool], tuple[int, int, int, int, mx.Dtype, bool]] = {}
    for _, mod in model.named_modules():
        q6k = type(mod) in (Q6KLinear, Q6KEmbedding) or (type(mod) is CpuQuantizedLinear and mod.bits == Q6K_BITS)
        if q6k or (type(mod) in (nn.QuantizedLinear, nn.QuantizedEmbedding, CpuQuantizedLinear, K8Linear)
                   and _affine(mod)):
            n = int(mod.weight.shape[0])
            k = int(mod.scales.shape[1]) * Q6K_GROUP if q6k else int(mod.weight.shape[1]) * 32 // int(mod.bits)
            sym = type(mod) is not nn.QuantizedEmbedding and not q6k and (
                mod.biases.size == 0 or symmetric(mod.scales, mod.biases, int(mod.bits)))
            key = (n, k, int(mod.bits), int(mod.group_size), str(mod.scales.dtype), sym)
            seen[key] = (n, k, int(mod.bits), int(mod.group_size), mod.scales.dtype, sym)
    return list(seen.values())


def random_q6k(n: int, k: int, key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Q6_K blocks of an [n, k] matrix with random codes, sub-block scales and small
    super-scales (every byte pattern is a valid code)."""
    kw, ks, kd = mx.random.split(key, 3)
    w = mx.random.randint(0, 256, (n, k // 256 * 192), key=kw).astype(mx.uint8)
    s = mx.random.randint(-128, 128, (n, k // 16), key=ks).astype(mx.int8)
    d = (mx.random.uniform(1e-4, 1e-3, (n, k // 256), key=kd)).astype(mx.float16)
    return w, s, d


def random_k8(n: int, k: int, bits: int, key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Codes of an [n, k] matrix with QMM_K8 scales and biases (random 6-bit multipliers,
    small factors: a Q4_K-like matrix; `bits` 8 is a widened Q5_K's)."""
    kw, ks, kf = mx.random.split(key, 3)
    w = mx.view(mx.random.randint(0, 256, (n, k * bits // 8), key=kw).astype(mx.uint8), mx.uint32)
    mult = mx.random.randint(0, 64, (2, n, k // 256, 8), key=ks).astype(mx.uint8)
    fac = mx.random.uniform(1e-4, 1e-3, (2, n, k // 256, 1), key=kf).astype(mx.float16)
    fac = fac * mx.array([1.0, -1.0], dtype=mx.float16).reshape(2, 1, 1, 1)  # biases: -dmin
    raw = mx.view(fac, mx.uint8)  # [2, n, blocks, 2]: the float16 bytes, little end first
    both = mx.concatenate([raw, mult], axis=-1).reshape(2, n, -1)
    return w, both[0], both[1]


def error_and_tolerance(got: mx.array, ref: mx.array, rel: float = 1e-4) -> tuple[float, float]:
    """Max abs error of `got` against `ref`, and the tolerance the start-up self-checks
    allow: `rel` of the reference's largest magnitude (at least `rel`)."""
    err = float(mx.max(mx.abs(got - ref)).item())  # type: ignore[arg-type]  # item() of a 0-d float array
    return err, rel * max(1.0, float(mx.max(mx.abs(ref)).item()))  # type: ignore[arg-type]


def self_check(
    shapes: Iterable[tuple[Any, ...]], rows: Iterable[int] = (1, 3, 16, 37)
) -> tuple[bool, str]:
    """The op against `mx.quantized_matmul` on random weights of each shape (N, K, bits,
    group size, scale dtype[, symmetric]; `quantized_shapes`): (ok, reason) (decode rows the
    op rounds to 8 bits: against `reference_product`, x rounded the same way; symmetric:
    the op given no biases, MLX's ops the rebuilt ones).

    Wide layers are checked on their first ~256 output rows (same K, same N mod 4, so the
    same code paths; MLX's own CPU op is slow enough that a full vocabulary head would add
    seconds to start-up)."""
    op = _op()
    if op is None:
        return False, available()[1]
    checked = 0
    for shape in shapes:
        n_full, k, bits, gs, sdt = shape[:5]
        sym = len(shape) > 5 and bool(shape[5])
        n = min(n_full, 256 + n_full % 4)
        wkey, xkey = mx.random.split(mx.random.key(1234 + checked))
        if bits == Q6K_BITS:
            w, s, b = random_q6k(n, k, wkey)
        elif sdt == mx.uint8:
            w, s, b = random_k8(n, k, bits, wkey)
        else:
            w, s, b = mx.quantize(mx.random.normal((n, k), key=wkey) * 0.05, group_size=gs, bits=bits)
            s, b = s.astype(sdt), b.astype(sdt)
            if sym:
                b = without_biases(s)
        for r in rows:
            x = mx.random.normal((r, k), key=mx.random.split(xkey, r + 1)[r])
            ref = reference_product(x, w, s, b, gs, bits)
            got = op(x, w, s, b, gs, bits)
            if got is None:
                return False, f"op declined shape N={n} K={k} bits={bits} gs={gs} {sdt}"
            err, tol = error_and_tolerance(got, ref)
            if not err <= tol:
                return False, (f"mismatch {err:.3g} > {tol:.3g} at N={n} K={k} bits={bits} gs={gs} rows={r}"
                               + (" symmetric" if sym else ""))
        checked += 1
    return True, f"{checked} shape(s) match mx.quantized_matmul"
