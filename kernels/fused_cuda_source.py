"""CUDA source of the fused segmented-attention kernel (`segserve.kernels.fused_cuda`).

Owns: loading the kernel text from kernels/cuda/*.cu (`header`, `kernel_source`,
`body_reduce`), the unrolled piece walk generated per slot count, and `compile_unit`, the
kernel wrapped as one translation unit the way `mx.fast.cuda_kernel` wraps it (for nvcc
checks without a GPU). The launch planning, availability checks and the route object live
in `segserve.kernels.fused_cuda`. Invariant: the text handed to MLX is the files' text unchanged.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

MergeMode = Literal["in_kernel", "two_pass"]
MAX_PIECES = 17  # 16 segments + the tail in one launch

# ---------------------------------------------------------------------------------------
# CUDA source, in kernels/cuda/ (read once, at first use). Raw 16-bit values move through
# shared memory as unsigned short; T only decides the mma flavour and how P is rounded.
#   segattn_header.cu  `header=` of both kernels: namespace segattn (Ops<T>, cp.async,
#                      ldmatrix/mma helpers, merge_slots)
#   segattn_body.cu    body of the attention kernel; @PICK@ and @SELECT@ are generated
#                      per piece count, @OWN@ for owned pieces or not, @MERGE@ per merge mode
#   segattn_merge.cu   the in-kernel two-level merge (merge="in_kernel")
#   segattn_reduce.cu  body of the second pass of merge="two_pass"
# Bodies are fragments (what mx.fast.cuda_kernel puts inside its `__global__` function);
# `compile_unit` wraps them the same way for an offline nvcc check (tests/test_cuda_sources.py).
# ---------------------------------------------------------------------------------------
CUDA_DIR = Path(__file__).resolve().parent / "cuda"
SOURCE_FILES = ("segattn_header.cu", "segattn_body.cu", "segattn_merge.cu", "segattn_reduce.cu")


@cache
def read_source(name: str) -> str:
    """The text of kernels/cuda/`name` (exactly as stored: its hash names MLX's cached module)."""
    if name not in SOURCE_FILES:
        raise ValueError(f"unknown CUDA source {name!r}")
    return (CUDA_DIR / name).read_text(encoding="utf-8")


def header() -> str:
    """`header=` of both kernels."""
    return read_source("segattn_header.cu")


def body_reduce() -> str:
    """Body of the two-pass reduce kernel."""
    return read_source("segattn_reduce.cu")


def _own_source(owned: bool) -> str:
    """OWNED and the block's piece range: its batch row's (input `own`, offsets per row)
    for owned pieces, else every slot (constants the compiler folds away)."""
    if owned:
        return "  constexpr bool OWNED = true;\n  const int own_lo = own[b], own_hi = own[b + 1];"
    return "  constexpr bool OWNED = false;\n  constexpr int own_lo = 0, own_hi = 0x7fffffff;"


def _pick_source(n_pieces: int) -> str:
    """Unrolled walk over the piece slots: chunk c -> (piece, first row); NC total (the
    block's own pieces only, where pieces are owned)."""
    lines = []
    for i in range(n_pieces):
        lines.append(
            f"  {{ const int r = ({i} < nlive && {i} >= own_lo && {i} < own_hi) ? k{i}_shape[2] : 0;\n"
            f"    const int n = (r + CH - 1) / CH;\n"
            f"    if (piece < 0 && c < NC + n) {{ piece = {i}; cstart = (c - NC) * CH; prow = r; }}\n"
            f"    NC += n; }}"
        )
    return "\n".join(lines)


def _select_source(n_pieces: int) -> str:
    """Base pointers and strides of the chosen piece (k/v strides: b, h, row, d); an owned
    piece is its row's alone (batch 1)."""
    lines = []
    for i in range(n_pieces):
        lines.append(
            f"  if (piece == {i}) {{\n"
            f"    kb = reinterpret_cast<const unsigned short*>(k{i}) + (OWNED ? 0 : b) * k{i}_strides[0] + h * k{i}_strides[1];\n"
            f"    vb = reinterpret_cast<const unsigned short*>(v{i}) + (OWNED ? 0 : b) * v{i}_strides[0] + h * v{i}_strides[1];\n"
            f"    krs = k{i}_strides[2]; kds = k{i}_strides[3]; vrs = v{i}_strides[2]; vds = v{i}_strides[3];\n"
            f"  }}"
        )
    return "\n".join(lines)


def kernel_source(merge: MergeMode, n_pieces: int = MAX_PIECES, owned: bool = False) -> str:
    """Body of the attention kernel for `n_pieces` input slots (exposed for compile checks);
    `owned`: each batch row reads only its own pieces (an extra input `own`, in-kernel
    merge only)."""
    if owned and merge != "in_kernel":
        raise ValueError("owned pieces need the in-kernel merge")
    tail = read_source("segattn_merge.cu") if merge == "in_kernel" else ""
    return (
        read_source("segattn_body.cu").replace("@OWN@", _own_source(owned))
        .replace("@PICK@", _pick_source(n_pieces))
        .replace("@SELECT@", _select_source(n_pieces))
        .replace("@MERGE@", tail)
    )


def input_names(n_pieces: int, merge: MergeMode, owned: bool = False) -> list[str]:
    """The attention kernel's inputs, in order."""
    head = ["q", "cfg", "sem"] if merge == "in_kernel" else ["q", "cfg"]
    if owned:
        head.append("own")
    return head + [f"k{i}" for i in range(n_pieces)] + [f"v{i}" for i in range(n_pieces)]


def __getattr__(name: str) -> str:
    # HEADER / BODY_REDUCE as module attributes (benchmarks import them), read on first use.
    if name == "HEADER":
        return header()
    if name == "BODY_REDUCE":
        return body_reduce()
    raise AttributeError(name)


# What mx.fast.cuda_kernel puts around a body (MLX's default header brings these types
# from mlx/backend/cuda/device/utils.cuh; the minimal equivalents suffice to compile).
_PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[10]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def compile_unit(kernel: Literal["in_kernel", "two_pass", "reduce"], n_pieces: int = 2,
                 head_dim: int = 128, stages: int = 2, wide: int = 0, owned: bool = False) -> str:
    """The kernel as one translation unit, wrapped as MLX wraps it: a `__global__` function
    whose parameters are the inputs (with `_shape`/`_strides` where the body uses them) and
    outputs, whose template arguments are constants (bfloat16, causal, scale 1/8)."""
    if kernel == "reduce":
        body = body_reduce()
        inputs = [("ws", "float"), ("q", "__nv_bfloat16"), ("cfg", "int32_t")]
        outputs = [("out", "__nv_bfloat16"), ("lse", "float")]
        consts = ["using OT = __nv_bfloat16;", f"constexpr int D = {head_dim};"]
    else:
        body = kernel_source(kernel, n_pieces, owned)
        names = input_names(n_pieces, kernel, owned)
        types = {"cfg": "int32_t", "sem": "uint32_t", "own": "int32_t"}
        inputs = [(n, types.get(n, "__nv_bfloat16")) for n in names]
        outputs = ([("out", "__nv_bfloat16"), ("lse", "float"), ("ws", "float")]
                   if kernel == "in_kernel" else [("ws", "float")])
        consts = ["using T = __nv_bfloat16;", "using OT = __nv_bfloat16;",
                  f"constexpr int D = {head_dim};", "constexpr bool CAUSAL = true;",
                  "constexpr int SCALE_BITS = 1040187392;",  # 0.125f
                  "constexpr int CAP_BITS = 1112014848;",  # 50.0f: the soft-capped variant
                  f"constexpr int NST = {stages};", f"constexpr int WIDE = {wide};"]
    params = []
    for name, ctype in inputs:
        params.append(f"const {ctype}* {name}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides")):
            if name + suffix in body:
                params.append(f"const __grid_constant__ {kind} {name}{suffix}")
    params += [f"{ctype}* {name}" for name, ctype in outputs]
    return (
        _PRELUDE + header() + "namespace segattn_check {\n__global__ void kernel(\n    "
        + ",\n    ".join(params) + ") {\n" + "\n".join("  " + c for c in consts) + "\n"
        + body + "\n}\n}  // namespace segattn_check\n"
    )
