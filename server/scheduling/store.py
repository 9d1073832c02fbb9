"""The scheduler's view of the session store: the protocol it calls, and what a lookup gives.

Owns: `SnapshotStore` and `LookupHit` (both Protocols: the session bank, `segserve.bank.Bank`,
and its `LookupResult` satisfy them as they are, so the bank imports nothing from the
server) and `reusable_tokens` (the one place of the rule "reuse at most len - 1 tokens").
Engine thread only. Model-free: snapshots are opaque here (`segserve.kv.segment.Snapshot`
is imported for types only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from segserve.kv.segment import Snapshot


def reusable_tokens(prompt_tokens: int) -> int:
    """At most this many prompt tokens may come from the store: the last prompt token must
    still run to give the logits of the first generated token (vLLM caps hits the same way)."""
    return max(0, prompt_tokens - 1)


class LookupHit(Protocol):
    """What the scheduler reads of a lookup; read-only."""

    @property
    def snapshot(self) -> Snapshot:
        """The reused rows, already cut to `reused_tokens` (empty on a miss)."""
        ...

    @property
    def reused_tokens(self) -> int: ...

    @property
    def kind(self) -> str:
        """"session" | "prefix" | "miss"."""
        ...

    @property
    def restore_rows_from_ssd(self) -> int:
        """Reused rows the lookup read back from SSD (priced by admission)."""
        ...


class SnapshotStore(Protocol):
    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None, max_reuse: int
    ) -> LookupHit:
        """The longest stored prefix of `tokens` (at most `max_reuse` of them). Only an
        explicit id continues a session; a prefix hit starts a new one that shares the
        matched segments (clients that resend history send no id)."""
        ...

    def continue_session(
        self, session_id: str, turn: int | None, *, salt: str | None, new_id: str
    ) -> bool:
        """Fork turns 0..`turn` of `session_id` into the new session `new_id` (shared by
        reference); False when the source is gone or `new_id` exists."""
        ...

    def put(self, session_id: str | None, snapshot: Snapshot, *, salt: str | None) -> str | None:
        """Store the snapshot as the session's next turn; returns the session id (new if
        None). Called only with a snapshot that grew past what its request reused, so
        never with an empty one."""
        ...

    def pin(self, snapshot: Snapshot) -> None: ...

    def unpin(self, snapshot: Snapshot) -> None: ...

    def ram_bytes(self) -> int: ...

    def evictable_bytes(self) -> int:
        """RAM bytes that may be spilled or dropped now (pinned snapshots excluded)."""
        ...

    def release(self, bytes_wanted: int, /) -> int:
        """Spill or drop idle entries until `bytes_wanted` are released; returns bytes freed."""
        ...
