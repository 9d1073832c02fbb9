"""GPU weight layout: sibling projections of one input fused into one product.

Owns: `fuse_projections(model)`, a load-time transform on a GPU: in every module whose
q_proj/k_proj/v_proj (and gate_proj/up_proj) are MLX linear layers of one kind (`nn.Linear`
of one dtype, or `nn.QuantizedLinear` of one mode, bit width and group size; biases on all
or on none), the group's rows are concatenated into one layer and each projection becomes a
`LayerPart` of it (`segserve.kernels.split_product`). Main thread, once, before the first
forward; on the CPU the same fusion is done by `cpu_layout` and `qmm_cpu.install`.

Why: a decode step of one or a few sessions on a GPU is bound by the host (MLX builds and
launches every primitive of a step; an 8B model's step reads its weights in ~3 ms on an
H200 while building it takes about as long). Three products of one input become one wider
product that reads the input once, and the MLP's two become one: 3 fewer matmul launches per
layer. The split outputs are views of the product (the head split that follows reshapes
them; mlx-lm's own Phi-3 layers do the same with their `qkv_proj`).
Math is unchanged: each output row of the wider product is the same dot product of the same
row of weights (the differential test compares logits with the unfused model).
Memory: the concatenated copy of each group is made and evaluated before the next group, so
loading peaks at one group's copy above the weights.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.kernels.split_product import LayerPart, SharedLayer

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(model: nn.Module) -> int:
    """Fuse every eligible group in `model`; returns how many groups were fused."""
    fused = 0
    for _, mod in model.named_modules():
        for names in GROUPS:
            fused += _fuse(mod, names)
    return fused


def _same_kind(mods: list[Any]) -> bool:
    first = mods[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not type(first) for m in mods):
        return False
    keys = set(first.keys())
    for m in mods[1:]:
        if set(m.keys()) != keys:
            return False
        # rows are concatenated: every array but its first axis alike (a bias has no other)
        if any(m[k].dtype != first[k].dtype or m[k].shape[1:] != first[k].shape[1:] for k in keys):
            return False
    if type(first) is nn.QuantizedLinear:
        attrs = ("group_size", "bits", "mode")
        return all(getattr(m, a, None) == getattr(first, a, None) for m in mods for a in attrs)
    return True


def _fuse(parent: nn.Module, names: tuple[str, ...]) -> bool:
    mods: list[Any] = [parent.get(n) for n in names]  # None where absent: not of one kind
    if not _same_kind(mods):
        return False
    first: Any = mods[0]
    widths = [int(m["weight"].shape[0]) for m in mods]
    splits = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    layer: Any
    if type(first) is nn.QuantizedLinear:
        # a holder of the right kind, its arrays replaced below
        layer = nn.QuantizedLinear(first.group_size, 1, bias="bias" in first, group_size=first.group_size,
                                   bits=first.bits, mode=getattr(first, "mode", "affine"))
    else:
        layer = nn.Linear(1, 1, bias="bias" in first)
    if set(layer.keys()) != set(first.keys()):
        return False
    for key in first.keys():
        layer[key] = mx.concatenate([m[key] for m in mods], axis=0)
    mx.eval(layer.parameters())  # now: the parts' arrays go when replaced below
    shared = SharedLayer(layer, splits)
    for i, n in enumerate(names):
        setattr(parent, n, LayerPart(shared, i))
    return True
