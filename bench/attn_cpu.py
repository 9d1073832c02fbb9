"""CPU benchmark of segment attention: stock SDPA vs the composed route vs the fused_cpu op.

Owns: nothing the server imports. Run on the CPU (a BLAS preloaded as the server does):

    LD_PRELOAD=$(ls /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4 | head -1) \
        python bench/attn_cpu.py [--json-out bench/out/attn_cpu.json] [--reps 15] [--calls 30]

Per layer call at SmolLM2 shapes (batch 1, 9 query heads, 3 KV heads, D=64, float32):
decode (L=1) and a causal verify window (L=8) at histories of 64 / 512 / 2K / 8K rows,
split as one segment + a 16-row tail, and as 4 segments + the tail; the tail is a slice of
a 256-row buffer, as the segmented cache hands it over. Stock SDPA reads one contiguous
buffer of the same rows (what the stock KVCache gives it). Timing: a chain of `--calls`
dependent calls (each call's output is the next call's queries, as layers are: 30 per
SmolLM2 token), built lazily, then one `mx.eval`; the median over `--reps` divided by the
chain length. The variants are interleaved within every repetition so machine noise hits
all alike. Prints one JSON object (also written to --json-out) and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from segserve.kernels.composed import KVPair, attend_segments  # noqa: E402

N_Q, N_KV, HEAD_DIM, DTYPE = 9, 3, 64, mx.float32
TAIL_ROWS, TAIL_CAPACITY = 16, 256
HISTORIES = (64, 512, 2048, 8192)
WINDOWS = (1, 8)
SPLITS = (1, 4)  # segments before the tail

Call = Callable[[mx.array], mx.array]


def _normal(shape: tuple[int, ...], key: mx.array) -> mx.array:
    return mx.random.normal(shape, key=key).astype(DTYPE)


def _layout(history: int, n_segments: int, key: mx.array) -> tuple[list[KVPair], KVPair, KVPair]:
    """(segments, tail view, the same rows as one contiguous buffer)."""
    keys = mx.random.split(key, 2 * n_segments + 2)
    seg_total = history - TAIL_ROWS
    cuts = [seg_total * i // n_segments for i in range(n_segments + 1)]
    segments = [
        (_normal((1, N_KV, b - a, HEAD_DIM), keys[2 * i]), _normal((1, N_KV, b - a, HEAD_DIM), keys[2 * i + 1]))
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))
    ]
    buf_k = _normal((1, N_KV, TAIL_CAPACITY, HEAD_DIM), keys[-2])
    buf_v = _normal((1, N_KV, TAIL_CAPACITY, HEAD_DIM), keys[-1])
    tail = (buf_k[:, :, :TAIL_ROWS, :], buf_v[:, :, :TAIL_ROWS, :])  # strided views
    whole = (
        mx.concatenate([k for k, _ in segments] + [tail[0]], axis=2),
        mx.concatenate([v for _, v in segments] + [tail[1]], axis=2),
    )
    mx.eval(segments, buf_k, buf_v, whole)
    return segments, tail, whole


def _variants(segments: list[KVPair], tail: KVPair, whole: KVPair, window: int) -> dict[str, Call]:
    from segserve.kernels.fused_cpu import FusedCpuRoute

    scale = HEAD_DIM**-0.5
    mask = "causal" if window > 1 else None
    fused = FusedCpuRoute()

    def stock(q: mx.array) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, *whole, scale=scale, mask=mask)

    def composed(q: mx.array) -> mx.array:
        return attend_segments(q, segments, tail, scale=scale, causal=True)

    def fused_cpu(q: mx.array) -> mx.array:
        return fused(q, segments, tail, scale=scale, causal=True)

    return {"stock": stock, "composed": composed, "fused_cpu": fused_cpu}


def _time_chain(fn: Call, q: mx.array, calls: int) -> float:
    """Seconds per call of a chain of `calls` dependent calls, evaluated once."""
    start = time.perf_counter()
    x = q
    for _ in range(calls):
        x = fn(x)
    mx.eval(x)
    return (time.perf_counter() - start) / calls


def bench(reps: int, calls: int, histories: tuple[int, ...]) -> dict[str, Any]:
    from segserve.kernels.native import _segattn

    key = mx.random.key(0)
    rows: list[dict[str, Any]] = []
    for history in histories:
        for n_segments in SPLITS:
            key, k_layout, k_q = mx.random.split(key, 3)
            segments, tail, whole = _layout(history, n_segments, k_layout)
            for window in WINDOWS:
                q = _normal((1, N_Q, window, HEAD_DIM), k_q)
                mx.eval(q)
                fns = _variants(segments, tail, whole, window)
                for fn in fns.values():  # warm-up: compile caches, allocator, pages
                    _time_chain(fn, q, calls)
                samples: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(reps):
                    for name, fn in fns.items():
                        samples[name].append(_time_chain(fn, q, calls))
                med = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
                row = {
                    "history": history, "segments": n_segments, "tail": TAIL_ROWS, "L": window,
                    "us_per_call": {k: round(v, 1) for k, v in med.items()},
                    "fused_vs_stock": round(med["stock"] / med["fused_cpu"], 2),
                    "fused_vs_composed": round(med["composed"] / med["fused_cpu"], 2),
                }
                rows.append(row)
                print(
                    f"S={history:5d} seg={n_segments} L={window}: "
                    + "  ".join(f"{k}={v:8.1f}us" for k, v in med.items())
                    + f"  stock/fused={row['fused_vs_stock']}",
                    file=sys.stderr,
                )
    return {
        "shapes": {"n_q_heads": N_Q, "n_kv_heads": N_KV, "head_dim": HEAD_DIM, "dtype": "float32"},
        "timing": f"median of {reps} chains of {calls} dependent calls, per call (us)",
        "isa": _segattn.isa(),
        "threads": _segattn.threads(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--histories", type=int, nargs="*", default=list(HISTORIES))
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    from segserve.kernels import fused_cpu

    ok, why = fused_cpu.available()
    if not ok:
        print(f"fused_cpu unavailable: {why}", file=sys.stderr)
        return 1
    report = bench(args.reps, args.calls, tuple(args.histories))
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
