"""GGUF tensor blocks → MLX's affine quantized layout, read from the raw bytes.

Owns: `convert` (one GGUF tensor's raw data → a float `mx.array` or an `AffineTensor`),
`SERVED` (the GGUF types served compactly) and the per-type block unpacking.

Why not `mx.load`: it keeps Q4_0/Q4_1/Q8_0 but casts every other quantized type to
float16, so a K-quant file (Q4_K_M, Q5_K_M, Q6_K: what most people download) would be
served at 16 bits per weight. Here each block is unpacked into integer codes plus one scale
and one bias per 32 weights, which is exactly MLX's affine format
(`w = scale * q + bias`, group size 32, codes packed little-endian into uint32 words):

| GGUF  | block | GGUF formula (per 32 weights)         | MLX affine g32        | exact?              |
|-------|-------|---------------------------------------|-----------------------|---------------------|
| Q4_0  | 32    | d*(q-8)                               | 4-bit, s=d, b=-8d     | bit-exact           |
| Q4_1  | 32    | d*q + m                               | 4-bit, s=d, b=m       | bit-exact           |
| Q5_0  | 32    | d*(q-16)                              | 5-bit, s=d, b=-16d    | bit-exact           |
| Q5_1  | 32    | d*q + m                               | 5-bit, s=d, b=m       | bit-exact           |
| Q8_0  | 32    | d*q, q int8                           | 8-bit, s=d, b=-128d   | bit-exact           |
| Q4_K  | 256   | d*sc*q - dmin*m (sc, m 6-bit)         | 4-bit                 | s, b rounded to f16 |
| Q5_K  | 256   | d*sc*q - dmin*m                       | 5-bit                 | s, b rounded to f16 |
| Q6_K  | 256   | d*sc*q, 16-weight sub-blocks          | 8-bit, or own blocks  | near, or bit-exact  |

Q6_K's scales belong to 16-weight sub-blocks and MLX's smallest group is 32, so each
group holds two sub-blocks with their own scales. The group's step is a quarter of the
larger sub-block's step (codes 4*q, exact for that sub-block); the other sub-block's values
are rounded to that grid: error at most half a step, i.e. 1/8 of the larger Q6_K step
(one step where q=-32 meets an equal, opposite-signed scale: code 128 is clipped to 127),
zero where the two scales are equal or divide evenly. This costs 9 bits per weight against
the file's 6.56 (MLX cannot keep 16-weight groups).

Where the CPU extension serves Q6_K itself (`convert(..., q6k_blocks=True)`, every matrix
the embedding table included), the file's blocks are kept: the 192 code bytes of each block as
one uint8 row, the 16 int8 sub-block scales and the float16 super-scale as two small arrays
(`Q6KTensor`, 6.56 bits per weight, exact; `segserve.kernels.qmm_cpu.Q6KLinear` serves a
matrix, `Q6KEmbedding` the table's row lookups and its tied output projection).

Where the CPU extension serves them (`convert(..., k_scales=True)`, every matrix but the
embedding table), Q4_K and Q5_K (widened) keep their scales in the file's own form: per
256-weight block the float16 d (and -dmin) with the eight 6-bit multipliers sc (and m) as
bytes, 10 bytes each for scales and biases (the extension's QMM_K8, kernels/native/qmm.h),
and the values are exact: d * sc is computed in float32 (an 11-bit significand times a
6-bit integer fits), where the float16 per group above rounds it. 4.625 bits per Q4_K
weight against 5 (and the file's 4.5): ~8 % fewer bytes in each Q4_K matrix a decode step reads.

Q2_K, Q3_K (16-weight sub-blocks at 2-3 bits: 8-bit codes would be 2.6x the file) and the
IQ* / TQ* / MXFP4 codebook types are refused with their name, never cast to float.
5-bit codes widened to 8 bits (`convert(..., widen_5bit=True)`): the same code with the same
scale and bias, stored in a byte (w = s*q + b with q in [0, 31] is unchanged), so it is exact.
Why: the CPU quantized matmul extension serves 4 and 8 bits only, and MLX's own 5-bit CPU
kernel is slow. It costs memory: 9 bits per weight (8 + float16 scale and bias per 32)
against 6 in the compact 5-bit form, 1.5x; against the file (Q5_K and Q5_0: 5.5 bits, Q5_1:
6) 1.64x / 1.5x, over the 1.15x-of-the-file goal the compact forms keep. On a GPU the
compact form is kept.
Invariant: every affine tensor has float16 scales and biases of shape [rows, cols/32], or
(`k_scales`) uint8 ones of shape [rows, cols/256*10].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

GROUP = 32
_ROWS_PER_CHUNK_ELEMS = 1 << 22  # unpack ~4M weights at a time: bounds the transient numpy copies

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [nb, E] uint8, scale/bias [nb, E/32] f32


class UnsupportedTensorType(ValueError):
    """A GGUF tensor type that is not served compactly (named in the message)."""


@dataclass(frozen=True, slots=True)
class AffineTensor:
    weight: mx.array  # uint32 [rows, cols*bits/32]
    scales: mx.array  # float16 [rows, cols/32], or uint8 [rows, cols/256*10] (K8_BYTES per block)
    biases: mx.array  # as scales
    bits: int
    exact: bool  # False where values were re-gridded (Q6_K)
    widened: bool = False  # 5-bit codes stored as 8-bit (exact; see the module doc)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """GGUF's 4-bit layout: byte j holds value j (low nibble) and value j+n/2 (high)."""
    nb = qs.shape[0]
    out = qs.reshape(nb, -1, 1, n // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (out & np.uint8(0x0F)).reshape(nb, -1)


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 32), d, -8 * d


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:], 32), _f16(b[:, :2]), _f16(b[:, 2:4])


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:], 32) | (_high_bits32(b[:, 2:6]) << np.uint8(4)), d, -16 * d


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _nibbles(b[:, 8:], 32) | (_high_bits32(b[:, 4:8]) << np.uint8(4))
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    q = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_multipliers(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K header bytes 4..16: the packed 6-bit (sc, m) of the 8 sub-blocks, uint8 [nb, 8] each."""
    nb = b.shape[0]
    s = b[:, 4:16].reshape(nb, 3, 4)
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], axis=-1)
    return sc, m


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K header: d, dmin and the 12 bytes of packed 6-bit (sc, m) per sub-block."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k_multipliers(b)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


K8_BYTES = 10  # per 256-weight block: float16 factor + 8 uint8 multipliers (kernels/native/qmm.h QMM_K8)


def k8_arrays(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K blocks [nb, block bytes] → their scales and biases in the extension's
    compact form, uint8 [nb, K8_BYTES] each: d then sc, and -dmin (the float16 sign bit
    flipped: exact) then m."""
    sc, m = _k_multipliers(b)
    neg_dmin = np.ascontiguousarray(b[:, 2:4]).copy()
    neg_dmin[:, 1] ^= np.uint8(0x80)
    return np.concatenate([b[:, 0:2], sc], axis=1), np.concatenate([neg_dmin, m], axis=1)


def _q4_k(b: np.ndarray) -> Unpacked:
    scale, bias = _k_scales(b)
    q = _nibbles(b[:, 16:].reshape(-1, 32), 64).reshape(b.shape[0], 256)
    return q, scale, bias


def _q5_k(b: np.ndarray) -> Unpacked:
    nb = b.shape[0]
    scale, bias = _k_scales(b)
    low = _nibbles(b[:, 48:].reshape(-1, 32), 64).reshape(nb, 8, 32)
    qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = low | ((qh & np.uint8(1)) << np.uint8(4))
    return q.reshape(nb, 256), scale, bias


def _q6_k(b: np.ndarray) -> Unpacked:
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(nb, 8, 32)
    q6 = (ql | (qh << np.uint8(4))).astype(np.float32).reshape(nb, 8, 2, 16) - 32  # [-32, 31]
    sub = (_f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8)).reshape(nb, 8, 2)
    # One 32-weight group = sub-blocks (2g, 2g+1). Step: a quarter of the larger one's
    # (signed so that sub-block's codes are exactly 4*q in [-128, 124]).
    big = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)  # [nb, 8, 1]
    step = (big / 4).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step[..., None] != 0, q6 * sub[..., None] / step[..., None], 0.0)
    q = (np.clip(np.rint(codes), -128, 127) + 128).astype(np.uint8).reshape(nb, 256)
    step = step.reshape(nb, 8)
    return q, step, -128 * step


@dataclass(frozen=True, slots=True)
class Q6KTensor:
    """A Q6_K matrix in its file's blocks (see the module doc and kernels/native/qmm.h)."""

    weight: mx.array  # uint8 [rows, cols/256*192]: ql (128 bytes) then qh (64) per block
    scales: mx.array  # int8 [rows, cols/16]: the sub-block scales
    biases: mx.array  # float16 [rows, cols/256]: the super-scale d


def split_q6k(name: str, data: np.ndarray, shape: tuple[int, ...]) -> Q6KTensor:
    """A Q6_K matrix's raw blocks split into codes, sub-block scales and super-scales
    (byte copies, no arithmetic)."""
    if len(shape) != 2 or shape[-1] % 256:
        raise UnsupportedTensorType(f"GGUF tensor {name}: Q6_K blocks need a matrix of whole 256-weight rows")
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // 256, 210)
    d = np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16).reshape(rows, -1)
    if not np.isfinite(d).all():
        raise UnsupportedTensorType(f"GGUF tensor {name}: a Q6_K scale is not finite")
    return Q6KTensor(
        mx.array(np.ascontiguousarray(blocks[:, :, :192]).reshape(rows, -1)),
        mx.array(np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(rows, -1)),
        mx.array(d),
    )


# type → (bits, weights per block, bytes per block, unpack, exact)
_TYPES: dict[T, tuple[int, int, int, Callable[[np.ndarray], Unpacked], bool]] = {
    T.Q4_0: (4, 32, 18, _q4_0, True),
    T.Q4_1: (4, 32, 20, _q4_1, True),
    T.Q5_0: (5, 32, 22, _q5_0, True),
    T.Q5_1: (5, 32, 24, _q5_1, True),
    T.Q8_0: (8, 32, 34, _q8_0, True),
    T.Q4_K: (4, 256, 144, _q4_k, True),
    T.Q5_K: (5, 256, 176, _q5_k, True),
    T.Q6_K: (8, 256, 210, _q6_k, False),
}
_FLOATS: dict[T, mx.Dtype] = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}
SERVED = frozenset(_TYPES) | frozenset(_FLOATS)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, cols] (each < 2**bits) → MLX's packing: a little-endian bit stream per
    row, read as uint32 words (for 4 and 8 bits: value i in bits [bits*(i%k), ...) of word i/k)."""
    rows, cols = q.shape
    if bits in (4, 8):
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits).reshape(1, 1, per)
        words = q.reshape(rows, cols // per, per).astype(np.uint32) << shifts
        packed: np.ndarray = np.bitwise_or.reduce(words, axis=-1)
        return packed
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)).reshape(rows, -1)
    return np.packbits(stream, axis=-1, bitorder="little").view(np.uint32)


def convert(
    name: str, kind: T, data: np.ndarray, shape: tuple[int, ...], *, widen_5bit: bool = False,
    q6k_blocks: bool = False, k_scales: bool = False,
) -> mx.array | AffineTensor | Q6KTensor:
    """One tensor. `shape` is the row-major shape ([rows, cols] for matrices, GGUF's `ne`
    reversed); `data` is the reader's view (raw bytes [rows, bytes per row] if quantized).
    `widen_5bit`: 5-bit types come back as 8-bit codes with the same scales (exact).
    `q6k_blocks`: a Q6_K matrix comes back as its own blocks (`Q6KTensor`).
    `k_scales`: a Q4_K (or widened Q5_K) tensor keeps its scales in the compact K8 form."""
    if q6k_blocks and kind == T.Q6_K:
        return split_q6k(name, data, shape)
    if kind in _FLOATS:
        if kind == T.BF16:  # numpy has no bfloat16: widen the bits to float32 exactly
            bits16 = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
            return mx.array((bits16.astype(np.uint32) << 16).view(np.float32)).astype(mx.bfloat16)
        return mx.array(np.ascontiguousarray(data).reshape(shape)).astype(_FLOATS[kind])
    if kind not in _TYPES:
        raise UnsupportedTensorType(
            f"GGUF tensor {name} has type {kind.name}, which is not served compactly "
            f"(served: {', '.join(sorted(t.name for t in SERVED))}); re-quantize the file, "
            "e.g. to Q4_K_M or Q8_0"
        )
    bits, per_block, block_bytes, unpack, exact = _TYPES[kind]
    widened = widen_5bit and bits == 5
    if widened:
        bits = 8
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if cols % per_block:
        raise UnsupportedTensorType(f"GGUF tensor {name}: row length {cols} is not whole {kind.name} blocks")
    raw = np.ascontiguousarray(data).reshape(rows, (cols // per_block) * block_bytes)
    k8 = k_scales and kind in (T.Q4_K, T.Q5_K) and bits in (4, 8)
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    if k8:
        scales = np.empty((rows, cols // per_block * K8_BYTES), dtype=np.uint8)
    else:
        scales = np.empty((rows, cols // GROUP), dtype=np.float16)
    biases = np.empty_like(scales)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // cols)
    for r in range(0, rows, step):
        chunk = raw[r : r + step]
        n = chunk.shape[0]
        blocks = chunk.reshape(-1, block_bytes)
        q, s, b = unpack(blocks)
        weight[r : r + n] = pack(q.reshape(n, cols), bits)
        if k8:
            s, b = k8_arrays(blocks)
            scales[r : r + n] = s.reshape(n, -1)
            biases[r : r + n] = b.reshape(n, -1)
        else:
            scales[r : r + n] = s.reshape(n, -1).astype(np.float16)
            biases[r : r + n] = b.reshape(n, -1).astype(np.float16)
    if k8:
        factors = np.concatenate([scales.reshape(-1, K8_BYTES)[:, :2], biases.reshape(-1, K8_BYTES)[:, :2]])
        finite = np.isfinite(np.ascontiguousarray(factors).view(np.float16)).all()
    else:
        finite = np.isfinite(scales).all() and np.isfinite(biases).all()
    if not finite:
        raise UnsupportedTensorType(f"GGUF tensor {name}: a {kind.name} scale overflows float16")
    out_rows = (*shape[:-1], -1)
    return AffineTensor(
        mx.array(weight.reshape(out_rows)),
        mx.array(scales.reshape(out_rows)),
        mx.array(biases.reshape(out_rows)),
        bits,
        exact,
        widened,
    )
