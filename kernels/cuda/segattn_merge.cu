
  // Two-level merge, in this launch (threadFenceReduction pattern, counters reset to 0):
  // the last block of each run of SS chunks merges them into a first-level slot, the last
  // of those merges the NSUP slots into out/lse. Each merge reads few slots, and the first
  // level overlaps other blocks' main loop, so the serial tail stays short. A paired block
  // (PAIRED) does this for each of its two groups in turn.
  const int NSUP = (NC + SS - 1) / SS, sup = c / SS;
  const int NSUPS = (NCS + SS - 1) / SS;  // the layout's stride (= NSUP but for OWNED)
  const int s0 = sup * SS, ns = min(SS, NC - s0);
  float* sw = reinterpret_cast<float*>(seg_smem4);
  float* supO = wsML + static_cast<size_t>(NG) * NCS * R * 2;  // [NG][NSUPS][R][D]
  float* supML = supO + static_cast<size_t>(NG) * NSUPS * R * D;  // [NG][NSUPS][R][2]
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
    const float* srcO = wsO + (static_cast<size_t>(gq) * NCS + s0) * R * D;
    const float* srcML = wsML + (static_cast<size_t>(gq) * NCS + s0) * R * 2;
    if (NSUP == 1) {
      segattn::merge_slots<OT, D, true>(srcO, srcML, ns, R, sw, 0, R * D / 4, tid, NTHR, out,
                                        lse, true, Lq, Lw, wq, G, h, b, Hq, nullptr, nullptr);
      continue;
    }
    float* dO = supO + (static_cast<size_t>(gq) * NSUPS + sup) * R * D;
    float* dML = supML + (static_cast<size_t>(gq) * NSUPS + sup) * R * 2;
    segattn::merge_slots<OT, D, false>(srcO, srcML, ns, R, sw, 0, R * D / 4, tid, NTHR, out,
                                       lse, false, Lq, Lw, wq, G, h, b, Hq, dO, dML);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = (atomicAdd(semw, 1u) == static_cast<unsigned int>(NSUP - 1));
    __syncthreads();
    if (!s_last) continue;
    __threadfence();
    if (tid == 0) semw[0] = 0u;
    segattn::merge_slots<OT, D, true>(supO + static_cast<size_t>(gq) * NSUPS * R * D,
                                      supML + static_cast<size_t>(gq) * NSUPS * R * 2, NSUP, R,
                                      sw, 0, R * D / 4, tid, NTHR, out, lse, true, Lq, Lw, wq, G,
                                      h, b, Hq, nullptr, nullptr);
  }
