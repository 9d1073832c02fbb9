// Graph-side entry points of the fused decode-layer ops (see block_op.cpp).
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"

namespace block {

// Norm, q/k/v product (one fused affine-quantized weight, rows q | k | v) and RoPE of one
// decode step: h [B, 1, H] float32, offsets int32 [B] -> q [B, Hq, 1, D], k, v [B, Hkv, 1, D].
std::optional<std::vector<mlx::core::array>> pre(
    const mlx::core::array& h, const mlx::core::array& offsets, const mlx::core::array& norm_w, float eps,
    const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, int group_size,
    int bits, int n_heads, int n_kv_heads, int head_dim, int rope_dims, bool traditional, float rope_base,
    float rope_scale);

// Output projection + residual, norm, SwiGLU MLP (gate | up fused) + residual:
// h [B, 1, H], o [B, Hq, 1, D] float32 -> h' [B, 1, H].
std::optional<mlx::core::array> post(
    const mlx::core::array& h, const mlx::core::array& o, const mlx::core::array& wo, const mlx::core::array& so,
    const mlx::core::array& bo, int gs_o, int bits_o, const mlx::core::array& norm_w, float eps,
    const mlx::core::array& wgu, const mlx::core::array& sgu, const mlx::core::array& bgu, int gs_gu,
    int bits_gu, const mlx::core::array& wd, const mlx::core::array& sd, const mlx::core::array& bd, int gs_d,
    int bits_d);

}  // namespace block
