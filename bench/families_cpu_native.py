"""Decode tok/s per family on the CPU: native decode layers vs MLX's ops (JSON out).

For each family batched decode serves (llama, Llama 3 RoPE, qwen2, qwen3, phi3, olmo2,
granite, gemma3_text), a random-weight model of a ~0.5B shape (Qwen2-0.5B's: hidden 896,
14 heads, 2 KV heads, head_dim 64, MLP 4864; `--layers` keeps the run short), quantized
to 4 bits (group 32) and routed through the CPU quantized matmul as the loader does. One
session: a 64-token prompt into a segmented cache, then `--steps` decode steps through
`segserve.server.runner.batched.decode_batch` (the engine's decode step), timed as the median of
`--repeats` runs, with the native layer ops on and off (`cpu_native_layers`), greedy
tokens compared. Both variants of a family run back to back in one process.

    python bench/families_cpu_native.py --layers 4 --json-out bench/out/families_cpu_native.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segserve.kernels import qmm_cpu  # noqa: E402
from segserve.kernels.composed import attend_segments  # noqa: E402
from segserve.kernels.hook import install, layer_windows  # noqa: E402
from segserve.kv.segmented import SegmentedCache  # noqa: E402
from segserve.server.runner import DecodeBackend, logits_last, model_shape  # noqa: E402
from segserve.server.runner.batched import _compiled_layers, batch_support, decode_batch  # noqa: E402

SHAPE: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
    head_dim=64, rms_norm_eps=1e-6, vocab_size=32000, max_position_embeddings=4096,
    rope_theta=1e6, tie_word_embeddings=True,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"tie_word_embeddings": False}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"embedding_multiplier": 12.0, "attention_multiplier": 0.015625,
                            "residual_multiplier": 0.22, "logits_scaling": 8.0,
                            "attention_bias": False, "mlp_bias": False}),
    "gemma3": ("gemma3_text", {"sliding_window": 512, "sliding_window_pattern": 6,
                               "query_pre_attn_scalar": 64}),
}


def _model(family: str, layers: int, native: bool) -> DecodeBackend:
    module, over = FAMILIES[family]
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(0)
    if module == "gemma3_text":  # its forward reads the cache of the first global layer
        over = {**over, "sliding_window_pattern": min(6, layers)}
    model = arch.Model(arch.ModelArgs.from_dict(
        {**SHAPE, "num_hidden_layers": layers, "model_type": module, **over}))
    nn.quantize(model, group_size=32, bits=4)
    qmm_cpu.install(model, model_shape(model))
    install(model)
    mx.eval(model.parameters())
    return DecodeBackend(model, model_shape(model), native_layers=native)


def _decode(dec: DecodeBackend, steps: int) -> tuple[float, list[int]]:
    model = dec.model
    windows = layer_windows(model)
    assert not isinstance(windows, str)
    cache = SegmentedCache(len(model.layers), route=attend_segments, windows=windows)
    prompt = [(7 * i + 3) % 32000 for i in range(64)]
    tok = int(mx.argmax(logits_last(model, prompt, cache.layers)).item())  # type: ignore[arg-type]
    cache.record_tokens(prompt)
    cache.seal()
    toks = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(mx.argmax(decode_batch(dec, [tok], [cache.layers])[0]).item())  # type: ignore[arg-type]
        cache.record_tokens([tok])
        toks.append(tok)
    return steps / (time.perf_counter() - t0), toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    rows = []
    for family in args.families.split(","):
        row: dict[str, Any] = {"family": family}
        tokens: dict[str, list[int]] = {}
        for variant, native in (("native", True), ("mlx_ops", False)):
            dec = _model(family, args.layers, native)
            row["batched"] = batch_support(dec).ok
            compiled = _compiled_layers(dec) or []
            row[f"{variant}_layers_native"] = bool(compiled) and all(c.native is not None for c in compiled)
            _decode(dec, 2)  # warm-up: compiled graphs traced
            runs = [_decode(dec, args.steps) for _ in range(args.repeats)]
            row[f"{variant}_tok_s"] = round(statistics.median(r[0] for r in runs), 2)
            tokens[variant] = runs[0][1]
            del dec
        row["native_over_mlx_ops"] = round(row["native_tok_s"] / row["mlx_ops_tok_s"], 3)
        row["greedy_equal"] = tokens["native"] == tokens["mlx_ops"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"machine": platform.processor() or platform.machine(), "qmm": qmm_cpu.available()[1],
           "shape": {**SHAPE, "num_hidden_layers": args.layers}, "bits": 4, "group_size": 32,
           "steps": args.steps, "repeats": args.repeats, "results": rows}
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
