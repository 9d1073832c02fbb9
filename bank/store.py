"""The bank's mutable state and every change to it: turns, refcounts, residency, eviction.

Owns: the segment tree (`SegmentIndex`), sessions (scope, id) -> ordered turn leaves, the
LRU clock, eviction counters, and the glue between the RAM tier and the cold tier.
Who mutates: `bank.Bank` calls in here on the engine thread only. Writer results come in
through `sync()` (the cold tier's poll), never from another thread directly.

Residency of a stored segment (a `Node`): RAM copy and/or SSD copy; a node with neither is
lost, which drops every turn through it (and so its whole subtree). Eviction walks idle
nodes in LRU order, deepest first on ties and only nodes with no RAM-resident children, so
a conversation's latest turns go before the prefixes other branches share. With an SSD tier
every new segment is queued for writing when it is put (write-through, off the request
path), so evicting it later only drops the RAM copy; without one, eviction drops turns.

Invariants: see `segserve.bank.invariants.check` (called by `Bank.check_invariants`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from segserve.kv.segment import Segment

from .blocks import DiskCopy
from .events import NodeObserver
from .index import Node, SegmentIndex, SessionKey, is_within, path_of, subtree
from .manifest import Loaded
from .ram import RamTier
from .tier import ColdStore, ReadFault, Refused
from .types import BankError


@dataclass(slots=True, eq=False)
class Session:
    scope: str
    id: str
    turns: list[Node]  # turn k's snapshot is the path root..turns[k]
    last_used: int = 0


def _lru_key(n: Node) -> tuple[int, int, int]:
    # Least recently used first; on a tie (one path touched at once) the deepest node first.
    return (n.last_used, -n.depth, n.seq)


def own_bytes(seg: Segment) -> int:
    """Bytes of a segment's own rows (for a view: the rows it shows, not its base)."""
    return sum(k.nbytes + v.nbytes for k, v in zip(seg.keys, seg.values, strict=True))


class Store:
    def __init__(self, ram: RamTier, cold: ColdStore) -> None:
        self.index = SegmentIndex()
        self.ram = ram
        self.cold = cold
        self.sessions: dict[SessionKey, Session] = {}
        self.clock = 0
        self.evictions: Counter[str] = Counter()
        self._dirty: set[SessionKey] = set()
        self._busy: set[int] = set()  # ids of nodes a running restore needs (not disk victims)
        self.observer: NodeObserver | None = None  # told when a node enters or leaves the tree

    # ---- turns ------------------------------------------------------------------------
    def insert(self, scope: str, segments: Sequence[Segment]) -> list[Node]:
        """Path of nodes for a validated snapshot; new segments become nodes held in RAM."""
        parent = self.index.root(scope)
        path: list[Node] = []
        for seg in segments:
            node = parent.children.get(seg.digest)
            if node is None:
                node = self.index.add(
                    parent, seg.digest, seg.parent_digest, seg.tokens, own_bytes(seg)
                )
                if self.observer is not None:
                    self.observer.node_added(node)
            if node.segment is None:  # new, or only on SSD: the caller's rows make it hot
                node.segment = seg
                self.ram.hold(seg)
            path.append(node)
            parent = node
        return path

    def add_turn(self, key: SessionKey, path: Sequence[Node]) -> None:
        sess = self.sessions.get(key)
        if sess is None:
            sess = self.sessions[key] = Session(key[0], key[1], [])
        for n in path:
            n.refs += 1
        leaf = path[-1]
        leaf.holders[key] = leaf.holders.get(key, 0) + 1
        sess.turns.append(leaf)
        self._dirty.add(key)

    def delete_session(self, key: SessionKey) -> None:
        sess = self.sessions.pop(key)
        for leaf in sess.turns:
            self._drop_turn(key, leaf)
        self._dirty.add(key)

    def touch(self, nodes: Sequence[Node], sess: Session | None = None) -> None:
        self.clock += 1
        for n in nodes:
            n.last_used = self.clock
        if sess is not None:
            sess.last_used = self.clock

    def write_through(self, path: Sequence[Node]) -> None:
        for n in path:
            if n.disk is None and n.segment is not None:
                self.spill(n)

    def _drop_turn(self, key: SessionKey, leaf: Node) -> None:
        leaf.holders[key] -= 1
        if leaf.holders[key] == 0:
            del leaf.holders[key]
        path = path_of(leaf)
        for n in path:
            n.refs -= 1
        for n in reversed(path):  # free tail-first; refs only shrink toward the leaf
            if n.refs > 0:
                break
            self._free(n)

    def _free(self, n: Node) -> None:
        if n.segment is not None:
            self.ram.release(n.segment)
            n.segment = None
        if n.disk is not None:
            self.cold.release(n.disk)
            n.disk = None
            self.cold.drop([n.key])  # queued now, so it runs before any later rewrite
        self.index.remove(n)
        if self.observer is not None:
            self.observer.node_removed(n)

    def lose(self, node: Node) -> None:
        """The node's rows are gone: drop every turn through it (frees its subtree)."""
        if not node.alive:
            return
        for key in {k for n in subtree(node) for k in n.holders}:
            sess = self.sessions[key]
            keep: list[Node] = []
            for leaf in sess.turns:
                if is_within(leaf, node):
                    self._drop_turn(key, leaf)
                else:
                    keep.append(leaf)
            sess.turns = keep
            if not keep:
                del self.sessions[key]
            self._dirty.add(key)

    # ---- residency --------------------------------------------------------------------
    def spill(self, n: Node) -> DiskCopy | Refused:
        assert n.segment is not None
        toks: list[int] = []
        for p in path_of(n):
            toks.extend(p.tokens)
        got = self.cold.spill(n, n.segment, toks, lambda need: self._disk_room(need, n))
        if isinstance(got, DiskCopy):
            n.disk = got
            self._dirty.update(k for m in subtree(n) for k in m.holders)
        return got

    def evict_ram(self, goal: Callable[[int], bool]) -> int:
        """Evict idle nodes (LRU, tail-first) until `goal(freed)`; return bytes freed."""
        freed = 0
        while not goal(freed):
            victim = self._ram_victim()
            if victim is None:
                break
            before = self.ram.bytes
            if victim.disk is None:
                got = self.spill(victim)
                if isinstance(got, Refused):
                    self.evictions[f"dropped: {got.reason}"] += 1
                    self.lose(victim)
                    freed += before - self.ram.bytes
                    continue
            self.evictions["spilled"] += 1
            assert victim.segment is not None
            self.ram.release(victim.segment)
            victim.segment = None
            freed += before - self.ram.bytes
        return freed

    def _ram_victim(self) -> Node | None:
        best: Node | None = None
        for n in self.index.nodes():
            if n.segment is None or self.ram.is_pinned(n.segment):
                continue
            if any(c.segment is not None for c in n.children.values()):
                continue  # tail-first: a prefix stays while a longer branch is hot
            if best is None or _lru_key(n) < _lru_key(best):
                best = n
        return best

    def _disk_room(self, need: int, keep: Node) -> bool:
        """Drop cold-only leaves (LRU) until `need` more bytes fit under the disk cap."""
        while self.cold.over_cap(need):
            best: Node | None = None
            for n in self.index.nodes():
                if n.disk is None or n.segment is not None or n.children or id(n) in self._busy:
                    continue
                if is_within(n, keep):
                    continue
                if best is None or _lru_key(n) < _lru_key(best):
                    best = n
            if best is None:
                return False
            self.evictions["dropped: disk cap"] += 1
            self.lose(best)
        return True

    def materialize(self, nodes: Sequence[Node]) -> tuple[list[Segment], int, str | None]:
        """RAM segments for `nodes` (a root path), restoring SSD ones while RAM has room.

        Returns (segments, rows restored, why it stopped early or None). The path's RAM
        segments are pinned meanwhile so that making room never evicts them.
        """
        pinned = [n.segment for n in nodes if n.segment is not None]
        for s in pinned:
            self.ram.pin(s)
        self._busy = {id(n) for n in nodes}
        out: list[Segment] = []
        restored, note = 0, None
        try:
            for n in nodes:
                if not n.alive:  # a fault while restoring an earlier node dropped this one
                    note = note or "dropped while restoring"
                    break
                if n.segment is None:
                    got = self._restore(n)
                    if isinstance(got, str):
                        note = got
                        break
                    self.ram.pin(got)
                    pinned.append(got)
                    restored += n.rows
                assert n.segment is not None
                out.append(n.segment)
        finally:
            self._busy = set()
            for s in pinned:
                self.ram.unpin(s)
        return out, restored, note

    def _restore(self, n: Node) -> Segment | str:
        if n.disk is None:
            raise BankError(f"node {n.digest} has neither a RAM nor an SSD copy")
        if self.ram.room() < n.nbytes:
            self.evict_ram(lambda _: self.ram.room() >= n.nbytes)
        if self.ram.room() < n.nbytes:
            return "ram full: ssd restore skipped"
        got = self.cold.read(n, n.disk)
        if isinstance(got, ReadFault):
            self.quarantine(got.block_id, got.reason)
            return f"ssd block quarantined: {got.reason}"
        n.segment = got
        self.ram.hold(got)
        return got

    # ---- cold tier results and faults ---------------------------------------------------
    def sync(self) -> None:
        failed = self.cold.poll()
        if failed:
            by_copy = {id(n.disk): n for n in self.index.nodes() if n.disk is not None}
            for f in failed:
                node = by_copy.get(id(f.copy))
                if node is not None and node.disk is f.copy:
                    self._invalidate_disk(node, "dropped: ssd write failed")
        if self.cold.resumed():
            self._respill()

    def _respill(self) -> None:
        """The cold tier writes again after a disk fault: queue what was kept in RAM only
        while it could not (refused or failed spills), parents first, so those sessions
        survive a restart too. A spill refused again leaves the node as it was."""
        for n in sorted(self.index.nodes(), key=lambda n: (n.depth, n.seq)):
            if n.alive and n.segment is not None and n.disk is None:
                self.spill(n)

    def quarantine(self, block_id: str, reason: str) -> None:
        self.cold.quarantine(block_id, reason)
        for n in self.index.nodes():
            if (
                n.alive
                and n.disk is not None
                and any(c.block_id == block_id for c in n.disk.chunks)
            ):
                self._invalidate_disk(n, "dropped: ssd block corrupt")

    def _invalidate_disk(self, n: Node, reason: str) -> None:
        assert n.disk is not None
        self.cold.release(n.disk)
        n.disk = None
        self.cold.drop([n.key])
        if n.segment is None:
            self.evictions[reason] += 1
            self.lose(n)
        else:
            self._dirty.update(k for m in subtree(n) for k in m.holders)

    def persist(self) -> None:
        """Queue a manifest update for every session changed by this operation."""
        for key in sorted(self._dirty):
            sess = self.sessions.get(key)
            turns = sess.turns if sess is not None else []
            self.cold.save_session(
                key[0], key[1], [tuple(p.digest for p in path_of(t)) for t in turns]
            )
        self._dirty.clear()

    # ---- startup ------------------------------------------------------------------------
    def load(self, loaded: Loaded, root_digest: str) -> int:
        """Rebuild sessions from the manifest (SSD copies only); return turns skipped."""
        skipped = 0
        for rec in loaded.sessions:
            key = (rec.scope, rec.id)
            for turn in rec.turns:
                segs = [loaded.segments.get((rec.scope, d)) for d in turn]
                if any(s is None for s in segs) or segs[0] is None or segs[0].parent != root_digest:
                    skipped += 1
                    continue
                parent = self.index.root(rec.scope)
                path: list[Node] = []
                for s in segs:
                    assert s is not None
                    node = parent.children.get(s.digest)
                    if node is None:
                        rows = len(s.tokens)
                        node = self.index.add(
                            parent, s.digest, s.parent, s.tokens, s.layout.row_bytes * rows
                        )
                        node.disk = DiskCopy(s.chunks, s.layout)
                        self.cold.track(node.disk)
                        if self.observer is not None:
                            self.observer.node_added(node)
                    path.append(node)
                    parent = node
                self.add_turn(key, path)
                self.touch(path, self.sessions[key])
        self._dirty.clear()  # what was just read is what the manifest holds
        return skipped
