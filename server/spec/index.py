"""Draft indexes: where the conversation already said what comes next.

Owns: `SegmentIndex` (one sealed segment's n-gram index, immutable), `TailIndex` (the
running turn's, grows token by token), `IndexRegistry` (segment indexes by content
digest, bounded) and `propose` (the lookup over a session's segment list and its tail).
Plain Python and numpy: no MLX, no model.

Why per segment: a sealed segment never changes, so its index is built once when it is
sealed (or restored) and every fork, rewind and continuation that references the segment
shares it. The registry keys indexes by the segment's chain digest (which covers its
tokens and everything before them), so two snapshots holding the same segment find the
same index; a prefix view of a segment uses its owner's index, limited to the view's rows.
Indexes are not written to the SSD tier: a restored segment's index is rebuilt from its
token ids (`IndexRegistry.ensure`, about 1 ms per 8K tokens).

Layout of a `SegmentIndex` of R tokens, for each n in 1..3: the n-grams ending before
position e (e = n..R-1, so each has a follower inside the segment) encoded as one int64
key each, sorted (stable, so equal keys keep ascending positions), with their follower
positions as int32: 12 bytes per token per n; and the tokens themselves as int64 (for the
backward comparison below): `INDEX_BYTES_PER_TOKEN` (44) in all. A lookup is a binary
search (`np.searchsorted`); the candidates' tokens are compared, so a key collision (token
ids past 2**21) can only miss, never propose wrong tokens.

Lookup order (`propose`): the longest n first (3, 2, then 1). Among the occurrences of that
n-gram (the tail's and every segment's, the most recent `MAX_CANDIDATES` of each), the one
whose preceding tokens agree with the sequence's for longest (up to `LOOKBACK` tokens, read
backwards inside the occurrence's own segment or turn) wins, the most recent on a tie. Why:
text that repeats a phrase ("... is noted in the log. ") has many occurrences of every
short n-gram at a phrase's end, and the most recent one is then the wrong one; copying a
document, the occurrence whose longer context agrees is the one being copied
(`bench/speculative.py`'s JSON echo workload on the embedded model: acceptance 0.51 with
the most recent occurrence, 0.75 with this rule). The proposal is the up to K tokens that
followed the chosen occurrence, read on through the next segments and the tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAX_NGRAM = 3
_BITS = 21  # token id bits per key slot (3 * 21 = 63 bits: one int64)
_MASK = (1 << _BITS) - 1
# Per n: key int64 + follower position int32; and the token itself as int64.
INDEX_BYTES_PER_TOKEN = MAX_NGRAM * (8 + 4) + 8
LOOKBACK = 32  # tokens compared backwards from a match to rank its occurrences
MAX_CANDIDATES = 256  # the most recent occurrences of an n-gram ranked, per segment and tail


def _key(tokens: Sequence[int]) -> int:
    k = 0
    for t in tokens:
        k = (k << _BITS) | (int(t) & _MASK)
    return k


@dataclass(frozen=True, slots=True)
class _Table:
    keys: npt.NDArray[np.int64]  # sorted
    follow: npt.NDArray[np.int32]  # follower position of each key, ascending within a key


class SegmentIndex:
    """The n-gram index of one sealed segment's tokens (immutable once built)."""

    __slots__ = ("tokens", "array", "_tables")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: tuple[int, ...] = tuple(int(t) for t in tokens)
        self.array: npt.NDArray[np.int64] = np.asarray(self.tokens, dtype=np.int64)
        t = self.array & _MASK
        r = len(t)
        self._tables: list[_Table] = []
        for n in range(1, MAX_NGRAM + 1):
            m = r - n  # n-grams with a follower: start j in 0..r-n-1, follower j + n
            if m <= 0:
                self._tables.append(_Table(np.zeros(0, np.int64), np.zeros(0, np.int32)))
                continue
            keys = np.zeros(m, dtype=np.int64)
            for i in range(n):
                keys = (keys << _BITS) | t[i : i + m]
            order = np.argsort(keys, kind="stable")
            self._tables.append(_Table(keys[order], (order + n).astype(np.int32)))

    @property
    def nbytes(self) -> int:
        return self.array.nbytes + sum(tb.keys.nbytes + tb.follow.nbytes for tb in self._tables)

    def find(self, context: Sequence[int], limit: int | None = None) -> int | None:
        """The follower position of the last occurrence of `context` (1..3 tokens) whose
        follower lies before `limit` (default: the segment's end), or None."""
        found = self.occurrences(context, len(self.tokens) if limit is None else limit, most=len(self.tokens))
        return int(found[-1]) if len(found) else None

    def occurrences(self, context: Sequence[int], limit: int, most: int = MAX_CANDIDATES) -> npt.NDArray[np.int64]:
        """The follower positions (< `limit`) of the last `most` occurrences of `context`
        (1..3 tokens), ascending; colliding keys whose tokens differ left out."""
        n = len(context)
        if not 1 <= n <= MAX_NGRAM:
            return np.zeros(0, np.int64)
        tb = self._tables[n - 1]
        k = _key(context)
        lo = int(np.searchsorted(tb.keys, k, side="left"))
        hi = int(np.searchsorted(tb.keys, k, side="right"))
        within = tb.follow[lo:hi]
        follows: npt.NDArray[np.int64] = within[: int(np.searchsorted(within, limit, side="left"))][-most:].astype(
            np.int64)
        keep = np.ones(len(follows), dtype=bool)
        for i, c in enumerate(context):  # token i of the n-gram sits at follower - n + i
            keep &= self.array[follows - n + i] == int(c)
        return follows[keep]


class TailIndex:
    """The running turn's tokens and their n-gram index (a dict of positions: the tail is
    short and grows one token at a time). `lead` is the history's last tokens, so n-grams
    that start before the turn and end inside it are found too."""

    def __init__(self, lead: Sequence[int] = ()) -> None:
        self.tokens: list[int] = [int(t) for t in lead[-(MAX_NGRAM - 1):]] if MAX_NGRAM > 1 else []
        self.lead = len(self.tokens)
        self._at: dict[tuple[int, ...], list[int]] = {}  # n-gram -> follower positions, ascending
        self._array = np.zeros(max(64, 2 * len(self.tokens)), dtype=np.int64)
        self._array[: len(self.tokens)] = self.tokens
        for i in range(1, len(self.tokens)):
            self._register(i)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            e = len(self.tokens) - 1
            if e >= len(self._array):  # doubled: appending stays O(1) amortised
                self._array = np.concatenate([self._array, np.zeros_like(self._array)])
            self._array[e] = int(t)
            self._register(e)

    @property
    def array(self) -> npt.NDArray[np.int64]:
        """The tokens as int64 (a view: valid until the next `extend`)."""
        return self._array[: len(self.tokens)]

    def _register(self, e: int) -> None:
        """The n-grams that end just before position e now have a follower (e)."""
        for n in range(1, MAX_NGRAM + 1):
            if e - n >= 0:
                self._at.setdefault(tuple(self.tokens[e - n : e]), []).append(e)

    def find(self, context: Sequence[int]) -> int | None:
        """The follower position of the last occurrence of `context`, or None."""
        at = self._at.get(tuple(int(c) for c in context))
        return at[-1] if at else None

    def occurrences(self, context: Sequence[int], most: int = MAX_CANDIDATES) -> npt.NDArray[np.int64]:
        """The follower positions of the last `most` occurrences of `context`, ascending."""
        at = self._at.get(tuple(int(c) for c in context))
        return np.asarray(at[-most:] if at else [], dtype=np.int64)


class IndexRegistry:
    """Segment indexes by owner digest, least recently used dropped past `max_bytes`
    (a dropped index is rebuilt from the segment's tokens when next needed)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._by_digest: OrderedDict[str, SegmentIndex] = OrderedDict()
        self.bytes = 0
        self.built = 0  # indexes built (a rebuild after eviction counts again)

    def __len__(self) -> int:
        return len(self._by_digest)

    def ensure(self, digest: str, tokens: Sequence[int]) -> SegmentIndex:
        idx = self._by_digest.get(digest)
        if idx is not None:
            self._by_digest.move_to_end(digest)
            return idx
        idx = SegmentIndex(tokens)
        self._by_digest[digest] = idx
        self.bytes += idx.nbytes
        self.built += 1
        while self.bytes > self.max_bytes and len(self._by_digest) > 1:
            _, old = self._by_digest.popitem(last=False)
            self.bytes -= old.nbytes
        return idx


@dataclass(frozen=True, slots=True)
class IndexedSegment:
    """One entry of a session's segment list for `propose`: its owner's index and how
    many of the owner's rows the snapshot holds (a prefix view holds fewer)."""

    index: SegmentIndex
    rows: int


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: tuple[int, ...]
    ngram: int  # the length of the context that matched (3, 2 or 1)
    source: str  # "tail" or "segment"


def _agreement(array: npt.NDArray[np.int64], follows: npt.NDArray[np.int64], n: int,
               recent: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """For each occurrence (its follower position in `array`) of the sequence's last n
    tokens: how many tokens before it, up to `recent`'s length, agree with the sequence's
    (`recent`: its last tokens, oldest first), n included. One gather of every candidate's
    preceding tokens (a loop over the offsets measured ~10x slower in Python)."""
    back = recent[::-1][n:]  # the sequence's tokens before its last n, newest first
    if len(back) == 0:
        return np.full(len(follows), n, dtype=np.int64)
    pos = follows[:, None] - n - 1 - np.arange(len(back))[None, :]
    same = (array[np.maximum(pos, 0)] == back[None, :]) & (pos >= 0)
    agree: npt.NDArray[np.int64] = n + np.cumprod(same, axis=1).sum(axis=1)
    return agree


def _recent(segments: Sequence[IndexedSegment], tail: TailIndex, count: int) -> npt.NDArray[np.int64]:
    """The sequence's last `count` tokens (the turn's, then the segments' before them)."""
    parts = [tail.array[tail.lead :][-count:]]
    need = count - len(parts[0])
    for s in reversed(segments):
        if need <= 0:
            break
        piece = s.index.array[: s.rows][-need:]
        parts.append(piece)
        need -= len(piece)
    return np.concatenate(parts[::-1]) if len(parts) > 1 else parts[0]


def propose(segments: Sequence[IndexedSegment], tail: TailIndex, k: int,
            min_ngram: int = 1) -> Proposal | None:
    """Up to `k` tokens that followed the longest match of the sequence's last tokens (the
    tail's end): its occurrence whose earlier tokens agree longest with the sequence's,
    the most recent on a tie. None when nothing matches (or k < 1)."""
    if k < 1 or len(tail.tokens) <= tail.lead:
        return None
    recent: npt.NDArray[np.int64] | None = None
    for n in range(min(MAX_NGRAM, len(tail.tokens)), min_ngram - 1, -1):
        ctx = tail.tokens[-n:]
        # Sources from the most recent: the tail (-1), then the segments from the last.
        best: tuple[int, int, int] | None = None  # (agreement, source, follower position)
        sources: list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]] = [
            (-1, tail.array, tail.occurrences(ctx))]
        sources += [(si, segments[si].index.array, segments[si].index.occurrences(ctx, segments[si].rows))
                    for si in range(len(segments) - 1, -1, -1)]
        for si, array, follows in sources:
            if len(follows) == 0:
                continue
            if recent is None:
                recent = _recent(segments, tail, LOOKBACK)
            agree = _agreement(array, follows, n, recent)
            i = len(agree) - 1 - int(np.argmax(agree[::-1]))  # the most recent of the longest
            if best is None or int(agree[i]) > best[0]:
                best = (int(agree[i]), si, int(follows[i]))
        if best is None:
            continue
        _, si, p = best
        if si < 0:
            return Proposal(tuple(tail.tokens[p : p + k]), n, "tail")
        s = segments[si]
        out = list(s.index.tokens[p : min(s.rows, p + k)])
        for nxt in segments[si + 1 :]:  # read on through the later segments
            if len(out) >= k:
                break
            out.extend(nxt.index.tokens[: min(nxt.rows, k - len(out))])
        if len(out) < k:
            out.extend(tail.tokens[tail.lead : tail.lead + k - len(out)])
        return Proposal(tuple(out[:k]), n, "segment")
    return None
