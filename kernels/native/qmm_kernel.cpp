// Quantized matmul kernel body: y = x @ dequant(W).T for MLX's affine group-wise format
// (4-bit or 8-bit fields packed in uint32 words, one float scale and bias per group of
// 32/64/128 values along K), x float32 [rows, K].
//
// Compiled once per ISA (CMakeLists.txt): QMM_ISA_AVX512 (16 float lanes), QMM_ISA_AVX2
// (8 lanes, FMA, F16C) and the portable baseline (4 lanes: SSE2 on x86-64, NEON on
// aarch64), all from this one source written with GCC/Clang vector extensions; qmm_op.cpp
// picks one at run time. Everything has internal linkage except the entry points.
//
// Weight blocks: every block is LANES bytes of one weight row. 4-bit: byte i holds values
// 2i (low nibble) and 2i+1 (high nibble), so one zero-extension of LANES bytes to int32
// lanes gives, after `& 15` and `>> 4`, the even and the odd values of 2 * LANES
// consecutive positions; x is stored (qmm_prep) with the evens of each block first, so
// both halves meet their x with plain vector loads. 8-bit: LANES values, natural order.
//
// Three paths; qmm_op.cpp picks by rows (dot for 1, deq below 24, gemm from 24 on):
//   dot  (1 row: decode)  - NB = 8 columns at once (eight weight streams in flight: ~6 %
//        faster than 4 on the 2-core machine: 30 layers of native blocks 9.9-10.7 against 10.5-11.3
//        ms in three alternating builds); per group a fresh FMA chain of
//        q * x (integer-valued q converted to float), then acc += chain * scale; the
//        biases enter once per group as bias * sum(x over the group). Memory-bound: per
//        weight byte 1 zero-extend, 1 and/shift, 1 convert, 1 FMA (4-bit: 2 values).
//   deq  (batched decode, verify: 2..23 rows) - each weight vector is dequantized in
//        registers (q * s + b, one FMA) and used by RB (<= 4) rows x NB columns of
//        accumulators, read straight from the packed rows (no dequantized copy).
//   gemm (prefill) - a packed-panel GEMM: W dequantized once per K chunk and panel of
//        columns into a small float buffer, shared by every row (qmm_gemm.cpp).
#include "qmm_simd.h"

namespace {

constexpr int kGroupChunk = 64;  // groups whose scales are converted at once (a multiple of LANES)

// One row r, columns n .. n + NB, group size GS (a compile-time constant: the block loop
// unrolls). Per chunk of groups, the NB rows of scales and biases are converted to float32
// on the stack, zero-padded to whole vectors (the group loop broadcasts the scales from
// memory); the bias term sum_g bias[g] * sum(x over g) is accumulated lane-wise into the
// same accumulator as the weights, so each column ends with one horizontal sum, and the
// NB sums are reduced together (reduce4: a few shuffles for four columns instead of
// 2 * LANES dependent scalar adds per column; bench/qmm_cpu.py, decode rows).
template <int NB, int BITS, int ST, int GS>
void tile_dot(const QmmArgs& a, int64_t r, int64_t n) {
  constexpr int BW = kBlock<BITS>;
  constexpr int blocks = GS / BW;
  const int64_t row_bytes = a.k * BITS / 8;
  const uint8_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * row_bytes;
  const float* x = a.xp + r * a.k;
  const float* xs = a.xs + r * a.groups;
  vf acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = vf{};
  alignas(64) float sc[NB][kGroupChunk];
  alignas(64) float bc[NB][kGroupChunk];
  alignas(64) float xsp[kGroupChunk];
  for (int64_t g0 = 0; g0 < a.groups; g0 += kGroupChunk) {
    const int cg = static_cast<int>(a.groups - g0 < kGroupChunk ? a.groups - g0 : kGroupChunk);
    const int padded = (cg + LANES - 1) / LANES * LANES;
    for (int i = 0; i < cg; ++i) xsp[i] = xs[g0 + i];
    for (int i = cg; i < padded; ++i) xsp[i] = 0.0f;
    for (int j = 0; j < NB; ++j) {
      const int64_t first = (n + j) * a.groups + g0;
      to_float<ST>(a.scales, first, cg, sc[j]);
      to_float<ST>(a.biases, first, cg, bc[j]);
      for (int i = cg; i < padded; ++i) bc[j][i] = 0.0f;
      for (int i = 0; i < padded; i += LANES) acc[j] += loadf(bc[j] + i) * loadf(xsp + i);
    }
    for (int gi = 0; gi < cg; ++gi) {
      const int64_t g = g0 + gi;
      vf d[NB];
      for (int j = 0; j < NB; ++j) d[j] = vf{};
      const float* xg = x + g * GS;
      const int64_t byte0 = g * GS * BITS / 8;
      // Decode is bound by DRAM latency more than by these few instructions. The NB rows of
      // a tile are contiguous and the next tile's rows follow them: prefetch that tile
      // evenly over this tile's groups (NB * GS * BITS / 8 bytes per group), so its lines
      // are in flight one tile ahead (a prefetch past the matrix never faults). Against a
      // fixed 1 KB look-ahead in each row: 30 layers of native blocks 7.8-12.3 against
      // 9.9-13.1 ms in three alternating builds.
      {
        constexpr int kAhead = NB * GS * BITS / 8;
        const uint8_t* next = wr[0] + NB * row_bytes + g * kAhead;
        for (int l = 0; l < kAhead; l += 64) __builtin_prefetch(next + l, 0, 3);
      }
#pragma GCC unroll 8
      for (int b = 0; b < blocks; ++b) {
        const float* xb = xg + b * BW;
        if constexpr (BITS == 4) {
          const vf xe = loadf(xb);
          const vf xo = loadf(xb + LANES);
          for (int j = 0; j < NB; ++j) {
            const vi v = load_bytes(wr[j] + byte0 + b * LANES);
            d[j] += to_f(v & 15) * xe;
            d[j] += to_f(v >> 4) * xo;
          }
        } else {
          const vf xv = loadf(xb);
          for (int j = 0; j < NB; ++j) d[j] += to_f(load_bytes(wr[j] + byte0 + b * LANES)) * xv;
        }
      }
      for (int j = 0; j < NB; ++j) acc[j] += d[j] * splat(&sc[j][gi]);
    }
  }
  float* y = a.y + r * a.n + n;
  if constexpr (NB == 8) {
    reduce4(acc[0], acc[1], acc[2], acc[3], y);
    reduce4(acc[4], acc[5], acc[6], acc[7], y + 4);
  } else if constexpr (NB == 4) {
    reduce4(acc[0], acc[1], acc[2], acc[3], y);
  } else {
    for (int j = 0; j < NB; ++j) y[j] = hsum(acc[j]);
  }
}

// Rows r .. r + RB, columns n .. n + NB; W dequantized in registers, shared by the rows.
template <int RB, int NB, int BITS, int ST>
void tile_deq(const QmmArgs& a, int64_t r, int64_t n) {
  constexpr int BW = kBlock<BITS>;
  const int64_t row_bytes = a.k * BITS / 8;
  const int gs = a.group_size;
  const int blocks = gs / BW;
  const uint8_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * row_bytes;
  const float* x[RB];
  for (int i = 0; i < RB; ++i) x[i] = a.xp + (r + i) * a.k;
  vf acc[RB][NB];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vf{};
  for (int64_t g = 0; g < a.groups; ++g) {
    vf s[NB], c[NB];
    const int64_t sidx = n * a.groups + g;
    for (int j = 0; j < NB; ++j) {
      s[j] = vf{} + scalar_at<ST>(a.scales, sidx + j * a.groups);
      c[j] = vf{} + scalar_at<ST>(a.biases, sidx + j * a.groups);
    }
    const int64_t k0 = g * gs;
    const int64_t byte0 = k0 * BITS / 8;
    for (int b = 0; b < blocks; ++b) {
      const int64_t kb = k0 + b * BW;
      for (int j = 0; j < NB; ++j) {
        const vi v = load_bytes(wr[j] + byte0 + b * LANES);
        if constexpr (BITS == 4) {
          const vf we = to_f(v & 15) * s[j] + c[j];
          const vf wo = to_f(v >> 4) * s[j] + c[j];
          for (int i = 0; i < RB; ++i) {
            acc[i][j] += we * loadf(x[i] + kb);
            acc[i][j] += wo * loadf(x[i] + kb + LANES);
          }
        } else {
          const vf wv = to_f(v) * s[j] + c[j];
          for (int i = 0; i < RB; ++i) acc[i][j] += wv * loadf(x[i] + kb);
        }
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    float* y = a.y + (r + i) * a.n + n;
    for (int j = 0; j < NB; ++j) y[j] = hsum(acc[i][j]);
  }
}

template <int RB, int BITS, int ST>
void rows_deq(const QmmArgs& a, int64_t r, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) tile_deq<RB, 2, BITS, ST>(a, r, n);
  for (; n < n1; ++n) tile_deq<RB, 1, BITS, ST>(a, r, n);
}

template <int BITS, int ST, int GS>
void run_dot(const QmmArgs& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) tile_dot<8, BITS, ST, GS>(a, 0, n);
  for (; n + 4 <= n1; n += 4) tile_dot<4, BITS, ST, GS>(a, 0, n);
  for (; n < n1; ++n) tile_dot<1, BITS, ST, GS>(a, 0, n);
}

template <int BITS, int ST>
void run(const QmmArgs& a, int64_t n0, int64_t n1) {
  if (a.rows == 1) {
    switch (a.group_size) {
      case 32: run_dot<BITS, ST, 32>(a, n0, n1); break;
      case 64: run_dot<BITS, ST, 64>(a, n0, n1); break;
      default: run_dot<BITS, ST, 128>(a, n0, n1); break;
    }
    return;
  }
  const int64_t chunk = a.row_chunk > 0 ? a.row_chunk : a.rows;
  constexpr int64_t kColBlock = 64;  // columns per pass over one row chunk
  for (int64_t r0 = 0; r0 < a.rows; r0 += chunk) {
    const int64_t r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    for (int64_t c0 = n0; c0 < n1; c0 += kColBlock) {
      const int64_t c1 = c0 + kColBlock < n1 ? c0 + kColBlock : n1;
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4) rows_deq<4, BITS, ST>(a, r, c0, c1);
      switch (r1 - r) {
        case 3: rows_deq<3, BITS, ST>(a, r, c0, c1); break;
        case 2: rows_deq<2, BITS, ST>(a, r, c0, c1); break;
        case 1: rows_deq<1, BITS, ST>(a, r, c0, c1); break;
        default: break;
      }
    }
  }
}

template <int BITS>
void run_bits(const QmmArgs& a, int64_t n0, int64_t n1) {
  switch (a.scale_type) {
    case QMM_F32: run<BITS, QMM_F32>(a, n0, n1); break;
    case QMM_F16: run<BITS, QMM_F16>(a, n0, n1); break;
    default: run<BITS, QMM_BF16>(a, n0, n1); break;
  }
}

}  // namespace

extern "C" void QMM_RUN(const QmmArgs* args, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  if (args->bits == 4) {
    run_bits<4>(*args, n0, n1);
  } else {
    run_bits<8>(*args, n0, n1);
  }
}

extern "C" void QMM_PREP(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k,
                         int group_size, int bits, float* xp, float* xs) {
  const int64_t groups = k / group_size;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * sr;
    float* out = xp + r * k;
    if (bits == 4) {
      for (int64_t k0 = 0; k0 < k; k0 += 2 * LANES) {
        for (int i = 0; i < LANES; ++i) {
          out[k0 + i] = xr[(k0 + 2 * i) * sk];
          out[k0 + LANES + i] = xr[(k0 + 2 * i + 1) * sk];
        }
      }
    } else if (sk == 1) {
      memcpy(out, xr, sizeof(float) * k);
    } else {
      for (int64_t i = 0; i < k; ++i) out[i] = xr[i * sk];
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      const float* p = out + g * group_size;  // a group is a union of whole blocks
      for (int i = 0; i < group_size; ++i) s += p[i];
      xs[r * groups + g] = s;
    }
  }
}
