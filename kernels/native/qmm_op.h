// Graph-side entry points of the CPU quantized matmul op (see qmm_op.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace qmm {

// x [..., K] float32 @ dequant(w).T with w uint32 [N, K * bits / 32] (MLX affine format),
// scales/biases [N, K / group_size] (float32, float16 or bfloat16): [..., N] float32.
// nullopt when the kernel does not serve the inputs (dtype, bits, group size, shapes):
// the caller uses mx.quantized_matmul. x8: this product's own rounding of x ("gemm": in
// the GEMM only; empty: the process's QMM_X8), taken where the process runs auto.
std::optional<mlx::core::array> quantized_matmul(const mlx::core::array& x,
                                                 const mlx::core::array& w,
                                                 const mlx::core::array& scales,
                                                 const mlx::core::array& biases,
                                                 int group_size, int bits,
                                                 const std::string& x8 = "");

// For other primitives of this extension (block_op.cpp), inside their eval task on the
// stream thread: the same kernel bodies and worker pool, run now.
struct Weights {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  int scale_type;  // QmmScaleType of scales and biases
  int64_t n, k;
  int group_size, bits;
  int x8 = -1;  // this product's own rounding of x (`x8_want`), -1: the process's
};
bool serves(int64_t k, const mlx::core::array& w, const mlx::core::array& scales,
            const mlx::core::array& biases, int group_size, int bits);
// The data of evaluated, row-contiguous arrays that `serves` accepted, K inputs wide; x8 as
// `Weights::x8`.
Weights weights_of(const mlx::core::array& w, const mlx::core::array& scales,
                   const mlx::core::array& biases, int64_t k, int group_size, int bits, int x8 = -1);
// A product's own rounding of x as `quantized_matmul` takes it ("", "gemm", "on", "off"),
// for `Weights::x8`: -1 for "" (the process's), taken where the process runs auto.
int x8_want(const std::string& x8);
// y [rows, n] = x [rows, k] (row-contiguous) @ dequant(W).T, on the calling thread + pool.
void run_now(const float* x, int64_t rows, const Weights& wt, float* y);

// The extension's worker pool: fn(ctx, i) for every i in [0, items), on the calling thread
// and the pool's workers (items are claimed from a counter); returns when all are done.
using ParallelFn = void (*)(const void* ctx, int64_t item);
void parallel_for(ParallelFn fn, const void* ctx, int64_t items);
// The same for a callable f(i) (a lambda capturing what its items read).
template <class F>
void parallel_for(int64_t items, const F& f) {
  parallel_for([](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); }, &f, items);
}

std::string isa();                         // kernel body new ops use: avx512, avx2, generic
std::vector<std::string> supported_isas();  // bodies this CPU can run, default first
void set_isa(const std::string& name);
int threads();  // threads one op may use (stream thread included)
std::string x8();  // which decode rows round x to 8 bits (qmm_dot8.cpp): auto, on, off
void set_x8(const std::string& mode);
bool x8_takes(int64_t rows, int64_t k, int bits);  // whether a new op rounds x [rows, k] so
int x8_block_of(int64_t rows, int64_t k, int bits);  // values per rounding scale there (0: float x)
void set_threads(int n);

}  // namespace qmm
