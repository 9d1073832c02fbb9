"""`SharedColdTier`: the SSD cold tier on a directory several replicas share.

Owns: this replica's part of a shared ROOT (`segserve.bank.shared` draws the layout): its manifest
and lock under ROOT/replicas/<id>/, the chain entries its writes publish, the probe and
read of other replicas' blocks on a lookup, and when to queue a sweep (`segserve.bank.sweep`).
Who calls: `bank.Bank` on the engine thread, as any `ColdStore`; file writes, chain
publication and sweeps run on the writer thread.

Differences from `segserve.bank.cold.ColdTier` (everything else is inherited):
- start-up removes only this replica's own temp files and never deletes a shared file:
  a block file no row of *this* manifest names may be another replica's;
- a block write publishes by `os.link` (`segserve.bank.shared.SharedFiles`): when another replica
  won, its file is checked and adopted; a commit that names new full aligned blocks also
  publishes their chain entries;
- `shared_prefix`/`read_shared` find and restore rows another replica stored for the same
  scope and tokens (checksums verified; a bad block and its chain entry are moved aside).

The disk cap counts this replica's manifest only (each replica caps what it names).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from .blocks import (
    BlockCorrupt,
    Chunk,
    HostRows,
    Layout,
    PlannedChain,
    aligned_chain,
    decode_block,
    host_slice,
    to_segment,
)
from .cold import ColdTier
from .index import Node, path_of
from .manifest import Loaded
from .shared import ChainEntry, SharedFiles, SharedLayout, plan_entries, probe
from .sweep import SweepResult, sweep
from .tier import NO_SHARED, ReadFault, SharedPrefix, SharedRows
from .types import BankError
from .writer import Failed, Task, Writer

log = logging.getLogger(__name__)


class SharedColdTier(ColdTier):
    def __init__(
        self,
        root: Path,
        *,
        replica: str,
        max_disk_bytes: int,
        min_free_disk_bytes: int = 1 << 30,
        block_rows: int = 256,
        gc_grace_s: float = 600.0,
        gc_interval_s: float = 300.0,
    ) -> None:
        super().__init__(
            root,
            max_disk_bytes=max_disk_bytes,
            min_free_disk_bytes=min_free_disk_bytes,
            block_rows=block_rows,
        )
        self.layout = SharedLayout(self.root, replica)
        self.gc_grace_s = gc_grace_s
        self.gc_interval_s = gc_interval_s
        self._next_sweep = time.monotonic() + gc_interval_s
        self._restores["shared"] = 0  # segments restored from other replicas' chain entries

    # ---- layout hooks -------------------------------------------------------------------
    def _check_kind(self) -> None:
        # A private bank's blocks are named by ROOT/manifest.sqlite3, which no sweep reads:
        # shared, they would be collected.
        if (self.root / "manifest.sqlite3").exists():
            raise BankError(f"{self.root} holds a private bank: a shared tier needs its own dir")

    def _make_dirs(self) -> None:
        self.layout.make_dirs()

    def _lock_path(self) -> Path:
        return self.layout.lock_path

    def _manifest_path(self) -> Path:
        return self.layout.manifest_path

    def _new_writer(self) -> Writer:
        return Writer(self.root, self.min_free_disk_bytes, SharedFiles(self.layout))

    def _aside_paths(self) -> list[Path]:
        return list(self.layout.replica_dir.glob("manifest.sqlite3*"))  # never shared blocks

    def _startup(self, ns: str) -> Loaded:
        """Own temp files go; the manifest drops rows whose files are missing; nothing
        shared is deleted (the sweeper decides that, over every replica's manifest)."""
        for tmp in self.layout.own_temp_files():
            tmp.unlink(missing_ok=True)
        manifest = self._open_manifest()
        try:
            dropped, _ = manifest.startup_gc(self._block_ok)
            loaded = manifest.load(ns)
            self._seq = manifest.max_seq()
        finally:
            manifest.close()
        if dropped:
            log.info("bank shared tier: startup dropped %d manifest rows", dropped)
        return loaded

    def _chains_for(
        self, node: Node, path_tokens: Sequence[int], chunks: Sequence[Chunk], layout: Layout
    ) -> tuple[PlannedChain, ...]:
        """Entries for the full aligned blocks this segment completes. A block that began in
        an ancestor also takes that ancestor's chunks (already queued: FIFO commits them
        first); the writer publishes an entry only once all its chunks are committed."""
        first = node.start - node.start % self.block_rows
        located: list[tuple[int, Chunk]] = []
        for p in path_of(node)[:-1]:
            if p.disk is None or p.start + p.rows <= first:
                continue
            pos = p.start
            for c in p.disk.chunks:
                located.append((pos, c))
                pos += c.rows
        pos = node.start
        for c in chunks:
            located.append((pos, c))
            pos += c.rows
        stop = node.start + node.rows
        return plan_entries(
            node.scope, path_tokens, located, node.start, stop, self.block_rows, layout
        )

    # ---- other replicas' rows -------------------------------------------------------------
    def shared_prefix(self, scope: str, tokens: Sequence[int], have: int) -> SharedPrefix:
        b = self.block_rows
        if len(tokens) - len(tokens) % b <= have:
            return NO_SHARED  # no full block beyond what this replica already holds
        chain = aligned_chain(scope, tokens, b)
        if not self.layout.chain_path(chain[have // b + 1]).exists():
            # One stat: the first block this replica lacks is stored nowhere (the common
            # case on a replica's own follow-ups), so the full probe would gain nothing.
            return NO_SHARED
        return SharedPrefix(tuple(probe(self.layout, chain, tokens, b)), b)

    def read_shared(
        self, found: SharedPrefix, tokens: Sequence[int], start: int, stop: int, parent: str
    ) -> SharedRows:
        """Rows [start, end) of the prompt, end <= stop, from verified block files; stops
        at the first bad block (its chain entry is moved aside with it by the caller's
        quarantine, so a later write republishes a good one)."""
        b = found.block_rows
        first = start // b
        parts: list[HostRows] = []
        end, fault = first * b, None
        for e in found.entries[first:]:
            if e.start >= stop:
                break
            got = self._entry_rows(e)
            if isinstance(got, ReadFault):
                fault = got
                self.layout.quarantine(self.layout.chain_path(e.digest))
                break
            parts.extend(got)
            end = e.start + b
        end = min(end, stop)
        if end <= start:
            return SharedRows(None, fault)
        rows = _cut(parts, start - first * b, end - start)
        seg = to_segment(rows, found.entries[0].layout, tuple(tokens[start:end]), parent)
        self._restores["shared"] += 1
        return SharedRows(seg, fault)

    def _entry_rows(self, e: ChainEntry) -> list[HostRows] | ReadFault:
        out: list[HostRows] = []
        for c in e.chunks:
            data = self._read_block(c.block_id, c.nbytes, c.checksum)
            if isinstance(data, str):
                return ReadFault(c.block_id, data)
            try:
                out.append(decode_block(data, e.layout, c.rows))
            except BlockCorrupt as ex:
                return ReadFault(c.block_id, str(ex))
        return out

    # ---- collection -----------------------------------------------------------------------
    def poll(self) -> list[Failed]:
        now = time.monotonic()
        if now >= self._next_sweep and self._writer is not None:
            self._next_sweep = now + self.gc_interval_s
            self._writer.submit(Task("sweep", self.sweep))
        return super().poll()

    def sweep(self) -> SweepResult:
        got = sweep(self.layout, grace_s=self.gc_grace_s)
        if got.skipped is not None:
            log.info("bank shared tier: sweep skipped: %s", got.skipped)
        elif got.blocks_deleted or got.chains_deleted or got.temps_deleted:
            log.info("bank shared tier: swept %s", got)
        return got


def _cut(parts: Sequence[HostRows], skip: int, keep: int) -> list[HostRows]:
    """Rows [skip, skip + keep) of the concatenation of `parts` (views, no copies)."""
    out: list[HostRows] = []
    pos = 0
    for p in parts:
        n = p.keys[0].shape[2]
        lo, hi = max(skip - pos, 0), min(skip + keep - pos, n)
        if lo < hi:
            out.append(p if (lo, hi) == (0, n) else host_slice(p, lo, hi))
        pos += n
    return out
