"""CUDA source of the fused segmented-attention kernel (`kernels.fused_cuda`).

Owns: the kernel text (`kernel_source`, `HEADER`, `BODY_REDUCE`) and the unrolled piece
walk generated per slot count. Kept apart from the launcher so both stay readable; the
launch planning, availability checks and the route object live in `kernels.fused_cuda`.
"""

from __future__ import annotations

from typing import Literal

MergeMode = Literal["in_kernel", "two_pass"]
MAX_PIECES = 17  # 16 segments + the tail in one launch

# ---------------------------------------------------------------------------------------
# CUDA source. Raw 16-bit values move through shared memory as unsigned short; T only
# decides the mma flavour and how P is rounded.
# ---------------------------------------------------------------------------------------
_HEADER = r"""
namespace segattn {

template <typename T> struct Ops;

template <> struct Ops<__nv_bfloat16> {
  static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
    return *reinterpret_cast<unsigned int*>(&v);
  }
  static __device__ __forceinline__ void mma(float* c, const unsigned int* a,
                                             const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <> struct Ops<__half> {
  static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
  }
  static __device__ __forceinline__ void mma(float* c, const unsigned int* a,
                                             const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ void cp16(void* smem, const void* gmem, bool valid) {
  // src-size 0 zero-fills: rows past the piece end become finite zeros (0 * garbage
  // could be NaN in the P.V product otherwise).
  unsigned int s;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n"
               : "=r"(s) : "l"(smem));
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Two consecutive 16-bit values of a row (element stride sd) as one mma register.
__device__ __forceinline__ unsigned int ld2(const unsigned short* base, long long off,
                                            int col, long long sd) {
  if (off < 0) return 0u;
  return static_cast<unsigned int>(base[off + col * sd]) |
         (static_cast<unsigned int>(base[off + (col + 1) * sd]) << 16);
}

// One K/V tile: rows [row0, row0 + min(n, TK)) of a piece into shared memory [TK][DP].
template <int D, int TK, int DP>
__device__ __forceinline__ void load_tile(unsigned short* sk, unsigned short* sv,
                                          const unsigned short* kb, const unsigned short* vb,
                                          long long krs, long long kds, long long vrs,
                                          long long vds, int row0, int n, bool vec, int tid,
                                          int nthr) {
  constexpr int CPR = D / 8;  // 16-byte pieces per row
  for (int i = tid; i < TK * CPR; i += nthr) {
    const int rr = i / CPR, cc = (i - rr * CPR) * 8;
    const bool ok = rr < n;
    const long long row = static_cast<long long>(row0 + (ok ? rr : 0));
    unsigned short* dk = sk + rr * DP + cc;
    unsigned short* dv = sv + rr * DP + cc;
    if (vec) {
      cp16(dk, kb + row * krs + cc, ok);
      cp16(dv, vb + row * vrs + cc, ok);
    } else {  // strided or unaligned piece: plain loads (slow path, still correct)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dk[e] = ok ? kb[row * krs + (cc + e) * kds] : static_cast<unsigned short>(0);
        dv[e] = ok ? vb[row * vrs + (cc + e) * vds] : static_cast<unsigned short>(0);
      }
    }
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// 2^x by the SFU alone (exp2f adds range fix-ups around it); ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory address of a generic pointer into shared memory (for ldmatrix).
__device__ __forceinline__ unsigned int smem_u32(const void* p) {
  unsigned int s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(s) : "l"(p));
  return s;
}
// Four 8x8 16-bit matrices; lane l gives the address of row l % 8 of matrix l / 8, and
// receives (row l / 4, cols 2 (l % 4) .. + 1) of each: the mma B fragment of K rows.
__device__ __forceinline__ void ldsm4(unsigned int* r, unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Same, transposed: lane l receives (rows 2 (l % 4) .. + 1, col l / 4), the B fragment of
// V rows (keys) for the P.V product.
__device__ __forceinline__ void ldsm4t(unsigned int* r, unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Wide (prefill) step: one warp, its 16 query rows against KN keys [j0, j0 + KN) of a
// shared tile (K, V: [TK][DP]). Scores for all KN keys first (K fragments by ldmatrix),
// then one online-softmax update and one rescale of O per KN keys, then P.V (V fragments
// by ldmatrix.trans). Against the narrow path (16 keys per update, scalar V loads) this
// issues about a third of the instructions per key. `mask`: some key of the step is past
// the chunk end or past a row's causal limit (warp-uniform; else no per-element test).
// Keys jb + j (j < KN) are valid iff jb + j < jend and jb + j <= lim of the row.
template <typename T, int D, int DP, int KN>
__device__ __forceinline__ void wide_step(const unsigned short* tK, const unsigned short* tV,
                                          int j0, const unsigned int (&qa)[D / 16][4],
                                          float (&o)[D / 8][4], float& m0, float& m1,
                                          float& l0, float& l1, float sl2, bool mask, int jb,
                                          int jend, int lim0, int lim1, int lane) {
  constexpr int KK = D / 16, ND = D / 8, NT = KN / 8;
  const int tig = lane & 3, mi = lane >> 3, mr = lane & 7;
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  // K: matrices (keys +0..7, dims +0..7), (+0..7, +8..15), (+8..15, +0..7), (+8..15, +8..15).
  const unsigned int ka = smem_u32(tK + (j0 + (mi >> 1) * 8 + mr) * DP + (mi & 1) * 8);
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned int b[4];
      ldsm4(b, ka + (np * 16 * DP + kk * 16) * 2);
      Ops<T>::mma(s[2 * np], qa[kk], b);
      Ops<T>::mma(s[2 * np + 1], qa[kk], b + 2);
    }
  }
  // s[nt][e]: row (e < 2 ? r0 : r1), key jb + nt * 8 + 2 tig + (e & 1); raw (unscaled).
  if (mask) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = jb + nt * 8 + tig * 2 + (e & 1);
        if (!(j < jend && j <= (e < 2 ? lim0 : lim1))) s[nt][e] = neg_inf();
      }
    }
  }
  float x0 = neg_inf(), x1 = neg_inf();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    x0 = fmaxf(x0, fmaxf(s[nt][0], s[nt][1]));
    x1 = fmaxf(x1, fmaxf(s[nt][2], s[nt][3]));
  }
  x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
  x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
  x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
  x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
  // Base-2 units (sl2 > 0 keeps the max); a row with nothing visible yet keeps -inf and
  // uses 0 as its reference (no NaN).
  const float n0 = fmaxf(m0, x0 * sl2), n1 = fmaxf(m1, x1 * sl2);
  const float ref0 = (n0 == neg_inf()) ? 0.f : n0;
  const float ref1 = (n1 == neg_inf()) ? 0.f : n1;
  const float cr0 = fast_exp2(m0 - ref0), cr1 = fast_exp2(m1 - ref1);
  m0 = n0;
  m1 = n1;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] = fast_exp2(fmaf(s[nt][0], sl2, -ref0));
    s[nt][1] = fast_exp2(fmaf(s[nt][1], sl2, -ref0));
    s[nt][2] = fast_exp2(fmaf(s[nt][2], sl2, -ref1));
    s[nt][3] = fast_exp2(fmaf(s[nt][3], sl2, -ref1));
    sum0 += s[nt][0] + s[nt][1];
    sum1 += s[nt][2] + s[nt][3];
  }
  l0 = l0 * cr0 + sum0;
  l1 = l1 * cr1 + sum1;
#pragma unroll
  for (int nd = 0; nd < ND; ++nd) {
    o[nd][0] *= cr0;
    o[nd][1] *= cr0;
    o[nd][2] *= cr1;
    o[nd][3] *= cr1;
  }
  // V: matrices (keys +0..7, dims +0..7), (+8..15, +0..7), (+0..7, +8..15), (+8..15, +8..15),
  // transposed: b[0..1] serve dim tile 2 dp, b[2..3] dim tile 2 dp + 1.
  const unsigned int va = smem_u32(tV + (j0 + (mi & 1) * 8 + mr) * DP + (mi >> 1) * 8);
#pragma unroll
  for (int kt = 0; kt < NT / 2; ++kt) {
    // The S accumulator layout is the A layout of P: no shuffle.
    unsigned int pa[4];
    pa[0] = Ops<T>::pack(s[2 * kt][0], s[2 * kt][1]);
    pa[1] = Ops<T>::pack(s[2 * kt][2], s[2 * kt][3]);
    pa[2] = Ops<T>::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
    pa[3] = Ops<T>::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
    for (int dp = 0; dp < ND / 2; ++dp) {
      unsigned int b[4];
      ldsm4t(b, va + (kt * 16 * DP + dp * 16) * 2);
      Ops<T>::mma(o[2 * dp], pa, b);
      Ops<T>::mma(o[2 * dp + 1], pa, b + 2);
    }
  }
}

// Paired wide step (prefill, two query windows per block): one warp, two m-tiles of 16
// query rows (tQ: the first's rows in shared memory [16][DP], the second's 64 rows below)
// against KN keys [j0, j0 + KN) of a shared tile. Each K and V fragment loaded by ldmatrix
// feeds both m-tiles' mma, halving shared-memory reads per mma against `wide_step`; Q's A
// fragments come from shared memory too (registers hold O and S of both m-tiles).
// lim[t][i]: causal limit of row g + 8 i of m-tile t; other arguments as in `wide_step`.
template <typename T, int D, int DP, int KN>
__device__ __forceinline__ void wide2_step(const unsigned short* tQ, const unsigned short* tK,
                                           const unsigned short* tV, int j0,
                                           float (&o)[2][D / 8][4], float (&m)[2][2],
                                           float (&l)[2][2], float sl2, bool mask, int jb,
                                           int jend, const int (&lim)[2][2], int lane) {
  constexpr int KK = D / 16, ND = D / 8, NT = KN / 8;
  const int tig = lane & 3, mi = lane >> 3, mr = lane & 7;
  float s[2][NT][4];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[t][nt][0] = s[t][nt][1] = s[t][nt][2] = s[t][nt][3] = 0.f;
  // Q (A fragments): lane l gives row l % 16, cols 8 (l / 16) of the 16 x 16 block.
  const unsigned int qa = smem_u32(tQ + (lane & 15) * DP + (lane >> 4) * 8);
  const unsigned int ka = smem_u32(tK + (j0 + (mi >> 1) * 8 + mr) * DP + (mi & 1) * 8);
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
    unsigned int a0[4], a1[4];
    ldsm4(a0, qa + kk * 32);
    ldsm4(a1, qa + (64 * DP + kk * 16) * 2);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned int b[4];
      ldsm4(b, ka + (np * 16 * DP + kk * 16) * 2);
      Ops<T>::mma(s[0][2 * np], a0, b);
      Ops<T>::mma(s[0][2 * np + 1], a0, b + 2);
      Ops<T>::mma(s[1][2 * np], a1, b);
      Ops<T>::mma(s[1][2 * np + 1], a1, b + 2);
    }
  }
  if (mask) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = jb + nt * 8 + tig * 2 + (e & 1);
          if (!(j < jend && j <= lim[t][e >> 1])) s[t][nt][e] = neg_inf();
        }
  }
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    float x0 = neg_inf(), x1 = neg_inf();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      x0 = fmaxf(x0, fmaxf(s[t][nt][0], s[t][nt][1]));
      x1 = fmaxf(x1, fmaxf(s[t][nt][2], s[t][nt][3]));
    }
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
    const float n0 = fmaxf(m[t][0], x0 * sl2), n1 = fmaxf(m[t][1], x1 * sl2);
    const float ref0 = (n0 == neg_inf()) ? 0.f : n0;
    const float ref1 = (n1 == neg_inf()) ? 0.f : n1;
    const float cr0 = fast_exp2(m[t][0] - ref0), cr1 = fast_exp2(m[t][1] - ref1);
    m[t][0] = n0;
    m[t][1] = n1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[t][nt][0] = fast_exp2(fmaf(s[t][nt][0], sl2, -ref0));
      s[t][nt][1] = fast_exp2(fmaf(s[t][nt][1], sl2, -ref0));
      s[t][nt][2] = fast_exp2(fmaf(s[t][nt][2], sl2, -ref1));
      s[t][nt][3] = fast_exp2(fmaf(s[t][nt][3], sl2, -ref1));
      sum0 += s[t][nt][0] + s[t][nt][1];
      sum1 += s[t][nt][2] + s[t][nt][3];
    }
    l[t][0] = l[t][0] * cr0 + sum0;
    l[t][1] = l[t][1] * cr1 + sum1;
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      o[t][nd][0] *= cr0;
      o[t][nd][1] *= cr0;
      o[t][nd][2] *= cr1;
      o[t][nd][3] *= cr1;
    }
  }
  const unsigned int va = smem_u32(tV + (j0 + (mi & 1) * 8 + mr) * DP + (mi >> 1) * 8);
#pragma unroll
  for (int kt = 0; kt < NT / 2; ++kt) {
    unsigned int pa[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      pa[t][0] = Ops<T>::pack(s[t][2 * kt][0], s[t][2 * kt][1]);
      pa[t][1] = Ops<T>::pack(s[t][2 * kt][2], s[t][2 * kt][3]);
      pa[t][2] = Ops<T>::pack(s[t][2 * kt + 1][0], s[t][2 * kt + 1][1]);
      pa[t][3] = Ops<T>::pack(s[t][2 * kt + 1][2], s[t][2 * kt + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < ND / 2; ++dp) {
      unsigned int b[4];
      ldsm4t(b, va + (kt * 16 * DP + dp * 16) * 2);
      Ops<T>::mma(o[0][2 * dp], pa[0], b);
      Ops<T>::mma(o[0][2 * dp + 1], pa[0], b + 2);
      Ops<T>::mma(o[1][2 * dp], pa[1], b);
      Ops<T>::mma(o[1][2 * dp + 1], pa[1], b + 2);
    }
  }
}

// LSE merge of `ns` partial slots of one group: acc [ns][R][D] and (m, l) [ns][R][2],
// m in base-2 units, over float4 items [i0, i1) of the R*D/4. FINAL writes out (normalised)
// and lse; otherwise one merged partial slot (dstO [R][D], dstML [R][2]) in the same form.
// sw: shared scratch of ns*R + 2R floats. __ldcg: other blocks wrote src (skip L1).
template <typename OT, int D, bool FINAL>
__device__ __noinline__ void merge_slots(const float* srcO, const float* srcML, int ns, int R, float* sw,
                            int i0, int i1, int tid, int nthr, OT* out, float* lse,
                            bool write_lse, int Lq, int Lw, int w0, int G, int h, int b, int Hq,
                            float* dstO, float* dstML) {
  // Packed row r: query head h*G + r / Lw at position w0 + r % Lw (of Lq); rows past Lq
  // (the last window's padding) are merged but never written.
  const int warp = tid >> 5, lane = tid & 31, nwarps = nthr >> 5;
  float* sl = sw + ns * R;  // [R] sum of weights x l
  for (int r = warp; r < R; r += nwarps) {
    float M = neg_inf();
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, __ldcg(srcML + (s * R + r) * 2));
    M = warp_max(M);
    const float ref = (M == neg_inf()) ? 0.f : M;
    float Ls = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float f = exp2f(__ldcg(srcML + (s * R + r) * 2) - ref);
      sw[s * R + r] = f;
      Ls += __ldcg(srcML + (s * R + r) * 2 + 1) * f;
    }
    Ls = warp_sum(Ls);
    if (lane == 0) {
      sl[r] = Ls;
      if (FINAL) {
        const int pos = w0 + r % Lw;
        if (write_lse && pos < Lq) {
          const size_t orow = (static_cast<size_t>(b) * Hq + h * G + r / Lw) * Lq + pos;
          lse[orow] = Ls > 0.f ? (ref + log2f(Ls)) * 0.6931471805599453f : neg_inf();
        }
      } else {
        dstML[r * 2] = M;
        dstML[r * 2 + 1] = Ls;
      }
    }
  }
  __syncthreads();
  constexpr int D4 = D / 4;
  const float4* src4 = reinterpret_cast<const float4*>(srcO);
  for (int i = i0 + tid; i < i1; i += nthr) {
    const int r = i / D4, d4 = i - r * D4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < ns; ++s) {  // independent loads: many in flight per thread
      const float w = sw[s * R + r];
      const float4 x = __ldcg(src4 + (static_cast<size_t>(s) * R + r) * D4 + d4);
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    if (FINAL) {
      const int pos = w0 + r % Lw;
      if (pos >= Lq) continue;
      const float inv = sl[r] > 0.f ? 1.f / sl[r] : 0.f;  // a row that saw no key -> zeros
      const size_t orow = (static_cast<size_t>(b) * Hq + h * G + r / Lw) * Lq + pos;
      OT* o = out + orow * D + d4 * 4;
      o[0] = static_cast<OT>(acc.x * inv);
      o[1] = static_cast<OT>(acc.y * inv);
      o[2] = static_cast<OT>(acc.z * inv);
      o[3] = static_cast<OT>(acc.w * inv);
    } else {
      reinterpret_cast<float4*>(dstO)[r * D4 + d4] = acc;
    }
  }
}

}  // namespace segattn
"""

# Kernel body; @PICK@ and @SELECT@ are generated per piece count, @MERGE@ per merge mode.
_BODY = r"""
  using Ops = segattn::Ops<T>;
  constexpr int TK = 64, DP = D + 8, KK = D / 16, ND = D / 8, NTHR = 128;
  extern __shared__ float4 seg_smem4[];
  unsigned short* sK = reinterpret_cast<unsigned short*>(seg_smem4);  // [NST][TK][DP]
  unsigned short* sV = sK + NST * TK * DP;                             // [NST][TK][DP]
  unsigned short* sQ = sV + NST * TK * DP;  // PAIRED only: [128][DP] packed query rows
  __shared__ int s_last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int c = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
  const int Hq = q_shape[1], Lq = q_shape[2], Hkv = k0_shape[1];
  // Query windows: positions [w0, w0 + Lw) of Lq per group; grid z = batch x window, or
  // with WIDE >= 2 (PAIRED wide path) batch x pair of windows: the block serves windows
  // wz and wz + 1 (when it exists: hasB), i.e. groups grp and grp + Hkv.
  const int Lw = cfg_shape[3], NW = (Lq + Lw - 1) / Lw;
  constexpr bool PAIRED = WIDE >= 2;
  constexpr int NPW = PAIRED ? 2 : 1;
  const int NZ = (NW + NPW - 1) / NPW;
  const int b = z / NZ, wz = (z - b * NZ) * NPW, w0 = wz * Lw;
  const bool hasB = NPW == 2 && wz + 1 < NW;
  const int G = Hq / Hkv, R = G * Lw;          // packed query rows, R <= 64
  // m-tiles (16 rows) per block; WIDE (prefill) gives each warp its own m-tile, padding
  // rows past R are zero queries whose output is never written.
  const int QW = WIDE ? 4 : min((R + 15) / 16, 4);
  const int KS = 4 / QW;                       // warps sharing one m-tile split the KV rows
  const int mt = warp % QW, ks = warp / QW;
  const bool active = ks < KS;
  const int nlive = cfg_shape[0];
  const int CH = cfg_shape[1] * TK;            // rows per chunk
  const int SS = cfg_shape[2];                 // chunks per first-level merge ("super")
  const int grp = (b * NW + wz) * Hkv + h;
  // Groups (batch x window x KV head); from gridDim (the other forms cost registers).
  const int NG = NPW == 1 ? gridDim.y * gridDim.z : gridDim.y * (gridDim.z / NZ) * NW;

  // Which piece and which rows this block reads; NC = chunks per group.
  int piece = -1, cstart = 0, prow = 0, NC = 0;
@PICK@
  const unsigned short* kb = nullptr;
  const unsigned short* vb = nullptr;
  long long krs = 0, kds = 1, vrs = 0, vds = 1;
@SELECT@
  const int nrows = min(CH, prow - cstart);
  const int ntiles = (nrows + TK - 1) / TK;
  const bool vec = kds == 1 && vds == 1 && (krs & 7) == 0 && (vrs & 7) == 0 &&
                   ((reinterpret_cast<unsigned long long>(kb) |
                     reinterpret_cast<unsigned long long>(vb)) & 15ull) == 0;

  // Q as mma A fragments (rows r0 = mt*16 + g and r0 + 8), kept in registers.
  unsigned int qa[KK][4];
  const int r0 = mt * 16 + g, r1 = r0 + 8;
  if (PAIRED) {
    // Both windows' packed rows into sQ (row 64 wi + r: window wz + wi, packed row r);
    // padding rows (r >= R, past Lq, or no second window) are zeros.
    // Unrolled (all loads in flight); 16 bytes at a time where rows are aligned.
    const unsigned short* qb = reinterpret_cast<const unsigned short*>(q);
    const long long qd = q_strides[3];
    const bool qvec = qd == 1 && ((q_strides[0] | q_strides[1] | q_strides[2]) & 7) == 0 &&
                      (reinterpret_cast<unsigned long long>(qb) & 15ull) == 0;
    constexpr int QV = D / 8;  // 16-byte pieces per row
#pragma unroll
    for (int k = 0; k < 128 * QV / NTHR; ++k) {
      const int i = tid + k * NTHR;
      const int rr = i / QV, col = (i - rr * QV) * 8;
      const int wi = rr >> 6, r = rr & 63, p = w0 + wi * Lw + r % Lw;
      const long long off = (r < R && (wi == 0 || hasB) && p < Lq)
                                ? b * q_strides[0] + (h * G + r / Lw) * q_strides[1] +
                                      p * q_strides[2]
                                : -1;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (qvec) {
        if (off >= 0) v = *reinterpret_cast<const uint4*>(qb + off + col);
      } else {
        v.x = segattn::ld2(qb, off, col, qd);
        v.y = segattn::ld2(qb, off, col + 2, qd);
        v.z = segattn::ld2(qb, off, col + 4, qd);
        v.w = segattn::ld2(qb, off, col + 6, qd);
      }
      *reinterpret_cast<uint4*>(sQ + rr * DP + col) = v;
    }
  } else {
    const unsigned short* qb = reinterpret_cast<const unsigned short*>(q);
    const int p0 = w0 + r0 % Lw, p1 = w0 + r1 % Lw;  // positions; >= Lq: padding (zeros)
    const long long q0 = (r0 < R && p0 < Lq) ? b * q_strides[0] + (h * G + r0 / Lw) * q_strides[1] +
                                        p0 * q_strides[2] : -1;
    const long long q1 = (r1 < R && p1 < Lq) ? b * q_strides[0] + (h * G + r1 / Lw) * q_strides[1] +
                                        p1 * q_strides[2] : -1;
    const long long qd = q_strides[3];
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      const int col = kk * 16 + tig * 2;
      qa[kk][0] = segattn::ld2(qb, q0, col, qd);
      qa[kk][1] = segattn::ld2(qb, q1, col, qd);
      qa[kk][2] = segattn::ld2(qb, q0, col + 8, qd);
      qa[kk][3] = segattn::ld2(qb, q1, col + 8, qd);
    }
  }
  // Causal tail: query position i sees tail rows j <= T - L + i.
  const bool masked = CAUSAL && piece == nlive - 1;
  const int lim0 = masked ? prow - Lq + w0 + (r0 % Lw) : 0x7fffffff;
  const int lim1 = masked ? prow - Lq + w0 + (r1 % Lw) : 0x7fffffff;
  // PAIRED: the warp's second m-tile holds the same packed rows of window wz + 1.
  const int lim2[2][2] = {{lim0, lim1},
                          {masked ? lim0 + Lw : 0x7fffffff, masked ? lim1 + Lw : 0x7fffffff}};

  // WIDE: the warp's lowest and highest causal limit decide, per KN keys, whether any key
  // needs masking and whether all of them are hidden (then the step is skipped).
  int wlo = min(lim0, lim1), whi = max(lim0, lim1);
  if (PAIRED) whi = max(lim2[1][0], lim2[1][1]);  // window wz + 1: Lw positions later
  if (WIDE) {
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
      wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, sh));
      whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, sh));
    }
  }
  constexpr int KN = 64;  // keys per online-softmax update on the WIDE path
  // The same on the paired path: WIDE == 2 takes 64 keys per update, WIDE == 3 takes 32.
  constexpr int KN2 = WIDE == 3 ? 32 : 64;

  const float sl2 = __int_as_float(SCALE_BITS) * 1.4426950408889634f;  // scores in base 2
  float o[ND][4];
#pragma unroll
  for (int nd = 0; nd < ND; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m0 = segattn::neg_inf(), m1 = segattn::neg_inf(), l0 = 0.f, l1 = 0.f;
  float o2[2][ND][4], m2[2][2], l2[2][2];  // PAIRED: both m-tiles
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) o2[t][nd][0] = o2[t][nd][1] = o2[t][nd][2] = o2[t][nd][3] = 0.f;
    m2[t][0] = m2[t][1] = segattn::neg_inf();
    l2[t][0] = l2[t][1] = 0.f;
  }

  // NST-stage cp.async pipeline: tiles t+1 .. t+NST-1 load while tile t is used. One
  // commit group per tile slot (empty past the end) keeps wait_group<NST-1> exact.
#pragma unroll
  for (int st = 0; st < NST - 1; ++st) {
    if (st < ntiles)
      segattn::load_tile<D, TK, DP>(sK + st * TK * DP, sV + st * TK * DP, kb, vb, krs, kds,
                                    vrs, vds, cstart + st * TK, nrows - st * TK, vec, tid,
                                    NTHR);
    segattn::cp_commit();
  }
  for (int t = 0; t < ntiles; ++t) {
    const int cur = t % NST;
    const int tn = t + NST - 1;  // its buffer was last read in iteration t - 1
    if (tn < ntiles)
      segattn::load_tile<D, TK, DP>(sK + (tn % NST) * TK * DP, sV + (tn % NST) * TK * DP, kb,
                                    vb, krs, kds, vrs, vds, cstart + tn * TK,
                                    nrows - tn * TK, vec, tid, NTHR);
    segattn::cp_commit();
    segattn::cp_wait<NST - 1>();
    __syncthreads();
    if (PAIRED) {
      const unsigned short* tK = sK + cur * TK * DP;
      const unsigned short* tV = sV + cur * TK * DP;
      const int jend = cstart + nrows;
#pragma unroll
      for (int hs = 0; hs < TK / KN2; ++hs) {
        const int jb = cstart + t * TK + hs * KN2;
        if (jb >= jend || jb > whi) break;
        const bool mk = jb + KN2 > jend || jb + KN2 - 1 > wlo;
        segattn::wide2_step<T, D, DP, KN2>(sQ + warp * 16 * DP, tK, tV, hs * KN2, o2, m2, l2,
                                           sl2, mk, jb, jend, lim2, lane);
      }
    } else if (WIDE) {
      const unsigned short* tK = sK + cur * TK * DP;
      const unsigned short* tV = sV + cur * TK * DP;
      const int jend = cstart + nrows;  // piece rows [cstart, jend) belong to this chunk
#pragma unroll
      for (int hs = 0; hs < TK / KN; ++hs) {
        const int jb = cstart + t * TK + hs * KN;  // piece row of the step's first key
        if (jb >= jend || jb > whi) break;         // warp-uniform: nothing visible
        const bool mk = jb + KN > jend || jb + KN - 1 > wlo;
        segattn::wide_step<T, D, DP, KN>(tK, tV, hs * KN, qa, o, m0, m1, l0, l1, sl2, mk, jb,
                                         jend, lim0, lim1, lane);
      }
    } else if (active) {
      const unsigned short* tK = sK + cur * TK * DP;
      const unsigned short* tV = sV + cur * TK * DP;
      for (int st = ks; st < TK / 16; st += KS) {  // 16-row sub-tiles of this warp
        const int j0 = st * 16;
        if (t * TK + j0 >= nrows) break;
        float s[2][4];
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) s[nh][0] = s[nh][1] = s[nh][2] = s[nh][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
          for (int nh = 0; nh < 2; ++nh) {
            const unsigned short* kr = tK + (j0 + nh * 8 + g) * DP + kk * 16 + tig * 2;
            unsigned int bf[2];
            bf[0] = *reinterpret_cast<const unsigned int*>(kr);
            bf[1] = *reinterpret_cast<const unsigned int*>(kr + 8);
            Ops::mma(s[nh], qa[kk], bf);
          }
        }
        // s[nh][e]: row (e < 2 ? r0 : r1), key j0 + nh*8 + tig*2 + (e & 1) of the tile.
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jt = t * TK + j0 + nh * 8 + tig * 2 + (e & 1);  // row in chunk
            const bool ok = jt < nrows && cstart + jt <= (e < 2 ? lim0 : lim1);
            s[nh][e] = ok ? s[nh][e] * sl2 : segattn::neg_inf();
          }
        }
        float x0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        float x1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
        const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
        // A row with nothing visible yet keeps max -inf: use 0 as reference (no NaN).
        const float ref0 = (n0 == segattn::neg_inf()) ? 0.f : n0;
        const float ref1 = (n1 == segattn::neg_inf()) ? 0.f : n1;
        const float cr0 = exp2f(m0 - ref0), cr1 = exp2f(m1 - ref1);
        m0 = n0;
        m1 = n1;
#pragma unroll
        for (int nh = 0; nh < 2; ++nh) {
          s[nh][0] = exp2f(s[nh][0] - ref0);
          s[nh][1] = exp2f(s[nh][1] - ref0);
          s[nh][2] = exp2f(s[nh][2] - ref1);
          s[nh][3] = exp2f(s[nh][3] - ref1);
        }
        l0 = l0 * cr0 + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
        l1 = l1 * cr1 + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
        // The S accumulator layout is the A layout of P: P.V needs no shuffle.
        unsigned int pa[4];
        pa[0] = Ops::pack(s[0][0], s[0][1]);
        pa[1] = Ops::pack(s[0][2], s[0][3]);
        pa[2] = Ops::pack(s[1][0], s[1][1]);
        pa[3] = Ops::pack(s[1][2], s[1][3]);
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
          o[nd][0] *= cr0;
          o[nd][1] *= cr0;
          o[nd][2] *= cr1;
          o[nd][3] *= cr1;
          const unsigned short* vr = tV + (j0 + tig * 2) * DP + nd * 8 + g;
          unsigned int bf[2];
          bf[0] = static_cast<unsigned int>(vr[0]) | (static_cast<unsigned int>(vr[DP]) << 16);
          bf[1] = static_cast<unsigned int>(vr[8 * DP]) |
                  (static_cast<unsigned int>(vr[9 * DP]) << 16);
          Ops::mma(o[nd], pa, bf);
        }
      }
    }
    __syncthreads();  // the next prefetch overwrites this buffer
  }
  segattn::cp_wait<0>();
  // ws: chunk partials acc [NG][NC][R][D], (m, l) [NG][NC][R][2], then (in-kernel merge)
  // first-level partials acc [NG][NSUP][R][D], (m, l) [NG][NSUP][R][2].
  float* wsO = ws;
  float* wsML = ws + static_cast<size_t>(NG) * NC * R * D;
  if (PAIRED) {
    // Each warp owns its rows whole (no key split): partials straight from registers.
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (t == 1 && !hasB) break;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float li = l2[t][i];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        const int r = warp * 16 + g + 8 * i;
        if (r >= R) continue;
        const size_t slot = (static_cast<size_t>(grp + t * Hkv) * NC + c) * R + r;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd)
          *reinterpret_cast<float2*>(wsO + slot * D + nd * 8 + tig * 2) =
              make_float2(o2[t][nd][2 * i], o2[t][nd][2 * i + 1]);
        if (tig == 0) *reinterpret_cast<float2*>(wsML + slot * 2) = make_float2(m2[t][i], li);
      }
    }
  } else {
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncthreads();

  // Merge the KS warps of each m-tile through shared memory (reusing the tile buffers).
  float* sO = reinterpret_cast<float*>(seg_smem4);  // [4 warps][16][D]
  float* sM = sO + 4 * 16 * D;                       // [4][16]
  float* sL = sM + 64;                               // [4][16]
  if (active) {
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      const int d = nd * 8 + tig * 2;
      sO[(warp * 16 + g) * D + d] = o[nd][0];
      sO[(warp * 16 + g) * D + d + 1] = o[nd][1];
      sO[(warp * 16 + g + 8) * D + d] = o[nd][2];
      sO[(warp * 16 + g + 8) * D + d + 1] = o[nd][3];
    }
    if (tig == 0) {
      sM[warp * 16 + g] = m0;
      sM[warp * 16 + g + 8] = m1;
      sL[warp * 16 + g] = l0;
      sL[warp * 16 + g + 8] = l1;
    }
  }
  __syncthreads();
  for (int i = tid; i < R * D; i += NTHR) {
    const int r = i / D, d = i - r * D;
    const int mr = r >> 4, rr = r & 15;
    float M = segattn::neg_inf();
    for (int k2 = 0; k2 < KS; ++k2) M = fmaxf(M, sM[(k2 * QW + mr) * 16 + rr]);
    const float ref = (M == segattn::neg_inf()) ? 0.f : M;
    float Ls = 0.f, acc = 0.f;
    for (int k2 = 0; k2 < KS; ++k2) {
      const int w = (k2 * QW + mr) * 16 + rr;
      const float f = exp2f(sM[w] - ref);
      Ls += sL[w] * f;
      acc += sO[w * D + d] * f;
    }
    const size_t slot = (static_cast<size_t>(grp) * NC + c) * R + r;
    wsO[slot * D + d] = acc;
    if (d == 0) {
      wsML[slot * 2] = M;
      wsML[slot * 2 + 1] = Ls;
    }
  }
  }
@MERGE@
"""

_MERGE_IN_KERNEL = r"""
  // Two-level merge, in this launch (threadFenceReduction pattern, counters reset to 0):
  // the last block of each run of SS chunks merges them into a first-level slot, the last
  // of those merges the NSUP slots into out/lse. Each merge reads few slots, and the first
  // level overlaps other blocks' main loop, so the serial tail stays short. A paired block
  // (PAIRED) does this for each of its two groups in turn.
  const int NSUP = (NC + SS - 1) / SS, sup = c / SS;
  const int s0 = sup * SS, ns = min(SS, NC - s0);
  float* sw = reinterpret_cast<float*>(seg_smem4);
  float* supO = wsML + static_cast<size_t>(NG) * NC * R * 2;  // [NG][NSUP][R][D]
  float* supML = supO + static_cast<size_t>(NG) * NSUP * R * D;  // [NG][NSUP][R][2]
  __threadfence();
  for (int gi = 0; gi < (hasB ? 2 : 1); ++gi) {
    const int gq = grp + gi * Hkv, wq = w0 + gi * Lw;
    unsigned int* semw = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(sem)) +
                         gq * 64;  // [0]: second level, [1 + sup]: first level
    __syncthreads();
    if (tid == 0) s_last = (atomicAdd(semw + 1 + sup, 1u) == static_cast<unsigned int>(ns - 1));
    __syncthreads();
    if (!s_last) continue;
    __threadfence();
    if (tid == 0) semw[1 + sup] = 0u;
    const float* srcO = wsO + (static_cast<size_t>(gq) * NC + s0) * R * D;
    const float* srcML = wsML + (static_cast<size_t>(gq) * NC + s0) * R * 2;
    if (NSUP == 1) {
      segattn::merge_slots<OT, D, true>(srcO, srcML, ns, R, sw, 0, R * D / 4, tid, NTHR, out,
                                        lse, true, Lq, Lw, wq, G, h, b, Hq, nullptr, nullptr);
      continue;
    }
    float* dO = supO + (static_cast<size_t>(gq) * NSUP + sup) * R * D;
    float* dML = supML + (static_cast<size_t>(gq) * NSUP + sup) * R * 2;
    segattn::merge_slots<OT, D, false>(srcO, srcML, ns, R, sw, 0, R * D / 4, tid, NTHR, out,
                                       lse, false, Lq, Lw, wq, G, h, b, Hq, dO, dML);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = (atomicAdd(semw, 1u) == static_cast<unsigned int>(NSUP - 1));
    __syncthreads();
    if (!s_last) continue;
    __threadfence();
    if (tid == 0) semw[0] = 0u;
    segattn::merge_slots<OT, D, true>(supO + static_cast<size_t>(gq) * NSUP * R * D,
                                      supML + static_cast<size_t>(gq) * NSUP * R * 2, NSUP, R,
                                      sw, 0, R * D / 4, tid, NTHR, out, lse, true, Lq, Lw, wq, G,
                                      h, b, Hq, nullptr, nullptr);
  }
"""

# Second pass of merge="two_pass": grid (splits, NG); every split recomputes the weights.
_BODY_REDUCE = r"""
  extern __shared__ float seg_smemf[];
  const int Hq = q_shape[1], Lq = q_shape[2];
  const int NC = cfg_shape[0], Hkv = cfg_shape[1], Lw = cfg_shape[2], NW = (Lq + Lw - 1) / Lw;
  const int G = Hq / Hkv, R = G * Lw;
  const int grp = blockIdx.y, z = grp / Hkv, h = grp - z * Hkv, NG = gridDim.y;
  const int b = z / NW, w0 = (z - b * NW) * Lw;
  const int items = R * D / 4, per = (items + gridDim.x - 1) / gridDim.x;
  const int i0 = blockIdx.x * per, i1 = min(items, i0 + per);
  const float* wsO = ws + static_cast<size_t>(grp) * NC * R * D;
  const float* wsML = ws + static_cast<size_t>(NG) * NC * R * D + static_cast<size_t>(grp) * NC * R * 2;
  segattn::merge_slots<OT, D, true>(wsO, wsML, NC, R, seg_smemf, i0, i1, threadIdx.x,
                                    blockDim.x, out, lse, blockIdx.x == 0, Lq, Lw, w0, G, h, b, Hq,
                                    nullptr, nullptr);
"""


def _pick_source(n_pieces: int) -> str:
    """Unrolled walk over the piece slots: chunk c -> (piece, first row); NC total."""
    lines = []
    for i in range(n_pieces):
        lines.append(
            f"  {{ const int r = ({i} < nlive) ? k{i}_shape[2] : 0; const int n = (r + CH - 1) / CH;\n"
            f"    if (piece < 0 && c < NC + n) {{ piece = {i}; cstart = (c - NC) * CH; prow = r; }}\n"
            f"    NC += n; }}"
        )
    return "\n".join(lines)


def _select_source(n_pieces: int) -> str:
    """Base pointers and strides of the chosen piece (k/v strides: b, h, row, d)."""
    lines = []
    for i in range(n_pieces):
        lines.append(
            f"  if (piece == {i}) {{\n"
            f"    kb = reinterpret_cast<const unsigned short*>(k{i}) + b * k{i}_strides[0] + h * k{i}_strides[1];\n"
            f"    vb = reinterpret_cast<const unsigned short*>(v{i}) + b * v{i}_strides[0] + h * v{i}_strides[1];\n"
            f"    krs = k{i}_strides[2]; kds = k{i}_strides[3]; vrs = v{i}_strides[2]; vds = v{i}_strides[3];\n"
            f"  }}"
        )
    return "\n".join(lines)


def kernel_source(merge: MergeMode, n_pieces: int = MAX_PIECES) -> str:
    """Body of the attention kernel for `n_pieces` input slots (exposed for compile checks)."""
    tail = _MERGE_IN_KERNEL if merge == "in_kernel" else ""
    return (
        _BODY.replace("@PICK@", _pick_source(n_pieces))
        .replace("@SELECT@", _select_source(n_pieces))
        .replace("@MERGE@", tail)
    )


HEADER = _HEADER
BODY_REDUCE = _BODY_REDUCE
