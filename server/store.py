"""The engine's view of the session store, and a small in-memory one.

Owns: `SnapshotStore` (the Protocol the engine calls) and `LookupHit`. The implementation
is `server.bank_store.BankStore` over the session bank. Engine thread only.
"""

from __future__ import annotations

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
    restore_tokens: int = 0  # reused rows the lookup read back from SSD (priced by admission)

    def cut(self, n: int) -> LookupHit:
        """The same hit reusing only the first `n` tokens."""
        return LookupHit(
            self.snapshot.prefix(min(n, self.snapshot.rows)), n, self.kind, self.session_id,
            min(self.restore_tokens, n),
        )


class SnapshotStore(Protocol):
    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None
    ) -> LookupHit: ...

    def put(self, session_id: str | None, snapshot: Snapshot, *, salt: str | None) -> str | None:
        """Store the snapshot as the session's next turn; returns the session id (new if None)."""
        ...

    def stats(self) -> dict[str, object]: ...

    def pin(self, snapshot: Snapshot) -> None: ...

    def unpin(self, snapshot: Snapshot) -> None: ...

    def ram_bytes(self) -> int: ...

    def evictable_bytes(self) -> int: ...

    def ensure_free(self, nbytes: int) -> int:
        """Spill or drop idle entries until `nbytes` are released; returns bytes freed."""
        ...
