"""A GGUF file's metadata and tensor table, read straight into the values the loader keeps.

Owns: `GGUFFile` (open a file, its `metadata` as plain values, its `tensors` with a
memory-mapped view of each one's bytes, `drop_pages` for bytes already converted) and
`drop_pages` itself. The loader (`segserve.server.runner.gguf`) is its only user.

Why not gguf-py's `GGUFReader`: it builds a few numpy views per metadata value before anyone
asks for them, ~1.5 KB per vocabulary token (~150 MB of Python objects for a 49K-token
vocabulary with its merges). Freed, they leave the heap fragmented around the values that
stay: loading a 28-layer Q4_K_M file of a 49K vocabulary held ~45 MB more for the rest of the
process than the metadata's own values (one-off `/proc/self/status` readings around the
load; `tests/test_gguf_families.py` bounds the load's peak). Here each value is decoded once,
strings to `str`, numbers to one array per value. gguf-py still supplies the format's
constants (value and tensor types, block sizes), and the tests compare this reading with
its reader on the files they write.

Invariants: little-endian files of format versions 2 and 3 (others are refused by name); every
tensor's bytes lie inside the file; a tensor's view has gguf-py's shape (floats and integers
as their dtype in row-major order, every other type as raw bytes per row).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

__all__ = ["GGUFFile", "GGUFFormatError", "TensorEntry", "drop_pages"]

MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
DEFAULT_ALIGNMENT = 32

V = GGUFValueType
_NUMBERS: dict[GGUFValueType, np.dtype[Any]] = {
    V.UINT8: np.dtype("<u1"), V.INT8: np.dtype("<i1"), V.UINT16: np.dtype("<u2"), V.INT16: np.dtype("<i2"),
    V.UINT32: np.dtype("<u4"), V.INT32: np.dtype("<i4"), V.FLOAT32: np.dtype("<f4"), V.BOOL: np.dtype("?"),
    V.UINT64: np.dtype("<u8"), V.INT64: np.dtype("<i8"), V.FLOAT64: np.dtype("<f8"),
}
T = GGMLQuantizationType
# Tensor types whose view is typed (gguf-py's reader does the same); every other type is bytes.
_TYPED: dict[GGMLQuantizationType, type[np.generic]] = {
    T.F16: np.float16, T.F32: np.float32, T.F64: np.float64,
    T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader can read (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's `ne`: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the mapped file


def _metadata_value(value: np.ndarray | np.generic) -> mx.array:
    """A number or numeric array in `mx.load`'s shapes (what the tokenizer reads): an
    `mx.array` of the stored type, 0-d for a scalar, float64 narrowed to float32."""
    arr = np.asarray(value)
    return mx.array(arr.astype(np.float32) if arr.dtype == np.float64 else arr)


class _Cursor:
    """Sequential little-endian reads over the mapped header, bounds-checked."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise GGUFFormatError(f"truncated at byte {start} (wanted {n} more bytes)")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.buf, self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.buf, self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {start} is not UTF-8") from exc

    def numbers(self, dtype: np.dtype[Any], count: int) -> np.ndarray:
        start = self.take(dtype.itemsize * count)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()

    def value(self, kind: int) -> Any:
        try:
            vtype = GGUFValueType(kind)
        except ValueError as exc:
            raise GGUFFormatError(f"unknown metadata value type {kind}") from exc
        if vtype == V.STRING:
            return self.string()
        if vtype == V.ARRAY:
            inner = self.u32()
            count = self.u64()
            if inner in _NUMBERS:
                return _metadata_value(self.numbers(_NUMBERS[GGUFValueType(inner)], count))
            if inner == V.STRING:
                return [self.string() for _ in range(count)]
            return [self.value(inner) for _ in range(count)]  # arrays of arrays
        return _metadata_value(self.numbers(_NUMBERS[vtype], 1)[0])


def drop_pages(mapped: Any, offset: int, nbytes: int) -> None:
    """Unmap the pages of bytes [offset, offset + nbytes) of the file: they were converted
    and are not read again, so they need not count in this process's memory (the page cache
    may keep them; they are clean, file-backed pages). Only those pages: advising the whole
    mapping after every tensor walks every page table entry of the file once per tensor. A
    page shared with the next tensor is read back in when that tensor is converted."""
    if not hasattr(mmap, "MADV_DONTNEED") or nbytes <= 0:
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(len(mapped), offset + nbytes)
    if end <= start:
        return
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # advice only: a refusal changes nothing served
        pass


class GGUFFile:
    """An open GGUF: `version`, `metadata` (key -> str, list, or mx.array), `tensors` in file
    order, `data_start` (where the tensor data begins). Tensor views stay valid while the
    object lives; the mapping goes with the last reference to it or its views."""

    def __init__(self, path: Path | str) -> None:
        with open(path, "rb") as f:
            try:
                self.mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from exc
        cur = _Cursor(self.mapped)
        if cur.u32() != MAGIC:
            raise GGUFFormatError("not a GGUF file (no GGUF magic)")
        self.version = cur.u32()
        if self.version & 0xFFFF == 0:
            raise GGUFFormatError("big-endian GGUF files are not supported")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF format version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.u64(), cur.u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        align = self.metadata.get("general.alignment")
        alignment = int(np.array(align)) if isinstance(align, mx.array) else DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
        self.data_start = cur.pos + (-cur.pos % alignment)
        self.tensors = self._tensors(infos)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        n_dims = cur.u32()
        if not 1 <= n_dims <= 4:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(cur.u64() for _ in range(n_dims))
        return name, dims, cur.u32(), cur.u64()

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[TensorEntry]:
        out: list[TensorEntry] = []
        seen: set[str] = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name} appears twice")
            seen.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
            except ValueError as exc:
                raise GGUFFormatError(f"tensor {name} has unknown type {raw_type}") from exc
            n_elements = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[kind]
            if dims[0] % block:
                raise GGUFFormatError(f"tensor {name}: rows of {dims[0]} are not whole {kind.name} blocks")
            n_bytes = n_elements * size // block
            offset = self.data_start + rel
            if offset + n_bytes > len(self.mapped):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file")
            row_major = tuple(reversed(dims))
            if kind in _TYPED:
                data = np.frombuffer(self.mapped, dtype=_TYPED[kind], count=n_elements, offset=offset)
                data = data.reshape(row_major)
            else:
                data = np.frombuffer(self.mapped, dtype=np.uint8, count=n_bytes, offset=offset)
                data = data.reshape(quant_shape_to_byte_shape(row_major, kind))
            out.append(TensorEntry(name, kind, dims, n_elements, n_bytes, offset, data))
        return out

    def drop_pages(self, offset: int, nbytes: int) -> None:
        drop_pages(self.mapped, offset, nbytes)

    def drop_header_pages(self) -> None:
        """The metadata and tensor table's pages: read once, into `metadata` and `tensors`."""
        drop_pages(self.mapped, 0, self.data_start)
