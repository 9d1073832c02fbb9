"""SSD block format: how a segment's rows become content-addressed block files and back.

Owns: `Layout` (per-layer K/V shape + dtype of a segment), `Chunk`/`DiskCopy` (which
blocks hold a stored segment), block ids, the block file encoding, and the two conversions
MLX <-> numpy.
Who calls: `to_host` and `to_segment` create/read MLX arrays, so only the engine thread
calls them. `chunk_payload`, `encode_block`, `decode_block` are pure numpy/bytes and run on
the writer thread (encode) or the engine thread (decode on restore).

Blocks are aligned to absolute row positions, not to segments: block j covers rows
[j*B, (j+1)*B) of the conversation. A segment covering rows [a, c) is stored as the pieces
of those blocks it overlaps ("chunks"). A chunk's id hashes the namespace, every token
before its aligned block start (through the aligned chain A_j), its offset inside the
block and the tokens up to its end, so the same rows of the same history get the same id
however they were split into segments (merges, forks, prefix views): stored once.

    rows:     0        B        2B       3B
    blocks:   |--------|--------|--------|
    segment:      [a ............... c)
    chunks:       [a,B) [B,2B)     [2B,c)

Block file: 24-byte header (magic, format version, rows, payload length) then, per layer,
K rows then V rows, each C-ordered [1, H, rows, D] as raw bytes of an unsigned integer
view of the dtype (bfloat16 has no numpy dtype; the bits are what matters).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from segserve.kv.segment import Segment, chain_digest

FORMAT_VERSION = 1
MAGIC = b"SSKVBLK\x00"
HEADER = struct.Struct("<8sIIQ")  # magic, format version, rows, payload bytes

# Allow-list of stored dtypes: name -> (MLX dtype, same-size unsigned MLX dtype, numpy dtype).
_DTYPES: dict[str, tuple[mx.Dtype, mx.Dtype, type[np.unsignedinteger]]] = {
    "float16": (mx.float16, mx.uint16, np.uint16),
    "bfloat16": (mx.bfloat16, mx.uint16, np.uint16),
    "float32": (mx.float32, mx.uint32, np.uint32),
}


class BlockCorrupt(Exception):
    """A block file that does not decode to what the manifest says it holds."""


@dataclass(frozen=True, slots=True)
class Layout:
    layers: int
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return int(np.dtype(_DTYPES[self.dtype][2]).itemsize)

    @property
    def row_bytes(self) -> int:
        return self.layers * (self.k_heads * self.k_dim + self.v_heads * self.v_dim) * self.itemsize

    def block_file_bytes(self, rows: int) -> int:
        return HEADER.size + rows * self.row_bytes

    def encode(self) -> str:
        return f"{self.layers},{self.k_heads},{self.k_dim},{self.v_heads},{self.v_dim},{self.dtype}"

    @staticmethod
    def decode(text: str) -> Layout:
        parts = text.split(",")
        if len(parts) != 6 or parts[5] not in _DTYPES:
            raise ValueError(f"bad layout {text!r}")
        a, b, c, d, e = (int(p) for p in parts[:5])
        return Layout(a, b, c, d, e, parts[5])


@dataclass(frozen=True, slots=True)
class Chunk:
    block_id: str
    rows: int


@dataclass(frozen=True, slots=True, eq=False)
class DiskCopy:
    """Where a stored segment's rows live on SSD (in order); identity-compared on purpose."""

    chunks: tuple[Chunk, ...]
    layout: Layout

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.chunks)


@dataclass(frozen=True, slots=True)
class PlannedChain:
    """A chain entry to publish once its segment is committed (shared SSD tier only).

    Names full aligned block j: `digest` is A_{j+1}, `parent` A_j, `tokens` the block's
    own tokens, `chunks` the stored chunks (of this and earlier segments) holding its rows.
    """

    digest: str
    parent: str
    start: int
    tokens: tuple[int, ...]
    layout: Layout
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class HostRows:
    """A segment's rows as numpy arrays (unsigned views; made on the engine thread)."""

    keys: tuple[np.ndarray, ...]  # per layer: [1, H_k, rows, D_k]
    values: tuple[np.ndarray, ...]  # per layer: [1, H_v, rows, D_v]


def layout_of(seg: Segment) -> Layout | None:
    """The segment's uniform layout, or None when it cannot be stored (odd shapes/dtype)."""
    if not seg.keys:
        return None
    k0, v0 = seg.keys[0], seg.values[0]
    name = str(k0.dtype).rsplit(".", 1)[-1]
    if name not in _DTYPES or k0.ndim != 4 or v0.ndim != 4 or k0.shape[0] != 1:
        return None
    for k, v in zip(seg.keys, seg.values, strict=True):
        if k.shape[:2] + k.shape[3:] != k0.shape[:2] + k0.shape[3:] or k.dtype != k0.dtype:
            return None
        if v.shape[:2] + v.shape[3:] != v0.shape[:2] + v0.shape[3:] or v.dtype != k0.dtype:
            return None
    return Layout(len(seg.keys), k0.shape[1], k0.shape[3], v0.shape[1], v0.shape[3], name)


def plan_chunks(
    blocks_root: str, path_tokens: Sequence[int], start: int, rows: int, block_rows: int
) -> tuple[Chunk, ...]:
    """Chunks for rows [start, start+rows) of a history whose tokens are `path_tokens`."""
    toks = tuple(path_tokens)
    aligned, j = blocks_root, 0  # aligned == A_j: chain over tokens[0 : j*block_rows]
    while (j + 1) * block_rows <= start:
        aligned = chain_digest(aligned, toks[j * block_rows : (j + 1) * block_rows])
        j += 1
    out: list[Chunk] = []
    pos, stop = start, start + rows
    while pos < stop:
        lo, hi = j * block_rows, (j + 1) * block_rows
        end = min(hi, stop)
        out.append(Chunk(chain_digest(f"{aligned}:{pos - lo}", toks[lo:end]), end - pos))
        if end == hi:
            aligned = chain_digest(aligned, toks[lo:hi])
            j += 1
        pos = end
    return tuple(out)


def aligned_chain(blocks_root: str, tokens: Sequence[int], block_rows: int) -> list[str]:
    """[A_0, A_1, ..., A_k] over the k full aligned blocks of `tokens` (A_0 = blocks_root):
    the same chain `plan_chunks` names chunks by, so the shared tier's chain entries and
    block ids agree."""
    toks = tuple(tokens)
    out = [blocks_root]
    for j in range(len(toks) // block_rows):
        out.append(chain_digest(out[-1], toks[j * block_rows : (j + 1) * block_rows]))
    return out


def to_host(seg: Segment, layout: Layout) -> HostRows:
    """A segment's arrays as numpy views of their own buffers (no copy). Engine thread only:
    the arrays are evaluated here, all in one evaluation.

    Why views: copying every layer's rows (one evaluation and one fresh allocation per
    array) took 10-28 ms per finished turn on the engine thread of a 28-layer model on the
    2-core CPU, before the turn's last chunk went out and while every other session's
    decode waited (read off a py-spy profile of the serving process; `tests/test_bank_cold.py`
    checks the views against copies). Safe for the writer thread to read: a sealed
    segment's arrays are never written again (`SegmentedCache._exact` copies a tail that a
    batch stack shares; a tail buffer is dropped at seal, not reused), and each view keeps
    its MLX array, so its memory, alive until the job is done."""
    udt = _DTYPES[layout.dtype][1]
    arrays = [a.view(udt) for a in (*seg.keys, *seg.values)]
    mx.eval(arrays)
    host = [np.asarray(a) for a in arrays]
    n = len(seg.keys)
    return HostRows(tuple(host[:n]), tuple(host[n:]))


def chunk_payload(host: HostRows, r0: int, r1: int) -> bytes:
    """Raw bytes of rows [r0, r1) of every layer (writer thread: numpy only)."""
    parts: list[bytes] = []
    for k, v in zip(host.keys, host.values, strict=True):
        parts.append(np.ascontiguousarray(k[:, :, r0:r1, :]).tobytes())
        parts.append(np.ascontiguousarray(v[:, :, r0:r1, :]).tobytes())
    return b"".join(parts)


def encode_block(payload: bytes, rows: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, rows, len(payload)) + payload


def decode_block(data: bytes, layout: Layout, rows: int) -> HostRows:
    """Parse one block file (already checksum-verified); raise BlockCorrupt on any mismatch."""
    if len(data) < HEADER.size:
        raise BlockCorrupt("truncated header")
    magic, version, got_rows, plen = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockCorrupt(f"bad magic/version {magic!r}/{version}")
    if got_rows != rows or plen != rows * layout.row_bytes or len(data) != HEADER.size + plen:
        raise BlockCorrupt("size does not match the manifest")
    flat = np.frombuffer(data, dtype=_DTYPES[layout.dtype][2], offset=HEADER.size)
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    off = 0
    for _ in range(layout.layers):
        for heads, dim, out in (
            (layout.k_heads, layout.k_dim, keys),
            (layout.v_heads, layout.v_dim, values),
        ):
            n = heads * rows * dim
            out.append(flat[off : off + n].reshape(1, heads, rows, dim))
            off += n
    return HostRows(tuple(keys), tuple(values))


def host_slice(host: HostRows, r0: int, r1: int) -> HostRows:
    return HostRows(
        tuple(k[:, :, r0:r1, :] for k in host.keys), tuple(v[:, :, r0:r1, :] for v in host.values)
    )


def to_segment(
    parts: Sequence[HostRows], layout: Layout, tokens: tuple[int, ...], parent_digest: str
) -> Segment:
    """Build one Segment from the chunks of ONE stored segment. Engine thread only."""
    dt = _DTYPES[layout.dtype][0]

    def join(arrays: list[np.ndarray]) -> mx.array:
        # One stored segment's chunks become one buffer per layer; never the whole history.
        whole = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=2)
        return mx.array(np.ascontiguousarray(whole)).view(dt)

    keys = tuple(join([p.keys[i] for p in parts]) for i in range(layout.layers))
    values = tuple(join([p.values[i] for p in parts]) for i in range(layout.layers))
    mx.eval(*keys, *values)
    return Segment.seal(keys, values, tokens, parent_digest)
