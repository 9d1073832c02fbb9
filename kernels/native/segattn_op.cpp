// The MLX primitive: attention of a query block over every K/V piece (segments + tail) in
// one CPU op, reading each piece in place through its strides (no K/V copy, no concat).
//
// Graph side (`segmented_attention`): validates shapes/dtypes, returns nullopt for what the
// kernel does not serve (the Python route then composes), else one array whose primitive
// is SegmentedAttention with inputs [q, k0, v0, k1, v1, ...] (tail last).
//
// Eval side (`eval_cpu`): allocates the output, registers inputs/output with the stream's
// CPU command encoder and dispatches one task onto the stream's thread, the way MLX's own
// CPU primitives do, so the op is ordered with the ops that produce its inputs (e.g. the
// slice_update that wrote the tail this step). The task runs the kernel body picked for
// this CPU (segattn_kernel.cpp: AVX-512, AVX2+FMA+F16C, or portable) over work items
// (batch, kv head, query-row block[, key split]) on the stream thread plus the extension's
// worker pool (see `default_threads`); key splits are merged by their (max, sum).
#include "segattn_op.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_isa.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "qmm_op.h"
#include "segattn.h"

namespace mx = mlx::core;

namespace segattn {

namespace {

// ---------------------------------------------------------------------------------------
// ISA selection.
// ---------------------------------------------------------------------------------------
struct IsaEntry {
  const char* name;
  SegAttnRunFn run;
  SegAttnRunFn merge;
  bool (*supported)();
};

// Default first. AVX2 leads although AVX-512 is there: on the Ice Lake Xeon this was
// measured on (a 2-vCPU VM) zmm FMAs issue at ~0.6 per cycle against ~1.1 for ymm, and the
// AVX-512 body was no faster overall (within +-15 % on 8..64-row windows, ~30 % slower on
// short decode). SEGATTN_ISA=avx512 (or _segattn.set_isa) selects it to compare.
const IsaEntry kIsas[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"avx2", &segattn_run_avx2, &segattn_merge_avx2, &cpu_isa::has_avx2},
    {"avx512", &segattn_run_avx512, &segattn_merge_avx512, &cpu_isa::has_avx512f},
#endif
    {"generic", &segattn_run_generic, &segattn_merge_generic, &cpu_isa::always},
};

cpu_isa::Choice g_isa(kIsas, "SEGATTN_ISA");

const IsaEntry* current_isa() {
  return g_isa.current();
}

// ---------------------------------------------------------------------------------------
// Scratch and the worker pool.
// ---------------------------------------------------------------------------------------
constexpr int kRowBlock = 32;  // packed query rows per work item

size_t align_up(size_t x) {
  return (x + 63) & ~size_t(63);
}

size_t scratch_bytes(const SegAttnArgs& a) {
  const size_t rb = static_cast<size_t>(a.row_block);
  const size_t d = static_cast<size_t>(a.head_dim);
  size_t total = 64;  // alignment of the base
  total += 2 * align_up(sizeof(float) * rb * d);            // qs, acc
  total += align_up(sizeof(float) * rb * SEGATTN_TILE);     // s
  total += 2 * align_up(sizeof(float) * rb);                // m, l
  total += align_up(sizeof(int64_t) * rb);                  // n
  total += align_up(sizeof(int) * rb);                      // active
  total += 2 * align_up(sizeof(float) * SEGATTN_TILE * d);  // k/v tiles (itemsize <= 4)
  return total;
}

char* thread_scratch(size_t bytes) {
  thread_local std::vector<char> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

// Threads one op may use: min(2, cores) by default, SEGATTN_THREADS overrides. The items
// run on the extension's one worker pool (qmm::parallel_for, qmm_op.cpp), whose workers spin
// a short while after each job: in a decode step they are still spinning from the layer's
// products when the attention call starts, so no wake-up is paid. Measured on the 2-core
// machine with this op's earlier pool (sleeping workers): 2 threads took decode at 2K keys
// from 175 to 135 us, at 8K from 716 to 487 us, an 8-row window at 2K from 1095 to 665 us.
int default_threads() {
  const char* env = std::getenv("SEGATTN_THREADS");
  if (env != nullptr && std::atoi(env) >= 1) return std::atoi(env);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw >= 2 ? 2 : 1;
}

std::atomic<int>& wanted_threads() {
  static std::atomic<int> n{default_threads()};
  return n;
}

// Work below this many multiply-adds (G*L*S*D per kv head, summed) stays on one thread.
constexpr int64_t kParallelMinWork = int64_t(1) << 17;

float* thread_partial(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

void run_kernel(SegAttnArgs args, const std::vector<SegAttnPiece>& pieces, const IsaEntry* isa) {
  args.pieces = pieces.data();
  args.total_keys = 0;
  for (const auto& p : pieces) args.total_keys += p.rows;
  const int64_t rows = static_cast<int64_t>(args.n_q_heads / args.n_kv_heads) * args.n_queries;
  const int64_t blocks = (rows + args.row_block - 1) / args.row_block;
  const int64_t base_items = static_cast<int64_t>(args.batch) * args.n_kv_heads * blocks;
  const size_t scratch = scratch_bytes(args);
  const int64_t work = static_cast<int64_t>(args.batch) * args.n_q_heads * args.n_queries *
                       args.total_keys * args.head_dim;
  const int threads = segattn::threads();
  const bool parallel = threads > 1 && work >= kParallelMinWork;
  // Few items that do not divide among the threads (decode: 3 kv heads on 2 threads):
  // split the keys too, so every thread gets the same share, and merge by (m, l).
  args.n_splits = 1;
  if (parallel && base_items % threads != 0 && base_items < 4 * threads &&
      args.total_keys >= 2LL * threads * SEGATTN_TILE) {
    args.n_splits = threads;
  }
  const int64_t items = base_items * args.n_splits;
  args.partial = nullptr;
  if (args.n_splits > 1) {
    args.partial = thread_partial(static_cast<size_t>(items) * args.row_block * (2 + args.head_dim));
  }
  if (parallel && items > 1) {
    // An item: one query-row block of one kv head (and key split).
    qmm::parallel_for(items, [&](int64_t i) { isa->run(&args, i, i + 1, thread_scratch(scratch)); });
  } else {
    isa->run(&args, 0, items, thread_scratch(scratch));
  }
  if (args.n_splits > 1) isa->merge(&args, 0, base_items, thread_scratch(scratch));
}

int dtype_code(mx::Dtype t) {
  if (t == mx::float32) return SEGATTN_F32;
  if (t == mx::float16) return SEGATTN_F16;
  if (t == mx::bfloat16) return SEGATTN_BF16;
  return -1;
}

// ---------------------------------------------------------------------------------------
// The primitive.
// ---------------------------------------------------------------------------------------
class SegmentedAttention : public mx::Primitive {
 public:
  SegmentedAttention(mx::Stream stream, float scale, bool causal_tail, const IsaEntry* isa)
      : mx::Primitive(stream), scale_(scale), causal_tail_(causal_tail), isa_(isa) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& q = inputs[0];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);

    SegAttnArgs args{};
    args.dtype = dtype_code(q.dtype());
    args.batch = q.shape(0);
    args.n_q_heads = q.shape(1);
    args.n_queries = q.shape(2);
    args.head_dim = q.shape(3);
    args.n_kv_heads = inputs.size() > 1 ? inputs[1].shape(1) : 1;
    args.q = q.data<char>();
    for (int i = 0; i < 4; ++i) args.q_stride[i] = q.strides()[i];
    args.out = out.data<char>();
    args.scale = scale_;
    args.row_block = kRowBlock;

    std::vector<SegAttnPiece> pieces;
    pieces.reserve((inputs.size() - 1) / 2);
    bool tail_live = false;
    for (size_t i = 1; i + 1 < inputs.size(); i += 2) {
      const mx::array& k = inputs[i];
      const mx::array& v = inputs[i + 1];
      const bool is_tail = i + 2 == inputs.size();
      if (k.shape(2) == 0) continue;
      SegAttnPiece p{};
      p.k = k.data<char>();
      p.v = v.data<char>();
      p.rows = k.shape(2);
      for (int d = 0; d < 4; ++d) {
        p.k_stride[d] = k.strides()[d];
        p.v_stride[d] = v.strides()[d];
      }
      pieces.push_back(p);
      tail_live = is_tail;
    }
    args.n_pieces = static_cast<int>(pieces.size());
    args.last_is_causal = (causal_tail_ && tail_live) ? 1 : 0;
    const int rows = (args.n_q_heads / args.n_kv_heads) * args.n_queries;
    if (rows < args.row_block) args.row_block = rows;  // smaller scratch for decode

    encoder.dispatch([args, pieces = std::move(pieces), isa = isa_, nbytes = out.nbytes()]() {
      if (pieces.empty()) {  // no key anywhere: zeros
        std::memset(args.out, 0, nbytes);
        return;
      }
      run_kernel(args, pieces, isa);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("SegmentedAttention runs on the CPU only");
  }

  const char* name() const override {
    return "SegmentedAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const SegmentedAttention*>(&other);
    return o != nullptr && o->scale_ == scale_ && o->causal_tail_ == causal_tail_ &&
           o->isa_ == isa_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_tail_;
  const IsaEntry* isa_;
};

}  // namespace

std::optional<mx::array> segmented_attention(const mx::array& q,
                                             const std::vector<mx::array>& kv, float scale,
                                             bool causal_tail) {
  if (q.ndim() != 4 || dtype_code(q.dtype()) < 0) return std::nullopt;
  const int d = q.shape(3);
  if (d != 64 && d != 128 && d != 256) return std::nullopt;
  if (kv.size() % 2 != 0) return std::nullopt;
  if (kv.empty()) return mx::zeros(q.shape(), q.dtype(), mx::Device::cpu);
  const int b = q.shape(0);
  const int hkv = kv[0].ndim() == 4 ? kv[0].shape(1) : 0;
  if (hkv <= 0 || q.shape(1) % hkv != 0) return std::nullopt;
  for (size_t i = 0; i < kv.size(); i += 2) {
    const mx::array& k = kv[i];
    const mx::array& v = kv[i + 1];
    if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) return std::nullopt;
    if (k.ndim() != 4 || k.shape() != v.shape()) return std::nullopt;
    if (k.shape(0) != b || k.shape(1) != hkv || k.shape(3) != d) return std::nullopt;
  }
  std::vector<mx::array> inputs;
  inputs.reserve(kv.size() + 1);
  inputs.push_back(q);
  inputs.insert(inputs.end(), kv.begin(), kv.end());
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<SegmentedAttention>(s, scale, causal_tail, current_isa());
  return mx::array(q.shape(), q.dtype(), std::move(prim), std::move(inputs));
}

std::string isa() {
  return current_isa()->name;
}

std::vector<std::string> supported_isas() {
  return g_isa.supported_names();
}

void set_isa(const std::string& name) {
  g_isa.set(name);
}

int threads() {
  return std::min(wanted_threads().load(), qmm::threads());
}

void set_threads(int n) {
  if (n < 1) throw std::invalid_argument("threads must be >= 1");
  wanted_threads().store(n);
}

}  // namespace segattn
