"""Immutable KV segments and snapshots (tuples of segment references).

Owns: `Segment`, `Snapshot`, the token chain hash.
Who mutates: nobody. A segment is created once at seal time (by `segserve.kv.segmented`) or by
the bank's restore path, and never written again. Any thread may read it; only the
engine thread creates MLX arrays.

Layout of one conversation's memory (per layer; every segment covers all layers):

    segments (immutable, shared by snapshots/forks)          tail (mutable, private)
    +-----------------+-----------+------+                   +--------------+......+
    | seg 0 (turn 1)  | seg 1     | seg 2|                   | rows written | cap  |
    +-----------------+-----------+------+                   +--------------+......+
    k, v: [1, H_kv, rows, D] per layer                       k, v: [1, H_kv, cap, D]

Invariants:
- `keys[i].shape[2] == values[i].shape[2] == len(tokens)` for every layer i.
- `digest == chain_digest(parent_digest, tokens)`: it names the tokens *and* everything
  before them, so two segments with equal digests hold the same KV rows.
- A prefix view (`prefix(n)`) slices the arrays (MLX slices share the buffer): no copy.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

ROOT_DIGEST = "0" * 32


def chain_digest(parent: str, tokens: Iterable[int]) -> str:
    """Stable (restart-proof) hash of `tokens` following the chain named by `parent`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.encode())
    toks = list(tokens)
    h.update(struct.pack(f"<{len(toks)}I", *toks))
    return h.hexdigest()


def namespace_digest(*parts: str) -> str:
    """Root of a hash chain, covering everything that changes KV (model, dtype, layout...)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode())
        h.update(b"\x00")
    return h.hexdigest()


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    keys: tuple[mx.array, ...]  # per layer: [1, H_kv, rows, D]
    values: tuple[mx.array, ...]  # per layer: [1, H_kv, rows, D]
    tokens: tuple[int, ...]
    parent_digest: str
    digest: str
    nbytes: int = field(default=0)
    # For a prefix view: the full segment whose buffers it slices (what really holds bytes).
    base: Segment | None = None
    # Merge tier (segserve.kv.merge_policy): 0 when sealed from a tail, k + 1 when made of tier-k ones.
    level: int = 0

    @staticmethod
    def seal(
        keys: Sequence[mx.array],
        values: Sequence[mx.array],
        tokens: Sequence[int],
        parent_digest: str,
        level: int = 0,
    ) -> Segment:
        toks = tuple(int(t) for t in tokens)
        ks, vs = tuple(keys), tuple(values)
        for k, v in zip(ks, vs, strict=True):
            if k.shape[2] != len(toks) or v.shape[2] != len(toks):
                raise ValueError(f"segment rows {k.shape[2]} != {len(toks)} tokens")
        nbytes = sum(k.nbytes + v.nbytes for k, v in zip(ks, vs, strict=True))
        digest = chain_digest(parent_digest, toks)
        return Segment(ks, vs, toks, parent_digest, digest, nbytes, None, level)

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def prefix(self, n: int) -> Segment:
        """A view of the first `n` rows (shares the buffers; the bytes stay owned by self)."""
        if not 0 < n <= self.rows:
            raise ValueError(f"prefix {n} outside 1..{self.rows}")
        if n == self.rows:
            return self
        ks = tuple(k[:, :, :n, :] for k in self.keys)
        vs = tuple(v[:, :, :n, :] for v in self.values)
        toks = self.tokens[:n]
        # nbytes 0: a view adds no memory; its base segment is what holds the bytes.
        base = self.base if self.base is not None else self
        digest = chain_digest(self.parent_digest, toks)
        return Segment(ks, vs, toks, self.parent_digest, digest, 0, base, self.level)

    @property
    def owner(self) -> Segment:
        """The segment that owns the buffers (itself, or the base of a view)."""
        return self.base if self.base is not None else self


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An ordered tuple of segment references. Fork = share it; rollback = an older one."""

    segments: tuple[Segment, ...] = ()

    @property
    def tokens(self) -> tuple[int, ...]:
        out: list[int] = []
        for s in self.segments:
            out.extend(s.tokens)
        return tuple(out)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def digest(self) -> str:
        return self.segments[-1].digest if self.segments else ROOT_DIGEST

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def prefix(self, n: int) -> Snapshot:
        """The first `n` rows as segment refs (the last one possibly a view): no copy."""
        if n < 0 or n > self.rows:
            raise ValueError(f"prefix {n} outside 0..{self.rows}")
        out: list[Segment] = []
        left = n
        for s in self.segments:
            if left <= 0:
                break
            out.append(s if s.rows <= left else s.prefix(left))
            left -= s.rows
        return Snapshot(tuple(out))
