"""Prefill tok/s of a random-weight GGUF through the server's loader, per family (CPU).

The file is written by tests/gguf_support.py (Q4_K_M, the embedded model's tokenizer,
~0.4B widths: hidden 1024, FF 2816, 16 heads, 4 KV heads, head size 64; `--layers` keeps
it short); `load_model` serves it as `--weights auto` does, the KV mode and route are
chosen as at start-up (segmented, or stock where the support check or the route's
self-check says no: printed), and one prompt of `--tokens` tokens is prefilled in one
chunk, best of `--repeats`. Prints one JSON line per family.

    .venv/bin/python bench/gguf_prefill_cpu.py --families llama3,gemma3 --layers 4 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from segserve.config.settings import load_settings  # noqa: E402
from segserve.kernels.hook import install, layer_windows  # noqa: E402
from segserve.kv.segmented import SegmentedCache  # noqa: E402
from segserve.server.runner import embedded_model_path, load_model, logits_last  # noqa: E402
from segserve.server.runtime import choose_kv  # noqa: E402
from tests.gguf_support import write_gguf  # noqa: E402

SHAPE = {"hidden": 1024, "ff": 2816, "heads": 16, "kv_heads": 4, "head_dim": 64}


def one(family: str, layers: int, tokens: int, repeats: int, out: Path) -> dict[str, object]:
    path = write_gguf(out / f"{family}.gguf", family, "Q4_K_M", seed=1, tokenizer_from=embedded_model_path(),
                      layers=layers, shape=SHAPE)
    settings = load_settings({"model": str(path), "bank_dir": "none"}, environ={})
    loaded = load_model(settings)
    verdict, route = choose_kv(settings, loaded)
    model = loaded.model
    if route is not None:
        install(model)
    prompt = [(37 * i) % 40000 + 100 for i in range(tokens)]

    def run() -> float:
        if route is None:
            caches = list(model.make_cache()) if hasattr(model, "make_cache") else None
            if caches is None:
                from mlx_lm.models.cache import make_prompt_cache
                caches = make_prompt_cache(model)
        else:
            windows = layer_windows(model)
            assert not isinstance(windows, str), windows  # choose_kv gave a route: segments serve
            caches = list(SegmentedCache(loaded.num_layers, route=route, dtype=getattr(mx, loaded.kv_dtype),
                                         windows=windows).layers)
        start = time.perf_counter()
        mx.eval(logits_last(model, prompt, caches))
        return time.perf_counter() - start

    run()  # warm-up: compiled graphs, first allocations
    best = min(run() for _ in range(repeats))
    return {"family": family, "layers": layers, "tokens": tokens, "kv_mode": verdict.mode,
            "self_check": verdict.self_check_detail,
            "quantization": loaded.quantization, "prefill_tok_s": round(tokens / best, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama3,gemma3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            print(json.dumps(one(family, args.layers, args.tokens, args.repeats, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
