// nanobind module `_segattn` (NB_DOMAIN mlx, so mlx.core.array crosses the boundary).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "act_op.h"
#include "block_op.h"
#include "qmm_op.h"
#include "segattn_op.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_segattn, m) {
  m.doc() = "One-op CPU attention over segmented KV memory (segments + tail).";
  m.def("attend", &segattn::segmented_attention, "queries"_a, "kv"_a, "scale"_a,
        "causal_tail"_a, "window"_a = 0, "softcap"_a = 0.0f,
        "Attention of queries [B, Hq, L, D] over kv = [k0, v0, ..., tail_k, tail_v] (window "
        "> 0: query l, the newest L positions, sees keys (p - window, p]; softcap > 0: each "
        "scaled score s becomes softcap * tanh(s / softcap)); None when the kernel does not "
        "serve these inputs.");
  m.def("attend_append", &segattn::segmented_attention_append, "queries"_a, "segments"_a,
        "k_new"_a, "v_new"_a, "k_buf"_a, "v_buf"_a, "start"_a, "scale"_a,
        "Writes k_new/v_new into the tail buffers at row start, then attends over the "
        "segments and the buffers' first start + n rows; None when not served.");
  m.def("isa", &segattn::isa, "Kernel body that new ops use (avx512, avx2, generic).");
  m.def("supported_isas", &segattn::supported_isas, "Kernel bodies this CPU can run.");
  m.def("set_isa", &segattn::set_isa, "name"_a, "Choose the kernel body for new ops.");
  m.def("threads", &segattn::threads, "Threads one op may use.");
  m.def("set_threads", &segattn::set_threads, "n"_a, "Threads one op may use (>= 1).");

  // CPU quantized matmul (qmm_op.cpp): its own ISA choice and worker pool.
  m.def("qmm", &qmm::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "x8"_a = "",
        "x [..., K] float32 @ dequant(w).T (MLX affine format, transpose=True); None when "
        "the kernel does not serve these inputs. x8: this product's rounding of x where the "
        "process runs auto ('gemm': 4/8-bit weights in the prefill GEMM too).");
  m.def("qmm_isa", &qmm::isa, "Quantized matmul body that new ops use.");
  m.def("qmm_supported_isas", &qmm::supported_isas, "Quantized matmul bodies this CPU can run.");
  m.def("qmm_set_isa", &qmm::set_isa, "name"_a, "Choose the quantized matmul body for new ops.");
  m.def("qmm_threads", &qmm::threads, "Threads one quantized matmul may use.");
  m.def("qmm_x8", &qmm::x8, "Whether quantized matmuls round x to 8 bits: auto, on, off.");
  m.def("qmm_set_x8", &qmm::set_x8, "mode"_a, "auto, on (Q6_K, 4-bit and 8-bit weights), off, or gemm (Q6_K, 4/8-bit in the GEMM), for new ops.");
  m.def("qmm_x8_takes", &qmm::x8_takes, "rows"_a, "k"_a, "bits"_a,
        "Whether a new op rounds x [rows, k] to 8 bits for weights of these bits.");
  m.def("qmm_x8_block", &qmm::x8_block_of, "rows"_a, "k"_a, "bits"_a,
        "How many values of x [rows, k] share one 8-bit rounding scale in a new op for weights "
        "of these bits: 256 (Q6_K decode rows), 32, or 0 (x stays float).");
  // A decoder layer's decode step outside attention (block_op.cpp), 4/8-bit weights.
  m.def("block_pre", &block::pre, "h"_a, "offsets"_a, "norm_w"_a.none(), "eps"_a, "proj"_a, "gs"_a,
        "bits"_a, "bias"_a.none(), "qk_norm"_a, "q_norm_w"_a.none(), "k_norm_w"_a.none(), "qk_eps"_a,
        "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rope_dims"_a, "traditional"_a, "rope_base"_a,
        "rope_scale"_a, "inv_freqs"_a.none(), "rope_mscale"_a, "long_inv_freqs"_a.none() = nb::none(),
        "long_mscale"_a = 1.0f, "rope_switch"_a = 0, "x8"_a = "",
        "[rms_norm], q/k/v quantized product(s) [+ bias], [q/k norm], RoPE of a decode step "
        "(long_inv_freqs: rows at positions >= rope_switch rotate with it and long_mscale; x8: "
        "the products' own rounding of x, as qmm takes it): "
        "[q, k, v], or None when the op does not serve these inputs.");
  m.def("block_post", &block::post, "h"_a, "o"_a, "wo"_a, "o_bias"_a.none(), "attn_out_norm_w"_a.none(),
        "mlp_in_norm_w"_a.none(), "gate_up"_a, "gate_up_bias"_a.none(), "down"_a, "down_bias"_a.none(),
        "mlp_out_norm_w"_a.none(), "gs"_a, "bits"_a, "eps"_a, "act"_a, "residual_multiplier"_a,
        "x8"_a = "",
        "Output projection, [norm], residual, [norm], gated MLP (SiLU or GELU-tanh), [norm], "
        "residual of a decode step (x8: the products' own rounding of x, as qmm takes it), or "
        "None when the op does not serve these inputs.");
  nb::class_<block::LayerPlan>(m, "BlockLayer",
                               "One decode row of a decoder layer in one op (block_op.h LayerPlan).")
      .def(nb::init<const mlx::core::array&, const mlx::core::array&>(), "pre_out"_a, "post_out"_a,
           "From an output of block_pre and one of block_post (lazy; never evaluated).")
      .def("step", &block::LayerPlan::step, "h"_a, "offsets"_a, "pieces"_a, "start"_a, "scale"_a,
           "softcap"_a = 0.0f, "tail_from"_a = 0,
           "h [1, 1, H] at offsets [1] through the layer, its K/V row written into the tail "
           "buffers (the last two pieces) at row start, attending their rows from tail_from on "
           "(a window inside the tail; no segment pieces then): h', or None when not served.");
  m.def("gated_act", &act::gated, "gate"_a, "up"_a, "act"_a,
        "act(gate) * up over float32 arrays on the CPU (act 0: SiLU, 1: GELU-tanh); None when "
        "the op does not serve these inputs.");
  m.def("qmm_set_threads", &qmm::set_threads, "n"_a, "Threads one quantized matmul may use (>= 1).");
}
