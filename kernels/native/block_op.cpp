// A llama decoder layer's decode step outside attention, as two MLX primitives on the CPU.
//
// Why: with 4-bit weights through the quantized matmul op, one SmolLM2 decode step was a
// graph of ~2,000 MLX nodes (RMSNorm and RoPE have no CPU kernel in MLX and decompose into
// ~25 small ops each; reshapes, splits, slices) and MLX's CPU evaluation costs several
// microseconds per node, more than the products themselves. These two ops do the same
// arithmetic in one task each (bench/profile_decode.py measures the step both ways):
//
//   block_pre:  x = rms_norm(h) * w_norm;  qkv = x @ dequant(W_qkv).T;  RoPE on q and k at
//               each row's own position (offsets[b]);  -> q [B, Hq, 1, D], k and v
//               [B, Hkv, 1, D] (the layout mlx-lm's attention hands to the cache).
//   block_post: h1 = h + o @ dequant(W_o).T;  x = rms_norm(h1) * w_norm2;
//               gu = x @ dequant(W_gu).T;  a = silu(gate) * up;  -> h1 + a @ dequant(W_d).T
//
// The cache write and the attention stay outside (the segmented cache and its route own
// them). The products are the quantized matmul op's own bodies and worker pool
// (qmm::run_now), so the numbers match it; norm, RoPE and SiLU follow MLX's float32
// definitions (tests/test_block_cpu.py compares both ops with the MLX layer they replace).
// Graph side returns nullopt for what it does not serve (dtypes other than float32,
// non-affine weights, shapes that disagree); the caller then keeps MLX's ops.
#include "block_op.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm_op.h"

namespace mx = mlx::core;

namespace block {

namespace {

// Per-thread scratch (the eval task runs on the stream thread); separate from the
// quantized matmul's own per-thread buffer.
float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// y = x * rsqrt(mean(x^2) + eps) * w, float32 throughout (MLX's rms_norm on float32).
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

bool row_contig(const mx::array& a) {
  return a.flags().row_contiguous;
}

// Rows of an [B, 1, H] activation: its data when row-contiguous, else a packed copy in
// `spare` (a view handed in by MLX, e.g. a slice, may be strided).
const float* rows_of(const float* p, int64_t rows, int64_t n, int64_t s0, int64_t s2, bool packed, float* spare) {
  if (packed) return p;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) spare[r * n + i] = p[r * s0 + i * s2];
  return spare;
}

void attach(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  for (const auto& a : in) enc.set_input_array(a);
  for (auto& a : out) {
    a.set_data(mx::allocator::malloc(a.nbytes()));
    enc.set_output_array(a);
  }
}

struct PreParams {
  float eps;
  int gs, bits;
  int n_heads, n_kv, head_dim;
  int rope_dims;
  bool traditional;
  float base, scale;
  bool operator==(const PreParams&) const = default;
};

struct PostParams {
  float eps;
  int gs_o, bits_o, gs_gu, bits_gu, gs_d, bits_d;
  bool operator==(const PostParams&) const = default;
};

// RoPE of one head vector at position `pos` (MLX's rope: theta_i = pos * scale *
// base^(-i / (dims / 2)), inverse frequencies computed as exp(-i * ln(base) / (dims / 2))).
void rope(float* v, float pos, const PreParams& p, const float* inv_freq) {
  const int half = p.rope_dims / 2;
  for (int i = 0; i < half; ++i) {
    const float theta = pos * inv_freq[i];
    const float c = std::cos(theta);
    const float s = std::sin(theta);
    const int a = p.traditional ? 2 * i : i;
    const int b = p.traditional ? 2 * i + 1 : i + half;
    const float x1 = v[a];
    const float x2 = v[b];
    v[a] = x1 * c - x2 * s;
    v[b] = x1 * s + x2 * c;
  }
}

// What both ops share: CPU only, a name, and equality by parameters.
template <class Params>
class ParamPrimitive : public mx::Primitive {
 public:
  ParamPrimitive(mx::Stream s, Params p, const char* name) : mx::Primitive(s), p_(p), name_(name) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override {
    return name_;
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const ParamPrimitive*>(&other);
    return o != nullptr && std::strcmp(o->name_, name_) == 0 && o->p_ == p_;
  }

 protected:
  Params p_;

 private:
  const char* name_;
};

class CpuBlockPre : public ParamPrimitive<PreParams> {
 public:
  CpuBlockPre(mx::Stream s, PreParams p) : ParamPrimitive(s, p, "CpuBlockPre") {
    const int half = p.rope_dims / 2;
    const float step = static_cast<float>(std::log(static_cast<double>(p.base)) / half);
    inv_freq_.resize(half);
    for (int i = 0; i < half; ++i) inv_freq_[i] = std::exp(-static_cast<float>(i) * step);
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (size_t i = 1; i < inputs.size(); ++i) {
      if (!row_contig(inputs[i])) throw std::runtime_error("CpuBlockPre: weights and offsets must be row-contiguous");
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    attach(enc, inputs, outputs);
    const int64_t rows = inputs[0].shape(0);
    const int64_t hidden = inputs[0].shape(-1);
    const float* h = inputs[0].data<float>();
    const bool h_packed = row_contig(inputs[0]);
    const int64_t sh0 = inputs[0].strides()[0], sh2 = inputs[0].strides()[2];
    const int32_t* offsets = inputs[1].data<int32_t>();
    const float* wn = inputs[2].data<float>();
    const qmm::Weights wt = qmm::weights_of(inputs[3], inputs[4], inputs[5], hidden, p_.gs, p_.bits);
    float* q = outputs[0].data<float>();
    float* k = outputs[1].data<float>();
    float* v = outputs[2].data<float>();
    // The task may run after MLX has detached this primitive: it owns copies of what it reads.
    enc.dispatch([=, p = p_, freqs = inv_freq_]() {
      const float* inv = freqs.data();
      const int64_t dq = int64_t(p.n_heads) * p.head_dim;
      const int64_t dkv = int64_t(p.n_kv) * p.head_dim;
      const int64_t width = dq + 2 * dkv;
      float* x = scratch(static_cast<size_t>(rows * (2 * hidden + width)));
      float* qkv = x + rows * hidden;
      const float* hr = rows_of(h, rows, hidden, sh0, sh2, h_packed, qkv + rows * width);
      for (int64_t r = 0; r < rows; ++r) rms_norm(hr + r * hidden, wn, p.eps, hidden, x + r * hidden);
      qmm::run_now(x, rows, wt, qkv);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = qkv + r * width;
        const float pos = static_cast<float>(offsets[r]) * p.scale;
        float* qr = q + r * dq;
        float* kr = k + r * dkv;
        std::memcpy(qr, src, sizeof(float) * dq);
        std::memcpy(kr, src + dq, sizeof(float) * dkv);
        std::memcpy(v + r * dkv, src + dq + dkv, sizeof(float) * dkv);
        for (int hd = 0; hd < p.n_heads; ++hd) rope(qr + hd * p.head_dim, pos, p, inv);
        for (int hd = 0; hd < p.n_kv; ++hd) rope(kr + hd * p.head_dim, pos, p, inv);
      }
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int b = inputs[0].shape(0);
    return {{b, p_.n_heads, 1, p_.head_dim}, {b, p_.n_kv, 1, p_.head_dim}, {b, p_.n_kv, 1, p_.head_dim}};
  }

 private:
  std::vector<float> inv_freq_;
};

class CpuBlockPost : public ParamPrimitive<PostParams> {
 public:
  CpuBlockPost(mx::Stream s, PostParams p) : ParamPrimitive(s, p, "CpuBlockPost") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // o may be a strided view (attention outputs); everything else row-contiguous.
    for (size_t i = 2; i < inputs.size(); ++i) {
      if (!row_contig(inputs[i])) throw std::runtime_error("CpuBlockPost: weights must be row-contiguous");
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    attach(enc, inputs, outputs);
    const mx::array& o = inputs[1];
    const int64_t rows = inputs[0].shape(0);
    const int64_t hidden = inputs[0].shape(-1);
    const int64_t heads = o.shape(1);
    const int64_t dh = o.shape(3);
    const int64_t so0 = o.strides()[0], so1 = o.strides()[1], so3 = o.strides()[3];
    const int64_t inter = inputs[9].shape(1) * 32 / p_.bits_d;
    const float* h = inputs[0].data<float>();
    const bool h_packed = row_contig(inputs[0]);
    const int64_t sh0 = inputs[0].strides()[0], sh2 = inputs[0].strides()[2];
    const float* op = o.data<float>();
    const float* wn = inputs[5].data<float>();
    const qmm::Weights wo = qmm::weights_of(inputs[2], inputs[3], inputs[4], heads * dh, p_.gs_o, p_.bits_o);
    const qmm::Weights wgu = qmm::weights_of(inputs[6], inputs[7], inputs[8], hidden, p_.gs_gu, p_.bits_gu);
    const qmm::Weights wd = qmm::weights_of(inputs[9], inputs[10], inputs[11], inter, p_.gs_d, p_.bits_d);
    float* out = outputs[0].data<float>();
    enc.dispatch([=, p = p_]() {
      const int64_t din = heads * dh;
      float* oc = scratch(static_cast<size_t>(rows * (din + 3 * hidden + 3 * inter)));
      float* x = oc + rows * din;        // [rows, hidden] normed h1
      float* gu = x + rows * hidden;     // [rows, 2 * inter]
      float* act = gu + rows * 2 * inter;  // [rows, inter]
      float* h1 = act + rows * inter;    // [rows, hidden]
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t hd = 0; hd < heads; ++hd) {
          const float* src = op + r * so0 + hd * so1;
          float* dst = oc + r * din + hd * dh;
          for (int64_t d = 0; d < dh; ++d) dst[d] = src[d * so3];
        }
      qmm::run_now(oc, rows, wo, h1);
      const float* hr = rows_of(h, rows, hidden, sh0, sh2, h_packed, h1 + rows * hidden);
      for (int64_t i = 0; i < rows * hidden; ++i) h1[i] += hr[i];
      for (int64_t r = 0; r < rows; ++r) rms_norm(h1 + r * hidden, wn, p.eps, hidden, x + r * hidden);
      qmm::run_now(x, rows, wgu, gu);
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = gu + r * 2 * inter;
        const float* u = g + inter;
        float* a = act + r * inter;
        // silu(g) * u with silu(g) = g * sigmoid(g) (mlx.nn.silu)
        for (int64_t i = 0; i < inter; ++i) a[i] = (g[i] * (1.0f / (1.0f + std::exp(-g[i])))) * u[i];
      }
      qmm::run_now(act, rows, wd, out);
      for (int64_t i = 0; i < rows * hidden; ++i) out[i] += h1[i];
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

bool f32_vector(const mx::array& a, int64_t n) {
  return a.dtype() == mx::float32 && a.ndim() == 1 && a.shape(0) == n;
}

}  // namespace

std::optional<std::vector<mx::array>> pre(const mx::array& h, const mx::array& offsets,
                                          const mx::array& norm_w, float eps, const mx::array& w,
                                          const mx::array& scales, const mx::array& biases, int group_size,
                                          int bits, int n_heads, int n_kv_heads, int head_dim, int rope_dims,
                                          bool traditional, float rope_base, float rope_scale) {
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1) return std::nullopt;
  const int64_t hidden = h.shape(2);
  const int b = h.shape(0);
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 || offsets.shape(0) != b) return std::nullopt;
  if (!f32_vector(norm_w, hidden)) return std::nullopt;
  if (!qmm::serves(hidden, w, scales, biases, group_size, bits)) return std::nullopt;
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0) return std::nullopt;
  if (w.shape(0) != static_cast<int64_t>(n_heads + 2 * n_kv_heads) * head_dim) return std::nullopt;
  if (rope_dims <= 0 || rope_dims > head_dim || rope_dims % 2 != 0) return std::nullopt;
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  const PreParams p{eps, group_size, bits, n_heads, n_kv_heads, head_dim, rope_dims, traditional, rope_base,
                    rope_scale};
  auto prim = std::make_shared<CpuBlockPre>(s, p);
  std::vector<mx::Shape> shapes = {
      {b, n_heads, 1, head_dim}, {b, n_kv_heads, 1, head_dim}, {b, n_kv_heads, 1, head_dim}};
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim,
                                {h, offsets, norm_w, w, scales, biases});
}

std::optional<mx::array> post(const mx::array& h, const mx::array& o, const mx::array& wo,
                              const mx::array& so, const mx::array& bo, int gs_o, int bits_o,
                              const mx::array& norm_w, float eps, const mx::array& wgu, const mx::array& sgu,
                              const mx::array& bgu, int gs_gu, int bits_gu, const mx::array& wd,
                              const mx::array& sd, const mx::array& bd, int gs_d, int bits_d) {
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1) return std::nullopt;
  const int64_t hidden = h.shape(2);
  if (o.dtype() != mx::float32 || o.ndim() != 4 || o.shape(0) != h.shape(0) || o.shape(2) != 1) return std::nullopt;
  if (!f32_vector(norm_w, hidden)) return std::nullopt;
  const int64_t din = static_cast<int64_t>(o.shape(1)) * o.shape(3);
  if (!qmm::serves(din, wo, so, bo, gs_o, bits_o) || wo.shape(0) != hidden) return std::nullopt;
  if (!qmm::serves(hidden, wgu, sgu, bgu, gs_gu, bits_gu) || wgu.shape(0) % 2 != 0) return std::nullopt;
  const int64_t inter = wgu.shape(0) / 2;
  if (!qmm::serves(inter, wd, sd, bd, gs_d, bits_d) || wd.shape(0) != hidden) return std::nullopt;
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  const PostParams p{eps, gs_o, bits_o, gs_gu, bits_gu, gs_d, bits_d};
  auto prim = std::make_shared<CpuBlockPost>(s, p);
  return mx::array(h.shape(), mx::float32, std::move(prim), {h, o, wo, so, bo, norm_w, wgu, sgu, bgu, wd, sd, bd});
}

}  // namespace block
