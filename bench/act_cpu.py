"""The MLP's gated activation on the CPU: the native op against MLX's own ops, printed as JSON.

Two parts, each variant interleaved round-robin in one process (machine noise hits both):
1. the op alone: act(gate) * up over [rows, ff] float32 arrays (SiLU and GELU-tanh), ms
   per call for `native` (`_segattn.gated_act`) and `mlx` (mlx-lm's `swiglu` /
   `nn.gelu_approx(g) * u`); and on the halves of a fused gate|up product [rows, 2 ff] (what
   the MLP gets), `silu_views` (read in place) against `silu_copied` (each half made
   row-contiguous first), with MLX's peak memory above the inputs per call;
2. prefill through a model (`--model`: a GGUF path, or `random:FAMILY:RECIPE` for the
   random-weight GGUF bench/families_cpu.py serves, default llama3 Q4_K_M at 8 layers):
   `--prompt` tokens in one chunk (segmented cache, the CPU attention route: the default
   mode's prefill) with the activation routed to the op (`act_cpu.install`)
   and with MLX's ops (`act_cpu.uninstall`), prefill tok/s per variant and their ratio.

    .venv/bin/python bench/act_cpu.py --json-out bench/results/act_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def op_alone(rows: int, ff: int, rounds: int) -> dict[str, Any]:
    from mlx_lm.models.activations import swiglu

    from segserve.kernels import act_cpu

    g = mx.random.normal((rows, ff)) * 3.0
    u = mx.random.normal((rows, ff))
    fused = mx.random.normal((rows, 2 * ff)) * 3.0
    mx.eval(g, u, fused)
    gv, uv = mx.split(fused, 2, axis=-1)
    variants = {
        "silu_native": lambda: act_cpu.gated(g, u, act_cpu.SILU),
        "silu_mlx": lambda: swiglu(g, u),
        "gelu_native": lambda: act_cpu.gated(g, u, act_cpu.GELU_TANH),
        "gelu_mlx": lambda: nn.gelu_approx(g) * u,
        "silu_views": lambda: act_cpu.gated(gv, uv, act_cpu.SILU),
        "silu_copied": lambda: act_cpu.gated(mx.contiguous(gv), mx.contiguous(uv), act_cpu.SILU),
    }
    got: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            got[name].append(_median_ms(fn, 5))
    peak_mb = {}
    for name in ("silu_views", "silu_copied"):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(variants[name]())  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
        peak_mb[name] = round((mx.get_peak_memory() - base) / 2**20, 2)
    ms = {k: round(statistics.median(v), 3) for k, v in got.items()}
    return {"rows": rows, "ff": ff, "ms": ms, "peak_mb": peak_mb,
            "silu_native_x_mlx": round(ms["silu_mlx"] / ms["silu_native"], 2),
            "gelu_native_x_mlx": round(ms["gelu_mlx"] / ms["gelu_native"], 2),
            "views_x_copied": round(ms["silu_copied"] / ms["silu_views"], 2)}


def _model_path(spec: str, tmp: Path) -> Path:
    if not spec.startswith("random:"):
        return Path(spec)
    from families_cpu import SHAPE, write_model

    _, family, recipe, *rest = spec.split(":")
    layers = int(rest[0]) if rest else 8
    written: Path = write_model(tmp, family, recipe, layers, SHAPE)
    return written


def prefill(spec: str, prompt: int, rounds: int) -> dict[str, Any]:
    from segserve.config.settings import load_settings
    from segserve.kernels import act_cpu
    from segserve.kernels.factory import select_route
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import load_model, logits_last

    with tempfile.TemporaryDirectory() as tmp:
        path = _model_path(spec, Path(tmp))
        lm = load_model(load_settings({"model": str(path), "weights": "auto"}, environ={}))
    ids = [(7 * i) % 5000 + 10 for i in range(prompt)]

    install(lm.model)
    route = select_route("cpu", head_dim=lm.head_dim, n_q_heads=lm.shape.n_q_heads, n_kv_heads=lm.n_kv_heads,
                         dtype=mx.float32).route

    def run() -> float:
        # the default mode's cache and route (per-layer sliding windows where the model has them)
        cache = SegmentedCache(lm.num_layers, route=route, windows=lm.shape.windows)
        t = time.perf_counter()
        mx.eval(logits_last(lm.model, ids, cache.layers))
        return prompt / (time.perf_counter() - t)

    tok_s: dict[str, list[float]] = {"native": [], "mlx": []}
    run()  # warm-up (kernel JIT, caches)
    for r in range(rounds):
        for name in (("native", "mlx") if r % 2 == 0 else ("mlx", "native")):
            (act_cpu.install if name == "native" else act_cpu.uninstall)(lm.model)
            tok_s[name].append(run())
    act_cpu.install(lm.model)
    med = {k: round(statistics.median(v), 1) for k, v in tok_s.items()}
    return {"model": spec, "quantization": lm.quantization, "prompt_tokens": prompt,
            "prefill_tok_s": med, "prefill_tok_s_runs": {k: [round(x, 1) for x in v] for k, v in tok_s.items()},
            "native_x_mlx": round(med["native"] / med["mlx"], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None,
                   help="GGUF path or random:FAMILY:RECIPE[:LAYERS] (repeatable)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    from segserve.kernels import act_cpu

    ok, why = act_cpu.available()
    if not ok:
        print(json.dumps({"error": why}))
        return 1
    import platform

    out: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                           "op": [op_alone(r, 2816, args.rounds) for r in (1, 64, 512)],
                           "prefill": [prefill(m, args.prompt, args.rounds)
                                       for m in (args.model or ["random:llama3:Q4_K_M", "random:gemma3:Q4_K_M"])]}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
