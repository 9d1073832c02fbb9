"""The cold tier's background writer: block files and manifest commits, off the engine thread.

Owns: the job queue, the writer thread, its own `Manifest` connection, block file IO
(write temp, fsync, rename, fsync directory), orphan-file unlinking, and a thread-safe
queue of results (`Written`, `Failed`, `Fault`) for the engine thread to poll, and
`disk_fault`, the one rule for telling a full or failing disk from a broken manifest.
Who calls: the engine thread calls `submit`, `poll`, `flush`, `close`; `pending` may be
called from any thread (the HTTP side reads the queue length for `/health`); the writer
thread runs `_run`. Shared state is only the two queues and counters under `_cv`.
Jobs carry numpy arrays made on the engine thread (views of sealed segments' buffers,
`blocks.to_host`): this thread never calls MLX.

The pending count is the real queue: +1 in `submit` before the job is queued, -1 once the
job finished, failed or was skipped at close, so it is 0 exactly when nothing is queued or
running. The manifest is opened lazily by the first job (and again after a failed open),
so a disk that is full when the writer starts fails jobs, one by one, instead of the thread.

Invariants: jobs run in submission order (FIFO), so a segment written before a session
save or a drop is committed (or failed) before them; nothing is committed before its
files are durable; a failed job leaves no row and removes the files it wrote.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import queue
import shutil
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .blocks import DiskCopy, HostRows, PlannedChain, chunk_payload, encode_block
from .manifest import BlockRecord, Manifest, MissingBlock, SegmentRecord

log = logging.getLogger(__name__)


class DiskFloor(Exception):
    """Free disk space would fall below the configured floor: nothing is written."""


@dataclass(frozen=True, slots=True)
class WriteSegment:
    record: SegmentRecord
    data: dict[str, tuple[HostRows, int, int]]  # block id -> rows [r0, r1) of host arrays
    copy: DiskCopy  # names the result for the engine (identity)
    pending_bytes: int
    # Chain entries to publish after the commit (shared SSD tier only; see segserve.bank.shared).
    chains: tuple[PlannedChain, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveSession:
    scope: str
    ns: str
    sid: str
    seq: int
    paths: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class DropSegments:
    keys: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Task:
    """Other file work that must stay off the engine thread (the shared tier's sweep)."""

    name: str
    run: Callable[[], object]


Job = WriteSegment | SaveSession | DropSegments | Task


@dataclass(frozen=True, slots=True)
class Written:
    copy: DiskCopy
    blocks: tuple[BlockRecord, ...]  # every block of the segment, as committed


@dataclass(frozen=True, slots=True)
class Failed:
    copy: DiskCopy
    reason: str
    disk_fault: str | None = None  # e.g. "ENOSPC", "SQLITE_FULL": the disk, not the data


@dataclass(frozen=True, slots=True)
class Fault:
    """A job other than a segment write raised; `job` is kept so that a session save or a
    drop refused by a full disk can be queued again once writes succeed."""

    reason: str
    job: Job | None = None
    disk_fault: str | None = None


Event = Written | Failed | Fault


_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
# Primary sqlite result codes (the low byte of an extended code such as SQLITE_IOERR_SHMSIZE).
_SQLITE_IOERR, _SQLITE_FULL = 10, 13


def disk_fault(exc: BaseException) -> str | None:
    """The name of the environment fault behind `exc`, or None when it is something else.

    A full, over-quota or failing disk (ENOSPC, EDQUOT, EIO; sqlite's SQLITE_FULL and
    SQLITE_IOERR family, e.g. "database or disk is full", "disk I/O error") says nothing
    about what the manifest holds: callers must never treat it as corruption."""
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return errno.errorcode[exc.errno]
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in (_SQLITE_IOERR, _SQLITE_FULL):
            return str(getattr(exc, "sqlite_errorname", None) or f"sqlite error {code}")
    return None


def block_path(root: Path, block_id: str) -> Path:
    return root / "blocks" / block_id[:2] / f"{block_id}.blk"


def checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """Create `path` if missing and make its entry durable in the parent."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        fsync_dir(path.parent)


def write_synced(path: Path, data: bytes, flags: int = os.O_TRUNC) -> None:
    """Write `data` to a new file at `path` (`flags`: O_TRUNC or O_EXCL) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename over `path`, fsync the directory: all or nothing."""
    ensure_dir(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class BlockFiles(Protocol):
    """Where the writer puts block files and what it may delete: the directory layout.

    `LocalFiles` is this process's own directory (the default); `segserve.bank.shared.SharedFiles`
    publishes into a directory several replicas share and never deletes there."""

    @property
    def manifest_path(self) -> Path: ...
    def put(self, block_id: str, rows: int, data: bytes) -> BlockRecord: ...
    def discard(self, block_id: str) -> None: ...
    def unused(self, block_id: str) -> None: ...
    def committed(self, manifest: Manifest, chains: Sequence[PlannedChain]) -> None: ...


@dataclass(frozen=True, slots=True)
class LocalFiles:
    """One process owns `root`: a block file no manifest row names may be deleted."""

    root: Path

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.sqlite3"

    def put(self, block_id: str, rows: int, data: bytes) -> BlockRecord:
        write_file_durably(block_path(self.root, block_id), data)
        return BlockRecord(block_id, rows, len(data), checksum(data))

    def discard(self, block_id: str) -> None:
        block_path(self.root, block_id).unlink(missing_ok=True)  # written, never committed

    def unused(self, block_id: str) -> None:
        block_path(self.root, block_id).unlink(missing_ok=True)  # no manifest row names it

    def committed(self, manifest: Manifest, chains: Sequence[PlannedChain]) -> None:
        pass  # nothing else reads this directory


class Writer:
    def __init__(self, root: Path, min_free_bytes: int, files: BlockFiles | None = None) -> None:
        self._root = root
        self._min_free = min_free_bytes
        self._files: BlockFiles = files if files is not None else LocalFiles(root)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending_jobs = 0
        self._pending_bytes = 0
        self._abandon = threading.Event()
        self._manifest: Manifest | None = None  # writer thread only (see `_open_manifest`)
        self._thread = threading.Thread(target=self._run, name="segserve-bank-writer", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            self._pending_jobs += 1
            self._pending_bytes += job.pending_bytes if isinstance(job, WriteSegment) else 0
        self._jobs.put(job)

    def poll(self) -> list[Event]:
        out: list[Event] = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> tuple[int, int]:
        """(queued or running jobs, host bytes they hold); safe from any thread."""
        with self._cv:
            return self._pending_jobs, self._pending_bytes

    def flush(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._pending_jobs == 0, timeout)

    def wait_backlog(self, limit_bytes: int, timeout: float) -> bool:
        """Wait until queued jobs keep at most `limit_bytes` of rows alive (bounded host memory)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending_bytes <= limit_bytes, timeout)

    def close(self, timeout: float) -> int:
        """Finish queued jobs within `timeout`; return how many were abandoned (lost)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return 0
        self._abandon.set()  # the thread skips what is left, then exits at the sentinel
        with self._cv:
            return self._pending_jobs

    # ---- writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                if not self._abandon.is_set():
                    self._run_one(job)
                wrote = isinstance(job, WriteSegment)
                with self._cv:
                    self._pending_jobs -= 1
                    if isinstance(job, WriteSegment):
                        self._pending_bytes -= job.pending_bytes
                    self._cv.notify_all()
                job = None  # drop the host arrays now, not when the next job arrives
                if wrote and self._jobs.empty():
                    release_free_heap()
        finally:
            if self._manifest is not None:
                self._manifest.close()

    def _open_manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = Manifest(self._files.manifest_path)
        return self._manifest

    def _run_one(self, job: Job) -> None:
        if isinstance(job, WriteSegment):
            self._events.put(self._write_segment(job))
            return
        try:
            if isinstance(job, SaveSession):
                self._open_manifest().save_session(job.scope, job.ns, job.sid, job.seq, job.paths)
            elif isinstance(job, Task):
                job.run()
            else:
                for block_id in self._open_manifest().drop_segments(job.keys):
                    self._files.unused(block_id)
        except Exception as e:  # the writer must outlive any one job
            log.warning("bank writer: %s failed: %s", type(job).__name__, _reason(e))
            self._events.put(Fault(f"{type(job).__name__}: {_reason(e)}", job, disk_fault(e)))

    def _write_segment(self, job: WriteSegment) -> Written | Failed:
        written: list[BlockRecord] = []
        try:
            manifest = self._open_manifest()
            for c in job.record.chunks:
                if manifest.has_block(c.block_id):
                    continue  # stored once: another segment of the same history wrote it
                src = job.data.get(c.block_id)
                if src is None:
                    raise MissingBlock(c.block_id)
                host, r0, r1 = src
                data = encode_block(chunk_payload(host, r0, r1), r1 - r0)
                self._check_floor(len(data))
                written.append(self._files.put(c.block_id, r1 - r0, data))
            manifest.commit_segment(job.record, written)
            records = tuple(manifest.block(c.block_id) for c in job.record.chunks)
        except Exception as e:  # any failure: nothing committed, say why
            for b in written:  # never committed: no row names these files
                self._files.discard(b.id)
            reason = _reason(e)
            log.warning("bank writer: segment %s not stored: %s", job.record.digest, reason)
            return Failed(job.copy, reason, disk_fault(e) or _floor(e))
        if job.chains:
            try:  # the segment is committed either way: a lookup aid must not fail it
                self._files.committed(manifest, job.chains)
            except Exception as e:
                log.warning("bank writer: chain entries not published: %s", _reason(e))
        return Written(job.copy, tuple(r for r in records if r is not None))

    def _check_floor(self, nbytes: int) -> None:
        if shutil.disk_usage(self._root).free - nbytes < self._min_free:
            raise DiskFloor(f"free disk below floor {self._min_free}")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    return fn


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS. Spilling allocates and frees many buffers below
    glibc's mmap threshold (each layer's part of a block payload; the segments' host copies
    too, before `blocks.to_host` passed views), so without this the server keeps the write
    queue's high-water mark (a 30-minute `bench/soak.sh` before this: idle RSS 2.04
    GB while MLX held 1.18 GB). A no-op where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _floor(e: BaseException) -> str | None:
    return "disk floor" if isinstance(e, DiskFloor) else None


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{errno.errorcode.get(e.errno, str(e.errno))}: {e.strerror or e}"
    if isinstance(e, sqlite3.Error) and (name := disk_fault(e)) is not None:
        return f"{name}: {e}"
    if isinstance(e, DiskFloor):
        return "disk floor"
    if isinstance(e, MissingBlock):
        return f"missing block {e}"
    return f"{type(e).__name__}: {e}"
