
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
