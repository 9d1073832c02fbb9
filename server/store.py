"""The engine's view of the session store, and a small in-memory one.

Owns: `SnapshotStore` (Protocol the engine calls), `LookupHit`, and `RecentSnapshots`, a
simple in-memory store (bounded count, longest common token prefix) used until / unless
the session bank (`bank/`) is configured. Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kv.segment import Snapshot


@dataclass(frozen=True, slots=True)
class LookupHit:
    snapshot: Snapshot  # already cut to `reused_tokens` rows
    reused_tokens: int
    kind: str  # "session" | "prefix" | "miss"
    session_id: str | None
    restore_tokens: int = 0  # reused rows that are on SSD and must be read back first
    ref: object | None = None  # the store's own handle for `materialize`

    def cut(self, n: int) -> LookupHit:
        """The same hit reusing only the first `n` tokens."""
        return LookupHit(
            self.snapshot.prefix(min(n, self.snapshot.rows)), n, self.kind, self.session_id,
            min(self.restore_tokens, n), self.ref,
        )


class SnapshotStore(Protocol):
    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None
    ) -> LookupHit: ...

    def put(self, session_id: str, snapshot: Snapshot, *, salt: str | None) -> None: ...

    def pin(self, snapshot: Snapshot) -> None: ...

    def unpin(self, snapshot: Snapshot) -> None: ...

    def live_segments(self) -> dict[int, int]:
        """id(owner segment) -> bytes, for every segment the store keeps alive."""
        ...

    def materialize(self, hit: LookupHit) -> LookupHit:
        """Bring a hit's SSD rows into RAM segments (after admission priced them)."""
        ...

    def ram_bytes(self) -> int: ...

    def evictable_bytes(self) -> int: ...

    def ensure_free(self, nbytes: int) -> int:
        """Spill or drop idle entries until `nbytes` are released; returns bytes freed."""
        ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RecentSnapshots:
    """Keeps the latest snapshot per session id (at most `max_entries`, LRU)."""

    def __init__(self, max_entries: int = 64) -> None:
        self._entries: OrderedDict[tuple[str | None, str], Snapshot] = OrderedDict()
        self._max = max_entries
        self._pins: dict[int, int] = {}

    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None
    ) -> LookupHit:
        best: tuple[int, str | None, Snapshot | None] = (0, None, None)
        for (s, sid), snap in self._entries.items():
            if s != salt or (session_id is not None and sid != session_id):
                continue
            n = common_prefix(snap.tokens, tokens)
            if n > best[0]:
                best = (n, sid, snap)
        n, sid, snap = best
        if snap is None:
            return LookupHit(Snapshot(), 0, "miss", None)
        self._entries.move_to_end((salt, sid or ""))
        kind = "session" if session_id is not None else "prefix"
        return LookupHit(snap.prefix(n), n, kind, sid)

    def put(self, session_id: str, snapshot: Snapshot, *, salt: str | None) -> None:
        self._entries[(salt, session_id)] = snapshot
        self._entries.move_to_end((salt, session_id))
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def pin(self, snapshot: Snapshot) -> None:
        for seg in snapshot.segments:
            self._pins[id(seg.owner)] = self._pins.get(id(seg.owner), 0) + 1

    def unpin(self, snapshot: Snapshot) -> None:
        for seg in snapshot.segments:
            k = id(seg.owner)
            self._pins[k] -= 1
            if self._pins[k] == 0:
                del self._pins[k]

    def materialize(self, hit: LookupHit) -> LookupHit:
        return hit  # RAM only

    def ram_bytes(self) -> int:
        return sum(self.live_segments().values())

    def evictable_bytes(self) -> int:
        return sum(b for k, b in self.live_segments().items() if k not in self._pins)

    def ensure_free(self, nbytes: int) -> int:
        freed = 0
        for key in list(self._entries):
            if freed >= nbytes:
                break
            before = self.ram_bytes()
            snap = self._entries[key]
            if any(id(s.owner) in self._pins for s in snap.segments):
                continue
            del self._entries[key]
            freed += before - self.ram_bytes()
        return freed

    def live_segments(self) -> dict[int, int]:
        return {id(s.owner): s.owner.nbytes for snap in self._entries.values() for s in snap.segments}
