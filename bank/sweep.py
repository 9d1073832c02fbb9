"""The shared SSD tier's collector: delete shared files no replica manifest names.

Owns: `sweep` and its result. Runs on a replica's writer thread (a `writer.Task` queued by
`segserve.bank.shared_tier.SharedColdTier.poll`), or from a test; one sweeper at a time over a
ROOT, by an flock on ROOT/gc.lock (another replica already sweeping: this one skips).

What is collected, and only when its mtime is older than the grace period (a write in
flight, or a file a replica just adopted, is never collected; adopting touches the file):
- a block file no manifest under ROOT/replicas/ names (moved-aside manifests count too);
- a chain entry that is unreadable or names a block no manifest names (it could restore
  nothing; a chain entry is named through its blocks);
- a temp file in ROOT/tmp (a crashed writer's; live writes take well under the grace).
Any manifest that cannot be read stops the sweep before anything is deleted.

Replica manifests are opened read-only: a sweeper never changes another replica's state.
A replica that will never come back keeps its blocks named until an operator removes its
ROOT/replicas/<id>/ directory.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .shared import ChainEntry, SharedLayout


@dataclass(frozen=True, slots=True)
class SweepResult:
    blocks_deleted: int = 0
    chains_deleted: int = 0
    temps_deleted: int = 0
    skipped: str | None = None  # why nothing was deleted


def named_blocks(layout: SharedLayout) -> set[str] | str:
    """Block ids every replica manifest names, or why they could not all be read."""
    named: set[str] = set()
    for path in sorted((layout.root / "replicas").rglob("manifest.sqlite3")):
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
            try:
                named.update(r[0] for r in db.execute("SELECT id FROM blocks"))
            finally:
                db.close()
        except sqlite3.Error as e:
            return f"manifest {path} unreadable: {e}"
    return named


def sweep(layout: SharedLayout, *, grace_s: float, now: float | None = None) -> SweepResult:
    fd = os.open(layout.gc_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return SweepResult(skipped="another replica is sweeping")
        named = named_blocks(layout)
        if isinstance(named, str):
            return SweepResult(skipped=named)
        cutoff = (time.time() if now is None else now) - grace_s
        blocks = chains = temps = 0
        for p in (layout.root / "blocks").glob("*/*.blk"):
            if p.stem not in named and _unlink_if_old(p, cutoff):
                blocks += 1
        for p in (layout.root / "chains").glob("*/*.chn"):
            if not _chain_live(p, named) and _unlink_if_old(p, cutoff):
                chains += 1
        for p in layout.tmp_dir.glob("*.tmp"):
            temps += _unlink_if_old(p, cutoff)
        return SweepResult(blocks, chains, temps)
    finally:
        os.close(fd)  # drops the flock


def _chain_live(path: Path, named: set[str]) -> bool:
    try:
        entry = ChainEntry.decode(path.read_bytes())
    except OSError:
        return True  # gone or unreadable now: nothing to decide
    return entry is not None and all(c.block_id in named for c in entry.chunks)


def _unlink_if_old(path: Path, cutoff: float) -> bool:
    try:
        if path.stat().st_mtime >= cutoff:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True
