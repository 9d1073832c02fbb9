"""GGUF → mlx-lm model directory (for peers such as `mlx_lm.server` on the same weights,
and as the second loading route the GGUF loader is tested against).

Owns: `convert_gguf`. Writes config.json (the file's family and RoPE convention, per-module
quantization), model.safetensors (MLX affine-quantized tensors under mlx-lm names),
tokenizer.json (the BPE built from the GGUF metadata) and tokenizer_config.json (with the
GGUF's chat template). The weights are written as read: no requantization.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from segserve.server.runner.gguf import GROUP_SIZE, ModelLoadError, embedded_model_path, read_gguf
from segserve.server.runner.gguf_arch import LONGROPE_LONG, LONGROPE_SHORT, longrope_for
from segserve.server.runner.tokenizer import from_gguf_metadata


def convert_gguf(gguf: Path | None, out: Path) -> Path:
    path = gguf or embedded_model_path()
    g = read_gguf(path)
    if g.rope_factors is not None:  # mlx-lm's config has no place for a frequency vector
        raise ModelLoadError("GGUF rope_freqs (Llama 3 RoPE) cannot be written to an mlx-lm config")
    meta, args, mapped = g.metadata, g.args, g.weights
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    for module, bits in g.bits.items():
        quant[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    if g.arch == "granite":  # mlx-lm's granite rotates NEOX-style: give it unpermuted rows
        mapped = _unpermuted_qk(mapped, args)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), mapped, metadata={"format": "mlx"})
    # Every field of the family's own ModelArgs, so that what a family adds (granite's
    # multipliers, smollm3's no-RoPE layers, gemma's windows and soft-caps, olmo2's norms)
    # reaches mlx-lm as the loader built it.
    config: dict[str, Any] = {k: v for k, v in dataclasses.asdict(args).items() if _is_json(v)}
    config["model_type"] = getattr(args, "model_type", g.arch)
    config["quantization"] = quant
    if g.longrope:  # Phi-3 LongRoPE: the two factor vectors and the switch point
        lr = longrope_for(meta, args, g.longrope)
        config["original_max_position_embeddings"] = lr.original
        config["rope_scaling"] = {"type": "longrope", "short_factor": _floats(g.longrope.get(LONGROPE_SHORT)),
                                  "long_factor": _floats(g.longrope[LONGROPE_LONG])}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    chat, tok = from_gguf_metadata(meta)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = tokenizer_config(chat, int(args.max_position_embeddings or 2048))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return out


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _floats(a: mx.array | None) -> list[float] | None:
    if a is None:
        return None
    import numpy as np

    return [float(x) for x in np.asarray(a.astype(mx.float32)).reshape(-1)]


def _unpermuted_qk(weights: dict[str, mx.array], args: Any) -> dict[str, mx.array]:
    """Q/K rows back in the order of the original checkpoint: llama.cpp's llama converter
    stores each head's rows as (head_dim/2, 2) pairs of its (2, head_dim/2) halves."""
    heads, kv_heads = int(args.num_attention_heads), int(args.num_key_value_heads)
    out = dict(weights)
    for name, value in weights.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj not in ("q_proj", "k_proj"):
            continue
        n = heads if proj == "q_proj" else kv_heads
        rows = value.shape[0]
        out[name] = value.reshape(n, rows // n // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
    return out


def tokenizer_config(chat: Any, context: int) -> dict[str, Any]:
    """tokenizer_config.json of an mlx-lm directory for a GGUF chat tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat.chat_template,
        "bos_token": chat.bos_token,
        "eos_token": chat.eos_token,
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": context,
    }
