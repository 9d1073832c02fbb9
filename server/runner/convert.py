"""GGUF → mlx-lm model directory (for peers such as `mlx_lm.server` on the same weights,
and as the second loading route the GGUF loader is tested against).

Owns: `convert_gguf`. Writes config.json (the file's family and RoPE convention, per-module
quantization), model.safetensors (MLX affine-quantized tensors under mlx-lm names),
tokenizer.json (the BPE built from the GGUF metadata) and tokenizer_config.json (with the
GGUF's chat template). The weights are written as read: no requantization.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from segserve.server.runner.gguf import GROUP_SIZE, ModelLoadError, embedded_model_path, read_gguf
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
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), mapped, metadata={"format": "mlx"})
    config = {
        "model_type": g.arch,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "head_dim": getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "rope_traditional": bool(getattr(args, "rope_traditional", False)),
        "tie_word_embeddings": args.tie_word_embeddings,
        "quantization": quant,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    chat, tok = from_gguf_metadata(meta)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = tokenizer_config(chat, int(args.max_position_embeddings or 2048))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
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
