"""The bank's segment tree: every stored segment once per scope, found by token prefix.

Owns: `Node` (one stored segment in one scope: its tokens, tree links, turn refcount and
where its rows live now) and `SegmentIndex` (scope roots, digest lookup, prefix match).
Who mutates: only `bank.Bank`, on the engine thread. Nothing here touches MLX arrays or
files; a node's RAM copy is an opaque `Segment` reference and its SSD copy a `DiskCopy`.

A scope is one (namespace, cache salt) pair, hashed by the bank. Nodes of different scopes
never share a tree, so a lookup can only return rows stored under its own scope.

Shape of one scope (children are keyed by their chain digest):

    root ─┬─ A (system+turn 1) ─┬─ B (turn 2) ── C (turn 3)     session s1: turns A, AB, ABC
          │                     └─ B' (fork turn 2)              session s2: turns A, AB'
          └─ D ...

Invariants (checked by `segserve.bank.invariants`):
- `child.parent is node` iff `node.children[child.digest] is child`; `depth`/`start` follow.
- `refs` == number of stored turns whose path (root..leaf) includes the node; a node with
  `refs == 0` is removed at once, so every node in the tree is referenced.
- A prefix hit is a chain-digest hit *and* equal stored tokens; a digest alone never wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from segserve.kv.segment import Segment, chain_digest

from .blocks import DiskCopy

SessionKey = tuple[str, str]  # (scope, session id)


@dataclass(slots=True, eq=False)
class Node:
    scope: str
    digest: str
    parent_digest: str
    tokens: tuple[int, ...]
    parent: Node | None
    depth: int  # 0 for a scope root, 1 for a conversation's first segment
    start: int  # absolute row offset of the first row (sum of ancestor rows)
    nbytes: int  # bytes of its rows when held on their own (restore price)
    seq: int  # creation order: the last LRU tie-breaker, for determinism
    segment: Segment | None = None  # RAM copy
    disk: DiskCopy | None = None  # SSD copy (committed or queued)
    refs: int = 0
    last_used: int = 0
    alive: bool = True
    children: dict[str, Node] = field(default_factory=dict)
    # (parent_digest, rows) of children -> count: which chain hashes a lookup must try here.
    child_keys: dict[tuple[str, int], int] = field(default_factory=dict)
    by_first: dict[int, list[Node]] = field(default_factory=dict)  # partial-match candidates
    holders: dict[SessionKey, int] = field(default_factory=dict)  # turns that end here

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def key(self) -> tuple[str, str]:
        return (self.scope, self.digest)


@dataclass(frozen=True, slots=True)
class Match:
    """Full-match path from the root, plus optionally a node matched on its first rows."""

    nodes: tuple[Node, ...] = ()
    partial: Node | None = None
    partial_rows: int = 0

    @property
    def rows(self) -> int:
        return sum(n.rows for n in self.nodes) + self.partial_rows

    def covering(self, rows: int) -> tuple[Node, ...]:
        """The nodes (full path, then the partial one) that hold the first `rows` rows."""
        out: list[Node] = []
        seen = 0
        for n in (*self.nodes, *((self.partial,) if self.partial else ())):
            if seen >= rows:
                break
            out.append(n)
            seen += n.rows
        return tuple(out)


def common_prefix(a: Sequence[int], b: Sequence[int], off: int) -> int:
    """Largest n with a[:n] == b[off:off+n], by binary search over C-level slice compares."""
    hi = min(len(a), len(b) - off)
    if hi <= 0:
        return 0
    if a[:hi] == b[off : off + hi]:
        return hi
    lo = 0  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[off : off + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def path_of(node: Node) -> list[Node]:
    """Root-excluded path ending at `node`, top-down."""
    out: list[Node] = []
    cur: Node | None = node
    while cur is not None and cur.depth > 0:
        out.append(cur)
        cur = cur.parent
    out.reverse()
    return out


def is_within(node: Node, top: Node) -> bool:
    """True when `node` is `top` or one of its descendants."""
    cur: Node | None = node
    while cur is not None and cur.depth >= top.depth:
        if cur is top:
            return True
        cur = cur.parent
    return False


def subtree(node: Node) -> list[Node]:
    out = [node]
    i = 0
    while i < len(out):
        out.extend(out[i].children.values())
        i += 1
    return out


class SegmentIndex:
    def __init__(self) -> None:
        self._roots: dict[str, Node] = {}
        self._nodes: dict[tuple[str, str], Node] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> list[Node]:
        """A copy: callers may free nodes while they walk it (check `alive`)."""
        return list(self._nodes.values())

    def roots(self) -> list[Node]:
        return list(self._roots.values())

    def get(self, scope: str, digest: str) -> Node | None:
        return self._nodes.get((scope, digest))

    def find_root(self, scope: str) -> Node | None:
        return self._roots.get(scope)

    def root(self, scope: str) -> Node:
        r = self._roots.get(scope)
        if r is None:
            r = Node(scope, "", "", (), None, 0, 0, 0, self._next_seq())
            self._roots[scope] = r
        return r

    def add(
        self, parent: Node, digest: str, parent_digest: str, tokens: tuple[int, ...], nbytes: int
    ) -> Node:
        """Create a child of `parent` (the caller checked that no child has this digest)."""
        if digest in parent.children or (parent.scope, digest) in self._nodes:
            raise ValueError(f"segment {digest} already stored in this scope")
        node = Node(
            parent.scope,
            digest,
            parent_digest,
            tokens,
            parent,
            parent.depth + 1,
            parent.start + parent.rows,
            nbytes,
            self._next_seq(),
        )
        parent.children[digest] = node
        ck = (parent_digest, node.rows)
        parent.child_keys[ck] = parent.child_keys.get(ck, 0) + 1
        if tokens:
            parent.by_first.setdefault(tokens[0], []).append(node)
        self._nodes[node.key] = node
        return node

    def remove(self, node: Node) -> None:
        """Unlink a node that has no children (freeing is always leaf-first)."""
        if node.children:
            raise ValueError("remove() needs a node without children")
        parent = node.parent
        assert parent is not None
        del parent.children[node.digest]
        ck = (node.parent_digest, node.rows)
        parent.child_keys[ck] -= 1
        if parent.child_keys[ck] == 0:
            del parent.child_keys[ck]
        if node.tokens:
            sibs = parent.by_first[node.tokens[0]]
            sibs.remove(node)
            if not sibs:
                del parent.by_first[node.tokens[0]]
        del self._nodes[node.key]
        node.alive = False
        if parent.depth == 0 and not parent.children:
            del self._roots[parent.scope]

    def match(self, scope: str, tokens: tuple[int, ...], is_cold: Callable[[Node], bool]) -> Match:
        """Longest stored prefix of `tokens` in `scope`; ties go to fewer rows on SSD."""
        root = self._roots.get(scope)
        best, best_key = Match(), (0, 0)
        if root is None or not tokens:
            return best
        stack: list[tuple[Node, tuple[Node, ...], int]] = [(root, (), 0)]
        while stack:
            node, path, cold = stack.pop()
            pos = node.start + node.rows
            full = self._full_children(node, tokens, pos)
            for c in full:
                c_cold = cold + (c.rows if is_cold(c) else 0)
                key = (pos + c.rows, -c_cold)
                if key > best_key:
                    best, best_key = Match((*path, c)), key
                stack.append((c, (*path, c), c_cold))
            if pos >= len(tokens):
                continue
            full_ids = {id(c) for c in full}
            for c in node.by_first.get(tokens[pos], ()):
                if id(c) in full_ids:
                    continue
                n = common_prefix(c.tokens, tokens, pos)
                # A partial hit restores the whole node, so price all of its rows.
                key = (pos + n, -(cold + (c.rows if is_cold(c) else 0)))
                if n > 0 and key > best_key:
                    best, best_key = Match(path, c, n), key
        return best

    def _full_children(self, node: Node, tokens: tuple[int, ...], pos: int) -> list[Node]:
        out: list[Node] = []
        for parent_digest, rows in node.child_keys:
            if pos + rows > len(tokens):
                continue
            piece = tokens[pos : pos + rows]
            child = node.children.get(chain_digest(parent_digest, piece))
            # The digest only nominates a candidate; equal tokens (and chain) decide.
            if child is not None and child.parent_digest == parent_digest and child.tokens == piece:
                out.append(child)
        return out

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
