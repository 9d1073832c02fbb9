"""Result types and errors of the session bank.

Owns: the frozen values the bank returns (`LookupResult`, `SessionInfo`, `BankStats`) and
the one error hierarchy (`BankError` and its subclasses).
Who mutates: nobody; every value is frozen. The bank builds them on the engine thread and
any thread may read them.
Invariants: no `-1` sentinels (absent is `None` or an empty mapping); ordinary misses are a
`LookupResult` with `kind == "miss"`, never an exception. Exceptions are for real faults:
an unknown session id named by the caller, a malformed snapshot, a broken invariant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from segserve.kv.segment import Snapshot

Kind = Literal["session", "prefix", "miss"]
# Where the reused rows came from: all RAM, some restored from the SSD tier, or nothing.
Tier = Literal["ram", "ssd", "none"]
# Where a session's latest turn lives now.
Residency = Literal["ram", "ssd", "mixed"]


class BankError(Exception):
    """A real fault in the bank or in how it was called (not an ordinary miss)."""


class SessionNotFound(BankError, KeyError):
    """A session id named by the caller (fork/delete/info/put turn) is not stored."""


class InvariantViolation(BankError):
    """`check_invariants()` found bookkeeping that disagrees with itself (a bug)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """What `Bank.lookup` found for a request's token ids.

    `snapshot` holds exactly `reused_tokens` rows (its last segment may be a prefix view);
    pin it before running the request. `restore_rows_from_ssd` rows were read from the
    cold tier by this lookup (the admission price includes them).
    """

    snapshot: Snapshot
    reused_tokens: int
    kind: Kind
    tier: Tier
    miss_reason: str | None
    restore_rows_from_ssd: int
    session_id: str | None = None  # the session that matched (kind == "session")
    turn: int | None = None  # index of the matched turn within that session
    # Why fewer rows were reused than matched (RAM full for a restore, a quarantined block).
    degraded: str | None = None


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: str
    turns: int
    tokens: int  # tokens of the latest turn
    segments: int  # segments of the latest turn
    bytes: int  # logical KV bytes of the latest turn (shared segments counted in full)
    tier: Residency


@dataclass(frozen=True, slots=True)
class BankStats:
    sessions: int
    entries: int  # stored turn snapshots over all sessions
    segments: int  # distinct stored segments (tree nodes)
    bytes_by_tier: Mapping[str, int]  # "ram": owner bytes held; "ssd": block bytes on disk
    rows_by_tier: Mapping[str, int]  # "ram": rows of owners held (views once); "ssd": rows on disk
    protected_bytes: int  # RAM bytes pinned by running requests
    evictable_bytes: int  # RAM bytes that eviction may free
    max_bytes: int
    hits_by_kind: Mapping[str, int]
    misses: int
    evictions_by_reason: Mapping[str, int]
    spills: int  # segment writes queued to the cold tier
    spills_refused: int  # writes refused (disk floor, disk cap, layout, backlog)
    spill_failures: int  # writes that failed on the writer thread (ENOSPC, IO error)
    restores_by_tier: Mapping[str, int]  # segments restored: "ssd" file, "pending" queue
    quarantined_blocks: int
    writes_pending: int
    write_queue_bytes: int  # host memory held by queued SSD writes (not in bytes_by_tier)
    writes_lost: int  # queued writes abandoned by close(timeout)
    last_miss_reason: str | None
    last_fault: str | None  # most recent logged cold-tier fault (quarantine, failure)
    # Disk faults by kind: manifest_moved_aside, orphans_kept, write_failed,
    # writer_job_failed, block_quarantined, spill_refused, disk_full_at_start.
    disk_faults: Mapping[str, int]
    # Whether the SSD tier writes: "read-write", "degraded: <why>", "read-only: <why>"
    # (a full disk; see `segserve.bank.disk_health`), or "off" (no SSD tier).
    cold_tier: str = "off"
