"""CPU speed of the embedded model by route: BLAS library x weight format x layout.

Each variant runs in its own process (a BLAS can only be chosen by LD_PRELOAD at process
start), interleaved round-robin over `--repeats` so machine noise hits every variant
alike. A variant prefills a `--prompt-tokens` prompt in 256-token chunks, then decodes
`--decode-tokens` greedy tokens at that context. Reported per variant: median prefill
tok/s, median decode tok/s, resident weight bytes, the greedy tokens, and ratios against
the plain install ("reference BLAS, 4-bit weights" = what `pip install mlx mlx-lm` gives).
Prints JSON; `--plot` draws a bar chart.

    python bench/cpu_speed.py --json-out bench/out/cpu_speed.json --plot bench/out/cpu_speed.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, str]] = {
    # name: {"blas": none|openblas|blis, "weights": quantized|float32, "layout": true|false}
    "plain_q4": {"blas": "none", "weights": "quantized", "layout": "false"},
    "openblas_q4": {"blas": "openblas", "weights": "quantized", "layout": "false"},
    "openblas_f32": {"blas": "openblas", "weights": "float32", "layout": "false"},
    "openblas_f32_layout": {"blas": "openblas", "weights": "float32", "layout": "true"},
    "blis_f32_layout": {"blas": "blis", "weights": "float32", "layout": "true"},
}


def _child(spec: dict[str, str], prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    from bench.common import prefill_decode
    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    lm = load_model(load_settings({"weights": spec["weights"], "cpu_layout": spec["layout"]}, environ={}))
    timed = prefill_decode(lm, prompt_tokens, decode_tokens)
    return {**timed, "weights_bytes": lm.weights_bytes, "quantization": lm.quantization}


def _run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from segserve.config.launcher import blas_library

    spec = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",) and not k.startswith("SEGSERVE_")}
    if spec["blas"] != "none":
        lib = blas_library(spec["blas"])  # type: ignore[arg-type]  # VARIANTS holds BlasChoice values as str
        if lib is None:
            return {"error": f"{spec['blas']} not installed"}
        env["LD_PRELOAD"] = lib
        env["BLIS_NUM_THREADS"] = str(os.cpu_count() or 1)
    cmd = [sys.executable, __file__, "--child", name, "--prompt-tokens", str(args.prompt_tokens),
           "--decode-tokens", str(args.decode_tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[name] = {"error": rs[0].get("error") if rs else "not run"}
            continue
        out[name] = {
            **VARIANTS[name],
            "prefill_tok_s": round(statistics.median(r["prefill_tok_s"] for r in ok), 2),
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in ok), 2),
            "weights_bytes": ok[0]["weights_bytes"],
            "quantization": ok[0]["quantization"],
            "tokens": ok[0]["tokens"],
        }
    base = out.get("plain_q4", {})
    for v in out.values():
        if "error" in v or "error" in base or not base:  # plain_q4 not run: no ratios
            continue
        v["prefill_x_plain"] = round(v["prefill_tok_s"] / base["prefill_tok_s"], 2)
        v["decode_x_plain"] = round(v["decode_tok_s"] / base["decode_tok_s"], 2)
        v["same_greedy_tokens_as_plain"] = v["tokens"] == base["tokens"]
    return out


def _plot(summary: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    names = [n for n, v in summary.items() if "error" not in v]
    fig = Figure(figsize=(9, 4))
    for i, key in enumerate(("prefill_tok_s", "decode_tok_s")):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.barh(names, [summary[n][key] for n in names])
        ax.set_xlabel(key.replace("_", " "))
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json-out")
    p.add_argument("--plot")
    p.add_argument("--child")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(VARIANTS[args.child], args.prompt_tokens, args.decode_tokens)))
        return 0
    names = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            print(f"[cpu_speed] repeat {rep + 1}: {name}", file=sys.stderr, flush=True)
            runs[name].append(_run_variant(name, args))
    result = {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "repeats": args.repeats, "cpus": os.cpu_count(), "variants": _summary(runs)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text)
    if args.plot:
        _plot(result["variants"], args.plot)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
