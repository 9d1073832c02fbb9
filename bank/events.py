"""Block events: the bank's contents as fixed-size blocks with chained hashes.

What KV-aware routers (llm-d, Dynamo) consume from vLLM: "these blocks are now stored",
"these blocks are gone", "everything is gone". The bank stores variable-length segments
in a tree; this module re-cuts every stored path into blocks of `block_size` tokens
aligned to absolute positions (block j = tokens [j*B, (j+1)*B) of the conversation), so
the same tokens give the same block hashes however they were split into segments, in any
replica and after a restart. A trailing partial block is not announced (vLLM announces
only full blocks too).

Owns: the event values (`BlocksStored`, `BlocksRemoved`, `AllCleared`), the hashing
(`block_hashes`), the `NodeObserver` protocol the store calls, and `BlockEvents`, the
observer that turns node additions and removals into block events for a sink.
Who calls: `segserve.bank.store.Store` on the engine thread, when a node enters or leaves the
segment tree; `Bank.observe` when it attaches (a full replay) and `Bank.close`. The sink
runs on the engine thread too: it must only queue (the server's publisher does).
Nothing here imports a transport: the server wires the sink (`segserve.server.kv_events`).

Presence, not tier: a block is stored while any live node completes it, in RAM or on the
SSD tier (a restore from SSD is far cheaper than a prefill, so a router should still send
the conversation here). Eviction from RAM to SSD is therefore silent; a drop (RAM-only
bank, disk cap, a corrupt block, a deleted session) removes blocks.

Token ids are private: a `BlocksStored` carries its blocks' tokens (the prompt text, for
anyone who can decode it) only when the observer was built with `token_ids=True`;
otherwise `token_ids` is empty and the tokens never leave the bank.

Hashes: A_0 = the scope (namespace + cache salt digest), A_{j+1} =
chain_digest(A_j, tokens of block j); a block's hash is the low 63 bits of A_{j+1} as an
integer (fits signed and unsigned 64-bit decoders). Refcounted per (scope, hash): two nodes
of differently split paths may complete the same block; it is removed with the last one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Union

from segserve.kv.segment import chain_digest

from .index import Node

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size: what routers are usually set to
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive blocks of one chain became present (`parent_block_hash` precedes them)."""

    scope: str
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # block_size tokens per block, in order; () when withheld
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    scope: str
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Forget everything this bank announced before (attach, restart, close)."""


BankEvent = Union[BlocksStored, BlocksRemoved, AllCleared]  # noqa: UP007 (py3.10 runtime)


class NodeObserver(Protocol):
    """What the store reports: a node entered or left the tree; the tree was reset."""

    def node_added(self, node: Node) -> None: ...

    def node_removed(self, node: Node) -> None: ...

    def cleared(self) -> None: ...


def hash_of(digest: str) -> int:
    return int(digest[:16], 16) & _MASK63


def block_hashes(scope: str, tokens: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the full blocks of a conversation's tokens in `scope` (reference)."""
    out: list[int] = []
    aligned = scope
    for j in range(len(tokens) // block_size):
        aligned = chain_digest(aligned, tokens[j * block_size : (j + 1) * block_size])
        out.append(hash_of(aligned))
    return out


@dataclass(frozen=True, slots=True)
class _Tail:
    """Chain state at the end of a node: the last aligned digest, the tokens after it."""

    aligned: str
    tail: tuple[int, ...]
    last_hash: int | None  # hash of the last full block at or before the node's end
    blocks: tuple[int, ...]  # hashes of the blocks this node completes


class BlockEvents:
    """A `NodeObserver` that emits block events to `sink` (a list per tree change);
    `token_ids` says whether stored events carry their tokens (default: hashes only)."""

    def __init__(
        self,
        sink: Callable[[list[BankEvent]], None],
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        token_ids: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.sink = sink
        self.block_size = block_size
        self.token_ids = token_ids
        self._tails: dict[tuple[str, str], _Tail] = {}
        self._refs: Counter[tuple[str, int]] = Counter()
        self.unchained = 0  # nodes whose parent was never announced (should stay 0)

    def present(self) -> set[tuple[str, int]]:
        """(scope, hash) of every block announced as stored and not removed since."""
        return set(self._refs)

    def node_added(self, node: Node) -> None:
        parent = node.parent
        if parent is None or parent.depth == 0:
            base = _Tail(node.scope, (), None, ())
        else:
            got = self._tails.get(parent.key)
            if got is None:  # cannot chain (a bug): never fail the bank call for an event
                self.unchained += 1
                return
            base = got
        b = self.block_size
        toks = base.tail + node.tokens
        aligned, last = base.aligned, base.last_hash
        hashes: list[int] = []
        full = len(toks) // b
        for j in range(full):
            aligned = chain_digest(aligned, toks[j * b : (j + 1) * b])
            hashes.append(hash_of(aligned))
        self._tails[node.key] = _Tail(aligned, toks[full * b :], hashes[-1] if hashes else last,
                                      tuple(hashes))
        events: list[BankEvent] = []
        run: list[int] = []
        run_parent, prev = last, last
        for j, h in enumerate(hashes):
            key = (node.scope, h)
            self._refs[key] += 1
            if self._refs[key] == 1:
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:
                events.append(self._stored(node.scope, run, run_parent, toks, j - len(run)))
                run = []
            prev = h
        if run:
            events.append(self._stored(node.scope, run, run_parent, toks, full - len(run)))
        if events:
            self.sink(events)

    def _stored(
        self, scope: str, run: list[int], parent: int | None, toks: tuple[int, ...], first: int
    ) -> BlocksStored:
        b = self.block_size
        tokens = toks[first * b : (first + len(run)) * b] if self.token_ids else ()
        return BlocksStored(scope, tuple(run), parent, tokens, b)

    def node_removed(self, node: Node) -> None:
        tail = self._tails.pop(node.key, None)
        if tail is None:
            return
        gone: list[int] = []
        for h in tail.blocks:
            key = (node.scope, h)
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                del self._refs[key]
                gone.append(h)
        if gone:
            self.sink([BlocksRemoved(node.scope, tuple(gone))])

    def cleared(self) -> None:
        self._tails.clear()
        self._refs.clear()
        self.sink([AllCleared()])
