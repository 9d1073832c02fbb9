"""Fused CUDA route: attention over up to 16 KV segments plus the tail in one kernel launch.

Owns: `FusedCudaRoute` (an `AttentionRoute`, name "fused_cuda"), `fused_available`,
`supports`, the registry hooks `applies`/`build`, the launch planner (`plan_launch`) and the
CUDA source (compiled by MLX through `mx.fast.cuda_kernel`, cached per signature).
Called from the engine thread only (one MLX stream; see "counters" below).

Design (flash-decoding over pieces, split-K inside one launch):

    grid = (chunks, H_kv, B), 128 threads (4 warps) per block
    piece 0            piece 1        ...  tail (last piece, causal when L > 1)
    [chunk|chunk|chunk][chunk|chunk]       [chunk]        a chunk never spans two pieces
        |  one block per chunk: 64-row K/V tiles, cp.async 2- or 3-stage pipeline into
        |  shared memory; tensor-core mma (m16n8k16, fp32 accumulate), online softmax in
        v  base 2; the block's 4 warps are merged through shared memory
    ws: partial (acc [R, D], max m, sum l) per (group, chunk), float32
        two-level LSE merge inside the launch: the last block (atomic counter) of each
        run of ~sqrt(NC) chunks merges the run; the last run merger merges the runs and
        writes out [B, Hq, L, D] and lse [B, Hq, L]. A one-level merge by the very last
        block was measured first: its NC-long serial loop cost ~0.4 us per chunk.

- The G query heads that share a KV head are packed as R = G * W query rows (row r: head
  h*G + r // W, position w0 + r % W of window w), so each KV row is read once per window.
  R <= 64; a call of L positions runs ceil(L / W) windows in the same launch (grid z =
  batch x window, W = min(L, 64 // G)), so a 256-row prefill chunk is one launch, not 16.
- Pieces travel as separate inputs (k0..k16, v0..v16) with their strides, so a tail that
  is a slice of a bigger buffer, or a prefix view of a segment, is read in place, never
  copied. Unused slots repeat piece 0 and are skipped (`cfg` says how many are live).
  One kernel per (dtype, D, causal, output dtype, scale) serves every piece count.
- More than 17 pieces: groups of 17, each launch returning float32 out + lse, merged by LSE.
- Counters ("last block merges"): a persistent uint32 array, each call using one of 256
  regions in turn (64 counters per group). A block increments its run's counter after
  writing its partial; the block that completes the count merges and resets the counter
  to 0, so counters are zero between calls without a fill launch. Two launches touching
  the same region at once would be a race; MLX runs one stream's graphs in order and caps
  a graph far below 256 kernels, so this holds for one stream. One route object per stream.
- `merge="two_pass"` instead writes partials only and merges in a second small kernel
  (no counters). Measured on the H200 (bench/kernels_gpu.py): the single launch is as fast
  or faster for decode (L=1); two_pass is 10-30 % faster for verify windows (L=8, R=32),
  where one block merging R*D outputs is the tail.
- Chunking: one wave of resident blocks by default (`waves=1`), planned so no block spills
  into a ragged extra wave; 2 waves and a 3-stage pipeline measured no better overall.
- Wide path (prefill chunks; template WIDE, route option `wide`, on from `build` where
  `wide_available` passed): launches of >= 49 packed rows (G * W) at D <= 128. The narrow
  inner loop updates the online softmax and rescales O every 16 keys and builds V's mma
  fragments from 16-bit shared loads: per 64 keys and warp ~1,340 SASS instructions and 384
  shared-memory wavefronts for 128 mma (nvcc 13.0, sm_90; `-Xptxas -v`, disassembled). At
  the follow-up's prefill chunks that runs at ~140-160 TFLOP/s against ~270 for stock SDPA
  (bench/results/zero_cost_h200*.json: ~0.25 / 0.36 / 1.86 ms more per layer and 256-row
  chunk at 8K / 32K / 128K, growing with the history: kernel time, not host time). The wide
  step (`fused_cuda_source.wide_step`) takes 64 keys per update, K and V fragments by
  ldmatrix (.trans for V), exp2 on the SFU alone: ~530 instructions and 256 wavefronts for
  the same 128 mma, 168 registers (3 blocks/SM, as before). Timed on the H200
  (bench/kernels_gpu.py --prefill, 256-row chunk, µs per layer call, stock / narrow / wide):
  8K 140 / 431 / 311, 32K 425 / 1371 / 928 with one segment; still ~2x stock SDPA's kernel,
  which runs at ~330 TFLOP/s to the wide path's ~165 (see the README's GPU section).
- Paired wide path (route option `pair_keys`, default 64; template WIDE 2, or 3 for 32 keys
  per update; 0 keeps the path above): a wide launch of >= 2 query windows gives each block
  two windows (128 packed rows, grid z = batch x pair) and each warp two m-tiles (the same
  packed rows of both windows), so every K/V fragment loaded by ldmatrix feeds two mma and
  each K/V tile is read from L2 once per 128 rows, not 64 (`fused_cuda_source.wide2_step`;
  Q's A fragments come from shared memory). 253-255 registers at D=128: 2 blocks per SM
  (`BLOCKS_PER_SM_PAIRED`). The workspace keeps one partial per window and chunk, so the
  merges are unchanged; a paired block merges its two groups in turn. Chunks are planned
  per pair leaving short pieces (the call's own tail rows) out of the count
  (`plan_launch(light=...)`), else one chunk in four was a near-empty tail block. Timed on
  the H200, one device call (bench/kernels_gpu.py --windows 256 --routes ..., 256-row
  chunk, µs per layer call, stock / paired / unpaired wide): 8K 130 / 276 / 307 (1
  segment), 134 / 288 / 350 (4); 32K 420 / 598 / 933 (1), 419 / 598 / 839 (4): ~230
  TFLOP/s at 32K, still above stock SDPA. ncu (8K, 1 segment): SMs active ~68 % of the
  kernel's cycles, ~22 % SM throughput: latency-bound at 2 warps per scheduler; 32K: 85 %.
- Host work per call: the layers of one step make the same call but for their K/V, so the
  first plans the launch (support check, chunking, template, grid) and the rest replay the
  plan (`_Recipe`): measured 59 -> 25 µs of Python per decode call with a stand-in kernel.
- Prefill calls in flight (route option `in_flight`, `build` sets IN_FLIGHT_PREFILL): MLX
  allocates an op's output when the host encodes it and keeps every input and sibling output
  (the workspace `ws` included) until the CUDA graph holding the op has run; up to 10 graphs
  may be queued, each cut at 100 ops or 1,000 MB of inputs (H100/H200: ~2 layers of an 8B
  model's weights). So a prefill chunk's forward keeps ~10-20 layers of activations and
  workspaces alive when the host runs ahead of the GPU: a 256-row chunk of a random 8B bf16
  model measured ~755 MiB above the tail at 8K and ~1,050 MiB at 32K (bench/zero_cost.py),
  of which the workspaces (~32 MiB per call) were the part stock SDPA does not have. A paced
  call (more than one query window) schedules its own launch (`mx.async_eval`) and first
  waits until the paced call `in_flight` calls back has run (its event: the queue behind it
  stays on the GPU, no drain), so at most `in_flight` layers' prefill work is queued.
  Measured on the H200 (bench/gpu_peak_breakdown.py, random 8B bf16, 513 new rows in
  256-row chunks; bench/results/gpu_peak_breakdown_h200.json), prefill peak above the turn's
  start, unpaced / paced to 2, at 8K / 32K / 128K: 1,465 / 285, 1,465 / 285, 1,606 / 248
  MiB (72 of it the tail), prefill time 50.0 / 52.8, 75.4 / 76.8, 160.0 / 159.8 ms; every
  layer evaluated before the next is built: 144 MiB but 2x the time. Asynchronous
  evaluation every 1-2 layers without the wait did not lower the peak (README). Decode and
  verify calls (one window) are never paced.

Invariants: same contract as `segserve.kernels.composed.attend_segments` (all segment rows visible;
tail row j visible to query i iff not causal or j <= T - L + i; rows that see nothing are
zeros; output dtype = query dtype). Anything the kernel does not serve (float32, L past
`max_window`, K/V dtype unlike Q, CPU) is delegated to the composed route unchanged.
A sliding-window layer's call (`window=W`) runs on the pieces clipped to the queries'
windows (`segserve.kernels.window`, views); one that still needs a per-query window start (a
prefill chunk across it) goes to the composed route with the window.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import mlx.core as mx

from segserve.kernels.composed import SUPPORTED_HEAD_DIMS, KVPair, attend_segments
from segserve.kernels.fused_cuda_source import (
    MAX_PIECES,
    MergeMode,
    body_reduce,
    header,
    input_names,
    kernel_source,
)
from segserve.kernels.window import clip_to_window

# Query positions the kernel serves per call: decode, verify windows and prefill chunks.
# A window wider than MAX_ROWS / G runs as query windows of the same launch (grid z), each
# reading the pieces in place and masking the tail for its own positions. Measured on the
# H200 (bench/zero_cost.py, random 8B bf16, 512-token follow-up in 256-row chunks), fused
# prefill against the composed tiled route: follow-up TTFT 1.44x / 1.37x stock at 8K / 32K
# against 3.46x / 5.01x, peak 0.74x / 0.14x stock against 0.48x / 0.12x. A route object
# may take fewer positions (`max_window`); wider calls then go to the composed route.
MAX_WINDOW = 1024
DEFAULT_MAX_WINDOW = MAX_WINDOW
MAX_ROWS = 64  # packed query rows (G * L) per launch: 4 warps x 16 mma rows
TILE = 64  # K/V rows per shared-memory tile
THREADS = 128
HEAD_DIMS = SUPPORTED_HEAD_DIMS
MAX_GROUP = 8  # query heads per KV head
REGIONS = 256  # counter regions, used round-robin (see module docstring)
SEM_STRIDE = 64  # counters per group: [0] second-level merge, [1 + s] first-level run s
MAX_CHUNKS = 2048  # per group; keeps runs (sqrt NC) and their count under SEM_STRIDE
# Merge weights live in shared memory: NC * R + R floats (two-pass) must fit the smallest
# kernel's dynamic shared memory (D=64, 2 stages: 2 x (K, V) x 64 x 72 halves x 2 B).
WEIGHT_FLOATS = 9216
# Blocks of one launch resident per SM by (head_dim, stages): registers (`nvcc -Xptxas -v`:
# 96 / 164 / 255 at 128 threads) and shared memory (stages x 2 x 64 x (D + 8) x 2 B).
BLOCKS_PER_SM = {(64, 2): 5, (64, 3): 4, (128, 2): 3, (128, 3): 2, (256, 2): 1, (256, 3): 1}
# The wide (prefill) path, nvcc 13.0 for sm_90 (`-Xptxas -v`; the device's NVRTC is 13.0
# too): 129-144 registers at D=64 (3 blocks of 128 threads fit 64K registers, 4 do not);
# at D=128, 168 with the in-kernel merge and <= 4 piece slots (3 blocks; 3 stages are held
# to 2 by shared memory), 172-180 with more slots or the two-pass merge (2 blocks, see
# `_wide_blocks_per_sm`). D=256 stays narrow: the wide step spills there.
# (The narrow path, same compiler: 165 / 174 / 180 registers at D=128 with 2 / 4 / 8+
# slots, i.e. 3 / 2 / 2 blocks, and 101-128 at D=64, 4 blocks: BLOCKS_PER_SM above was
# read off an older compiler and over-counts there; left as measured-best until re-timed.)
BLOCKS_PER_SM_WIDE = {(64, 2): 3, (64, 3): 3, (128, 2): 3, (128, 3): 2}
# The paired wide path (two query windows per block, two m-tiles per warp; `pair_keys` > 0):
# 253-255 registers at D=128 (2 blocks; 64 keys per update spill 16-24 bytes, 32 keys none,
# and time ~2-3 % slower), 168-230 at D=64 (2 taken), and 128 more rows of Q in shared
# memory: at D=128 with 3 stages one block's 136 KB leave no room for a second.
BLOCKS_PER_SM_PAIRED = {(64, 2): 2, (64, 3): 2, (128, 2): 2, (128, 3): 1}
PAIR_KEYS = (32, 64)  # keys per online-softmax update on the paired path (template WIDE 3, 2)
DEFAULT_PAIR_KEYS = 64
# Paired launches plan chunks leaving out pieces under 1/LIGHT_PIECE of a chunk (`plan_launch`).
LIGHT_PIECE = 4
# Paced prefill calls queued on the GPU at once (`FusedCudaRoute(in_flight=...)`, see the
# module docstring): two keeps the GPU fed (one layer's work is queued while the host builds
# the next) and matches admission's price of two calls' workspace (`segserve.server.scheduling.
# admission.price`). Measured (same source as the docstring) at 8K / 32K / 128K: one costs
# 1.6 / 1.5 / 1.3x the prefill time (the GPU waits for the host), three hold ~70 MiB more
# than two for no time gained. `--fused-inflight` overrides it in `build` (0: off).
IN_FLIGHT_PREFILL = 2
# Packed query rows from which a launch takes the wide path: every warp then owns a
# 16-row m-tile anyway (R > 48), so nothing is lost by giving each its own.
WIDE_MIN_ROWS = 49
H200_SMS = 132
# Piece slots a launch is compiled for; a call takes the smallest that holds its pieces.
# Why: every slot is a kernel input MLX processes on the host per call (34 arrays at 17
# slots), and decode mostly has 2-4 pieces (a segment or a few, and the tail).
SLOT_COUNTS = (2, 4, 8, MAX_PIECES)




def _wide_blocks_per_sm(head_dim: int, stages: int, n_slots: int, merge: MergeMode) -> int:
    """Resident blocks per SM of the wide kernel (registers: see BLOCKS_PER_SM_WIDE)."""
    blocks = BLOCKS_PER_SM_WIDE[(head_dim, stages)]
    if head_dim == 128 and (n_slots > 4 or merge != "in_kernel"):
        return min(blocks, 2)
    return blocks


def _shared_bytes(head_dim: int, stages: int, paired: bool = False) -> int:
    # stages x (K, V) x TILE rows x (D + 8) halves x 2 bytes; >= the merge scratch. The
    # paired path also keeps its 2 x MAX_ROWS query rows there.
    q_rows = 2 * MAX_ROWS if paired else 0
    return (stages * 2 * TILE + q_rows) * (head_dim + 8) * 2


def _wide_code(wide: bool, pair_keys: int) -> int:
    """Template WIDE: 0 narrow, 1 wide (one window per block), 2 / 3 paired (64 / 32 keys)."""
    if not wide:
        return 0
    return {0: 1, 64: 2, 32: 3}[pair_keys]


@lru_cache(maxsize=32)
def _attention_kernel(
    merge: MergeMode, n_pieces: int, head_dim: int, stages: int, paired: bool = False,
    owned: bool = False,
) -> Any:
    source = kernel_source(merge, n_pieces, owned)
    digest = hashlib.blake2b((header() + source).encode(), digest_size=6).hexdigest()
    # MLX caches compiled modules by name (+ template values), also on disk: the name must
    # change whenever the source does. Paired launches get their own object (more shared
    # memory per block); the others keep the smaller allocation, hence their occupancy.
    outputs = ["out", "lse", "ws"] if merge == "in_kernel" else ["ws"]
    return mx.fast.cuda_kernel(
        name=f"segattn_{merge}_p{n_pieces}_{digest}" + ("_pair" if paired else ""),
        input_names=input_names(n_pieces, merge, owned),
        output_names=outputs,
        source=source,
        header=header(),
        ensure_row_contiguous=False,  # read slices/views in place, never copy K/V
        shared_memory=_shared_bytes(head_dim, stages, paired),
    )


@lru_cache(maxsize=8)
def _reduce_kernel(head_dim: int) -> Any:
    digest = hashlib.blake2b((header() + body_reduce()).encode(), digest_size=6).hexdigest()
    return mx.fast.cuda_kernel(
        name=f"segattn_reduce_{digest}",
        input_names=["ws", "q", "cfg"],
        output_names=["out", "lse"],
        source=body_reduce(),
        header=header(),
        ensure_row_contiguous=False,
        shared_memory=WEIGHT_FLOATS * 4 + MAX_ROWS * 4,
    )


# ---------------------------------------------------------------------------------------
# Planning (pure Python; unit-tested on the CPU).
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """One launch: pieces cut into chunks of `chunk_tiles * TILE` rows, one block each."""

    n_live: int
    chunk_tiles: int
    n_chunks: int  # NC: chunks per (batch, KV head) group
    n_groups: int  # NG = B * H_kv
    rows: int  # R = G * L packed query rows
    run: int  # chunks per first-level merge (~sqrt NC)

    @property
    def n_runs(self) -> int:
        return -(-self.n_chunks // self.run)

    def ws_floats(self, head_dim: int) -> int:
        """Chunk partials, then first-level partials: acc [.., R, D] and (m, l) [.., R, 2]."""
        return self.n_groups * (self.n_chunks + self.n_runs) * self.rows * (head_dim + 2)


def plan_launch(
    piece_rows: Sequence[int],
    n_groups: int,
    n_query_rows: int,
    target_blocks: int,
    min_chunk_tiles: int = 1,
    light: int = 0,
) -> LaunchPlan:
    """Chunks of one launch: at most `target_blocks` blocks, within the merge scratch.

    The chunk is the smallest (in tiles) for which sum_i ceil(rows_i / chunk) chunks fit
    `target_blocks // n_groups` per group: a chunk never spans two pieces, and a launch
    that overshoots by a few blocks runs a ragged extra wave (measured on the H200: 186 us
    instead of ~170 us at 128K). The two-pass merge keeps NC * R + R weights in shared
    memory, which also bounds NC. Chunks of at least `min_chunk_tiles` tiles keep the
    merge small next to the rows read. With `light` > 0, pieces shorter than 1/light of the
    chunk (a prefill call's own rows in the tail) are left out of the count: their blocks
    finish early and free their slots, so counting them would shorten every other chunk
    (the paired wide path: one tail chunk among four cost ~1/4 of the launch's blocks).
    """
    if not piece_rows or min(piece_rows) <= 0:
        raise ValueError(f"pieces must be non-empty, got rows {list(piece_rows)}")
    cap, per_group = _chunk_budget(n_groups, n_query_rows, target_blocks)
    tiles = tuple(-(-r // TILE) for r in piece_rows)
    if light > 0:  # light chunks add up to one per piece: stay within the merge scratch
        chunk_tiles = _chunk_tiles_light(
            tiles, max(1, min(per_group, cap - len(tiles))), max(1, min_chunk_tiles), light
        )
    else:
        chunk_tiles = _chunk_tiles(tiles, per_group, max(1, min_chunk_tiles))
    n_chunks = sum(-(-t // chunk_tiles) for t in tiles)
    run = max(1, math.ceil(math.sqrt(n_chunks)))
    return LaunchPlan(len(tiles), chunk_tiles, n_chunks, n_groups, n_query_rows, run)


def _chunk_budget(n_groups: int, n_query_rows: int, target_blocks: int) -> tuple[int, int]:
    """(chunks per group the merge scratch allows, chunks per group a launch plans for:
    its share of `target_blocks`, within that cap)."""
    if not 1 <= n_query_rows <= MAX_ROWS:
        raise ValueError(f"{n_query_rows} packed query rows, launch takes 1..{MAX_ROWS}")
    cap = min(WEIGHT_FLOATS // n_query_rows - 1, MAX_CHUNKS)
    return cap, max(1, min(target_blocks // max(1, n_groups), cap))


@lru_cache(maxsize=4096)
def _chunk_tiles(tiles: tuple[int, ...], per_group: int, min_tiles: int) -> int:
    """Smallest chunk c >= min_tiles with sum(ceil(t / c)) <= per_group (else the largest
    piece: one chunk each). Cached: a decode step changes the tail's tiles once per 64."""
    hi = max(tiles)
    lo = max(min_tiles, -(-sum(tiles) // per_group))
    if lo >= hi or len(tiles) >= per_group:
        return max(lo, hi) if len(tiles) >= per_group else lo
    # sum(ceil(t / c)) is non-increasing in c
    return _least(lo, hi, lambda c: sum(-(-t // c) for t in tiles) <= per_group)


@lru_cache(maxsize=4096)
def _chunk_tiles_light(tiles: tuple[int, ...], per_group: int, min_tiles: int, light: int) -> int:
    """Smallest chunk c >= min_tiles whose chunks of pieces of >= c / light tiles number
    <= per_group (else the largest piece: one chunk each)."""

    def heavy(c: int) -> int:  # non-increasing in c
        return sum(-(-t // c) for t in tiles if t * light >= c)

    lo, hi = min_tiles, max(tiles)
    if lo >= hi or heavy(hi) > per_group:
        return max(lo, hi)
    return _least(lo, hi, lambda c: heavy(c) <= per_group)


def _least(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """Smallest c in [lo, hi] with fits(c), for `fits` false then true as c grows (hi fits)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_owned(
    session_rows: Sequence[Sequence[int]],
    n_kv_heads: int,
    n_query_rows: int,
    target_blocks: int,
    min_chunk_tiles: int = 1,
) -> LaunchPlan:
    """Chunks of one launch of owned pieces: batch row i (one decode row per session)
    reads only its own pieces, of `session_rows[i]` rows. The chunk is the smallest for
    which every row's chunks fit its groups' share of `target_blocks` (as `plan_launch`
    plans one row's); NC is the most chunks any row has (the grid's; a block past its
    row's chunks returns at once), and the workspace keeps NC slots per group."""
    if not session_rows or any(not rows or min(rows) <= 0 for rows in session_rows):
        raise ValueError(f"every session needs non-empty pieces, got {[list(r) for r in session_rows]}")
    n_groups = len(session_rows) * n_kv_heads
    _, per_group = _chunk_budget(n_groups, n_query_rows, target_blocks)
    tiles = [tuple(-(-r // TILE) for r in rows) for rows in session_rows]
    # sum(ceil(t / c)) is non-increasing in c: the largest of the rows' own chunks fits all.
    chunk_tiles = max(_chunk_tiles(t, per_group, max(1, min_chunk_tiles)) for t in tiles)
    n_chunks = max(sum(-(-x // chunk_tiles) for x in t) for t in tiles)
    run = max(1, math.ceil(math.sqrt(n_chunks)))
    return LaunchPlan(sum(len(t) for t in tiles), chunk_tiles, n_chunks, n_groups, n_query_rows, run)


def split_groups(n_pieces: int, max_pieces: int = MAX_PIECES) -> list[tuple[int, int]]:
    """Consecutive [start, end) piece ranges per launch; the tail stays last in the last."""
    return [(a, min(n_pieces, a + max_pieces)) for a in range(0, n_pieces, max_pieces)]


def query_windows(n_queries: int, group: int) -> tuple[int, int]:
    """(positions per window, windows): each window packs group * width <= MAX_ROWS rows;
    a launch runs every window of a call (grid z), the last one padded."""
    width = min(n_queries, max(1, MAX_ROWS // group))
    return width, -(-n_queries // width)


def merge_by_lse(outs: Sequence[mx.array], lses: Sequence[mx.array]) -> mx.array:
    """Merge float32 partial attention outputs [B, Hq, L, D] by their LSEs [B, Hq, L]."""
    lse = mx.stack(list(lses))  # lse: [n, B, Hq, L]
    top = lse.max(axis=0)
    ref = mx.where(top == -mx.inf, 0.0, top)  # every part empty -> weights 0, output 0
    w = mx.exp(lse - ref)  # w: [n, B, Hq, L]
    total = w.sum(axis=0)
    acc = (w[..., None] * mx.stack(list(outs))).sum(axis=0)  # acc: [B, Hq, L, D]
    return mx.where(total[..., None] > 0, acc / mx.maximum(total, 1e-30)[..., None], 0.0)


# ---------------------------------------------------------------------------------------
# Availability and support.
# ---------------------------------------------------------------------------------------
def supports(
    head_dim: int, n_q_heads: int, n_kv_heads: int, dtype: mx.Dtype, L: int
) -> tuple[bool, str]:
    """Shapes the kernel serves (availability is `fused_available`); reason when not."""
    if head_dim not in HEAD_DIMS:
        return False, f"head_dim {head_dim} not in {HEAD_DIMS}"
    if n_kv_heads <= 0 or n_q_heads % n_kv_heads:
        return False, f"{n_q_heads} query heads not a multiple of {n_kv_heads} KV heads"
    if not 1 <= n_q_heads // n_kv_heads <= MAX_GROUP:
        return False, f"GQA group {n_q_heads // n_kv_heads} outside 1..{MAX_GROUP}"
    if dtype not in (mx.float16, mx.bfloat16):
        return False, f"dtype {dtype} (kernel serves float16 and bfloat16)"
    if not 1 <= L <= MAX_WINDOW:
        return False, f"window of {L} queries (kernel serves 1..{MAX_WINDOW}; wider ones compose)"
    return True, f"D={head_dim}, G={n_q_heads // n_kv_heads}, {dtype}, L={L}"


@lru_cache(maxsize=1)
def fused_available() -> tuple[bool, str]:
    """Can the fused kernel run here? Compiles and checks it once on a small problem."""
    if not mx.cuda.is_available():
        return False, "MLX has no CUDA backend here (mx.cuda.is_available() is False)"
    if mx.default_device() != mx.gpu:
        return False, "MLX's default device is the CPU"
    try:
        err = _probe()
    except Exception as exc:  # compile or launch failure: report, never crash start-up
        return False, f"cuda_kernel failed: {type(exc).__name__}: {exc}"
    if not err <= 3.2e-2:  # also catches NaN
        return False, f"probe disagrees with stock SDPA (max abs error {err:.3g})"
    return True, f"cuda_kernel compiled and matched stock SDPA (max abs error {err:.2g})"


def _probe() -> float:
    """Max abs error of the kernel vs stock SDPA on a small causal GQA window whose
    chunks need both merge levels (6 chunks in runs of 3)."""
    ks = mx.random.split(mx.random.key(7), 5)

    def normal(shape: tuple[int, ...], i: int) -> mx.array:
        return mx.random.normal(shape, key=ks[i]).astype(mx.bfloat16)

    seg = (normal((1, 2, 300, 64), 0), normal((1, 2, 300, 64), 1))
    tail = (normal((1, 2, 9, 64), 2), normal((1, 2, 9, 64), 3))
    q = normal((1, 4, 3, 64), 4)
    route = FusedCudaRoute(min_chunk_rows=TILE)
    got = route._fused(q, [seg], tail, scale=0.125, causal=True)
    k = mx.concatenate([seg[0], tail[0]], axis=2)
    v = mx.concatenate([seg[1], tail[1]], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return float(err)  # type: ignore[arg-type]  # .item() is typed int | float | complex


def applies(query: Any) -> bool:
    """Registry predicate (`segserve.kernels.factory.FusedRouteSpec.applies`, takes a RouteQuery)."""
    if query.backend != "cuda":
        return False
    shape_ok, _ = supports(query.head_dim, query.n_q_heads, query.n_kv_heads, query.dtype, 1)
    return shape_ok and fused_available()[0]


def build(query: Any, in_flight: int | None = None) -> FusedCudaRoute:
    """Registry constructor (`FusedRouteSpec.build`): prefill chunks take the paired wide
    path where it passed its check here (`wide_available`), else the unpaired one;
    `--fused-wide single` takes the unpaired wide path, `off` keeps prefill on the narrow
    path (both for comparison). Measured on the H200 (bench/zero_cost.py, random 8B bf16,
    512-token follow-up in 256-row chunks), follow-up TTFT / stock at 8K / 32K: 0.79 / 0.94
    with the paired path, 1.03 / 1.12 with the unpaired wide path (launch replay and
    pipelined prefill on), 1.43 / 1.37 narrow. Prefill calls are paced: at most
    `in_flight_prefill()` queued on the GPU at once (with the paired path: 0.76 / 0.84, and
    0.57 at 128K, bench/results/zero_cost_h200.json). `in_flight` given: that bound
    instead (bench/gpu_peak_breakdown.py compares them). The launch planner fills
    `--cuda-sm-count` SMs, else the device's own count (`device_sm_count`)."""
    from segserve.kernels.factory import KernelOptions

    opts: KernelOptions = getattr(query, "options", None) or KernelOptions()
    keys, _ = wide_path(query.head_dim, query.dtype, opts.fused_wide)
    paced = in_flight_prefill(opts.fused_inflight) if in_flight is None else in_flight
    sms = opts.sm_count or device_sm_count() or H200_SMS
    cap = float(getattr(query, "softcap", 0.0))
    return FusedCudaRoute(wide=keys is not None, pair_keys=DEFAULT_PAIR_KEYS if keys is None else keys,
                          in_flight=paced, sm_count=sms, softcap=cap, owned_launches=opts.fused_owned)


def in_flight_prefill(setting: int | None = None) -> int:
    """Paced prefill calls `build` allows queued at once: IN_FLIGHT_PREFILL, or the
    `--fused-inflight` setting (for comparison; 0 turns pacing off)."""
    return IN_FLIGHT_PREFILL if setting is None else setting


@lru_cache(maxsize=1)
def device_sm_count() -> int | None:
    """Streaming multiprocessors of CUDA device 0, from the driver (MLX 0.32's
    `device_info` does not report them); None where the driver cannot be asked."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, count = ctypes.c_int(), ctypes.c_int()
        multiprocessor_count = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0)
                or cuda.cuDeviceGetAttribute(ctypes.byref(count), multiprocessor_count, dev)):
            return None
    except OSError:  # no driver library here
        return None
    return count.value if count.value > 0 else None


def wide_path(head_dim: int, dtype: mx.Dtype, mode: str = "paired") -> tuple[int | None, str]:
    """The prefill path `build` takes here for `--fused-wide` `mode`: the wide path's
    `pair_keys` (0: one query window per block), or None for the narrow path; and why."""
    if mode == "off":
        return None, "--fused-wide off"
    # The paired wide path unless `single` (or its check failed here): then one query
    # window per block.
    why = ""
    for keys in ((DEFAULT_PAIR_KEYS, 0) if mode != "single" else (0,)):
        ok, why = wide_available(head_dim, dtype, keys)
        if ok:
            return keys, why
    return None, why


@lru_cache(maxsize=8)
def wide_available(
    head_dim: int, dtype: mx.Dtype, pair_keys: int = 0
) -> tuple[bool, str]:
    """Does the wide (prefill) path run here and agree with stock SDPA? Checked once per
    (head_dim, dtype), on a causal GQA chunk of three query windows (the last padded)
    whose chunks need both merge levels; a failure keeps the narrow path, never the
    composed one (the narrow kernel has its own check, `fused_available`). `pair_keys`:
    the route option checked (0: one window per block; else the paired path)."""
    if (head_dim, 2) not in BLOCKS_PER_SM_WIDE:
        return False, f"head_dim {head_dim}: the wide path serves {sorted({d for d, _ in BLOCKS_PER_SM_WIDE})}"
    available, why = fused_available()
    if not available:
        return False, why
    try:
        err = _wide_probe(head_dim, dtype, pair_keys)
    except Exception as exc:  # compile or launch failure: report, never crash start-up
        return False, f"wide cuda_kernel failed: {type(exc).__name__}: {exc}"
    if not err <= 3.2e-2:  # also catches NaN
        return False, f"wide probe disagrees with stock SDPA (max abs error {err:.3g})"
    return True, f"wide path matched stock SDPA (max abs error {err:.2g})"


def _wide_probe(head_dim: int, dtype: mx.Dtype, pair_keys: int = 0) -> float:
    ks = mx.random.split(mx.random.key(11), 9)

    def normal(shape: tuple[int, ...], i: int) -> mx.array:
        return mx.random.normal(shape, key=ks[i]).astype(dtype)

    segs = [(normal((1, 2, r, head_dim), 2 * i), normal((1, 2, r, head_dim), 2 * i + 1))
            for i, r in enumerate((300, 1, 130))]
    tail = (normal((1, 2, 45, head_dim), 6), normal((1, 2, 45, head_dim), 7))
    q = normal((1, 8, 40, head_dim), 8)  # G=4: windows of 16 positions (64 rows), 3 windows
    scale = head_dim**-0.5
    route = FusedCudaRoute(min_chunk_rows=TILE, wide=True, pair_keys=pair_keys)
    got = route._fused(q, segs, tail, scale=scale, causal=True)
    k = mx.concatenate([kv[0] for kv in segs] + [tail[0]], axis=2)
    v = mx.concatenate([kv[1] for kv in segs] + [tail[1]], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return float(err)  # type: ignore[arg-type]  # .item() is typed int | float | complex


# ---------------------------------------------------------------------------------------
# The route.
# ---------------------------------------------------------------------------------------
Fallback = Callable[..., mx.array]


@dataclass(frozen=True, slots=True)
class _Recipe:
    """One launch of a call shape, reusable by every layer of a step: which segments are
    live (non-empty), whether the tail is a piece, and the plan, template and grid."""

    live: tuple[int, ...]
    with_tail: bool
    n_slots: int
    plan: LaunchPlan
    win: int
    cfg: mx.array
    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    ws_shape: list[int]
    out_dtype: mx.Dtype
    kernel: Any
    own: mx.array | None = None  # owned pieces: each batch row's first piece, and the end


def _schedule(handle: mx.array) -> None:
    """Start computing `handle` (and the graph it needs) on the GPU; returns at once."""
    mx.async_eval(handle)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub


def _wait(handle: mx.array) -> None:
    """Block until a scheduled `handle` has been computed (its event; no other work)."""
    mx.eval(handle)


_FALLBACK = object()  # the call goes to the composed route
_GENERAL = object()  # no pieces, or more than one launch takes: `_fused` plans it


class FusedCudaRoute:
    """`AttentionRoute` over segments + tail in one CUDA launch; composed route otherwise.

    Holds per-route state reused across calls (no MLX op is created for it per call): the
    counter regions, the `cfg` shape carriers and the template lists. One object per stream.
    """

    name = "fused_cuda"

    def __init__(
        self,
        *,
        merge: MergeMode = "in_kernel",
        max_window: int = DEFAULT_MAX_WINDOW,
        waves: float = 1.0,
        min_chunk_rows: int = 256,
        stages: int = 2,
        sm_count: int = H200_SMS,
        max_pieces: int = MAX_PIECES,
        wide: bool = False,
        pair_keys: int = DEFAULT_PAIR_KEYS,
        in_flight: int = 0,
        fallback: Fallback = attend_segments,
        softcap: float = 0.0,
        owned_launches: bool = True,
    ) -> None:
        if not 1 <= max_pieces <= MAX_PIECES:
            raise ValueError(f"max_pieces {max_pieces} outside 1..{MAX_PIECES}")
        if stages not in (2, 3):
            raise ValueError(f"stages {stages} not in (2, 3)")
        if not 1 <= max_window <= MAX_WINDOW:
            raise ValueError(f"max_window {max_window} outside 1..{MAX_WINDOW}")
        if pair_keys not in (0, *PAIR_KEYS):
            raise ValueError(f"pair_keys {pair_keys} not in (0, *{PAIR_KEYS})")
        if in_flight < 0:
            raise ValueError(f"in_flight {in_flight} < 0")
        self.merge: MergeMode = merge
        self.max_window = max_window
        # Blocks per launch ~ waves x resident blocks; whole waves avoid a ragged last one.
        self.waves = waves
        self.min_chunk_tiles = max(1, min_chunk_rows // TILE)
        self.stages = stages
        self.sm_count = sm_count
        self.max_pieces = max_pieces
        # Launches of >= WIDE_MIN_ROWS packed rows (prefill chunks) at D <= 128 take the
        # wide path (`fused_cuda_source.wide_step`); `build` turns it on once
        # `wide_available` has checked it against stock SDPA on this machine.
        self.wide = wide
        # Wide launches of two or more query windows pair them: one block serves two
        # windows (128 rows, two m-tiles per warp), each K/V fragment feeding both
        # (`fused_cuda_source.wide2_step`, `pair_keys` keys per update); 0: one window per
        # block (`wide_step`), as before.
        self.pair_keys = pair_keys
        # Prefill calls (more than one query window) queued on the GPU at most; 0: no bound
        # (the default here, so kernel benchmarks time chains of calls unpaced; `build` sets
        # IN_FLIGHT_PREFILL). `_paced` holds one small output of each call still counted.
        self.in_flight = in_flight
        self._paced: deque[mx.array] = deque()
        self.fallback = fallback
        # The model's attention soft cap (Gemma 2), compiled into every launch (`CAP_BITS`);
        # 0: none. A route serves one model, so one cap.
        self.softcap = float(softcap)
        self._cap_kw: dict[str, float] = {"softcap": self.softcap} if self.softcap else {}
        self._regions: list[mx.array] = []  # REGIONS views of one zeroed uint32 array
        self._region_groups = 0  # groups each region has counters for
        self._next_region = 0
        self._cfg_base = mx.zeros((1,), dtype=mx.int32)
        # Materialized here: a lazy array keeps the stream of the thread that made it, and
        # GPU streams are per thread (the engine thread calls the route, not its builder).
        mx.eval(self._cfg_base)
        self._cfg: dict[tuple[int, ...], mx.array] = {}
        self._templates: dict[tuple[Any, ...], list[tuple[str, Any]]] = {}
        self._supported: set[tuple[Any, ...]] = set()
        self._recipes: dict[tuple[Any, ...], _Recipe | object] = {}
        self._owned_checked: dict[tuple[Any, ...], bool] = {}
        # Whether batched decode steps use `attend_owned` (`build`: `--fused-owned`); the
        # server turns it off when the start-up check (`selfcheck.check_owned`) disagrees,
        # keeping one call per history.
        self.owned_launches = owned_launches

    def _target_blocks(self, per_sm: int) -> int:
        """Blocks a launch plans for: `waves` waves of `per_sm` resident blocks per SM."""
        return max(1, int(self.waves * (self.sm_count * per_sm)))

    def _wave_bound(self, head_dim: int) -> int:
        """Blocks per (KV head, window) group's share that bounds every plan: a launch plans
        for one wave of its blocks, and a paired block serves two groups (chunks per group:
        its wave / (heads x pairs) <= 2 x its wave / (heads x windows))."""
        wave = self._target_blocks(BLOCKS_PER_SM[(head_dim, self.stages)])
        if self.wide and self.pair_keys and (head_dim, self.stages) in BLOCKS_PER_SM_PAIRED:
            wave = max(wave, 2 * self._target_blocks(BLOCKS_PER_SM_PAIRED[(head_dim, self.stages)]))
        return wave

    def scratch_bytes(self, n_q_heads: int, n_kv_heads: int, head_dim: int, query_rows: int) -> int:
        """Upper bound of one call's workspace (partials, float32) besides its output, for a
        window of `query_rows` positions, whatever the history; admission prices it."""
        win, n_windows = query_windows(query_rows, max(1, n_q_heads // n_kv_heads))
        groups = n_kv_heads * n_windows
        # Per group: about one wave's share of chunks, plus at most one per piece (a chunk
        # never spans two pieces), and ~sqrt of that many first-level partials.
        per_group = -(-self._wave_bound(head_dim) // groups) + MAX_PIECES
        slots = groups * (per_group + math.isqrt(per_group) + 1)
        return slots * (n_q_heads // n_kv_heads) * win * (head_dim + 2) * 4

    def workspace_terms(
        self, n_q_heads: int, n_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int, int]:
        """One call's workspace as a function of the call, for admission
        (`segserve.server.scheduling.admission.fused_workspace_bytes`): (bytes per padded query
        position and partial slot, the shortest chunk in key rows, query positions per
        window, pieces per launch, blocks a launch plans for). `LaunchPlan.ws_floats` is
        what these bound; the single-window wide path plans for no more blocks than the
        narrow one, the paired path for up to twice its own wave per group (`_wave_bound`)."""
        group = max(1, n_q_heads // n_kv_heads)
        wave = self._wave_bound(head_dim)
        return (4 * n_q_heads * (head_dim + 2), self.min_chunk_tiles * TILE, MAX_ROWS // group,
                self.max_pieces, wave)

    def __call__(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
        window: int | None = None,
        softcap: float = 0.0,
    ) -> mx.array:
        if softcap != self.softcap:
            raise ValueError(f"a route built for soft cap {self.softcap:g} called with {softcap:g}")
        if window is not None:
            # Sliding-window layer: the pieces are clipped to the queries' windows (views,
            # `segserve.kernels.window`); a call that still needs a per-query window start (a prefill
            # chunk across it) takes the fallback, which masks per query.
            view = clip_to_window(segments, tail, queries.shape[2], window)
            if view.masked:
                return self.fallback(queries, segments, tail, scale=scale, causal=causal,
                                     window=window, **self._cap_kw)
            segments, tail = view.segments, view.tail
        # The layers of one step make the same call but for their K/V: the first one plans
        # the launch (support check, chunking, template, grid: ~45 us of Python) and the
        # others replay it (`_Recipe`). The key holds everything the plan depends on; the
        # pieces' dtype stands for the rest, as in `accepts`.
        first = segments[0] if segments else tail
        key = (
            queries.shape, queries.dtype, scale, causal,
            tuple(kv[0].shape[2] for kv in segments),
            None if tail is None else tail[0].shape[2],
            None if first is None else (first[0].dtype, first[0].shape[1]),
        )
        recipe = self._recipes.get(key)
        if recipe is None:
            recipe = self._plan_call(queries, segments, tail, scale, causal)
            if len(self._recipes) >= 64:  # a decode step changes the tail's rows: keep few
                self._recipes.clear()
            self._recipes[key] = recipe
        if not isinstance(recipe, _Recipe):
            if recipe is _FALLBACK:
                return self.fallback(queries, segments, tail, scale=scale, causal=causal, **self._cap_kw)
            out = self._fused(queries, segments, tail, scale=scale, causal=causal)
            lse = out
        else:
            pieces = [segments[i] for i in recipe.live]
            if recipe.with_tail and tail is not None:
                pieces.append(tail)
            out, lse = self._run(recipe, queries, pieces)
        if self.in_flight and first is not None:
            group = max(1, queries.shape[1] // first[0].shape[1])
            if query_windows(queries.shape[2], group)[1] > 1:  # a prefill chunk
                self._pace(lse)  # the small sibling: scheduling it runs the whole launch
        return out

    def attend_lse(
        self, queries: mx.array, segments: Sequence[KVPair], scale: float
    ) -> tuple[mx.array, mx.array]:
        """Every query over every segment (no mask), out float32 [B, Hq, L, D] and its
        natural-log LSE [B, Hq, L]: the shared part of a batched decode step
        (`segserve.kernels.batch_attention`), whose L query positions are sessions. More
        pieces than one launch takes run as groups merged by LSE; a shape the kernel does
        not serve goes to `batch_attention.plain_lse`. Not for a capped route (batched
        decode attends soft-capped layers one session at a time)."""
        if self.softcap:
            raise ValueError("attend_lse serves uncapped attention only")
        pieces = [kv for kv in segments if kv[0].shape[2] > 0]
        ok = bool(pieces) and self.accepts(queries, pieces, None)[0]
        if not ok:
            from segserve.kernels.batch_attention import plain_lse

            return plain_lse(queries, pieces, scale)
        rows = [kv[0].shape[2] for kv in pieces]
        outs, lses = [], []
        for a, e in split_groups(len(pieces), self.max_pieces):
            o, lse = self._launch(queries, pieces[a:e], rows[a:e], False, scale, mx.float32)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return merge_by_lse(outs, lses), mx.logsumexp(mx.stack(lses), axis=0)

    def attend_owned(
        self, queries: mx.array, sessions: Sequence[Sequence[KVPair]], scale: float
    ) -> tuple[mx.array, mx.array]:
        """Query row i of [n, Hq, 1, D] over every piece of `sessions[i]` (its own history's
        segments, [1, H_kv, S, D] each, no mask): out float32 [n, Hq, 1, D] and natural-log
        LSE [n, Hq, 1]. The shared part of a batched decode step for sessions whose
        histories differ (`segserve.kernels.batch_attention`): consecutive sessions whose
        pieces fit one launch (`max_pieces`) share it, each block reading its own row's
        pieces (`plan_owned`), so a layer costs ~n / 16 launches instead of n. A session
        with more pieces than a launch takes runs alone (`attend_lse`). Not for a capped
        route, as `attend_lse`."""
        if self.softcap:
            raise ValueError("attend_owned serves uncapped attention only")
        n = queries.shape[0]
        if n != len(sessions):
            raise ValueError(f"{n} query rows for {len(sessions)} sessions")
        lists = [[kv for kv in s if kv[0].shape[2] > 0] for s in sessions]
        if any(not pieces for pieces in lists):
            raise ValueError("every session needs a non-empty piece")
        packed = self._owned_ok(queries, lists)
        outs, lses = [], []
        i = 0
        while i < n:
            if not packed or len(lists[i]) > self.max_pieces:  # alone, in groups merged by LSE
                o, lse = self.attend_lse(queries[i : i + 1], lists[i], scale)
                i += 1
            else:
                j, count = i, 0
                while j < n and count + len(lists[j]) <= self.max_pieces:
                    count += len(lists[j])
                    j += 1
                q = queries if (i, j) == (0, n) else queries[i:j]
                o, lse = self._run_owned(q, lists[i:j], scale)
                i = j
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return mx.concatenate(outs, axis=0), mx.concatenate(lses, axis=0)

    def _owned_ok(self, queries: mx.array, lists: Sequence[Sequence[KVPair]]) -> bool:
        """Whether owned launches serve these calls: the fused kernel takes the shape, one
        query position per row, and the first and last session's pieces stand for the rest
        (one cache layout per model, as in `accepts`)."""
        if queries.shape[2] != 1:
            return False
        ends = [kv for pieces in (lists[0], lists[-1]) for kv in (pieces[0], pieces[-1])]
        key = (tuple(queries.shape[1:]), queries.dtype,
               tuple((k.shape[0], k.shape[1], k.shape[3], k.dtype, v.dtype) for k, v in ends))
        ok = self._owned_checked.get(key)
        if ok is None:  # the check slices a row: once per layout, not per layer call
            ok = self.accepts(queries[:1], ends, None)[0]
            self._owned_checked[key] = ok
        return ok

    def _run_owned(
        self, q: mx.array, lists: Sequence[Sequence[KVPair]], scale: float
    ) -> tuple[mx.array, mx.array]:
        """One owned launch: row i of q over lists[i]'s pieces (all of them <= max_pieces)."""
        first = lists[0][0][0]
        session_rows = tuple(tuple(kv[0].shape[2] for kv in pieces) for pieces in lists)
        key = ("owned", q.shape, q.dtype, scale, session_rows, first.dtype, first.shape[1])
        recipe = self._recipes.get(key)
        if not isinstance(recipe, _Recipe):
            recipe = self._owned_recipe(q, first.shape[1], session_rows, scale)
            if len(self._recipes) >= 64:
                self._recipes.clear()
            self._recipes[key] = recipe
        return self._run(recipe, q, [kv for pieces in lists for kv in pieces])

    def _owned_recipe(
        self, q: mx.array, n_kv: int, session_rows: tuple[tuple[int, ...], ...], scale: float
    ) -> _Recipe:
        """Everything an owned launch over sessions of `session_rows` needs but the arrays."""
        b, n_q, _, head_dim = q.shape
        n_pieces = sum(len(rows) for rows in session_rows)
        n_slots = next(n for n in SLOT_COUNTS if n >= n_pieces)
        plan = plan_owned(session_rows, n_kv, n_q // n_kv,
                          self._target_blocks(BLOCKS_PER_SM[(head_dim, self.stages)]), self.min_chunk_tiles)
        offsets = [0]
        for rows in session_rows:
            offsets.append(offsets[-1] + len(rows))
        own = mx.array(offsets, dtype=mx.int32)
        mx.eval(own)  # made on the calling (engine) thread's stream, reused by every layer
        return _Recipe(
            live=(),
            with_tail=False,
            n_slots=n_slots,
            plan=plan,
            win=1,
            cfg=self._shape_carrier((plan.n_live, plan.chunk_tiles, plan.run, 1)),
            template=self._template(q, mx.float32, False, scale, 0),
            grid=(plan.n_chunks * THREADS, n_kv, b),
            ws_shape=[plan.ws_floats(head_dim)],
            out_dtype=mx.float32,
            kernel=_attention_kernel("in_kernel", n_slots, head_dim, self.stages, False, owned=True),
            own=own,
        )

    def _pace(self, handle: mx.array) -> None:
        """Schedule this call's launch once the paced call `in_flight` calls back has run.

        The wait is on that call's own event (`mx.eval` of an array already scheduled only
        waits for it), so the calls queued behind it keep the GPU busy while the host builds
        the next layer, and what the finished graphs held is freed as they complete. A
        handle from an earlier forward has run already: its wait returns at once."""
        while len(self._paced) >= self.in_flight:
            _wait(self._paced.popleft())
        _schedule(handle)
        self._paced.append(handle)

    def _plan_call(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        scale: float,
        causal: bool,
    ) -> _Recipe | object:
        """What a call of this shape does: the fallback, the general path (empty or more
        pieces than one launch takes), or one launch (`_Recipe`)."""
        ok, _ = self.accepts(queries, segments, tail)
        if not ok:
            return _FALLBACK
        live = tuple(i for i, kv in enumerate(segments) if kv[0].shape[2] > 0)
        t_rows = tail[0].shape[2] if tail is not None else 0
        n = len(live) + (1 if t_rows else 0)
        if n == 0 or n > self.max_pieces:
            return _GENERAL
        rows = [segments[i][0].shape[2] for i in live] + ([t_rows] if t_rows else [])
        masked = causal and t_rows > 0 and queries.shape[2] > 1  # L == 1 sees the whole tail
        n_kv = (segments[live[0]] if live else tail)[0].shape[1]  # type: ignore[index]
        return self._recipe(queries, n_kv, rows, masked, scale, queries.dtype, live, t_rows > 0)

    def accepts(
        self, queries: mx.array, segments: Sequence[KVPair], tail: KVPair | None
    ) -> tuple[bool, str]:
        """Whether this call runs fused (else the composed route serves it), and why."""
        available, why = fused_available()
        if not available:
            return False, why
        b, n_q, n_win, head_dim = queries.shape
        dtype = queries.dtype
        first = segments[0] if segments else tail
        if first is None:
            return False, "no pieces"
        n_kv = first[0].shape[1]
        if n_win > self.max_window:
            return False, f"window of {n_win} queries > {self.max_window} (the composed route tiles it)"
        key = (head_dim, n_q, n_kv, dtype, n_win)
        if key not in self._supported:  # per call on the host: skip the reason strings
            shape_ok, why = supports(*key)
            if not shape_ok:
                return False, why
            self._supported.add(key)
        # The first and last segment and the tail stand for the rest: all come from one
        # cache, and checking every piece costs ~1 us each per layer call on the host.
        want = (b, n_kv, head_dim)
        ends = [*segments[:1], *segments[-1:], *([tail] if tail is not None else [])]
        for k, v in ends:
            ks, vs = k.shape, v.shape
            if k.dtype != dtype or v.dtype != dtype:
                return False, f"K/V dtype {k.dtype}/{v.dtype} differs from queries {dtype}"
            if ks != vs or (ks[0], ks[1], ks[3]) != want:
                return False, f"piece shape {ks}/{vs} does not match queries {queries.shape}"
        return True, "fused"

    # -- fused path --------------------------------------------------------------------
    def _fused(
        self,
        queries: mx.array,
        segments: Sequence[KVPair],
        tail: KVPair | None,
        *,
        scale: float,
        causal: bool,
    ) -> mx.array:
        # queries: [B, Hq, L, D]; pieces: [B, H_kv, S_i, D]
        pieces: list[KVPair] = []
        rows: list[int] = []
        for kv in segments:
            r = kv[0].shape[2]
            if r > 0:
                pieces.append(kv)
                rows.append(r)
        t_rows = tail[0].shape[2] if tail is not None else 0
        if not pieces and t_rows == 0:
            return mx.zeros(queries.shape, dtype=queries.dtype)
        # Windows wider than MAX_ROWS / G run as query windows of one launch (grid z), each
        # masking the tail for its own positions.
        tail_w = (tail, t_rows) if tail is not None and t_rows else None
        return self._window(queries, pieces, rows, tail_w, scale, causal)

    def _window(
        self,
        q: mx.array,
        segments: list[KVPair],
        seg_rows: list[int],
        tail: tuple[KVPair, int] | None,
        scale: float,
        causal: bool,
    ) -> mx.array:
        """One query window over non-empty segments (+ the tail with its row count)."""
        pieces, rows = segments, seg_rows
        if tail is not None:
            pieces, rows = segments + [tail[0]], seg_rows + [tail[1]]
        if not pieces:
            return mx.zeros(q.shape, dtype=q.dtype)
        masked = causal and tail is not None and q.shape[2] > 1  # L == 1 sees the whole tail
        if len(pieces) <= self.max_pieces:
            return self._launch(q, pieces, rows, masked, scale, q.dtype)[0]
        outs, lses = [], []
        for a, e in split_groups(len(pieces), self.max_pieces):
            last = e == len(pieces)  # the tail (if any) is the last piece of the last group
            o, lse = self._launch(q, pieces[a:e], rows[a:e], masked and last, scale, mx.float32)
            outs.append(o)
            lses.append(lse)
        return merge_by_lse(outs, lses).astype(q.dtype)

    def _counters(self, n_groups: int) -> mx.array:
        """The next region of the persistent counters (all zero between calls)."""
        if n_groups > self._region_groups:
            groups = max(64, 1 << (n_groups - 1).bit_length())
            size = groups * SEM_STRIDE
            sem = mx.zeros((REGIONS * size,), dtype=mx.uint32)
            self._regions = [sem[i * size : (i + 1) * size] for i in range(REGIONS)]
            mx.eval(self._regions)
            self._region_groups = groups
        view = self._regions[self._next_region]
        self._next_region = (self._next_region + 1) % REGIONS
        return view

    def _shape_carrier(self, shape: tuple[int, ...]) -> mx.array:
        """A broadcast view whose shape carries small ints to the kernel (`cfg_shape`)."""
        arr = self._cfg.get(shape)
        if arr is None:
            arr = mx.broadcast_to(self._cfg_base, shape)
            mx.eval(arr)
            self._cfg[shape] = arr
        return arr

    def _template(
        self, q: mx.array, out_dtype: mx.Dtype, masked: bool, scale: float, wide: int
    ) -> list[tuple[str, Any]]:
        key = (q.dtype, out_dtype, q.shape[3], masked, scale, wide)
        tpl = self._templates.get(key)
        if tpl is None:
            bits = struct.unpack("<i", struct.pack("<f", float(scale)))[0]
            cap = struct.unpack("<i", struct.pack("<f", self.softcap))[0] if self.softcap else 0
            tpl = [
                ("T", q.dtype),
                ("OT", out_dtype),
                ("D", q.shape[3]),
                ("CAUSAL", masked),
                ("SCALE_BITS", bits),  # the float's bits: template args are ints
                ("CAP_BITS", cap),  # the soft cap's bits, 0: none (`segattn::soft_cap`)
                ("NST", self.stages),
                ("WIDE", wide),  # `_wide_code`: always an int
            ]
            self._templates[key] = tpl
        return tpl

    def _launch(
        self,
        q: mx.array,
        pieces: list[KVPair],
        rows: list[int],
        masked: bool,
        scale: float,
        out_dtype: mx.Dtype,
    ) -> tuple[mx.array, mx.array]:
        """One kernel launch over <= max_pieces pieces: (out [B,Hq,L,D], lse [B,Hq,L])."""
        recipe = self._recipe(q, pieces[0][0].shape[1], rows, masked, scale, out_dtype, (), False)
        return self._run(recipe, q, pieces)

    def _recipe(
        self,
        q: mx.array,
        n_kv: int,
        rows: list[int],
        masked: bool,
        scale: float,
        out_dtype: mx.Dtype,
        live: tuple[int, ...],
        with_tail: bool,
    ) -> _Recipe:
        """Everything one launch over pieces of `rows` rows needs but the arrays."""
        b, n_q, n_win, head_dim = q.shape
        group = n_q // n_kv
        win, n_windows = query_windows(n_win, group)
        n_slots = next(n for n in SLOT_COUNTS if n >= len(rows))
        wide = self.wide and group * win >= WIDE_MIN_ROWS and (head_dim, self.stages) in BLOCKS_PER_SM_WIDE
        # Paired: blocks serve two windows each (grid z = batch x pair); chunks are planned
        # per pair, the workspace keeps one partial per window (group) and chunk.
        paired = wide and self.pair_keys > 0 and n_windows >= 2
        n_z = -(-n_windows // 2) if paired else n_windows
        if paired:
            per_sm = BLOCKS_PER_SM_PAIRED[(head_dim, self.stages)]
        elif wide:
            per_sm = _wide_blocks_per_sm(head_dim, self.stages, n_slots, self.merge)
        else:
            per_sm = BLOCKS_PER_SM[(head_dim, self.stages)]
        plan = plan_launch(
            rows,
            b * n_kv * n_z,
            group * win,
            self._target_blocks(per_sm),
            self.min_chunk_tiles,
            LIGHT_PIECE if paired else 0,
        )
        if paired:
            plan = replace(plan, n_groups=b * n_kv * n_windows)
        code = _wide_code(wide, self.pair_keys if paired else 0)
        return _Recipe(
            live=live,
            with_tail=with_tail,
            n_slots=n_slots,
            plan=plan,
            win=win,
            cfg=self._shape_carrier((plan.n_live, plan.chunk_tiles, plan.run, win)),
            template=self._template(q, out_dtype, masked, scale, code),
            grid=(plan.n_chunks * THREADS, n_kv, b * n_z),
            ws_shape=[plan.ws_floats(head_dim)],
            out_dtype=out_dtype,
            kernel=_attention_kernel(self.merge, n_slots, head_dim, self.stages, paired),
        )

    def _run(self, recipe: _Recipe, q: mx.array, pieces: list[KVPair]) -> tuple[mx.array, mx.array]:
        """Launch `recipe` over `pieces` (the live segments, then the tail)."""
        slots = pieces + [pieces[0]] * (recipe.n_slots - len(pieces))  # unused slots: skipped
        kv_inputs = [k for k, _ in slots] + [v for _, v in slots]
        plan, out_dtype, head_dim = recipe.plan, recipe.out_dtype, q.shape[3]
        if self.merge == "in_kernel" or recipe.own is not None:
            owned = [] if recipe.own is None else [recipe.own]
            out, lse, _ = recipe.kernel(
                inputs=[q, recipe.cfg, self._counters(plan.n_groups), *owned, *kv_inputs],
                template=recipe.template,
                grid=recipe.grid,
                threadgroup=(THREADS, 1, 1),
                output_shapes=[q.shape, q.shape[:3], recipe.ws_shape],
                output_dtypes=[out_dtype, mx.float32, mx.float32],
            )
            return out, lse
        (ws,) = recipe.kernel(
            inputs=[q, recipe.cfg, *kv_inputs],
            template=recipe.template,
            grid=recipe.grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=[recipe.ws_shape],
            output_dtypes=[mx.float32],
        )
        n_kv, win = recipe.grid[1], recipe.win
        splits = max(1, min(16, (plan.rows * head_dim) // 512))
        out, lse = _reduce_kernel(head_dim)(
            inputs=[ws, q, self._shape_carrier((plan.n_chunks, n_kv, win))],
            template=[("OT", out_dtype), ("D", head_dim)],
            grid=(splits * THREADS, plan.n_groups, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[q.shape, q.shape[:3]],
            output_dtypes=[out_dtype, mx.float32],
        )
        return out, lse
