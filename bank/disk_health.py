"""Whether the SSD cold tier can write now, and what it owes the disk once it can again.

Owns: `DiskHealth` (the tier's write state, its one-line description for `/health`, the
rate limit of the "spills refused" log line, and the manifest jobs a full disk refused).
Who calls: `segserve.bank.cold.ColdTier`, on the engine thread only.

States (`describe()` is what `/health` shows as `bank.cold_tier`):
- "read-write": writes are expected to succeed;
- "degraded: <why>": the writer runs but the last write failed on a full disk (or a spill
  was refused by the free-disk floor). Writes go on being attempted; the first one that
  succeeds returns the tier to "read-write";
- "read-only: <why>": the manifest could not be opened for writing at start-up (full
  disk). Stored sessions are served from the blocks; nothing is written. Every
  `probe_every_s` the tier tries to open the manifest for writing again and, when that
  works, starts its writer (see `ColdTier._try_resume`).

Manifest jobs (session saves, segment drops) that a full disk refused, or that were made
while read-only, are kept here (`defer`) and queued again once writing works (`take_deferred`):
a session changed during the fault is stored when space returns, not forgotten. Only the
newest save of each session is queued again (an older one would overwrite it).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from .writer import DropSegments, SaveSession

log = logging.getLogger("segserve.bank.cold")

Deferred = SaveSession | DropSegments


class DiskHealth:
    def __init__(
        self,
        root: Path,
        *,
        log_every_s: float = 60.0,
        probe_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.state = "read-write"
        self.why = ""
        self._log_every = log_every_s
        self._probe_every = probe_every_s
        self._clock = clock
        self._next_probe = 0.0
        self._logged_at: float | None = None
        self._unlogged = 0
        self._deferred: list[Deferred] = []
        self._latest_seq: dict[tuple[str, str], int] = {}

    # ---- state ----------------------------------------------------------------------------
    def describe(self) -> str:
        return self.state if self.state == "read-write" else f"{self.state}: {self.why}"

    @property
    def read_only(self) -> bool:
        return self.state == "read-only"

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def explain(self, fault: str) -> str:
        """`fault` ("ENOSPC", "SQLITE_FULL", "disk floor", ...) with the free space now."""
        free = self.free_bytes()
        where = f"{free} bytes free in {self.root}" if free is not None else f"in {self.root}"
        what = "below the free-disk floor" if fault == "disk floor" else f"disk full: {fault}"
        return f"{what} ({where})"

    def set_read_only(self, fault: str) -> str:
        self.state, self.why = "read-only", self.explain(fault)
        self._next_probe = self._clock() + self._probe_every
        return self.why

    def degrade(self, fault: str) -> None:
        if self.state == "read-write":
            log.warning(
                "bank cold tier: writes are failing (%s); new sessions stay in RAM until a "
                "write succeeds", self.explain(fault),
            )
        if self.state != "read-only":
            self.state, self.why = "degraded", self.explain(fault)

    def recovered(self) -> bool:
        """A write succeeded (or the writer started again): True when that ends a fault."""
        if self.state == "read-write":
            return False
        log.warning("bank cold tier: writing again (was %s)", self.describe())
        self.state, self.why = "read-write", ""
        return True

    def probe_due(self) -> bool:
        """Read-only and time to try writing again (rate-limited: opening costs IO)."""
        if not self.read_only or self._clock() < self._next_probe:
            return False
        self._next_probe = self._clock() + self._probe_every
        return True

    # ---- refused spills --------------------------------------------------------------------
    def refused(self, reason: str) -> None:
        """Log refused spills: the first at once, then one line per `log_every_s` with the
        count since the last line (a full disk refuses every turn)."""
        self._unlogged += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < self._log_every:
            return
        log.warning(
            "bank cold tier: %d spill(s) refused (last: %s); those sessions are kept in RAM "
            "only and are lost at restart unless the tier writes again (tier %s)",
            self._unlogged, reason, self.describe(),
        )
        self._logged_at, self._unlogged = now, 0

    # ---- manifest jobs owed ----------------------------------------------------------------
    def saved(self, job: SaveSession) -> None:
        """Every session save the tier makes passes here, queued or deferred."""
        self._latest_seq[(job.scope, job.sid)] = job.seq

    def defer(self, job: Deferred) -> None:
        self._deferred.append(job)

    def forget_drop(self, key: tuple[str, str]) -> None:
        """A segment is being written again: an owed drop of it must not delete the new copy."""
        kept: list[Deferred] = []
        for job in self._deferred:
            if isinstance(job, DropSegments) and key in job.keys:
                keys = tuple(k for k in job.keys if k != key)
                if keys:
                    kept.append(DropSegments(keys))
            else:
                kept.append(job)
        self._deferred = kept

    def take_deferred(self) -> list[Deferred]:
        """The owed jobs in their order, each session's newest save only."""
        jobs, self._deferred = self._deferred, []
        return [
            j for j in jobs
            if not isinstance(j, SaveSession) or self._latest_seq.get((j.scope, j.sid)) == j.seq
        ]

    @property
    def owed(self) -> int:
        return len(self._deferred)
