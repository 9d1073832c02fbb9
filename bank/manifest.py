"""The SSD tier's sqlite manifest: which blocks, segments and session turns are committed.

Owns: the schema, the format-version check, every SQL statement, the startup consistency
pass (drop rows whose blocks are missing, turns whose segments are missing, anything no
turn references).
Who calls: the writer thread (its own `Manifest`, the only one writing while the bank runs)
and the bank's constructor (a short-lived `Manifest` for the startup pass and the load,
closed before the writer starts; on a full disk, an in-memory copy, `read_only_copy`).
A `Manifest` object is used by one thread only.

Commit rule: a block row is inserted only after its file is durable (written, fsynced,
renamed, directory fsynced) and in the same transaction as the segment that needs it; a
turn row only names segments that are committed. WAL + synchronous=FULL makes each commit
durable, so after a crash (kill -9) every committed row names readable files; files with no
row are garbage the startup pass removes (in a directory this process owns; in a shared one,
`segserve.bank.sweep` decides over every replica's manifest).

Tables: meta(key, value); blocks(id, rows, nbytes, checksum);
segments(scope, digest, ns, parent, tokens, layout); segment_blocks(scope, digest, idx,
block_id, rows); sessions(scope, id, ns, seq); turns(scope, session, idx, path) where
`path` is the comma-joined digests root..leaf of the turn's snapshot.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from segserve.kv.segment import chain_digest

from .blocks import FORMAT_VERSION, Chunk, Layout

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS blocks(id TEXT PRIMARY KEY, rows INTEGER NOT NULL,"
    " nbytes INTEGER NOT NULL, checksum TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS segments(scope TEXT NOT NULL, digest TEXT NOT NULL,"
    " ns TEXT NOT NULL, parent TEXT NOT NULL, tokens BLOB NOT NULL, layout TEXT NOT NULL,"
    " PRIMARY KEY(scope, digest))",
    "CREATE TABLE IF NOT EXISTS segment_blocks(scope TEXT NOT NULL, digest TEXT NOT NULL,"
    " idx INTEGER NOT NULL, block_id TEXT NOT NULL, rows INTEGER NOT NULL,"
    " PRIMARY KEY(scope, digest, idx))",
    "CREATE INDEX IF NOT EXISTS segment_blocks_block ON segment_blocks(block_id)",
    "CREATE TABLE IF NOT EXISTS sessions(scope TEXT NOT NULL, id TEXT NOT NULL,"
    " ns TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY(scope, id))",
    "CREATE TABLE IF NOT EXISTS turns(scope TEXT NOT NULL, session TEXT NOT NULL,"
    " idx INTEGER NOT NULL, path TEXT NOT NULL, PRIMARY KEY(scope, session, idx))",
)


class FormatMismatch(Exception):
    def __init__(self, found: str) -> None:
        super().__init__(f"manifest format {found}, this build reads {FORMAT_VERSION}")
        self.found = found


class MissingBlock(Exception):
    """A segment commit names a block that is not committed (an earlier write failed)."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    id: str
    rows: int
    nbytes: int
    checksum: str


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    scope: str
    ns: str
    digest: str
    parent: str
    tokens: tuple[int, ...]
    layout: Layout
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class SessionRecord:
    scope: str
    id: str
    seq: int
    turns: tuple[tuple[str, ...], ...]  # per turn: digests root..leaf


@dataclass(frozen=True, slots=True)
class Loaded:
    sessions: tuple[SessionRecord, ...]
    segments: dict[tuple[str, str], SegmentRecord]
    blocks: dict[str, BlockRecord]  # blocks this namespace's segments use
    foreign_bytes: int  # block bytes only other namespaces use (counted against the cap)


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back after a failed statement, keeping the first error: sqlite may already have
    rolled back itself (a full disk at COMMIT), and then ROLLBACK raises a second, vaguer
    error ("no transaction is active") that would hide SQLITE_FULL from the caller."""
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def pack_tokens(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    return tuple(int(t) for t in np.frombuffer(blob, dtype="<u4"))


class Manifest:
    def __init__(self, path: Path | sqlite3.Connection) -> None:
        """Open (or create) the manifest at `path`, or adopt an open connection (the
        in-memory copy of `read_only_copy`). Closes the connection if the checks fail."""
        self._db = (
            path if isinstance(path, sqlite3.Connection)
            else sqlite3.connect(str(path), isolation_level=None)
        )
        try:
            self._setup()
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def read_only_copy(cls, path: Path) -> Manifest:
        """A private in-memory copy of the manifest at `path`, read without writing a byte
        there (for a disk too full to open it normally: no -wal/-shm file is created when
        none exists). The copy can run `startup_gc` and `load`; its changes stay in memory.

        A WAL that holds commits must be read through sqlite's shared memory file; with
        no WAL the database file alone is the whole state, which `immutable=1` reads."""
        wal = path.with_name(path.name + "-wal")
        has_wal = wal.exists() and wal.stat().st_size > 0
        mode = "mode=ro" if has_wal else "mode=ro&immutable=1"
        src = sqlite3.connect(f"file:{path}?{mode}", uri=True)
        try:
            mem = sqlite3.connect(":memory:", isolation_level=None)
            src.backup(mem)
        finally:
            src.close()
        return cls(mem)

    def _setup(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        for stmt in _SCHEMA:
            self._db.execute(stmt)
        row = self._db.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
        # True when this open created the manifest (none existed, or an empty database).
        self.created = row is None
        if row is None:
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES('format_version', ?)", (str(FORMAT_VERSION),)
            )
        elif row[0] != str(FORMAT_VERSION):
            raise FormatMismatch(row[0])

    def close(self) -> None:
        self._db.close()

    # ---- writer thread ----------------------------------------------------------------
    def has_block(self, block_id: str) -> bool:
        return self.block(block_id) is not None

    def block(self, block_id: str) -> BlockRecord | None:
        r = self._db.execute(
            "SELECT id, rows, nbytes, checksum FROM blocks WHERE id=?", (block_id,)
        ).fetchone()
        return BlockRecord(r[0], int(r[1]), int(r[2]), r[3]) if r is not None else None

    def commit_segment(self, rec: SegmentRecord, new_blocks: Iterable[BlockRecord]) -> None:
        """One transaction: the new (already durable) blocks, the segment and its chunk list."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT OR IGNORE INTO blocks(id, rows, nbytes, checksum) VALUES(?,?,?,?)",
                [(b.id, b.rows, b.nbytes, b.checksum) for b in new_blocks],
            )
            for c in rec.chunks:
                if not self.has_block(c.block_id):
                    raise MissingBlock(c.block_id)
            db.execute(
                "INSERT OR REPLACE INTO segments(scope, digest, ns, parent, tokens, layout)"
                " VALUES(?,?,?,?,?,?)",
                (
                    rec.scope,
                    rec.digest,
                    rec.ns,
                    rec.parent,
                    pack_tokens(rec.tokens),
                    rec.layout.encode(),
                ),
            )
            db.execute(
                "DELETE FROM segment_blocks WHERE scope=? AND digest=?", (rec.scope, rec.digest)
            )
            db.executemany(
                "INSERT INTO segment_blocks(scope, digest, idx, block_id, rows) VALUES(?,?,?,?,?)",
                [(rec.scope, rec.digest, i, c.block_id, c.rows) for i, c in enumerate(rec.chunks)],
            )
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)
            raise

    def save_session(
        self, scope: str, ns: str, sid: str, seq: int, paths: Sequence[Sequence[str]]
    ) -> int:
        """Replace a session's turns by those whose segments are all committed; return kept."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM turns WHERE scope=? AND session=?", (scope, sid))
            kept = [p for p in paths if p and all(self._has_segment(scope, d) for d in p)]
            db.executemany(
                "INSERT INTO turns(scope, session, idx, path) VALUES(?,?,?,?)",
                [(scope, sid, i, ",".join(p)) for i, p in enumerate(kept)],
            )
            if kept:
                db.execute(
                    "INSERT OR REPLACE INTO sessions(scope, id, ns, seq) VALUES(?,?,?,?)",
                    (scope, sid, ns, seq),
                )
            else:
                db.execute("DELETE FROM sessions WHERE scope=? AND id=?", (scope, sid))
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)
            raise
        return len(kept)

    def drop_segments(self, keys: Sequence[tuple[str, str]]) -> list[str]:
        """Delete segments (and turns naming them); return block ids nothing uses any more."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            touched: set[str] = set()
            for scope, digest in keys:
                db.execute(
                    "DELETE FROM turns WHERE scope=? AND instr(path, ?) > 0", (scope, digest)
                )
                touched.update(
                    r[0]
                    for r in db.execute(
                        "SELECT block_id FROM segment_blocks WHERE scope=? AND digest=?",
                        (scope, digest),
                    )
                )
                db.execute("DELETE FROM segment_blocks WHERE scope=? AND digest=?", (scope, digest))
                db.execute("DELETE FROM segments WHERE scope=? AND digest=?", (scope, digest))
            db.execute(
                "DELETE FROM sessions WHERE NOT EXISTS (SELECT 1 FROM turns t"
                " WHERE t.scope=sessions.scope AND t.session=sessions.id)"
            )
            orphans = [b for b in sorted(touched) if not self._block_used(b)]
            db.executemany("DELETE FROM blocks WHERE id=?", [(b,) for b in orphans])
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)
            raise
        return orphans

    # ---- startup (constructor thread, before the writer starts) -------------------------
    def startup_gc(self, block_ok: Callable[[BlockRecord], bool]) -> tuple[int, set[str]]:
        """Make the manifest self-consistent; return (rows dropped, live block ids)."""
        db = self._db
        dropped = 0
        db.execute("BEGIN IMMEDIATE")
        try:
            bad = [b.id for b in self.blocks().values() if not block_ok(b)]
            db.executemany("DELETE FROM blocks WHERE id=?", [(b,) for b in bad])
            dropped += len(bad)
            segs = self._segments(None)
            broken = [k for k, s in segs.items() if not self._segment_ok(s)]
            for scope, digest in broken:
                db.execute("DELETE FROM segment_blocks WHERE scope=? AND digest=?", (scope, digest))
                db.execute("DELETE FROM segments WHERE scope=? AND digest=?", (scope, digest))
                del segs[(scope, digest)]
            dropped += len(broken)
            dropped += self._gc_turns_and_segments(segs)
            dropped += db.execute(
                "DELETE FROM blocks WHERE NOT EXISTS"
                " (SELECT 1 FROM segment_blocks sb WHERE sb.block_id=blocks.id)"
            ).rowcount
            db.execute("COMMIT")
        except BaseException:
            _rollback(db)
            raise
        return dropped, set(self.blocks())

    def load(self, ns: str) -> Loaded:
        segs = self._segments(ns)
        sessions: list[SessionRecord] = []
        rows = self._db.execute(
            "SELECT scope, id, seq FROM sessions WHERE ns=? ORDER BY seq, id", (ns,)
        ).fetchall()
        for scope, sid, seq in rows:
            paths = self._db.execute(
                "SELECT path FROM turns WHERE scope=? AND session=? ORDER BY idx", (scope, sid)
            ).fetchall()
            turns = tuple(tuple(p[0].split(",")) for p in paths)
            sessions.append(SessionRecord(scope, sid, int(seq), turns))
        blocks = self.blocks()
        mine = {c.block_id for s in segs.values() for c in s.chunks}
        foreign = sum(b.nbytes for i, b in blocks.items() if i not in mine)
        return Loaded(tuple(sessions), segs, {i: blocks[i] for i in mine}, foreign)

    def max_seq(self) -> int:
        row = self._db.execute("SELECT max(seq) FROM sessions").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def blocks(self) -> dict[str, BlockRecord]:
        cur = self._db.execute("SELECT id, rows, nbytes, checksum FROM blocks")
        return {r[0]: BlockRecord(r[0], int(r[1]), int(r[2]), r[3]) for r in cur}

    # ---- helpers ----------------------------------------------------------------------
    def _gc_turns_and_segments(self, segs: dict[tuple[str, str], SegmentRecord]) -> int:
        db = self._db
        dropped = 0
        live: set[tuple[str, str]] = set()
        for scope, sid, idx, path in db.execute(
            "SELECT scope, session, idx, path FROM turns"
        ).fetchall():
            digests = path.split(",")
            if all((scope, d) in segs for d in digests) and self._chain_ok(segs, scope, digests):
                live.update((scope, d) for d in digests)
            else:
                db.execute(
                    "DELETE FROM turns WHERE scope=? AND session=? AND idx=?", (scope, sid, idx)
                )
                dropped += 1
        dropped += db.execute(
            "DELETE FROM sessions WHERE NOT EXISTS (SELECT 1 FROM turns t"
            " WHERE t.scope=sessions.scope AND t.session=sessions.id)"
        ).rowcount
        for key in [k for k in segs if k not in live]:
            db.execute("DELETE FROM segment_blocks WHERE scope=? AND digest=?", key)
            db.execute("DELETE FROM segments WHERE scope=? AND digest=?", key)
            dropped += 1
        return dropped

    @staticmethod
    def _chain_ok(segs: dict[tuple[str, str], SegmentRecord], scope: str, path: list[str]) -> bool:
        return all(segs[(scope, path[i])].parent == path[i - 1] for i in range(1, len(path)))

    def _segment_ok(self, s: SegmentRecord) -> bool:
        if chain_digest(s.parent, s.tokens) != s.digest or not s.chunks:
            return False
        if sum(c.rows for c in s.chunks) != len(s.tokens):
            return False
        return all(self.has_block(c.block_id) for c in s.chunks)

    def _segments(self, ns: str | None) -> dict[tuple[str, str], SegmentRecord]:
        where, args = ("WHERE ns=?", (ns,)) if ns is not None else ("", ())
        chunks: dict[tuple[str, str], list[Chunk]] = {}
        for scope, digest, block_id, rows in self._db.execute(
            "SELECT scope, digest, block_id, rows FROM segment_blocks ORDER BY scope, digest, idx"
        ):
            chunks.setdefault((scope, digest), []).append(Chunk(block_id, int(rows)))
        out: dict[tuple[str, str], SegmentRecord] = {}
        for scope, digest, sns, parent, tokens, layout in self._db.execute(
            f"SELECT scope, digest, ns, parent, tokens, layout FROM segments {where}", args
        ):
            out[(scope, digest)] = SegmentRecord(
                scope,
                sns,
                digest,
                parent,
                unpack_tokens(tokens),
                Layout.decode(layout),
                tuple(chunks.get((scope, digest), ())),
            )
        return out

    def _has_segment(self, scope: str, digest: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM segments WHERE scope=? AND digest=?", (scope, digest)
        ).fetchone()
        return row is not None

    def _block_used(self, block_id: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM segment_blocks WHERE block_id=? LIMIT 1", (block_id,)
        ).fetchone()
        return row is not None
