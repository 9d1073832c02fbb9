
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
// Soft-capped scores (Gemma 2): the caller multiplies a raw score s by sl2 = scale * log2(e);
// capping in raw units, s -> (C / scale) * tanh(s * scale / C), makes that product
// C * tanh(s * scale / C) in base-2 units. tanh is monotonic, so maxima commute with it.
// CAP_BITS is the cap's float bits (a template argument); 0 = no cap, folded away.
template <int CAP_BITS>
__device__ __forceinline__ float soft_cap(float s, float sl2) {
  if (CAP_BITS == 0) return s;
  const float scale = sl2 * 0.6931471805599453f;
  const float cap = __int_as_float(CAP_BITS);
  return (cap / scale) * tanhf(s * (scale / cap));
}

template <typename T, int D, int DP, int KN, int CAP_BITS>
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
  if (CAP_BITS != 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = soft_cap<CAP_BITS>(s[nt][e], sl2);
  }
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
template <typename T, int D, int DP, int KN, int CAP_BITS>
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
  if (CAP_BITS != 0) {
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][nt][e] = soft_cap<CAP_BITS>(s[t][nt][e], sl2);
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
