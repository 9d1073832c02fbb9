"""Products of a few rows with quantized weights on a CUDA GPU, side by side in one process,
printed as JSON: `segserve.kernels.qmv_cuda.small_matmul` (one pass over the weights at any
row count up to 8, one row included although the engine routes 2-7) against MLX's
`mx.quantized_matmul` on the same 4-bit and 8-bit weights and against a bfloat16 matmul of
the same shape.

Shapes: a Llama-3-8B layer's products as the engine runs them on a GPU (q/k/v fused 6144 x
4096, o 4096 x 4096, gate/up fused 28672 x 4096, down 4096 x 14336); rows 1-8 and 16 (a
decode step of that many sessions). MLX's op both on x [rows, K] (`mlx_q*`) and on x
[rows, 1, K] (`mlx3d_q*`, the shape of a decode batch, which MLX takes as rows products of
one row each). Per variant: --calls calls queued, then one evaluation
(as a decode step queues its layers), over weight copies cycled so that every call reads
HBM (>= --cold-bytes in all); the median of --repeats such runs, variants interleaved
round-robin; ms per call and GB/s of the weight bytes read. Also the largest difference
of each quantized variant from a float32 product of the dequantized weights, relative to
the largest |y|.

    python bench/small_qmm_gpu.py --json-out bench/results/small_qmm_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
from common import emit_json

from segserve.kernels import qmv_cuda

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def _copies(nbytes: int, cold: int) -> int:
    return max(2, -(-cold // max(1, nbytes)))


def _variants(n: int, k: int, rows: int, columns: list[int], cold: int) -> dict[str, Any]:
    """name -> (callable taking a copy index, weight bytes per call, copies)."""
    out: dict[str, Any] = {}
    dense_bytes = n * k * 2
    nd = _copies(dense_bytes, cold)
    dense = [mx.random.normal((n, k), key=mx.random.key(i)).astype(mx.bfloat16) * 0.02 for i in range(nd)]
    mx.eval(dense)
    x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(mx.bfloat16)
    out["bf16"] = (lambda i: x @ dense[i % nd].T, dense_bytes, None)
    for bits, gs in ((4, 64), (8, 64)):
        q0 = mx.quantize(dense[0], group_size=gs, bits=bits)
        qbytes = sum(a.nbytes for a in q0)
        nq = _copies(qbytes, cold)
        qs = [q0] + [mx.quantize(dense[i % nd] * (1 + 0.01 * i), group_size=gs, bits=bits) for i in range(1, nq)]
        mx.eval(qs)
        ref = x.astype(mx.float32) @ mx.dequantize(*q0, group_size=gs, bits=bits).astype(mx.float32).T

        def mlx_op(i: int, qs: list[Any] = qs, nq: int = nq, gs: int = gs, bits: int = bits) -> mx.array:
            w, s, b = qs[i % nq]
            return mx.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)

        out[f"mlx_q{bits}"] = (mlx_op, qbytes, ref)
        if rows >= 2:
            def mlx_3d(i: int, qs: list[Any] = qs, nq: int = nq, gs: int = gs, bits: int = bits) -> mx.array:
                w, s, b = qs[i % nq]  # a decode batch's shape: [rows, 1, K]
                return mx.quantized_matmul(x[:, None, :], w, s, b, group_size=gs, bits=bits)[:, 0, :]

            out[f"mlx3d_q{bits}"] = (mlx_3d, qbytes, ref)
        if rows <= 8:  # one row too: whether it would beat MLX's qmv
            for cw in columns:
                def ours(i: int, qs: list[Any] = qs, nq: int = nq, gs: int = gs, bits: int = bits,
                         cw: int = cw) -> mx.array:
                    w, s, b = qs[i % nq]
                    return qmv_cuda.small_matmul(x, w, s, b, gs, bits, columns=cw)

                out[f"ours_q{bits}_cw{cw}"] = (ours, qbytes, ref)
    return out




def _scalar(a: mx.array) -> float:
    return float(a.item())  # type: ignore[arg-type]  # item() of a 0-d float array


def _time(fn: Any, calls: int) -> float:
    mx.eval(fn(0))
    mx.synchronize()
    t = time.perf_counter()
    ys = [fn(i) for i in range(calls)]
    mx.eval(ys)
    mx.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,16")
    p.add_argument("--columns", default="4", help="output columns per warp of our kernel, compared (e.g. 2,4,8)")
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cold-bytes", type=int, default=256 << 20)
    p.add_argument("--json-out")
    args = p.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA backend")
    columns = [int(c) for c in args.columns.split(",")]
    results = []
    for label, n, k in SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            variants = _variants(n, k, rows, columns, args.cold_bytes)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (fn, _, _) in variants.items():
                    times[name].append(_time(fn, args.calls))
            row: dict[str, Any] = {"shape": label, "n": n, "k": k, "rows": rows}
            for name, (fn, nbytes, ref) in variants.items():
                ms = statistics.median(times[name])
                entry: dict[str, Any] = {"ms": round(ms, 4), "gb_s": round(nbytes / ms / 1e6, 1)}
                if ref is not None:
                    got = fn(0).astype(mx.float32)
                    entry["max_rel_err"] = _scalar(mx.max(mx.abs(got - ref))) / max(1e-6, _scalar(mx.max(mx.abs(ref))))
                row[name] = entry
            for bits in (4, 8):
                if f"mlx3d_q{bits}" in row:
                    row[f"q{bits}_mlx3d_over_mlx"] = round(row[f"mlx3d_q{bits}"]["ms"] / row[f"mlx_q{bits}"]["ms"], 2)
                best = min((row[f"ours_q{bits}_cw{c}"]["ms"] for c in columns if f"ours_q{bits}_cw{c}" in row),
                           default=None)
                if best is not None:
                    row[f"q{bits}_mlx_over_ours"] = round(row[f"mlx_q{bits}"]["ms"] / best, 2)
                    row[f"q{bits}_bf16_over_ours"] = round(row["bf16"]["ms"] / best, 2)
            print(row, flush=True)
            results.append(row)
            mx.clear_cache()
    emit_json({"device": mx.device_info().get("device_name", "gpu"), "calls": args.calls, "repeats": args.repeats,
               "results": results}, args.json_out)


if __name__ == "__main__":
    main()
