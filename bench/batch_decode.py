"""Batched vs one-by-one decode on the embedded model: is batching worth keeping?

For B sessions (each with its own segmented cache at `--context` tokens), times one
decode token for all of them done (a) as one batched forward (`segserve.server.runner.batched`) and
(b) as B single-session forwards, interleaved round-robin so machine noise hits both.
Prints JSON: median ms per round, aggregate tokens/s, and the ratio batched/sequential.
Run: `python bench/batch_decode.py --batch 1,2,4,8 --context 512`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx

from segserve.config.settings import load_settings
from segserve.kernels.factory import select_route
from segserve.kernels.hook import Route, install
from segserve.kv.segmented import SegmentedCache
from segserve.server.runner import LoadedModel, decode_batch, load_model, logits_last


def _sessions(lm: LoadedModel, b: int, ctx: int, route: Route) -> list[SegmentedCache]:
    out = []
    for i in range(b):
        cache = SegmentedCache(lm.num_layers, route=route)
        prompt = [(13 * j + i) % 5000 + 10 for j in range(ctx)]
        for s in range(0, ctx, 256):
            mx.eval(logits_last(lm.model, prompt[s : s + 256], cache.layers))
            cache.record_tokens(prompt[s : s + 256])
        cache.seal()
        out.append(cache)
    return out


def _round_batched(lm: LoadedModel, caches: list[SegmentedCache]) -> None:
    mx.eval(decode_batch(lm.model, [42] * len(caches), [c.layers for c in caches]))
    for c in caches:
        for layer in c.layers:
            layer.trim(1)  # keep the context fixed across repeats


def _round_single(lm: LoadedModel, caches: list[SegmentedCache]) -> None:
    for c in caches:
        mx.eval(logits_last(lm.model, [42], c.layers))
        for layer in c.layers:
            layer.trim(1)


def measure(lm: LoadedModel, b: int, ctx: int, repeats: int, route: Route) -> dict[str, Any]:
    caches = _sessions(lm, b, ctx, route)
    times: dict[str, list[float]] = {"batched": [], "sequential": []}
    fns = {"batched": _round_batched, "sequential": _round_single}
    for fn in fns.values():
        fn(lm, caches)  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(lm, caches)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch": b,
        "round_ms": {k: round(1e3 * v, 2) for k, v in med.items()},
        "aggregate_tok_s": {k: round(b / v, 2) for k, v in med.items()},
        "ratio_time_batched_over_sequential": round(med["batched"] / med["sequential"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    lm = load_model(load_settings({}, environ={}))
    route = select_route("cpu", head_dim=lm.head_dim, n_q_heads=9, n_kv_heads=3, dtype=mx.float32)
    install(lm.model)
    rows = [measure(lm, int(b), args.context, args.repeats, route.route) for b in args.batch.split(",")]
    print(json.dumps({"model": lm.model_id, "weights": lm.quantization, "context": args.context, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
