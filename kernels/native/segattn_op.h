// Graph-side entry points of the segmented attention op (see segattn_op.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace segattn {

// Attention of q [B, Hq, L, D] over pieces kv = [k0, v0, k1, v1, ...], each [B, Hkv, S_i, D]
// (S_i may be 0), the tail last when causal_tail (bottom-right causal inside it). nullopt
// when the kernel does not serve the inputs (dtype, head_dim, shapes): the caller composes.
std::optional<mlx::core::array> segmented_attention(
    const mlx::core::array& q, const std::vector<mlx::core::array>& kv, float scale,
    bool causal_tail);

std::string isa();                         // kernel body new ops use: avx512, avx2, generic
std::vector<std::string> supported_isas();  // bodies this CPU can run, default first
void set_isa(const std::string& name);      // for tests and benchmarks
int threads();                              // threads one op may use (stream thread included)
void set_threads(int n);

}  // namespace segattn
