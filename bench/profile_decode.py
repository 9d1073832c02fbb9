"""Where a decode step's time goes on this CPU (embedded model), printed as JSON.

Measures, interleaved round-robin so machine noise hits every variant alike:
- `step`: one real decode step through the engine's forward (segmented cache + hook);
- `step_stock`: the same with mlx-lm's contiguous KVCache;
- `graph_build`: building the lazy graph of one step without evaluating it (Python cost);
- `matmuls_only`: the step's weight products alone (same shapes and layout), one eval;
- `attention_only`: the attention route over the step's context, all layers, one eval;
- `lm_head`: the output projection alone;
- `sample`/`detok`: greedy sampling + `.item()`, and incremental detokenizing one token.
The remainder (step - matmuls - attention - graph build) is norms, RoPE, SiLU, residual
adds and MLX's per-op dispatch. Run: `python bench/profile_decode.py --context 1000`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from config.settings import load_settings
from kernels.factory import select_route
from kernels.hook import Route, install
from kv.segmented import SegmentedCache
from server.runner import LoadedModel, TextStream, load_model, logits_last


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _prepared(lm: LoadedModel, ctx: int, route: Route | None) -> list[Any]:
    if route is not None:
        cache = SegmentedCache(lm.num_layers, route=route)
        layers: list[Any] = list(cache.layers)
    else:
        layers = [KVCache() for _ in range(lm.num_layers)]
    prompt = [(7 * i) % 1000 + 10 for i in range(ctx)]
    for i in range(0, ctx, 256):
        mx.eval(logits_last(lm.model, prompt[i : i + 256], layers))
        if route is not None:
            cache.record_tokens(prompt[i : i + 256])
    if route is not None:
        cache.seal()  # the history is a sealed segment, as after a prompt
    return layers


def _weights(lm: LoadedModel) -> list[mx.array]:
    """The weight matrices one decode step multiplies by, as the model holds them now
    (after the CPU layout transform: transposed, q/k/v and gate/up fused)."""
    out: list[mx.array] = []
    for layer in lm.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                     layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                     layer.mlp.down_proj):
            if "wt" in proj:
                out.append(proj.wt)  # TransposedLinear or the first FusedPart of a group
            elif "weight" in proj:
                out.append(proj.weight.T)
    return out


def variants(lm: LoadedModel, ctx: int, seg_route: Route) -> dict[str, Callable[[], Any]]:
    seg_layers = _prepared(lm, ctx, seg_route)
    stock_layers = _prepared(lm, ctx, None)
    ws = _weights(lm)
    hidden = lm.model.args.hidden_size
    inter = lm.model.args.intermediate_size
    x = mx.random.normal((1, hidden))
    xi = mx.random.normal((1, inter))
    head = getattr(lm.model, "tied_head", None) or lm.model.model.embed_tokens.as_linear
    seg_kv = [c.segment_kv() for c in seg_layers]
    q = mx.random.normal((1, 9, 1, 64))
    tail = (mx.random.normal((1, 3, 1, 64)), mx.random.normal((1, 3, 1, 64)))
    route = select_route("cpu", head_dim=64, n_q_heads=9, n_kv_heads=3, dtype=mx.float32).route
    text = TextStream(lm.tokenizer.decode, [])

    def one_step(layers: list[Any]) -> Callable[[], Any]:
        def run() -> None:
            logits = logits_last(lm.model, [42], layers)
            mx.eval(logits)
            for c in layers:  # keep the context length fixed across repeats
                c.trim(1)
        return run

    def matmuls() -> None:
        outs = [(xi if w.shape[0] == inter else x) @ w for w in ws]  # w: [in, out]
        mx.eval(outs)

    def graph_build() -> None:
        logits_last(lm.model, [42], seg_layers)  # built, never evaluated
        for c in seg_layers:
            c.trim(1)

    return {
        "step": one_step(seg_layers),
        "step_stock": one_step(stock_layers),
        "graph_build": graph_build,
        "matmuls_only": matmuls,
        "attention_only": lambda: mx.eval([route(q, kv, tail, scale=0.125, causal=False) for kv in seg_kv]),
        "lm_head": lambda: mx.eval(head(x)),
        "sample": lambda: mx.argmax(mx.random.normal((49152,))).item(),
        "detok": lambda: text.push(1000),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    lm = load_model(load_settings({}, environ={}))
    support = select_route("cpu", head_dim=lm.head_dim, n_q_heads=9, n_kv_heads=3, dtype=mx.float32)
    install(lm.model)
    vs = variants(lm, args.context, support.route)
    times: dict[str, list[float]] = {k: [] for k in vs}
    for fn in vs.values():
        fn()  # warm-up (compiles, allocates)
    for _ in range(args.repeats):
        for name, fn in vs.items():
            times[name].append(_timed(fn))
    ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    rest = ms["step"] - ms["matmuls_only"] - ms["attention_only"] - ms["lm_head"] - ms["graph_build"]
    out = {
        "context": args.context,
        "model": lm.model_id,
        "weights": lm.quantization,
        "median_ms": ms,
        "tokens_per_s": {"segmented": round(1e3 / ms["step"], 2), "stock": round(1e3 / ms["step_stock"], 2)},
        "breakdown_ms": {
            "weight_matmuls": ms["matmuls_only"],
            "lm_head": ms["lm_head"],
            "attention": ms["attention_only"],
            "python_graph_build": ms["graph_build"],
            "other_ops_and_dispatch": round(rest, 3),
            "sampling": ms["sample"],
            "detokenize": ms["detok"],
        },
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
