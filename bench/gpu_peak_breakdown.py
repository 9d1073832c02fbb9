"""Where a segmented follow-up turn's GPU memory goes: one turn taken apart.

Owns: the breakdown probe behind the H200 figures of bench/zero_cost.py. It replays what
the engine does for one follow-up turn, phase by phase, directly on the model (the
server's own `logits_last`, `SegmentedCache` and fused route), over a synthetic history of
random K/V rows (the model's dtype) laid out as two sealed segments (a long one and a 63-row reply,
as bench/zero_cost.py's conversation leaves them), and reports for each phase MLX's peak
above the turn's start and above the phase's start:

    tail      the tail buffers the first chunk allocates (new rows, reserved for the prompt)
    chunk i   each prefill chunk (`--chunk` rows): activations and attention workspaces
              the forward holds while the GPU runs behind the host
    seal      turn boundary 1 (the prompt's rows become a segment)
    decode    `--decode` single-token steps
    seal2     turn boundary 2, merges included (the synthetic layout has four tier-0
              segments by then, so this seal merges them wherever the rows fit the cap)

Variants of the prefill (each on a fresh tail over the same history, run twice; the second
run is reported, the first compiles): the fused route as `build` makes it (`paced2`:
prefill calls paced to 2 queued), paced to 1 and 3, unpaced (`in_flight=0`, the route
before the pacing), unpaced with the forward evaluated layer by layer (the floor: one
layer's work at a time), and stock mlx-lm attention over a contiguous, unshared history
(what stock mode holds besides its copy of the history). It also reports the workspace of
one prefill and one decode call (`ws` of the launch plan) and, from `segserve.kv.merge_policy`,
whether bench/zero_cost.py's measured turn merges segments at each history length.

Run (the H200; JSON to stdout and --json-out):
    python bench/gpu_peak_breakdown.py --contexts 8192,32768,131072 --json-out OUT.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models.base import create_attention_mask  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.common import emit_json, exit_now, load_bench_model, log  # noqa: E402
from segserve.kernels import fused_cuda  # noqa: E402
from segserve.kernels.factory import RouteQuery  # noqa: E402
from segserve.kernels.hook import install  # noqa: E402
from segserve.kv.merge_policy import seal_onto  # noqa: E402
from segserve.kv.segment import Segment, Snapshot  # noqa: E402
from segserve.kv.segmented import SegmentedCache  # noqa: E402
from segserve.server.runner import LoadedModel, logits_last  # noqa: E402
from segserve.server.runner.forward import head_of  # noqa: E402

MIB = 1 << 20


def _measure(fn: Callable[[], Any], turn_start: int) -> dict[str, float]:
    """Run `fn` to completion; its peak above its own start and above the turn's, and time."""
    gc.collect()
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = fn()
    if out is not None:
        mx.eval(out)
    mx.synchronize()
    dt = time.perf_counter() - t0
    # reset_peak_memory zeroes the counter: a phase that allocates nothing reads a peak
    # below its start, i.e. 0 above it (as bench/common.run_turn clamps it).
    peak = max(mx.get_peak_memory(), start)
    return {"ms": dt * 1e3, "peak_above_phase_mib": (peak - start) / MIB,
            "peak_above_turn_mib": (peak - turn_start) / MIB,
            "held_after_mib": (mx.get_active_memory() - turn_start) / MIB}


def _history(loaded: LoadedModel, rows: Sequence[int], seed: int) -> Snapshot:
    """Sealed segments of random rows in the model's K/V dtype (every layer), oldest first."""
    mx.random.seed(seed)
    dtype = getattr(mx, loaded.kv_dtype)
    shape = (1, loaded.n_kv_heads)
    segs: list[Segment] = []
    parent = Snapshot().digest
    for n in rows:
        ks, vs = [], []
        for _ in range(loaded.num_layers):
            k = mx.random.normal((*shape, n, loaded.head_dim), dtype=dtype)
            v = mx.random.normal((*shape, n, loaded.head_dim), dtype=dtype)
            mx.eval(k, v)
            ks.append(k)
            vs.append(v)
        seg = Segment.seal(ks, vs, [7 + i % 1000 for i in range(n)], parent)
        parent = seg.digest
        segs.append(seg)
    return Snapshot(tuple(segs))


def _sync_trunk_logits(model: Any, tokens: Sequence[int], cache: Sequence[Any]) -> mx.array:
    """`logits_last` with every layer evaluated before the next is built (the floor)."""
    trunk = model.model
    h = trunk.embed_tokens(mx.array([list(tokens)], dtype=mx.int32))
    mask = create_attention_mask(h, cache[0])
    for layer, c in zip(trunk.layers, cache, strict=True):
        h = layer(h, mask, cache=c)
        mx.eval(h)
    out: mx.array = head_of(model)(trunk.norm(h)[:, -1:, :])[0, -1]
    return out


def _sealed(cache: SegmentedCache) -> list[mx.array]:
    """Seal (merges included) and return the newest segment's arrays, to evaluate."""
    last = cache.seal().segments[-1]
    return [*last.keys, *last.values]


def _turn(loaded: LoadedModel, base: Snapshot, route: fused_cuda.FusedCudaRoute | None,
          new: int, chunk: int, decode: int, sync_layers: bool) -> dict[str, Any]:
    """One follow-up turn: prefill `new` rows in chunks, seal, decode, seal."""
    model = loaded.model
    dtype = getattr(mx, loaded.kv_dtype)
    vocab = int(loaded.tokenizer.vocab_size)
    rng = [4 + (i * 7919) % (vocab - 4) for i in range(new + decode)]
    gc.collect()
    mx.synchronize()
    turn_start = mx.get_active_memory()
    phases: dict[str, Any] = {}
    if route is None:  # stock: contiguous history with room for the turn, shared by nobody
        rows = base.rows
        caches: list[Any] = []
        for _ in range(loaded.num_layers):
            c = KVCache()
            cap = rows + new + decode + 256
            c.keys = mx.zeros((1, loaded.n_kv_heads, cap, loaded.head_dim), dtype)
            c.values = mx.zeros((1, loaded.n_kv_heads, cap, loaded.head_dim), dtype)
            c.offset = rows
            caches.append(c)
        mx.eval([c.keys for c in caches], [c.values for c in caches])
        gc.collect()
        turn_start = mx.get_active_memory()
        layers: Any = caches
        seg_cache = None
    else:
        seg_cache = SegmentedCache(loaded.num_layers, base, route=route, dtype=dtype)
        seg_cache.reserve(new)
        layers = seg_cache.layers
    for i, s in enumerate(range(0, new, chunk)):
        toks = rng[s : s + chunk]
        forward = _sync_trunk_logits if sync_layers else logits_last
        phases[f"chunk{i}"] = _measure(partial(forward, model, toks, layers), turn_start)
        if seg_cache is not None:
            seg_cache.record_tokens(toks)
    if seg_cache is not None:
        phases["tail_mib"] = seg_cache.tail_nbytes() / MIB
        phases["seal"] = _measure(lambda: _sealed(seg_cache), turn_start)
        layers = seg_cache.layers

    def steps() -> None:
        for t in rng[new : new + decode]:
            mx.eval(logits_last(model, [t], layers))
            if seg_cache is not None:
                seg_cache.record_tokens([t])

    phases["decode"] = _measure(steps, turn_start)
    if seg_cache is not None:
        merges = seg_cache.merges
        phases["seal2"] = _measure(lambda: _sealed(seg_cache), turn_start)
        phases["seal2"]["merges"] = seg_cache.merges - merges
    prefill = [v for k, v in phases.items() if k.startswith("chunk")]
    summary = {
        "prefill_ms": sum(p["ms"] for p in prefill),
        "prefill_peak_above_turn_mib": max(p["peak_above_turn_mib"] for p in prefill),
        "turn_peak_above_turn_mib": max(p["peak_above_turn_mib"] for k, p in phases.items()
                                        if isinstance(p, dict)),
        "decode_ms_per_step": phases["decode"]["ms"] / max(1, decode),
    }
    return {"phases": phases, **summary}


def _workspaces(route: fused_cuda.FusedCudaRoute, head_dim: int) -> dict[str, float]:
    """Workspace (`ws`) of each launch shape the route planned, MiB, by query positions."""
    out: dict[str, float] = {}
    for key, recipe in route._recipes.items():
        if isinstance(recipe, fused_cuda._Recipe):
            positions = int(key[0][2])
            out[f"L={positions}"] = max(out.get(f"L={positions}", 0.0),
                                        recipe.plan.ws_floats(head_dim) * 4 / MIB)
    return out


def _bench_merge(context: int, chunk: int = 8192, reserve: int = 576, decode: int = 64,
                 follow: int = 512) -> dict[str, Any]:
    """Replay bench/zero_cost.py's conversation through `segserve.kv.merge_policy` (rows only): the
    segments before the measured follow-up and the rows its two seals merge."""
    levels: list[int] = []
    rows: list[int] = []

    def seal(n: int) -> list[int]:
        return [p.rows for p in seal_onto(levels, rows, n)]

    hist = stored = 0
    for target in sorted({8192, 32768, 131072, context}):
        if target > context:
            break
        while (n := min(chunk, target - reserve - hist)) >= 8:
            prompt = hist + n
            seal(prompt - stored)
            seal(decode - 1)
            hist, stored = prompt + decode, prompt + decode - 1
    before = list(rows)
    merged = seal(hist + follow - stored) + seal(decode - 1)
    return {"segments_before": before, "followup_merge_rows": merged}


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    loaded = load_bench_model(cfg.model)
    install(loaded.model)
    dtype = getattr(mx, loaded.kv_dtype)
    keys, why = fused_cuda.wide_path(loaded.head_dim, dtype)
    if not fused_cuda.fused_available()[0]:
        raise SystemExit(f"the fused CUDA route is not available here: {fused_cuda.fused_available()[1]}")

    query = RouteQuery("cuda", loaded.head_dim, int(loaded.model.args.num_attention_heads),
                       loaded.n_kv_heads, dtype)

    def route(in_flight: int) -> fused_cuda.FusedCudaRoute:
        return fused_cuda.build(query, in_flight)

    variants: list[tuple[str, int | None, bool]] = [
        ("unpaced", 0, False), ("paced1", 1, False), ("paced2", 2, False),
        ("paced3", 3, False), ("unpaced_sync_layers", 0, True), ("stock", None, False),
    ]
    results = []
    for context in cfg.contexts:
        history = context - cfg.new - cfg.decode
        base = _history(loaded, [history - 63, 63], seed=context)
        log(f"history {history} rows ({base.nbytes / MIB:.0f} MiB held)")
        row: dict[str, Any] = {"context": context, "history_rows": history,
                               "new_rows": cfg.new, "variants": {}}
        for name, paced, sync in variants:
            r = route(paced) if paced is not None else None
            for _ in range(2):  # the first run compiles and warms the allocator
                res = _turn(loaded, base, r, cfg.new, cfg.chunk, cfg.decode, sync)
            if r is not None:
                res["workspace_mib"] = _workspaces(r, loaded.head_dim)
            row["variants"][name] = res
            log(f"{context} {name}: prefill peak {res['prefill_peak_above_turn_mib']:.0f} MiB, "
                f"turn peak {res['turn_peak_above_turn_mib']:.0f} MiB, "
                f"prefill {res['prefill_ms']:.1f} ms")
        row["new_rows_mib"] = cfg.new * loaded.kv_bytes_per_token / MIB
        row["zero_cost_bench"] = _bench_merge(context)
        row["zero_cost_bench"]["followup_merge_mib"] = [
            n * loaded.kv_bytes_per_token / MIB for n in row["zero_cost_bench"]["followup_merge_rows"]]
        results.append(row)
        del base
        gc.collect()
    return {"bench": "gpu_peak_breakdown", "model": cfg.model, "wide_path": [keys, why],
            "kv_bytes_per_token": loaded.kv_bytes_per_token, "chunk": cfg.chunk,
            "decode": cfg.decode, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random8b")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--new", type=int, default=513, help="follow-up rows to prefill (the "
                   "bench's 512 user tokens plus the previous reply's last token)")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    a.contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    emit_json(run(a), a.json_out)
    return 0


if __name__ == "__main__":
    exit_now(main())
