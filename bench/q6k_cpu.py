"""GGUF quantized layouts on the CPU, two loads of one file side by side in one run, printed
as JSON. `--compare q6k` (default): Q6_K in its own blocks (6.56 bits per weight) against
the 8-bit affine re-grid (9 bits). `--compare k8`: Q4_K (and Q5_K) matrices with their
compact scales (K8: 4.625 bits per Q4_K weight) against float16 scale and bias per 32
weights (5 bits). `--compare symmetric` (with `--recipe Q8_0`): Q8_0 / Q4_0 matrices served
without their biases (8.5 / 4.5 bits per weight, the op derives each bias from its scale)
against the biases held (9 / 5 bits).

The file: a random-weight GGUF of bench/families_cpu.py's shape (llama3, 8 layers, the
embedded tokenizer's 49K vocabulary; `--recipe`, default Q4_K_M: Q6_K in attn_v, ffn_down
and the output head), or `--model FILE`. Both loads go through the CPU quantized matmul
extension and the native decode layers, as the server serves them. Measured, interleaved round-robin:
- `decode_step_ms` / `decode_step_4_ms`: one batched decode step (`decode_batch`) of one
  session / four sessions, each after a 256-token prompt;
- `head_ms`: the output projection alone, 1 and 4 rows;
- `weights_bytes`: the loaded model's parameter bytes, and their ratio to the file.
Run: `python bench/q6k_cpu.py --json-out bench/results/q6k_cpu.json`,
`python bench/q6k_cpu.py --compare k8 --layers 28 --json-out bench/results/k8_scales_cpu.json`,
`python bench/q6k_cpu.py --compare symmetric --recipe Q8_0 --layers 28 --json-out bench/results/symmetric_q8_cpu.json`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


# Per comparison: the two variants' load_gguf arguments (and `full_biases`: symmetric layers
# keep their biases after routing), the first the one measured against the second.
COMPARE: dict[str, dict[str, dict[str, bool]]] = {
    "q6k": {"q6k_blocks": {"q6k_blocks": True}, "affine8": {"q6k_blocks": False}},
    "k8": {"k8_scales": {"k_scales": True}, "float16_scales": {"k_scales": False}},
    "symmetric": {"no_biases": {}, "with_biases": {"full_biases": True}},
}


def _load(path: Path, layout: dict[str, bool], x8: str) -> Any:
    from segserve.kernels import qmm_cpu
    from segserve.server.runner import batched, model_shape
    from segserve.server.runner.batched import DecodeBackend
    from segserve.server.runner.gguf import X8_BY_MAIN_TYPE, load_gguf
    from segserve.server.runner.qweights import float32_activations

    layout = dict(layout)
    full = layout.pop("full_biases", False)
    g = load_gguf(path, dequantize=False, **layout)
    model = g.model
    float32_activations(model)
    # x rounded to 8 bits where the server rounds it for this file (its main type), unless given
    qmm_cpu.install(model, model_shape(model), x8=X8_BY_MAIN_TYPE.get(g.main_type, "") if x8 == "auto" else x8)
    if full:  # the biases a symmetric layer was routed without, back (the op then reads them)
        for _, mod in model.named_modules():
            if type(mod) is qmm_cpu.CpuQuantizedLinear and mod.biases.size == 0:
                mod.biases = qmm_cpu.full_biases(mod.scales, mod.biases, mod.bits)
        mx.eval(model.parameters())
    dec = DecodeBackend(model, model_shape(model))
    layers = batched._compiled_layers(dec)
    assert layers is not None and all(c.native is not None for c in layers), "native layers did not engage"
    return dec


def _nbytes(model: Any) -> int:
    flat: Any = tree_flatten(model.parameters())
    return sum(int(v.nbytes) for _, v in flat)


def _timed(fn: Any, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file with Q6_K tensors (default: a random Q4_K_M one)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--recipe", default="Q4_K_M", help="the random file's recipe (tests/gguf_support.py)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compare", choices=sorted(COMPARE), default="q6k")
    p.add_argument("--x8", choices=["auto", "on", "off"], default="auto",
                   help="products' rounding of x (auto: as the server serves the file)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    from common import emit_json

    from segserve.server.runner import batched, logits_last
    from segserve.server.runner.forward import head_of

    with tempfile.TemporaryDirectory(prefix="q6k-") as tmp:
        if args.model:
            path = Path(args.model)
        else:
            import families_cpu

            path = families_cpu.write_model(Path(tmp), "llama3", args.recipe, args.layers, families_cpu.SHAPE)
        size = path.stat().st_size
        decs = {name: _load(path, layout, args.x8) for name, layout in COMPARE[args.compare].items()}
        first, second = decs
        caches: dict[str, list[list[KVCache]]] = {}
        last: dict[str, list[int]] = {}
        heads = {}
        for name, dec in decs.items():
            caches[name], last[name] = [], []
            for s in range(4):
                prompt = [(7 * i + s) % 1000 + 3 for i in range(args.prompt)]
                caches[name].append([KVCache() for _ in dec.model.layers])
                last[name].append(int(mx.argmax(logits_last(dec.model, prompt, caches[name][-1])).item()))  # type: ignore[arg-type]
            heads[name] = head_of(dec.model)
        hidden = int(decs[first].model.args.hidden_size)
        xs = {r: mx.random.normal((r, hidden)) for r in (1, 4)}
        mx.eval(list(xs.values()))
        samples: dict[str, dict[str, list[float]]] = {
            n: {"decode_step_ms": [], "decode_step_4_ms": [], "head_1_ms": [], "head_4_ms": []} for n in decs}

        def step(name: str, sessions: int) -> None:
            logits = batched.decode_batch(decs[name], last[name][:sessions], caches[name][:sessions])
            mx.eval(logits)
            for cache in caches[name][:sessions]:  # rewind: every round decodes at the same position
                for c in cache:
                    c.offset -= 1

        for _ in range(2):  # warm-up (compiled layers, thread pool)
            for name in decs:
                step(name, 1)
                step(name, 4)
        for _ in range(args.rounds):
            for name in decs:
                samples[name]["decode_step_ms"].append(_timed(lambda n=name: step(n, 1), 10))
                samples[name]["decode_step_4_ms"].append(_timed(lambda n=name: step(n, 4), 5))
                for r, x in xs.items():
                    samples[name][f"head_{r}_ms"].append(_timed(lambda n=name, x=x: mx.eval(heads[n](x)), 10))
        report: dict[str, Any] = {"file": str(path) if args.model else f"random llama3 {args.recipe}, {args.layers} layers",
                                  "file_bytes": size, "prompt_tokens": args.prompt, "compare": args.compare, "x8": args.x8,
                                  "variants": {}}
        for name, dec in decs.items():
            w = _nbytes(dec.model)
            report["variants"][name] = {k: round(statistics.median(v), 3) for k, v in samples[name].items()}
            report["variants"][name].update({"weights_bytes": w, "weights_over_file": round(w / size, 3)})
        a, b = report["variants"][first], report["variants"][second]
        ratio_key = "blocks_over_affine8" if args.compare == "q6k" else f"{first}_over_{second}"
        report[ratio_key] = {k: round(a[k] / b[k], 3) for k in a if k != "weights_over_file"}
    emit_json(report, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
