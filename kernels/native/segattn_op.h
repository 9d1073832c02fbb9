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
// window > 0: a sliding window; the queries are the newest L positions of all keys, query
// l at p = keys - L + l, and each sees keys (p - window, p].
std::optional<mlx::core::array> segmented_attention(
    const mlx::core::array& q, const std::vector<mlx::core::array>& kv, float scale,
    bool causal_tail, int64_t window = 0, float softcap = 0.0f);

// The decode step's form: writes k_new/v_new [B, Hkv, n, D] into the tail buffers k_buf/
// v_buf [B, Hkv, cap, D] at row `start` (rounded to their dtype), then attends over the
// segments and the buffers' first start + n rows (causal inside them). The buffers must be
// evaluated, row-contiguous and private to the caller (they are written in place when the
// op runs). nullopt when not served: the caller writes and attends the plain way.
std::optional<mlx::core::array> segmented_attention_append(
    const mlx::core::array& q, const std::vector<mlx::core::array>& segments,
    const mlx::core::array& k_new, const mlx::core::array& v_new, const mlx::core::array& k_buf,
    const mlx::core::array& v_buf, int64_t start, float scale);

std::string isa();                         // kernel body new ops use: avx512, avx2, generic
std::vector<std::string> supported_isas();  // bodies this CPU can run, default first
void set_isa(const std::string& name);      // for tests and benchmarks
int threads();                              // threads one op may use (stream thread included)
void set_threads(int n);

}  // namespace segattn
