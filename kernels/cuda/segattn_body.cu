
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

  // Which piece and which rows this block reads; NC = chunks per group. Owned pieces
  // (OWNED, decode rows of sessions with distinct histories): batch row b reads only its
  // own pieces [own_lo, own_hi), given whole ([1, H_kv, S, D]); NC counts its chunks, the
  // launch's grid runs the most any row has, and a block past its row's chunks returns
  // before it touches the workspace or a counter. Partials keep one layout for every row:
  // NCS (the grid's chunks) is their stride.
@OWN@
  int piece = -1, cstart = 0, prow = 0, NC = 0;
@PICK@
  if (OWNED && piece < 0) return;
  const int NCS = OWNED ? static_cast<int>(gridDim.x) : NC;
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
        segattn::wide2_step<T, D, DP, KN2, CAP_BITS>(sQ + warp * 16 * DP, tK, tV, hs * KN2, o2, m2, l2,
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
        segattn::wide_step<T, D, DP, KN, CAP_BITS>(tK, tV, hs * KN, qa, o, m0, m1, l0, l1, sl2, mk, jb,
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
            s[nh][e] = ok ? segattn::soft_cap<CAP_BITS>(s[nh][e], sl2) * sl2 : segattn::neg_inf();
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
  // ws: chunk partials acc [NG][NCS][R][D], (m, l) [NG][NCS][R][2], then (in-kernel merge)
  // first-level partials acc [NG][NSUPS][R][D], (m, l) [NG][NSUPS][R][2].
  float* wsO = ws;
  float* wsML = ws + static_cast<size_t>(NG) * NCS * R * D;
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
        const size_t slot = (static_cast<size_t>(grp + t * Hkv) * NCS + c) * R + r;
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
    const size_t slot = (static_cast<size_t>(grp) * NCS + c) * R + r;
    wsO[slot * D + d] = acc;
    if (d == 0) {
      wsML[slot * 2] = M;
      wsML[slot * 2 + 1] = Ls;
    }
  }
  }
@MERGE@
