"""Where a decode step's time goes on this CPU (embedded model), printed as JSON.

Measures, interleaved round-robin so machine noise hits every variant alike, one decode
step (B = 1) through the engine's batched forward (`segserve.server.runner.batched.decode_batch`):
- `step`: the default: segmented cache, layers through the native ops (segserve.kernels.block_cpu);
- `step_three_ops`: the default with each layer as three nodes (pre, the fused route's
  write-and-attend, post) instead of one (`NativeBlock.layer`);
- `step_mlx_ops`: the same with each layer's MLX ops (compiled), as `--cpu-native-layers false`;
- `step_stock`: mlx-lm's contiguous KVCache (rows as computed, float32), native ops;
- `step_f32_kv`: the default step with the cache storing float32 rows (what the CPU stored
  before its cache went to the model's float16: twice the bytes attention reads);
- `graph_build`: building the lazy graph of one default step without evaluating it;
- `layers_only`: every layer's native ops chained without attention (norms, weight
  products, RoPE, MLP: the weight-reading part), one eval;
- `attention_only`: the attention route over the step's context, all layers, one eval;
- `lm_head`: the output projection alone;
- `sample`/`detok`: greedy argmax over a vocabulary of logits + `.item()`, and
  incremental detokenizing one token.
`graph_nodes` counts the MLX nodes of one step both ways. The remainder (step - layers -
attention - head - graph build) is the cache writes and MLX's per-node dispatch (each
variant is timed with its own eval, so the parts overlap a little and the remainder can
come out slightly negative). Run: `python bench/profile_decode.py --context 1000`
(`--model FILE` for another model).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from segserve.config.settings import load_settings
from segserve.kernels import block_cpu
from segserve.kernels.factory import select_route
from segserve.kernels.hook import Route, install
from segserve.kv.segmented import SegmentedCache
from segserve.kv.stock import StockCache
from segserve.server.runner import LoadedModel, TextStream, load_model, logits_last
from segserve.server.runner.batched import _BLOCKS, _CompiledLayer, decode_batch
from segserve.server.runner.forward import head_of


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` took, or the seconds it reports itself (a float it returns)."""
    t = time.perf_counter()
    own = fn()
    return own if isinstance(own, float) else time.perf_counter() - t


def _prepared(lm: LoadedModel, ctx: int, route: Route | None, dtype: mx.Dtype) -> list[Any]:
    if route is not None:
        cache = SegmentedCache(lm.num_layers, route=route, dtype=dtype, windows=lm.shape.windows or None)
        layers: list[Any] = list(cache.layers)
    else:
        layers = list(StockCache(lm.num_layers).layers)
    prompt = [(7 * i) % 1000 + 10 for i in range(ctx)]
    for i in range(0, ctx, 256):
        mx.eval(logits_last(lm.model, prompt[i : i + 256], layers))
        if route is not None:
            cache.record_tokens(prompt[i : i + 256])
    if route is not None:
        cache.seal()  # the history is a sealed segment, as after a prompt
    return layers


def _layers_only(lm: LoadedModel, layers: tuple[_CompiledLayer, ...]) -> Callable[[], None]:
    """Every layer's step outside attention (norms, products, RoPE, MLP), chained as in a
    step, attention replaced by a fixed input: the weight-reading part of a step."""
    args = lm.model.args
    h = mx.random.normal((1, 1, args.hidden_size))
    o = mx.random.normal((1, args.num_attention_heads, 1, lm.head_dim))
    offsets = mx.array([500], dtype=mx.int32)

    def run() -> None:
        x = h
        for fns in layers:
            fns.pre(x, offsets)
            x = fns.post(x, o)
        mx.eval(x)
    return run


def _nodes(out: mx.array) -> int:
    f = io.StringIO()
    mx.export_to_dot(f, out)
    return len(re.findall(r"label", f.getvalue()))


def variants(lm: LoadedModel, ctx: int, seg_route: Route) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    model = lm.model
    native = tuple(_CompiledLayer(layer, block_cpu.for_layer(layer, _BLOCKS[type(layer)][2])) for layer in model.layers)
    mlx_ops = tuple(_CompiledLayer(layer) for layer in model.layers)
    kv_dtype = getattr(mx, lm.kv_dtype)  # what the server stores
    seg_layers = _prepared(lm, ctx, seg_route, kv_dtype)
    f32_layers = _prepared(lm, ctx, seg_route, mx.float32)
    stock_layers = _prepared(lm, ctx, None, kv_dtype)
    hidden = model.args.hidden_size
    x = mx.random.normal((1, hidden))
    head = head_of(model)
    seg_kv = [c.segment_kv() for c in seg_layers]
    nq, nkv, d = lm.shape.n_q_heads, lm.n_kv_heads, lm.head_dim
    q = mx.random.normal((1, nq, 1, d))
    tail = (mx.random.normal((1, nkv, 1, d)).astype(kv_dtype), mx.random.normal((1, nkv, 1, d)).astype(kv_dtype))
    route = select_route("cpu", head_dim=d, n_q_heads=nq, n_kv_heads=nkv, dtype=mx.float32).route
    text = TextStream(lm.tokenizer.decode, [])
    logits = mx.random.normal((model.args.vocab_size,))
    mx.eval(logits)

    def use(layers: tuple[_CompiledLayer, ...]) -> None:
        lm.decode.use_layers(layers)

    def one_step(layers: list[Any], ops: tuple[_CompiledLayer, ...], whole: bool = True) -> Callable[[], Any]:
        def run() -> None:
            use(ops)
            mx.eval(decode_batch(lm.decode, [42], [layers], whole_layers=whole))
            for c in layers:  # keep the context length fixed across repeats
                c.trim(1)
        return run

    def graph_build() -> float:
        use(native)
        t = time.perf_counter()
        out = decode_batch(lm.decode, [42], [seg_layers])  # built, not evaluated while timed
        took = time.perf_counter() - t
        mx.eval(out)  # else the next step would evaluate this one's cache writes too
        for c in seg_layers:
            c.trim(1)
        return took

    counts = {}  # graph nodes of one step, evaluated after counting (as above)
    for name, ops, whole in (("native_ops", native, True), ("native_three_ops", native, False),
                             ("mlx_ops", mlx_ops, True)):
        use(ops)
        out = decode_batch(lm.decode, [42], [seg_layers], whole_layers=whole)
        counts[name] = _nodes(out)
        mx.eval(out)
        for c in seg_layers:
            c.trim(1)
    fns = {
        "step": one_step(seg_layers, native),
        "step_three_ops": one_step(seg_layers, native, whole=False),
        "step_mlx_ops": one_step(seg_layers, mlx_ops),
        "step_stock": one_step(stock_layers, native),
        "step_f32_kv": one_step(f32_layers, native),
        "graph_build": graph_build,
        "layers_only": _layers_only(lm, native),
        "attention_only": lambda: mx.eval([route(q, kv, tail, scale=d ** -0.5, causal=False) for kv in seg_kv]),
        "lm_head": lambda: mx.eval(head(x)),
        "sample": lambda: mx.argmax(logits).item(),
        "detok": lambda: text.push(1000),
    }
    return fns, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--model", help="a GGUF file or mlx-lm directory (default: the embedded model), served "
                                   "with --weights auto")
    args = p.parse_args(argv)
    lm = load_model(load_settings({"model": args.model, "weights": "auto"} if args.model else {}, environ={}))
    support = select_route("cpu", head_dim=lm.head_dim, n_q_heads=lm.shape.n_q_heads, n_kv_heads=lm.n_kv_heads,
                           dtype=mx.float32)
    install(lm.model)
    vs, nodes = variants(lm, args.context, support.route)
    times: dict[str, list[float]] = {k: [] for k in vs}
    for fn in vs.values():
        fn()  # warm-up (compiles, allocates)
    for _ in range(args.repeats):
        for name, fn in vs.items():
            times[name].append(_timed(fn))
    ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    rest = ms["step"] - ms["layers_only"] - ms["attention_only"] - ms["lm_head"] - ms["graph_build"]
    out = {
        "context": args.context,
        "model": lm.model_id,
        "weights": lm.quantization,
        "median_ms": ms,
        "tokens_per_s": {
            "segmented": round(1e3 / ms["step"], 2),
            "segmented_three_ops": round(1e3 / ms["step_three_ops"], 2),
            "segmented_mlx_ops": round(1e3 / ms["step_mlx_ops"], 2),
            "stock": round(1e3 / ms["step_stock"], 2),
            "segmented_f32_kv": round(1e3 / ms["step_f32_kv"], 2),
        },
        "kv_dtype": lm.kv_dtype,
        "native_ops_speedup": round(ms["step_mlx_ops"] / ms["step"], 3),
        "whole_layer_speedup": round(ms["step_three_ops"] / ms["step"], 3),
        "graph_nodes": nodes,
        "breakdown_ms": {
            "layers_outside_attention": ms["layers_only"],
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
