"""One forward pass that computes logits for the last position only.

Owns: `logits_last`. Engine thread only.
mlx-lm models compute the vocabulary projection for every position; during a prefill
chunk of 256 tokens on SmolLM2 that is 256 x 49152 x 576 multiply-adds thrown away (about
as much as the rest of the chunk). Models that expose the usual `model.model` trunk get
the projection on the last row only; anything else falls back to the full call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def logits_last(model: nn.Module, tokens: Sequence[int], cache: Sequence[Any]) -> mx.array:
    """Run `tokens` through the model (writing the cache); return logits [V] of the last."""
    x = mx.array([list(tokens)], dtype=mx.int32)
    trunk = getattr(model, "model", None)
    head = head_of(model)
    if trunk is None or head is None:
        out: mx.array = model(x, cache=list(cache))[0, -1]
        return out
    hidden = trunk(x, list(cache))  # hidden: [1, L, H]
    logits: mx.array = head(hidden[:, -1:, :])[0, -1]
    return logits


def head_of(model: nn.Module) -> Any:
    """The output projection (vocabulary logits) of a model, or None if not found."""
    tied = getattr(model, "tied_head", None)  # set by server.runner.cpu_layout
    if tied is not None:
        return tied
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False):
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        return getattr(embed, "as_linear", None)
    return getattr(model, "lm_head", None)
