// Products with x rounded to 8 bits: y[n] = x . dequant(W[n]) from integer dot products of
// the weight codes with x's int8 codes, the scheme llama.cpp's CPU backend uses (its Q8
// activations). The float paths (qmm_kernel.cpp's tile_dot, qmm_gemm.cpp) convert every code
// to float and spend one FMA per value; here 32 codes meet 32 x codes in one `vpdpbusd`
// (AVX-512 VNNI, ymm) or `vpmaddubsw` + `vpmaddwd` (AVX2), and the float work is per block
// of 32 values. Decode rows (each row of x on its own, below the GEMM's rows) take the dot
// tiles; from the GEMM's rows on (prefill) the GEMM at the end of this file.
//
// Formats: Q6_K (qmm.h), whose float tile is bound by unpacking its 6-bit codes, 4-bit
// affine with groups of 32, 64 or 128 (K a multiple of 64) and 8-bit affine.
// qmm_op.cpp's `x8_serves` says which products come here.
//
// x (qmm_prep8_*): per block of 32 values, d = max|x| / 127 and q = round(x / d) (int8,
// ties to even); for 4-bit weights every 64 values are stored evens first, then odds (the
// weights' byte i holds values 2i and 2i+1, so a 32-byte load gives the evens in its low
// nibbles and the odds in its high ones); Q6_K keeps the natural order.
//
// Centred codes: the rounding of x multiplies what the codes stand for, so the products
// are formed as if the codes were centred (4-bit: q - 8; Q6_K is q - 32 by definition).
// The weights then meet the rounding of x with their own size, not with their offset from
// the group's minimum (for Gaussian rows ~2x less error). Affine: y = sum_g s_g * sum
// (q - 8) * xhat + (b_g + 8 * s_g) * sum_g x, computed as the plain integer sums q * xq
// plus, per group, b_g * xs_g + 8 * s_g * xr_g with xs the exact sum of x and xr = xs -
// sum(xhat) (both written by the prep). Q6_K: xs holds sum(xhat) per 16-value sub-block
// and the offset is -32 * d * scale * xs. `segserve.kernels.qmm_cpu.x8_product` computes the
// same with MLX ops (the differential tests' and the start-up self-check's reference).
//
// Compiled once per ISA (CMakeLists.txt): QMM_ISA_VNNI (AVX-512 VNNI on ymm: one block of
// 32 codes is one ymm, and Zen 4 runs 512-bit ops as two halves anyway), QMM_ISA_AVX2, and
// the portable baseline (plain loops, the same integer sums).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "qmm.h"
#include "qmm_simd.h"  // f16_to_f32, scalar_at, to_float, affine_centre (the VNNI build is also QMM_ISA_AVX2)

#if defined(QMM_ISA_VNNI) || defined(QMM_ISA_AVX2)
#define QMM8_SIMD 1
#endif

#if defined(QMM_ISA_VNNI)
#define QMM_DOT8 qmm_dot8_vnni
#define QMM_PREP8 qmm_prep8_vnni
#define QMM_GEMM8 qmm_gemm8_vnni
#elif defined(QMM_ISA_AVX2)
#define QMM_DOT8 qmm_dot8_avx2
#define QMM_PREP8 qmm_prep8_avx2
#define QMM_GEMM8 qmm_gemm8_avx2
#else
#define QMM_DOT8 qmm_dot8_generic
#define QMM_PREP8 qmm_prep8_generic
#define QMM_GEMM8 qmm_gemm8_generic
#endif

namespace {

constexpr int kGroupChunk = 64;  // groups whose scales are converted at once
constexpr int64_t kMaxRows8 = QMM_X8_MAX_ROWS;  // rows one call carries at most

#if defined(QMM8_SIMD)

// acc + the sums of four adjacent products u8 * s8 per int32 lane.
inline __m256i dp(__m256i acc, __m256i u, __m256i s) {
#if defined(QMM_ISA_VNNI)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  // u <= 63 here (4-bit, Q6_K codes): two products stay below 2 * 63 * 127, no saturation.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if !defined(QMM_ISA_VNNI)
// acc + sums of four products w * x with w signed (centred 8-bit codes): |w| meets x with
// w's sign (see kSigned8).
inline __m256i dp_signed(__m256i acc, __m256i w, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane indices for _mm256_permutevar8x32_ps, from memory (a vector built from a loop
// counter would cost several inserts per use): kPair[c] = [2c x4, 2c+1 x4] gives a code
// vector covering blocks 2c and 2c+1 its scales, kLane[c] = [c x8] one block's.
alignas(32) constexpr int32_t kPair[4][8] = {
    {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};
alignas(32) constexpr int32_t kLane[8][8] = {
    {0, 0, 0, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2}, {3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4}, {5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6}, {7, 7, 7, 7, 7, 7, 7, 7}};

inline __m256i index_of(const int32_t (&row)[8]) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(row));
}

// Byte shuffles of int16 scales (one 128-bit lane holds eight): kSubPair[t] puts scale 2t in
// every int16 of the low lane and scale 2t + 1 in every one of the high lane (both lanes
// hold the same eight scales), the sub-blocks of a Q6_K code vector's two halves.
alignas(32) constexpr int8_t kSubPair[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};

inline __m256i index_of8(const int8_t (&row)[32]) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(row));
}

// acc + the sums of adjacent int16 products (two per int32 lane).
inline __m256i dp16(__m256i acc, __m256i a, __m256i b) {
#if defined(QMM_ISA_VNNI)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// Lanes [2c x4, 2c+1 x4] of v: the scales of a code vector covering two blocks.
inline __m256 pair(__m256 v, int c) {
  return _mm256_permutevar8x32_ps(v, index_of(kPair[c]));
}

// Decode reads DRAM as fast as the lines arrive: the tile after this one (its NB rows are
// contiguous and follow this tile's) is prefetched as this tile walks its rows, NB * 32
// bytes per 32 bytes read from each row, so its lines are in flight one tile ahead and the
// prefetches are spread over the loop (a burst of them per span of 8 blocks measured
// slower on rows from DRAM). A prefetch past the matrix never faults.
template <int NB>
inline void prefetch_next(const uint8_t* p) {
  for (int l = 0; l < NB * 32; l += 64) __builtin_prefetch(p + l, 0, 3);
}

// Affine 4-bit and 8-bit, rows rows[0 .. RB) of a call, columns n .. n + NB. Per span of 8
// blocks: the per-block factors scale[group(block)] * d[block] as one vector per column (a lane permute spreads a group's
// scale over its blocks); then 4-bit: per 32 code bytes (64 values, two blocks) two integer
// dot products, one conversion and one FMA; 8-bit: per 32 codes (one block, natural order)
// one dot product, one conversion and one FMA. Per group the terms of the codes' centre
// (8 or 128) as the header says. 8-bit on AVX2: `vpmaddubsw` would saturate on 255 * 127 *
// 2, so the codes are centred on the fly (q ^ 0x80 = q - 128, signed) and multiplied by
// sign (dp_signed): the centre then meets the exact sums of x (xs), not the residuals (xr).
// What does not depend on x is done once for the RB rows: the weight loads and the nibble
// unpacking, the scales' conversion, the prefetches (one row per call re-did all of it per
// row, and batched decode of the 28-layer 0.4B Q4_K_M shape cost ~3.7 single-row steps at 4
// sessions). Each row's float arithmetic is op for op and in the same order whatever RB, so
// a row's sums are bitwise the same alone (RB = 1, `tile_affine`) or among others.
template <int RB, int NB, int GS, int ST, int BITS>
void tile_affine_rows(const QmmArgs* rows, int64_t n) {
  const QmmArgs& a = rows[0];  // weights, scales and shapes: the same for every row
  const int64_t row_bytes = a.k * BITS / 8;
  const uint8_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * row_bytes;
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  alignas(32) float sc[NB][kGroupChunk + 8];
  alignas(32) float bc[NB][kGroupChunk + 8];
  alignas(32) float xsp[RB][kGroupChunk + 8];
  alignas(32) float xcp[RB][kGroupChunk + 8];
  constexpr float kCentre = affine_centre(BITS);
#if defined(QMM_ISA_VNNI)
  constexpr bool kCentredCodes = false;
#else
  constexpr bool kCentredCodes = BITS == 8;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  constexpr int kPerGroup = GS / 32;
  const __m256i spread = kPerGroup == 1   ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                         : kPerGroup == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                          : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t g0 = 0; g0 < a.groups; g0 += kGroupChunk) {
    const int cg = static_cast<int>(a.groups - g0 < kGroupChunk ? a.groups - g0 : kGroupChunk);
    const int padded = (cg + 7) / 8 * 8;
    for (int j = 0; j < NB; ++j) {
      const int64_t first = (n + j) * a.groups + g0;
      to_float<ST>(a.scales, first, cg, sc[j]);
      biases_to_float<ST>(a, first, cg, sc[j], bc[j]);
      for (int i = cg; i < padded + 8; ++i) sc[j][i] = bc[j][i] = 0.0f;
    }
    for (int r = 0; r < RB; ++r) {
      const float* centred = kCentredCodes ? rows[r].xs : rows[r].xr;
      for (int i = 0; i < cg; ++i) {
        xsp[r][i] = rows[r].xs[g0 + i];
        xcp[r][i] = centred[g0 + i] * kCentre;
      }
      for (int i = cg; i < padded + 8; ++i) xsp[r][i] = xcp[r][i] = 0.0f;
      for (int j = 0; j < NB; ++j) {
        for (int i = 0; i < padded; i += 8) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(bc[j] + i), _mm256_load_ps(xsp[r] + i), acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(sc[j] + i), _mm256_load_ps(xcp[r] + i), acc[r][j]);
        }
      }
    }
    const int64_t b_end = (g0 + cg) * kPerGroup;
    for (int64_t b0 = g0 * kPerGroup; b0 < b_end; b0 += 8) {
      const int nb = static_cast<int>(b_end - b0 < 8 ? b_end - b0 : 8);
      const int gi = static_cast<int>(b0 / kPerGroup - g0);
      __m256 sd[RB][NB];
      for (int r = 0; r < RB; ++r) {
        const __m256 dxv = _mm256_loadu_ps(rows[r].xd + b0);
        for (int j = 0; j < NB; ++j) {
          sd[r][j] = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(sc[j] + gi), spread), dxv);
        }
      }
      if constexpr (BITS == 4) {
        for (int c = 0; c < nb / 2; ++c) {
          const int64_t byte0 = (b0 + 2 * c) * 16;
          prefetch_next<NB>(wr[0] + NB * row_bytes + byte0 * NB);
          __m256i lo[NB], hi[NB];
          for (int j = 0; j < NB; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + byte0));
            lo[j] = _mm256_and_si256(v, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          }
          for (int r = 0; r < RB; ++r) {
            const int8_t* xc = rows[r].xq + (b0 + 2 * c) * 32;
            const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
            const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32));
            for (int j = 0; j < NB; ++j) {
              const __m256i p = dp(dp(_mm256_setzero_si256(), lo[j], xe), hi[j], xo);
              acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), pair(sd[r][j], c), acc[r][j]);
            }
          }
        }
      } else {
        for (int c = 0; c < nb; ++c) {
          const int64_t byte0 = (b0 + c) * 32;
          prefetch_next<NB>(wr[0] + NB * row_bytes + byte0 * NB);
          __m256i v[NB];
          for (int j = 0; j < NB; ++j) {
            v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + byte0));
#if !defined(QMM_ISA_VNNI)
            v[j] = _mm256_xor_si256(v[j], flip);
#endif
          }
          for (int r = 0; r < RB; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r].xq + byte0));
            for (int j = 0; j < NB; ++j) {
#if defined(QMM_ISA_VNNI)
              const __m256i p = dp(_mm256_setzero_si256(), v[j], xv);
#else
              const __m256i p = dp_signed(_mm256_setzero_si256(), v[j], xv);
#endif
              acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                          _mm256_permutevar8x32_ps(sd[r][j], index_of(kLane[c])), acc[r][j]);
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) rows[r].y[n + j] = hsum8(acc[r][j]);
}

template <int NB, int GS, int ST, int BITS>
void tile_affine(const QmmArgs& a, int64_t n) {
  tile_affine_rows<1, NB, GS, ST, BITS>(&a, n);
}

// Q6_K (qmm.h), rows rows[0 .. RB) of a call, columns n .. n + NB, x rounded per block of
// 256 (the prep's Q6_K decode layout: one d per block, the codes' sums per 16-value
// sub-block as int16), as llama.cpp's Q6_K x Q8_K dot: every product of a block stays in
// integers and is converted once. Per half h of a block, the 32 bytes at ql + 64h,
// ql + 64h + 32 and qh + 32h give four code vectors of 32 consecutive values (t = 0..3:
// values 128h + 32t ..), each two 16-value sub-blocks: `vpmaddubsw` pairs codes with x
// (q <= 63, |x| <= 127: no saturation), then `vpmaddwd` (`vpdpwssd` on VNNI) weighs the
// pairs with the sub-blocks' int16 scales ([scale a x8 | scale b x8], a byte shuffle of
// the block's scales) into the block's int32 sums. The -32 offset: -32 * sum over
// sub-blocks of scale * (sum of x codes), one `vpmaddwd`. Then per block one conversion
// and one FMA with d * dx. Per 32 values ~4 unpacking ops and 3 integer ops, where x per
// 32 values needed a conversion, a scale permute, a multiply and an FMA per 32 on top.
// Bounds: per lane and block 8 products of <= 2 * 63 * 127 * 128 (~33M < 2^31).
// The unpacking, the scale shuffles and the prefetches are done once for the RB rows;
// each row's arithmetic is exact integers then one FMA per block in block order (bitwise
// the same alone, RB = 1 `tile_q6`, or among others).
template <int RB, int NB>
void tile_q6_rows(const QmmArgs* rows, int64_t n) {
  const QmmArgs& a = rows[0];
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
  // Independent integer sums per (row, column): a block's eight `vpdpwssd` into one register
  // are a chain of dependent ops (~5 cycles each) that bounded a single row's tile; split
  // over the code vectors where the registers allow (integer sums: the order is exact).
  constexpr int kChains = RB == 1 ? 4 : RB == 2 ? 2 : 1;
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), m_hi = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < blocks; ++b) {
    {
      const uint8_t* next = wr[0] + NB * row_bytes + b * NB * 192;
      for (int l = 0; l < NB * 192; l += 64) __builtin_prefetch(next + l, 0, 3);
    }
    __m256i s16[NB], half_sc[NB][2];
    float dj[NB];
    for (int j = 0; j < NB; ++j) {
      dj[j] = f16_to_f32(dr[j][b]);
      s16[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr[j] + b * 16)));
      half_sc[j][0] = _mm256_permute4x64_epi64(s16[j], 0x44);  // scales 0..7 in both lanes
      half_sc[j][1] = _mm256_permute4x64_epi64(s16[j], 0xee);  // 8..15
    }
    __m256i isum[RB][NB][kChains];
    for (int r = 0; r < RB; ++r) {
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r].xs + b * 8));
      for (int j = 0; j < NB; ++j) {
        isum[r][j][0] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(s16[j], bs), 5));
        for (int c = 1; c < kChains; ++c) isum[r][j][c] = _mm256_setzero_si256();
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i xv[RB][4];  // each row's codes for this half, read once
      for (int r = 0; r < RB; ++r) {
        const int8_t* xb = rows[r].xq + b * 256 + h * 128;
        for (int t = 0; t < 4; ++t) xv[r][t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + t * 32));
      }
      for (int j = 0; j < NB; ++j) {
        const uint8_t* ql = wr[j] + b * 192 + h * 64;
        const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + b * 192 + 128 + h * 32));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(lo0, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), m_hi)),
            _mm256_or_si256(_mm256_and_si256(lo1, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), m_hi)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4), _mm256_and_si256(hi, m_hi)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hi, 2), m_hi))};
        for (int t = 0; t < 4; ++t) {
          const __m256i st = _mm256_shuffle_epi8(half_sc[j][h], index_of8(kSubPair[t]));
          for (int r = 0; r < RB; ++r) {
            __m256i& chain = isum[r][j][t % kChains];
            chain = dp16(chain, _mm256_maddubs_epi16(q[t], xv[r][t]), st);
          }
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const float dx = rows[r].xd[b];
      for (int j = 0; j < NB; ++j) {
        __m256i sum = isum[r][j][0];
        for (int c = 1; c < kChains; ++c) sum = _mm256_add_epi32(sum, isum[r][j][c]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dj[j] * dx), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) rows[r].y[n + j] = hsum8(acc[r][j]);
}

template <int NB>
void tile_q6(const QmmArgs& a, int64_t n) {
  tile_q6_rows<1, NB>(&a, n);
}

#else  // portable: the same integer sums per block in plain loops

template <int NB, int GS, int ST, int BITS>
void tile_affine(const QmmArgs& a, int64_t n) {
  constexpr float kCentre = affine_centre(BITS);
  for (int j = 0; j < NB; ++j) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * (a.k * BITS / 8);
    const int64_t row = (n + j) * a.groups;
    float acc = 0.0f;
    for (int64_t g = 0; g < a.groups; ++g) {
      acc += bias_at<ST>(a, row + g) * a.xs[g] + scalar_at<ST>(a.scales, row + g) * kCentre * a.xr[g];
    }
    for (int64_t blk = 0; blk < a.k / 32; ++blk) {
      int32_t sum = 0;
      if constexpr (BITS == 4) {
        // Block blk is half of the 64-value chunk blk / 2: its evens are xq[chunk][16 * half ..],
        // its odds xq[chunk][32 + 16 * half ..] (the layout in the header comment).
        const int64_t chunk = blk / 2, half = blk % 2;
        const int8_t* xe = a.xq + chunk * 64 + half * 16;
        const int8_t* xo = xe + 32;
        const uint8_t* wb = w + chunk * 32 + half * 16;
        for (int i = 0; i < 16; ++i) sum += (wb[i] & 15) * xe[i] + (wb[i] >> 4) * xo[i];
      } else {
        for (int i = 0; i < 32; ++i) sum += w[blk * 32 + i] * a.xq[blk * 32 + i];
      }
      acc += (float)sum * scalar_at<ST>(a.scales, row + blk * 32 / GS) * a.xd[blk];
    }
    a.y[n + j] = acc;
  }
}

// The int16 sums of x codes per 16-value sub-block that the prep keeps in a Q6_K decode
// row's xs (qmm.h), 16 per 256-value block.
inline int16_t code_sum(const float* xs, int64_t sub) {
  int16_t v;
  memcpy(&v, reinterpret_cast<const char*>(xs) + sub * sizeof(int16_t), sizeof(v));
  return v;
}

template <int NB>
void tile_q6(const QmmArgs& a, int64_t n) {
  const int64_t blocks = a.k / 256;
  for (int j = 0; j < NB; ++j) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + (n + j) * blocks * 192;
    const int8_t* sc = static_cast<const int8_t*>(a.scales) + (n + j) * a.groups;
    const uint16_t* dr = static_cast<const uint16_t*>(a.biases) + (n + j) * blocks;
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* ql = w + b * 192;
      const uint8_t* qh = ql + 128;
      int32_t sum = 0;
      for (int s = 0; s < 16; ++s) sum -= 32 * sc[b * 16 + s] * code_sum(a.xs, b * 16 + s);
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 4; ++t) {
          const int8_t* xq = a.xq + b * 256 + h * 128 + t * 32;
          for (int l = 0; l < 32; ++l) {
            const uint8_t lo = ql[h * 64 + (t & 1) * 32 + l];
            const int q = ((t < 2 ? lo & 15 : lo >> 4) | (((qh[h * 32 + l] >> (2 * t)) & 3) << 4));
            sum += q * xq[l] * sc[b * 16 + h * 8 + 2 * t + l / 16];
          }
        }
      }
      acc += static_cast<float>(sum) * (f16_to_f32(dr[b]) * a.xd[b]);
    }
    a.y[n + j] = acc;
  }
}

#endif

// Row r of a call (qmm.h: the prep's arrays are row after row), as one-row arguments.
QmmArgs row_of(const QmmArgs& a, int64_t r) {
  QmmArgs one = a;
  one.rows = 1;
  one.xq = a.xq + r * a.k;
  one.xd = a.xd + r * (a.k / 32 + 8);
  one.xs = a.xs + r * a.groups;
  if (a.xr != nullptr) one.xr = a.xr + r * a.groups;
  one.y = a.y + r * a.n;
  return one;
}

// Columns n .. n1 (whole tiles of NB) of every row: per tile of columns, each row in turn
// (the tile's weight rows are read from DRAM once, then from cache), so a row's sums never
// depend on the other rows of the call: batched decode gives each session what decoding it
// alone gives.
template <int NB, class Tile>
void tiles(const QmmArgs* rows, int64_t count, int64_t& n, int64_t n1, Tile tile) {
  for (; n + NB <= n1; n += NB) {
    for (int64_t r = 0; r < count; ++r) tile(rows[r], n);
  }
}

// Two columns per tile, for the reason Q6_K's take two (QMM_DOT8 below): decode rows of
// a 0.4B shape's 4-bit layers read from DRAM, 1024 x 2816 131-149 us with eight columns,
// 82-96 with two, 2816 x 1024 98-111 / 84-95 (a 49152 x 576 head 694-871 / 946-1,032: the
// layers are most of a step's bytes). The 8-bit tile likewise: 2816 x 1024 117-128 us with
// two columns against 160-170 with four, a 49152 x 576 head 1,134-1,147 / 1,336-1,361.
#if defined(QMM8_SIMD)
// Rows per multi-row tile: four where AVX-512VL gives 32 vector registers (the VNNI build:
// 8 accumulators, 8 scale vectors and the unpacked codes stay in registers), two on AVX2's 16.
#if defined(QMM_ISA_VNNI)
constexpr int kRowBlock = 4;
#else
constexpr int kRowBlock = 2;
#endif

// Every row of the call, kRowBlock rows per tile and the rest in one smaller tile:
// tile(RB, r) for rows r .. r + RB, RB a std::integral_constant.
template <typename Tile>
void row_blocks(int64_t count, Tile tile) {
  int64_t r = 0;
  for (; r + kRowBlock <= count; r += kRowBlock) tile(std::integral_constant<int, kRowBlock>{}, r);
  const int64_t left = count - r;
  if constexpr (kRowBlock > 3) {
    if (left == 3) return tile(std::integral_constant<int, 3>{}, r);
  }
  if constexpr (kRowBlock > 2) {
    if (left == 2) return tile(std::integral_constant<int, 2>{}, r);
  }
  if (left == 1) tile(std::integral_constant<int, 1>{}, r);
}

template <int NB, int GS, int ST, int BITS>
void all_rows(const QmmArgs* rows, int64_t count, int64_t n) {
  row_blocks(count, [&](auto rb, int64_t r) { tile_affine_rows<decltype(rb)::value, NB, GS, ST, BITS>(rows + r, n); });
}

template <int NB>
void q6_all_rows(const QmmArgs* rows, int64_t count, int64_t n) {
  row_blocks(count, [&](auto rb, int64_t r) { tile_q6_rows<decltype(rb)::value, NB>(rows + r, n); });
}
#endif

template <int GS, int ST, int BITS>
void run_affine(const QmmArgs* rows, int64_t count, int64_t& n, int64_t n1) {
#if defined(QMM8_SIMD)
  if (count > 1) {  // batched decode, verify windows: the rows share each tile's work
    for (; n + 2 <= n1; n += 2) all_rows<2, GS, ST, BITS>(rows, count, n);
    for (; n < n1; ++n) all_rows<1, GS, ST, BITS>(rows, count, n);
    return;
  }
#endif
  tiles<2>(rows, count, n, n1, [](const QmmArgs& x, int64_t c) { tile_affine<2, GS, ST, BITS>(x, c); });
  tiles<1>(rows, count, n, n1, [](const QmmArgs& x, int64_t c) { tile_affine<1, GS, ST, BITS>(x, c); });
}

template <int ST, int BITS>
void run_bits(const QmmArgs* rows, int64_t count, int64_t& n, int64_t n1) {
  switch (rows[0].group_size) {
    case 32: run_affine<32, ST, BITS>(rows, count, n, n1); break;
    case 64: run_affine<64, ST, BITS>(rows, count, n, n1); break;
    default: run_affine<128, ST, BITS>(rows, count, n, n1); break;
  }
}

template <int ST>
void run_groups(const QmmArgs* rows, int64_t count, int64_t& n, int64_t n1) {
  if (rows[0].bits == 8) {
    run_bits<ST, 8>(rows, count, n, n1);
  } else {
    run_bits<ST, 4>(rows, count, n, n1);
  }
}


// ---------------------------------------------------------------------------------------
// Many rows (prefill, from the GEMM's row count on): the same rounding of x and the same
// integer sums, cut as a GEMM so that each weight is unpacked once per call rather than
// once per row. Per panel of 8 columns (over all of K): the codes laid out as [K / 4][8][4]
// bytes, so one 32-byte vector holds 4 consecutive codes of each of the 8 columns and one
// `dp` against a broadcast of 4 x codes of one row adds 4 products per column; the panel's
// scales as one 8-column vector per group (affine: scale, bias, 8 * scale) or per 16-value
// sub-block (Q6_K: d * scale and -32 * d * scale). Every row block (kMR8 rows) then reads
// the panel from L1/L2: per 32 values and row, 8 `dp`s and, per block, one conversion and
// one FMA; per group two FMAs for the affine terms (the bias with the exact sums of x, the
// centre with what the rounding took from them: as tile_affine, tile_q6).
// x is the prep's, row after row, in natural order (qmm_op.cpp prepares it with bits 8 for
// the affine formats: natural order, exact sums and residuals per group).
constexpr int kPanel = 8;
#if defined(QMM_ISA_VNNI)
constexpr int kMR8 = 8;  // 3 x 8 accumulator vectors of 32 ymm registers (AVX-512 VL)
#else
constexpr int kMR8 = 4;  // of 16
#endif

struct Panel8 {
  uint8_t* q;  // [K / 4][8][4] codes
  float* s;    // affine: [groups][8] scale; Q6_K: [K / 16][8] d * scale
  float* b;    // affine: [groups][8] bias;  Q6_K: [K / 16][8] -32 * d * scale
  float* c;    // affine: [groups][8] centre * scale (the centre's term: 8 or 128)
};

// 8-bit codes on AVX2 are stored centred and signed (q - 128): `vpmaddubsw` takes one
// unsigned operand and saturates its pair sums at 2^15, which 255 * 127 * 2 exceeds; the
// sign trick (|w| times x with w's sign) keeps them within 128 * 127 * 2. The centred
// codes then carry the centre themselves: bias + 128 * scale meets the exact sums of x and
// no residual term is needed. VNNI's `vpdpbusd` and the portable loops take q as it is.
#if defined(QMM8_SIMD) && !defined(QMM_ISA_VNNI)
constexpr bool kSigned8 = true;
#else
constexpr bool kSigned8 = false;
#endif

// The panel's scale vectors (zeros past the last column: computed, never stored).
template <int ST>
void pack_scales(const QmmArgs& a, int64_t n0, int nc, const Panel8& p) {
  for (int j = 0; j < kPanel; ++j) {
    const int64_t col = n0 + j;
    if (a.bits == 6) {
      const int8_t* scl = static_cast<const int8_t*>(a.scales) + col * a.groups;
      const uint16_t* dr = static_cast<const uint16_t*>(a.biases) + col * (a.k / 256);
      for (int64_t g = 0; g < a.k / 16; ++g) {
        const float sc = j < nc ? f16_to_f32(dr[g / 16]) * static_cast<float>(scl[g]) : 0.0f;
        p.s[g * kPanel + j] = sc;
        p.b[g * kPanel + j] = -32.0f * sc;
      }
      continue;
    }
    const bool signed8 = kSigned8 && a.bits == 8;
    const float centre = affine_centre(a.bits);
    for (int64_t g = 0; g < a.groups; ++g) {
      const float sv = j < nc ? scalar_at<ST>(a.scales, col * a.groups + g) : 0.0f;
      const float bv = j < nc ? bias_at<ST>(a, col * a.groups + g) : 0.0f;
      p.s[g * kPanel + j] = sv;
      p.b[g * kPanel + j] = signed8 ? bv + centre * sv : bv;
      p.c[g * kPanel + j] = signed8 ? 0.0f : centre * sv;
    }
  }
}

#if defined(QMM8_SIMD)

// r[j]: 32 codes of column j (8 quads); writes quad t of every column as vector t (the
// panel's layout): an 8 x 8 transpose of 32-bit words.
inline void store_quads(const __m256i* r, uint8_t* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + q * 32), _mm256_permute2x128_si256(u[q], u[q + 4], 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + (q + 4) * 32), _mm256_permute2x128_si256(u[q], u[q + 4], 0x31));
  }
}

void pack_codes(const QmmArgs& a, int64_t n0, int nc, uint8_t* out) {
  __m256i r[kPanel];
  if (a.bits == 6) {  // per 128 values of a block: tile_q6's four code vectors per column
    const int64_t row_bytes = a.k / 256 * 192;
    const __m256i m4 = _mm256_set1_epi8(15), m_hi = _mm256_set1_epi8(0x30);
    alignas(32) __m256i code[kPanel][4];
    for (int64_t b = 0; b < a.k / 256; ++b) {
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < kPanel; ++j) {
          if (j >= nc) {
            for (int t = 0; t < 4; ++t) code[j][t] = _mm256_setzero_si256();
            continue;
          }
          const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + (n0 + j) * row_bytes + b * 192;
          const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + h * 64));
          const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + h * 64 + 32));
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + h * 32));
          code[j][0] = _mm256_or_si256(_mm256_and_si256(lo0, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), m_hi));
          code[j][1] = _mm256_or_si256(_mm256_and_si256(lo1, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), m_hi));
          code[j][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4), _mm256_and_si256(hi, m_hi));
          code[j][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(hi, 2), m_hi));
        }
        for (int t = 0; t < 4; ++t) {  // values 256b + 128h + 32t ..: one block of 32
          for (int j = 0; j < kPanel; ++j) r[j] = code[j][t];
          store_quads(r, out + (b * 8 + h * 4 + t) * 256);
        }
      }
    }
    return;
  }
  if (a.bits == 8) {  // one byte per value, natural order
    const __m256i flip = _mm256_set1_epi8(kSigned8 ? static_cast<char>(0x80) : 0);
    for (int64_t blk = 0; blk < a.k / 32; ++blk) {
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + (n0 + j) * a.k + blk * 32;
        r[j] = j < nc ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), flip)
                      : _mm256_setzero_si256();
      }
      store_quads(r, out + blk * 256);
    }
    return;
  }
  const __m128i m4 = _mm_set1_epi8(15);
  for (int64_t blk = 0; blk < a.k / 32; ++blk) {  // 4-bit: byte i holds values 2i, 2i + 1
    for (int j = 0; j < kPanel; ++j) {
      if (j >= nc) {
        r[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + (n0 + j) * (a.k / 2) + blk * 16;
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
      r[j] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    }
    store_quads(r, out + blk * 256);
  }
}

#else

// The codes of column col, values 256 * blk .. (Q6_K: one block).
inline void q6_codes(const QmmArgs& a, int64_t col, int64_t blk, uint8_t* out) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(a.w) + col * (a.k / 256 * 192) + blk * 192;
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t b0 = b[h * 64 + l], b1 = b[h * 64 + 32 + l], hb = b[128 + h * 32 + l];
      const int t = h * 128 + l;
      out[t] = (b0 & 15) | ((hb << 4) & 0x30);
      out[t + 32] = (b1 & 15) | ((hb << 2) & 0x30);
      out[t + 64] = (b0 >> 4) | (hb & 0x30);
      out[t + 96] = (b1 >> 4) | ((hb >> 2) & 0x30);
    }
  }
}

void pack_codes(const QmmArgs& a, int64_t n0, int nc, uint8_t* out) {
  for (int j = 0; j < kPanel; ++j) {
    uint8_t* dst = out + j * 4;  // quad t of column j at dst + t * 32
    if (j >= nc) {
      for (int64_t t = 0; t < a.k / 4; ++t) memset(dst + t * 32, 0, 4);
      continue;
    }
    if (a.bits == 6) {
      uint8_t codes[256];
      for (int64_t blk = 0; blk < a.k / 256; ++blk) {
        q6_codes(a, n0 + j, blk, codes);
        for (int t = 0; t < 64; ++t) memcpy(dst + (blk * 64 + t) * 32, codes + 4 * t, 4);
      }
      continue;
    }
    if (a.bits == 8) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + (n0 + j) * a.k;
      for (int64_t t = 0; t < a.k / 4; ++t) memcpy(dst + t * 32, src + 4 * t, 4);
      continue;
    }
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + (n0 + j) * (a.k / 2);
    for (int64_t t = 0; t < a.k / 4; ++t) {  // byte i holds values 2i (low nibble), 2i + 1
      uint8_t* o = dst + t * 32;
      o[0] = src[2 * t] & 15;
      o[1] = src[2 * t] >> 4;
      o[2] = src[2 * t + 1] & 15;
      o[3] = src[2 * t + 1] >> 4;
    }
  }
}

#endif

template <int ST>
void pack_panel(const QmmArgs& a, int64_t n0, int nc, const Panel8& p) {
  pack_scales<ST>(a, n0, nc, p);
  pack_codes(a, n0, nc, p.q);
}

// Rows r0 .. r0 + m of the call (row pointers: rows past m repeat row r0, computed, not stored).
struct Rows8 {
  const int8_t* xq[kMR8];
  const float* xd[kMR8];
  const float* xs[kMR8];
  const float* xr[kMR8];
};

inline Rows8 rows8(const QmmArgs& a, int64_t r0, int m) {
  Rows8 r{};
  const int64_t dstride = a.k / 32 + 8;
  const int64_t gstride = a.bits == 6 ? a.k / 16 : a.groups;
  for (int i = 0; i < kMR8; ++i) {
    const int64_t row = r0 + (i < m ? i : 0);
    r.xq[i] = a.xq + row * a.k;
    r.xd[i] = a.xd + row * dstride;
    r.xs[i] = a.xs + row * gstride;
    r.xr[i] = a.xr != nullptr ? a.xr + row * a.groups : nullptr;
  }
  return r;
}

#if defined(QMM8_SIMD)

inline __m256i x4(const int8_t* p) {  // 4 x codes of one row, in every lane
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline void store_rows(const QmmArgs& a, const __m256* cf, int64_t r0, int m, int64_t n0, int nc) {
  for (int i = 0; i < m; ++i) {
    float* y = a.y + (r0 + i) * a.n + n0;
    if (nc == kPanel) {
      _mm256_storeu_ps(y, cf[i]);
    } else {
      alignas(32) float t[kPanel];
      _mm256_store_ps(t, cf[i]);
      for (int j = 0; j < nc; ++j) y[j] = t[j];
    }
  }
}

template <int GS, bool SIGNED>
void micro_affine(const QmmArgs& a, const Panel8& p, int64_t r0, int m, int64_t n0, int nc) {
  const Rows8 x = rows8(a, r0, m);
  __m256 cf[kMR8];
  for (int i = 0; i < kMR8; ++i) cf[i] = _mm256_setzero_ps();
  constexpr int kPerGroup = GS / 32;
  for (int64_t g = 0; g < a.groups; ++g) {
    const __m256 sv = _mm256_load_ps(p.s + g * kPanel);
    for (int e = 0; e < kPerGroup; ++e) {
      const int64_t blk = g * kPerGroup + e;
      const uint8_t* qb = p.q + blk * 256;
      __m256i acc[kMR8];
      for (int i = 0; i < kMR8; ++i) acc[i] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(qb + t * 32));
        for (int i = 0; i < kMR8; ++i) {
#if defined(QMM_ISA_VNNI)
          acc[i] = dp(acc[i], w, x4(x.xq[i] + blk * 32 + 4 * t));
#else
          acc[i] = SIGNED ? dp_signed(acc[i], w, x4(x.xq[i] + blk * 32 + 4 * t))
                          : dp(acc[i], w, x4(x.xq[i] + blk * 32 + 4 * t));
#endif
        }
      }
      for (int i = 0; i < kMR8; ++i) {
        cf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(sv, _mm256_set1_ps(x.xd[i][blk])), cf[i]);
      }
    }
    const __m256 bv = _mm256_load_ps(p.b + g * kPanel), cv = _mm256_load_ps(p.c + g * kPanel);
    for (int i = 0; i < kMR8; ++i) {
      cf[i] = _mm256_fmadd_ps(bv, _mm256_set1_ps(x.xs[i][g]), cf[i]);
      if constexpr (!SIGNED) cf[i] = _mm256_fmadd_ps(cv, _mm256_set1_ps(x.xr[i][g]), cf[i]);
    }
  }
  store_rows(a, cf, r0, m, n0, nc);
}

void micro_q6(const QmmArgs& a, const Panel8& p, int64_t r0, int m, int64_t n0, int nc) {
  const Rows8 x = rows8(a, r0, m);
  __m256 cf[kMR8];
  for (int i = 0; i < kMR8; ++i) cf[i] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < a.k / 32; ++blk) {
    __m256 part[kMR8];
    for (int h = 0; h < 2; ++h) {  // the block's two 16-value sub-blocks
      const int64_t sb = 2 * blk + h;
      const uint8_t* qb = p.q + sb * 128;
      __m256i acc[kMR8];
      for (int i = 0; i < kMR8; ++i) acc[i] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(qb + t * 32));
        for (int i = 0; i < kMR8; ++i) acc[i] = dp(acc[i], w, x4(x.xq[i] + sb * 16 + 4 * t));
      }
      const __m256 sv = _mm256_load_ps(p.s + sb * kPanel);
      for (int i = 0; i < kMR8; ++i) {
        part[i] = h == 0 ? _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i]), sv)
                         : _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), sv, part[i]);
      }
    }
    for (int i = 0; i < kMR8; ++i) cf[i] = _mm256_fmadd_ps(part[i], _mm256_set1_ps(x.xd[i][blk]), cf[i]);
  }
  for (int64_t sb = 0; sb < a.k / 16; ++sb) {  // the -32 offset with the rounded x's sums
    const __m256 ov = _mm256_load_ps(p.b + sb * kPanel);
    for (int i = 0; i < kMR8; ++i) cf[i] = _mm256_fmadd_ps(ov, _mm256_set1_ps(x.xs[i][sb]), cf[i]);
  }
  store_rows(a, cf, r0, m, n0, nc);
}

#else  // portable: the same sums, one row and column at a time

inline int32_t dot4(const uint8_t* w, const int8_t* x) {
  return w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3];
}

template <int GS, bool SIGNED>  // SIGNED: never here (kSigned8)
void micro_affine(const QmmArgs& a, const Panel8& p, int64_t r0, int m, int64_t n0, int nc) {
  const Rows8 x = rows8(a, r0, m);
  constexpr int kPerGroup = GS / 32;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < nc; ++j) {
      float acc = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        const float s = p.s[g * kPanel + j];
        for (int e = 0; e < kPerGroup; ++e) {
          const int64_t blk = g * kPerGroup + e;
          int32_t sum = 0;
          for (int t = 0; t < 8; ++t) sum += dot4(p.q + blk * 256 + t * 32 + j * 4, x.xq[i] + blk * 32 + 4 * t);
          acc += static_cast<float>(sum) * (s * x.xd[i][blk]);
        }
        acc += p.b[g * kPanel + j] * x.xs[i][g];
        acc += p.c[g * kPanel + j] * x.xr[i][g];
      }
      a.y[(r0 + i) * a.n + n0 + j] = acc;
    }
  }
}

void micro_q6(const QmmArgs& a, const Panel8& p, int64_t r0, int m, int64_t n0, int nc) {
  const Rows8 x = rows8(a, r0, m);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < nc; ++j) {
      float acc = 0.0f;
      for (int64_t blk = 0; blk < a.k / 32; ++blk) {
        float part = 0.0f;
        for (int h = 0; h < 2; ++h) {
          const int64_t sb = 2 * blk + h;
          int32_t sum = 0;
          for (int t = 0; t < 4; ++t) sum += dot4(p.q + sb * 128 + t * 32 + j * 4, x.xq[i] + sb * 16 + 4 * t);
          part += static_cast<float>(sum) * p.s[sb * kPanel + j];
        }
        acc += part * x.xd[i][blk];
      }
      for (int64_t sb = 0; sb < a.k / 16; ++sb) acc += p.b[sb * kPanel + j] * x.xs[i][sb];
      a.y[(r0 + i) * a.n + n0 + j] = acc;
    }
  }
}

#endif

template <class Micro>
void panels(const QmmArgs& a, int64_t n0, int64_t n1, void (*pack)(const QmmArgs&, int64_t, int, const Panel8&),
            Micro micro) {
  const int64_t ng = a.bits == 6 ? a.k / 16 : a.groups;
  thread_local std::vector<uint8_t> qbuf;
  thread_local std::vector<float> fbuf;
  if (qbuf.size() < static_cast<size_t>(a.k * kPanel + 32)) qbuf.resize(a.k * kPanel + 32);
  if (fbuf.size() < static_cast<size_t>(3 * ng * kPanel + 16)) fbuf.resize(3 * ng * kPanel + 16);
  // 32-byte aligned starts (the micro-kernels use aligned loads)
  uint8_t* q = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(qbuf.data()) + 31) & ~uintptr_t(31));
  float* f = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(fbuf.data()) + 31) & ~uintptr_t(31));
  const Panel8 p{q, f, f + ng * kPanel, f + 2 * ng * kPanel};
  for (int64_t j0 = n0; j0 < n1; j0 += kPanel) {
    const int nc = static_cast<int>(n1 - j0 < kPanel ? n1 - j0 : kPanel);
    pack(a, j0, nc, p);
    for (int64_t r0 = 0; r0 < a.rows; r0 += kMR8) {
      micro(a, p, r0, static_cast<int>(a.rows - r0 < kMR8 ? a.rows - r0 : kMR8), j0, nc);
    }
  }
}

template <int ST, bool SIGNED>
void gemm8_groups(const QmmArgs& a, int64_t n0, int64_t n1) {
  switch (a.group_size) {
    case 32: panels(a, n0, n1, &pack_panel<ST>, &micro_affine<32, SIGNED>); break;
    case 64: panels(a, n0, n1, &pack_panel<ST>, &micro_affine<64, SIGNED>); break;
    default: panels(a, n0, n1, &pack_panel<ST>, &micro_affine<128, SIGNED>); break;
  }
}

template <int ST>
void gemm8_affine(const QmmArgs& a, int64_t n0, int64_t n1) {
  if (kSigned8 && a.bits == 8) {
    gemm8_groups<ST, kSigned8>(a, n0, n1);
  } else {
    gemm8_groups<ST, false>(a, n0, n1);
  }
}

}  // namespace

extern "C" void QMM_DOT8(const QmmArgs* args, int64_t n0, int64_t n1) {
  const QmmArgs& a = *args;
  if (n1 <= n0 || a.rows <= 0) return;
  QmmArgs rows[kMaxRows8];
  const int64_t count = a.rows < kMaxRows8 ? a.rows : kMaxRows8;
  for (int64_t r = 0; r < count; ++r) rows[r] = row_of(a, r);
  int64_t n = n0;
  if (a.bits == 6) {
    // Two columns per tile: with eight (or four) the tile's accumulators and row pointers
    // no longer fit the registers and its weight streams outrun the prefetches; a decode
    // row of the 28-layer 0.4B Q4_K_M shape's ffn_down (1024 x 2816, from DRAM) took
    // 186-266 us with eight, 123-150 with four and 105-114 with two, its 49152 x 1024
    // head 2,285-3,263 / 1,290-2,030 / 1,590-1,710 us (2-core AVX-512 VM, three alternating runs).
#if defined(QMM8_SIMD)
    if (count > 1) {  // batched decode, verify windows: the rows share each tile's unpacking
      for (; n + 2 <= n1; n += 2) q6_all_rows<2>(rows, count, n);
      for (; n < n1; ++n) q6_all_rows<1>(rows, count, n);
      return;
    }
#endif
    tiles<2>(rows, count, n, n1, [](const QmmArgs& x, int64_t c) { tile_q6<2>(x, c); });
    tiles<1>(rows, count, n, n1, [](const QmmArgs& x, int64_t c) { tile_q6<1>(x, c); });
  } else {
    switch (a.scale_type) {
      case QMM_F32: run_groups<QMM_F32>(rows, count, n, n1); break;
      case QMM_F16: run_groups<QMM_F16>(rows, count, n, n1); break;
      case QMM_K8: run_groups<QMM_K8>(rows, count, n, n1); break;
      default: run_groups<QMM_BF16>(rows, count, n, n1); break;
    }
  }
}

namespace {

// One block of x rounded, with the sums the bodies need: the codes (natural order), d, the
// codes' sum over all 32 and over the first 16, and the exact sum of the values formed as
// eight lanes (lane l = v[l] + v[8 + l] + v[16 + l] + v[24 + l]) added pairwise across.
struct Block8 {
  alignas(32) int8_t q[32];
  float d, exact;
  int32_t sum, half;
};

#if defined(QMM8_SIMD)
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

// max |v| over 32 values.
inline float amax32(const float* v) {
#if defined(QMM8_SIMD)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_load_ps(v + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  return amax;
#endif
}

// q = round(v / d) (ties to even) of 32 values, and the sums. The SIMD form takes the sums
// from the rounding's own registers (scalar loops over the codes cost ~3x the rounding
// itself in prefill's prep).
inline void round32(const float* v, float d, Block8& out) {
  out.d = d;
#if defined(QMM8_SIMD)
  __m256 vv[4];
  for (int i = 0; i < 4; ++i) vv[i] = _mm256_load_ps(v + 8 * i);
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(vv[i], inv));  // MXCSR: to even
  const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_store_si256(reinterpret_cast<__m256i*>(out.q), b);
  const __m256i first = _mm256_add_epi32(r[0], r[1]);  // |codes| <= 127: no saturation above
  out.half = hsum_epi32(first);
  out.sum = out.half + hsum_epi32(_mm256_add_epi32(r[2], r[3]));
  alignas(32) float lane[8];
  _mm256_store_ps(lane, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(vv[0], vv[1]), vv[2]), vv[3]));
  out.exact = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
#else
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) out.q[i] = static_cast<int8_t>(nearbyintf(v[i] * inv));
  out.sum = out.half = 0;
  for (int i = 0; i < 32; ++i) {
    out.sum += out.q[i];
    if (i == 15) out.half = out.sum;
  }
  float lane[8] = {};
  for (int i = 0; i < 32; ++i) lane[i % 8] += v[i];
  out.exact = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
#endif
}

// One block of 32 values rounded on its own: d = max|v| / 127.
inline void prep_block(const float* v, Block8& out) {
  round32(v, amax32(v) / 127.0f, out);
}

// Q6_K decode rows (qmm.h): per 256 values one d = max|v| / 127 (llama.cpp's Q8_K), the
// codes in natural order, and the codes' sums per 16-value sub-block as int16 in xs.
void prep_q8k(const float* x, int64_t sk, int64_t k, int8_t* xq, float* xd, float* xs) {
  alignas(32) float v[256];
  for (int64_t b = 0; b < k / 256; ++b) {
    if (sk == 1) {
      memcpy(v, x + b * 256, sizeof(v));
    } else {
      for (int i = 0; i < 256; ++i) v[i] = x[(b * 256 + i) * sk];
    }
    float amax = 0.0f;
    for (int c = 0; c < 8; ++c) amax = fmaxf(amax, amax32(v + 32 * c));
    const float d = amax / 127.0f;
    int16_t sums[16];
    for (int c = 0; c < 8; ++c) {
      Block8 blk;
      round32(v + 32 * c, d, blk);
      memcpy(xq + b * 256 + 32 * c, blk.q, 32);
      sums[2 * c] = static_cast<int16_t>(blk.half);
      sums[2 * c + 1] = static_cast<int16_t>(blk.sum - blk.half);
    }
    xd[b] = d;
    memcpy(reinterpret_cast<char*>(xs) + b * sizeof(sums), sums, sizeof(sums));
  }
}

// 4-bit order: value 64c + 2i + e of chunk c goes to 64c + 32e + i; block hb (0, 1) of the
// chunk holds i in [16 hb, 16 hb + 16).
inline void store_evens_odds(const int8_t* q, int8_t* out) {
#if defined(QMM8_SIMD)
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  // per 128-bit half [evens, odds] -> [evens lo, evens hi, odds lo, odds hi]
  const __m256i eo = _mm256_permute4x64_epi64(
      _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(q)), split), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(eo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32), _mm256_extracti128_si256(eo, 1));
#else
  for (int i = 0; i < 16; ++i) {
    out[i] = q[2 * i];
    out[32 + i] = q[2 * i + 1];
  }
#endif
}

}  // namespace

extern "C" void QMM_PREP8(const float* x, int64_t sk, int64_t k, int group_size, int bits,
                          int8_t* xq, float* xd, float* xs, float* xr) {
  // affine: exact sums of x per group (xs) and what the rounding took from them (xr);
  // Q6_K: sums of the rounded x per 16-value sub-block (xs).
  if (bits == 6 && group_size == 256) return prep_q8k(x, sk, k, xq, xd, xs);
  const int per_group = bits == 6 ? 1 : group_size / 32;  // blocks per affine group
  for (int64_t blk = 0; blk < k / 32; ++blk) {
    alignas(32) float v[32];
    if (sk == 1) {
      memcpy(v, x + blk * 32, sizeof(v));
    } else {
      for (int i = 0; i < 32; ++i) v[i] = x[(blk * 32 + i) * sk];
    }
    Block8 b;
    prep_block(v, b);
    xd[blk] = b.d;
    if (bits == 6) {
      xs[2 * blk] = b.d * static_cast<float>(b.half);
      xs[2 * blk + 1] = b.d * static_cast<float>(b.sum - b.half);
    } else {
      const int64_t g = blk / per_group;
      if (blk % per_group == 0) xs[g] = xr[g] = 0.0f;
      xs[g] += b.exact;
      xr[g] += b.exact - b.d * static_cast<float>(b.sum);
    }
    if (bits == 4) {
      store_evens_odds(b.q, xq + (blk / 2) * 64 + (blk % 2) * 16);
    } else {
      memcpy(xq + blk * 32, b.q, 32);
    }
  }
}

extern "C" void QMM_GEMM8(const QmmArgs* args, int64_t n0, int64_t n1) {
  const QmmArgs& a = *args;
  if (n1 <= n0 || a.rows <= 0) return;
  if (a.bits == 6) {
    panels(a, n0, n1, &pack_panel<QMM_F16>, &micro_q6);  // Q6_K: the scale type is its own
    return;
  }
  switch (a.scale_type) {
    case QMM_F32: gemm8_affine<QMM_F32>(a, n0, n1); break;
    case QMM_F16: gemm8_affine<QMM_F16>(a, n0, n1); break;
    case QMM_K8: gemm8_affine<QMM_K8>(a, n0, n1); break;
    default: gemm8_affine<QMM_BF16>(a, n0, n1); break;
  }
}
