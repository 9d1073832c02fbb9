"""GGUF tokenizer: transformers' converter (the default route) against the hand build.

Prints JSON, on the embedded SmolLM2 GGUF (metadata read once with mx.load, as the server
does):
- `build_s`: median and min build time of each route (`transformers_bpe`, `build_bpe`);
- `encode_ms`: median and min time to encode the corpus (tests/test_gguf_tokenizer_parity.py's
  CORPUS repeated `--repeat` times, a loop of `encode` calls); the routes alternate run by
  run, so load on a shared machine falls on both alike;
- `ids_identical`: whether both give the same ids on every corpus text;
- `raw_transformers_differs`: corpus texts on which transformers' converter *without* our
  "smollm" pre-tokenizer (it falls back to GPT-2's) gives other ids than the hand build.

Run: .venv/bin/python bench/tokenizer_gguf.py [--runs 15] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from segserve.server.runner import embedded_model_path  # noqa: E402
from segserve.server.runner.tokenizer import _gpt2, build_bpe, transformers_bpe  # noqa: E402
from tests.test_gguf_tokenizer_parity import CORPUS  # noqa: E402


def _alternating(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, dict[str, float]]:
    """Seconds per call of each function, the functions taking turns run by run."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: {"median": statistics.median(v), "min": min(v)} for k, v in times.items()}


def _rounded(d: dict[str, dict[str, float]], scale: float, digits: int) -> dict[str, dict[str, float]]:
    return {k: {s: round(v * scale, digits) for s, v in row.items()} for k, row in d.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()

    loaded: Any = mx.load(str(embedded_model_path()), return_metadata=True)
    meta: dict[str, Any] = dict(loaded[1])
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = list(meta["tokenizer.ggml.merges"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    pre = str(meta["tokenizer.ggml.pre"])

    def ours_build() -> Tokenizer:
        return build_bpe(tokens, merges, types, pre)

    def tf_build() -> Tokenizer:
        return transformers_bpe(meta)

    tf, ours = tf_build(), ours_build()
    raw = Tokenizer.from_str(tf.to_str())
    raw.pre_tokenizer = _gpt2()  # what transformers alone gives for "smollm"

    texts = CORPUS * args.repeat

    def enc(tok: Tokenizer) -> Callable[[], object]:
        return lambda: [tok.encode(t, add_special_tokens=False) for t in texts]

    n_tokens = sum(len(ours.encode(t, add_special_tokens=False).ids) for t in texts)
    ids = {t: ours.encode(t, add_special_tokens=False).ids for t in CORPUS}
    out = {
        "model": embedded_model_path().name,
        "tokenizer.ggml.pre": pre,
        "vocab": len(tokens),
        "build_s": _rounded(_alternating({"transformers": tf_build, "hand_built": ours_build}, args.runs), 1, 4),
        "corpus": {"texts": len(texts), "tokens": n_tokens},
        "encode_ms": _rounded(_alternating({"transformers": enc(tf), "hand_built": enc(ours)}, args.runs), 1e3, 3),
        "ids_identical": all(tf.encode(t, add_special_tokens=False).ids == v for t, v in ids.items()),
        "raw_transformers_differs": [
            t for t, v in ids.items() if raw.encode(t, add_special_tokens=False).ids != v
        ],
    }
    print(json.dumps(out, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
