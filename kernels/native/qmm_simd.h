// SIMD helpers of the quantized matmul bodies (qmm_kernel.cpp, qmm_gemm.cpp), which are
// compiled once per ISA (CMakeLists.txt): QMM_ISA_AVX512 (16 float lanes), QMM_ISA_AVX2
// (8 lanes, FMA, F16C) or neither (portable, 4 lanes). Included only by those bodies,
// never by code built for the baseline ISA; everything here has internal linkage.
#pragma once

#include <stdint.h>
#include <string.h>

#include "qmm.h"

#if defined(QMM_ISA_AVX512) || defined(QMM_ISA_AVX2)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(QMM_ISA_AVX512)
#define QMM_RUN qmm_run_avx512
#define QMM_PREP qmm_prep_avx512
#define QMM_GEMM qmm_gemm_avx512
#define QMM_GEMM_PACK qmm_gemm_pack_avx512
#define QMM_GEMM_TILE qmm_gemm_tile_avx512
#define LANES 16
#define GEMM_MR 12
#elif defined(QMM_ISA_AVX2)
#define QMM_RUN qmm_run_avx2
#define QMM_PREP qmm_prep_avx2
#define QMM_GEMM qmm_gemm_avx2
#define QMM_GEMM_PACK qmm_gemm_pack_avx2
#define QMM_GEMM_TILE qmm_gemm_tile_avx2
#define LANES 8
#define GEMM_MR 6
#else
#define QMM_RUN qmm_run_generic
#define QMM_PREP qmm_prep_generic
#define QMM_GEMM qmm_gemm_generic
#define QMM_GEMM_PACK qmm_gemm_pack_generic
#define QMM_GEMM_TILE qmm_gemm_tile_generic
#define LANES 4
#define GEMM_MR 6
#endif

namespace {

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint8_t vb __attribute__((vector_size(LANES)));

inline vf loadf(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

// LANES bytes, zero-extended to int32 lanes (one vpmovzxbd on x86; GCC 12 lowers the
// portable __builtin_convertvector of a byte vector to scalar byte moves there).
inline void storef(float* p, vf v) {
  memcpy(p, &v, sizeof v);
}

// *p in every lane, from memory (vbroadcastss m32: a load-port µop; `vf{} + x` would be a
// scalar add plus a register broadcast on the shuffle port, which AVX-512 FMAs also use).
inline vf splat(const float* p) {
#if defined(QMM_ISA_AVX512)
  return (vf)_mm512_set1_ps(*p);
#elif defined(QMM_ISA_AVX2)
  return (vf)_mm256_broadcast_ss(p);
#else
  vf v;
  for (int i = 0; i < LANES; ++i) v[i] = *p;
  return v;
#endif
}

inline vi load_bytes(const uint8_t* p) {
#if defined(QMM_ISA_AVX512)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(QMM_ISA_AVX2)
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE2__)
  int32_t word;
  memcpy(&word, p, 4);
  const __m128i zero = _mm_setzero_si128();
  const __m128i b = _mm_cvtsi32_si128(word);
  return (vi)_mm_unpacklo_epi16(_mm_unpacklo_epi8(b, zero), zero);
#else
  vb b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
#endif
}

// LANES signed bytes, sign-extended to int32 lanes (Q6_K's sub-block scales).
inline vi load_sbytes(const int8_t* p) {
#if defined(QMM_ISA_AVX512)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(QMM_ISA_AVX2)
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vi v;
  for (int i = 0; i < LANES; ++i) v[i] = p[i];
  return v;
#endif
}

inline vf to_f(vi v) {
  return __builtin_convertvector(v, vf);
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < LANES; ++i) s += v[i];
  return s;
}

// The horizontal sums of four vectors, stored to y[0..3].
inline void reduce4(vf a, vf b, vf c, vf d, float* y) {
#if defined(QMM_ISA_AVX512)
  const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)a), 1)));
  const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)b), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)b), 1)));
  const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)c), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)c), 1)));
  const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)d), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)d), 1)));
#elif defined(QMM_ISA_AVX2)
  const __m256 a8 = (__m256)a, b8 = (__m256)b, c8 = (__m256)c, d8 = (__m256)d;
#endif
#if defined(QMM_ISA_AVX512) || defined(QMM_ISA_AVX2)
  // hadd pairs: [a01 a23 b01 b23 | a45 a67 b45 b67], then [a b c d | a b c d] partials
  const __m256 ab = _mm256_hadd_ps(a8, b8);
  const __m256 cd = _mm256_hadd_ps(c8, d8);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  y[0] = hsum(a);
  y[1] = hsum(b);
  y[2] = hsum(c);
  y[3] = hsum(d);
#endif
}

inline float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
#if defined(QMM_ISA_AVX512) || defined(QMM_ISA_AVX2)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_to_f32(sign);
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

template <int ST>
inline float scalar_at(const void* p, int64_t i) {
  if constexpr (ST == QMM_F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == QMM_F16) {
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  } else if constexpr (ST == QMM_K8) {
    const uint8_t* b = static_cast<const uint8_t*>(p) + (i >> 3) * QMM_K8_BYTES;
    return f16_to_f32(static_cast<uint16_t>(b[0] | (b[1] << 8))) * static_cast<float>(b[2 + (i & 7)]);
  } else {
    return bits_to_f32(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
}

// Values per weight block (LANES bytes).
template <int BITS>
constexpr int kBlock = BITS == 4 ? 2 * LANES : LANES;

// count scales (or biases) of type ST from src to float32 dst.
template <int ST>
inline void to_float(const void* src, int64_t first, int count, float* dst) {
  int i = 0;
  if constexpr (ST == QMM_K8) {
#if defined(QMM_ISA_AVX512) || defined(QMM_ISA_AVX2)
    if ((first & 7) == 0) {  // whole 256-weight blocks: 8 multipliers times one factor
      const uint8_t* b = static_cast<const uint8_t*>(src) + (first >> 3) * QMM_K8_BYTES;
      for (; i + 8 <= count; i += 8, b += QMM_K8_BYTES) {
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2))));
        const float f = f16_to_f32(static_cast<uint16_t>(b[0] | (b[1] << 8)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(m, _mm256_set1_ps(f)));
      }
    }
#endif
  }
  if constexpr (ST == QMM_F16) {
#if defined(QMM_ISA_AVX512) || defined(QMM_ISA_AVX2)
    const uint16_t* p = static_cast<const uint16_t*>(src) + first;
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    }
#endif
  }
  for (; i < count; ++i) dst[i] = scalar_at<ST>(src, first + i);
}

// The code an affine 4-bit / 8-bit weight is centred on (its range's middle): the 8-bit-x
// bodies multiply centred codes, and a symmetric group's bias is -centre * scale.
constexpr float affine_centre(int bits) {
  return bits == 4 ? 8.0f : 128.0f;
}

// The bias of a symmetric group (QmmArgs::biases NULL) of this scale.
inline float symmetric_bias(int bits, float scale) {
  return -affine_centre(bits) * scale;
}

// Group i's bias as float32: read, or from the group's scale (symmetric weights).
template <int ST>
inline float bias_at(const QmmArgs& a, int64_t i) {
  return a.biases != nullptr ? scalar_at<ST>(a.biases, i) : symmetric_bias(a.bits, scalar_at<ST>(a.scales, i));
}

// count biases from group `first` on as float32, `sc` the same groups' scales already
// converted (symmetric weights derive theirs from them).
template <int ST>
inline void biases_to_float(const QmmArgs& a, int64_t first, int count, const float* sc, float* dst) {
  if (a.biases != nullptr) {
    to_float<ST>(a.biases, first, count, dst);
    return;
  }
  const float c = symmetric_bias(a.bits, 1.0f);
  for (int i = 0; i < count; ++i) dst[i] = c * sc[i];
}

}  // namespace
