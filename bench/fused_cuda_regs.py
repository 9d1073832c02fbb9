"""Registers and spills of the fused CUDA kernel, compiled here with nvcc (no GPU needed).

Owns: nothing the server imports. Wraps `segserve.kernels.fused_cuda_source` the way MLX's
`mx.fast.cuda_kernel` does (a `__global__` function whose body is the source, template
arguments as constants, `Shape`/`Strides` parameters for the inputs that use them) and
compiles it for sm_90 with `nvcc -cubin -Xptxas -v`. The device's MLX compiles the same
text with NVRTC of the same CUDA release, so the counts decide how many 128-thread blocks
fit one SM (64K registers: <= 168 per thread for 3, <= 128 for 4), which is what
`segserve.kernels.fused_cuda.BLOCKS_PER_SM*` assume.

Run:
    python bench/fused_cuda_regs.py [--nvcc /usr/local/cuda/bin/nvcc] [--keep DIR] \
        [--merges in_kernel] [--slots 2,4] [--dims 128]
Prints one JSON object: per (merge, slots, D, stages, wide) the registers and spill bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segserve.kernels.fused_cuda_source import HEADER, input_names, kernel_source  # noqa: E402

_PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[10]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def wrapped_source(merge: str, n_pieces: int, head_dim: int, stages: int, wide: bool) -> str:
    """The kernel as one compilable translation unit (bfloat16, causal, scale 1/8)."""
    body = kernel_source(merge, n_pieces)  # type: ignore[arg-type]
    names = input_names(n_pieces, merge)  # type: ignore[arg-type]
    types = {"cfg": "int32_t", "sem": "uint32_t"}
    params = []
    for name in names:
        params.append(f"const {types.get(name, '__nv_bfloat16')}* {name}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides")):
            if name + suffix in body:
                params.append(f"const __grid_constant__ {kind} {name}{suffix}")
    outs = {"out": "__nv_bfloat16", "lse": "float", "ws": "float"}
    out_names = ["out", "lse", "ws"] if merge == "in_kernel" else ["ws"]
    params += [f"{outs[o]}* {o}" for o in out_names]
    consts = [
        "using T = __nv_bfloat16;",
        "using OT = __nv_bfloat16;",
        f"constexpr int D = {head_dim};",
        "constexpr bool CAUSAL = true;",
        "constexpr int SCALE_BITS = 1040187392;",  # 0.125f
        f"constexpr int NST = {stages};",
        f"constexpr bool WIDE = {'true' if wide else 'false'};",
    ]
    return (
        _PRELUDE + HEADER + "namespace segattn_check {\n__global__ void kernel(\n    "
        + ",\n    ".join(params) + ") {\n" + "\n".join("  " + c for c in consts) + "\n"
        + body + "\n}\n}  // namespace segattn_check\n"
    )


def compile_one(nvcc: str, workdir: Path, **case: Any) -> dict[str, Any]:
    tag = "_".join(f"{k}{v}" for k, v in case.items())
    src = workdir / f"{tag}.cu"
    src.write_text(wrapped_source(**case))
    cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o",
           str(workdir / f"{tag}.cubin"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    row: dict[str, Any] = dict(case)
    row["ok"] = res.returncode == 0
    row["registers"] = int(regs[-1]) if regs else None
    row["spill_store_bytes"] = max((int(s) for s in spills), default=0)
    if row["registers"]:
        per_warp = -(-row["registers"] * 32 // 256) * 256  # allocation unit: 256 per warp
        row["blocks_per_sm_by_registers"] = 65536 // (4 * per_warp)
    if not row["ok"]:
        row["error"] = res.stderr[-2000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--keep", help="write the .cu/.cubin files here (default: a temp dir)")
    ap.add_argument("--merges", default="in_kernel,two_pass")
    ap.add_argument("--slots", default="2,4,8,17", help="piece slots (~10 s a compile at 17)")
    ap.add_argument("--dims", default="64,128,256")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        grid = itertools.product(
            args.merges.split(","),
            [int(n) for n in args.slots.split(",")],
            [int(d) for d in args.dims.split(",")],
            (2, 3),
            (False, True),
        )
        for merge, slots, d, stages, wide in grid:
            rows.append(compile_one(args.nvcc, workdir, merge=merge, n_pieces=slots, head_dim=d,
                                    stages=stages, wide=wide))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"arch": "sm_90", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
