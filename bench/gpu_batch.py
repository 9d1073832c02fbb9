"""Batched decode of many sessions forked from one history: segmented vs stock.

What it measures: B sessions, each a follow-up on one shared history of C tokens (the
segmented sessions share the history's segments; the stock ones each hold a copy, as a
stock server restoring a stored session would), decoding one token per step together
through `decode_batch`, the engine's batched step (greedy draws, one `mx.eval` per step).
Modes, in one run on the same weights:
  segmented      the batched segmented attention (`segserve.kernels.batch_attention`):
                 one shared-part call per history group and layer, one tail op
  per_session    the same caches with the batched attention off (one fused call per
                 session and layer: the path before it)
  segmented_by_history  the batched attention without the owned part (not in the default
                 modes): sessions of distinct histories one shared-part call each per
                 layer instead of together (`FusedCudaRoute.attend_owned`, which the
                 `segmented` modes here use, as a server with `--fused-owned on`)
  stock          mlx-lm KV caches, mlx-lm's SDPA per batch row
  segmented_pipelined  the segmented batch in the engine's pipelined form (not in the default
                 modes): each step built on the previous step's lazy draws and started
                 before that step's tokens are read (`--pipeline-decode-steps`)
  segmented_unfused  `segmented` on mlx-lm's own layout of the same weights (not in the
                 default modes): the projections not fused (`segserve.server.runner.gpu_layout`,
                 what the server does on a GPU and the other modes run on)
  segmented_mlx_qmm  `segmented` with every quantized product through MLX's own quantized
                 matmul as the model calls it (not in the default modes; the server's
                 `--gpu-small-qmm off`), for the A/B of `segserve.kernels.qmv_cuda`
  mlx_lm_batch   mlx-lm's own BatchGenerator (not in the default modes): each session a
                 copy of the history in mlx-lm's caches, its `next()` step per token, on
                 mlx-lm's own layout of the weights
`--histories distinct`: each session its own history of C tokens instead (unrelated users;
every mode then reads B histories per step, and the segmented batch has one history group
per session).
Per (B, C): aggregate decode tok/s, step ms, peak memory above the loaded weights, and the
fraction of the roofline: the bytes a step must read (weights + the KV the mode reads:
once for the shared history, B times for stock copies) over the device's memory bandwidth.

    python bench/gpu_batch.py --model random8b --sessions 1,8,32,64 --contexts 2048,8192 \\
        --out bench/results/gpu_batch_h200.json
    python bench/gpu_batch.py --plot bench/results/gpu_batch_h200.json   # the PNG (matplotlib)
    python bench/gpu_batch.py --ramp 32 --contexts 2048 [--warm-up]      # the cost of unseen batch sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # NVIDIA's figures for the SXM parts (HBM3e, HBM3)
PREFILL_CHUNK = 512
FIT_FRACTION = 0.9  # of the device's memory: above it, stock's copies are reported as not fitting


def _device_memory() -> int:
    """The device's memory in bytes as MLX reports it (CUDA: total_memory; Metal: memory_size)."""
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0)


def _history(loaded: Any, route: Any, rows: int, salt: int = 0) -> Any:
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import logits_last

    cache = SegmentedCache(loaded.num_layers, route=route)
    vocab = int(loaded.model.args.vocab_size)
    tokens = [(7 * i + 11 + 13 * salt) % vocab for i in range(rows)]
    for a in range(0, rows, PREFILL_CHUNK):
        mx.eval(logits_last(loaded.model, tokens[a : a + PREFILL_CHUNK], cache.layers))
    cache.record_tokens(tokens)
    base = cache.seal()
    mx.eval([s.keys for s in base.segments], [s.values for s in base.segments])
    return base


def _by_history(plan_fn: Any) -> Any:
    """The batched plan without its owned part: one shared-part call per history."""

    def plan(*a: Any) -> Any:
        got = plan_fn(*a)
        return None if got is None else (got[0], got[1], None)

    return plan


def _run(loaded: Any, caches: list[Any], steps: int, warm: int) -> tuple[float, int]:
    """Median step seconds over `steps` timed steps, and the peak bytes during them."""
    from segserve.server.runner import decode_batch

    b = len(caches)
    tokens = [(13 * i + 5) % 1000 for i in range(b)]
    times = []
    mx.reset_peak_memory()
    for step in range(warm + steps):
        t0 = time.perf_counter()
        logits = decode_batch(loaded.decode, tokens, [c.layers for c in caches])
        draws = mx.argmax(logits, axis=-1)
        mx.eval(draws)
        tokens = [int(t) for t in draws.tolist()]  # type: ignore[union-attr, arg-type]  # tolist() of a 1-d int array
        if step >= warm:
            times.append(time.perf_counter() - t0)
        for c, t in zip(caches, tokens, strict=True):
            c.record_tokens([t])
    times.sort()
    return times[len(times) // 2], int(mx.get_peak_memory())


def _run_pipelined(loaded: Any, caches: list[Any], steps: int, warm: int) -> tuple[float, int]:
    """As `_run`, in the engine's pipelined form (`--pipeline-decode-steps`): step t+1 is
    built on step t's lazy draws and started (`mx.async_eval`) before step t's tokens are
    read, so the host builds while the device runs."""
    from segserve.server.runner import decode_batch

    layers = [c.layers for c in caches]
    first = [(13 * i + 5) % 1000 for i in range(len(caches))]
    draws = mx.argmax(decode_batch(loaded.decode, mx.array(first, dtype=mx.uint32), layers), axis=-1)
    mx.async_eval(draws)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
    for c, t in zip(caches, first, strict=True):  # each row written is its fed token
        c.record_tokens([t])
    times = []
    mx.reset_peak_memory()
    for step in range(warm + steps):
        t0 = time.perf_counter()
        nxt = mx.argmax(decode_batch(loaded.decode, draws, layers), axis=-1)
        mx.async_eval(nxt)  # type: ignore[no-untyped-call]
        fed = cast(list[int], draws.tolist())  # fed to the step just started: read while it runs
        for c, t in zip(caches, fed, strict=True):
            c.record_tokens([t])
        draws = nxt
        if step >= warm:
            times.append(time.perf_counter() - t0)
    mx.eval(draws)
    times.sort()
    return times[len(times) // 2], int(mx.get_peak_memory())


def _run_mlx_lm(loaded: Any, bases: list[Any], b: int, steps: int, warm: int) -> tuple[float, int]:
    """mlx-lm's own `BatchGenerator` on the same weights: each session its own copy of the
    history (mlx-lm KV caches, as a stock server holds them), a one-token follow-up,
    greedy. Median seconds of its `next()` calls that decode every session (it evaluates
    the next step before returning this one's tokens), and the peak bytes during them."""
    from mlx_lm.generate import BatchGenerator

    from segserve.kv.stock import StockCache

    total = warm + steps + 2
    gen = BatchGenerator(loaded.model, max_tokens=total, stop_tokens=[], completion_batch_size=b,
                         prefill_batch_size=b)
    try:
        gen.insert([[(13 * i + 5) % 1000] for i in range(b)], max_tokens=[total] * b,
                   caches=[StockCache(loaded.num_layers, bases[i % len(bases)]).layers for i in range(b)])
        times: list[float] = []
        decoding = 0
        mx.reset_peak_memory()
        while len(times) < steps:
            t0 = time.perf_counter()
            _, generated = gen.next()
            took = time.perf_counter() - t0
            if len(generated) == b:  # a step of the whole batch (prompts are one token each)
                decoding += 1
                if decoding > warm:
                    times.append(took)
            elif decoding:
                raise RuntimeError(f"mlx-lm's batch decoded {len(generated)} of {b} sessions")
    finally:
        gen.close()
    times.sort()
    return times[len(times) // 2], int(mx.get_peak_memory())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bench.common import bench_route, load_bench_model, model_info
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.kv.stock import StockCache
    from segserve.server.runner import batched

    loaded = load_bench_model(args.model)
    install(loaded.model)
    modes = args.modes.split(",")
    plain = loaded  # mlx-lm's own layout: the same weights (same seed), projections apart
    if mx.default_device() != mx.cpu and {"mlx_lm_batch", "segmented_unfused"} & set(modes):
        plain = load_bench_model(args.model, fuse=False)
        install(plain.model)
    mlx_qmm = loaded
    if "segmented_mlx_qmm" in modes:
        mlx_qmm = load_bench_model(args.model, small_qmm=False)
        install(mlx_qmm.model)
    route_name, route = bench_route(loaded)
    if hasattr(route, "owned_launches"):  # the fused CUDA route: as with `--fused-owned on`
        route.owned_launches = True  # `segmented` measures them, `segmented_by_history` not
    bw = HBM_BYTES_PER_S.get(args.device_name)
    weights, per_tok = loaded.weights_bytes, loaded.kv_bytes_per_token
    plan_fn = batched._batch_plan
    memory = int(args.memory_gib * 2**30) if args.memory_gib else _device_memory()
    rows: list[dict[str, Any]] = []
    distinct = args.histories == "distinct"
    for ctx in [int(c) for c in args.contexts.split(",")]:
        bases = [_history(loaded, route, ctx)]
        for b in [int(s) for s in args.sessions.split(",")]:
            if distinct:  # one history per session, made once and kept for larger B
                bases += [_history(loaded, route, ctx, salt=i) for i in range(len(bases), b)]
            row: dict[str, Any] = {"sessions": b, "context": ctx, "histories": args.histories}
            for mode in modes:
                gc.collect()
                mx.clear_cache()
                copies = mode in ("stock", "mlx_lm_batch")
                # stock: each session's own copy; distinct histories: every mode reads b of them
                kv_read = (b if copies or distinct else 1) * ctx * per_tok
                if copies and memory and weights + kv_read > FIT_FRACTION * memory:
                    # Capacity, not speed: the copies alone would not fit in the device's memory.
                    row[mode] = {"skipped": f"{b} copies of the history need "
                                 f"{(weights + kv_read) / 2**30:.1f} GiB with the weights; "
                                 f"the device has {memory / 2**30:.1f}"}
                    print(json.dumps({"sessions": b, "context": ctx, mode: row[mode]}), flush=True)
                    continue
                batched._batch_plan = {"per_session": lambda *a: None,
                                       "segmented_by_history": _by_history(plan_fn)}.get(mode, plan_fn)
                model = (plain if mode in ("mlx_lm_batch", "segmented_unfused")
                         else mlx_qmm if mode == "segmented_mlx_qmm" else loaded)
                caches: list[Any] = []
                try:
                    start = mx.get_active_memory()
                    if mode == "mlx_lm_batch":
                        step_s, peak = _run_mlx_lm(model, bases[:b], b, args.steps, args.warm)
                    else:
                        if mode == "stock":
                            caches = [StockCache(loaded.num_layers, bases[i % len(bases)]) for i in range(b)]
                        else:
                            caches = [SegmentedCache(loaded.num_layers, bases[i % len(bases)], route=route)
                                      for i in range(b)]
                        run = _run_pipelined if mode == "segmented_pipelined" else _run
                        step_s, peak = run(model, caches, args.steps, args.warm)
                except (RuntimeError, MemoryError) as e:  # e.g. the device out of memory
                    row[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print(json.dumps({"sessions": b, "context": ctx, mode: row[mode]}), flush=True)
                    continue
                finally:
                    batched._batch_plan = plan_fn
                    del caches
                roof = (weights + kv_read) / bw if bw else None
                row[mode] = {
                    "tok_s": round(b / step_s, 1), "step_ms": round(step_s * 1e3, 3),
                    "peak_above_start_mib": round((peak - start) / 2**20, 1),
                    "bytes_read": weights + kv_read,
                    "roofline_tok_s": round(b / roof, 1) if roof else None,
                    "roofline_fraction": round(roof / step_s, 3) if roof else None,
                }
                print(json.dumps({"sessions": b, "context": ctx, mode: row[mode]}), flush=True)
            if "tok_s" in row.get("stock", {}) and "tok_s" in row.get("segmented", {}):
                row["segmented_over_stock"] = round(row["segmented"]["tok_s"] / row["stock"]["tok_s"], 3)
            if "tok_s" in row.get("segmented_mlx_qmm", {}) and "tok_s" in row.get("segmented", {}):
                row["small_qmm_speedup"] = round(row["segmented"]["tok_s"] / row["segmented_mlx_qmm"]["tok_s"], 3)
            if "tok_s" in row.get("segmented_unfused", {}) and "tok_s" in row.get("segmented", {}):
                row["fused_over_unfused"] = round(row["segmented"]["tok_s"] / row["segmented_unfused"]["tok_s"], 3)
            for mode in ("segmented", "segmented_pipelined"):
                if "tok_s" in row.get("mlx_lm_batch", {}) and "tok_s" in row.get(mode, {}):
                    row[f"{mode}_over_mlx_lm"] = round(row[mode]["tok_s"] / row["mlx_lm_batch"]["tok_s"], 3)
            rows.append(row)
        del bases
    return {"bench": "gpu_batch", "histories": args.histories, "model": model_info(loaded, route_name),
            "device_name": args.device_name, "steps": args.steps, "warm": args.warm,
            "command": " ".join(sys.argv), "rows": rows}


def _time_us(fn: Any, *a: Any) -> float:
    """Median of 5 timings (after one warm-up) of 32 calls evaluated together, per call."""
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        mx.eval([fn(*a)[0] for _ in range(32)])
        ts.append((time.perf_counter() - t0) / 32 * 1e6)
    return round(sorted(ts[1:])[2], 1)


def _sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float) -> tuple[mx.array]:
    return (mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),)


def micro(args: argparse.Namespace) -> dict[str, Any]:
    """The shared part alone, per layer call: the fused route's `attend_lse` and
    `plain_lse` with the sessions as query positions over one segment, against stock SDPA
    over B copies of it (random 8B shape: 32 / 8 heads, D 128, bfloat16)."""
    from segserve.kernels.batch_attention import plain_lse
    from segserve.kernels.fused_cuda import FusedCudaRoute

    route = FusedCudaRoute()
    out: list[dict[str, Any]] = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        k = mx.random.normal((1, 8, ctx, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, ctx, 128)).astype(mx.bfloat16)
        for b in [int(s) for s in args.sessions.split(",")]:
            q = mx.random.normal((1, 32, b, 128)).astype(mx.bfloat16)
            kb = mx.broadcast_to(k, (b, 8, ctx, 128)) + 0
            vb = mx.broadcast_to(v, (b, 8, ctx, 128)) + 0
            qb = q.transpose(2, 1, 0, 3)
            mx.eval(k, v, q, kb, vb, qb)
            row: dict[str, Any] = {"sessions": b, "context": ctx}
            if mx.default_device() == mx.gpu:
                row["attend_lse_us"] = _time_us(route.attend_lse, q, [(k, v)], 0.088)
            row["plain_lse_us"] = _time_us(plain_lse, q, [(k, v)], 0.088)
            row["stock_sdpa_copies_us"] = _time_us(_sdpa, qb, kb, vb, 0.088)
            print(json.dumps(row), flush=True)
            out.append(row)
            del kb, vb
    return {"bench": "gpu_batch_micro", "command": " ".join(sys.argv), "rows": out}


def _unfused_merge(scale: float) -> Any:
    """The tail part and the LSE merge as separate ops (what `batch_attention._merged_compiled`
    replaced), for the comparisons below."""
    from segserve.kernels import batch_attention
    from segserve.kernels.fused_cuda import merge_by_lse

    def apply(q: mx.array, k: mx.array, v: mx.array, lengths: mx.array, so: mx.array, sl: mx.array) -> mx.array:
        to, tl = batch_attention._tail_compiled(scale)(q, k, v, lengths)
        return merge_by_lse([so, to], [sl, tl]).astype(q.dtype)
    return apply


@contextmanager
def _undone(restack: bool, unfuse: bool) -> Iterator[None]:
    """The batched attention with the tails re-stacked every step (`restack`) and/or the
    tail part and the merge unfused (`unfuse`), as before either change; restored after."""
    from segserve.kernels import batch_attention
    from segserve.kv.segmented import SegmentedCache

    kept, merged = SegmentedCache.kept_stack, batch_attention._merged_compiled
    if restack:  # no stack is known to be kept: every tail is stacked on its own (`padded_tail`)
        SegmentedCache.kept_stack = lambda *a: None  # type: ignore[method-assign]
    if unfuse:
        batch_attention._merged_compiled = _unfused_merge  # type: ignore[assignment]
    try:
        yield
    finally:
        SegmentedCache.kept_stack = kept  # type: ignore[method-assign]
        batch_attention._merged_compiled = merged


def parts(args: argparse.Namespace) -> dict[str, Any]:
    """Where a batched segmented step's time goes, per (B, C), variants interleaved:
    `step` (decode_batch + greedy draws, evaluated), `graph_build` (building that step's
    graph on the host, not evaluated while timed), `no_attention` (the step with every
    layer's attention replaced by its queries: products, norms, RoPE, head), `tail_only`
    (the batched attention without the shared history's part), `shared_only` (only the
    shared history's part, GPU). The rows each step writes stay (no trim: a trim would
    make every step re-stack the tails), so the context grows by a few dozen rows."""
    from bench.common import bench_route, load_bench_model
    from segserve.kernels.hook import install

    loaded = load_bench_model(args.model)
    install(loaded.model)
    modes = args.modes.split(",")
    plain = loaded  # mlx-lm's own layout: the same weights (same seed), projections apart
    if mx.default_device() != mx.cpu and {"mlx_lm_batch", "segmented_unfused"} & set(modes):
        plain = load_bench_model(args.model, fuse=False)
        install(plain.model)
    _, route = bench_route(loaded)
    out: list[dict[str, Any]] = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        base = _history(loaded, route, ctx)
        for b in [int(s) for s in args.sessions.split(",")]:
            row: dict[str, Any] = {"sessions": b, "context": ctx}
            row.update(_parts_row(loaded, base, route, b, args.steps, args.warm))
            print(json.dumps(row), flush=True)
            out.append(row)
        del base
    return {"bench": "gpu_batch_parts", "command": " ".join(sys.argv), "rows": out}


def _parts_row(loaded: Any, base: Any, route: Any, b: int, steps: int, warm: int) -> dict[str, float]:
    from segserve.kernels import batch_attention
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import batched, decode_batch

    real_rows, real_plan = batched._attend_rows, batch_attention.plan_batch
    module: Any = batched
    caches = [SegmentedCache(loaded.num_layers, base, route=route) for _ in range(b)]
    layers = [c.layers for c in caches]
    tokens = [(13 * i + 5) % 1000 for i in range(b)]

    def no_groups(cs: Any) -> Any:
        plan = real_plan(cs)
        return batch_attention.BatchPlan(groups=(), singles=0, order=plan.order, lengths=plan.lengths,
                                         tail_pad=plan.tail_pad, n_without=len(cs),
                                         written=plan.written, new_row=plan.new_row)

    def shared_only(attn: Any, q: mx.array, k: mx.array, v: mx.array, cs: Any, batch: Any = None) -> mx.array:
        o, _ = batch[1](q.transpose(2, 1, 0, 3), cs[0].segment_kv(), attn.scale)
        return cast(mx.array, o.transpose(2, 1, 0, 3).astype(q.dtype))

    def variant(rows: Any = None, plan: Any = None, build_only: bool = False) -> Any:
        def run() -> float | None:
            batched._attend_rows = rows or real_rows
            module.plan_batch = plan or real_plan  # the name batched imported
            try:
                t0 = time.perf_counter()
                draws = mx.argmax(decode_batch(loaded.decode, tokens, layers), axis=-1)
                took = time.perf_counter() - t0
                mx.eval(draws)
                return took if build_only else None
            finally:
                batched._attend_rows = real_rows
                module.plan_batch = real_plan
        return run

    def undone(fn: Any, restack: bool, unfuse: bool) -> Any:
        def run() -> float | None:
            with _undone(restack, unfuse):
                return cast(float | None, fn())
        return run

    variants = {
        "step": variant(),
        "step_restacked": undone(variant(), True, False),
        "step_unfused_merge": undone(variant(), False, True),
        "step_before": undone(variant(), True, True),
        "graph_build": variant(build_only=True),
        "no_attention": variant(rows=lambda attn, q, k, v, cs, batch=None: q),
        "tail_only": variant(plan=no_groups),
    }
    if b > 1 and mx.default_device() == mx.gpu:
        variants["shared_only"] = variant(rows=shared_only)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(warm):
        for fn in variants.values():
            fn()
    for _ in range(steps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            own = fn()
            times[name].append(own if own is not None else time.perf_counter() - t0)
    return {f"{k}_ms": round(1e3 * sorted(v)[len(v) // 2], 3) for k, v in times.items()}


def host(args: argparse.Namespace) -> dict[str, Any]:
    """Host time to build one step's batched attention over 32 layers (8B shape: 32 / 8 heads,
    D 128; one shared history of 64 rows, one row per session and layer), not evaluated:
    the default against the tails re-stacked every step (`restacked`), the tail part and the
    LSE merge as separate ops (`unfused`), and both (`before`); and a batch that changes
    every step (`churn`: its first session leaves, then is back), kept rows taken as slices of
    the previous stack against every tail re-stacked (`churn_restacked`). Runs on any device
    (the shared part by `plain_lse`); median of 10 steps after 2."""
    from segserve.kernels import batch_attention as ba
    from segserve.kernels.composed import attend_segments
    from segserve.kv.segmented import SegmentedCache

    layers_n, hkv, hq, d = 32, 8, 32, 128

    def build_ms(b: int, variant: str, churn: bool = False) -> float:
        root = SegmentedCache(layers_n, route=attend_segments)
        for lc in root.layers:
            lc.update_and_fetch(mx.zeros((1, hkv, 64, d)), mx.zeros((1, hkv, 64, d)))
        root.record_tokens(list(range(64)))
        base = root.seal()
        caches = [SegmentedCache(layers_n, base, route=attend_segments) for _ in range(b)]
        q, k = mx.zeros((b, hq, 1, d)), mx.zeros((b, hkv, 1, d))
        ts = []
        with _undone(variant in ("restacked", "before"), variant in ("unfused", "before")):
            for step in range(12):
                # churn: the batch changes every step (its first session leaves, then is back)
                members = caches[1:] if churn and step % 2 else caches
                per_layer = [[c.layers[li] for c in members] for li in range(layers_n)]
                plan = ba.plan_batch(per_layer[0])
                n = len(members)
                t0 = time.perf_counter()
                outs = [ba.attend_batch(q[:n], k[:n], k[:n], per_layer[li], plan, 0.088, ba.plain_lse)
                        for li in range(layers_n)]
                ts.append(time.perf_counter() - t0)
                mx.eval(outs)
        return round(1e3 * sorted(ts[2:])[len(ts[2:]) // 2], 3)

    rows = []
    for b in [int(s) for s in args.sessions.split(",") if int(s) > 1]:
        row: dict[str, Any] = {"sessions": b}
        row.update({f"{v}_ms": build_ms(b, v) for v in ("default", "restacked", "unfused", "before")})
        # A batch that changes every step: the kept rows as slices of the previous stack
        # (default) against every tail re-stacked on its own.
        row.update({"churn_ms": build_ms(b, "default", churn=True),
                    "churn_restacked_ms": build_ms(b, "restacked", churn=True)})
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"bench": "gpu_batch_host", "device": str(mx.default_device()), "command": " ".join(sys.argv), "rows": rows}


def ramp(args: argparse.Namespace) -> dict[str, Any]:
    """What a decode step at a batch size not seen before costs: sessions (each its own
    history, as clients arriving one by one) join one per step, B = 1..N, and the same ramp
    runs again; the first pass pays MLX's compiles (graph traces per new shape, GPU
    kernels), the second finds them done. With `--warm-up`, the server's start-up warm-up
    (`segserve.server.runner.warmup`) runs first, and the first pass shows what is left."""
    from bench.common import bench_route, load_bench_model, model_info
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner.warmup import warm_up

    loaded = load_bench_model(args.model)
    install(loaded.model)
    route_name, route = bench_route(loaded)
    if hasattr(route, "owned_launches"):  # the fused CUDA route: as `--fused-owned`
        route.owned_launches = args.owned == "on"
    n = args.ramp
    vocab = int(loaded.model.args.vocab_size)
    ctx = int(args.contexts.split(",")[0])
    report: dict[str, Any] = {"bench": "gpu_batch_ramp", "model": model_info(loaded, route_name),
                              "device_name": args.device_name, "context": ctx, "sessions": n,
                              "owned": args.owned, "command": " ".join(sys.argv)}
    if args.warm_up:
        got = warm_up(loaded.model, loaded.decode, lambda base: SegmentedCache(
            loaded.num_layers, base, route=route), max_batch=n, prefill_chunk=PREFILL_CHUNK, vocab=vocab)
        report["warm_up"] = got.as_dict()
    bases = [_history(loaded, route, ctx, salt=i) for i in range(n)]
    report["restack"] = args.restack
    undo = _undone(restack=True, unfuse=False) if args.restack else nullcontext()
    with undo:
        _ramp_passes(loaded, route, bases, vocab, report)
    first, second = report["first_pass_ms"], report["second_pass_ms"]
    report["ramp_s"] = {"first": round(sum(first) / 1e3, 3), "second": round(sum(second) / 1e3, 3)}
    report["worst_first_ms"] = max(first)
    return report


def _ramp_passes(loaded: Any, route: Any, bases: list[Any], vocab: int, report: dict[str, Any]) -> None:
    """Two passes of sessions joining one per step (`ramp`); each step's ms into `report`."""
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import decode_batch

    n = len(bases)
    for name in ("first_pass_ms", "second_pass_ms"):
        caches: list[Any] = []
        times = []
        for b in range(1, n + 1):
            caches.append(SegmentedCache(loaded.num_layers, bases[b - 1], route=route))
            t0 = time.perf_counter()
            logits = decode_batch(loaded.decode, [(13 * i + 5) % vocab for i in range(b)], [c.layers for c in caches])
            mx.eval(mx.argmax(logits, axis=-1))
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
            for c in caches:
                c.record_tokens([1])
        report[name] = times
        print(json.dumps({name: times}), flush=True)
        del caches


def plot(path: str) -> None:
    from bench.common import plot_panels

    report = json.loads(Path(path).read_text())
    for ctx in sorted({r["context"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["context"] == ctx]
        x = [float(r["sessions"]) for r in rows]
        modes = [m for m in ("segmented", "segmented_pipelined", "segmented_by_history", "per_session", "stock",
                             "mlx_lm_batch")
                 if m in rows[0]]
        series = {m: [r[m].get("tok_s", float("nan")) for r in rows] for m in modes}
        frac = {m: [r[m].get("roofline_fraction") or float("nan") for r in rows] for m in modes}
        plot_panels(str(Path(path).with_suffix("")) + f"_{ctx}.png", x, "sessions",
                    [("aggregate decode tok/s", series), ("fraction of roofline", frac)],
                    f"{report['model']['id']}, history {ctx} tokens, {report['device_name']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random8b")
    ap.add_argument("--sessions", default="1,8,32,64")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--modes", default="segmented,per_session,stock")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--device-name", default="H200", help="bandwidth key for the roofline")
    ap.add_argument("--out", default=None)
    ap.add_argument("--histories", choices=("shared", "distinct"), default="shared",
                    help="shared: every session a follow-up of one history; distinct: each "
                         "session its own history of the same length (as unrelated users)")
    ap.add_argument("--memory-gib", type=float, default=0.0,
                    help="the device's memory for the fit check (default: what MLX reports)")
    ap.add_argument("--micro", action="store_true", help="time the shared part alone")
    ap.add_argument("--parts", action="store_true", help="where a batched step's time goes")
    ap.add_argument("--host", action="store_true", help="host time of a step's batched attention")
    ap.add_argument("--plot", default=None, help="draw the PNGs of a result JSON and exit")
    ap.add_argument("--ramp", type=int, default=0,
                    help="sessions joining one per step up to N (own histories of the first "
                         "--contexts length): each step's time in a first and a second pass")
    ap.add_argument("--warm-up", action="store_true",
                    help="with --ramp: the server's start-up warm-up first (up to N)")
    ap.add_argument("--owned", choices=("on", "off"), default="on",
                    help="with --ramp: sessions of their own histories share attention launches "
                         "(the server's --fused-owned; on by default)")
    ap.add_argument("--restack", action="store_true",
                    help="with --ramp: every tail re-stacked on its own when the batch changes "
                         "(no slices of the previous stack), for the A/B")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return
    if args.ramp:
        report = ramp(args)
    elif args.micro:
        report = micro(args)
    elif args.parts or args.host:
        report = parts(args) if args.parts else host(args)
    else:
        report = measure(args)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
