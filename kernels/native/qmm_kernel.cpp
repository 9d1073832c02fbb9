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
// Q6_K (bits == 6, qmm.h) has its own dot tile (tile_dot_q6, 1 row), dequantizing tile
// (tile_deq_q6, 2..23 rows) and a branch of the GEMM's panel dequantization.
//
// Three paths; qmm_op.cpp picks by rows (dot for 1, deq below 24, gemm from 24 on):
//   dot  (1 row: decode)  - NB = 8 columns at once (eight weight streams in flight: ~6 %
//        faster than 4 on the 2-core machine: 30 layers of native blocks 9.9-10.7 against 10.5-11.3
//        ms in three alternating builds); per group a fresh FMA chain of
//        q * x (integer-valued q converted to float), then acc += chain * scale; the
//        biases enter once per group as bias * sum(x over the group). Memory-bound: per
//        weight byte 1 zero-extend, 1 and/shift, 1 convert, 1 FMA (4-bit: 2 values).
//   deq  (batched decode, verify: 2..23 rows) - each weight vector is dequantized in
//        registers (q * s + b, one FMA) and used by RB (<= 8 on AVX-512, else 4) rows x NB columns of
//        accumulators, read straight from the packed rows (no dequantized copy); NB = 4
//        for one or two rows (eight accumulators either way), and the next tile's rows
//        prefetched as the dot tiles do. Both for rows read from DRAM: SmolLM2's 8-bit head
//        (49152 x 576) at 2 rows 2.75 -> 1.44 ms, 5 rows 4.50 -> 3.69, 9 rows 6.87 -> 6.17
//        (bench/qmm_cpu.py --rows 1,2,5,9 --isas avx512 --no-llama --decode-tokens 0,
//        before and after); the cache-resident layer shapes within noise.
//   gemm (prefill) - a packed-panel GEMM: W dequantized once per K chunk and panel of
//        columns into a small float buffer, shared by every row (qmm_gemm.cpp).
#include "qmm_simd.h"

namespace {

constexpr int kGroupChunk = 64;  // groups whose scales are converted at once (a multiple of LANES)
// Rows of one dequantizing pass (deq tiles): RB x 2 accumulators plus the dequantized weight
// vectors and scales must stay in registers: 8 rows in AVX-512's 32, 4 in AVX2's 16 (and
// the portable body's). A 5-row verify window on the embedded model's 4-bit layers took one
// pass of 4 rows and one of 1 before (perf: the 1-row pass 11 % of the window's samples
// against 26 % for the 4-row one).
constexpr int kMaxRowBlock = LANES >= 16 ? 8 : 4;

// y[j] = the horizontal sum of acc[j], j < NB (the dot tiles' last step; four columns at
// a time through reduce4).
template <int NB>
inline void store_sums(const vf* acc, float* y) {
  if constexpr (NB == 8) {
    reduce4(acc[0], acc[1], acc[2], acc[3], y);
    reduce4(acc[4], acc[5], acc[6], acc[7], y + 4);
  } else if constexpr (NB == 4) {
    reduce4(acc[0], acc[1], acc[2], acc[3], y);
  } else {
    for (int j = 0; j < NB; ++j) y[j] = hsum(acc[j]);
  }
}

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
      biases_to_float<ST>(a, first, cg, sc[j], bc[j]);
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
  store_sums<NB>(acc, a.y + r * a.n + n);
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
      c[j] = vf{} + bias_at<ST>(a, sidx + j * a.groups);
    }
    const int64_t k0 = g * gs;
    const int64_t byte0 = k0 * BITS / 8;
    {  // the next tile's rows, spread over this tile's groups (as tile_dot prefetches)
      const int64_t ahead = static_cast<int64_t>(NB) * gs * BITS / 8;
      const uint8_t* next = wr[0] + NB * row_bytes + g * ahead;
      for (int64_t l = 0; l < ahead; l += 64) __builtin_prefetch(next + l, 0, 3);
    }
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

// Q6_K (bits == 6, qmm.h): row r, columns n .. n + NB. Per block of 256 weights and per
// half of it, byte l of ql holds the low nibbles of weights l (& 15) and l + 64 (>> 4), byte
// l + 32 those of l + 32 and l + 96, and byte l of qh their four high bit pairs (llama.cpp's
// order). So LANES consecutive bytes of ql, ql + 32 and qh give four vectors of codes, each
// LANES consecutive weights inside one 16-weight sub-block, met by plain loads of x in its
// natural order. Per vector: acc += (q * x) * (d * scale); the -32 offset enters once per
// sub-block as -32 * d * scale * sum(x over it), lane-wise in the same accumulator.
template <int NB>
void tile_dot_q6(const QmmArgs& a, int64_t r, int64_t n) {
  const int64_t row_bytes = a.k / 256 * 192;
  const int64_t blocks = a.k / 256;
  const uint8_t* wr[NB];
  const int8_t* sr[NB];
  const uint16_t* dr[NB];
  for (int j = 0; j < NB; ++j) {
    wr[j] = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * row_bytes;
    sr[j] = static_cast<const int8_t*>(a.scales) + (n + j) * a.groups;
    dr[j] = static_cast<const uint16_t*>(a.biases) + (n + j) * blocks;
  }
  const float* x = a.xp + r * a.k;
  const float* xs = a.xs + r * a.groups;
  vf acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = vf{};
  alignas(64) float sc[NB][16];
  const vi m4 = vi{} + 15, m_hi = vi{} + 0x30;
  for (int64_t b = 0; b < blocks; ++b) {
    {  // the next tile's codes, one block ahead (as tile_dot)
      const uint8_t* next = wr[0] + NB * row_bytes + b * NB * 192;
      for (int l = 0; l < NB * 192; l += 64) __builtin_prefetch(next + l, 0, 3);
    }
    for (int j = 0; j < NB; ++j) {
      const vf d = vf{} + f16_to_f32(dr[j][b]);
      for (int i = 0; i < 16; i += LANES) {
        const vf s = to_f(load_sbytes(sr[j] + b * 16 + i)) * d;
        storef(sc[j] + i, s);
        acc[j] -= s * (loadf(xs + b * 16 + i) * 32.0f);
      }
    }
    const float* xb = x + b * 256;
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int l = 0; l < 32; l += LANES) {
        const float* xh = xb + h * 128 + l;
        const vf x0 = loadf(xh), x1 = loadf(xh + 32), x2 = loadf(xh + 64), x3 = loadf(xh + 96);
        const int s0 = h * 8 + l / 16;  // sub-block of x0; x1, x2, x3: + 2, 4, 6
        for (int j = 0; j < NB; ++j) {
          const uint8_t* ql = wr[j] + b * 192 + h * 64 + l;
          const vi lo0 = load_bytes(ql), lo1 = load_bytes(ql + 32);
          const vi hi = load_bytes(wr[j] + b * 192 + 128 + h * 32 + l);
          const vi q0 = (lo0 & m4) | ((hi << 4) & m_hi);
          const vi q1 = (lo1 & m4) | ((hi << 2) & m_hi);
          const vi q2 = (lo0 >> 4) | (hi & m_hi);
          const vi q3 = (lo1 >> 4) | ((hi >> 2) & m_hi);
          acc[j] += (to_f(q0) * x0) * splat(&sc[j][s0]);
          acc[j] += (to_f(q1) * x1) * splat(&sc[j][s0 + 2]);
          acc[j] += (to_f(q2) * x2) * splat(&sc[j][s0 + 4]);
          acc[j] += (to_f(q3) * x3) * splat(&sc[j][s0 + 6]);
        }
      }
    }
  }
  store_sums<NB>(acc, a.y + r * a.n + n);
}

// Q6_K, rows r .. r + RB, columns n .. n + NB (batched decode, verify): each code vector
// is dequantized once in registers ((q - 32) * d * scale, one FMA) and used by every row,
// as tile_deq does for the affine formats.
template <int RB, int NB>
void tile_deq_q6(const QmmArgs& a, int64_t r, int64_t n) {
  const int64_t row_bytes = a.k / 256 * 192;
  const int64_t blocks = a.k / 256;
  const uint8_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * row_bytes;
  const float* x[RB];
  for (int i = 0; i < RB; ++i) x[i] = a.xp + (r + i) * a.k;
  vf acc[RB][NB];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vf{};
  alignas(64) float sc[NB][16];
  alignas(64) float bc[NB][16];
  const vi m4 = vi{} + 15, m_hi = vi{} + 0x30;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int j = 0; j < NB; ++j) {
      const int8_t* scl = static_cast<const int8_t*>(a.scales) + (n + j) * a.groups + b * 16;
      const vf d = vf{} + f16_to_f32(static_cast<const uint16_t*>(a.biases)[(n + j) * blocks + b]);
      for (int i = 0; i < 16; i += LANES) {
        const vf s = to_f(load_sbytes(scl + i)) * d;
        storef(sc[j] + i, s);
        storef(bc[j] + i, s * -32.0f);
      }
    }
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 32; l += LANES) {
        const int64_t k0 = b * 256 + h * 128 + l;
        const int s0 = h * 8 + l / 16;
        for (int j = 0; j < NB; ++j) {
          const uint8_t* ql = wr[j] + b * 192 + h * 64 + l;
          const vi lo0 = load_bytes(ql), lo1 = load_bytes(ql + 32);
          const vi hi = load_bytes(wr[j] + b * 192 + 128 + h * 32 + l);
          const vf w0 = to_f((lo0 & m4) | ((hi << 4) & m_hi)) * splat(&sc[j][s0]) + splat(&bc[j][s0]);
          const vf w1 = to_f((lo1 & m4) | ((hi << 2) & m_hi)) * splat(&sc[j][s0 + 2]) + splat(&bc[j][s0 + 2]);
          const vf w2 = to_f((lo0 >> 4) | (hi & m_hi)) * splat(&sc[j][s0 + 4]) + splat(&bc[j][s0 + 4]);
          const vf w3 = to_f((lo1 >> 4) | ((hi >> 2) & m_hi)) * splat(&sc[j][s0 + 6]) + splat(&bc[j][s0 + 6]);
          for (int i = 0; i < RB; ++i) {
            acc[i][j] += w0 * loadf(x[i] + k0);
            acc[i][j] += w1 * loadf(x[i] + k0 + 32);
            acc[i][j] += w2 * loadf(x[i] + k0 + 64);
            acc[i][j] += w3 * loadf(x[i] + k0 + 96);
          }
        }
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    float* y = a.y + (r + i) * a.n + n;
    for (int j = 0; j < NB; ++j) y[j] = hsum(acc[i][j]);
  }
}

// The tiles of a format: Q6_K's own (bits 6), else the affine ones. Every loop over rows
// and columns below serves both.
template <int NB, int BITS, int ST, int GS>
inline void dot_tile(const QmmArgs& a, int64_t r, int64_t n) {
  if constexpr (BITS == 6) {
    tile_dot_q6<NB>(a, r, n);
  } else {
    tile_dot<NB, BITS, ST, GS>(a, r, n);
  }
}

template <int RB, int NB, int BITS, int ST>
inline void deq_tile(const QmmArgs& a, int64_t r, int64_t n) {
  if constexpr (BITS == 6) {
    tile_deq_q6<RB, NB>(a, r, n);
  } else {
    tile_deq<RB, NB, BITS, ST>(a, r, n);
  }
}

template <int RB, int BITS, int ST>
void rows_deq(const QmmArgs& a, int64_t r, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (RB <= 2) {
    for (; n + 4 <= n1; n += 4) deq_tile<RB, 4, BITS, ST>(a, r, n);
  }
  for (; n + 2 <= n1; n += 2) deq_tile<RB, 2, BITS, ST>(a, r, n);
  for (; n < n1; ++n) deq_tile<RB, 1, BITS, ST>(a, r, n);
}

template <int BITS, int ST>
void rows_deq_n(int rb, const QmmArgs& a, int64_t r, int64_t n0, int64_t n1) {
  switch (rb) {
    case 1: rows_deq<1, BITS, ST>(a, r, n0, n1); break;
    case 2: rows_deq<2, BITS, ST>(a, r, n0, n1); break;
    case 3: rows_deq<3, BITS, ST>(a, r, n0, n1); break;
    case 4: rows_deq<4, BITS, ST>(a, r, n0, n1); break;
    default:
      if constexpr (kMaxRowBlock >= 8) {
        switch (rb) {
          case 5: rows_deq<5, BITS, ST>(a, r, n0, n1); break;
          case 6: rows_deq<6, BITS, ST>(a, r, n0, n1); break;
          case 7: rows_deq<7, BITS, ST>(a, r, n0, n1); break;
          default: rows_deq<8, BITS, ST>(a, r, n0, n1); break;
        }
      }
      break;
  }
}

template <int BITS, int ST, int GS>
void run_dot(const QmmArgs& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) dot_tile<8, BITS, ST, GS>(a, 0, n);
  for (; n + 4 <= n1; n += 4) dot_tile<4, BITS, ST, GS>(a, 0, n);
  for (; n < n1; ++n) dot_tile<1, BITS, ST, GS>(a, 0, n);
}

template <int BITS, int ST>
void run(const QmmArgs& a, int64_t n0, int64_t n1) {
  if (a.rows == 1) {
    if constexpr (BITS == 6) {
      run_dot<BITS, ST, 16>(a, n0, n1);  // Q6_K: 16-weight sub-blocks, read by its own tile
    } else {
      switch (a.group_size) {
        case 32: run_dot<BITS, ST, 32>(a, n0, n1); break;
        case 64: run_dot<BITS, ST, 64>(a, n0, n1); break;
        default: run_dot<BITS, ST, 128>(a, n0, n1); break;
      }
    }
    return;
  }
  const int64_t chunk = a.row_chunk > 0 ? a.row_chunk : a.rows;
  constexpr int64_t kColBlock = 64;  // columns per pass over one row chunk
  for (int64_t r0 = 0; r0 < a.rows; r0 += chunk) {
    const int64_t r1 = r0 + chunk < a.rows ? r0 + chunk : a.rows;
    for (int64_t c0 = n0; c0 < n1; c0 += kColBlock) {
      const int64_t c1 = c0 + kColBlock < n1 ? c0 + kColBlock : n1;
      // As few passes over the weights as the registers allow, the rows spread evenly
      // over them: 5 rows are one pass of 5, not 4 then 1 (each pass re-reads and
      // re-dequantizes the tile's weights).
      for (int64_t r = r0; r < r1;) {
        const int64_t left = r1 - r;
        const int64_t passes = (left + kMaxRowBlock - 1) / kMaxRowBlock;
        const int rb = static_cast<int>((left + passes - 1) / passes);
        rows_deq_n<BITS, ST>(rb, a, r, c0, c1);
        r += rb;
      }
    }
  }
}

template <int BITS>
void run_bits(const QmmArgs& a, int64_t n0, int64_t n1) {
  switch (a.scale_type) {
    case QMM_F32: run<BITS, QMM_F32>(a, n0, n1); break;
    case QMM_F16: run<BITS, QMM_F16>(a, n0, n1); break;
    case QMM_K8: run<BITS, QMM_K8>(a, n0, n1); break;
    default: run<BITS, QMM_BF16>(a, n0, n1); break;
  }
}

}  // namespace

extern "C" void QMM_RUN(const QmmArgs* args, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  if (args->bits == 6) {
    run<6, QMM_F16>(*args, n0, n1);  // Q6_K: its scale types are its own (qmm.h)
  } else if (args->bits == 4) {
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
