// Segmented attention kernel body: one query block over every K/V piece in one pass, with
// an online softmax (running max m and sum l per query row, float32, base 2).
//
// Compiled once per ISA (CMakeLists.txt): SEGATTN_ISA_AVX512 (-mavx512f ...), SEGATTN_ISA_AVX2
// (-mavx2 -mfma -mf16c) and the portable baseline (GCC/Clang vector extensions: SSE2 on
// x86-64, NEON on aarch64). segattn_op.cpp picks one at run time from the CPU's features.
// Everything here has internal linkage (anonymous namespace, no std templates) except the
// two entry points (run, merge), so no code built with wider flags can leak into others.
//
// Per work item (batch b, kv head h, block of packed query rows r = g * L + l, which is
// query head h * G + g at position l):
//   qs[r]  = q[r] * scale * log2(e)                   (float32 scratch, any Q strides)
//   for each piece, for each tile of SEGATTN_TILE keys (K/V read in place), for each group
//   of up to RG rows that see keys in the tile:
//     s[r, j] = qs[r] . k[j]          (2 rows x KB keys of FMA accumulators, then a
//                                      horizontal-add tree for KB sums at once)
//     m' = max(m, max_j s), a = 2^(m - m'), p = 2^(s - m')      (vector 2^x polynomial)
//     l = l * a + sum_j p;  acc[r] = acc[r] * a + sum_j p[j] v[j]  (each V vector loaded
//                                      once per group, RG rows of accumulators in registers)
//   out[r] = acc[r] / l  (0 when the row saw no key)
// With key splits (few items, several threads) an item covers one key range and leaves
// (m, l, acc) per row; the merge entry combines the ranges.
// The causal tail is a prefix per row: row l sees tail keys [0, T - L + l + 1), so no mask
// is ever materialised; a tile covers the longest prefix in the block and each row uses its
// own length.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "segattn.h"

#if defined(SEGATTN_ISA_AVX512) || defined(SEGATTN_ISA_AVX2)
#include <immintrin.h>
#endif

#if defined(SEGATTN_ISA_AVX512)
#define SEGATTN_ENTRY segattn_run_avx512
#define SEGATTN_MERGE_ENTRY segattn_merge_avx512
#elif defined(SEGATTN_ISA_AVX2)
#define SEGATTN_ENTRY segattn_run_avx2
#define SEGATTN_MERGE_ENTRY segattn_merge_avx2
#else
#define SEGATTN_ENTRY segattn_run_generic
#define SEGATTN_MERGE_ENTRY segattn_merge_generic
#endif

namespace {

struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

inline float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_to_f32(sign);
    // subnormal: value = mant * 2^-24
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float32 -> float16, round to nearest even (overflow -> inf, nan stays nan).
inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) {  // |f| >= 65536 (rounds to inf), inf or nan
    return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (x < 0x38800000u) {  // below the smallest normal half: let float addition round
    float t = bits_to_f32(x) + 0.5f;  // 0.5 = 2^-1: aligns the half subnormal ulp (2^-24)
    return (uint16_t)(sign | (f32_to_bits(t) - 0x3f000000u));
  }
  uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000000u + 0xfffu + odd;  // rebias exponent (-112 << 23), round half to even
  return (uint16_t)(sign | (x >> 13));
}

inline float bf16_to_f32(uint16_t b) {
  return bits_to_f32((uint32_t)b << 16);
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

inline float to_f32(float x) {
  return x;
}
inline float to_f32(F16 x) {
  return f16_to_f32(x.bits);
}
inline float to_f32(BF16 x) {
  return bf16_to_f32(x.bits);
}
inline void from_f32(float x, float* dst) {
  *dst = x;
}
inline void from_f32(float x, F16* dst) {
  dst->bits = f32_to_f16(x);
}
inline void from_f32(float x, BF16* dst) {
  dst->bits = f32_to_bf16(x);
}

// 2^f on [-0.5, 0.5] (Cephes exp2f polynomial, ~2e-7 relative).
constexpr float P0 = 1.535336188319500e-4f;
constexpr float P1 = 1.339887440266574e-3f;
constexpr float P2 = 9.618437357674640e-3f;
constexpr float P3 = 5.550332471162809e-2f;
constexpr float P4 = 2.402264791363012e-1f;
constexpr float P5 = 6.931472028550421e-1f;
constexpr float ROUND_MAGIC = 12582912.0f;  // 1.5 * 2^23: x + M - M rounds to nearest
constexpr float EXP_FLOOR = -126.0f;        // 2^x below this is flushed to 0

// ---------------------------------------------------------------------------------------
// SIMD backends: W floats per vector, KB keys per score register block.
// ---------------------------------------------------------------------------------------
#if defined(SEGATTN_ISA_AVX512)
struct Simd {
  static constexpr int W = 16;
  static constexpr int KB = 8;    // scores: 2 rows x 8 keys = 16 zmm accumulators
  static constexpr int ACC = 24;  // V accumulation: rows x vectors held in registers
  static constexpr int RG = 4;    // query rows per group (one pass over the V tile)
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load(const BF16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static __m256 half_sum(V v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  }
  // out[i] = sum of the lanes of a[i], i < KB.
  static void hsum_block(const V* a, float* out) {
    __m256 t0 = _mm256_hadd_ps(half_sum(a[0]), half_sum(a[1]));
    __m256 t1 = _mm256_hadd_ps(half_sum(a[2]), half_sum(a[3]));
    __m256 t2 = _mm256_hadd_ps(half_sum(a[4]), half_sum(a[5]));
    __m256 t3 = _mm256_hadd_ps(half_sum(a[6]), half_sum(a[7]));
    __m256 u0 = _mm256_hadd_ps(t0, t1);  // [s0..s3 low lanes | s0..s3 high lanes]
    __m256 u1 = _mm256_hadd_ps(t2, t3);
    __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
    __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
  }
  static V exp2(V x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    V n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V f = _mm512_sub_ps(x, n);
    V p = _mm512_set1_ps(P0);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(P5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
  }
};
#elif defined(SEGATTN_ISA_AVX2)
struct Simd {
  static constexpr int W = 8;
  static constexpr int KB = 4;    // scores: 2 rows x 4 keys = 8 ymm accumulators
  static constexpr int ACC = 12;  // V accumulation: rows x vectors held in registers
  static constexpr int RG = 4;    // query rows per group (one pass over the V tile)
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load(const BF16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static void hsum_block(const V* a, float* out) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
    __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 u = _mm256_hadd_ps(t0, t1);  // [s0..s3 low lanes | s0..s3 high lanes]
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
  static V exp2(V x) {
    V keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    V n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V f = _mm256_sub_ps(x, n);
    V p = _mm256_set1_ps(P0);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(P5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};
#else
// Portable baseline: compiler vector extensions, 4 floats (SSE2 / NEON registers).
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
struct Simd {
  static constexpr int W = 4;
  static constexpr int KB = 4;
  static constexpr int ACC = 12;
  static constexpr int RG = 2;
  using V = v4f;
  static V zero() { return V{0.0f, 0.0f, 0.0f, 0.0f}; }
  static V set1(float x) { return V{x, x, x, x}; }
  static V load(const float* p) {
    V v;
    memcpy(&v, p, sizeof(v));
    return v;
  }
  static V load(const F16* p) {
    return V{f16_to_f32(p[0].bits), f16_to_f32(p[1].bits), f16_to_f32(p[2].bits),
             f16_to_f32(p[3].bits)};
  }
  static V load(const BF16* p) {
    return V{bf16_to_f32(p[0].bits), bf16_to_f32(p[1].bits), bf16_to_f32(p[2].bits),
             bf16_to_f32(p[3].bits)};
  }
  static void store(float* p, V v) { memcpy(p, &v, sizeof(v)); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V max(V a, V b) {
    v4i gt = a > b;
    return (V)((gt & (v4i)a) | (~gt & (v4i)b));
  }
  static V min(V a, V b) {
    v4i lt = a < b;
    return (V)((lt & (v4i)a) | (~lt & (v4i)b));
  }
  static V div(V a, V b) { return a / b; }
  static float hsum(V v) { return (v[0] + v[1]) + (v[2] + v[3]); }
  static float hmax(V v) {
    float a = v[0] > v[1] ? v[0] : v[1];
    float b = v[2] > v[3] ? v[2] : v[3];
    return a > b ? a : b;
  }
  static void hsum_block(const V* a, float* out) {
    for (int i = 0; i < KB; ++i) out[i] = hsum(a[i]);
  }
  static V exp2(V x) {
    v4i keep = x >= set1(EXP_FLOOR);
    x = max(x, set1(EXP_FLOOR));
    V n = (x + set1(ROUND_MAGIC)) - set1(ROUND_MAGIC);
    V f = x - n;
    V p = set1(P0);
    p = p * f + set1(P1);
    p = p * f + set1(P2);
    p = p * f + set1(P3);
    p = p * f + set1(P4);
    p = p * f + set1(P5);
    p = p * f + set1(1.0f);
    v4i e = (__builtin_convertvector(n, v4i) + 127) << 23;
    return (V)(keep & (v4i)(p * (V)e));
  }
};
#endif

constexpr int W = Simd::W;
constexpr int KB = Simd::KB;
constexpr int TILE = SEGATTN_TILE;
using V = Simd::V;

static_assert(TILE % W == 0 && TILE % KB == 0, "tile must hold whole vectors and key blocks");

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}
inline int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t max64(int64_t a, int64_t b) {
  return a > b ? a : b;
}

// Scratch layout of one work item (see segattn_scratch_bytes in segattn_op.cpp, which
// must allocate at least this; both use the same formula through SEGATTN_TILE).
struct Scratch {
  float* qs;    // [RB, D]
  float* acc;   // [RB, D]
  float* s;     // [RB, TILE]
  float* m;     // [RB]
  float* l;     // [RB]
  int64_t* n;   // [RB] keys row i sees in the current piece: [lo[i], n[i])
  int64_t* lo;  // [RB] first of them (0 without a window)
  int* active;  // [RB] rows that see keys in the current tile
  char* ktile;  // [TILE, D] gathered K rows (only for a non-unit head_dim stride)
  char* vtile;  // [TILE, D]
  // Soft cap (gemma2), else cap_in == 0: the queries are scaled by `scale` only and each
  // score s becomes cap_out * tanh(s / softcap) = cap_out * (E - 1) / (E + 1) with
  // E = 2^(s * cap_in), cap_in = 2 log2(e) / softcap, cap_out = log2(e) * softcap: the
  // capped score in base 2, as the rest of the kernel expects.
  float cap_in;
  float cap_out;
};

inline char* align64(char* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

template <class T, int D>
Scratch carve(char* base, int rb) {
  Scratch sc;
  sc.cap_in = sc.cap_out = 0.0f;  // no soft cap unless run_item sets one
  char* p = align64(base);
  sc.qs = reinterpret_cast<float*>(p);
  p = align64(p + sizeof(float) * rb * D);
  sc.acc = reinterpret_cast<float*>(p);
  p = align64(p + sizeof(float) * rb * D);
  sc.s = reinterpret_cast<float*>(p);
  p = align64(p + sizeof(float) * rb * TILE);
  sc.m = reinterpret_cast<float*>(p);
  p = align64(p + sizeof(float) * rb);
  sc.l = reinterpret_cast<float*>(p);
  p = align64(p + sizeof(float) * rb);
  sc.n = reinterpret_cast<int64_t*>(p);
  p = align64(p + sizeof(int64_t) * rb);
  sc.lo = reinterpret_cast<int64_t*>(p);
  p = align64(p + sizeof(int64_t) * rb);
  sc.active = reinterpret_cast<int*>(p);
  p = align64(p + sizeof(int) * rb);
  sc.ktile = p;
  p = align64(p + sizeof(T) * TILE * D);
  sc.vtile = p;
  return sc;
}

// Scores of two query rows against n keys (rows kt + j * ks): s0[j], s1[j].
template <class T, int D>
void scores2(const float* q0, const float* q1, const T* kt, int64_t ks, int64_t n, float* s0,
             float* s1) {
  int64_t j = 0;
  for (; j + KB <= n; j += KB) {
    V a[2 * KB];
    for (int u = 0; u < 2 * KB; ++u) a[u] = Simd::zero();
    for (int c = 0; c < D; c += W) {
      V qa = Simd::load(q0 + c);
      V qb = Simd::load(q1 + c);
      for (int u = 0; u < KB; ++u) {
        V k = Simd::load(kt + (j + u) * ks + c);
        a[u] = Simd::fma(qa, k, a[u]);
        a[KB + u] = Simd::fma(qb, k, a[KB + u]);
      }
    }
    Simd::hsum_block(a, s0 + j);
    Simd::hsum_block(a + KB, s1 + j);
  }
  for (; j < n; ++j) {
    V a = Simd::zero(), b = Simd::zero();
    for (int c = 0; c < D; c += W) {
      V k = Simd::load(kt + j * ks + c);
      a = Simd::fma(Simd::load(q0 + c), k, a);
      b = Simd::fma(Simd::load(q1 + c), k, b);
    }
    s0[j] = Simd::hsum(a);
    s1[j] = Simd::hsum(b);
  }
}

template <class T, int D>
void scores1(const float* q0, const T* kt, int64_t ks, int64_t n, float* s0) {
  // Two accumulator sets (even / odd head_dim chunks): 2 * KB independent FMA chains.
  constexpr int C2 = (D / W) >= 2 ? 2 : 1;
  int64_t j = 0;
  for (; j + KB <= n; j += KB) {
    V a[C2][KB];
    for (int h = 0; h < C2; ++h)
      for (int u = 0; u < KB; ++u) a[h][u] = Simd::zero();
    for (int c = 0; c < D; c += C2 * W) {
      for (int h = 0; h < C2; ++h) {
        V qa = Simd::load(q0 + c + h * W);
        for (int u = 0; u < KB; ++u)
          a[h][u] = Simd::fma(qa, Simd::load(kt + (j + u) * ks + c + h * W), a[h][u]);
      }
    }
    if (C2 == 2)
      for (int u = 0; u < KB; ++u) a[0][u] = Simd::add(a[0][u], a[C2 - 1][u]);
    Simd::hsum_block(a[0], s0 + j);
  }
  for (; j < n; ++j) {
    V a = Simd::zero();
    for (int c = 0; c < D; c += W) a = Simd::fma(Simd::load(q0 + c), Simd::load(kt + j * ks + c), a);
    s0[j] = Simd::hsum(a);
  }
}

// Soft-capped scores (see Scratch::cap_in) over s[0, n) rounded up to whole vectors.
// E's exponent is clamped at 64 (tanh is 1 in float32 long before), below by exp2's floor
// (E = 0: tanh = -1).
inline void softcap_scores(float* s, int64_t n, float cap_in, float cap_out) {
  const V k = Simd::set1(cap_in), c = Simd::set1(cap_out), one = Simd::set1(1.0f);
  const V minus_one = Simd::set1(-1.0f), hi = Simd::set1(64.0f);
  for (int64_t j = 0; j < round_up(n, W); j += W) {
    V e = Simd::exp2(Simd::min(Simd::mul(Simd::load(s + j), k), hi));
    Simd::store(s + j, Simd::mul(c, Simd::div(Simd::add(e, minus_one), Simd::add(e, one))));
  }
}

// Online-softmax step of one row over its n scores: rescales acc by 2^(m - m'), overwrites
// s with p = 2^(s - m') and p = 0 from n up to n_group (the longest row of its group, so
// the group's V pass can run over n_group keys for every row), updates m and l.
template <int D>
void softmax_step(float* s, int64_t n, int64_t n_group, float* m, float* l, float* acc) {
  const float neg_inf = -__builtin_inff();
  int64_t padded = round_up(n_group, W);
  for (int64_t j = n; j < padded; ++j) s[j] = neg_inf;
  V vm = Simd::set1(neg_inf);
  for (int64_t j = 0; j < padded; j += W) vm = Simd::max(vm, Simd::load(s + j));
  float tile_max = Simd::hmax(vm);
  float m_old = *m;
  float m_new = m_old > tile_max ? m_old : tile_max;
  V neg_m = Simd::set1(-m_new);
  V vsum = Simd::zero();
  for (int64_t j = 0; j < padded; j += W) {
    V p = Simd::exp2(Simd::add(Simd::load(s + j), neg_m));
    Simd::store(s + j, p);
    vsum = Simd::add(vsum, p);
  }
  float tile_sum = Simd::hsum(vsum);
  if (m_new != m_old) {
    float alpha = m_old == neg_inf ? 0.0f : exp2f(m_old - m_new);
    *l = *l * alpha + tile_sum;
    V va = Simd::set1(alpha);
    for (int c = 0; c < D; c += W) Simd::store(acc + c, Simd::mul(Simd::load(acc + c), va));
    *m = m_new;
  } else {
    *l += tile_sum;
  }
}

constexpr int pow2_floor(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// acc[g] += sum_{j < n} p[g][j] v[j] for the NG rows of a group (rows vt + j * vs): each V
// vector is loaded once per group and feeds NG accumulators held in registers.
template <class T, int D, int NG>
void accumulate(float* const* p, float* const* acc, int64_t n, const T* vt, int64_t vs) {
  constexpr int NV = D / W;
  constexpr int VC = pow2_floor((Simd::ACC / NG) < NV ? (Simd::ACC / NG) : NV);
  for (int c0 = 0; c0 < NV; c0 += VC) {
    V a[NG][VC];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < VC; ++c) a[g][c] = Simd::load(acc[g] + (c0 + c) * W);
    for (int64_t j = 0; j < n; ++j) {
      V pb[NG];
      for (int g = 0; g < NG; ++g) pb[g] = Simd::set1(p[g][j]);
      const T* row = vt + j * vs + c0 * W;
      for (int c = 0; c < VC; ++c) {
        V v = Simd::load(row + c * W);
        for (int g = 0; g < NG; ++g) a[g][c] = Simd::fma(pb[g], v, a[g][c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < VC; ++c) Simd::store(acc[g] + (c0 + c) * W, a[g][c]);
  }
}

// One tile for a group of NG query rows (indices rows[]): scores over the group's longest
// visible run of keys, the softmax step per row, then one V pass for the group.
template <class T, int D, int NG>
void tile_group(const Scratch& sc, const int* rows, int64_t t0, int64_t tn, const T* kt,
                int64_t ks, const T* vt, int64_t vs) {
  int64_t n[NG];
  int64_t n_group = 0;
  float* s[NG];
  float* acc[NG];
  for (int g = 0; g < NG; ++g) {
    n[g] = min64(tn, sc.n[rows[g]] - t0);
    n_group = max64(n_group, n[g]);
    s[g] = sc.s + (int64_t)rows[g] * TILE;
    acc[g] = sc.acc + (int64_t)rows[g] * D;
  }
  int g = 0;
  for (; g + 2 <= NG; g += 2)
    scores2<T, D>(sc.qs + (int64_t)rows[g] * D, sc.qs + (int64_t)rows[g + 1] * D, kt, ks, n_group,
                  s[g], s[g + 1]);
  if (g < NG) scores1<T, D>(sc.qs + (int64_t)rows[g] * D, kt, ks, n_group, s[g]);
  if (sc.cap_in > 0.0f)
    for (g = 0; g < NG; ++g) softcap_scores(s[g], n_group, sc.cap_in, sc.cap_out);
  for (g = 0; g < NG; ++g) {
    // A sliding window's start inside this tile: the keys before it are not seen.
    for (int64_t j = 0, first = sc.lo[rows[g]] - t0; j < first && j < n[g]; ++j) s[g][j] = -__builtin_inff();
    softmax_step<D>(s[g], n[g], n_group, sc.m + rows[g], sc.l + rows[g], acc[g]);
  }
  accumulate<T, D, NG>(s, acc, n_group, vt, vs);
}

// Rows [t0, t0 + tn) of a piece as (pointer, row stride): in place when the head_dim
// stride is 1, else gathered into `tile` (rare: only a transposed view gets here).
template <class T, int D>
const T* tile_rows(const T* base, int64_t row_stride, int64_t d_stride, int64_t t0, int64_t tn,
                   char* tile, int64_t* stride_out) {
  if (d_stride == 1) {
    *stride_out = row_stride;
    return base + t0 * row_stride;
  }
  T* dst = reinterpret_cast<T*>(tile);
  for (int64_t t = 0; t < tn; ++t) {
    const T* src = base + (t0 + t) * row_stride;
    for (int d = 0; d < D; ++d) dst[t * D + d] = src[d * d_stride];
  }
  *stride_out = D;
  return dst;
}

// Final rows of one (batch, kv head, row block): out = acc / l, zeros where l == 0.
template <class TQ, int D>
void write_rows(const SegAttnArgs& a, int64_t b, int64_t h, int64_t r0, int nr, const float* l,
                const float* acc, int64_t acc_stride) {
  const int G = a.n_q_heads / a.n_kv_heads;
  const int L = a.n_queries;
  TQ* out = static_cast<TQ*>(a.out);
  for (int i = 0; i < nr; ++i) {
    int64_t r = r0 + i;
    int64_t hq = h * G + r / L, pos = r % L;
    TQ* orow = out + ((b * a.n_q_heads + hq) * L + pos) * D;
    float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // a row that saw nothing -> 0
    const float* ac = acc + i * acc_stride;
    for (int d = 0; d < D; ++d) from_f32(ac[d] * inv, orow + d);
  }
}

// Work item -> (batch, kv head, row block, key split).
struct Item {
  int64_t b, h, r0, split, base;
  int nr;
};

inline Item decode_item(const SegAttnArgs& a, int64_t item) {
  const int64_t R = (int64_t)(a.n_q_heads / a.n_kv_heads) * a.n_queries;
  const int64_t n_blocks = (R + a.row_block - 1) / a.row_block;
  Item it;
  it.split = item % a.n_splits;
  it.base = item / a.n_splits;
  const int64_t blk = it.base % n_blocks;
  it.h = (it.base / n_blocks) % a.n_kv_heads;
  it.b = it.base / (n_blocks * a.n_kv_heads);
  it.r0 = blk * a.row_block;
  it.nr = (int)min64(a.row_block, R - it.r0);
  return it;
}

// TQ: the type of q and out; T: the type of every K/V piece (float16/bfloat16 K/V under
// float32 queries is the CPU's half-size KV cache).
template <class TQ, class T, int D>
void run_item(const SegAttnArgs& a, int64_t item, char* scratch_base) {
  const int G = a.n_q_heads / a.n_kv_heads;
  const int L = a.n_queries;
  const Item it = decode_item(a, item);
  const int64_t b = it.b, h = it.h, r0 = it.r0;
  const int nr = it.nr;
  Scratch sc = carve<T, D>(scratch_base, a.row_block);

  // Queries, scaled into base 2, float32 (with a soft cap: scaled only; see Scratch).
  const float log2e = 1.4426950408889634f;
  const float qscale = a.softcap > 0.0f ? a.scale : a.scale * log2e;
  sc.cap_in = a.softcap > 0.0f ? 2.0f * log2e / a.softcap : 0.0f;
  sc.cap_out = log2e * a.softcap;
  const TQ* q = static_cast<const TQ*>(a.q);
  for (int i = 0; i < nr; ++i) {
    int64_t r = r0 + i;
    int64_t hq = h * G + r / L, pos = r % L;
    const TQ* qrow = q + b * a.q_stride[0] + hq * a.q_stride[1] + pos * a.q_stride[2];
    float* dst = sc.qs + (int64_t)i * D;
    for (int d = 0; d < D; ++d) dst[d] = to_f32(qrow[d * a.q_stride[3]]) * qscale;
    float* acc = sc.acc + (int64_t)i * D;
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    sc.m[i] = -__builtin_inff();
    sc.l[i] = 0.0f;
  }

  // This item's keys: [key_lo, key_hi) of all pieces concatenated (split-K for few items).
  const int64_t chunk = (a.total_keys + a.n_splits - 1) / a.n_splits;
  const int64_t key_lo = it.split * chunk;
  const int64_t key_hi = min64(a.total_keys, key_lo + chunk);
  int64_t offset = 0;
  for (int pi = 0; pi < a.n_pieces; ++pi) {
    const SegAttnPiece& pc = a.pieces[pi];
    const int64_t piece_start = offset;
    int64_t lo = max64(0, key_lo - offset);
    const int64_t hi = min64(pc.rows, key_hi - offset);
    offset += pc.rows;
    if (lo >= hi) continue;
    const bool causal = a.last_is_causal && pi == a.n_pieces - 1;
    int64_t longest = 0;
    int64_t start = hi;  // the earliest key of this piece some row sees
    for (int i = 0; i < nr; ++i) {
      int64_t n = pc.rows;
      if (causal) n = max64(0, min64(pc.rows, pc.rows - L + (r0 + i) % L + 1));
      sc.n[i] = min64(n, hi);
      // Window: this row's first visible key, as a row of this piece.
      const int64_t first = a.window > 0 ? a.total_keys - L + (r0 + i) % L - a.window + 1 - piece_start : 0;
      sc.lo[i] = max64(lo, first);
      if (sc.lo[i] >= sc.n[i]) {
        sc.n[i] = 0;  // nothing of this piece in its window (or its causal range)
      } else {
        start = min64(start, sc.lo[i]);
      }
      longest = max64(longest, sc.n[i]);
    }
    lo = start;  // tiles before it hold nothing any row sees
    const T* kbase = static_cast<const T*>(pc.k) + b * pc.k_stride[0] + h * pc.k_stride[1];
    const T* vbase = static_cast<const T*>(pc.v) + b * pc.v_stride[0] + h * pc.v_stride[1];
    for (int64_t t0 = lo; t0 < longest; t0 += TILE) {
      const int64_t tn = min64(TILE, longest - t0);
      int64_t ks, vs;
      const T* kt = tile_rows<T, D>(kbase, pc.k_stride[2], pc.k_stride[3], t0, tn, sc.ktile, &ks);
      const T* vt = tile_rows<T, D>(vbase, pc.v_stride[2], pc.v_stride[3], t0, tn, sc.vtile, &vs);
      // Rows that see keys in this tile, in groups of up to RG (one V pass per group).
      int nact = 0;
      for (int i = 0; i < nr; ++i)
        if (sc.n[i] > t0 && sc.lo[i] < t0 + tn) sc.active[nact++] = i;
      for (int k = 0; k < nact; k += Simd::RG) {
        const int* rows = sc.active + k;
        switch (nact - k >= Simd::RG ? Simd::RG : nact - k) {
          case 1:
            tile_group<T, D, 1>(sc, rows, t0, tn, kt, ks, vt, vs);
            break;
          case 2:
            tile_group<T, D, 2>(sc, rows, t0, tn, kt, ks, vt, vs);
            break;
          case 3:
            if constexpr (Simd::RG >= 3) tile_group<T, D, 3>(sc, rows, t0, tn, kt, ks, vt, vs);
            break;
          case 4:
            if constexpr (Simd::RG >= 4) tile_group<T, D, 4>(sc, rows, t0, tn, kt, ks, vt, vs);
            break;
          default:
            break;
        }
      }
    }
  }

  if (a.n_splits == 1) {
    write_rows<TQ, D>(a, b, h, r0, nr, sc.l, sc.acc, D);
    return;
  }
  // Partial (m, l, acc) per row for segattn_merge: [item][row_block][2 + D].
  float* part = a.partial + item * (int64_t)a.row_block * (2 + D);
  for (int i = 0; i < nr; ++i) {
    float* dst = part + (int64_t)i * (2 + D);
    dst[0] = sc.m[i];
    dst[1] = sc.l[i];
    memcpy(dst + 2, sc.acc + (int64_t)i * D, sizeof(float) * D);
  }
}

// Merges the key splits of base items [first, last) by their (m, l) and writes out.
template <class TQ, class T, int D>
void merge_items(const SegAttnArgs& a, int64_t first, int64_t last, char* scratch_base) {
  Scratch sc = carve<T, D>(scratch_base, a.row_block);
  const int64_t row_floats = 2 + D;
  const int64_t item_floats = (int64_t)a.row_block * row_floats;
  for (int64_t base = first; base < last; ++base) {
    const Item it = decode_item(a, base * a.n_splits);
    const float* parts = a.partial + base * a.n_splits * item_floats;
    for (int i = 0; i < it.nr; ++i) {
      float top = -__builtin_inff();
      for (int s = 0; s < a.n_splits; ++s) {
        float m = parts[s * item_floats + i * row_floats];
        top = m > top ? m : top;
      }
      float l = 0.0f;
      float* acc = sc.acc + (int64_t)i * D;
      for (int d = 0; d < D; ++d) acc[d] = 0.0f;
      for (int s = 0; s < a.n_splits; ++s) {
        const float* p = parts + s * item_floats + i * row_floats;
        if (p[0] == -__builtin_inff()) continue;  // this split saw no key of this row
        const float w = exp2f(p[0] - top);
        l += w * p[1];
        for (int d = 0; d < D; ++d) acc[d] += w * p[2 + d];
      }
      sc.l[i] = l;
    }
    write_rows<TQ, D>(a, it.b, it.h, it.r0, it.nr, sc.l, sc.acc, D);
  }
}

template <class TQ, class T, int D>
void run_items(const SegAttnArgs& a, int64_t first, int64_t last, char* scratch, int merge) {
  if (merge) return merge_items<TQ, T, D>(a, first, last, scratch);
  for (int64_t item = first; item < last; ++item) run_item<TQ, T, D>(a, item, scratch);
}

template <class TQ, class T>
void run_dtype(const SegAttnArgs& a, int64_t first, int64_t last, char* scratch, int merge) {
  switch (a.head_dim) {
    case 64:
      return run_items<TQ, T, 64>(a, first, last, scratch, merge);
    case 128:
      return run_items<TQ, T, 128>(a, first, last, scratch, merge);
    case 256:
      return run_items<TQ, T, 256>(a, first, last, scratch, merge);
    default:
      return;  // segattn_op.cpp only sends the head dims above
  }
}

// Half-size K/V (T) under queries of T itself or of float32, the CPU's float16 cache.
template <class T>
void run_half(const SegAttnArgs& a, int64_t first, int64_t last, char* scratch, int merge) {
  if (a.dtype == SEGATTN_F32) return run_dtype<float, T>(a, first, last, scratch, merge);
  return run_dtype<T, T>(a, first, last, scratch, merge);
}

void run_entry(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch, int merge) {
  char* s = static_cast<char*>(scratch);
  // segattn_op.cpp sends queries of the K/V's type, or float32 over float16/bfloat16 K/V.
  switch (args->kv_dtype) {
    case SEGATTN_F32:
      return run_dtype<float, float>(*args, first, last, s, merge);
    case SEGATTN_F16:
      return run_half<F16>(*args, first, last, s, merge);
    case SEGATTN_BF16:
      return run_half<BF16>(*args, first, last, s, merge);
    default:
      return;
  }
}

}  // namespace

extern "C" void SEGATTN_ENTRY(const SegAttnArgs* args, int64_t first, int64_t last,
                              void* scratch) {
  run_entry(args, first, last, scratch, 0);
}

extern "C" void SEGATTN_MERGE_ENTRY(const SegAttnArgs* args, int64_t first, int64_t last,
                                    void* scratch) {
  run_entry(args, first, last, scratch, 1);
}
