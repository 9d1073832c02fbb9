// A decoder layer's decode step outside attention, as two MLX primitives on the CPU.
//
// Why: with 4-bit weights through the quantized matmul op, one SmolLM2 decode step was a
// graph of ~2,000 MLX nodes (RMSNorm and RoPE have no CPU kernel in MLX and decompose into
// ~25 small ops each; reshapes, splits, slices) and MLX's CPU evaluation costs several
// microseconds per node, more than the products themselves. These two ops do the same
// arithmetic in one task each (bench/profile_decode.py measures the step both ways).
//
// One block, parameterised by what mlx-lm's families differ in (kernels/block_cpu.py
// `BlockShape` says which family has what; [x] = optional):
//
//   block_pre:  x = [rms_norm(h) * w_in];  qkv = x @ dequant(W_qkv).T [+ b_qkv] (one fused
//               weight or q, k, v apart);  [q/k rms_norm per head or over all heads];
//               RoPE on q and k at each row's own position (offsets[b]) with inverse
//               frequencies from base/scale or given (Llama 3, YaRN: any vector; LongRoPE:
//               two vectors, the row's position picks one),
//               split-half or interleaved pairs, [mscale];  -> q [B, Hq, 1, D], k and v
//               [B, Hkv, 1, D] (the layout mlx-lm's attention hands to the cache).
//   block_post: a = [norm](o @ dequant(W_o).T [+ b_o]);  h1 = h + m * a;  x = [norm](h1);
//               gu = x @ dequant(W_gu).T [+ b_gu] (fused or apart);  g = act(gate) * up
//               (SiLU or GELU-tanh);  -> h1 + m * [norm](g @ dequant(W_d).T [+ b_d])
//               (m: the residual multiplier, 1 but for granite).
//
// Norm weights arrive as the multiplier itself (gemma's 1 + w is added on the Python
// side once). The cache write and the attention stay outside (the segmented cache and its
// route own them), except in the layer op (CpuBlockLayer, `LayerPlan`): one session's
// decode row through pre, the write of its K/V row into the tail buffers the cache hands
// out and attention over its segments (segattn::run_append), and post, in one node. Why:
// per layer that is one node and one host call instead of three (a 28-layer step: graph
// building 1.2 -> 0.7 ms, the step 1.07x; bench/profile_decode.py). The products are the
// quantized matmul op's own bodies and worker pool (qmm::run_now), so the numbers match
// it; norm, RoPE and activations follow MLX's float32 definitions (tests/test_block_cpu.py
// compares both ops with each family's MLX layer).
// Graph side returns nullopt for what it does not serve (dtypes other than float32,
// non-affine weights, shapes that disagree); the caller then keeps MLX's ops.
#include "block_op.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm_op.h"
#include "segattn_op.h"

namespace mx = mlx::core;

namespace block {

namespace {

// Per-thread scratch (the eval task runs on the stream thread); separate from the
// quantized matmul's own per-thread buffer. Slot 1 holds the layer op's q, k, v and o,
// apart from slot 0, which the pre and post tasks use in turn.
template <int Slot = 0>
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

constexpr int kMaxProj = 3;

struct PreParams {
  float eps, qk_eps;
  int nproj;  // 1 (q|k|v fused) or 3 (q, k, v)
  int gs[kMaxProj], bits[kMaxProj];
  bool has_norm, has_bias;
  int qk_norm;  // 0 none, 1 per head, 2 over all heads
  int n_heads, n_kv, head_dim;
  int rope_dims;
  bool traditional, has_freqs;
  float base, scale, mscale;
  // LongRoPE: rows at positions >= rope_switch rotate with the second frequency set
  // (long_inv_freqs) and long_mscale instead.
  bool has_long;
  float long_mscale;
  int rope_switch;
  int x8;  // the products' own rounding of x (qmm::x8_want)
  bool operator==(const PreParams&) const = default;
};

struct PostParams {
  float eps, resid;
  int ngu;  // 1 (gate|up fused) or 2 (gate, up)
  int gs[4], bits[4];  // o, gate/up (1 or 2), down
  bool o_bias, attn_out_norm, mlp_in_norm, gu_bias, d_bias, mlp_out_norm;
  int act;  // 0 SiLU, 1 GELU (tanh approximation)
  int x8;  // the products' own rounding of x (qmm::x8_want)
  bool operator==(const PostParams&) const = default;
};

// RoPE of one head vector at position `pos` (MLX's rope: theta_i = pos * inv_freq[i]; a
// module's `mscale` multiplies the rotated dims first, as SuScaledRoPE does).
void rope(float* v, float pos, const PreParams& p, const float* inv_freq, float mscale) {
  const int half = p.rope_dims / 2;
  for (int i = 0; i < half; ++i) {
    const float theta = pos * inv_freq[i];
    const float c = std::cos(theta);
    const float s = std::sin(theta);
    const int a = p.traditional ? 2 * i : i;
    const int b = p.traditional ? 2 * i + 1 : i + half;
    const float x1 = v[a] * mscale;
    const float x2 = v[b] * mscale;
    v[a] = x1 * c - x2 * s;
    v[b] = x1 * s + x2 * c;
  }
}

// y [rows, sum n_i] = x @ [W_0 | W_1 | ...].T: one product, or one per weight into `tmp`
// and interleaved into y's rows.
void products(const float* x, int64_t rows, const std::vector<qmm::Weights>& ws, float* y, float* tmp) {
  if (ws.size() == 1) {
    qmm::run_now(x, rows, ws[0], y);
    return;
  }
  int64_t width = 0;
  for (const auto& w : ws) width += w.n;
  int64_t col = 0;
  for (const auto& w : ws) {
    qmm::run_now(x, rows, w, tmp);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * width + col, tmp + r * w.n, sizeof(float) * w.n);
    col += w.n;
  }
}

using PreRun = std::function<void(float* q, float* k, float* v)>;
// o: [rows, heads, 1, dh] through its element strides (b, head, d).
using PostRun = std::function<void(const float* o, int64_t so0, int64_t so1, int64_t so3, float* out)>;

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

// Inputs: h, offsets, [norm_w], (w, scales, biases) x nproj, [bias], [q_norm_w, k_norm_w],
// [inv_freqs], [long_inv_freqs].
class CpuBlockPre : public ParamPrimitive<PreParams> {
 public:
  CpuBlockPre(mx::Stream s, PreParams p) : ParamPrimitive(s, p, "CpuBlockPre") {
    if (p.has_freqs) return;
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
    float* q = outputs[0].data<float>();
    float* k = outputs[1].data<float>();
    float* v = outputs[2].data<float>();
    enc.dispatch([run = task(inputs), q, k, v]() { run(q, k, v); });
  }

  // The arithmetic of one call, from its evaluated inputs [h, offsets, ...] (the layer op
  // runs it inside its own task). The task may run after MLX has detached this primitive:
  // it owns copies of what it reads.
  PreRun task(const std::vector<mx::array>& inputs) const {
    const int64_t rows = inputs[0].shape(0);
    const int64_t hidden = inputs[0].shape(-1);
    const float* h = inputs[0].data<float>();
    const bool h_packed = row_contig(inputs[0]);
    const int64_t sh0 = inputs[0].strides()[0], sh2 = inputs[0].strides()[2];
    const int32_t* offsets = inputs[1].data<int32_t>();
    size_t at = 2;
    const float* wn = p_.has_norm ? inputs[at++].data<float>() : nullptr;
    std::vector<qmm::Weights> ws;
    int64_t widest = 0;
    for (int i = 0; i < p_.nproj; ++i, at += 3) {
      ws.push_back(qmm::weights_of(inputs[at], inputs[at + 1], inputs[at + 2], hidden, p_.gs[i], p_.bits[i], p_.x8));
      widest = std::max(widest, ws.back().n);
    }
    const float* bias = p_.has_bias ? inputs[at++].data<float>() : nullptr;
    const float* qn = p_.qk_norm ? inputs[at++].data<float>() : nullptr;
    const float* kn = p_.qk_norm ? inputs[at++].data<float>() : nullptr;
    const float* given = p_.has_freqs ? inputs[at++].data<float>() : nullptr;
    const float* given_long = p_.has_long ? inputs[at++].data<float>() : nullptr;
    return [=, p = p_, freqs = inv_freq_](float* q, float* k, float* v) {
      const float* inv = p.has_freqs ? given : freqs.data();
      const int64_t dq = int64_t(p.n_heads) * p.head_dim;
      const int64_t dkv = int64_t(p.n_kv) * p.head_dim;
      const int64_t width = dq + 2 * dkv;
      float* x = scratch(static_cast<size_t>(rows * (2 * hidden + width + widest)));
      float* qkv = x + rows * hidden;
      float* tmp = qkv + rows * width;
      const float* hr = rows_of(h, rows, hidden, sh0, sh2, h_packed, tmp + rows * widest);
      if (wn != nullptr) {
        for (int64_t r = 0; r < rows; ++r) rms_norm(hr + r * hidden, wn, p.eps, hidden, x + r * hidden);
      } else {
        std::memcpy(x, hr, sizeof(float) * rows * hidden);
      }
      products(x, rows, ws, qkv, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        float* src = qkv + r * width;
        if (bias != nullptr)
          for (int64_t i = 0; i < width; ++i) src[i] += bias[i];
        float* qr = q + r * dq;
        float* kr = k + r * dkv;
        std::memcpy(qr, src, sizeof(float) * dq);
        std::memcpy(kr, src + dq, sizeof(float) * dkv);
        std::memcpy(v + r * dkv, src + dq + dkv, sizeof(float) * dkv);
        if (p.qk_norm == 1) {
          for (int hd = 0; hd < p.n_heads; ++hd) rms_norm(qr + hd * p.head_dim, qn, p.qk_eps, p.head_dim, qr + hd * p.head_dim);
          for (int hd = 0; hd < p.n_kv; ++hd) rms_norm(kr + hd * p.head_dim, kn, p.qk_eps, p.head_dim, kr + hd * p.head_dim);
        } else if (p.qk_norm == 2) {
          rms_norm(qr, qn, p.qk_eps, dq, qr);
          rms_norm(kr, kn, p.qk_eps, dkv, kr);
        }
        const float pos = static_cast<float>(offsets[r]) * p.scale;
        // LongRoPE picks its set by each row's own position (segserve.server.runner.longrope).
        const bool lng = p.has_long && offsets[r] >= p.rope_switch;
        const float* iv = lng ? given_long : inv;
        const float ms = lng ? p.long_mscale : p.mscale;
        for (int hd = 0; hd < p.n_heads; ++hd) rope(qr + hd * p.head_dim, pos, p, iv, ms);
        for (int hd = 0; hd < p.n_kv; ++hd) rope(kr + hd * p.head_dim, pos, p, iv, ms);
      }
    };
  }

  int n_inputs() const {
    return 2 + p_.has_norm + 3 * p_.nproj + p_.has_bias + 2 * (p_.qk_norm != 0) + p_.has_freqs + p_.has_long;
  }

  const PreParams& params() const {
    return p_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int b = inputs[0].shape(0);
    return {{b, p_.n_heads, 1, p_.head_dim}, {b, p_.n_kv, 1, p_.head_dim}, {b, p_.n_kv, 1, p_.head_dim}};
  }

 private:
  std::vector<float> inv_freq_;
};

inline float gelu_tanh(float x) {
  // mlx.nn.gelu_approx: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
  return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * (x * x * x))));
}

// Inputs: h, o, (wo, so, bo), [o_bias], [attn_out_norm_w], [mlp_in_norm_w],
// (w, scales, biases) x ngu, [gu_bias], (wd, sd, bd), [d_bias], [mlp_out_norm_w].
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
    const float* op = o.data<float>();
    const int64_t so0 = o.strides()[0], so1 = o.strides()[1], so3 = o.strides()[3];
    float* out = outputs[0].data<float>();
    enc.dispatch([run = task(inputs[0], inputs, 2, o.shape(1), o.shape(3)), op, so0, so1, so3, out]() {
      run(op, so0, so1, so3, out);
    });
  }

  // The arithmetic of one call from evaluated h and the weights at inputs[first...]
  // (o, [rows, heads, 1, dh], comes to the task as a pointer and strides).
  PostRun task(const mx::array& h_in, const std::vector<mx::array>& inputs, size_t first, int64_t heads,
               int64_t dh) const {
    const int64_t rows = h_in.shape(0);
    const int64_t hidden = h_in.shape(-1);
    const float* h = h_in.data<float>();
    const bool h_packed = row_contig(h_in);
    const int64_t sh0 = h_in.strides()[0], sh2 = h_in.strides()[2];
    size_t at = first;
    const qmm::Weights wo =
        qmm::weights_of(inputs[at], inputs[at + 1], inputs[at + 2], heads * dh, p_.gs[0], p_.bits[0], p_.x8);
    at += 3;
    const float* ob = p_.o_bias ? inputs[at++].data<float>() : nullptr;
    const float* n_ao = p_.attn_out_norm ? inputs[at++].data<float>() : nullptr;
    const float* n_mi = p_.mlp_in_norm ? inputs[at++].data<float>() : nullptr;
    std::vector<qmm::Weights> wgu;
    for (int i = 0; i < p_.ngu; ++i, at += 3)
      wgu.push_back(
          qmm::weights_of(inputs[at], inputs[at + 1], inputs[at + 2], hidden, p_.gs[1 + i], p_.bits[1 + i], p_.x8));
    const float* gub = p_.gu_bias ? inputs[at++].data<float>() : nullptr;
    const int64_t inter = p_.ngu == 1 ? wgu[0].n / 2 : wgu[0].n;
    const qmm::Weights wd =
        qmm::weights_of(inputs[at], inputs[at + 1], inputs[at + 2], inter, p_.gs[3], p_.bits[3], p_.x8);
    at += 3;
    const float* db = p_.d_bias ? inputs[at++].data<float>() : nullptr;
    const float* n_mo = p_.mlp_out_norm ? inputs[at++].data<float>() : nullptr;
    return [=, p = p_](const float* op, int64_t so0, int64_t so1, int64_t so3, float* out) {
      const int64_t din = heads * dh;
      float* oc = scratch(static_cast<size_t>(rows * (din + 4 * hidden + 4 * inter)));
      float* x = oc + rows * din;          // [rows, hidden] the MLP's input
      float* gu = x + rows * hidden;       // [rows, 2 * inter]
      float* act = gu + rows * 2 * inter;  // [rows, inter]
      float* h1 = act + rows * inter;      // [rows, hidden]
      float* tmp = h1 + rows * hidden;     // [rows, max(hidden, inter)] branch before its norm
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t hd = 0; hd < heads; ++hd) {
          const float* src = op + r * so0 + hd * so1;
          float* dst = oc + r * din + hd * dh;
          for (int64_t d = 0; d < dh; ++d) dst[d] = src[d * so3];
        }
      qmm::run_now(oc, rows, wo, tmp);
      const float* hr = rows_of(h, rows, hidden, sh0, sh2, h_packed, out);
      // h1 = h + resid * [norm](o @ Wo.T + bo)
      for (int64_t r = 0; r < rows; ++r) {
        float* a = tmp + r * hidden;
        if (ob != nullptr)
          for (int64_t i = 0; i < hidden; ++i) a[i] += ob[i];
        if (n_ao != nullptr) rms_norm(a, n_ao, p.eps, hidden, a);
        const float* hrow = hr + r * hidden;
        float* h1r = h1 + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) h1r[i] = hrow[i] + a[i] * p.resid;
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (n_mi != nullptr) rms_norm(h1 + r * hidden, n_mi, p.eps, hidden, x + r * hidden);
        else std::memcpy(x + r * hidden, h1 + r * hidden, sizeof(float) * hidden);
      }
      products(x, rows, wgu, gu, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        float* g = gu + r * 2 * inter;
        if (gub != nullptr)
          for (int64_t i = 0; i < 2 * inter; ++i) g[i] += gub[i];
        const float* u = g + inter;
        float* a = act + r * inter;
        if (p.act == 1) {
          for (int64_t i = 0; i < inter; ++i) a[i] = gelu_tanh(g[i]) * u[i];
        } else {
          // silu(g) * u with silu(g) = g * sigmoid(g) (mlx.nn.silu)
          for (int64_t i = 0; i < inter; ++i) a[i] = (g[i] * (1.0f / (1.0f + std::exp(-g[i])))) * u[i];
        }
      }
      qmm::run_now(act, rows, wd, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        float* m = tmp + r * hidden;
        if (db != nullptr)
          for (int64_t i = 0; i < hidden; ++i) m[i] += db[i];
        if (n_mo != nullptr) rms_norm(m, n_mo, p.eps, hidden, m);
        const float* h1r = h1 + r * hidden;
        float* y = out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) y[i] = h1r[i] + m[i] * p.resid;
      }
    };
  }

  int n_weights() const {
    return 6 + p_.o_bias + p_.attn_out_norm + p_.mlp_in_norm + 3 * p_.ngu + p_.gu_bias + p_.d_bias + p_.mlp_out_norm;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// One decode row of a whole layer: block_pre's task, the segmented cache's write and
// attention (segattn::run_append), block_post's task, in one node.
// Inputs: h, offsets, pre's weights, post's weights, segments k0, v0, ..., k_buf, v_buf.
class CpuBlockLayer : public mx::Primitive {
 public:
  CpuBlockLayer(mx::Stream s, std::shared_ptr<CpuBlockPre> pre, std::shared_ptr<CpuBlockPost> post,
                int64_t start, float scale, float softcap, int64_t tail_from)
      : mx::Primitive(s), pre_(std::move(pre)), post_(std::move(post)), start_(start), scale_(scale),
        softcap_(softcap), tail_from_(tail_from) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const size_t n_pre = static_cast<size_t>(pre_->n_inputs());
    const size_t n_w = n_pre + static_cast<size_t>(post_->n_weights());
    for (size_t i = 1; i < n_w; ++i) {
      if (!row_contig(inputs[i])) throw std::runtime_error("CpuBlockLayer: weights and offsets must be row-contiguous");
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    attach(enc, inputs, outputs);
    const PreParams& pp = pre_->params();
    const int64_t dh = pp.head_dim, dq = int64_t(pp.n_heads) * dh, dkv = int64_t(pp.n_kv) * dh;
    PreRun pre = pre_->task(std::vector<mx::array>(inputs.begin(), inputs.begin() + n_pre));
    PostRun post = post_->task(inputs[0], inputs, n_pre, pp.n_heads, dh);
    const std::vector<mx::array> pieces(inputs.begin() + n_w, inputs.end());
    auto att = segattn::append_task(pieces, start_, pp.n_heads, scale_, softcap_, tail_from_);
    float* out = outputs[0].data<float>();
    enc.dispatch([pre = std::move(pre), post = std::move(post), att = std::move(att), out, dq, dkv, dh]() {
      float* q = scratch<1>(static_cast<size_t>(2 * dq + 2 * dkv));
      float* k = q + dq;
      float* v = k + dkv;
      float* o = v + dkv;
      pre(q, k, v);
      segattn::run_append(*att, q, k, v, o);
      post(o, dq, dh, 1, out);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("CpuBlockLayer runs on the CPU only");
  }

  const char* name() const override {
    return "CpuBlockLayer";
  }

  // Never merged with another node: it writes its tail buffers in place.
  bool is_equivalent(const mx::Primitive&) const override {
    return false;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  std::shared_ptr<CpuBlockPre> pre_;
  std::shared_ptr<CpuBlockPost> post_;
  int64_t start_;
  float scale_, softcap_;
  int64_t tail_from_;
};

bool f32_vector(const mx::array& a, int64_t n) {
  return a.dtype() == mx::float32 && a.ndim() == 1 && a.shape(0) == n;
}

}  // namespace

std::optional<std::vector<mx::array>> pre(const mx::array& h, const mx::array& offsets,
                                          const std::optional<mx::array>& norm_w, float eps,
                                          const std::vector<mx::array>& proj, const std::vector<int>& gs,
                                          const std::vector<int>& bits, const std::optional<mx::array>& bias,
                                          int qk_norm, const std::optional<mx::array>& q_norm_w,
                                          const std::optional<mx::array>& k_norm_w, float qk_eps, int n_heads,
                                          int n_kv_heads, int head_dim, int rope_dims, bool traditional,
                                          float rope_base, float rope_scale,
                                          const std::optional<mx::array>& inv_freqs, float rope_mscale,
                                          const std::optional<mx::array>& long_inv_freqs, float long_mscale,
                                          int rope_switch, const std::string& x8) {
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1) return std::nullopt;
  const int64_t hidden = h.shape(2);
  const int b = h.shape(0);
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 || offsets.shape(0) != b) return std::nullopt;
  if (norm_w && !f32_vector(*norm_w, hidden)) return std::nullopt;
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0) return std::nullopt;
  const int64_t dq = int64_t(n_heads) * head_dim, dkv = int64_t(n_kv_heads) * head_dim;
  const int nproj = static_cast<int>(proj.size() / 3);
  if ((nproj != 1 && nproj != 3) || proj.size() != size_t(3 * nproj)) return std::nullopt;
  if (gs.size() != size_t(nproj) || bits.size() != size_t(nproj)) return std::nullopt;
  const int64_t widths3[3] = {dq, dkv, dkv};
  PreParams p{};
  p.eps = eps;
  p.qk_eps = qk_eps;
  p.nproj = nproj;
  for (int i = 0; i < nproj; ++i) {
    const mx::array& w = proj[3 * i];
    if (!qmm::serves(hidden, w, proj[3 * i + 1], proj[3 * i + 2], gs[i], bits[i])) return std::nullopt;
    if (w.shape(0) != (nproj == 1 ? dq + 2 * dkv : widths3[i])) return std::nullopt;
    p.gs[i] = gs[i];
    p.bits[i] = bits[i];
  }
  if (bias && !f32_vector(*bias, dq + 2 * dkv)) return std::nullopt;
  if (qk_norm < 0 || qk_norm > 2 || (qk_norm != 0) != (q_norm_w.has_value() && k_norm_w.has_value())) return std::nullopt;
  if (qk_norm == 1 && !(f32_vector(*q_norm_w, head_dim) && f32_vector(*k_norm_w, head_dim))) return std::nullopt;
  if (qk_norm == 2 && !(f32_vector(*q_norm_w, dq) && f32_vector(*k_norm_w, dkv))) return std::nullopt;
  if (rope_dims <= 0 || rope_dims > head_dim || rope_dims % 2 != 0) return std::nullopt;
  if (inv_freqs && !f32_vector(*inv_freqs, rope_dims / 2)) return std::nullopt;
  if (long_inv_freqs && !(inv_freqs && f32_vector(*long_inv_freqs, rope_dims / 2))) return std::nullopt;
  p.has_norm = norm_w.has_value();
  p.has_bias = bias.has_value();
  p.qk_norm = qk_norm;
  p.n_heads = n_heads;
  p.n_kv = n_kv_heads;
  p.head_dim = head_dim;
  p.rope_dims = rope_dims;
  p.traditional = traditional;
  p.has_freqs = inv_freqs.has_value();
  p.base = rope_base;
  p.scale = rope_scale;
  p.mscale = rope_mscale;
  p.has_long = long_inv_freqs.has_value();
  p.long_mscale = p.has_long ? long_mscale : 1.0f;
  p.rope_switch = p.has_long ? rope_switch : 0;
  p.x8 = qmm::x8_want(x8);
  std::vector<mx::array> in = {h, offsets};
  if (norm_w) in.push_back(*norm_w);
  for (const auto& a : proj) in.push_back(a);
  if (bias) in.push_back(*bias);
  if (qk_norm) {
    in.push_back(*q_norm_w);
    in.push_back(*k_norm_w);
  }
  if (inv_freqs) in.push_back(*inv_freqs);
  if (long_inv_freqs) in.push_back(*long_inv_freqs);
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<CpuBlockPre>(s, p);
  std::vector<mx::Shape> shapes = {
      {b, n_heads, 1, head_dim}, {b, n_kv_heads, 1, head_dim}, {b, n_kv_heads, 1, head_dim}};
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, std::move(in));
}

std::optional<mx::array> post(const mx::array& h, const mx::array& o, const std::vector<mx::array>& wo,
                              const std::optional<mx::array>& o_bias,
                              const std::optional<mx::array>& attn_out_norm_w,
                              const std::optional<mx::array>& mlp_in_norm_w, const std::vector<mx::array>& gate_up,
                              const std::optional<mx::array>& gate_up_bias, const std::vector<mx::array>& down,
                              const std::optional<mx::array>& down_bias,
                              const std::optional<mx::array>& mlp_out_norm_w, const std::vector<int>& gs,
                              const std::vector<int>& bits, float eps, int act, float residual_multiplier,
                              const std::string& x8) {
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(1) != 1) return std::nullopt;
  const int64_t hidden = h.shape(2);
  if (o.dtype() != mx::float32 || o.ndim() != 4 || o.shape(0) != h.shape(0) || o.shape(2) != 1) return std::nullopt;
  const int ngu = static_cast<int>(gate_up.size() / 3);
  if (wo.size() != 3 || down.size() != 3 || (ngu != 1 && ngu != 2) || gate_up.size() != size_t(3 * ngu)) return std::nullopt;
  if (gs.size() != size_t(2 + ngu) || bits.size() != gs.size() || act < 0 || act > 1) return std::nullopt;
  const int64_t din = static_cast<int64_t>(o.shape(1)) * o.shape(3);
  if (!qmm::serves(din, wo[0], wo[1], wo[2], gs[0], bits[0]) || wo[0].shape(0) != hidden) return std::nullopt;
  for (int i = 0; i < ngu; ++i)
    if (!qmm::serves(hidden, gate_up[3 * i], gate_up[3 * i + 1], gate_up[3 * i + 2], gs[1 + i], bits[1 + i]))
      return std::nullopt;
  if (ngu == 1 && gate_up[0].shape(0) % 2 != 0) return std::nullopt;
  if (ngu == 2 && gate_up[0].shape(0) != gate_up[3].shape(0)) return std::nullopt;
  const int64_t inter = ngu == 1 ? gate_up[0].shape(0) / 2 : gate_up[0].shape(0);
  const int gd = gs[1 + ngu], bd = bits[1 + ngu];
  if (!qmm::serves(inter, down[0], down[1], down[2], gd, bd) || down[0].shape(0) != hidden) return std::nullopt;
  for (const auto* n : {&attn_out_norm_w, &mlp_in_norm_w, &mlp_out_norm_w, &o_bias, &down_bias})
    if (n->has_value() && !f32_vector(**n, hidden)) return std::nullopt;
  if (gate_up_bias && !f32_vector(*gate_up_bias, 2 * inter)) return std::nullopt;
  PostParams p{};
  p.eps = eps;
  p.resid = residual_multiplier;
  p.ngu = ngu;
  p.gs[0] = gs[0];
  p.bits[0] = bits[0];
  for (int i = 0; i < ngu; ++i) {
    p.gs[1 + i] = gs[1 + i];
    p.bits[1 + i] = bits[1 + i];
  }
  p.gs[3] = gd;
  p.bits[3] = bd;
  p.o_bias = o_bias.has_value();
  p.attn_out_norm = attn_out_norm_w.has_value();
  p.mlp_in_norm = mlp_in_norm_w.has_value();
  p.gu_bias = gate_up_bias.has_value();
  p.d_bias = down_bias.has_value();
  p.mlp_out_norm = mlp_out_norm_w.has_value();
  p.act = act;
  p.x8 = qmm::x8_want(x8);
  std::vector<mx::array> in = {h, o, wo[0], wo[1], wo[2]};
  for (const auto* a : {&o_bias, &attn_out_norm_w, &mlp_in_norm_w})
    if (a->has_value()) in.push_back(**a);
  for (const auto& a : gate_up) in.push_back(a);
  if (gate_up_bias) in.push_back(*gate_up_bias);
  for (const auto& a : down) in.push_back(a);
  for (const auto* a : {&down_bias, &mlp_out_norm_w})
    if (a->has_value()) in.push_back(**a);
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<CpuBlockPost>(s, p);
  return mx::array(h.shape(), mx::float32, std::move(prim), std::move(in));
}

struct LayerPlan::Impl {
  std::shared_ptr<CpuBlockPre> pre;
  std::shared_ptr<CpuBlockPost> post;
  std::vector<mx::array> weights;  // pre's after h and offsets, then post's after h and o
  int64_t hidden;
};

LayerPlan::LayerPlan(const array& pre_out, const array& post_out) {
  auto pre = pre_out.has_primitive() ? std::dynamic_pointer_cast<CpuBlockPre>(pre_out.primitive_ptr()) : nullptr;
  auto post = post_out.has_primitive() ? std::dynamic_pointer_cast<CpuBlockPost>(post_out.primitive_ptr()) : nullptr;
  if (pre == nullptr || post == nullptr) {
    throw std::invalid_argument("BlockLayer takes an output of block_pre and one of block_post");
  }
  const auto& pi = pre_out.inputs();
  const auto& qi = post_out.inputs();
  if (pi.size() != size_t(pre->n_inputs()) || qi.size() != size_t(2 + post->n_weights()) ||
      pi[0].shape(-1) != qi[0].shape(-1) || qi[1].shape(1) != pre->params().n_heads ||
      qi[1].shape(3) != pre->params().head_dim) {
    throw std::invalid_argument("BlockLayer: block_pre's and block_post's shapes disagree");
  }
  auto impl = std::make_shared<Impl>();
  impl->pre = pre;
  impl->post = post;
  impl->weights.assign(pi.begin() + 2, pi.end());
  impl->weights.insert(impl->weights.end(), qi.begin() + 2, qi.end());
  impl->hidden = pi[0].shape(-1);
  impl_ = std::move(impl);
}

std::optional<array> LayerPlan::step(const array& h, const array& offsets, const std::vector<array>& pieces,
                                     int64_t start, float scale, float softcap, int64_t tail_from) const {
  const Impl& m = *impl_;
  const PreParams& pp = m.pre->params();
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(0) != 1 || h.shape(1) != 1 || h.shape(2) != m.hidden)
    return std::nullopt;
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 || offsets.shape(0) != 1) return std::nullopt;
  if (softcap < 0.0f || !segattn::append_served(pp.n_heads, pieces, start, tail_from)) return std::nullopt;
  const mx::array& k_buf = pieces[pieces.size() - 2];
  if (k_buf.shape(1) != pp.n_kv || k_buf.shape(3) != pp.head_dim) return std::nullopt;
  std::vector<mx::array> in;
  in.reserve(2 + m.weights.size() + pieces.size());
  in.push_back(h);
  in.push_back(offsets);
  in.insert(in.end(), m.weights.begin(), m.weights.end());
  in.insert(in.end(), pieces.begin(), pieces.end());
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<CpuBlockLayer>(s, m.pre, m.post, start, scale, softcap, tail_from);
  return mx::array(h.shape(), mx::float32, std::move(prim), std::move(in));
}

}  // namespace block
