"""One product shared by sibling projections of the same input, split into their outputs.

Owns: `SplitProduct`. Used by `segserve.server.runner.cpu_layout` (float32 `x @ [W_a | W_b | ...]`)
and `segserve.kernels.qmm_cpu` (one quantized matmul over the concatenated 4/8-bit weights).

mlx-lm's attention calls q_proj(x), k_proj(x), v_proj(x) back to back on the same `x`
(and the MLP gate_proj(x), up_proj(x)): one wider product reads the input once and cuts
the number of calls. The last input and its split product are kept until every sibling
has taken its part, then dropped.
"""

from __future__ import annotations

import mlx.core as mx


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
