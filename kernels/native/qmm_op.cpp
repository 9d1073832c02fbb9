// The MLX primitive: y = x @ dequant(W).T on the CPU for MLX's affine quantized format
// (the product `mx.quantized_matmul(x, w, scales, biases, transpose=True)` computes).
//
// Graph side (`quantized_matmul`): validates dtypes/shapes, returns nullopt for what the
// kernel does not serve (the Python drop-in then calls mx.quantized_matmul), else one array
// whose primitive is CpuQuantizedMatmul with inputs [x2d, w, scales, biases] (leading dims
// of x are flattened around it).
//
// Eval side (`eval_cpu`): allocates the output, registers inputs/output with the stream's
// CPU command encoder and dispatches one task onto the stream's thread (ordered with the
// ops around it, as MLX's own CPU primitives are). The task writes x in the body's block
// order plus per-group sums of x into per-thread scratch (qmm_prep_*), then splits the
// output columns between the stream thread and a small persistent pool (qmm_run_*).
//
// Pool: one op is ~10-100 us at decode (210 calls per token on SmolLM2), so a condition
// variable wake per call would cost a visible share; workers spin (pause) for a short
// while after each job, then sleep. QMM_SPIN_US sets the spin (default 50, 0 = never).
// The segment attention op (segattn_op.cpp) runs its items on the same pool
// (`parallel_for`): one set of workers, still spinning from the layer's products when the
// attention call starts.
#include "qmm_op.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
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
#include "qmm.h"

namespace mx = mlx::core;

namespace qmm {

namespace {

// ---------------------------------------------------------------------------------------
// ISA selection (same scheme as segattn_op.cpp; QMM_ISA overrides).
// ---------------------------------------------------------------------------------------
struct IsaEntry {
  const char* name;
  QmmRunFn run;
  QmmPrepFn prep;
  QmmRunFn gemm;
  QmmGemmPackFn gemm_pack;
  QmmGemmTileFn gemm_tile;
  QmmRunFn dot8;  // decode rows with 8-bit x (qmm_dot8.cpp)
  QmmPrep8Fn prep8;
  QmmRunFn gemm8;  // many rows with 8-bit x (qmm_dot8.cpp)
  bool (*supported)();
};

#if defined(__x86_64__) || defined(_M_X64)
// The AVX-512 entry's 8-bit-x decode body: VNNI where the CPU has it (and AVX-512 VL for
// its ymm form), else the AVX2 one (Skylake-X: AVX-512 without VNNI).
void dot8_avx512(const QmmArgs* args, int64_t n0, int64_t n1) {
  static const QmmRunFn body = cpu_isa::has_avx512vnni() ? &qmm_dot8_vnni : &qmm_dot8_avx2;
  body(args, n0, n1);
}

void gemm8_avx512(const QmmArgs* args, int64_t n0, int64_t n1) {
  static const QmmRunFn body = cpu_isa::has_avx512vnni() ? &qmm_gemm8_vnni : &qmm_gemm8_avx2;
  body(args, n0, n1);
}
#endif

// Default first. AVX-512 leads here (unlike the attention op): bench/qmm_cpu.py runs both
// bodies side by side; on the 2-vCPU Ice Lake VM decode (1 row) was equal or faster with
// zmm on most shapes (one 64-byte load per 128 4-bit weights), 4..16 rows within noise,
// and the prefill GEMM (512 rows) 1.6-2.5x faster (12 x 32 register tile, broadcasts from
// memory; bench/results/qmm_cpu.json).
// QMM_ISA=avx2 (or _segattn.qmm_set_isa) selects the other.
const IsaEntry kIsas[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"avx512", &qmm_run_avx512, &qmm_prep_avx512, &qmm_gemm_avx512, &qmm_gemm_pack_avx512,
     &qmm_gemm_tile_avx512, &dot8_avx512, &qmm_prep8_avx2, &gemm8_avx512, &cpu_isa::has_avx512bw},
    {"avx2", &qmm_run_avx2, &qmm_prep_avx2, &qmm_gemm_avx2, &qmm_gemm_pack_avx2, &qmm_gemm_tile_avx2,
     &qmm_dot8_avx2, &qmm_prep8_avx2, &qmm_gemm8_avx2, &cpu_isa::has_avx2},
#endif
    {"generic", &qmm_run_generic, &qmm_prep_generic, &qmm_gemm_generic, &qmm_gemm_pack_generic,
     &qmm_gemm_tile_generic, &qmm_dot8_generic, &qmm_prep8_generic, &qmm_gemm8_generic, &cpu_isa::always},
};

cpu_isa::Choice g_isa(kIsas, "QMM_ISA");

const IsaEntry* current_isa() {
  return g_isa.current();
}

// ---------------------------------------------------------------------------------------
// The worker pool. A job is a column range cut into chunks that threads claim from an
// atomic counter, the calling thread included: a worker that is late (descheduled on a
// busy machine) costs nothing, the caller takes its chunks. The caller returns once every
// chunk is done and no worker is registered on the job (`running_`/`active_` handshake,
// sequentially consistent: a late worker either is waited for or sees the job closed).
// ---------------------------------------------------------------------------------------
class Pool {
 public:
  Pool() {
    const char* env = std::getenv("QMM_SPIN_US");
    spin_us_ = env != nullptr ? std::atoi(env) : 50;
  }

  void run(ParallelFn fn, const void* ctx, int64_t chunks) {
    std::lock_guard<std::mutex> one_job(run_mu_);
    ctx_ = ctx;
    fn_ = fn;
    chunks_ = chunks;
    next_.store(0);
    done_.store(0);
    running_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    work();
    for (int spins = 0; done_.load() != chunks; ++spins) {
      if (spins < 4096) {
        cpu_isa::relax();
      } else {
        std::this_thread::yield();
      }
    }
    running_.store(false);
    while (active_.load() != 0) std::this_thread::yield();
  }

  void resize(int threads) {
    std::lock_guard<std::mutex> no_job(run_mu_);
    while (static_cast<int>(workers_.size()) + 1 < threads) {
      const uint64_t seen = generation_.load();
      workers_.emplace_back([this, seen] { loop(seen); });
      workers_.back().detach();
    }
    wanted_ = threads;
  }

  int wanted() const {
    return wanted_.load(std::memory_order_relaxed);
  }

 private:
  void work() {
    for (;;) {
      const int64_t c = next_.fetch_add(1);
      if (c >= chunks_) return;
      fn_(ctx_, c);
      done_.fetch_add(1);
    }
  }

  void loop(uint64_t seen) {
    for (;;) {
      uint64_t gen = generation_.load(std::memory_order_acquire);
      if (gen == seen && spin_us_ > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        int tries = 0;
        while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
          cpu_isa::relax();
          if (++tries == 64) {
            tries = 0;
            if (std::chrono::steady_clock::now() > until) break;
          }
        }
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        gen = generation_.load(std::memory_order_acquire);
      }
      seen = gen;
      active_.fetch_add(1);
      if (running_.load()) work();
      active_.fetch_sub(1);
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> running_{false};
  std::atomic<int> active_{0};
  std::atomic<int> wanted_{1};
  // The job (written before running_ is set, read by registered workers only).
  const void* ctx_ = nullptr;
  ParallelFn fn_ = nullptr;
  int64_t chunks_ = 0;
  int spin_us_ = 50;
};

// Threads: min(2, cores) by default (the 2-core target); QMM_THREADS overrides.
Pool* make_pool() {
  auto* made = new Pool();  // never destroyed: workers may be parked at exit
  const char* env = std::getenv("QMM_THREADS");
  const unsigned hw = std::thread::hardware_concurrency();
  int n = env != nullptr ? std::atoi(env) : (hw >= 2 ? 2 : 1);
  made->resize(n >= 1 ? n : 1);
  return made;
}

Pool& pool() {
  static Pool* p = make_pool();
  return *p;
}

int64_t gemm_min_rows();

// Whether a product of `rows` rows with 8-bit x runs as the GEMM (prefill) rather than as
// decode rows (fewer than the GEMM's minimum and than the dot body carries).
bool x8_gemm_rows(int64_t rows) {
  return rows >= gemm_min_rows() || rows > QMM_X8_MAX_ROWS;
}

// Which products round x to 8 bits (qmm_dot8.cpp): QMM_X8 = auto (default: Q6_K), on (Q6_K,
// 4-bit and 8-bit), off (none; float x everywhere). `x8_serves` says why.
// A product may ask for gemm (Q6_K, and 4-bit and 8-bit in the GEMM only: prefill rows;
// decode rows of 4/8-bit weights keep float x) where the process is on auto.
enum X8Mode : int { kX8Off = 0, kX8Auto = 1, kX8On = 2, kX8Gemm = 3 };

int x8_parse(const std::string& v) {
  if (v.empty() || v == "auto") return kX8Auto;
  if (v == "on" || v == "1") return kX8On;
  if (v == "off" || v == "0") return kX8Off;
  if (v == "gemm") return kX8Gemm;
  throw std::invalid_argument("QMM_X8 must be auto, on, off or gemm, not '" + v + "'");
}

std::atomic<int>& x8_mode() {
  static std::atomic<int> mode{[] {
    const char* env = std::getenv("QMM_X8");
    try {
      return x8_parse(env != nullptr ? env : "");
    } catch (const std::invalid_argument&) {
      return static_cast<int>(kX8Auto);  // the settings loader rejects bad values before this runs
    }
  }()};
  return mode;
}

// Whether the 8-bit-x bodies take a product of these weights (decode rows through the dot
// body, from the GEMM's row count on through its GEMM):
// - Q6_K (auto, on): its float tile is bound by unpacking the 6-bit codes; 1.1-1.4x on layer
//   and head shapes read from DRAM, ~2.2x in the prefill GEMM (bench/qmm_x8.py);
// - 4-bit (on; K % 64 == 0): ~1.0x on layer shapes read from DRAM, 1.6-2.3x in the GEMM;
// - 8-bit (on): 1.7-2.2x in the GEMM; decode rows through the dot body's two-column tiles
//   read layer shapes from DRAM at 22-28 GB/s against the float tile's 17-20 (a 28-layer
//   0.4B Q8_0 decode step 19-26 -> 17-21 ms, three alternating runs).
// 4-bit and 8-bit are not the default: the rounding is llama.cpp's own for these formats and
// moved the embedded model's perplexity by only +0.2-0.3 % (bench/qmm_x8.py --text), but
// its first answer to a plain question sits on a 0.05-nat margin that the rounding tips.
bool x8_serves(int64_t rows, int64_t k, int bits, int mode) {
  if (mode == kX8Off || rows < 1) return false;
  if (bits == 6) return true;  // K % 256 == 0 (serves)
  if (mode == kX8Gemm) return x8_gemm_rows(rows) && (bits == 8 || (bits == 4 && k % 64 == 0));
  if (mode != kX8On) return false;
  return bits == 8 || (bits == 4 && k % 64 == 0);
}

// How many values of x share one rounding scale in such a product (0: x stays float): 256
// for Q6_K decode rows, whose tile then keeps a block's products in integers (llama.cpp's
// Q8_K; qmm_dot8.cpp tile_q6_rows), 32 for the rest.
int x8_block(int64_t rows, int64_t k, int bits, int mode) {
  if (!x8_serves(rows, k, bits, mode)) return 0;
  return bits == 6 && !x8_gemm_rows(rows) ? 256 : 32;
}

// The mode a product runs with: its own request (`want`, `x8_want`; -1: none) where the
// process runs auto; an explicit on or off of the process wins.
int x8_resolved(int want) {
  const int mode = x8_mode().load();
  return want >= 0 && mode == kX8Auto ? want : mode;
}

// The mode of a new op.
int x8_for_op(const std::string& want) {
  return x8_resolved(x8_want(want));
}

// Below this many weights a call stays on one thread (waking a worker costs more).
constexpr int64_t kParallelMinWeights = int64_t(1) << 16;

float* thread_floats(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

int scale_code(mx::Dtype t) {
  if (t == mx::float32) return QMM_F32;
  if (t == mx::float16) return QMM_F16;
  if (t == mx::bfloat16) return QMM_BF16;
  if (t == mx::uint8) return QMM_K8;
  return -1;
}

struct Job {
  const float* x;
  int64_t sr, sk;
  int x8;  // X8Mode: decode rows through the 8-bit-x body where it serves the weights
  QmmArgs args;
};

// From this many rows on, the packed-panel GEMM (qmm_gemm_*) serves the op, below it the
// register-tile paths (dot for 1 row, deq for 2..). QMM_GEMM_MIN_ROWS overrides (benches).
int64_t gemm_min_rows() {
  static const int64_t v = [] {
    const char* env = std::getenv("QMM_GEMM_MIN_ROWS");
    return env != nullptr && *env != '\0' ? std::max<int64_t>(2, std::atoll(env)) : int64_t(24);
  }();
  return v;
}

// Column chunks for the pool: about 8 per thread (balance when a thread is late), whole
// tiles of `align` columns, none narrower than `min_cols`.
void run_split(const QmmArgs& a, QmmRunFn fn, int64_t align, int64_t min_cols) {
  const int threads = pool().wanted();
  const int64_t weights = a.n * a.k;
  if (threads > 1 && weights * std::max<int64_t>(a.rows, 1) >= kParallelMinWeights && a.n >= 2 * align) {
    int64_t cols = std::max<int64_t>(min_cols, (a.n + 8 * threads - 1) / (8 * threads));
    cols = (cols + align - 1) / align * align;
    parallel_for((a.n + cols - 1) / cols, [&](int64_t c) { fn(&a, c * cols, std::min(c * cols + cols, a.n)); });
  } else {
    fn(&a, 0, a.n);
  }
}

void run_job(Job job, const IsaEntry* isa) {
  QmmArgs& a = job.args;
  const int block = x8_block(a.rows, a.k, a.bits, job.x8);
  if (block != 0) {
    const bool many = x8_gemm_rows(a.rows);
    // Per row (qmm.h strides): xd (padded by a span), xs, xr (floats), then xq (bytes).
    const int64_t dstride = a.k / 32 + 8;
    float* scratch = thread_floats(static_cast<size_t>(a.rows * (dstride + 2 * a.groups + a.k / 4) + 16));
    float* xd = scratch;
    float* xs = xd + a.rows * dstride;
    float* xr = xs + a.rows * a.groups;
    int8_t* xq = reinterpret_cast<int8_t*>(xr + a.rows * a.groups);
    const bool affine = a.bits != 6;
    // The GEMM reads the affine formats' x in natural order, as the prep lays out 8-bit rows;
    // Q6_K decode rows take x per 256 values (x8_block).
    const int prep_bits = many && affine ? 8 : a.bits;
    const int prep_group = block == 256 ? 256 : a.group_size;
    const auto prep_row = [&](int64_t r) {
      float* d = xd + r * dstride;
      std::fill(d + a.k / 32, d + dstride, 0.0f);
      isa->prep8(job.x + r * job.sr, job.sk, a.k, prep_group, prep_bits, xq + r * a.k, d, xs + r * a.groups,
                 affine ? xr + r * a.groups : nullptr);
    };
    if (many) {  // prefill: a visible share of the product (~1 ns per value) unless split
      parallel_for((a.rows + 7) / 8, [&](int64_t c) {
        for (int64_t r = 8 * c; r < std::min(a.rows, 8 * c + 8); ++r) prep_row(r);
      });
    } else {
      for (int64_t r = 0; r < a.rows; ++r) prep_row(r);
    }
    a.xq = xq;
    a.xd = xd;
    a.xs = xs;
    a.xr = affine ? xr : nullptr;
    run_split(a, many ? isa->gemm8 : isa->dot8, 8, 8);
    return;
  }
  if (a.rows >= gemm_min_rows()) {
    int mr = 1, nr = 1;
    isa->gemm_tile(&mr, &nr);
    const int64_t blocks = (a.rows + mr - 1) / mr;
    float* ap = thread_floats(static_cast<size_t>(blocks * mr * a.k));
    isa->gemm_pack(job.x, job.sr, job.sk, a.rows, a.k, ap);
    a.xp = ap;
    a.xs = nullptr;
    run_split(a, isa->gemm, nr, nr);
    return;
  }
  float* scratch = thread_floats(static_cast<size_t>(a.rows * (a.k + a.groups)));
  isa->prep(job.x, job.sr, job.sk, a.rows, a.k, a.group_size, a.bits, scratch, scratch + a.rows * a.k);
  a.xp = scratch;
  a.xs = scratch + a.rows * a.k;
  // Rows per pass: the x chunk (chunk * K floats) stays within ~512 KB of L2.
  a.row_chunk = std::max<int64_t>(4, ((int64_t(1) << 17) / std::max<int64_t>(a.k, 1)) / 4 * 4);
  // Prefill-sized calls: no chunk narrower than 16 columns (each re-reads its x chunks).
  const int64_t align = a.rows == 1 ? 8 : 2;  // whole tiles of the dot path (8 columns)
  run_split(a, isa->run, align, a.rows > 16 ? 16 : align);
}

// One product's job: x [rows, k] with element strides (sr, sk), the weights, y [rows, n].
Job make_job(const float* x, int64_t sr, int64_t sk, int64_t rows, const Weights& wt, float* y, int x8) {
  Job job{};
  job.x = x;
  job.x8 = x8;
  job.sr = sr;
  job.sk = sk;
  QmmArgs& a = job.args;
  a.w = wt.w;
  a.scales = wt.scales;
  a.biases = wt.biases;
  a.y = y;
  a.rows = rows;
  a.n = wt.n;
  a.k = wt.k;
  a.group_size = wt.group_size;
  a.groups = wt.k / wt.group_size;
  a.bits = wt.bits;
  a.scale_type = wt.scale_type;
  return job;
}

// ---------------------------------------------------------------------------------------
// The primitive.
// ---------------------------------------------------------------------------------------
class CpuQuantizedMatmul : public mx::Primitive {
 public:
  CpuQuantizedMatmul(mx::Stream stream, int group_size, int bits, const IsaEntry* isa, int x8)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), isa_(isa), x8_(x8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const mx::array& scales = inputs[2];
    const mx::array& biases = inputs[3];
    for (int i = 1; i < 4; ++i) {
      if (!inputs[i].flags().row_contiguous) {
        throw std::runtime_error("CpuQuantizedMatmul: w, scales and biases must be row-contiguous");
      }
    }
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);

    const Job job = make_job(x.data<float>(), x.strides()[0], x.strides()[1], x.shape(0),
                             weights_of(w, scales, biases, x.shape(1), group_size_, bits_),
                             out.data<float>(), x8_);
    encoder.dispatch([job, isa = isa_]() {
      if (job.args.rows == 0 || job.args.n == 0) return;
      run_job(job, isa);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("CpuQuantizedMatmul runs on the CPU only");
  }

  const char* name() const override {
    return "CpuQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const CpuQuantizedMatmul*>(&other);
    return o != nullptr && o->group_size_ == group_size_ && o->bits_ == bits_ && o->isa_ == isa_ &&
           o->x8_ == x8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(0)}};
  }

 private:
  int group_size_;
  int bits_;
  const IsaEntry* isa_;
  int x8_;
};

}  // namespace

bool serves(int64_t k, const mx::array& w, const mx::array& scales, const mx::array& biases,
            int group_size, int bits) {
  if (bits == 6) {  // GGUF Q6_K (qmm.h): codes uint8, sub-block scales int8, d float16
    if (group_size != 16 || k <= 0 || k % 256 != 0) return false;
    if (w.dtype() != mx::uint8 || w.ndim() != 2 || scales.dtype() != mx::int8 || scales.ndim() != 2) return false;
    if (biases.dtype() != mx::float16 || biases.ndim() != 2) return false;
    const int64_t rows = w.shape(0);
    return w.shape(1) == k / 256 * 192 && scales.shape(0) == rows && scales.shape(1) == k / 16 &&
           biases.shape(0) == rows && biases.shape(1) == k / 256;
  }
  if (bits != 4 && bits != 8) return false;
  if (group_size != 32 && group_size != 64 && group_size != 128) return false;
  if (w.dtype() != mx::uint32 || w.ndim() != 2) return false;
  if (scales.ndim() != 2 || biases.ndim() != 2) return false;
  if (scale_code(scales.dtype()) < 0 || biases.dtype() != scales.dtype()) return false;
  const int64_t n = w.shape(0);
  if (k <= 0 || k % group_size != 0) return false;
  if (static_cast<int64_t>(w.shape(1)) * 32 != k * bits) return false;
  if (scales.dtype() == mx::uint8) {  // QMM_K8 (qmm.h): 10 bytes per 8 groups of 32
    if (group_size != 32 || k % 256 != 0) return false;
    return scales.shape(0) == n && scales.shape(1) == k / 256 * QMM_K8_BYTES && biases.shape() == scales.shape();
  }
  if (scales.shape(0) != n || scales.shape(1) != k / group_size) return false;
  // [n, 0]: symmetric weights (qmm.h), each group's bias -centre * scale.
  return biases.shape() == scales.shape() || (biases.shape(0) == n && biases.shape(1) == 0);
}

Weights weights_of(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t k,
                   int group_size, int bits, int x8) {
  Weights wt{};
  wt.w = static_cast<const uint32_t*>(w.data<void>());  // Q6_K: bytes (qmm.h)
  wt.scales = scales.data<void>();
  wt.biases = biases.size() == 0 ? nullptr : biases.data<void>();  // symmetric (serves)
  wt.scale_type = bits == 6 ? QMM_F16 : scale_code(scales.dtype());
  wt.n = w.shape(0);
  wt.k = k;
  wt.group_size = group_size;
  wt.bits = bits;
  wt.x8 = x8;
  return wt;
}

int x8_want(const std::string& x8) {
  return x8.empty() ? -1 : x8_parse(x8);
}

void run_now(const float* x, int64_t rows, const Weights& wt, float* y) {
  if (rows == 0 || wt.n == 0) return;
  // Resolved per call: a process setting made after the layer ops were built still wins.
  run_job(make_job(x, wt.k, 1, rows, wt, y, x8_resolved(wt.x8)), current_isa());
}

std::optional<mx::array> quantized_matmul(const mx::array& x, const mx::array& w,
                                          const mx::array& scales, const mx::array& biases,
                                          int group_size, int bits, const std::string& x8) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) return std::nullopt;
  const int k = x.shape(-1);
  if (!serves(k, w, scales, biases, group_size, bits)) return std::nullopt;
  const int n = w.shape(0);
  mx::Stream s = mx::to_stream(std::monostate{}, mx::Device::cpu);
  mx::Shape out_shape = x.shape();
  out_shape.back() = n;
  mx::array x2 = x.ndim() == 2 ? x : mx::reshape(x, {-1, k}, s);
  auto prim = std::make_shared<CpuQuantizedMatmul>(s, group_size, bits, current_isa(), x8_for_op(x8));
  mx::array y(mx::Shape{x2.shape(0), n}, mx::float32, std::move(prim), {x2, w, scales, biases});
  return x.ndim() == 2 ? y : mx::reshape(y, out_shape, s);
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
  return pool().wanted();
}

std::string x8() {
  const int m = x8_mode().load();
  return m == kX8Off ? "off" : m == kX8On ? "on" : m == kX8Gemm ? "gemm" : "auto";
}

bool x8_takes(int64_t rows, int64_t k, int bits) {
  return x8_serves(rows, k, bits, x8_mode().load());
}

int x8_block_of(int64_t rows, int64_t k, int bits) {
  return x8_block(rows, k, bits, x8_mode().load());
}

void set_x8(const std::string& mode) {
  x8_mode().store(x8_parse(mode));
}

void parallel_for(ParallelFn fn, const void* ctx, int64_t items) {
  Pool& workers = pool();
  if (workers.wanted() > 1 && items > 1) {
    workers.run(fn, ctx, items);
  } else {
    for (int64_t i = 0; i < items; ++i) fn(ctx, i);
  }
}

void set_threads(int n) {
  if (n < 1) throw std::invalid_argument("threads must be >= 1");
  pool().resize(n);
}

}  // namespace qmm
