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
//
// Append form (`segmented_attention_append`, the decode step of a segmented cache): the
// inputs end with the tail's buffers and this step's new rows, [..., k_buf, v_buf, k_new,
// v_new]; the task first writes the new rows into the buffers at row `start` (rounding
// them to the buffers' dtype), then attends with the tail = the buffers' first start + n
// rows. Why: per layer that replaces two slice_updates, two dtype casts and two slices
// (six MLX nodes, ~25 us on the 2-core CPU) with nothing. The buffers are the request's
// private tail (segserve.kv.segmented: never a segment, never shared), evaluated and row-contiguous
// (checked on the graph side), so writing them in place is what MLX's own slice_update
// does when it may donate its input.
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
  total += 2 * align_up(sizeof(int64_t) * rb);              // n, lo
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

// One append: the new rows [B, H, n, D] (any strides) and the buffer [B, H, cap, D]
// (row-contiguous) they go to at row `start`.
struct RowsCopy {
  const char* src;
  int src_dtype;
  int64_t src_stride[4];
  char* dst;
  int dst_dtype;
  int64_t b, h, n, d, cap, start;
};

template <class T>
float load_as_float(const char* p) {
  return static_cast<float>(*reinterpret_cast<const T*>(p));
}

template <class T>
void store_float(char* p, float x) {
  *reinterpret_cast<T*>(p) = static_cast<T>(x);
}

float load_code(const char* p, int code) {
  if (code == SEGATTN_F16) return load_as_float<mx::float16_t>(p);
  if (code == SEGATTN_BF16) return load_as_float<mx::bfloat16_t>(p);
  return load_as_float<float>(p);
}

void copy_rows(const RowsCopy& c) {
  const size_t src_size = c.src_dtype == SEGATTN_F32 ? 4 : 2;
  const size_t dst_size = c.dst_dtype == SEGATTN_F32 ? 4 : 2;
  for (int64_t b = 0; b < c.b; ++b)
    for (int64_t h = 0; h < c.h; ++h)
      for (int64_t l = 0; l < c.n; ++l) {
        const char* src = c.src + (b * c.src_stride[0] + h * c.src_stride[1] + l * c.src_stride[2]) *
                                      static_cast<int64_t>(src_size);
        char* dst = c.dst + (((b * c.h + h) * c.cap) + c.start + l) * c.d * static_cast<int64_t>(dst_size);
        for (int64_t d = 0; d < c.d; ++d) {
          const float x = load_code(src + d * c.src_stride[3] * static_cast<int64_t>(src_size), c.src_dtype);
          char* o = dst + d * static_cast<int64_t>(dst_size);
          if (c.dst_dtype == SEGATTN_F16) store_float<mx::float16_t>(o, x);
          else if (c.dst_dtype == SEGATTN_BF16) store_float<mx::bfloat16_t>(o, x);
          else store_float<float>(o, x);
        }
      }
}

RowsCopy rows_copy(const mx::array& src, const mx::array& buf, int64_t start) {
  RowsCopy c{};
  c.src = src.data<char>();
  c.src_dtype = dtype_code(src.dtype());
  for (int i = 0; i < 4; ++i) c.src_stride[i] = src.strides()[i];
  c.dst = const_cast<char*>(buf.data<char>());  // the private tail buffer (see the header)
  c.dst_dtype = dtype_code(buf.dtype());
  c.b = src.shape(0);
  c.h = src.shape(1);
  c.n = src.shape(2);
  c.d = src.shape(3);
  c.cap = buf.shape(2);
  c.start = start;
  return c;
}

// A K/V piece read in place through its strides, its first `rows` rows.
SegAttnPiece piece_of(const mx::array& k, const mx::array& v, int64_t rows) {
  SegAttnPiece p{};
  p.k = k.data<char>();
  p.v = v.data<char>();
  p.rows = rows;
  for (int d = 0; d < 4; ++d) {
    p.k_stride[d] = k.strides()[d];
    p.v_stride[d] = v.strides()[d];
  }
  return p;
}

// ---------------------------------------------------------------------------------------
// The primitive.
// ---------------------------------------------------------------------------------------
class SegmentedAttention : public mx::Primitive {
 public:
  // append_start >= 0: the append form (see the file header), new rows go to that row.
  SegmentedAttention(mx::Stream stream, float scale, bool causal_tail, const IsaEntry* isa,
                     int64_t append_start = -1, int64_t window = 0, float softcap = 0.0f)
      : mx::Primitive(stream), scale_(scale), causal_tail_(causal_tail), isa_(isa),
        append_start_(append_start), window_(window), softcap_(softcap) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& q = inputs[0];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);

    SegAttnArgs args{};
    const bool append = append_start_ >= 0;
    // The append form's last two inputs are the new rows, not a piece.
    const size_t n_kv_inputs = inputs.size() - (append ? 2 : 0);
    std::vector<RowsCopy> copies;
    if (append) {
      const mx::array& k_buf = inputs[n_kv_inputs - 2];
      const mx::array& v_buf = inputs[n_kv_inputs - 1];
      copies = {rows_copy(inputs[n_kv_inputs], k_buf, append_start_),
                rows_copy(inputs[n_kv_inputs + 1], v_buf, append_start_)};
    }
    args.dtype = dtype_code(q.dtype());
    args.kv_dtype = inputs.size() > 1 ? dtype_code(inputs[1].dtype()) : args.dtype;
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
    for (size_t i = 1; i + 1 < n_kv_inputs; i += 2) {
      const mx::array& k = inputs[i];
      const mx::array& v = inputs[i + 1];
      const bool is_tail = i + 2 == n_kv_inputs;
      // The append form's tail: the buffers' rows up to and including this step's.
      const int64_t rows = append && is_tail ? append_start_ + inputs[n_kv_inputs].shape(2) : k.shape(2);
      if (rows == 0) continue;
      pieces.push_back(piece_of(k, v, rows));
      tail_live = is_tail;
    }
    args.n_pieces = static_cast<int>(pieces.size());
    args.last_is_causal = (causal_tail_ && tail_live) ? 1 : 0;
    args.window = window_;
    args.softcap = softcap_;
    const int rows = (args.n_q_heads / args.n_kv_heads) * args.n_queries;
    if (rows < args.row_block) args.row_block = rows;  // smaller scratch for decode

    encoder.dispatch([args, pieces = std::move(pieces), copies = std::move(copies), isa = isa_,
                      nbytes = out.nbytes()]() {
      for (const RowsCopy& c : copies) copy_rows(c);
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
           o->isa_ == isa_ && o->append_start_ == append_start_ && o->window_ == window_ &&
           o->softcap_ == softcap_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_tail_;
  const IsaEntry* isa_;
  int64_t append_start_;
  int64_t window_;
  float softcap_;
};

bool served_head_dim(int d) {
  return d == 64 || d == 128 || d == 256;
}

bool served_query(const mx::array& q) {
  return q.ndim() == 4 && dtype_code(q.dtype()) >= 0 && served_head_dim(q.shape(3));
}

// K/V pieces [b, Hkv, S, D] the kernel serves under queries of `b` rows, `n_q_heads` heads
// of head size d (served_head_dim) in q_dtype.
bool served_pieces(int b, int n_q_heads, int d, mx::Dtype q_dtype, const std::vector<mx::array>& kv) {
  if (kv.size() % 2 != 0 || kv.empty()) return false;
  const int hkv = kv[0].ndim() == 4 ? kv[0].shape(1) : 0;
  if (hkv <= 0 || n_q_heads % hkv != 0) return false;
  // K/V share one dtype: q's, or float16/bfloat16 under float32 queries (the CPU keeps its
  // KV cache at half size, as llama.cpp does; scores and sums stay float32 either way).
  const mx::Dtype kv_type = kv[0].dtype();
  const bool half_kv = q_dtype == mx::float32 && (kv_type == mx::float16 || kv_type == mx::bfloat16);
  if (kv_type != q_dtype && !half_kv) return false;
  for (size_t i = 0; i < kv.size(); i += 2) {
    const mx::array& k = kv[i];
    const mx::array& v = kv[i + 1];
    if (k.dtype() != kv_type || v.dtype() != kv_type) return false;
    if (k.ndim() != 4 || k.shape() != v.shape()) return false;
    if (k.shape(0) != b || k.shape(1) != hkv || k.shape(3) != d) return false;
  }
  return true;
}

// Shapes and dtypes the kernel serves (see segmented_attention in the header).
bool served(const mx::array& q, const std::vector<mx::array>& kv) {
  return served_query(q) && served_pieces(q.shape(0), q.shape(1), q.shape(3), q.dtype(), kv);
}

// An evaluated buffer the op may write rows into: its own contiguous bytes.
bool writable(const mx::array& buf) {
  return buf.is_available() && buf.flags().row_contiguous && buf.data_size() == buf.size() &&
         buf.ndim() == 4;
}

}  // namespace

std::optional<mx::array> segmented_attention_append(const mx::array& q,
                                                    const std::vector<mx::array>& segments,
                                                    const mx::array& k_new, const mx::array& v_new,
                                                    const mx::array& k_buf, const mx::array& v_buf,
                                                    int64_t start, float scale) {
  std::vector<mx::array> kv(segments);
  kv.push_back(k_buf);
  kv.push_back(v_buf);
  if (!served(q, kv) || !writable(k_buf) || !writable(v_buf) || k_buf.shape() != v_buf.shape()) {
    return std::nullopt;
  }
  if (k_new.ndim() != 4 || k_new.shape() != v_new.shape() || dtype_code(k_new.dtype()) < 0 ||
      v_new.dtype() != k_new.dtype()) {
    return std::nullopt;
  }
  if (k_new.shape(0) != k_buf.shape(0) || k_new.shape(1) != k_buf.shape(1) ||
      k_new.shape(3) != k_buf.shape(3) || start < 0 || start + k_new.shape(2) > k_buf.shape(2)) {
    return std::nullopt;
  }
  std::vector<mx::array> inputs;
  inputs.reserve(kv.size() + 3);
  inputs.push_back(q);
  inputs.insert(inputs.end(), kv.begin(), kv.end());
  inputs.push_back(k_new);
  inputs.push_back(v_new);
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<SegmentedAttention>(s, scale, true, current_isa(), start);
  return mx::array(q.shape(), q.dtype(), std::move(prim), std::move(inputs));
}

struct AppendTask {
  SegAttnArgs args;  // q and out set by run_append
  std::vector<SegAttnPiece> pieces;  // the segments, then the tail (its rows: start + 1)
  RowsCopy k_copy, v_copy;  // src set by run_append
  const IsaEntry* isa;
};

bool append_served(int n_q_heads, const std::vector<mx::array>& pieces, int64_t start, int64_t tail_from) {
  if (pieces.size() < 2 || tail_from < 0 || tail_from > start || (tail_from > 0 && pieces.size() != 2)) return false;
  const mx::array& k_buf = pieces[pieces.size() - 2];
  const mx::array& v_buf = pieces.back();
  if (k_buf.ndim() != 4 || !served_head_dim(k_buf.shape(3))) return false;
  return served_pieces(1, n_q_heads, k_buf.shape(3), mx::float32, pieces) && writable(k_buf) &&
         writable(v_buf) && start >= 0 && start + 1 <= k_buf.shape(2);
}

std::shared_ptr<const AppendTask> append_task(const std::vector<mx::array>& pieces, int64_t start,
                                              int n_q_heads, float scale, float softcap, int64_t tail_from) {
  auto t = std::make_shared<AppendTask>();
  const mx::array& k_buf = pieces[pieces.size() - 2];
  const mx::array& v_buf = pieces.back();
  const int64_t hkv = k_buf.shape(1), d = k_buf.shape(3);
  SegAttnArgs& a = t->args;
  a.dtype = SEGATTN_F32;
  a.kv_dtype = dtype_code(k_buf.dtype());
  a.batch = 1;
  a.n_q_heads = n_q_heads;
  a.n_kv_heads = static_cast<int>(hkv);
  a.n_queries = 1;
  a.head_dim = static_cast<int>(d);
  const int64_t q_strides[4] = {int64_t(n_q_heads) * d, d, d, 1};
  for (int i = 0; i < 4; ++i) a.q_stride[i] = q_strides[i];
  a.scale = scale;
  a.softcap = softcap;
  a.window = 0;  // the caller clipped the segments to the window (views)
  a.row_block = std::min(kRowBlock, n_q_heads / a.n_kv_heads);
  for (size_t i = 0; i < pieces.size(); i += 2) {
    const bool tail = i + 2 == pieces.size();
    const int64_t rows = tail ? start + 1 - tail_from : pieces[i].shape(2);
    if (rows == 0) continue;
    SegAttnPiece p = piece_of(pieces[i], pieces[i + 1], rows);
    if (tail && tail_from > 0) {  // the window's first row: a view of the buffers from there
      p.k = static_cast<const char*>(p.k) + tail_from * p.k_stride[2] * pieces[i].itemsize();
      p.v = static_cast<const char*>(p.v) + tail_from * p.v_stride[2] * pieces[i + 1].itemsize();
    }
    t->pieces.push_back(p);
  }
  a.n_pieces = static_cast<int>(t->pieces.size());
  a.last_is_causal = 1;  // one query row at the tail's last position: sees every tail row
  const int64_t src_strides[4] = {hkv * d, d, d, 1};
  for (RowsCopy* c : {&t->k_copy, &t->v_copy}) {
    const mx::array& buf = c == &t->k_copy ? k_buf : v_buf;
    c->src_dtype = SEGATTN_F32;
    for (int i = 0; i < 4; ++i) c->src_stride[i] = src_strides[i];
    c->dst = const_cast<char*>(buf.data<char>());  // the private tail buffer (see the header)
    c->dst_dtype = dtype_code(buf.dtype());
    c->b = 1;
    c->h = hkv;
    c->n = 1;
    c->d = d;
    c->cap = buf.shape(2);
    c->start = start;
  }
  t->isa = current_isa();
  return t;
}

void run_append(const AppendTask& task, const float* q, const float* k_new, const float* v_new, float* out) {
  RowsCopy kc = task.k_copy, vc = task.v_copy;
  kc.src = reinterpret_cast<const char*>(k_new);
  vc.src = reinterpret_cast<const char*>(v_new);
  copy_rows(kc);
  copy_rows(vc);
  SegAttnArgs args = task.args;
  args.q = q;
  args.out = out;
  run_kernel(args, task.pieces, task.isa);
}

std::optional<mx::array> segmented_attention(const mx::array& q,
                                             const std::vector<mx::array>& kv, float scale,
                                             bool causal_tail, int64_t window, float softcap) {
  if (window < 0 || softcap < 0.0f) return std::nullopt;
  if (kv.empty() && served_query(q)) return mx::zeros(q.shape(), q.dtype(), mx::Device::cpu);
  if (!served(q, kv)) return std::nullopt;
  std::vector<mx::array> inputs;
  inputs.reserve(kv.size() + 1);
  inputs.push_back(q);
  inputs.insert(inputs.end(), kv.begin(), kv.end());
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  auto prim = std::make_shared<SegmentedAttention>(s, scale, causal_tail, current_isa(), -1, window,
                                                   softcap);
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
