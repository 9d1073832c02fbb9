"""CPU weight layout: store float32 projection weights pre-transposed ([in, out]).

Owns: `apply_cpu_layout(model)`, a load-time transform (like gpt-fast's `apply_tp`), and
`LayoutReport`. Engine thread only, once, before the first forward.

Why: MLX's CPU matmul hands `x @ W.T` (W stored [out, in], mlx's nn.Linear layout) to BLAS
as a transposed GEMM; with OpenBLAS preloaded that runs a single-row decode at about
4-5 GB/s here, while the same product against a contiguous [in, out] copy runs at 12-20
GB/s (bench/cpu_speed.py measures both). Decode is one row per step, so this doubles
tokens/s. The tied embedding keeps its [vocab, hidden] table for lookups and gets a
transposed copy for the output projection: that copy costs vocab * hidden * 4 bytes
(113 MB on SmolLM2), reported in `LayoutReport.extra_bytes`.
Math is unchanged: same products, same float32 accumulation (greedy tokens are compared
with the plain route in tests/test_cpu_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class TransposedLinear(nn.Module):
    """`y = x @ wt (+ bias)` with `wt` stored [in, out] contiguous."""

    def __init__(self, weight: mx.array, bias: mx.array | None) -> None:
        super().__init__()
        self.wt = mx.contiguous(weight.T)  # wt: [in, out]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.wt
        return y + self.bias if "bias" in self else y


class TransposedHead(nn.Module):
    """Output projection of a tied embedding: x @ E.T with E.T stored contiguous."""

    def __init__(self, table: mx.array) -> None:
        super().__init__()
        self.wt = mx.contiguous(table.T)  # wt: [hidden, vocab]

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.wt


@dataclass(frozen=True, slots=True)
class LayoutReport:
    linears: int
    tied_head: bool
    extra_bytes: int


def apply_cpu_layout(model: nn.Module) -> LayoutReport:
    count = 0
    for _, mod in model.named_modules():
        for name, child in list(mod.children().items()):
            if type(child) is nn.Linear and child.weight.dtype == mx.float32:
                setattr(mod, name, TransposedLinear(child.weight, child.get("bias")))
                count += 1
    extra = 0
    tied = False
    args: Any = getattr(model, "args", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if getattr(args, "tie_word_embeddings", False) and type(embed) is nn.Embedding:
        if embed.weight.dtype == mx.float32:
            head = TransposedHead(embed.weight)
            model.tied_head = head  # type: ignore[attr-defined]
            extra = head.wt.nbytes
            tied = True
    mx.eval(model.parameters())
    return LayoutReport(count, tied, extra)
