// Quantized matmul body for many rows (prefill): a packed-panel GEMM, compiled once per
// ISA like qmm_kernel.cpp (same helpers, qmm_simd.h); qmm_op.cpp calls it from 24 rows on.
#include "qmm_simd.h"

namespace {

// C [rows, n] = A [rows, K] . B [K, n] with B = dequant(W).T, cut the usual way:
//   A packed once per op (QMM_GEMM_PACK): [row block][k][GEMM_MR], natural k order.
//   per thread, per K chunk (kKC, whole groups) and per panel of kNR columns: W's bytes of
//   those columns are spread to a [kc][kNR] byte tile, then dequantized with vectors along
//   N (every column of a panel meets group k / gs at the same k, so one vector of the
//   panel's scales and one of its biases serve a whole group) into Bp [kc][kNR] floats,
//   L1-resident (256 x 32 x 4 = 32 KB on AVX-512); every row block then reads it.
//   micro-kernel: GEMM_MR rows x kNR columns of accumulators in registers (AVX-512: 12 x 2
//   zmm = 24 of 32 registers; AVX2/SSE: 6 x 2 = 12 of 16); per k, kNR / LANES vector
//   loads of Bp, GEMM_MR broadcasts of A, 2 * GEMM_MR FMAs.
// The dequantization (a few operations per weight) is paid once per K chunk and panel and
// shared by all rows, so at 512 rows it is ~1/100 of the FMAs.
constexpr int kNR = 2 * LANES;
constexpr int kKC = 256;  // a multiple of every group size (32/64/128)
constexpr int kMaxGroupsPerChunk = kKC / 16;  // Q6_K: 16-weight groups

template <int BITS, int ST>
void gemm_pack_b(const QmmArgs& a, int64_t j0, int nc, int64_t kc0, int kc, uint8_t* qt, float* bp) {
  const int64_t row_bytes = a.k * BITS / 8;
  const int gs = a.group_size;
  const int ng = kc / gs;
  const int64_t g0 = kc0 / gs;
  alignas(64) float st[kMaxGroupsPerChunk][kNR];
  alignas(64) float bt[kMaxGroupsPerChunk][kNR];
  for (int j = 0; j < kNR; ++j) {
    if (j >= nc) {  // past the last column: zeros, never stored
      for (int t = 0; t < kc; ++t) qt[t * kNR + j] = 0;
      for (int g = 0; g < ng; ++g) st[g][j] = bt[g][j] = 0.0f;
      continue;
    }
    if constexpr (BITS == 6) {  // Q6_K: kc0 and kc are whole blocks (k % 256 == 0, kKC == 256)
      const uint8_t* blk = reinterpret_cast<const uint8_t*>(a.w) + (j0 + j) * (a.k / 256 * 192) + kc0 / 256 * 192;
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t b0 = blk[h * 64 + l], b1 = blk[h * 64 + 32 + l], hb = blk[128 + h * 32 + l];
          const int t = h * 128 + l;
          qt[t * kNR + j] = (b0 & 15) | ((hb << 4) & 0x30);
          qt[(t + 32) * kNR + j] = (b1 & 15) | ((hb << 2) & 0x30);
          qt[(t + 64) * kNR + j] = (b0 >> 4) | (hb & 0x30);
          qt[(t + 96) * kNR + j] = (b1 >> 4) | ((hb >> 2) & 0x30);
        }
      }
      const float d = f16_to_f32(static_cast<const uint16_t*>(a.biases)[(j0 + j) * (a.k / 256) + kc0 / 256]);
      const int8_t* scl = static_cast<const int8_t*>(a.scales) + (j0 + j) * a.groups + g0;
      for (int g = 0; g < ng; ++g) {
        st[g][j] = d * static_cast<float>(scl[g]);
        bt[g][j] = -32.0f * st[g][j];
      }
      continue;
    }
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + (j0 + j) * row_bytes + kc0 * BITS / 8;
    if constexpr (BITS == 4) {
      for (int t = 0; t < kc / 2; ++t) {
        const uint8_t b = src[t];
        qt[(2 * t) * kNR + j] = b & 15;
        qt[(2 * t + 1) * kNR + j] = b >> 4;
      }
    } else {
      for (int t = 0; t < kc; ++t) qt[t * kNR + j] = src[t];
    }
    const int64_t sidx = (j0 + j) * a.groups + g0;
    for (int g = 0; g < ng; ++g) {
      st[g][j] = scalar_at<ST>(a.scales, sidx + g);
      bt[g][j] = bias_at<ST>(a, sidx + g);
    }
  }
  for (int g = 0; g < ng; ++g) {
    const vf s0 = loadf(st[g]), s1 = loadf(st[g] + LANES);
    const vf c0 = loadf(bt[g]), c1 = loadf(bt[g] + LANES);
    for (int t = g * gs; t < (g + 1) * gs; ++t) {
      storef(bp + t * kNR, to_f(load_bytes(qt + t * kNR)) * s0 + c0);
      storef(bp + t * kNR + LANES, to_f(load_bytes(qt + t * kNR + LANES)) * s1 + c1);
    }
  }
}

// C rows [0, m) x columns [0, nc) of one tile (row stride ldc) = (or +=) Ap . Bp over kc.
inline void gemm_micro(const float* ap, const float* bp, int kc, float* c, int64_t ldc, int m, int nc,
                       bool accumulate) {
  vf c0[GEMM_MR], c1[GEMM_MR];
  for (int i = 0; i < GEMM_MR; ++i) c0[i] = c1[i] = vf{};
  for (int t = 0; t < kc; ++t) {
    const vf b0 = loadf(bp);
    const vf b1 = loadf(bp + LANES);
    for (int i = 0; i < GEMM_MR; ++i) {
      const vf av = splat(ap + i);
      c0[i] += av * b0;
      c1[i] += av * b1;
    }
    ap += GEMM_MR;
    bp += kNR;
  }
  for (int i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (nc == kNR) {
      if (accumulate) {
        c0[i] += loadf(ci);
        c1[i] += loadf(ci + LANES);
      }
      storef(ci, c0[i]);
      storef(ci + LANES, c1[i]);
    } else {
      alignas(64) float tmp[kNR];
      storef(tmp, c0[i]);
      storef(tmp + LANES, c1[i]);
      for (int j = 0; j < nc; ++j) ci[j] = accumulate ? ci[j] + tmp[j] : tmp[j];
    }
  }
}

template <int BITS, int ST>
void gemm(const QmmArgs& a, int64_t n0, int64_t n1) {
  alignas(64) uint8_t qt[kKC * kNR];
  alignas(64) float bp[kKC * kNR];
  const int64_t blocks = (a.rows + GEMM_MR - 1) / GEMM_MR;
  for (int64_t kc0 = 0; kc0 < a.k; kc0 += kKC) {
    const int kc = static_cast<int>(a.k - kc0 < kKC ? a.k - kc0 : kKC);
    for (int64_t j0 = n0; j0 < n1; j0 += kNR) {
      const int nc = static_cast<int>(n1 - j0 < kNR ? n1 - j0 : kNR);
      gemm_pack_b<BITS, ST>(a, j0, nc, kc0, kc, qt, bp);
      for (int64_t rb = 0; rb < blocks; ++rb) {
        const int64_t r = rb * GEMM_MR;
        const int m = static_cast<int>(a.rows - r < GEMM_MR ? a.rows - r : GEMM_MR);
        gemm_micro(a.xp + (rb * a.k + kc0) * GEMM_MR, bp, kc, a.y + r * a.n + j0, a.n, m, nc, kc0 > 0);
      }
    }
  }
}

template <int BITS>
void gemm_bits(const QmmArgs& a, int64_t n0, int64_t n1) {
  switch (a.scale_type) {
    case QMM_F32: gemm<BITS, QMM_F32>(a, n0, n1); break;
    case QMM_F16: gemm<BITS, QMM_F16>(a, n0, n1); break;
    case QMM_K8: gemm<BITS, QMM_K8>(a, n0, n1); break;
    default: gemm<BITS, QMM_BF16>(a, n0, n1); break;
  }
}

}  // namespace

extern "C" void QMM_GEMM(const QmmArgs* args, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  if (args->bits == 6) {
    gemm<6, QMM_F16>(*args, n0, n1);  // Q6_K: the scale type is its own (qmm.h)
  } else if (args->bits == 4) {
    gemm_bits<4>(*args, n0, n1);
  } else {
    gemm_bits<8>(*args, n0, n1);
  }
}

extern "C" void QMM_GEMM_TILE(int* mr, int* nr) {
  *mr = GEMM_MR;
  *nr = kNR;
}

extern "C" void QMM_GEMM_PACK(const float* x, int64_t sr, int64_t sk, int64_t rows, int64_t k, float* ap) {
  const int64_t blocks = (rows + GEMM_MR - 1) / GEMM_MR;
  for (int64_t rb = 0; rb < blocks; ++rb) {
    float* out = ap + rb * k * GEMM_MR;
    for (int i = 0; i < GEMM_MR; ++i) {
      const int64_t r = rb * GEMM_MR + i;
      if (r >= rows) {
        for (int64_t t = 0; t < k; ++t) out[t * GEMM_MR + i] = 0.0f;
        continue;
      }
      const float* xr = x + r * sr;
      for (int64_t t = 0; t < k; ++t) out[t * GEMM_MR + i] = xr[t * sk];
    }
  }
}
