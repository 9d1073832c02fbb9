"""The written-down cache protocol.

Owns: `LayerCache` (what an mlx-lm model calls on a per-layer cache). Implementations:
the per-layer caches of `segserve.kv.segmented.SegmentedCache` and `segserve.kv.stock.StockCache`; mlx-lm's
own `KVCache` satisfies `LayerCache` and is run through the same contract test.

Where log-sum-exp merging happens (decision): NOT in `kv/`. A segmented layer cache's
`update_and_fetch` writes the new rows into the private tail and returns the tail's rows
only; attention over the sealed segments plus the tail is done by `kernels/` through the
attention hook (`segserve.kernels.hook`), which recognises the segmented layer cache by type and
calls the attention route that cache carries.
mlx-lm's own helper only switches on `hasattr(cache, "bits")`, so without the hook a
segmented cache would silently attend to the tail alone: the hook is installed before
any model runs, and the start-up self-check proves it is in place.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import mlx.core as mx


@runtime_checkable
class LayerCache(Protocol):
    """Model-facing per-layer part (mlx-lm 0.32.2's informal protocol, written down)."""

    @property
    def offset(self) -> int: ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any: ...

    @property
    def state(self) -> Any: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def empty(self) -> bool: ...
