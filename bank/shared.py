"""The shared SSD tier's files: directory layout, atomic publication, chain entries, probe.

Owns: `SharedLayout` (where everything lives under a ROOT several replicas share),
`publish` (one writer per file: temp file, fsync, `os.link`; EEXIST = another replica
won), `ChainEntry` (the lookup record of one full aligned block) and `probe` (the verified
chain entries for a prompt's blocks), and `SharedFiles` (the writer's `BlockFiles` for a
shared ROOT: it never deletes there).
Who calls: `SharedFiles` runs on the writer thread; `probe` and `read_entry` on the engine
thread (small JSON files); both only read and create files, never rewrite one.

    ROOT/blocks/<id[:2]>/<id>.blk     block files (content-addressed, shared, never rewritten)
    ROOT/chains/<A[:2]>/<A>.chn       chain entries by aligned chain digest (shared)
    ROOT/tmp/<name>~<replica>~<n>.tmp  writes in flight (each replica removes its own)
    ROOT/replicas/<id>/               one replica: manifest.sqlite3 + lock
    ROOT/quarantine/                  files that failed a check (kept for an operator)
    ROOT/gc.lock                      one sweeper at a time (`segserve.bank.sweep`)

Invariants: a file under blocks/ or chains/ is complete and durable (it appears by a link
of an fsynced temp file); no file there is ever rewritten in place; a chain entry restores
nothing unless its tokens, its parent digest and its own digest match the prompt's.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .blocks import HEADER, Chunk, Layout, PlannedChain, aligned_chain
from .manifest import BlockRecord, Manifest
from .writer import block_path, checksum, ensure_dir, fsync_dir, write_synced

log = logging.getLogger(__name__)

CHAIN_FORMAT = 1
# A replica id is a directory name: no separators, no dot-only names, and no "~" (the
# temp-file field separator).
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_counter = itertools.count()  # next() on a count is atomic under the GIL


@dataclass(frozen=True, slots=True)
class SharedLayout:
    root: Path
    replica: str

    def __post_init__(self) -> None:
        if not REPLICA_ID.fullmatch(self.replica):
            raise ValueError(f"replica id {self.replica!r}: use letters, digits, '.', '_', '-'")

    @property
    def replica_dir(self) -> Path:
        return self.root / "replicas" / self.replica

    @property
    def manifest_path(self) -> Path:
        return self.replica_dir / "manifest.sqlite3"

    @property
    def lock_path(self) -> Path:
        return self.replica_dir / "lock"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def gc_lock(self) -> Path:
        return self.root / "gc.lock"

    def chain_path(self, digest: str) -> Path:
        return self.root / "chains" / digest[:2] / f"{digest}.chn"

    def make_dirs(self) -> None:
        for d in ("blocks", "chains", "tmp", "quarantine"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.replica_dir.mkdir(parents=True, exist_ok=True)

    def own_temp_files(self) -> list[Path]:
        """Temp files this replica left (a crash mid-write); others' are not ours to touch."""
        return [p for p in self.tmp_dir.glob("*.tmp") if _tmp_owner(p) == self.replica]

    def quarantine(self, path: Path) -> Path | None:
        """Move a bad shared file aside (never delete: an operator may want it)."""
        dest = self.root / "quarantine" / f"{path.name}.{time.time_ns()}"
        try:
            path.rename(dest)
        except FileNotFoundError:
            return None  # already moved by another replica
        return dest


def _tmp_owner(p: Path) -> str | None:
    parts = p.name.split("~")
    return parts[1] if len(parts) == 3 else None


def publish(layout: SharedLayout, dest: Path, data: bytes) -> bool:
    """Make `dest` hold `data` unless it exists: True when this call created it.

    Temp file in ROOT/tmp, fsync, `os.link` to `dest` (atomic, never replaces: EEXIST means
    another replica published first), fsync the directory. A crash leaves at most a temp
    file, which its replica removes at its next start."""
    ensure_dir(dest.parent)
    tmp = layout.tmp_dir / f"{dest.name}~{layout.replica}~{os.getpid()}-{next(_counter)}.tmp"
    try:
        write_synced(tmp, data, os.O_EXCL)
        try:
            os.link(tmp, dest)
        except FileExistsError:
            return False
        fsync_dir(dest.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


# ---- chain entries ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ChainChunk:
    block_id: str
    rows: int
    nbytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class ChainEntry:
    """Full aligned block j of some history: where its rows are (chunks, in order)."""

    digest: str  # A_{j+1}
    parent: str  # A_j
    start: int  # j * block_rows
    tokens: tuple[int, ...]  # the block's own tokens
    layout: Layout
    chunks: tuple[ChainChunk, ...]

    def encode(self) -> bytes:
        return json.dumps({
            "format": CHAIN_FORMAT, "digest": self.digest, "parent": self.parent,
            "start": self.start, "tokens": list(self.tokens), "layout": self.layout.encode(),
            "chunks": [[c.block_id, c.rows, c.nbytes, c.checksum] for c in self.chunks],
        }, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> ChainEntry | None:
        """The entry, or None for anything malformed (an unknown format included)."""
        try:
            d = json.loads(data)
            if d["format"] != CHAIN_FORMAT:
                return None
            chunks = tuple(
                ChainChunk(str(i), int(r), int(n), str(c)) for i, r, n, c in d["chunks"]
            )
            entry = ChainEntry(
                str(d["digest"]), str(d["parent"]), int(d["start"]),
                tuple(int(t) for t in d["tokens"]), Layout.decode(d["layout"]), chunks,
            )
        except (ValueError, KeyError, TypeError):
            return None
        if not chunks or sum(c.rows for c in chunks) != len(entry.tokens):
            return None
        return entry


def read_entry(layout: SharedLayout, digest: str) -> ChainEntry | None:
    try:
        data = layout.chain_path(digest).read_bytes()
    except OSError:
        return None
    return ChainEntry.decode(data)


def probe(
    layout: SharedLayout, chain: Sequence[str], tokens: Sequence[int], block_rows: int
) -> list[ChainEntry]:
    """Verified entries for the prompt's full aligned blocks 0, 1, ... up to the first gap;
    `chain` is the prompt's aligned chain (`aligned_chain`).

    Every entry is checked against the prompt itself (its digest, its parent digest, its
    start and its tokens), from block 0 on: a digest alone never restores."""
    toks = tuple(tokens)
    out: list[ChainEntry] = []
    for j in range(len(chain) - 1):
        e = read_entry(layout, chain[j + 1])
        lo = j * block_rows
        if e is None or (e.digest, e.parent, e.start) != (chain[j + 1], chain[j], lo):
            break
        if e.tokens != toks[lo : lo + block_rows] or (out and e.layout != out[0].layout):
            break
        out.append(e)
    return out


def plan_entries(
    scope: str,
    path_tokens: Sequence[int],
    located: Sequence[tuple[int, Chunk]],
    start: int,
    stop: int,
    block_rows: int,
    layout: Layout,
) -> tuple[PlannedChain, ...]:
    """Chain entries for the full aligned blocks that end inside rows (start, stop].

    `located` holds (first row, chunk) of every stored chunk on the path, in row order; a
    block whose rows are not all covered by them (an ancestor not stored) gets no entry."""
    toks = tuple(path_tokens)
    chain = aligned_chain(scope, toks[: stop - stop % block_rows], block_rows)
    out: list[PlannedChain] = []
    for j in range(start // block_rows, stop // block_rows):
        lo, hi = j * block_rows, (j + 1) * block_rows
        if hi <= start:
            continue
        chunks = tuple(c for pos, c in located if lo <= pos < hi)
        if sum(c.rows for c in chunks) != block_rows:
            continue
        out.append(PlannedChain(chain[j + 1], chain[j], lo, toks[lo:hi], layout, chunks))
    return tuple(out)


# ---- the writer's files -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SharedFiles:
    """`segserve.bank.writer.BlockFiles` on a shared ROOT: publish, adopt what others published,
    delete nothing (a file no row of *this* manifest names may be another replica's)."""

    layout: SharedLayout

    @property
    def manifest_path(self) -> Path:
        return self.layout.manifest_path

    def put(self, block_id: str, rows: int, data: bytes) -> BlockRecord:
        path = block_path(self.layout.root, block_id)
        if path.exists():  # stored by another replica already: no need to write ours
            got = self._adopt(path, block_id, rows, data)
            if got is not None:
                return got
        for _ in range(2):
            if publish(self.layout, path, data):
                return BlockRecord(block_id, rows, len(data), checksum(data))
            got = self._adopt(path, block_id, rows, data)
            if got is not None:
                return got
        raise OSError(errno.EEXIST, f"block {block_id}: a bad copy keeps reappearing")

    def _adopt(self, path: Path, block_id: str, rows: int, data: bytes) -> BlockRecord | None:
        """Another replica published `block_id`: use its file, after checking it."""
        try:
            theirs = path.read_bytes()
            os.utime(path)  # fresh again: the sweeper's grace covers our commit
        except FileNotFoundError:
            return None  # collected meanwhile: publish ours
        ours, sums = checksum(data), checksum(theirs)
        # Same tokens, same model: the same rows, but not always the same bits (another
        # prefill chunking rounds differently). A file of the same shape is theirs to keep;
        # the recorded checksum is of their bytes, so a later flip is still caught.
        if sums == ours or (len(theirs) == len(data) and theirs[: HEADER.size] == data[: HEADER.size]):
            return BlockRecord(block_id, rows, len(theirs), sums)
        log.warning("bank shared tier: block %s is malformed: quarantined", block_id)
        self.layout.quarantine(path)
        return None

    def discard(self, block_id: str) -> None:
        # Published but not committed: another replica may have adopted it meanwhile.
        # The sweeper collects it once no manifest names it and its grace has passed.
        pass

    def unused(self, block_id: str) -> None:
        pass  # this manifest no longer names it; others may (the sweeper decides)

    def committed(self, manifest: Manifest, chains: Sequence[PlannedChain]) -> None:
        for pc in chains:
            recs = [manifest.block(c.block_id) for c in pc.chunks]
            if any(r is None for r in recs):
                continue  # an earlier segment of the path was never stored
            chunks = tuple(
                ChainChunk(r.id, r.rows, r.nbytes, r.checksum) for r in recs if r is not None
            )
            entry = ChainEntry(pc.digest, pc.parent, pc.start, pc.tokens, pc.layout, chunks)
            path = self.layout.chain_path(pc.digest)
            if publish(self.layout, path, entry.encode()):
                continue
            if read_entry(self.layout, pc.digest) is None and self.layout.quarantine(path):
                publish(self.layout, path, entry.encode())  # theirs was unreadable
