"""`Bank`: the session bank's public API (what the server calls).

Owns: the namespace and per-salt scopes, input validation, lookup policy (explicit session
first, else the longest stored prefix), hit/miss counters, and the public result types.
All state lives in `segserve.bank.store.Store`.
Who calls: every public method runs on the engine thread (the one thread that creates and
evaluates MLX arrays); the constructor may run on any thread before the engine starts. The
SSD tier's writer thread never calls in here: its results are applied at the start of the
next public call.

Invariants: a lookup only sees entries stored under the same namespace *and* the same
salt; a hit is a chain-digest hit with equal stored tokens; `lookup` never raises for an
ordinary miss; `check_invariants()` holds after every public call.

One turn, as the server drives it (engine thread):

    r = bank.lookup(prompt_ids, session_id=sid, salt=tenant)  # may read SSD blocks
    bank.pin(r.snapshot)             # nothing it references is evicted while pinned
    # admission prices new rows + r.restore_rows_from_ssd (already in bank.ram_bytes())
    # prefill prompt_ids[r.reused_tokens:] on top of r.snapshot, decode, seal
    sid = bank.put(sid, sealed_snapshot, salt=tenant)  # append the turn (queues SSD write)
    bank.unpin(r.snapshot)
Under memory pressure: `release(n)` frees n bytes of idle snapshots, `ensure_free(n)`
makes n bytes of room under `max_bytes`; `evictable_bytes()`/`protected_bytes()` are O(1).

`Bank` is the scheduler's store as it is: it satisfies
`segserve.server.scheduling.SnapshotStore` structurally (lookup, put, pin, unpin,
ram_bytes, evictable_bytes, release) and `LookupResult` satisfies its `LookupHit`, so
nothing here imports the server.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from segserve.kv.segment import ROOT_DIGEST, Segment, Snapshot, chain_digest, namespace_digest

from . import invariants
from .blocks import FORMAT_VERSION
from .cold import ColdTier
from .events import NodeObserver
from .index import Match, Node, common_prefix, path_of
from .ram import RamTier
from .shared_tier import SharedColdTier
from .store import Session, Store
from .tier import ColdStore, NullColdTier, SharedPrefix
from .types import (
    BankError,
    BankStats,
    Kind,
    LookupResult,
    Residency,
    SessionInfo,
    SessionNotFound,
    Tier,
)

log = logging.getLogger("segserve.bank")


def bank_namespace(
    *,
    model: str,
    revision: str,
    dtype: str,
    quantization: str,
    kv_layout: str,
    tokenizer: str,
    chat_template: str,
) -> str:
    """The namespace string for `Bank`: everything that changes KV rows or token ids.

    Pass identifiers or content hashes (e.g. a hash of tokenizer.json and of the template).
    """
    parts = {
        "model": model,
        "revision": revision,
        "dtype": dtype,
        "quantization": quantization,
        "kv_layout": kv_layout,
        "tokenizer": tokenizer,
        "chat_template": chat_template,
    }
    return namespace_digest(*(f"{k}={v}" for k, v in sorted(parts.items())))


class Bank:
    def __init__(
        self,
        namespace: str,
        max_bytes: int,
        *,
        cold: ColdStore | None = None,
        root_digest: str = ROOT_DIGEST,
    ) -> None:
        # Versioned, fixed seed: stable across restarts, changes with the bank format.
        self._ns = namespace_digest("segserve.bank", str(FORMAT_VERSION), namespace)
        self._root = root_digest
        self._ram = RamTier(max_bytes)
        self._cold: ColdStore = cold if cold is not None else NullColdTier()
        self._store = Store(self._ram, self._cold)
        self._hits: Counter[str] = Counter()
        self._misses = 0
        self._last_miss: str | None = None
        self._closed = False
        self.skipped_on_load = self._store.load(self._cold.open(self._ns), root_digest)

    @classmethod
    def open(
        cls,
        namespace: str,
        max_bytes: int,
        cold_dir: Path | str | None = None,
        *,
        max_disk_bytes: int = 64 << 30,
        min_free_disk_bytes: int = 4 << 30,
        block_rows: int = 256,
        shared_replica: str | None = None,
    ) -> Bank:
        """A bank with an SSD tier in `cold_dir`, or RAM only when it is None.

        `shared_replica`: `cold_dir` is shared by several replicas and this is this one's
        id (`segserve.bank.shared_tier.SharedColdTier`); None: this process owns `cold_dir`."""
        if cold_dir is None:
            return cls(namespace, max_bytes)
        if shared_replica is not None:
            shared = SharedColdTier(
                Path(cold_dir),
                replica=shared_replica,
                max_disk_bytes=max_disk_bytes,
                min_free_disk_bytes=min_free_disk_bytes,
                block_rows=block_rows,
            )
            return cls(namespace, max_bytes, cold=shared)
        cold = ColdTier(
            Path(cold_dir),
            max_disk_bytes=max_disk_bytes,
            min_free_disk_bytes=min_free_disk_bytes,
            block_rows=block_rows,
        )
        return cls(namespace, max_bytes, cold=cold)

    # ---- storing ----------------------------------------------------------------------
    def put(self, session_id: str | None, snapshot: Snapshot, salt: str | None = None) -> str:
        """Append `snapshot` as the session's next turn; return the id (new if None)."""
        self._begin()
        segs = snapshot.segments
        self._validate(segs)
        scope = self._scope(salt)
        self._check_collisions(scope, segs)
        sid = session_id if session_id is not None else f"s-{uuid.uuid4().hex}"
        key = (scope, sid)
        store = self._store
        path = store.insert(scope, segs)
        store.add_turn(key, path)
        store.touch(path, store.sessions[key])
        store.write_through(path)
        store.evict_ram(lambda _: self._ram.bytes <= self._ram.max_bytes)
        store.persist()
        return sid

    def fork(
        self,
        session_id: str,
        turn: int | None = None,
        salt: str | None = None,
        new_id: str | None = None,
    ) -> str:
        """New session sharing turns 0..turn (default: all) of `session_id`; no rows copied."""
        self._begin()
        src = self._session(session_id, salt)
        idx = len(src.turns) - 1 if turn is None else turn
        if not 0 <= idx < len(src.turns):
            raise BankError(f"turn {turn} outside 0..{len(src.turns) - 1}")
        nid = new_id if new_id is not None else f"s-{uuid.uuid4().hex}"
        key = (src.scope, nid)
        if key in self._store.sessions:
            raise BankError(f"session {nid!r} already exists")
        for leaf in src.turns[: idx + 1]:
            self._store.add_turn(key, path_of(leaf))
        self._store.touch([], self._store.sessions[key])
        self._store.persist()
        return nid

    def continue_session(
        self, session_id: str, turn: int | None, *, salt: str | None, new_id: str
    ) -> bool:
        """`fork` into `new_id` for a request that continues a stored turn; False, with
        nothing changed, when that session or turn is gone or `new_id` exists (the request
        then prefills its history from text)."""
        try:
            self.fork(session_id, turn, salt=salt, new_id=new_id)
        except BankError:
            return False
        return True

    def delete(self, session_id: str, salt: str | None = None) -> None:
        self._begin()
        sess = self._session(session_id, salt)
        self._store.delete_session((sess.scope, sess.id))
        self._store.persist()

    # ---- finding ----------------------------------------------------------------------
    def lookup(
        self,
        tokens: Sequence[int],
        session_id: str | None = None,
        salt: str | None = None,
        *,
        max_reuse: int | None = None,
    ) -> LookupResult:
        """Stored rows for the longest usable prefix of `tokens` (restoring SSD rows).

        `max_reuse` defaults to len(tokens) - 1: the last prompt token must still run to
        produce logits. An explicit session wins ties with the global prefix match.
        """
        self._begin()
        toks = tuple(int(t) for t in tokens)
        cap = len(toks) - 1 if max_reuse is None else min(max_reuse, len(toks))
        scope = self._scope(salt)
        sess = self._store.sessions.get((scope, session_id)) if session_id is not None else None
        match, turn = self._best_match(scope, toks, sess)
        reuse = min(match.rows, cap)
        found = self._cold.shared_prefix(scope, toks, reuse)
        if min(found.rows, cap) > reuse:
            got = self._lookup_shared(toks, match, found, cap)
            if got is not None:
                return got
        if reuse <= 0:
            why = "no stored prefix" if match.rows == 0 else "prompt too short to reuse"
            return self._miss("session not found" if session_id and sess is None else why)
        nodes = match.covering(reuse)
        segs, restored, note = self._store.materialize(nodes)
        reuse = min(reuse, sum(s.rows for s in segs))
        self._store.persist()  # a quarantine may have dropped turns
        if reuse <= 0:
            return self._miss(note or "no stored prefix")
        kind: Kind = "session" if turn is not None else "prefix"
        self._store.touch(nodes[: len(segs)], sess if turn is not None else None)
        self._hits[kind] += 1
        tier: Tier = "ssd" if restored else "ram"
        sid = session_id if turn is not None else None
        snap = Snapshot(tuple(segs)).prefix(reuse)
        return LookupResult(snap, reuse, kind, tier, None, restored, sid, turn, note)

    def _lookup_shared(
        self, toks: tuple[int, ...], match: Match, found: SharedPrefix, cap: int
    ) -> LookupResult | None:
        """Local full segments of `match`, then the rest from another replica's blocks in
        the shared SSD tier; None when that reuses no more than `match` alone would."""
        store = self._store
        segs, restored, note = store.materialize(match.nodes)
        start = sum(s.rows for s in segs)
        parent = segs[-1].digest if segs else self._root
        got = self._cold.read_shared(found, toks, start, min(found.rows, cap), parent)
        if got.fault is not None:
            store.quarantine(got.fault.block_id, got.fault.reason)
            note = f"shared ssd block quarantined: {got.fault.reason}"
        store.persist()  # a quarantine may have dropped turns
        if got.segment is None or start + got.segment.rows <= min(match.rows, cap):
            return None
        store.touch(match.nodes[: len(segs)])
        self._hits["prefix"] += 1
        snap = Snapshot((*segs, got.segment))
        rows = got.segment.rows
        return LookupResult(snap, snap.rows, "prefix", "ssd", None, restored + rows, None, None, note)

    def _best_match(
        self, scope: str, toks: tuple[int, ...], sess: Session | None
    ) -> tuple[Match, int | None]:
        """(match, matched turn of `sess` or None for a global prefix match)."""
        match = self._store.index.match(scope, toks, lambda n: n.segment is None)
        if sess is not None:
            smatch, sturn = _session_match(sess, toks)
            if smatch.rows >= match.rows and smatch.rows > 0:
                return smatch, sturn
        return match, None

    def list_sessions(self, salt: str | None = None) -> list[SessionInfo]:
        """Sessions of this namespace and salt, most recently used first."""
        self._begin()
        scope = self._scope(salt)
        found = [s for s in self._store.sessions.values() if s.scope == scope]
        found.sort(key=lambda s: (-s.last_used, s.id))
        return [_info(s) for s in found]

    def info(self, session_id: str, salt: str | None = None) -> SessionInfo:
        self._begin()
        return _info(self._session(session_id, salt))

    def turn_index(self, session_id: str, salt: str | None = None) -> int | None:
        """The index of `session_id`'s latest turn; None when it is not stored (an ordinary
        answer, like a miss: the caller then has no turn to continue from)."""
        self._begin()
        sess = self._store.sessions.get((self._scope(salt), session_id))
        return None if sess is None else len(sess.turns) - 1

    # ---- memory -----------------------------------------------------------------------
    def pin(self, snapshot: Snapshot) -> None:
        """Protect a running request's segments from eviction until `unpin`."""
        for seg in snapshot.segments:
            self._ram.pin(seg)

    def unpin(self, snapshot: Snapshot) -> None:
        for seg in snapshot.segments:
            self._ram.unpin(seg)

    def ensure_free(self, bytes_needed: int) -> int:
        """Evict idle snapshots until `bytes_needed` fit under `max_bytes`; return freed."""
        self._begin()
        freed = self._store.evict_ram(lambda _: self._ram.room() >= bytes_needed)
        self._store.persist()
        return freed

    def release(self, bytes_wanted: int) -> int:
        """Evict idle snapshots until `bytes_wanted` bytes were freed (or none is left)."""
        self._begin()
        freed = self._store.evict_ram(lambda f: f >= bytes_wanted)
        self._store.persist()
        return freed

    @property
    def max_bytes(self) -> int:
        return self._ram.max_bytes

    def ram_bytes(self) -> int:
        return self._ram.bytes

    def evictable_bytes(self) -> int:
        return self._ram.bytes - self._ram.protected

    def protected_bytes(self) -> int:
        return self._ram.protected

    # ---- state ------------------------------------------------------------------------
    def stats(self) -> BankStats:
        self._begin()
        store, c = self._store, self._cold.stats()
        # Rows counted like the RAM bytes: a buffer shared by views and branches once.
        nodes = store.index.nodes()
        owners = {id(n.segment.owner): n.segment.owner for n in nodes if n.segment is not None}
        ssd_rows = sum(n.rows for n in nodes if n.disk is not None)
        return BankStats(
            sessions=len(store.sessions),
            entries=sum(len(s.turns) for s in store.sessions.values()),
            segments=len(store.index),
            bytes_by_tier={"ram": self._ram.bytes, "ssd": c.disk_bytes},
            rows_by_tier={"ram": sum(o.rows for o in owners.values()), "ssd": ssd_rows},
            protected_bytes=self._ram.protected,
            evictable_bytes=self.evictable_bytes(),
            max_bytes=self._ram.max_bytes,
            hits_by_kind=dict(self._hits),
            misses=self._misses,
            evictions_by_reason=dict(store.evictions),
            spills=c.spills,
            spills_refused=c.spills_refused,
            spill_failures=c.spill_failures,
            restores_by_tier=dict(c.restores_by_tier),
            quarantined_blocks=c.quarantined_blocks,
            writes_pending=c.writes_pending,
            write_queue_bytes=c.write_queue_bytes,
            writes_lost=c.writes_lost,
            last_miss_reason=self._last_miss,
            last_fault=c.last_fault,
            disk_faults=dict(c.faults),
            cold_tier=c.state,
        )

    @property
    def cold_root(self) -> Path | None:
        """The SSD tier's directory (None without one). Fixed at construction: safe from
        any thread."""
        return self._cold.root if isinstance(self._cold, ColdTier) else None

    def writer_queue(self) -> tuple[int, int]:
        """(SSD writer jobs queued or running, host bytes they hold), read now. Safe from
        any thread, unlike the rest of the bank: `/health` reads it between engine steps."""
        return self._cold.writer_queue()

    def check_invariants(self) -> None:
        invariants.check(self._store)

    def observe(self, observer: NodeObserver | None) -> None:
        """Tell `observer` (e.g. `segserve.bank.events.BlockEvents`) of every node that enters or
        leaves the segment tree from now on. It first hears `cleared()` and then every node
        already stored (parents first): a subscriber's view restarts from this bank's state.
        """
        self._begin()
        self._store.observer = observer
        if observer is None:
            return
        observer.cleared()
        for n in sorted(self._store.index.nodes(), key=lambda n: (n.depth, n.seq)):
            observer.node_added(n)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait for queued SSD writes and apply their results (tests, shutdown)."""
        self._begin()
        done = self._cold.flush(timeout)
        self._store.sync()
        self._store.persist()
        return done

    def close(self, timeout: float = 10.0) -> int:
        """Finish queued SSD writes within `timeout`; return how many were lost (logged as
        an error too: those turns are gone once the process exits)."""
        if self._closed:
            return 0
        self._store.sync()
        self._store.persist()
        self._closed = True
        if self._store.observer is not None:
            self._store.observer.cleared()  # this process serves none of it any more
            self._store.observer = None
        lost = self._cold.close(timeout)
        if lost:
            log.error("%d queued SSD writes were lost", lost)
        return lost

    # ---- helpers ----------------------------------------------------------------------
    def _begin(self) -> None:
        if self._closed:
            raise BankError("bank is closed")
        self._store.sync()

    def _scope(self, salt: str | None) -> str:
        # None and "" are the same tenant: no salt.
        return namespace_digest(self._ns, "salt", salt or "")

    def _session(self, session_id: str, salt: str | None) -> Session:
        sess = self._store.sessions.get((self._scope(salt), session_id))
        if sess is None:
            raise SessionNotFound(session_id)
        return sess

    def _miss(self, reason: str) -> LookupResult:
        self._misses += 1
        self._last_miss = reason
        return LookupResult(Snapshot(), 0, "miss", "none", reason, 0)

    def _validate(self, segs: Sequence[Segment]) -> None:
        if not segs:
            raise BankError("cannot store an empty snapshot")
        parent = self._root
        for i, s in enumerate(segs):
            if s.rows == 0 or not s.keys or len(s.keys) != len(segs[0].keys):
                raise BankError(f"segment {i} is empty or has another layer count")
            if any(k.shape[2] != s.rows for k in (*s.keys, *s.values)):
                raise BankError(f"segment {i} rows disagree with its tokens")
            if s.parent_digest != parent or s.digest != chain_digest(parent, s.tokens):
                raise BankError(f"segment {i} does not continue the chain from the root")
            parent = s.digest

    def _check_collisions(self, scope: str, segs: Sequence[Segment]) -> None:
        node = self._store.index.find_root(scope)
        for s in segs:
            node = node.children.get(s.digest) if node is not None else None
            if node is None:
                return  # the rest is new
            if node.tokens != s.tokens or node.parent_digest != s.parent_digest:
                raise BankError(f"digest {s.digest} names other tokens: refusing to store")


def _session_match(sess: Session, toks: tuple[int, ...]) -> tuple[Match, int | None]:
    """Longest prefix of `toks` over the session's turns (latest turn wins ties)."""
    best, best_turn = Match(), None
    for i in range(len(sess.turns) - 1, -1, -1):
        full: list[Node] = []
        partial, prow, pos = None, 0, 0
        for n in path_of(sess.turns[i]):
            k = common_prefix(n.tokens, toks, pos)
            if k < n.rows:
                partial, prow = (n, k) if k > 0 else (None, 0)
                break
            full.append(n)
            pos += k
        m = Match(tuple(full), partial, prow)
        if m.rows > best.rows:
            best, best_turn = m, i
    return best, best_turn


def _info(s: Session) -> SessionInfo:
    path = path_of(s.turns[-1])
    hot = sum(1 for n in path if n.segment is not None)
    tier: Residency = "ram" if hot == len(path) else "ssd" if hot == 0 else "mixed"
    return SessionInfo(
        s.id, len(s.turns), sum(n.rows for n in path), len(path), sum(n.nbytes for n in path), tier
    )
