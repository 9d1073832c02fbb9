"""The SSD cold tier, engine side: block refcounts, disk caps, spill, restore, quarantine.

Owns: the in-memory block table (id -> size, refcount, checksum once committed, or the
host arrays (views of the segment, `blocks.to_host`) while its write is queued), the disk byte total, the directory lock, the startup
pass (format check, temp/orphan removal, manifest GC, load), and the `Writer`.
Who calls: `bank.Bank` only, on the engine thread. File writes happen on the writer thread;
restore reads happen here (the request needs the rows now).
`segserve.bank.tier.NullColdTier` is the same interface with nothing behind it (no SSD tier);
`segserve.bank.shared_tier.SharedColdTier` overrides the layout hooks for a directory several
replicas share (it never deletes shared files and can read other replicas' blocks).

Block ids are planned from the node's scope (namespace + cache salt), so two tenants that
store the same tokens write separate blocks: the disk total a tenant can observe never
depends on what another tenant stored (no cross-tenant dedupe side channel).

Disk faults (a manifest moved aside, orphan block files kept, a failed write, a writer
job that raised, a quarantined block, a refused spill, a start-up on a full disk) are
counted by kind (`ColdStats.faults`, shown on `/health` and `/metrics`) and logged
(refused spills at most once a minute, with a count). Start-up never deletes block files
because the manifest is missing, empty or unreadable: they are moved aside for an operator
(a block file holds rows, not their tokens, so sessions cannot be rebuilt from blocks alone).

A full or failing disk is not corruption (`segserve.bank.writer.disk_fault`: ENOSPC, EDQUOT, EIO,
SQLITE_FULL, SQLITE_IOERR): nothing is moved aside for it. At start-up the manifest is then
read into memory without writing (`Manifest.read_only_copy`) and the tier serves read-only:
stored sessions restore, new ones stay in RAM, and the tier retries opening for writing
every `retry_interval_s` (`segserve.bank.disk_health` has the states and what is owed meanwhile).
When even that read fails, `open` raises `BankError` naming the directory and its free
space. While running, a write that fails on a full disk marks the tier degraded; the next
write that succeeds clears it.

Invariants (`check`):
- a block's `refs` == number of live `DiskCopy` chunks naming it; it is removed at 0;
- `disk_bytes` == sum of block sizes in the table (+ bytes of other namespaces' blocks);
- a block is served only after its bytes match the manifest checksum; a block that does
  not is moved to `quarantine/` and every copy naming it is dropped by the bank.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from segserve.kv.segment import Segment

from .blocks import (
    BlockCorrupt,
    Chunk,
    DiskCopy,
    HostRows,
    Layout,
    PlannedChain,
    decode_block,
    host_slice,
    layout_of,
    plan_chunks,
    to_host,
    to_segment,
)
from .disk_health import DiskHealth
from .index import Node
from .manifest import BlockRecord, FormatMismatch, Loaded, Manifest, SegmentRecord
from .tier import NO_SHARED, ColdStats, ReadFault, Refused, SharedPrefix, SharedRows
from .types import BankError
from .writer import (
    DropSegments,
    Failed,
    Fault,
    SaveSession,
    Writer,
    WriteSegment,
    Written,
    block_path,
    checksum,
    disk_fault,
)

log = logging.getLogger(__name__)

FAULT_KINDS = (
    "manifest_moved_aside", "orphans_kept", "write_failed", "writer_job_failed",
    "block_quarantined", "spill_refused", "disk_full_at_start",
)
# More orphan block files than this (and than live blocks) cannot be one crash's leftovers.
_MAX_CRASH_ORPHANS = 64


class EmptyManifest(Exception):
    """The manifest file exists but holds nothing (0 bytes): treated as unreadable."""


@dataclass(slots=True)
class _Block:
    nbytes: int
    refs: int
    checksum: str | None  # None until the writer reports the commit
    host: tuple[HostRows, int, int] | None  # the queued rows, while not committed


class ColdTier:
    def __init__(
        self,
        root: Path,
        *,
        max_disk_bytes: int,
        min_free_disk_bytes: int = 1 << 30,
        block_rows: int = 256,
        max_pending_bytes: int = 1 << 30,
        backlog_wait_s: float = 2.0,
        retry_interval_s: float = 30.0,
    ) -> None:
        if block_rows <= 0 or max_disk_bytes < 0 or min_free_disk_bytes < 0:
            raise ValueError("block_rows must be > 0 and byte limits >= 0")
        self.root = Path(root)
        self.max_disk_bytes = max_disk_bytes
        self.min_free_disk_bytes = min_free_disk_bytes
        self.block_rows = block_rows
        self._max_pending = max_pending_bytes
        self._backlog_wait = backlog_wait_s
        self._blocks: dict[str, _Block] = {}
        self._pending: set[DiskCopy] = set()
        self._bytes = 0
        self._foreign = 0
        self._ns = ""
        self._seq = 0
        self._writer: Writer | None = None
        self._lock_fd: int | None = None
        self._counts = {"spills": 0, "refused": 0, "failed": 0, "quarantined": 0, "lost": 0}
        self._restores = {"ssd": 0, "pending": 0}
        self._last_fault: str | None = None
        self._faults: Counter[str] = Counter(dict.fromkeys(FAULT_KINDS, 0))
        self._health = DiskHealth(self.root, probe_every_s=retry_interval_s)
        self._resumed = False

    def _fault(self, kind: str, detail: str) -> None:
        """Count and log a disk fault; `/health` shows the last one."""
        self._faults[kind] += 1
        self._last_fault = detail
        log.warning("bank cold tier: %s", detail)

    # ---- startup ------------------------------------------------------------------------
    def open(self, ns: str) -> Loaded:
        self._ns = ns
        self._check_kind()
        try:
            self._make_dirs()
            self._lock_dir()
        except OSError as e:
            if disk_fault(e) is None:
                raise
            raise BankError(self._cannot_start(e)) from e
        try:
            try:
                loaded = self._startup(ns)
            except Exception as e:
                if disk_fault(e) is None:
                    raise
                loaded = self._startup_read_only(ns, e)
        except BaseException:
            self._unlock()
            raise
        self._blocks = {b.id: _Block(b.nbytes, 0, b.checksum, None) for b in loaded.blocks.values()}
        self._bytes = sum(b.nbytes for b in self._blocks.values())
        self._foreign = loaded.foreign_bytes
        if not self._health.read_only:
            self._writer = self._new_writer()
        return loaded

    def _startup_read_only(self, ns: str, cause: Exception) -> Loaded:
        """The start-up pass on a disk too full to write: the manifest is copied into memory
        and checked there; no file is created, changed, moved or deleted."""
        path = self._manifest_path()
        try:
            manifest = Manifest.read_only_copy(path) if path.exists() else None
            if manifest is None:
                loaded, seq = Loaded((), {}, {}, 0), 0  # nothing was ever stored here
            else:
                try:
                    manifest.startup_gc(self._block_ok)  # in memory only
                    loaded, seq = manifest.load(ns), manifest.max_seq()
                finally:
                    manifest.close()
        except (sqlite3.Error, OSError, FormatMismatch) as e:
            raise BankError(self._cannot_start(cause, e)) from e
        self._seq = seq
        why = self._health.set_read_only(disk_fault(cause) or "disk fault")
        self._fault(
            "disk_full_at_start",
            f"SSD tier read-only: {why}; {len(loaded.sessions)} stored sessions can be "
            f"restored, new ones stay in RAM until space is freed (start-up: {cause})",
        )
        return loaded

    def _cannot_start(self, cause: Exception, read: Exception | None = None) -> str:
        tail = f"; reading the manifest without writing failed too: {read}" if read else ""
        return (
            f"the SSD tier in {self.root} cannot be opened: "
            f"{self._health.explain(disk_fault(cause) or 'disk fault')}: {cause}{tail}. "
            "Nothing was moved or deleted; free space there and start again"
        )

    def _try_resume(self) -> None:
        """Read-only: when space was freed, open the manifest for writing (applying the
        start-up consistency pass the read-only copy applied in memory) and start the
        writer; then queue what was owed. Still full: stay read-only, try again later."""
        try:
            manifest = Manifest(self._manifest_path())
            try:
                manifest.startup_gc(self._block_ok)
            finally:
                manifest.close()
        except Exception as e:  # noqa: BLE001 — a failed retry must not fail the request
            if disk_fault(e) is None:
                log.warning("bank cold tier: still read-only, the manifest did not open: %s", e)
            self._health.set_read_only(disk_fault(e) or "manifest not writable")
            return
        self._writer = self._new_writer()
        self._health.recovered()
        self._resumed = True
        self._submit_owed()

    def _submit_owed(self) -> None:
        for job in self._health.take_deferred():
            self._need_writer().submit(job)

    # Layout hooks: this process owns `root`. `segserve.bank.shared_tier.SharedColdTier` overrides
    # them for a directory several replicas share.
    def _check_kind(self) -> None:
        # Opened privately, a shared directory's blocks would look like orphans and be
        # moved aside at start-up, under every other replica.
        if (self.root / "replicas").is_dir():
            raise BankError(f"{self.root} is a shared SSD tier: open it as shared (--bank-shared)")

    def _make_dirs(self) -> None:
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)

    def _lock_path(self) -> Path:
        return self.root / "lock"

    def _manifest_path(self) -> Path:
        return self.root / "manifest.sqlite3"

    def _new_writer(self) -> Writer:
        return Writer(self.root, self.min_free_disk_bytes)

    def _aside_paths(self) -> list[Path]:
        """What a broken manifest is moved aside with: the blocks only it can name."""
        return [*self.root.glob("manifest.sqlite3*"), self.root / "blocks"]

    def _chains_for(
        self, node: Node, path_tokens: Sequence[int], chunks: Sequence[Chunk], layout: Layout
    ) -> tuple[PlannedChain, ...]:
        return ()  # no other replica looks blocks up here

    def _startup(self, ns: str) -> Loaded:
        """Remove temp files, make the manifest consistent, load this namespace.

        Block files no manifest row names are crash leftovers (written, never committed)
        and are removed, unless the manifest looks lost: just created, naming no block, or
        far fewer blocks than the files on disk. Then they are moved aside, never deleted.
        """
        manifest = self._open_manifest()
        try:
            for tmp in (self.root / "blocks").glob("*/*.tmp"):
                tmp.unlink(missing_ok=True)  # a write that never committed (crash)
            dropped, live = manifest.startup_gc(self._block_ok)
            orphans = [p for p in (self.root / "blocks").glob("*/*.blk") if p.stem not in live]
            suspicious = manifest.created or not live or (
                len(orphans) > _MAX_CRASH_ORPHANS and len(orphans) > len(live)
            )
            if orphans and suspicious:
                self._keep_aside(orphans, manifest.created, len(live))
            else:
                for p in orphans:
                    p.unlink(missing_ok=True)
            loaded = manifest.load(ns)
            self._seq = manifest.max_seq()
        finally:
            manifest.close()
        if dropped or (orphans and not suspicious):
            log.info(
                "bank cold tier: startup dropped %d rows, %d orphan files", dropped, len(orphans)
            )
        return loaded

    def _keep_aside(self, orphans: Sequence[Path], created: bool, live: int) -> None:
        aside = self.root / f"stale-orphans-{time.time_ns()}" / "blocks"
        for p in orphans:
            dest = aside / p.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            p.rename(dest / p.name)
        why = "the manifest was just created" if created else f"the manifest names {live} blocks"
        self._fault(
            "orphans_kept",
            f"{len(orphans)} block files no manifest row names were kept in {aside.parent} "
            f"({why}; an operator may restore the manifest or delete them)",
        )

    def track(self, copy: DiskCopy) -> None:
        """Count a loaded segment's references to its (committed) blocks."""
        for c in copy.chunks:
            self._blocks[c.block_id].refs += 1

    def _lock_dir(self) -> None:
        fd = os.open(self._lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise BankError(f"cold tier {self.root} is in use by another bank") from e
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open_manifest(self) -> Manifest:
        path = self._manifest_path()
        try:
            if path.exists() and path.stat().st_size == 0:
                raise EmptyManifest("manifest is empty (0 bytes)")
            return Manifest(path)
        except (FormatMismatch, EmptyManifest, sqlite3.DatabaseError) as e:
            if disk_fault(e) is not None:
                raise  # a full or failing disk, not a broken manifest: `open` decides
            # Never read an unknown format or a broken database, never destroy it either:
            # move it aside with the blocks it named and start empty.
            tag = (
                f"format-{e.found}" if isinstance(e, FormatMismatch)
                else "empty" if isinstance(e, EmptyManifest) else "unreadable"
            )
            aside = path.parent / f"stale-{tag}-{time.time_ns()}"
            aside.mkdir()
            for p in self._aside_paths():
                p.rename(aside / p.name)
            self._make_dirs()
            self._fault("manifest_moved_aside", f"manifest moved aside: {e}; kept in {aside}")
            return Manifest(path)

    def _block_ok(self, b: BlockRecord) -> bool:
        try:
            return block_path(self.root, b.id).stat().st_size == b.nbytes
        except OSError:
            return False

    # ---- spill ------------------------------------------------------------------------
    def spill(
        self,
        node: Node,
        segment: Segment,
        path_tokens: Sequence[int],
        make_room: Callable[[int], bool],
    ) -> DiskCopy | Refused:
        """Queue a write of the node's rows; `make_room(n)` may drop cold entries for the cap."""
        if self._writer is None:
            return self._refuse(f"read-only: {self._health.why}")
        layout = layout_of(segment)
        if layout is None:
            return self._refuse("unsupported layout")
        # Scoped ids: the same rows of two tenants are two blocks (see the module doc).
        chunks = plan_chunks(node.scope, path_tokens, node.start, node.rows, self.block_rows)
        refusal = self._admit(chunks, layout, make_room)
        if refusal is not None:
            return refusal
        # Copy to host only when some block is new: the rest is stored (or queued) already.
        new = any(c.block_id not in self._blocks for c in chunks)
        host = to_host(segment, layout) if new else None
        copy = DiskCopy(chunks, layout)
        data: dict[str, tuple[HostRows, int, int]] = {}
        r0 = 0
        for c in chunks:
            blk = self._blocks.get(c.block_id)
            if blk is None:
                assert host is not None
                blk = _Block(layout.block_file_bytes(c.rows), 0, None, (host, r0, r0 + c.rows))
                self._blocks[c.block_id] = blk
                self._bytes += blk.nbytes
            if blk.checksum is None and blk.host is not None:
                data[c.block_id] = blk.host  # written by whichever queued job gets there first
            blk.refs += 1
            r0 += c.rows
        rec = SegmentRecord(
            node.scope, self._ns, node.digest, node.parent_digest, node.tokens, layout, chunks
        )
        self._pending.add(copy)
        self._health.forget_drop((node.scope, node.digest))
        held = sum(a.nbytes for a in (*host.keys, *host.values)) if host is not None else 0
        chains = self._chains_for(node, path_tokens, chunks, layout)
        self._need_writer().submit(WriteSegment(rec, data, copy, held, chains))
        self._counts["spills"] += 1
        return copy

    def _admit(
        self, chunks: Sequence[Chunk], layout: Layout, make_room: Callable[[int], bool]
    ) -> Refused | None:
        """Disk cap, free-disk floor and write backlog checks for a spill; None = go."""
        new_bytes = self._new_bytes(chunks, layout)
        if self.over_cap(new_bytes):
            if not make_room(new_bytes):
                return self._refuse("disk cap")
            # Making room may have dropped blocks this copy would have shared: recount.
            new_bytes = self._new_bytes(chunks, layout)
            if self.over_cap(new_bytes):
                return self._refuse("disk cap")
        writer = self._need_writer()
        free = shutil.disk_usage(self.root).free - writer.pending()[1]
        if free - new_bytes < self.min_free_disk_bytes:
            self._health.degrade("disk floor")
            return self._refuse("disk floor")
        if not writer.wait_backlog(self._max_pending, self._backlog_wait):
            return self._refuse("writer backlog")
        return None

    def _new_bytes(self, chunks: Sequence[Chunk], layout: Layout) -> int:
        return sum(
            layout.block_file_bytes(c.rows) for c in chunks if c.block_id not in self._blocks
        )

    def over_cap(self, extra: int) -> bool:
        return self._bytes + self._foreign + extra > self.max_disk_bytes

    def _refuse(self, reason: str) -> Refused:
        """Count and (rate-limited) log a refused spill: its session stays RAM-only."""
        self._counts["refused"] += 1
        self._faults["spill_refused"] += 1
        self._last_fault = f"spill refused: {reason}"
        self._health.refused(reason)
        return Refused(reason)

    # ---- restore ----------------------------------------------------------------------
    def read(self, node: Node, copy: DiskCopy) -> Segment | ReadFault:
        """Rows of one stored segment as one Segment: queued host arrays or verified files."""
        parts: list[HostRows] = []
        from_file = False
        for c in copy.chunks:
            blk = self._blocks[c.block_id]
            if blk.checksum is None:
                assert blk.host is not None
                host, r0, r1 = blk.host
                parts.append(host_slice(host, r0, r1))
                continue
            got = self._read_block(c.block_id, blk.nbytes, blk.checksum)
            if isinstance(got, str):
                return ReadFault(c.block_id, got)
            try:
                parts.append(decode_block(got, copy.layout, c.rows))
            except BlockCorrupt as e:
                return ReadFault(c.block_id, str(e))
            from_file = True
        seg = to_segment(parts, copy.layout, node.tokens, node.parent_digest)
        if seg.digest != node.digest:
            raise BankError(f"restored segment digest {seg.digest} != {node.digest}")
        self._restores["ssd" if from_file else "pending"] += 1
        return seg

    def _read_block(self, block_id: str, nbytes: int, expect: str) -> bytes | str:
        try:
            data = block_path(self.root, block_id).read_bytes()
        except OSError as e:
            return f"unreadable: {e.strerror or e}"
        if len(data) != nbytes:
            return f"truncated: {len(data)} of {nbytes} bytes"
        if checksum(data) != expect:
            return "checksum mismatch"
        return data

    def shared_prefix(self, scope: str, tokens: Sequence[int], have: int) -> SharedPrefix:
        return NO_SHARED  # this directory is private: no other replica's blocks to find

    def read_shared(
        self, found: SharedPrefix, tokens: Sequence[int], start: int, stop: int, parent: str
    ) -> SharedRows:
        raise BankError("not a shared SSD tier: nothing shared to read")

    def quarantine(self, block_id: str, reason: str) -> None:
        """Move a bad block aside (kept for inspection, never served again)."""
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        try:
            block_path(self.root, block_id).rename(qdir / f"{block_id}.{time.time_ns()}.blk")
        except FileNotFoundError:
            pass
        self._counts["quarantined"] += 1
        self._fault("block_quarantined", f"block {block_id} quarantined: {reason}")

    # ---- bookkeeping ------------------------------------------------------------------
    def release(self, copy: DiskCopy) -> None:
        """The bank no longer uses this copy: drop its block refs (files go with `drop`)."""
        self._pending.discard(copy)
        for c in copy.chunks:
            blk = self._blocks[c.block_id]
            blk.refs -= 1
            if blk.refs == 0:
                del self._blocks[c.block_id]
                self._bytes -= blk.nbytes

    def drop(self, keys: Sequence[tuple[str, str]]) -> None:
        if keys:
            self._queue(DropSegments(tuple(keys)))

    def save_session(self, scope: str, sid: str, paths: Sequence[tuple[str, ...]]) -> None:
        self._seq += 1
        job = SaveSession(scope, self._ns, sid, self._seq, tuple(paths))
        self._health.saved(job)
        self._queue(job)

    def _queue(self, job: SaveSession | DropSegments) -> None:
        if self._writer is None:
            self._health.defer(job)  # read-only: written once the tier writes again
        else:
            self._writer.submit(job)

    def poll(self) -> list[Failed]:
        """Apply writer results; return the failed copies the bank must drop."""
        failed: list[Failed] = []
        if self._writer is None and self._health.probe_due():
            self._try_resume()
        if self._writer is None:
            return failed  # read-only: nothing queued
        for ev in self._writer.poll():
            if isinstance(ev, Fault):
                self._fault("writer_job_failed", ev.reason)
                if ev.disk_fault is not None and isinstance(ev.job, SaveSession | DropSegments):
                    self._health.degrade(ev.disk_fault)
                    self._health.defer(ev.job)  # queued again when a write succeeds
            elif ev.copy not in self._pending:
                continue  # released while queued: its blocks may belong to newer copies now
            elif isinstance(ev, Written):
                self._pending.discard(ev.copy)
                for b in ev.blocks:
                    blk = self._blocks.get(b.id)
                    if blk is not None and blk.checksum is None:
                        blk.checksum, blk.host, blk.nbytes = b.checksum, None, b.nbytes
                if self._health.recovered():
                    self._resumed = True
                    self._submit_owed()
            else:
                self._pending.discard(ev.copy)
                self._counts["failed"] += 1
                self._fault("write_failed", f"write failed: {ev.reason}")
                if ev.disk_fault is not None:
                    self._health.degrade(ev.disk_fault)
                failed.append(ev)
        return failed

    def resumed(self) -> bool:
        """True once after writing works again (the bank re-spills its RAM-only rows)."""
        got, self._resumed = self._resumed, False
        return got

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait for queued writes (tests, shutdown); results are applied by the next poll."""
        return self._writer.flush(timeout) if self._writer is not None else True

    def writer_queue(self) -> tuple[int, int]:
        """(writer jobs queued or running, host bytes they hold), read now; safe from any
        thread (the HTTP side reads it for `/health`; the rest of this object is not)."""
        writer = self._writer  # one read: close() may clear it meanwhile
        return writer.pending() if writer is not None else (0, 0)

    def stats(self) -> ColdStats:
        jobs, held = self.writer_queue()
        c = self._counts
        return ColdStats(
            self._bytes + self._foreign,
            c["spills"],
            c["refused"],
            c["failed"],
            dict(self._restores),
            c["quarantined"],
            jobs,
            held,
            c["lost"],
            self._last_fault,
            dict(self._faults),
            self._health.describe(),
        )

    def check(self, copies: Sequence[DiskCopy]) -> None:
        refs: dict[str, int] = {}
        for copy in copies:
            for c in copy.chunks:
                refs[c.block_id] = refs.get(c.block_id, 0) + 1
        got = {i: b.refs for i, b in self._blocks.items()}
        if refs != got:
            raise BankError(f"block refcounts disagree: {len(refs)} used vs {len(got)} tracked")
        if self._bytes != sum(b.nbytes for b in self._blocks.values()):
            raise BankError("disk byte total disagrees with the block table")
        for b in self._blocks.values():
            if (b.checksum is None) == (b.host is None):
                raise BankError("a block is neither committed nor queued (or both)")

    def close(self, timeout: float) -> int:
        if self._writer is None and self._health.read_only:
            self._try_resume()  # one last chance for what read-only mode owes the manifest
        elif self._writer is not None and self._health.owed:
            self._submit_owed()  # degraded: space may have come back since
        lost = self._writer.close(timeout) if self._writer is not None else 0
        self._writer = None
        if self._health.owed:
            log.error(
                "bank cold tier: %d session changes not written (%s): the manifest keeps "
                "their earlier state", self._health.owed, self._health.describe(),
            )
            lost += len(self._health.take_deferred())
        self._counts["lost"] += lost
        self._unlock()
        return lost

    def _need_writer(self) -> Writer:
        if self._writer is None:
            raise BankError("cold tier is not open (or already closed)")
        return self._writer
