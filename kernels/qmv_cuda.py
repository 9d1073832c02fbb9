"""Products of a few rows with 4-bit and 8-bit affine weights on a CUDA GPU, in one pass over
the weights.

Owns: `SOURCE` (the kernel body, compiled by MLX through `mx.fast.cuda_kernel`),
`takes` (which calls it serves), `small_matmul` (the call), `compile_unit` (the body wrapped
as MLX wraps it, for an nvcc check without a GPU), `GpuQuantizedLinear` and `install`
(`nn.QuantizedLinear` layers of a model on the GPU routed through it for 2..MAX_ROWS rows,
and more rows handed to MLX's op as one [rows, K] matrix).

Why: a batched decode step multiplies every session's row by the same weights. MLX's CUDA
quantized matmul reads the weights once for one row (its `qmv`), but from two rows on it
takes its tiled GEMM (on Hopper `qmm_sm90`), cut for many rows: eight sessions of a 4-bit
Llama-3-8B shape decoded at 263 tok/s against 650-672 with bfloat16 weights on an H100
(docs/performance.md). Here each warp owns CW output columns over all of K and all M
(<= MAX_ROWS) rows: every 16-byte load of weights (32 4-bit or 16 8-bit codes) is
dequantized once in registers and meets the M rows' x, so the weights are read once per
call at any M. The float work grows with M (M FMAs per weight): on an H100 a Llama-3-8B
layer's products took 0.25-0.72x MLX's time at 2-4 rows and 1.6x at 8, where MLX's GEMM on
x [8, K] is efficient (bench/small_qmm_gpu.py): hence MAX_ROWS = 7, and from 8 rows on the
rows go to MLX's op as one matrix (a decode batch's x [B, 1, K] would reach it as B products
of one row, each reading all of the weights).

Arithmetic: w = scale * q + bias per group, as MLX's affine format; products and sums in
float32 (MLX's own `qmv` sums 4-bit products in the activation dtype), the output rounded
to the activation dtype once. Differential tests against `mx.quantized_matmul` and a
float64 reference on the GPU (tests/test_qmv_cuda.py).

Layout (MLX's): w uint32 [N, K * bits / 32], scales and biases [N, K / group_size] in x's
dtype, x [M, K] row-contiguous. Served: bits 4 and 8, group size 32/64/128, K % 32 == 0,
x bfloat16 or float16 with scales of the same dtype.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 7  # rows one call serves (M); fewer than 2 and more go to MLX's own op
WARPS = 4  # warps per block
COLUMNS = 4  # output columns per warp (CW)
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

HEADER = """
namespace segserve_qmv {
template <typename A> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<__nv_bfloat16> { static constexpr bool value = true; };
}  // namespace segserve_qmv
"""

# Body of the `__global__` function MLX generates (inputs x, w, scales, biases; output out;
# template constants T, M, CW, GS, BITS). One lane takes 32 consecutive k at a time (16 bytes
# of a 4-bit row, 32 of an 8-bit one; one group, as GS >= 32), a warp 1024 per step.
SOURCE = r"""
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int col0 = (blockIdx.x * (blockDim.x >> 5) + warp) * CW;
  if (col0 >= N) return;
  constexpr int WORDS = 32 * BITS / 32;      // uint32 words of one lane's 32 codes
  constexpr int PER_WORD = 32 / BITS;        // codes per word
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int64_t words_per_row = (int64_t)K * BITS / 32;
  const int groups = K / GS;
  float acc[CW][M];
#pragma unroll
  for (int c = 0; c < CW; ++c)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;
  for (int k0 = lane * 32; k0 < K; k0 += 32 * 32) {
    uint32_t wq[CW][WORDS];
    float sc[CW], bi[CW];
#pragma unroll
    for (int c = 0; c < CW; ++c) {
      const int col = min(col0 + c, N - 1);  // past N: a valid row, never stored
      const uint4* src = reinterpret_cast<const uint4*>(w + col * words_per_row + k0 * BITS / 32);
#pragma unroll
      for (int v = 0; v < WORDS / 4; ++v) {
        const uint4 u = src[v];
        wq[c][4 * v] = u.x; wq[c][4 * v + 1] = u.y; wq[c][4 * v + 2] = u.z; wq[c][4 * v + 3] = u.w;
      }
      sc[c] = static_cast<float>(scales[(int64_t)col * groups + k0 / GS]);
      bi[c] = static_cast<float>(biases[(int64_t)col * groups + k0 / GS]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // 8 values of k at a time: one 16-byte load of x per row
      float xf[M][8];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4 u = *reinterpret_cast<const uint4*>(x + (int64_t)m * K + k0 + 8 * e);
        const uint32_t h[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (segserve_qmv::is_bf16<T>::value) {
            xf[m][2 * i] = __uint_as_float(h[i] << 16);
            xf[m][2 * i + 1] = __uint_as_float(h[i] & 0xffff0000u);
          } else {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
            xf[m][2 * i] = f.x;
            xf[m][2 * i + 1] = f.y;
          }
        }
      }
#pragma unroll
      for (int c = 0; c < CW; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int idx = 8 * e + i;                       // value of the lane's 32
          const uint32_t word = wq[c][idx / PER_WORD];
          const uint32_t q = (word >> (BITS * (idx % PER_WORD))) & MASK;
          // exact float of a small integer: its bits under 2^23's exponent, minus 2^23
          const float wv = fmaf(__uint_as_float(0x4b000000u | q) - 8388608.0f, sc[c], bi[c]);
#pragma unroll
          for (int m = 0; m < M; ++m) acc[c][m] = fmaf(xf[m][i], wv, acc[c][m]);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < CW; ++c) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[c][m];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == ((c * M + m) & 31) && col0 + c < N) out[(int64_t)m * N + col0 + c] = static_cast<T>(v);
    }
  }
"""


def takes(rows: int, k: int, bits: int, group_size: int, mode: str, dtype: mx.Dtype, scale_dtype: mx.Dtype) -> bool:
    """Whether `small_matmul` serves a product of `rows` rows x [rows, k] (dtype) by affine
    weights of these bits and group size whose scales are `scale_dtype`. One row stays with
    MLX's `qmv` (one pass over the weights already), more than MAX_ROWS with its GEMM."""
    return (
        2 <= rows <= MAX_ROWS
        and mode == "affine"
        and bits in BITS
        and group_size in GROUP_SIZES
        and k % 32 == 0
        and dtype in (mx.bfloat16, mx.float16)
        and scale_dtype == dtype
    )


@lru_cache(maxsize=4)
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="segserve_small_qmm",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
    )


def small_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                 columns: int = COLUMNS) -> mx.array:
    """x [..., K] @ dequant(w).T for 2..MAX_ROWS rows (`takes`), one launch (`columns`:
    output columns per warp; the benchmark compares others)."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows, n = x2.shape[0], w.shape[0]
    per_block = WARPS * columns
    outs = _kernel()(
        inputs=[x2, w, scales, biases],
        template=[("T", x.dtype), ("M", rows), ("CW", columns), ("GS", group_size), ("BITS", bits)],
        grid=(((n + per_block - 1) // per_block) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    out: mx.array = outs[0]
    return out.reshape(*lead, n)


class GpuQuantizedLinear(nn.QuantizedLinear):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """`nn.QuantizedLinear` whose products of 2..MAX_ROWS rows go through `small_matmul`;
    every other call is MLX's own (same arrays, same format)."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = 1
        for dim in x.shape[:-1]:
            rows *= int(dim)
        if mx.default_device() == mx.gpu and rows > 1:
            if takes(rows, int(x.shape[-1]), self.bits, self.group_size, getattr(self, "mode", "affine"),
                     x.dtype, self["scales"].dtype):
                y = small_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
                return y + self["bias"] if "bias" in self else y
            if x.ndim > 2:
                # Rows as one matrix: MLX reads [B, 1, K] (a decode batch) as B products of one
                # row each, its GEMM once per row over all of the weights.
                flat: mx.array = super().__call__(x.reshape(rows, x.shape[-1]))
                return flat.reshape(*x.shape[:-1], flat.shape[-1])
        out: mx.array = super().__call__(x)
        return out


def install(model: nn.Module) -> int:
    """Route `model`'s affine `nn.QuantizedLinear` layers (4/8-bit, groups 32/64/128) through
    `small_matmul` for 2..MAX_ROWS rows; returns how many. The layers change class in place
    (`GpuQuantizedLinear` adds only `__call__`): a fused projection group holds its layer by
    reference (`segserve.kernels.split_product.SharedLayer`), so a new object would not be
    seen there."""
    routed = 0
    for _, mod in model.named_modules():
        if (type(mod) is nn.QuantizedLinear and getattr(mod, "mode", "affine") == "affine"
                and mod.bits in BITS and mod.group_size in GROUP_SIZES and "biases" in mod):
            mod.__class__ = GpuQuantizedLinear
            routed += 1
    return routed


_PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
"""


def compile_unit(dtype: str = "__nv_bfloat16", rows: int = 8, bits: int = 4, group_size: int = 64) -> str:
    """The kernel as one translation unit, wrapped as MLX wraps it (a `__global__` function
    with the inputs, their `_shape` where the body reads it, the output and the template
    constants), for an nvcc check without a GPU."""
    consts = [f"using T = {dtype};", f"constexpr int M = {rows};", f"constexpr int CW = {COLUMNS};",
              f"constexpr int GS = {group_size};", f"constexpr int BITS = {bits};"]
    params = [f"const {dtype}* x", "const __grid_constant__ Shape x_shape", "const uint32_t* w",
              "const __grid_constant__ Shape w_shape", f"const {dtype}* scales", f"const {dtype}* biases",
              f"{dtype}* out"]
    return (_PRELUDE + HEADER + "__global__ void kernel(\n    " + ",\n    ".join(params) + ") {\n"
            + "\n".join("  " + c for c in consts) + "\n" + SOURCE + "}\n")
