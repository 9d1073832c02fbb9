"""GPU benchmark of segment attention: fused CUDA kernel vs composed route vs stock SDPA.

Owns: nothing the server imports. Run on a CUDA machine (an H200 here):

    python bench/kernels_gpu.py [--out bench/out/kernels_gpu.json] [--quick] [--model]

Per layer call, 8B-llama shapes (32 query heads, 8 KV heads, D=128, bf16, batch 1):
decode (L=1) and verify (L=8, causal) at contexts 8K / 32K / 128K (`--prefill`: also prefill
chunks, L=256, causal, where `fused_wide` is the wide path), the history split into
1, 4 or 12 segments plus a 16-row tail (a slice of a 64-row buffer, as the segmented cache
hands it over); stock SDPA reads one contiguous buffer of the same rows. Timing: a chain of
`--calls` dependent calls (each call's output is the next call's queries, as layers are)
built lazily, then one `mx.eval`; median over `--reps`, divided by the chain length.
Bandwidth: K/V bytes per call / time, against a device copy (read + write) and a read-only
reduction, both measured in the same run.
`--model` adds whole-model decode tokens/s (random-weight 8B llama, bf16) through
`segserve.kernels.hook`: stock KVCache vs segmented cache with the composed and the fused route.
Prints one JSON object on stdout (also written to --out) and a table on stderr.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segserve.kernels.composed import KVPair, attend_segments  # noqa: E402
from segserve.kernels.fused_cuda import FusedCudaRoute, fused_available  # noqa: E402

N_Q, N_KV, D, DTYPE = 32, 8, 128, mx.bfloat16
TAIL_ROWS, TAIL_CAP = 16, 64
Step = Callable[[mx.array], mx.array]


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _evaluator(fn: Callable[[], mx.array]) -> Callable[[], None]:
    def run() -> None:
        mx.eval(fn())

    return run


def bandwidths(reps: int) -> dict[str, float]:
    """Device memory bandwidth, bytes/s: copies (read + write) and a read-only reduction.

    `copy` is the best of an elementwise bf16 pass and a float32 pass, each over 4 GiB
    (a few times the 60 MB L2); `read` is a sum over the float32 array (bytes read only).
    """
    out: dict[str, float] = {}
    x = mx.random.normal((1 << 16, 1 << 15)).astype(mx.bfloat16)  # 4 GiB (dims are int32)
    y = mx.random.normal((1 << 15, 1 << 15))  # float32, 4 GiB
    mx.eval(x, y)
    passes: list[tuple[str, Callable[[], mx.array], int]] = [
        ("copy_bf16", lambda: x + 1, 2 * x.nbytes),
        ("copy_f32", lambda: y * 2, 2 * y.nbytes),
        ("read_f32", lambda: y.sum(), y.nbytes),
    ]
    for name, fn, nbytes in passes:
        mx.eval(fn())  # warm the allocator and the kernel
        out[name] = nbytes / _median_time(_evaluator(fn), reps)
    out["copy"] = max(out["copy_bf16"], out["copy_f32"])
    out["read"] = out["read_f32"]
    return out


def _chain_time(step: Step, q: mx.array, calls: int, reps: int) -> tuple[float, float]:
    """(device seconds per call, host seconds per call to build the graph)."""

    def build() -> mx.array:
        y = q
        for _ in range(calls):
            y = step(y)
        return y

    mx.eval(build())  # warm-up: compiles, allocator
    builds: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        y = build()
        builds.append(time.perf_counter() - t0)
        mx.eval(y)

    total = _median_time(run, reps)
    host = statistics.median(builds)
    return (total - host) / calls, host / calls


def _make_case(ctx: int, n_seg: int, n_win: int, seed: int) -> dict[str, Any]:
    key = iter(mx.random.split(mx.random.key(seed), 2 * n_seg + 5))
    shape = (1, N_KV, ctx, D)
    k_all = mx.random.normal(shape, key=next(key)).astype(DTYPE)
    v_all = mx.random.normal(shape, key=next(key)).astype(DTYPE)
    # A prefill chunk's own rows are in the tail (the chunk sees them causally).
    tail_rows = TAIL_ROWS if n_win <= TAIL_ROWS else n_win + TAIL_ROWS
    hist = ctx - tail_rows
    bounds = [hist * i // n_seg for i in range(n_seg + 1)]
    # Separate allocations, as sealed segments are; the tail is a view of a bigger buffer.
    segs: list[KVPair] = [
        (mx.contiguous(k_all[:, :, a:b]), mx.contiguous(v_all[:, :, a:b]))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    pad = mx.zeros((1, N_KV, TAIL_CAP - TAIL_ROWS, D), dtype=DTYPE)  # 48 spare rows
    buf_k = mx.concatenate([k_all[:, :, hist:], pad], axis=2)
    buf_v = mx.concatenate([v_all[:, :, hist:], pad], axis=2)
    tail = (buf_k[:, :, :tail_rows], buf_v[:, :, :tail_rows])
    q = mx.random.normal((1, N_Q, n_win, D), key=next(key)).astype(DTYPE)
    mx.eval(k_all, v_all, segs, buf_k, buf_v, q)
    return {"q": q, "k": k_all, "v": v_all, "segs": segs, "tail": tail}


def _variants() -> dict[str, FusedCudaRoute]:
    return {
        "fused": FusedCudaRoute(),  # the default: in-kernel merge, 2 stages, 1 wave
        "fused_2pass": FusedCudaRoute(merge="two_pass"),  # split-K second launch
        "fused_w2": FusedCudaRoute(waves=2.0),
        "fused_s3": FusedCudaRoute(stages=3),
        "fused_wide": FusedCudaRoute(wide=True),  # prefill chunks (>= 49 packed rows): paired
        "fused_wide_w2": FusedCudaRoute(wide=True, waves=2.0),
        "fused_wide_c8": FusedCudaRoute(wide=True, min_chunk_rows=512),  # fewer, longer chunks
        "fused_wide1": FusedCudaRoute(wide=True, pair_keys=0),  # one window per block
        "fused_pair32": FusedCudaRoute(wide=True, pair_keys=32),  # paired, 32 keys per update
    }


ROUTES = ("stock", "composed", "fused", "fused_2pass", "fused_w2", "fused_s3", "fused_wide",
          "fused_wide_w2", "fused_wide_c8", "fused_wide1", "fused_pair32")


def _route_step(
    route: FusedCudaRoute, segs: list[KVPair], tail: KVPair, scale: float, causal: bool
) -> Step:
    def step(x: mx.array) -> mx.array:
        return route(x, segs, tail, scale=scale, causal=causal)

    return step


def bench_case(
    ctx: int, n_seg: int, n_win: int, args: argparse.Namespace, bw: dict[str, float]
) -> dict[str, Any]:
    case = _make_case(ctx, n_seg, n_win, seed=ctx + n_seg * 7 + n_win)
    scale = D**-0.5
    causal = n_win > 1
    segs, tail, k, v = case["segs"], case["tail"], case["k"], case["v"]
    mask = "causal" if causal else None
    steps: dict[str, Step] = {
        "stock": lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask),
        "composed": lambda x: attend_segments(x, segs, tail, scale=scale, causal=causal),
    }
    for name, route in _variants().items():
        steps[name] = _route_step(route, segs, tail, scale, causal)
    if args.routes:  # a subset (stock always: the reference)
        keep = {"stock", *args.routes.split(",")}
        steps = {n: f for n, f in steps.items() if n in keep}
    row: dict[str, Any] = {"ctx": ctx, "segments": n_seg, "L": n_win}
    want = steps["stock"](case["q"]).astype(mx.float32)
    kv_bytes = 2 * k.nbytes  # K and V, read once per call
    for name, step in steps.items():
        dev, host = _chain_time(step, case["q"], args.calls, args.reps)
        row[f"{name}_us"] = dev * 1e6
        row[f"{name}_host_us"] = host * 1e6
        row[f"{name}_bw_frac"] = kv_bytes / dev / bw["copy"]
        row[f"{name}_read_frac"] = kv_bytes / dev / bw["read"]
        err = mx.abs(step(case["q"]).astype(mx.float32) - want).max().item()
        row[f"{name}_max_err"] = err
    nan = float("nan")
    row["fused_over_stock"] = row.get("fused_us", nan) / row["stock_us"]
    row["wide_over_stock"] = row.get("fused_wide_us", nan) / row["stock_us"]
    # Attention FLOPs (QK and PV, every score counted) per second, for prefill rows.
    for name in ("stock", "fused_wide", "fused_wide1", "fused_pair32"):
        if f"{name}_us" in row:
            row[f"{name}_tflops"] = 4 * N_Q * n_win * ctx * D / (row[f"{name}_us"] * 1e6)
    row["fused_over_composed"] = row.get("fused_us", nan) / row.get("composed_us", nan)
    row["kv_bytes"] = kv_bytes
    return row


LLAMA_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": N_Q,
    "num_key_value_heads": N_KV,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "head_dim": D,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def _segments(layer_kv: list[KVPair], n_seg: int) -> list[Any]:
    from segserve.kv.segment import ROOT_DIGEST, Segment

    ctx = layer_kv[0][0].shape[2]
    bounds = [ctx * i // n_seg for i in range(n_seg + 1)]
    segments, parent = [], ROOT_DIGEST
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        seg = Segment.seal(
            [mx.contiguous(k[:, :, a:b]) for k, _ in layer_kv],
            [mx.contiguous(v[:, :, a:b]) for _, v in layer_kv],
            [0] * (b - a),
            parent,
        )
        segments.append(seg)
        parent = seg.digest
    mx.eval([s.keys for s in segments], [s.values for s in segments])
    return segments


def model_bench(
    contexts: list[int], tokens: int, dims: dict[str, Any] | None = None, rounds: int = 2
) -> list[dict[str, Any]]:
    """Whole-model decode tokens/s: stock KVCache vs segmented cache (composed, fused).

    The history is random K/V of `ctx` rows per layer (no prefill); decoding appends to
    mlx-lm's KVCache (stock) or to the segmented cache's tail behind 1 or 4 segments.
    """
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from segserve.kernels.hook import install
    from segserve.kv.segment import Snapshot
    from segserve.kv.segmented import SegmentedCache

    args = llama.ModelArgs(**(dims or LLAMA_8B))
    n_kv, head_dim = int(args.num_key_value_heads or N_KV), int(args.head_dim or D)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    n_layers = args.num_hidden_layers
    results: list[dict[str, Any]] = []
    for ctx in contexts:
        keys = mx.random.split(mx.random.key(ctx), 2 * n_layers)
        layer_kv = [
            (
                mx.random.normal((1, n_kv, ctx, head_dim), key=keys[2 * i]).astype(DTYPE),
                mx.random.normal((1, n_kv, ctx, head_dim), key=keys[2 * i + 1]).astype(DTYPE),
            )
            for i in range(n_layers)
        ]
        mx.eval(layer_kv)
        modes: list[tuple[str, int, Any]] = [
            ("stock", 0, None),
            ("segmented_composed", 4, attend_segments),
            ("segmented_fused", 1, FusedCudaRoute()),
            ("segmented_fused", 4, FusedCudaRoute()),
        ]
        best: dict[tuple[str, int], dict[str, Any]] = {}
        for _round in range(rounds):  # interleaved rounds: the best of each mode is kept
            for mode, n_seg, route in modes:
                if route is None:
                    cache: list[Any] = [KVCache() for _ in range(n_layers)]
                    for c, (k, v) in zip(cache, layer_kv, strict=True):
                        c.update_and_fetch(k, v)
                    install(model)  # stock caches fall through to mlx-lm
                else:
                    base = Snapshot(tuple(_segments(layer_kv, n_seg)))
                    cache = SegmentedCache(n_layers, base=base, route=route).layers
                    install(model)
                tps, host_ms = _decode_tps(model, cache, tokens)
                del cache
                row = {
                    "ctx": ctx,
                    "segments": n_seg,
                    "mode": mode,
                    "tokens_per_s": tps,
                    "host_build_ms_per_token": host_ms,
                }
                print(f"model {row}", file=sys.stderr, flush=True)
                key = (mode, n_seg)
                if key not in best or tps > best[key]["tokens_per_s"]:
                    best[key] = row
        results.extend(best.values())
        del layer_kv
    return results


def _decode_tps(model: Any, cache: list[Any], tokens: int, warmup: int = 8) -> tuple[float, float]:
    """(tokens/s, host ms per token spent building the step's graph) for greedy decode."""
    y = mx.array([[1]])
    t0, host = 0.0, 0.0
    for i in range(warmup + tokens):
        if i == warmup:
            mx.eval(y)
            mx.synchronize()
            t0 = time.perf_counter()
            host = 0.0
        tb = time.perf_counter()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        host += time.perf_counter() - tb
        mx.async_eval(y)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub; overlap the next step, as mlx-lm does
    mx.eval(y)
    return tokens / (time.perf_counter() - t0), host / tokens * 1e3


def _table(rows: list[dict[str, Any]], bw: dict[str, float]) -> str:
    names = [n for n in ROUTES if rows and f"{n}_us" in rows[0]]
    short = {n: n.replace("fused_", "") for n in names}
    head = (
        f"bandwidth: copy {bw['copy'] / 1e12:.2f} TB/s (read+write), "
        f"read {bw['read'] / 1e12:.2f} TB/s; times in us per layer call\n"
        f"{'ctx':>7} {'seg':>3} {'L':>3} | "
        + " ".join(f"{short[n]:>8}" for n in names)
        + f" | {'f/stock':>7} {'w/stock':>7} | {'max err':>7}"
    )
    lines = [head]
    for r in rows:
        times = " ".join(f"{r[f'{n}_us']:8.1f}" for n in names)
        err = max(r[f"{n}_max_err"] for n in names)
        lines.append(
            f"{r['ctx']:>7} {r['segments']:>3} {r['L']:>3} | {times} | "
            f"{r['fused_over_stock']:7.3f} {r['wide_over_stock']:7.3f} | {err:7.2g}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/out/kernels_gpu.json")
    ap.add_argument("--calls", type=int, default=32, help="dependent calls per timed chain")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="8K and 32K only, fewer reps")
    ap.add_argument("--model", action="store_true", help="also whole-model decode tokens/s")
    ap.add_argument("--model-tokens", type=int, default=96)
    ap.add_argument("--prefill", action="store_true", help="also L=256 prefill chunks")
    ap.add_argument("--segments", default="1,4,12", help="segment counts (comma-separated)")
    ap.add_argument("--contexts", help="contexts (comma-separated), overrides --quick's")
    ap.add_argument("--windows", help="query rows per call (comma-separated), overrides the set")
    ap.add_argument("--routes", help="routes to time besides stock (comma-separated), e.g. "
                    "fused_wide,fused_wide1")
    args = ap.parse_args()
    ok, why = fused_available()
    print(f"fused_available: {ok} ({why})", file=sys.stderr, flush=True)
    contexts = [8192, 32768] if args.quick else [8192, 32768, 131072]
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    windows: tuple[int, ...] = (1, 8, 256) if args.prefill else (1, 8)
    if args.windows:
        windows = tuple(int(w) for w in args.windows.split(","))
    if args.quick:
        args.reps = min(args.reps, 5)
    bw = bandwidths(args.reps)
    rows = []
    for ctx in contexts:
        for n_seg in (int(n) for n in args.segments.split(",")):
            for n_win in windows:
                rows.append(bench_case(ctx, n_seg, n_win, args, bw))
                r = rows[-1]
                print(
                    f"ctx={ctx} seg={n_seg} L={n_win}: "
                    + ", ".join(f"{n} {r[f'{n}_us']:.1f}" for n in ROUTES if f"{n}_us" in r),
                    file=sys.stderr,
                    flush=True,
                )
    result: dict[str, Any] = {
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()},
        "mlx": getattr(mx, "__version__", "?"),
        "fused_available": [ok, why],
        "shape": {"n_q_heads": N_Q, "n_kv_heads": N_KV, "head_dim": D, "dtype": str(DTYPE)},
        "tail_rows": TAIL_ROWS,
        "calls_per_chain": args.calls,
        "reps": args.reps,
        "bandwidth_Bps": bw,
        "rows": rows,
    }
    if args.model:
        result["model"] = model_bench([8192, 32768], args.model_tokens)
    text = json.dumps(result, indent=1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(_table(rows, bw), file=sys.stderr)


if __name__ == "__main__":
    main()
