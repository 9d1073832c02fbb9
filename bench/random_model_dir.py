"""A random-weight mlx-lm model directory with the embedded model's tokenizer, for serving
benchmarks over HTTP (`segserve serve --model DIR`, `segserve loadtest`) on a model shape
the embedded model does not have.

Shapes: `llama3-8b` (Llama-3-8B: hidden 4096, 32 layers, 8 KV heads, bf16; ~14 GiB),
`llama-0.4b` (hidden 1024, 28 layers, bf16), `tiny` (2 layers, for a smoke run). The vocabulary is SmolLM2's 49,152 tokens, so
the chat template and tokenizer are the embedded model's (`tokenizer.json` and
`tokenizer_config.json`, as the tests' tiny model directories have them).

    python bench/random_model_dir.py /tmp/m8b --shape llama3-8b
    python bench/random_model_dir.py --tokenizer-only /tmp/tok          # just the tokenizer files
    python bench/random_model_dir.py /tmp/m8b --tokenizer-from /tmp/tok  # reuse them (a machine
                                                                          # without the embedded model)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-0.4b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64),  # the tests' smoke run
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tokenizer(out: Path, context: int) -> None:
    """The embedded model's tokenizer and chat template as an mlx-lm directory holds them."""
    from segserve.server.runner import embedded_model_path, from_gguf_metadata, tokenizer_config

    out.mkdir(parents=True, exist_ok=True)
    _, meta = mx.load(str(embedded_model_path()), return_metadata=True)
    assert isinstance(meta, dict)
    chat, tok = from_gguf_metadata(meta)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat, context)))


def write_model(out: Path, shape: str, context: int, seed: int) -> int:
    """Random bf16 weights of `shape` (mlx-lm's own initialisation), its config.json; bytes."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=49152,
                  max_position_embeddings=context, rope_theta=500000.0, rope_traditional=False,
                  tie_word_embeddings=False, **SHAPES[shape])
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**config))
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return sum(int(v.nbytes) for v in weights.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer files only")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="copy the tokenizer files from this folder instead of making them")
    args = ap.parse_args()
    if args.tokenizer_from is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(args.tokenizer_from / name, args.out / name)
    else:
        write_tokenizer(args.out, args.context)
    if args.tokenizer_only:
        print(json.dumps({"out": str(args.out), "files": list(TOKENIZER_FILES)}))
        return
    nbytes = write_model(args.out, args.shape, args.context, args.seed)
    print(json.dumps({"out": str(args.out), "shape": args.shape, "weights_gib": round(nbytes / 2**30, 2)}))


if __name__ == "__main__":
    main()
