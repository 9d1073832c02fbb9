"""Stock mode: mlx-lm's contiguous `KVCache`, kept for A/B comparison and as the fallback.

Owns: `StockCache`, one request's memory as one mlx-lm `KVCache` per layer.
Only the engine thread calls it.

A snapshot here is ONE segment whose arrays are views of the live per-layer buffers, which
is exactly what mlx-lm's prompt cache does: the buffer is then shared, so the next write
(or the next 256-row growth by concatenation) copies the whole history. That copy is the
cost segmented mode removes; admission prices it in stock mode.

Rows are stored as the layers compute them (mlx-lm's behaviour): on CPU float32 for a GGUF,
where segmented mode stores float16 (`segserve.server.runner.model.stock_mode` gives stock mode its
own `kv_dtype` and price). Why not float16 here too: mlx-lm's SDPA would then cast the
whole history to float32 every step (bench/profile_decode.py, 500 rows: about twice as
slow a step).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from segserve.kv.segment import Segment, Snapshot


class StockCache:
    def __init__(self, num_layers: int, base: Snapshot | None = None) -> None:
        self.layers = [KVCache() for _ in range(num_layers)]
        self._tokens: list[int] = []
        self._snapshot = Snapshot()
        self.seals = 0
        self.merges = 0
        if base is not None and base.rows > 0:
            self._restore(base)

    def _restore(self, base: Snapshot) -> None:
        # One buffer per layer, as the stock cache needs; with one stored segment this is a
        # view of the stored buffer (shared: the next write copies it), else a concatenation.
        for i, layer in enumerate(self.layers):
            ks = [s.keys[i] for s in base.segments]
            vs = [s.values[i] for s in base.segments]
            layer.keys = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
            layer.values = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
            layer.offset = base.rows
        self._tokens = list(base.tokens)
        self._snapshot = base

    @property
    def offset(self) -> int:
        return int(self.layers[-1].offset)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def reserve(self, rows: int) -> None:
        """Stock growth is mlx-lm's own (256-row steps by concatenation): nothing to do."""

    def record_tokens(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(int(t) for t in tokens)
        if len(self._tokens) != self.offset:
            raise AssertionError("tokens and cache rows disagree")

    def seal(self) -> Snapshot:
        n = self.offset
        if n == 0:
            return self._snapshot
        if n == self._snapshot.rows:
            return self._snapshot
        # n > 0: every layer has written, so its buffers exist.
        keys: list[mx.array] = [layer.keys[:, :, :n, :] for layer in self.layers]  # type: ignore[index]
        vals: list[mx.array] = [layer.values[:, :, :n, :] for layer in self.layers]  # type: ignore[index]
        seg = Segment.seal(keys, vals, self._tokens, Snapshot().digest)
        self._snapshot = Snapshot((seg,))
        self.seals += 1
        return self._snapshot

    def drop_tail(self) -> None:
        keep = self._snapshot.rows
        for layer in self.layers:
            layer.offset = min(layer.offset, keep)
        del self._tokens[keep:]

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self.layers)

    def tail_nbytes(self) -> int:
        # The whole live slab: in stock mode a turn's writes land in (a copy of) it.
        return self.nbytes

    @property
    def base(self) -> Snapshot:
        return self._snapshot
