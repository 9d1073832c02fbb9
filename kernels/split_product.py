"""One product shared by sibling projections of the same input, split into their outputs.

Owns: `SplitProduct`, `SharedLayer` (the product is one layer over the concatenated rows) and
`LayerPart` (the module standing in for one sibling). Used by
`segserve.server.runner.cpu_layout` (float32 `x @ [W_a | W_b | ...]`), `segserve.kernels.qmm_cpu`
(one quantized matmul over the concatenated 4/8-bit weights) and
`segserve.server.runner.gpu_layout` (MLX's own linear or quantized layer over the
concatenated rows, on a GPU).

mlx-lm's attention calls q_proj(x), k_proj(x), v_proj(x) back to back on the same `x`
(and the MLP gate_proj(x), up_proj(x)): one wider product reads the input once and cuts
the number of calls. The last input and its split product are kept until every sibling
has taken its part, then dropped.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class SplitProduct:
    """Subclasses say what the product is (`product`); `part(i, x)` is sibling i's output."""

    def __init__(self, splits: list[int]) -> None:
        self.splits = splits  # cumulative split points along the last axis
        self._x: mx.array | None = None
        self._parts: list[mx.array] = []
        self._taken = 0

    def product(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def part(self, i: int, x: mx.array) -> mx.array:
        if self._x is not x or self._taken == len(self.splits) + 1:
            self._x, self._taken = x, 0
            self._parts = mx.split(self.product(x), self.splits, axis=-1)  # type: ignore[assignment]
        self._taken += 1
        out = self._parts[i]
        if self._taken == len(self.splits) + 1:
            self._x, self._parts = None, []
        return out


class SharedLayer(SplitProduct):
    """The product is one layer (any `nn.Module` mapping [..., in] to [..., sum(out_i)])."""

    def __init__(self, layer: nn.Module, splits: list[int]) -> None:
        super().__init__(splits)
        self.layer = layer

    def product(self, x: mx.array) -> mx.array:
        return self.layer(x)  # type: ignore[no-any-return]


class LayerPart(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    """Stands in for one projection of a fused group; the first part holds the fused layer
    (registered once, so parameter byte counts stay true)."""

    def __init__(self, shared: SharedLayer, index: int) -> None:
        super().__init__()
        if index == 0:
            self.fused = shared.layer
        self._shared = [shared]  # a list: not a child module, so not registered twice
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared[0].part(self._index, x)
