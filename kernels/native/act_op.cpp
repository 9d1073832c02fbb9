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
#include <stdexcept>

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

struct Job {
  const float* g;
  const float* u;
  float* y;
  int64_t n;
  int act;
};

void run(const Job& job) {
  auto one = [&job](int64_t c) {
    const int64_t lo = c * kChunk, hi = std::min(job.n, lo + kChunk);
    if (job.act == 0) {
      silu_gate(job.g + lo, job.u + lo, job.y + lo, hi - lo);
    } else {
      gelu_gate(job.g + lo, job.u + lo, job.y + lo, hi - lo);
    }
  };
  const int64_t items = (job.n + kChunk - 1) / kChunk;
  if (items <= 1) {
    if (items == 1) one(0);
    return;
  }
  qmm::parallel_for(items, one);
}

class CpuGatedAct : public mx::Primitive {
 public:
  CpuGatedAct(mx::Stream stream, int act) : mx::Primitive(stream), act_(act) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& g = inputs[0];
    const mx::array& u = inputs[1];
    if (!g.flags().row_contiguous || !u.flags().row_contiguous) {
      throw std::runtime_error("CpuGatedAct: inputs must be row-contiguous");
    }
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(u);
    encoder.set_output_array(out);
    const Job job{g.data<float>(), u.data<float>(), out.data<float>(), static_cast<int64_t>(g.size()), act_};
    encoder.dispatch([job]() { run(job); });
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
  // A view (a split of a fused gate|up product) is copied to row-contiguous first; an
  // array that already is one passes through without a copy.
  mx::array g = mx::contiguous(gate, false, s);
  mx::array u = mx::contiguous(up, false, s);
  return mx::array(gate.shape(), mx::float32, std::make_shared<CpuGatedAct>(s, act), {g, u});
}

}  // namespace act
