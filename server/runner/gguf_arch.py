"""GGUF architectures as data: metadata → mlx-lm model args, tensor names → parameter paths.

Owns: `FAMILIES` (one row per `general.architecture`), `family_for`, `model_args`,
`map_name` and `FreqRoPE` (RoPE from an explicit frequency vector, for Llama 3's
`rope_freqs` tensor). Pure lookups: the loader (`segserve.server.runner.gguf`) calls them once.

RoPE convention, decided per family: llama.cpp's converter permutes the Q/K rows of the
llama architecture (Llama, Mistral, SmolLM) for interleaved ("normal") RoPE, so those run
with mlx-lm's `rope_traditional=True` and are never un-permuted. Qwen2/Qwen3/Phi-3 are
converted unpermuted and llama.cpp rotates them NEOX-style: `rope_traditional=False`.
Llama 3.1+ files carry `rope_freqs.weight`, the per-frequency divisors llama.cpp applies
(theta_i = pos * base^(-2i/d) / f_i); `FreqRoPE` feeds the same periods to `mx.fast.rope`.

Phi-3 128k / Phi-3.5 (`phi3` with `rope_factors_short` / `rope_factors_long`): LongRoPE, the
switch at `rope.scaling.original_context_length`, the attention factor from
`rope.scaling.attn_factor` (`longrope_for`; segserve.server.runner.longrope says which factors
a position gets).

Gemma 2 / Gemma 3 (`gemma2`, `gemma3`): NEOX RoPE, unpermuted; llama.cpp's converter stores
every `*norm.weight` as 1 + w (HF's Gemma RMSNorm scales by 1 + w; `conversion/gemma.py`
adds 1 at conversion), and mlx-lm's Gemma RMSNorm adds 1 itself, so the loader subtracts it
back (`Family.norm_plus_one`). The attention scale is llama.cpp's: 1/sqrt(hidden/heads) for
the 27B shapes (62 layers for Gemma 3, 46 for Gemma 2), else 1/sqrt(head size). Gemma 3's
windows: `attention.sliding_window`, a global layer every `sliding_window_pattern` (6 when
absent, llama.cpp's default; a per-layer array must be that periodic shape), local RoPE base
`rope.freq_base_swa` (10,000 when absent). Gemma 2's windows (`attention.sliding_window`,
4,096 when absent; every even layer), which mlx-lm's gemma2 does not have, are put in by
`segserve.server.runner.gemma2_window`.

OLMo 2 (`olmo2`): NEOX RoPE, unpermuted (llama.cpp's converter writes it as its own
architecture); no pre-norms, `post_attention_norm` / `post_ffw_norm` on the branch outputs,
q/k RMSNorm over all heads at once. A file with `attention.sliding_window` (OLMo 3, written
as olmo2 by newer converters) is refused: mlx-lm's olmo2 has no windows.
Granite (`granite`): the llama converter (permuted Q/K, interleaved RoPE) plus four scalars:
`attention.scale` (the attention's softmax scale), `embedding_scale`, `residual_scale` and
`logit_scale` (the logits are divided by it). mlx-lm's granite builds its RoPE unrotated
("NEOX"), so the loader swaps in an interleaved one (`adapt_model`).
SmolLM3 (`smollm3`): the llama converter, with no RoPE in every 4th layer ((i + 1) % 4 == 0);
llama.cpp hardcodes that step (no GGUF key), and so does this loader. The model is served
as mlx-lm's llama model with those layers' RoPE switched off (`smollm3_as_llama`: the same
forward as mlx-lm's smollm3 wrapper, under the class the batched decode knows).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, granite, llama, olmo2, phi3, qwen2, qwen3, smollm3
from mlx_lm.models.rope_utils import initialize_rope

from segserve.server.runner.gemma2_window import install_gemma2_windows
from segserve.server.runner.longrope import LongRoPE, default_mscale


class ModelLoadError(RuntimeError):
    """The model file could not be read or is not a supported architecture."""


_LLAMA_LAYER = {
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
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True, slots=True)
class Family:
    module: ModuleType  # the mlx-lm model module that computes this family
    rope_traditional: bool  # True where GGUF's Q/K rows are permuted (llama arch)
    layer_map: Mapping[str, str]  # GGUF `blk.N.<part>` → path under `model.layers.N.`
    own_head_dim: bool = True  # ModelArgs has head_dim (else it is hidden // heads)
    refused_tensors: frozenset[str] = field(default_factory=frozenset)  # not built: named in the error
    norm_plus_one: bool = False  # the file stores norm weights as 1 + w (gemma): the loader subtracts 1
    model_type: str = ""  # mlx-lm's model_type, where it differs from the GGUF architecture


FAMILIES: dict[str, Family] = {
    # Mistral and Mistral-Nemo are written as "llama" (Nemo: key_length 128 != hidden/heads).
    "llama": Family(llama, True, _LLAMA_LAYER),
    "qwen2": Family(qwen2, False, _LLAMA_LAYER, own_head_dim=False),
    "qwen3": Family(
        qwen3, False, {**_LLAMA_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    ),
    # Phi-3 keeps HF's fused projections, and so does mlx-lm's phi3.
    "phi3": Family(
        phi3,
        False,
        {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",
            "ffn_down": "mlp.down_proj",
        },
        own_head_dim=False,
    ),
    "gemma2": Family(gemma2, False, _GEMMA_LAYER, norm_plus_one=True),
    "olmo2": Family(
        olmo2,
        False,
        {k: v for k, v in {**_GEMMA_LAYER, "attn_q_norm": "self_attn.q_norm",
                           "attn_k_norm": "self_attn.k_norm"}.items()
         if k not in ("attn_norm", "ffn_norm")},
    ),
    "granite": Family(granite, True, _LLAMA_LAYER, own_head_dim=False),
    "smollm3": Family(smollm3, True, _LLAMA_LAYER),
    "gemma3": Family(
        gemma3_text,
        False,
        {**_GEMMA_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        norm_plus_one=True,
        model_type="gemma3_text",
    ),
}
GEMMA2_WINDOW, GEMMA3_PATTERN, GEMMA3_LOCAL_BASE = 4096, 6, 10000.0  # llama.cpp's defaults
SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp: `hparams.n_no_rope_layer_step = 4` (no GGUF key)
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_TOPNAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"
# Phi-3 128k / 3.5 LongRoPE: per-frequency divisors, short and long (segserve.server.runner.longrope)
LONGROPE_SHORT, LONGROPE_LONG = "rope_factors_short.weight", "rope_factors_long.weight"
LONGROPE_TENSORS = frozenset({LONGROPE_SHORT, LONGROPE_LONG})


def family_for(meta: Mapping[str, Any]) -> tuple[str, Family]:
    arch = str(meta.get("general.architecture", ""))
    if arch not in FAMILIES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return arch, FAMILIES[arch]


def map_name(family: Family, gguf_name: str) -> str:
    """GGUF tensor name → mlx-lm parameter path (`.weight` / `.bias`)."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in family.layer_map:
            return f"model.layers.{layer}.{family.layer_map[part]}.{kind}"
    m = _TOPNAME.match(gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name}")


def _num(meta: Mapping[str, Any], key: str, default: float | None = None) -> float:
    if key not in meta:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks {key}")
        return default
    value = meta[key]
    return float(value.item() if hasattr(value, "item") else value)


def model_args(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """mlx-lm `ModelArgs` of the file's family from its metadata and tensor shapes
    (row-major, e.g. token_embd [vocab, hidden])."""
    arch, fam = family_for(meta)
    refused = sorted(fam.refused_tensors & set(shapes))
    if refused:
        raise ModelLoadError(f"GGUF {arch}: {', '.join(refused)} is not supported")
    if arch != "phi3" and LONGROPE_TENSORS & set(shapes):
        raise ModelLoadError(f"GGUF {arch}: LongRoPE factor tensors are served for phi3 only")
    a = arch + "."
    hidden = int(_num(meta, a + "embedding_length"))
    heads = int(_num(meta, a + "attention.head_count"))
    head_dim = int(_num(meta, a + "attention.key_length", hidden // heads))
    if not fam.own_head_dim and head_dim != hidden // heads:
        raise ModelLoadError(f"GGUF {arch}: head size {head_dim} != hidden/heads, which mlx-lm's {arch} assumes")
    rope_dims = int(_num(meta, a + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"GGUF {arch}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    d: dict[str, Any] = {
        "model_type": fam.model_type or arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_num(meta, a + "block_count")),
        "intermediate_size": int(_num(meta, a + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_num(meta, a + "attention.head_count_kv", heads)),
        "rms_norm_eps": _num(meta, a + "attention.layer_norm_rms_epsilon"),
        "vocab_size": int(shapes["token_embd.weight"][0]),
        "head_dim": head_dim,
        "max_position_embeddings": int(_num(meta, a + "context_length")),
        "rope_theta": _num(meta, a + "rope.freq_base", 10000.0),
        "rope_traditional": fam.rope_traditional,
        "tie_word_embeddings": "output.weight" not in shapes,
        "rope_scaling": _rope_scaling(meta, a),
    }
    if arch in ("gemma2", "gemma3"):
        d.update(_gemma_args(meta, arch, d))
    if arch == "olmo2" and _num(meta, a + "attention.sliding_window", 0.0):
        raise ModelLoadError("GGUF olmo2: sliding-window attention (OLMo 3) is not supported "
                             "(mlx-lm's olmo2 has no windows)")
    if arch == "granite":
        d.update({
            "attention_multiplier": _num(meta, a + "attention.scale"),
            "embedding_multiplier": _num(meta, a + "embedding_scale", 1.0),
            "residual_multiplier": _num(meta, a + "residual_scale", 1.0),
            "logits_scaling": _num(meta, a + "logit_scale", 1.0),
            "attention_bias": "blk.0.attn_q.bias" in shapes,
            "mlp_bias": "blk.0.ffn_up.bias" in shapes,
        })
    if arch == "smollm3":
        d["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_STEP
    args = fam.module.ModelArgs.from_dict(d)
    # The server reads the context from here; gemma2's ModelArgs has no such field.
    args.max_position_embeddings = d["max_position_embeddings"]
    if arch == "gemma2":  # nor this one: `adapt_model` installs the windows from it
        args.sliding_window = d["sliding_window"]
    return args


def longrope_for(meta: Mapping[str, Any], args: Any, factors: Mapping[str, mx.array]) -> LongRoPE:
    """Phi-3's LongRoPE from the file (llama.cpp's converter): the two factor tensors,
    `rope.scaling.original_context_length` (the switch) and `rope.scaling.attn_factor`
    (absent: the default from the context and the original context)."""
    if LONGROPE_LONG not in factors:
        raise ModelLoadError(f"GGUF phi3: {LONGROPE_SHORT} without {LONGROPE_LONG}")
    original = int(_num(meta, "phi3.rope.scaling.original_context_length"))
    context = int(args.max_position_embeddings)
    attn = _num(meta, "phi3.rope.scaling.attn_factor", default_mscale(context, original))
    head_dim = args.hidden_size // args.num_attention_heads
    long = factors[LONGROPE_LONG]
    try:
        return LongRoPE(head_dim, float(args.rope_theta), original, factors.get(LONGROPE_SHORT, long), long, attn, attn)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF phi3: {exc}") from exc


def adapt_model(arch: str, model: nn.Module, args: Any) -> nn.Module:
    """The family's mlx-lm model as this file's tensors need it (before its weights load):
    granite's RoPE interleaved (the llama converter permuted its Q/K rows), smollm3 as
    mlx-lm's llama model with its no-RoPE layers, gemma2 with its sliding windows."""
    if arch == "gemma2":
        return install_gemma2_windows(model, args.sliding_window)
    if arch == "granite":
        head_dim = args.hidden_size // args.num_attention_heads
        for layer in model.layers:
            layer.self_attn.rope = initialize_rope(
                head_dim, args.rope_theta, True, args.rope_scaling, args.max_position_embeddings)
    return smollm3_as_llama(model)


def smollm3_as_llama(model: nn.Module) -> nn.Module:
    """mlx-lm's smollm3 wrapper is llama's forward line for line (llama's trunk, tied or
    separate head) with RoPE switched off per layer; the same modules under mlx-lm's llama
    `Model` class, which the batched decode and the native decode layers recognise.
    Parameter paths are unchanged. Other models are returned as they are."""
    if type(model) is not smollm3.Model:
        return model
    out = llama.Model(model.args)  # its fresh trunk is lazy and never evaluated: replaced here
    out.model = model.model
    if "lm_head" in model:
        out.lm_head = model.lm_head
    return out


def _gemma_args(meta: Mapping[str, Any], arch: str, d: Mapping[str, Any]) -> dict[str, Any]:
    a = arch + "."
    big = d["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's 27B rule
    out: dict[str, Any] = {
        "query_pre_attn_scalar": d["hidden_size"] / d["num_attention_heads"] if big else d["head_dim"],
    }
    if arch == "gemma2":
        window = int(_num(meta, a + "attention.sliding_window", GEMMA2_WINDOW))
        out["attn_logit_softcapping"] = _num(meta, a + "attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = _num(meta, a + "final_logit_softcapping", 30.0)
        out["sliding_window"] = window  # not a field of mlx-lm's gemma2 args: see build_args
        return out
    if _num(meta, a + "final_logit_softcapping", 0.0):
        raise ModelLoadError("GGUF gemma3: final_logit_softcapping is not supported (mlx-lm's gemma3 has none)")
    window = int(_num(meta, a + "attention.sliding_window", 0))
    out["sliding_window"] = window or int(d["max_position_embeddings"])
    out["sliding_window_pattern"] = _gemma3_pattern(meta.get(a + "attention.sliding_window_pattern"),
                                                    int(d["num_hidden_layers"])) if window else 1
    out["rope_local_base_freq"] = _num(meta, a + "rope.freq_base_swa", GEMMA3_LOCAL_BASE)
    return out


def _gemma3_pattern(value: Any, layers: int) -> int:
    """The period p of Gemma 3's windows (layer i is global iff i % p == p - 1, mlx-lm's and
    llama.cpp's rule) from the metadata: absent, a number, or a per-layer "is windowed" array."""
    if value is None:
        return GEMMA3_PATTERN
    flags = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(flags, list):
        return int(flags)
    for p in range(1, layers + 1):
        if [bool(f) for f in flags] == [i % p < p - 1 for i in range(layers)]:
            return p
    raise ModelLoadError("GGUF gemma3: a sliding-window layer pattern that is not periodic is not supported")


def _rope_scaling(meta: Mapping[str, Any], a: str) -> dict[str, Any] | None:
    kind = str(meta.get(a + "rope.scaling.type", "none"))
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _num(meta, a + "rope.scaling.factor")}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (none, linear)")


class FreqRoPE(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """RoPE with explicit per-frequency periods: `base^(2i/d) * factor_i` (llama.cpp's
    `rope_freqs` divides each angle by factor_i). The periods are evaluated here: a lazy
    array made on the loading thread cannot be evaluated by the engine thread later.
    `rope_by_freqs`: the native decode layers (segserve.kernels.block_cpu) may compute it
    from `_freqs`, `dims` and `traditional` alone (no position scale, no mscale)."""

    rope_by_freqs = True

    def __init__(self, dims: int, traditional: bool, base: float, factors: mx.array) -> None:
        super().__init__()
        if factors.shape != (dims // 2,):
            raise ModelLoadError(f"GGUF {ROPE_FREQS} has shape {factors.shape}, expected ({dims // 2},)")
        self.dims, self.traditional = dims, traditional
        exps = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (mx.power(mx.array(base, dtype=mx.float32), exps) * factors.astype(mx.float32))
        mx.eval(self._freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def apply_rope_freqs(model: nn.Module, args: Any, factors: mx.array) -> None:
    """Swap every attention's RoPE for `FreqRoPE` with the file's frequency factors."""
    head_dim = int(getattr(args, "head_dim", 0) or args.hidden_size // args.num_attention_heads)
    traditional = FAMILIES[family_for({"general.architecture": _arch_of(args)})[0]].rope_traditional
    rope = FreqRoPE(head_dim, traditional, float(args.rope_theta), factors)
    for layer in model.layers:
        if type(layer.self_attn.rope) is not smollm3.NoPE:  # smollm3's layers without RoPE stay so
            layer.self_attn.rope = rope


def _arch_of(args: Any) -> str:
    """The GGUF architecture of a family's args (`model_args` set mlx-lm's model_type)."""
    kind = str(args.model_type)
    return next((a for a, f in FAMILIES.items() if (f.model_type or a) == kind), kind)
