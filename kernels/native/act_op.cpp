// The gated activation of an MLP, act(gate) * up, as one CPU op over float32 arrays.
//
// Why: MLX's CPU build evaluates exp, tanh and sigmoid one element at a time through
// libm (a scalar fmaf call per polynomial step): SiLU(gate) * up over a 512 x 2816 prefill
// chunk took ~25 ms on an AMD Zen 4 core where a multiply of the same arrays took 0.8 ms,
// ~20 % of a Q4_K_M prefill step (bench/act_cpu.py). Here exp is a vector polynomial
// (range reduction by ln 2, degree-6 polynomial, 2^n built in the exponent bits: relative
// error ~1e-7, float32's own rounding) that GCC vectorizes for each ISA of
// `target_clones`, and long arrays are split over the quantized matmul's worker pool.
//
// SiLU: g / (1 + exp(-g)) (mlx.nn.silu). GELU-tanh (mlx.nn.gelu_approx): 0.5 g (1 +
// tanh(z)), z = c (g + 0.044715 g^3), computed as g / (1 + exp(-2 z)) (the same value).
#include "act_op.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>
#include <algorithm>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm_op.h"

namespace mx = mlx::core;

namespace act {

namespace {

inline float exp_poly(float in) {
  const float x = in < -87.0f ? -87.0f : (in > 88.0f ? 88.0f : in);
  const float n = __builtin_roundevenf(x * 1.44269504088896341f);
  // r = x - n ln 2, ln 2 in two parts so that n * hi is exact
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.98756912e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 5.00000000e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  // Past float32's range exp is +inf (so g / (1 + e) is -0 for a very negative g, as in
  // MLX); below -87 it stays ~1e-38, where 1 + e is 1.
  return in > 88.7f ? __builtin_inff() : p * scale;
}

__attribute__((target_clones("avx512f", "arch=haswell", "default")))
void silu_gate(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}

__attribute__((target_clones("avx512f", "arch=haswell", "default")))
void gelu_gate(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    // 0.5 x (1 + tanh(z)) = x * sigmoid(2 z): no cancellation where tanh(z) is near -1.
    const float z = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    y[i] = x / (1.0f + exp_poly(-2.0f * z)) * u[i];
  }
}

// Elements per pool item: long enough that waking a worker pays.
constexpr int64_t kChunk = 16384;

// The inputs as rows of `width` values: row r of g starts at g + r * gs (u likewise), y is
// row-contiguous. A split of a fused gate|up product is such a view of the product (row
// stride 2 * width), read in place: copying both halves first cost two extra passes over
// the chunk's activations and ~5 MB of transient memory per layer of a 256-token prefill
// chunk on a 0.4B shape.
struct Job {
  const float* g;
  const float* u;
  float* y;
  int64_t rows, width, gs, us;
  int act;
};

void run(const Job& job) {
  auto span = [&job](int64_t r, int64_t lo, int64_t hi) {
    const float* g = job.g + r * job.gs;
    const float* u = job.u + r * job.us;
    float* y = job.y + r * job.width;
    if (job.act == 0) {
      silu_gate(g + lo, u + lo, y + lo, hi - lo);
    } else {
      gelu_gate(g + lo, u + lo, y + lo, hi - lo);
    }
  };
  // Items of whole rows (about kChunk values each), or pieces of one row when rows are longer.
  const int64_t per_row = (job.width + kChunk - 1) / kChunk;  // pieces of a row
  const int64_t rows_per = per_row == 1 ? std::max<int64_t>(1, kChunk / std::max<int64_t>(job.width, 1)) : 1;
  const int64_t items = per_row == 1 ? (job.rows + rows_per - 1) / rows_per : job.rows * per_row;
  auto one = [&](int64_t c) {
    if (per_row == 1) {
      for (int64_t r = c * rows_per; r < std::min(job.rows, (c + 1) * rows_per); ++r) span(r, 0, job.width);
    } else {
      const int64_t r = c / per_row, lo = (c % per_row) * kChunk;
      span(r, lo, std::min(job.width, lo + kChunk));
    }
  };
  if (items <= 1) {
    if (items == 1) one(0);
    return;
  }
  qmm::parallel_for(items, one);
}

// The stride between consecutive rows of `a` (its last axis of unit stride, every leading
// axis a whole number of rows after the next one; any sign), or nothing where `a` is not
// such rows.
std::optional<int64_t> row_stride(const mx::array& a) {
  const int nd = a.ndim();
  if (nd == 0) return std::nullopt;
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  if (shape[nd - 1] > 1 && strides[nd - 1] != 1) return std::nullopt;
  std::optional<int64_t> rs;
  int64_t next = 0;  // the stride the next leading axis must have
  for (int d = nd - 2; d >= 0; --d) {
    if (shape[d] == 1) continue;  // a stride of a size-1 axis is never used
    if (!rs) {
      rs = strides[d];
    } else if (static_cast<int64_t>(strides[d]) != next) {
      return std::nullopt;
    }
    next = static_cast<int64_t>(strides[d]) * shape[d];
  }
  return rs ? *rs : static_cast<int64_t>(shape[nd - 1]);  // one row
}

// `a` copied to row-contiguous floats (the rare input that is not rows: a transposed view).
std::vector<float> gathered(const mx::array& a) {
  std::vector<float> out(a.size());
  const int nd = a.ndim();
  std::vector<int64_t> idx(nd, 0);
  const float* base = a.data<float>();
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[d] * a.strides()[d];
    out[i] = base[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < a.shape(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

class CpuGatedAct : public mx::Primitive {
 public:
  CpuGatedAct(mx::Stream stream, int act) : mx::Primitive(stream), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& g = inputs[0];
    const mx::array& u = inputs[1];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(u);
    encoder.set_output_array(out);
    const int64_t width = g.ndim() == 0 ? 1 : g.shape(-1);
    const int64_t rows = width == 0 ? 0 : static_cast<int64_t>(g.size()) / width;
    encoder.dispatch([g, u, out, width, rows, act = act_]() mutable {
      const std::optional<int64_t> gs = row_stride(g), us = row_stride(u);
      std::vector<float> gc, uc;  // copies of inputs that are not rows
      const float* gp = g.data<float>();
      const float* up = u.data<float>();
      if (!gs) {
        gc = gathered(g);
        gp = gc.data();
      }
      if (!us) {
        uc = gathered(u);
        up = uc.data();
      }
      run(Job{gp, up, out.data<float>(), rows, width, gs.value_or(width), us.value_or(width), act});
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("CpuGatedAct runs on the CPU only");
  }

  const char* name() const override {
    return "CpuGatedAct";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const CpuGatedAct*>(&other);
    return o != nullptr && o->act_ == act_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int act_;
};

}  // namespace

std::optional<mx::array> gated(const mx::array& gate, const mx::array& up, int act) {
  if (act != 0 && act != 1) return std::nullopt;
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32) return std::nullopt;
  if (gate.shape() != up.shape() || gate.size() == 0) return std::nullopt;
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  // Views are read in place (the op takes rows at any stride; see Job).
  return mx::array(gate.shape(), mx::float32, std::make_shared<CpuGatedAct>(s, act), {gate, up});
}

}  // namespace act
