// Graph-side entry points of the segmented attention op (see segattn_op.cpp).
#pragma once

#include <memory>
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

// The same write-and-attend for one session, run inside another op's task (block_op.cpp's
// decoder-layer op), with float32 rows the task computed itself. Graph side:
// `append_served` says whether the pieces (segments k0, v0, ..., then k_buf, v_buf, shapes
// [1, Hkv, S, D]) take it. Eval side (the arrays evaluated): `append_task` reads their
// pointers, and `run_append` writes k_new/v_new (packed [Hkv, D]) into the buffers at row
// `start`, then attends q (packed [Hq, D], one row per head) over the segments and the
// buffers' rows [tail_from, start + 1) into out (packed [Hq, D]). softcap > 0: soft-capped
// scores. tail_from > 0: a sliding window that starts inside the tail (no segments then).
struct AppendTask;
bool append_served(int n_q_heads, const std::vector<mlx::core::array>& pieces, int64_t start,
                   int64_t tail_from = 0);
std::shared_ptr<const AppendTask> append_task(const std::vector<mlx::core::array>& pieces, int64_t start,
                                              int n_q_heads, float scale, float softcap, int64_t tail_from = 0);
void run_append(const AppendTask& task, const float* q, const float* k_new, const float* v_new, float* out);

std::string isa();                         // kernel body new ops use: avx512, avx2, generic
std::vector<std::string> supported_isas();  // bodies this CPU can run, default first
void set_isa(const std::string& name);      // for tests and benchmarks
int threads();                              // threads one op may use (stream thread included)
void set_threads(int n);

}  // namespace segattn
