"""The RAM tier's byte accounting: owners held by stored segments, and pins.

Owns: per owner segment (the one whose buffers hold the bytes; a prefix view's owner is its
base) how many stored nodes hold it and how many pins protect it; the RAM byte total and
the protected (pinned) byte total, both kept up to date on every change so admission can
price memory in O(1).
Who mutates: `bank.Bank` only, on the engine thread (`hold`/`release` when a node gains or
loses its RAM copy, `pin`/`unpin` for snapshots a running request uses).

Invariants (`check`):
- `bytes` == sum of `owner.nbytes` over owners held by >= 1 node: a buffer shared by
  branches, views and scopes is counted once;
- `protected` == the same sum over held owners with pins > 0; 0 <= protected <= bytes;
- node and pin counts are >= 0 and an entry with both at 0 is removed.
Entries keep a reference to the owner, so an `id()` key cannot be reused while present.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from segserve.kv.segment import Segment

from .types import BankError


@dataclass(slots=True)
class _Owner:
    segment: Segment
    nodes: int = 0
    pins: int = 0


class RamTier:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.protected = 0
        self._owners: dict[int, _Owner] = {}

    def room(self) -> int:
        return self.max_bytes - self.bytes

    def hold(self, seg: Segment) -> None:
        e = self._entry(seg.owner)
        e.nodes += 1
        if e.nodes == 1:
            self.bytes += e.segment.nbytes
            if e.pins:
                self.protected += e.segment.nbytes

    def release(self, seg: Segment) -> None:
        e = self._owners.get(id(seg.owner))
        if e is None or e.nodes == 0:
            raise BankError("release of a segment the RAM tier does not hold")
        e.nodes -= 1
        if e.nodes == 0:
            self.bytes -= e.segment.nbytes
            if e.pins:
                self.protected -= e.segment.nbytes
        self._gc(e)

    def pin(self, seg: Segment) -> None:
        e = self._entry(seg.owner)
        e.pins += 1
        if e.pins == 1 and e.nodes:
            self.protected += e.segment.nbytes

    def unpin(self, seg: Segment) -> None:
        e = self._owners.get(id(seg.owner))
        if e is None or e.pins == 0:
            raise BankError("unpin of a segment that is not pinned")
        e.pins -= 1
        if e.pins == 0 and e.nodes:
            self.protected -= e.segment.nbytes
        self._gc(e)

    def is_pinned(self, seg: Segment) -> bool:
        e = self._owners.get(id(seg.owner))
        return e is not None and e.pins > 0

    def pinned_owners(self) -> int:
        return sum(1 for e in self._owners.values() if e.pins)

    def check(self, held: Iterable[Segment]) -> None:
        counts: dict[int, int] = {}
        owners: dict[int, Segment] = {}
        for seg in held:
            counts[id(seg.owner)] = counts.get(id(seg.owner), 0) + 1
            owners[id(seg.owner)] = seg.owner
        got = {k: e.nodes for k, e in self._owners.items() if e.nodes}
        if counts != got:
            raise BankError(f"RAM holders disagree: {len(counts)} owners held, {len(got)} tracked")
        want_bytes = sum(o.nbytes for o in owners.values())
        want_prot = sum(o.nbytes for k, o in owners.items() if self._owners[k].pins)
        if (self.bytes, self.protected) != (want_bytes, want_prot):
            raise BankError(
                f"RAM bytes {self.bytes}/{self.protected} != recount {want_bytes}/{want_prot}"
            )
        if any(e.nodes < 0 or e.pins < 0 or not (e.nodes or e.pins) for e in self._owners.values()):
            raise BankError("an owner entry has a negative or all-zero count")

    def _entry(self, owner: Segment) -> _Owner:
        e = self._owners.get(id(owner))
        if e is None:
            e = self._owners[id(owner)] = _Owner(owner)
        return e

    def _gc(self, e: _Owner) -> None:
        if e.nodes == 0 and e.pins == 0:
            del self._owners[id(e.segment)]
