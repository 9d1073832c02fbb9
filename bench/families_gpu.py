"""Decode speed per model family: segserve's engine against mlx-lm's own generation loop on
the same random weights (prints JSON).

For each family (Llama 3 with its scaled RoPE, Qwen 3 with q/k norms, Gemma 3 with sliding
window layers, Gemma 2 with soft-capped attention: `--families gemma2`) and each weight format (bfloat16 and MLX's 4-bit affine, group 64), one
model of an 8B shape is built with random weights and, in one process:
- mlx-lm's loop: `mlx_lm.generate.generate_step` over the prompt, decode tok/s from the
  second token on (its own pipelining, its own caches, its own layout of the weights);
- segserve, segmented and stock: one greedy turn through `segserve.server.engine.Engine` (the
  server's own factory, `bench.common.start_engine`) on the model as the server holds it
  (on a GPU, q/k/v and gate/up fused: `segserve.server.runner.gpu_layout`), decode tok/s =
  1 / the mean gap between tokens;
- with `--unfused`, segserve segmented on mlx-lm's layout as well (the fusion's A/B).
The same prompts (random ids) and decode length for all three, one warm-up at the measured
shapes, then `--repeats` interleaved rounds; segserve's ratios of the medians to mlx-lm's
loop are what the benchmark reports. `--shape tiny` runs the same on a small shape
(the CPU smoke test in the test suite uses it).

    python bench/families_gpu.py --json-out bench/out/families_gpu.json       # H200
    python bench/families_gpu.py --shape tiny --families llama3 --formats bf16  # smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    _IdCodec,
    bank_store,
    bench_route,
    emit_json,
    greedy,
    log,
    ratio,
    run_turn,
    start_engine,
)
from segserve.server.runner import ChatTokenizer, LoadedModel, kv_bytes_per_token, model_shape  # noqa: E402
from segserve.server.runner.gpu_layout import fuse_projections  # noqa: E402

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Shapes of the published 8B-class models (vocabulary cut to 32K: the head is not what is
# measured); Gemma 3 at the 12B model's width with 32 layers (~8B parameters).
SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "8b": {
        "llama3": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                       intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                       max_position_embeddings=131072),
        "qwen3": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                      intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, rope_theta=1e6, max_position_embeddings=40960),
        "gemma3": dict(model_type="gemma3_text", hidden_size=3840, num_hidden_layers=32,
                       intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, sliding_window=1024, max_position_embeddings=131072),
        # Gemma 2 9B: soft-capped attention and logits; served within its 4K window.
        "gemma2": dict(model_type="gemma2", hidden_size=3584, num_hidden_layers=42,
                       intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, query_pre_attn_scalar=256.0, max_position_embeddings=4096),
    },
    "tiny": {
        "llama3": dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                       max_position_embeddings=4096),
        "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, rope_theta=1e6, max_position_embeddings=4096),
        "gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, sliding_window=32, max_position_embeddings=4096),
        "gemma2": dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, query_pre_attn_scalar=64.0, max_position_embeddings=4096),
    },
}
_MODULES = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3_text", "gemma2": "gemma2"}
VOCAB = 32000


def build(family: str, shape: str, fmt: str, seed: int = 0, fuse: bool = True) -> LoadedModel:
    """A random-weight model of `family` as the server would hold it (bf16 or 4-bit; on a
    GPU with its q/k/v and gate/up projections fused, as `load_model` does there). `fuse`
    False: mlx-lm's own layout (its loop's model; the same weights for the same seed)."""
    import importlib

    cfg = dict(SHAPES[shape][family])
    module = importlib.import_module(f"mlx_lm.models.{_MODULES[cfg['model_type']]}")
    # from_dict drops what a family's ModelArgs does not take (gemma3 has no tie flag).
    args = module.ModelArgs.from_dict(
        {"vocab_size": VOCAB, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **cfg})
    mx.random.seed(seed)
    model: nn.Module = module.Model(args)
    model.set_dtype(mx.bfloat16)
    if fmt == "q4":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    if fuse and mx.default_device() != mx.cpu:
        fuse_projections(model)
    flat: Any = tree_flatten(model.parameters())
    weights = sum(int(v.nbytes) for _, v in flat)
    dims = model_shape(model)
    tok = ChatTokenizer(_IdCodec(), "", frozenset(), "", "", VOCAB)
    return LoadedModel(model, tok, f"{family}-{shape}-random", "random", f"seed{seed}", fmt,
                       dims, int(cfg["max_position_embeddings"]), "bfloat16",
                       kv_bytes_per_token(dims.num_layers, dims.n_kv_heads, dims.head_dim, 2), weights)


def load_spec(spec: str | None) -> LoadedModel:
    """A benchmark's `--model`: `random:FAMILY:FORMAT` (this file's random 8B shape, `build`),
    else a model the server can load (None: the embedded one), loaded as the server loads it."""
    if spec and spec.startswith("random:"):
        _, family, fmt = spec.split(":")
        return build(family, "8b", fmt)
    from segserve.config.settings import load_settings
    from segserve.server.runner import load_model

    return load_model(load_settings({"model": spec} if spec else {}, environ={}))


def mlx_lm_decode(loaded: LoadedModel, prompt: list[int], decode: int) -> float:
    """Decode tok/s of mlx-lm's own generation loop (greedy), from the second token on."""
    from mlx_lm.generate import generate_step

    stamps = [time.perf_counter() for _ in generate_step(mx.array(prompt), loaded.model, max_tokens=decode)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _variant(prompt: list[int], r: int) -> list[int]:
    """Another prompt of the same length (no prefix shared with the others)."""
    return [((t + 7919 * (r + 1)) % (VOCAB - 1)) + 1 for t in prompt]


def measure(loaded: LoadedModel, plain: LoadedModel, prompt: list[int], decode: int, repeats: int,
            segmented: bool, unfused: bool = False) -> dict[str, Any]:
    """Interleaved repeats (mlx-lm's loop on `plain`, mlx-lm's own layout of the same
    weights; segserve segmented and stock on `loaded`, as the server holds it; with
    `unfused`, segserve segmented on `plain` too: one of each per repeat, so the device's
    drift hits all alike); medians and every run."""
    engines = {"stock": start_engine(loaded, bank_store(loaded, 1 << 30), segmented=False, prefill_chunk=2048)}
    if segmented:
        engines["segmented"] = start_engine(loaded, bank_store(loaded, 1 << 30), segmented=True, prefill_chunk=2048)
        if unfused and plain is not loaded:
            engines["segmented_unfused"] = start_engine(plain, bank_store(plain, 1 << 30), segmented=True,
                                                        prefill_chunk=2048)
    runs: dict[str, list[float]] = {"mlx_lm": [], **{k: [] for k in engines}}
    try:
        # Warm-up at the measured shapes: GPU kernels compile per shape variant on first use.
        mlx_lm_decode(plain, _variant(prompt, -2), decode)
        for name, eng in engines.items():
            run_turn(eng, greedy(_variant(prompt, -2), decode, f"warm-{name}"))
        for r in range(repeats):
            runs["mlx_lm"].append(mlx_lm_decode(plain, _variant(prompt, r), decode))
            for name, eng in engines.items():
                step = run_turn(eng, greedy(_variant(prompt, r), decode, f"{name}-{r}")).decode_step_s
                runs[name].append(1.0 / step if step else 0.0)
    finally:
        for eng in engines.values():
            eng.stop()
    return {name: {"decode_tok_s": statistics.median(v), "runs": v} for name, v in runs.items()}


def run(families: list[str], formats: list[str], shape: str, context: int, decode: int,
        repeats: int = 3, unfused: bool = False) -> dict[str, Any]:
    rows = []
    for family in families:
        for fmt in formats:
            log(f"{family} {fmt}: building")
            loaded = build(family, shape, fmt)
            # mlx-lm's loop gets mlx-lm's own layout (on a CPU the two are the same model)
            plain = build(family, shape, fmt, fuse=False) if mx.default_device() != mx.cpu else loaded
            ids: Any = mx.random.randint(1, VOCAB, (context,)).tolist()  # a flat list here
            prompt = [int(t) for t in ids]
            row: dict[str, Any] = {"family": family, "format": fmt, "context": context,
                                   "weights_bytes": loaded.weights_bytes}
            try:
                row["route"] = bench_route(loaded)[0]
            except Exception as exc:  # a family the segmented path refuses: say why
                row["route"] = f"refused: {exc}"
            row.update(measure(loaded, plain, prompt, decode, repeats, not row["route"].startswith("refused"),
                               unfused))
            base = row["mlx_lm"]["decode_tok_s"]
            row["segmented_over_mlx_lm"] = ratio(row.get("segmented", {}).get("decode_tok_s"), base)
            row["stock_over_mlx_lm"] = ratio(row["stock"]["decode_tok_s"], base)
            if "segmented_unfused" in row:
                row["fused_over_unfused"] = ratio(row["segmented"]["decode_tok_s"],
                                                  row["segmented_unfused"]["decode_tok_s"])
            log(f"{family} {fmt}: mlx-lm {base:.1f} tok/s; segmented/mlx-lm "
                f"{row['segmented_over_mlx_lm']}, stock/mlx-lm {row['stock_over_mlx_lm']}")
            rows.append(row)
            del loaded, plain
            gc.collect()
            mx.clear_cache()
    return {"bench": "families_gpu", "shape": shape, "device": str(mx.default_device()),
            "decode_tokens": decode, "repeats": repeats, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--families", default="llama3,qwen3,gemma3")
    ap.add_argument("--formats", default="bf16,q4", help="bf16 and/or q4")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens per turn")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved measured repeats")
    ap.add_argument("--unfused", action="store_true",
                    help="also segserve segmented on mlx-lm's layout (projections not fused)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    report = run(a.families.split(","), a.formats.split(","), a.shape, a.context, a.decode, a.repeats,
                 a.unfused)
    emit_json(report, a.json_out)


if __name__ == "__main__":
    main()
