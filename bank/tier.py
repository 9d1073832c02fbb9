"""The cold-tier interface the bank programs against, and the tier that stores nothing.

Owns: `ColdStore` (the protocol `segserve.bank.store.Store` calls), the small result values of a
cold tier (`Refused`, `ReadFault`, `ColdStats`) and `NullColdTier` (no SSD configured: the
feature is this object, not a flag checked elsewhere).
Who calls: the engine thread only (through `segserve.bank.store.Store`).
Invariants: `NullColdTier` never holds a disk copy, so `spill` always refuses and `read`,
`track`, `release` are never reached (they raise if they are: a bank bug).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from segserve.kv.segment import Segment

from .blocks import DiskCopy
from .index import Node
from .manifest import Loaded
from .shared import ChainEntry
from .types import BankError
from .writer import Failed

_EMPTY = Loaded((), {}, {}, 0)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


@dataclass(frozen=True, slots=True)
class ReadFault:
    block_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """What a shared SSD tier holds for a prompt: verified chain entries of its first
    full aligned blocks (`segserve.bank.shared.probe`); empty without a shared tier."""

    entries: tuple[ChainEntry, ...] = ()
    block_rows: int = 0

    @property
    def rows(self) -> int:
        return len(self.entries) * self.block_rows


@dataclass(frozen=True, slots=True)
class SharedRows:
    """Prompt rows read from the shared tier: `segment` (None when none could be read)
    and the fault that stopped the read early, if any."""

    segment: Segment | None
    fault: ReadFault | None = None


NO_SHARED = SharedPrefix()


@dataclass(frozen=True, slots=True)
class ColdStats:
    disk_bytes: int = 0
    spills: int = 0
    spills_refused: int = 0
    spill_failures: int = 0
    restores_by_tier: dict[str, int] = field(default_factory=dict)
    quarantined_blocks: int = 0
    writes_pending: int = 0
    write_queue_bytes: int = 0  # host (numpy) copies held by queued writes
    writes_lost: int = 0
    last_fault: str | None = None
    faults: dict[str, int] = field(default_factory=dict)  # disk faults by kind
    # "read-write", "degraded: <why>", "read-only: <why>" (`segserve.bank.disk_health`), "off".
    state: str = "off"


class ColdStore(Protocol):
    def open(self, ns: str) -> Loaded: ...
    def track(self, copy: DiskCopy) -> None: ...
    def spill(
        self,
        node: Node,
        segment: Segment,
        path_tokens: Sequence[int],
        make_room: Callable[[int], bool],
    ) -> DiskCopy | Refused: ...
    def read(self, node: Node, copy: DiskCopy) -> Segment | ReadFault: ...
    def release(self, copy: DiskCopy) -> None: ...
    def drop(self, keys: Sequence[tuple[str, str]]) -> None: ...
    def save_session(self, scope: str, sid: str, paths: Sequence[tuple[str, ...]]) -> None: ...
    def quarantine(self, block_id: str, reason: str) -> None: ...
    def shared_prefix(self, scope: str, tokens: Sequence[int], have: int) -> SharedPrefix: ...
    def read_shared(
        self, found: SharedPrefix, tokens: Sequence[int], start: int, stop: int, parent: str
    ) -> SharedRows: ...
    def poll(self) -> list[Failed]: ...
    def resumed(self) -> bool: ...  # once, after a disk fault ended: re-spill RAM-only rows
    def over_cap(self, extra: int) -> bool: ...
    def stats(self) -> ColdStats: ...
    def writer_queue(self) -> tuple[int, int]: ...  # any thread: (jobs, host bytes) now
    def flush(self, timeout: float) -> bool: ...
    def check(self, copies: Sequence[DiskCopy]) -> None: ...
    def close(self, timeout: float) -> int: ...


class NullColdTier:
    """No SSD tier: nothing is ever stored, so eviction drops and lookups never restore."""

    def open(self, ns: str) -> Loaded:
        return _EMPTY

    def track(self, copy: DiskCopy) -> None:
        raise BankError("no cold tier: nothing to track")

    def spill(
        self,
        node: Node,
        segment: Segment,
        path_tokens: Sequence[int],
        make_room: Callable[[int], bool],
    ) -> DiskCopy | Refused:
        return Refused("no cold tier")

    def read(self, node: Node, copy: DiskCopy) -> Segment | ReadFault:
        raise BankError("no cold tier: nothing to read")

    def release(self, copy: DiskCopy) -> None:
        raise BankError("no cold tier: nothing to release")

    def drop(self, keys: Sequence[tuple[str, str]]) -> None:
        pass

    def save_session(self, scope: str, sid: str, paths: Sequence[tuple[str, ...]]) -> None:
        pass

    def quarantine(self, block_id: str, reason: str) -> None:
        pass

    def shared_prefix(self, scope: str, tokens: Sequence[int], have: int) -> SharedPrefix:
        return NO_SHARED

    def read_shared(
        self, found: SharedPrefix, tokens: Sequence[int], start: int, stop: int, parent: str
    ) -> SharedRows:
        raise BankError("no cold tier: nothing shared to read")

    def poll(self) -> list[Failed]:
        return []

    def resumed(self) -> bool:
        return False

    def over_cap(self, extra: int) -> bool:
        return False

    def stats(self) -> ColdStats:
        return ColdStats()

    def writer_queue(self) -> tuple[int, int]:
        return 0, 0

    def flush(self, timeout: float) -> bool:
        return True

    def check(self, copies: Sequence[DiskCopy]) -> None:
        if copies:
            raise BankError("disk copies exist without a cold tier")

    def close(self, timeout: float) -> int:
        return 0
