// Graph-side entry points of the fused decode-layer ops (see block_op.cpp).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace block {

using mlx::core::array;

// [norm], q/k/v product(s) (`proj`: w, scales, biases of one fused q|k|v weight or of q,
// k and v), [bias], [q/k norm: 1 per head, 2 over all heads], RoPE (inverse frequencies
// from base/scale, or `inv_freqs`; with `long_inv_freqs`, rows at positions >= rope_switch
// use those and long_mscale: LongRoPE) of one decode step: h [B, 1, H] float32, offsets int32
// [B] -> q [B, Hq, 1, D], k, v [B, Hkv, 1, D]. x8: the products' own rounding of x, as the
// quantized matmul op takes it (qmm_op.h).
std::optional<std::vector<array>> pre(const array& h, const array& offsets, const std::optional<array>& norm_w,
                                      float eps, const std::vector<array>& proj, const std::vector<int>& gs,
                                      const std::vector<int>& bits, const std::optional<array>& bias, int qk_norm,
                                      const std::optional<array>& q_norm_w, const std::optional<array>& k_norm_w,
                                      float qk_eps, int n_heads, int n_kv_heads, int head_dim, int rope_dims,
                                      bool traditional, float rope_base, float rope_scale,
                                      const std::optional<array>& inv_freqs, float rope_mscale,
                                      const std::optional<array>& long_inv_freqs, float long_mscale,
                                      int rope_switch, const std::string& x8);

// Output projection [+ bias] [norm], residual (x multiplier), [norm], gated MLP (gate|up
// fused or apart, SiLU (act 0) or GELU-tanh (act 1)) [+ biases] [norm], residual:
// h [B, 1, H], o [B, Hq, 1, D] float32 -> h' [B, 1, H]. gs/bits: o, gate/up (1 or 2), down;
// x8 as `pre`'s.
std::optional<array> post(const array& h, const array& o, const std::vector<array>& wo,
                          const std::optional<array>& o_bias, const std::optional<array>& attn_out_norm_w,
                          const std::optional<array>& mlp_in_norm_w, const std::vector<array>& gate_up,
                          const std::optional<array>& gate_up_bias, const std::vector<array>& down,
                          const std::optional<array>& down_bias, const std::optional<array>& mlp_out_norm_w,
                          const std::vector<int>& gs, const std::vector<int>& bits, float eps, int act,
                          float residual_multiplier, const std::string& x8);

// One decode row of a whole layer in one op: pre, the cache write and attention, post.
// Built once per layer from a (lazy, never evaluated) output of `pre` and one of `post`,
// which carry the layer's parameters and weights; `step` then takes the row h [1, 1, H],
// its position offsets [1], and the session's pieces k0, v0, ..., k_buf, v_buf (segments
// [1, Hkv, S, D], then the private tail buffers the new K/V row goes to at row `start`,
// evaluated: see segattn::append_served) -> h' [1, 1, H]; nullopt when not served.
// tail_from > 0: attention reads the tail from that row on (a sliding window starting
// inside the tail; the pieces are then the buffers alone).
class LayerPlan {
 public:
  LayerPlan(const array& pre_out, const array& post_out);
  std::optional<array> step(const array& h, const array& offsets, const std::vector<array>& pieces,
                            int64_t start, float scale, float softcap, int64_t tail_from = 0) const;
  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace block
