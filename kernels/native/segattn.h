// Segmented attention kernel: plain-C interface between the MLX primitive (segattn_op.cpp,
// compiled for the baseline ISA) and the kernel bodies (segattn_kernel.cpp, compiled once
// per ISA with its own -m flags and a per-ISA entry point name).
//
// Only POD types and declarations here: nothing inline, no templates. A header function
// compiled into an AVX-512 object could otherwise be picked by the linker for every caller
// (one definition rule) and crash an AVX2-only machine.
#pragma once

#include <stddef.h>
#include <stdint.h>

// Keys per tile: scores of one row block live in row_block x SEGATTN_TILE floats.
#define SEGATTN_TILE 64

extern "C" {

enum SegAttnDtype { SEGATTN_F32 = 0, SEGATTN_F16 = 1, SEGATTN_BF16 = 2 };

// One K/V piece [B, H_kv, rows, D], read in place through its element strides.
struct SegAttnPiece {
  const void* k;
  const void* v;
  int64_t rows;
  int64_t k_stride[4];  // b, h, s, d (elements)
  int64_t v_stride[4];
};

struct SegAttnArgs {
  int dtype;     // SegAttnDtype of q and out
  int kv_dtype;  // SegAttnDtype of every k/v: dtype, or F16/BF16 under F32 queries
  int batch, n_q_heads, n_kv_heads, n_queries, head_dim;
  const void* q;
  int64_t q_stride[4];  // b, h, l, d (elements)
  void* out;            // [B, Hq, L, D], row-contiguous
  const SegAttnPiece* pieces;  // non-empty pieces only
  int n_pieces;
  int last_is_causal;  // the last piece is the tail and is causally masked
  // > 0: a sliding window. The queries are the newest L positions of all keys (pieces
  // concatenated), query l at p = total_keys - L + l, and it sees keys (p - window, p].
  int64_t window;
  float scale;
  // > 0: soft-capped scores (gemma2): each scaled score s becomes softcap * tanh(s / softcap)
  // before the mask and the softmax.
  float softcap;
  // Work split: the packed query rows R = G * L of one (batch, kv head) are cut into
  // blocks of row_block rows; the keys (all pieces concatenated, total_keys rows) into
  // n_splits equal ranges. Work item = base * n_splits + split, with
  // base = ((b * H_kv) + h) * n_row_blocks + row_block.
  int row_block;
  int n_splits;
  int64_t total_keys;
  // n_splits > 1: per item and row (m, l, acc[D]) float32, [items][row_block][2 + D],
  // combined into out by the merge entry (one call per base item).
  float* partial;
};

// run: work items [first, last) (see SegAttnArgs). merge: base items [first, last), after
// every split of them ran (n_splits > 1 only). `scratch` holds the bytes `scratch_bytes`
// in segattn_op.cpp computes for `args`, one buffer per thread.
typedef void (*SegAttnRunFn)(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);

void segattn_run_generic(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
void segattn_merge_generic(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
#if defined(__x86_64__) || defined(_M_X64)
void segattn_run_avx2(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
void segattn_merge_avx2(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
void segattn_run_avx512(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
void segattn_merge_avx512(const SegAttnArgs* args, int64_t first, int64_t last, void* scratch);
#endif

}  // extern "C"
