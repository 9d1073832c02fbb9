"""`segserve.server.runner.gguf_file` against gguf-py's own reader, and on broken files.

The loader reads GGUF metadata and tensor tables itself (the module says why); these tests
hold it to gguf-py's reading of the same files: every metadata value, every tensor's type,
shape, offset, size and bytes. Broken files are refused with a message naming what is wrong,
through the loader's `ModelLoadError`.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from segserve.server.runner.gguf import ModelLoadError, embedded_model_path, read_gguf
from segserve.server.runner.gguf_file import GGUFFile, GGUFFormatError
from tests.gguf_support import write_gguf


def _reader_value(field: Any) -> Any:
    """gguf-py's value of one field, in the shapes `GGUFFile.metadata` gives."""
    types = list(field.types)
    if types[0] == GGUFValueType.STRING:
        return str(field.contents())
    if types[0] == GGUFValueType.ARRAY and len(types) > 1 and types[1] == GGUFValueType.STRING:
        return [str(s) for s in field.contents()]
    if types[0] == GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        return np.concatenate(parts) if parts else np.zeros(0)
    return field.parts[field.data[0]][0]


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, mx.array):
        a, b = np.array(ours), np.asarray(theirs)
        if b.dtype == np.float64:  # narrowed to float32, as mx.load does
            b = b.astype(np.float32)
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return bool(ours == theirs)


def _compare(path: Path) -> None:
    ours = GGUFFile(path)
    reader = GGUFReader(str(path), "r")
    theirs = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(theirs)
    for key, field in theirs.items():
        assert _same(ours.metadata[key], _reader_value(field)), key
    assert ours.data_start == reader.data_offset
    assert len(ours.tensors) == len(reader.tensors)
    for a, b in zip(ours.tensors, reader.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, tuple(int(n) for n in b.shape), int(b.n_elements), int(b.n_bytes),
            int(b.data_offset))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("family,recipe", [("llama3", "Q4_K_M"), ("qwen2", "Q8_0"), ("gemma3", "Q5_K_M"),
                                           ("phi3", "F16"), ("llama", "Q4_0")])
def test_reads_what_gguf_py_reads(family: str, recipe: str, tmp_path: Path) -> None:
    _compare(write_gguf(tmp_path / "m.gguf", family, recipe, tokenizer_from=embedded_model_path()))


def test_reads_the_embedded_model_as_gguf_py_does() -> None:
    _compare(embedded_model_path())


def test_every_value_type_and_alignment(tmp_path: Path) -> None:
    """Scalars of every numeric type, bools, strings, numeric and string arrays, nested
    arrays, and a non-default alignment: what gguf-py writes, read back as gguf-py reads it."""
    path = tmp_path / "v.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 1)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.floats", [0.5, 1.5, 2.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.arange(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    m = f.metadata
    assert m["t.u64"].item() == 2**63 + 1 and m["t.u64"].dtype == mx.uint64
    assert m["t.f64"].dtype == mx.float32 and m["t.bool"].item() is True
    assert m["t.str"] == "héllo ✓" and m["t.strs"] == ["a", "", "ü"]
    assert [np.array(v).tolist() for v in m["t.nested"]] == [[1, 2], [3]]
    assert f.data_start % 64 == 0
    assert np.array_equal(f.tensors[0].data, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert f.tensors[1].data.dtype == np.float16 and f.tensors[1].data.shape == (5,)
    reader = GGUFReader(str(path), "r")
    for key in ("t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.f32", "t.i64", "t.floats"):
        assert _same(m[key], _reader_value(reader.fields[key])), key


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


@pytest.mark.parametrize("data,message", [
    (b"", "empty"),
    (b"GGML" + bytes(20), "no GGUF magic"),
    (_header(version=1), "version 1"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (_header(n_kv=1) + _string("k"), "truncated"),
    (_header(n_kv=1) + _string("k") + struct.pack("<I", 99), "unknown metadata value type 99"),
    (_header(n_kv=1) + _string("k") + struct.pack("<IQ", 8, 5) + b"\xff\xfe\xfd\xfc\xfb", "not UTF-8"),
    (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 32, 0, 0), "runs past the end"),
    (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 32, 1234, 0) + bytes(64), "unknown type 1234"),
    (_header(n_tensors=1) + _string("w") + struct.pack("<I", 9), "9 dimensions"),
    (_header(n_tensors=2) + (_string("w") + struct.pack("<IQIQ", 1, 4, 0, 0)) * 2 + bytes(64), "appears twice"),
    (_header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 33, 2, 0) + bytes(64), "not whole Q4_0 blocks"),
])
def test_broken_files_are_refused_by_name(data: bytes, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile(path)
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF .*{message}"):
        read_gguf(path)
