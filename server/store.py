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
        pass

    def unpin(self, snapshot: Snapshot) -> None:
        pass

    def live_segments(self) -> dict[int, int]:
        return {id(s.owner): s.owner.nbytes for snap in self._entries.values() for s in snap.segments}
