"""Gemma 2's sliding-window layers, which mlx-lm's gemma2 model leaves out.

Owns: `install_gemma2_windows` (called once at load by `segserve.server.runner.model` for an
mlx-lm directory and by `segserve.server.runner.gguf` for a GGUF file) and the two classes
it puts the model under: `WindowedGemma2` (the model, whose `make_cache` gives every
windowed layer mlx-lm's `RotatingKVCache`) and `WindowedGemmaModel` (the trunk, whose
forward hands each layer the mask of its kind).

Gemma 2 alternates a layer that attends to the last W positions (even layers, W =
`sliding_window`, 4,096 in every released Gemma 2) with a global one, as Hugging Face's and
llama.cpp's implementations do. mlx-lm 0.32's gemma2 attends globally in every layer, which
is the same model only while a conversation is at most W tokens long. With the windows:
stock mode (mlx-lm's caches) keeps the last W rows of a windowed layer in a rotating cache
and masks by position, as mlx-lm's gemma3 does; segmented mode reads the windows from the
model's caches (`segserve.kernels.hook.layer_windows`) and its attention routes skip the
segments outside a query's window. Parameter paths and the attention modules are
unchanged (the soft-capped attention is still mlx-lm's, or segserve's routed subclass).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache


def windowed(layer: int) -> bool:
    """Gemma 2's rule: even layers slide, odd ones attend globally."""
    return layer % 2 == 0


class WindowedGemmaModel(gemma2.GemmaModel):
    """mlx-lm's gemma2 trunk with each layer's mask of its kind (windowed or global)."""

    window: int

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * (self.args.hidden_size**0.5)
        if cache is None:
            cache = [None] * len(self.layers)
        # Array masks: gemma2's attention applies them itself (it computes the soft-capped
        # scores inline). A one-layer model has no global layer.
        glob = cache[1] if len(cache) > 1 else None
        global_mask = create_attention_mask(h, glob, return_array=True)
        window_mask = create_attention_mask(h, cache[0], window_size=self.window, return_array=True)
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            h = layer(h, window_mask if windowed(i) else global_mask, c)
        return self.norm(h)  # type: ignore[no-any-return]


class WindowedGemma2(gemma2.Model):
    """mlx-lm's gemma2 model whose caches say which layers slide (`make_cache`)."""

    def make_cache(self) -> list[Any]:
        window = self.model.window
        return [RotatingKVCache(max_size=window) if windowed(i) else KVCache() for i in range(len(self.layers))]


def install_gemma2_windows(model: nn.Module, window: int | None) -> nn.Module:
    """Put a gemma2 model's windowed layers in place (W = `window`); any other model, or a
    gemma2 whose configuration gives no window, is returned as it is."""
    if type(model) is not gemma2.Model or not window:
        return model
    model.model.__class__ = WindowedGemmaModel
    model.model.window = int(window)
    model.__class__ = WindowedGemma2
    return model
