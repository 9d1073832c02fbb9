"""The scheduler's view of the session store: the protocol it calls, and a lookup result.

Owns: `SnapshotStore` (the Protocol), `LookupHit` and `reusable_tokens` (the one place of the
rule "reuse at most len - 1 tokens"). The implementation is
`segserve.server.engine.bank_store.BankStore` over the session bank. Engine thread only.
Model-free: snapshots are opaque here (`segserve.kv.segment.Snapshot` is imported for types only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from segserve.kv.segment import Snapshot


def reusable_tokens(prompt_tokens: int) -> int:
    """At most this many prompt tokens may come from the store: the last prompt token must
    still run to give the logits of the first generated token (vLLM caps hits the same way)."""
    return max(0, prompt_tokens - 1)


@dataclass(frozen=True, slots=True)
class LookupHit:
    snapshot: Snapshot  # already cut to `reused_tokens` rows
    reused_tokens: int
    kind: str  # "session" | "prefix" | "miss"
    session_id: str | None
    restore_tokens: int = 0  # reused rows the lookup read back from SSD (priced by admission)


class SnapshotStore(Protocol):
    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None, max_reuse: int
    ) -> LookupHit:
        """The longest stored prefix of `tokens` (at most `max_reuse` of them)."""
        ...

    def put(self, session_id: str | None, snapshot: Snapshot, *, salt: str | None) -> str | None:
        """Store the snapshot as the session's next turn; returns the session id (new if None)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def pin(self, snapshot: Snapshot) -> None: ...

    def unpin(self, snapshot: Snapshot) -> None: ...

    def ram_bytes(self) -> int: ...

    def evictable_bytes(self) -> int:
        """RAM bytes that may be spilled or dropped now (pinned snapshots excluded)."""
        ...

    def ensure_free(self, nbytes: int) -> int:
        """Spill or drop idle entries until `nbytes` are released; returns bytes freed."""
        ...
