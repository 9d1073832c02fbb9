"""CPU weight layout: store float32 projection weights pre-transposed ([in, out]).

Owns: `apply_cpu_layout(model, shape)`, a load-time transform (like gpt-fast's `apply_tp`), and
`LayoutReport`. Engine thread only, once, before the first forward.

Why: MLX's CPU matmul hands `x @ W.T` (W stored [out, in], mlx's nn.Linear layout) to BLAS
as a transposed GEMM, which is slow for the single row of a decode step; against a
contiguous [in, out] copy, with q/k/v and gate/up fused into one product each, decode went
from 9.7 to 13.4 tok/s with OpenBLAS (`python bench/cpu_speed.py`, variants
openblas_f32 and openblas_f32_layout). The tied embedding keeps its [vocab, hidden] table for lookups and gets a
transposed copy for the output projection: that copy costs vocab * hidden * 4 bytes
(113 MB on SmolLM2), reported in `LayoutReport.extra_bytes`.
Math is unchanged: same products, same float32 accumulation (greedy tokens are compared
with the plain route in tests/test_cpu_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from segserve.kernels.split_product import SplitProduct
from segserve.kv.shape import ModelShape


class TransposedLinear(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """`y = x @ wt (+ bias)` with `wt` stored [in, out] contiguous."""

    def __init__(self, weight: mx.array, bias: mx.array | None) -> None:
        super().__init__()
        self.wt = mx.contiguous(weight.T)  # wt: [in, out]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.wt
        return y + self.bias if "bias" in self else y


class TransposedHead(nn.Module):  # type: ignore[misc]
    """Output projection of a tied embedding: x @ E.T with E.T stored contiguous."""

    def __init__(self, table: mx.array) -> None:
        super().__init__()
        self.wt = mx.contiguous(table.T)  # wt: [hidden, vocab]

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.wt


class _SharedProduct(SplitProduct):
    """One product `x @ [W_a | W_b | ...]` shared by sibling projections of the same input
    (`segserve.kernels.split_product`): one wider product reads the input once and halves the
    number of BLAS calls."""

    def __init__(self, wt: mx.array, splits: list[int]) -> None:
        super().__init__(splits)
        self.wt = wt  # wt: [in, sum(out_i)]

    def product(self, x: mx.array) -> mx.array:
        return x @ self.wt


class FusedPart(nn.Module):  # type: ignore[misc]
    """Stands in for one projection; the first part of a group owns the fused weight."""

    def __init__(self, shared: _SharedProduct, index: int) -> None:
        super().__init__()
        if index == 0:
            self.wt = shared.wt  # registered once, so parameter byte counts stay true
        self._shared = [shared]  # a list: not an mx.array attribute, so not a parameter
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared[0].part(self._index, x)


def _fuse(parent: nn.Module, names: tuple[str, ...]) -> bool:
    mods = [getattr(parent, n, None) for n in names]
    if not all(type(m) is TransposedLinear and "bias" not in m for m in mods):
        return False
    wts = [m.wt for m in mods]  # type: ignore[union-attr]
    widths = [w.shape[1] for w in wts]
    splits = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    shared = _SharedProduct(mx.concatenate(wts, axis=1), splits)
    for i, n in enumerate(names):
        setattr(parent, n, FusedPart(shared, i))
    return True


@dataclass(frozen=True, slots=True)
class LayoutReport:
    linears: int
    tied_head: bool
    extra_bytes: int
    fused_groups: int = 0


def apply_cpu_layout(model: nn.Module, shape: ModelShape, *, fuse: bool = True) -> LayoutReport:
    count = 0
    for _, mod in model.named_modules():
        for name, child in list(mod.children().items()):
            if type(child) is nn.Linear and child.weight.dtype == mx.float32:
                setattr(mod, name, TransposedLinear(child.weight, child.get("bias")))
                count += 1
    extra = 0
    tied = False
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and shape.tie_word_embeddings and type(embed) is nn.Embedding:
        if embed.weight.dtype == mx.float32:
            head = TransposedHead(embed.weight)
            model.tied_head = head
            extra = head.wt.nbytes
            tied = True
    fused = 0
    if fuse:
        for _, mod in model.named_modules():
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                fused += _fuse(mod, group)
    mx.eval(model.parameters())
    return LayoutReport(count, tied, extra, fused)
