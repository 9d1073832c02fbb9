// CPU quantized matmul kernel: plain-C interface between the MLX primitive (qmm_op.cpp,
// compiled for the baseline ISA) and the kernel bodies (qmm_kernel.cpp, compiled once per
// ISA with its own -m flags and a per-ISA entry point name).
//
// Only POD types and declarations here (same rule as segattn.h): nothing inline, no
// templates, so no code built with wide flags can be picked for baseline callers.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

// QMM_K8: GGUF K-quant scales kept compact (group_size 32 only): per 8 consecutive groups
// (a 256-weight block) 10 bytes, a float16 factor then 8 uint8 multipliers; group g's value
// is factor(g / 8) * multiplier(g). Q4_K's scales are d * sc and its biases -dmin * m in
// this form, exact in float32 (an 11-bit significand times a 6-bit integer), where float16
// per group would round them and take 16 bits per group instead of 10 (each array).
enum QmmScaleType { QMM_F32 = 0, QMM_F16 = 1, QMM_BF16 = 2, QMM_K8 = 3 };
enum { QMM_K8_BYTES = 10 };  // bytes per 8 groups of a QMM_K8 array

// y[r, n] = sum_k x[r, k] * (scales[n, k / gs] * q[n, k] + biases[n, k / gs])
// with q[n, k] the k-th `bits`-wide field of row n of `w` (MLX's affine format: uint32
// words, field j of a word at bits [j * bits, (j + 1) * bits), little end first).
// Symmetric affine weights (GGUF Q4_0, Q8_0: d * (q - centre)) carry no biases array
// (biases NULL): every group's bias is -centre * scale, centre 8 (4-bit) or 128 (8-bit);
// the file's 4.5 / 8.5 bits per weight stay so in memory instead of 5 / 9.
//
// bits == 6 is GGUF's Q6_K instead (group_size 16): w holds per block of 256 weights
// its 192 code bytes in llama.cpp's order (ql[128]: low nibbles, qh[64]: high bit pairs),
// `scales` the block's 16 int8 sub-block scales [n, k / 16] and `biases` its float16
// super-scale d [n, k / 256]; weight = d * scale * (q - 32), q in [0, 63].
struct QmmArgs {
  const float* xp;       // [rows, k] x in the kernel's block order (qmm_prep_* wrote it)
  const float* xs;       // [rows, groups] sum of x over each group
  const uint32_t* w;     // [n, k * bits / 32], row-contiguous
  const void* scales;    // [n, groups] of scale_type, row-contiguous
  const void* biases;    // [n, groups]; NULL: symmetric (below)
  float* y;              // [rows, n], row-contiguous
  int64_t rows, n, k, groups;
  int group_size, bits, scale_type;
  int64_t row_chunk;     // rows per pass over a column range (x chunk stays in L2)
  // Rows with 8-bit x (qmm_dot8.cpp; qmm_prep8_* wrote them, and xs: affine the exact
  // sums of x per group, Q6_K the sums of the rounded x per 16-value sub-block):
  const int8_t* xq;      // [rows, k] x codes in the body's order
  const float* xd;       // [rows, k / 32 + 8] per block of 32 values: x ~= xd * xq (padded)
  const float* xr;       // [rows, groups] affine: sum of x minus sum of the rounded x per group
};

// Columns [n0, n1) for every row. Kernels for different column ranges never write the
// same output, so threads split the columns.
typedef void (*QmmRunFn)(const QmmArgs* args, int64_t n0, int64_t n1);

// Block order of x for a body: (lanes, bits) -> within every block of 2 * lanes values
// (4-bit) the even positions first, then the odd ones; 8-bit keeps the natural order.
// Writes xp [rows, k] and xs [rows, groups] from x (element strides sr, sk).
typedef void (*QmmPrepFn)(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k,
                          int group_size, int bits, float* xp, float* xs);

// Many rows (prefill): a packed-panel GEMM. x is first packed by qmm_gemm_pack_* into
// [ceil(rows / mr)][k][mr] (QmmArgs::xp; xs unused), mr and nr from qmm_gemm_tile_*; the
// op hands each thread whole panels of nr columns where it can.
typedef void (*QmmGemmPackFn)(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k, float* ap);
typedef void (*QmmGemmTileFn)(int* mr, int* nr);

// Decode rows (1 .. QMM_X8_MAX_ROWS) with x rounded to 8 bits per block of 32 values
// (qmm_dot8.cpp): 4-bit affine (k % 64 == 0) and Q6_K. The prep writes, for one row, xq,
// xd, xs and xr (QmmArgs; xr only for the affine format) from x [k] with element stride sk;
// every body uses the same layout. Rows follow each other with strides k (xq), k / 32 + 8
// (xd) and groups (xs, xr; Q6_K's groups are its 16-value sub-blocks). Q6_K decode rows
// (the prep called with bits 6 and group_size 256) round x per block of 256 instead, as
// llama.cpp's Q8_K: xd[b] per 256 values, and xs holds the codes' sums per sub-block as
// int16 (16 per block, in the row's float storage).
enum { QMM_X8_MAX_ROWS = 23 };
typedef void (*QmmPrep8Fn)(const float* x, int64_t sk, int64_t k, int group_size, int bits,
                           int8_t* xq, float* xd, float* xs, float* xr);
// From the GEMM's row count on (prefill), the same rounding and sums cut as a GEMM
// (qmm_gemm8_*): x prepared per row as above, with bits 8 for the affine formats (natural
// order, the exact sums and the residuals per group) and 6 for Q6_K.
void qmm_dot8_generic(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm8_generic(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep8_generic(const float* x, int64_t sk, int64_t k, int group_size, int bits,
                       int8_t* xq, float* xd, float* xs, float* xr);

void qmm_run_generic(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep_generic(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k,
                      int group_size, int bits, float* xp, float* xs);
void qmm_gemm_generic(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm_pack_generic(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k, float* ap);
void qmm_gemm_tile_generic(int* mr, int* nr);
#if defined(__x86_64__) || defined(_M_X64)
void qmm_run_avx2(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep_avx2(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k,
                   int group_size, int bits, float* xp, float* xs);
void qmm_gemm_avx2(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm_pack_avx2(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k, float* ap);
void qmm_gemm_tile_avx2(int* mr, int* nr);
void qmm_run_avx512(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep_avx512(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k,
                     int group_size, int bits, float* xp, float* xs);
void qmm_gemm_avx512(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm_pack_avx512(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k, float* ap);
void qmm_gemm_tile_avx512(int* mr, int* nr);
void qmm_dot8_avx2(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm8_avx2(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep8_avx2(const float* x, int64_t sk, int64_t k, int group_size, int bits,
                    int8_t* xq, float* xd, float* xs, float* xr);
void qmm_dot8_vnni(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_gemm8_vnni(const QmmArgs* args, int64_t n0, int64_t n1);
void qmm_prep8_vnni(const float* x, int64_t sk, int64_t k, int group_size, int bits,
                    int8_t* xq, float* xd, float* xs, float* xr);
#endif

}  // extern "C"
