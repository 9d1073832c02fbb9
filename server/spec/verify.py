"""The verify forward: a window of 1 + K tokens through the model, logits for every row.

Owns: `logits_window`. Engine thread only. The window goes through the same trunk call
as a prefill chunk (the segmented routes take several query rows: causal inside the
tail, every sealed segment before them), so each row's logits are the model's for the
token after that row; the vocabulary projection runs on all 1 + K rows (a prefill
chunk's runs on its last row only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.server.runner.forward import finish_logits, head_of, trunk_hidden


def logits_window(model: nn.Module, tokens: Sequence[int], cache: Sequence[Any]) -> mx.array:
    """Run `tokens` through the model (writing their rows to the cache); logits [N, V]."""
    x = mx.array([list(tokens)], dtype=mx.int32)
    trunk = getattr(model, "model", None)
    head = head_of(model)
    if trunk is None or head is None:
        out: mx.array = model(x, cache=list(cache))[0]
        return out
    return finish_logits(model, head(trunk_hidden(model, x, cache))[0])
