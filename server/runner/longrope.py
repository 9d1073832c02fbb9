"""Phi-3 LongRoPE (`rope_scaling.type` "longrope" / "su": Phi-3-mini-128k, Phi-3.5) with
its short and long frequency factors.

Owns: `LongRoPE` (the RoPE module), `longrope_from_config` (from an mlx-lm/HF config's
`rope_scaling`) and `install_longrope` (every attention of a phi3 model). Called once at
load (`segserve.server.runner.model`, `segserve.server.runner.gguf`).

Frequencies: theta_i = pos / (factor_i * base^(2i/d)), the rotated dims scaled by the
attention factor first (HF's `attention_factor`, llama.cpp's `rope.scaling.attn_factor`,
mlx-lm's `SuScaledRoPE._scale`: sqrt(1 + ln(max/original) / ln(original)) unless the config
gives `short_mscale` / `long_mscale`).

Which factors: a row at position p < `original_max_position_embeddings` is rotated with the
short factors, from there on with the long ones. Why per position: a KV row must be a
function of its token and position only, or a stored segment would be stale as soon as a
conversation grew past the switch (HF switches the whole sequence by its length and keeps
the rows it cached before; llama.cpp picks one set by the configured context; mlx-lm's
`SuScaledRoPE` always uses the long factors). Up to the switch this is HF's computation
exactly; past it, new rows use the long factors as HF's decode does. A prefill chunk that
spans the switch is rotated in two parts; batched decode (one offset per row) computes both
and selects per row; the native CPU decode layers pick the set per row by its position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

LONGROPE_TYPES = ("longrope", "su")


def default_mscale(max_positions: int, original: int) -> float:
    factor = max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class LongRoPE(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    # For the native decode layers (segserve.kernels.block_cpu), which may not import this
    # module: two frequency sets (`_short`, `_long`) and mscales, switched at `original`.
    two_frequency_sets = True

    def __init__(self, dims: int, base: float, original: int, short_factor: list[float] | mx.array,
                 long_factor: list[float] | mx.array, short_mscale: float, long_mscale: float) -> None:
        super().__init__()
        self.dims, self.original = dims, int(original)
        periods = mx.power(mx.array(base, dtype=mx.float32), mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        short = mx.array(short_factor, dtype=mx.float32).reshape(-1)
        long = mx.array(long_factor, dtype=mx.float32).reshape(-1)
        if short.shape != (dims // 2,) or long.shape != (dims // 2,):
            raise ValueError(f"LongRoPE factors have {short.shape[0]} / {long.shape[0]} values, expected {dims // 2}")
        self._short, self._long = short * periods, long * periods
        self.short_mscale, self.long_mscale = float(short_mscale), float(long_mscale)
        # Evaluated here: a lazy array made on the loading thread cannot be evaluated by
        # the engine thread later.
        mx.eval(self._short, self._long)

    def _rotate(self, x: mx.array, offset: int | mx.array, long: bool) -> mx.array:
        mscale = self.long_mscale if long else self.short_mscale
        if mscale != 1.0:
            x = x.at[..., : self.dims].multiply(mscale)
        freqs = self._long if long else self._short
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        length = x.shape[-2]
        if isinstance(offset, int):
            if offset + length <= self.original:
                return self._rotate(x, offset, long=False)
            if offset >= self.original:
                return self._rotate(x, offset, long=True)
            cut = self.original - offset  # a chunk across the switch: two parts
            return mx.concatenate(
                [self._rotate(x[..., :cut, :], offset, long=False),
                 self._rotate(x[..., cut:, :], self.original, long=True)], axis=-2)
        # One offset per batch row (batched decode) or a 0-d array: per-row selection.
        pos = offset.reshape(-1, 1, 1, 1) + mx.arange(length).reshape(1, 1, length, 1)
        return mx.where(pos < self.original, self._rotate(x, offset, long=False), self._rotate(x, offset, long=True))


def longrope_from_config(dims: int, base: float, max_positions: int, original: int,
                         scaling: Mapping[str, Any]) -> LongRoPE:
    """From a config's `rope_scaling` ({type, short_factor, long_factor, [short_mscale,
    long_mscale]}); a missing short_factor means the long one (as mlx-lm reads it)."""
    long = scaling["long_factor"]
    short = scaling.get("short_factor", long)
    default = default_mscale(max_positions, original)
    return LongRoPE(dims, base, original, short, long, float(scaling.get("short_mscale") or default),
                    float(scaling.get("long_mscale") or default))


def install_longrope(model: nn.Module, rope: LongRoPE) -> int:
    """Every attention's RoPE of `model` becomes `rope`; returns how many."""
    layers = list(model.layers)
    for layer in layers:
        layer.self_attn.rope = rope
    return len(layers)


def longrope_for_phi3(model: nn.Module) -> LongRoPE | None:
    """The LongRoPE an mlx-lm phi3 model's config asks for, or None (no LongRoPE scaling)."""
    args: Any = getattr(model, "args", None)
    scaling = getattr(args, "rope_scaling", None)
    if getattr(args, "model_type", "") != "phi3" or not scaling or scaling.get("type") not in LONGROPE_TYPES:
        return None
    head_dim = args.hidden_size // args.num_attention_heads
    dims = int(head_dim * float(getattr(args, "partial_rotary_factor", 1.0)))
    return longrope_from_config(dims, float(args.rope_theta), int(args.max_position_embeddings),
                                int(args.original_max_position_embeddings), scaling)
