"""`check(store)`: recount the bank's bookkeeping from scratch and compare.

Owns nothing; reads a `Store` on the engine thread (tests call it after every step).
Checked:
- tree links: parent/children maps agree, depth and absolute start follow the parent, a
  node's RAM segment has the node's digest, tokens and chain parent;
- every node is alive, referenced (refs >= 1) and holds a copy (RAM or SSD);
- refs == number of stored turns through the node; holders == turns ending at it;
- every session turn names a live node reachable from its scope root (nothing both freed
  and referenced);
- the RAM tier's byte totals equal the recount over owners (shared buffers once);
- the cold tier's block refcounts and disk bytes equal the recount over SSD copies.
"""

from __future__ import annotations

from collections import Counter

from .index import Node, SessionKey, path_of
from .store import Store
from .types import BankError, InvariantViolation


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


def _check_node(n: Node) -> None:
    p = n.parent
    if p is None or p.children.get(n.digest) is not n:
        _fail(f"node {n.digest} is not its parent's child")
        return
    if n.depth != p.depth + 1 or n.start != p.start + p.rows or n.scope != p.scope:
        _fail(f"node {n.digest} depth/start/scope disagree with its parent")
    if p.depth > 0 and n.parent_digest != p.digest:
        _fail(f"node {n.digest} chain parent is not its tree parent")
    if not n.alive or n.refs < 1:
        _fail(f"node {n.digest} is freed or unreferenced but still in the tree")
    if n.segment is None and n.disk is None:
        _fail(f"node {n.digest} has neither a RAM nor an SSD copy")
    s = n.segment
    if s is not None and (s.digest, s.tokens, s.parent_digest) != (
        n.digest,
        n.tokens,
        n.parent_digest,
    ):
        _fail(f"node {n.digest} holds a segment with other content")
    if n.disk is not None and n.disk.rows != n.rows:
        _fail(f"node {n.digest} SSD copy has {n.disk.rows} rows, not {n.rows}")


def check(store: Store) -> None:
    nodes = store.index.nodes()
    reach: list[Node] = []
    for root in store.index.roots():
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            reach.append(n)
            stack.extend(n.children.values())
    if {id(n) for n in reach} != {id(n) for n in nodes} or len(reach) != len(nodes):
        _fail("tree reachability disagrees with the node table")
    for n in nodes:
        _check_node(n)
    refs: Counter[int] = Counter()
    holders: dict[int, Counter[SessionKey]] = {}
    for key, sess in store.sessions.items():
        if (sess.scope, sess.id) != key or not sess.turns:
            _fail(f"session {key} is mislabelled or has no turns")
        for leaf in sess.turns:
            if not leaf.alive or leaf.scope != sess.scope:
                _fail(f"session {key} names a freed node or another scope's node")
            holders.setdefault(id(leaf), Counter())[key] += 1
            for p in path_of(leaf):
                refs[id(p)] += 1
    for n in nodes:
        if refs[id(n)] != n.refs:
            _fail(f"node {n.digest} refs {n.refs} != {refs[id(n)]} turns through it")
        if Counter(n.holders) != holders.get(id(n), Counter()):
            _fail(f"node {n.digest} holders disagree with the sessions")
    try:
        store.ram.check(n.segment for n in nodes if n.segment is not None)
        store.cold.check([n.disk for n in nodes if n.disk is not None])
    except InvariantViolation:
        raise
    except BankError as e:
        raise InvariantViolation(str(e)) from e
    if not 0 <= store.ram.protected <= store.ram.bytes:
        _fail("protected bytes outside 0..ram bytes")
