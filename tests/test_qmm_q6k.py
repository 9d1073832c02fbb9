"""GGUF Q6_K served in its own blocks (`segserve.kernels.qmm_cpu.Q6KLinear`, the op's bits 6;
`Q6KEmbedding` for an embedding table, its rows and its tied output projection).

Differential against gguf-py's own dequantization: the MLX-ops reference
(`dequantize_q6k`) bit for bit, the native op over row counts that take each path (dot
tile: 1..23 rows, packed-panel GEMM: 24+), odd column counts, every SIMD body this CPU runs
and one or two threads. Then a Q4_K_M file (Q6_K in v, down and the head) loads with
those layers in their blocks at the file's bytes, routes them through the op, keeps the
native decode layers, decodes the same greedy tokens with them on and off, and
re-quantizes them when asked for 8-bit weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants
from mlx.utils import tree_flatten

from segserve.kernels import block_cpu, qmm_cpu
from segserve.server.runner import batched, model_shape
from segserve.server.runner.gguf import load_gguf
from segserve.server.runner.gguf_quant import Q6KTensor, convert
from segserve.server.runner.qweights import requantize
from tests.conftest import decode_backend
from tests.gguf_support import tensor_data, write_gguf

_OK, _WHY = qmm_cpu.available()
needs_op = pytest.mark.skipif(not _OK, reason=f"CPU quantized matmul unavailable: {_WHY}")


def _blocks(rows: int, cols: int, seed: int) -> tuple[np.ndarray, Q6KTensor]:
    raw = tensor_data(T.Q6_K, rows, cols, np.random.default_rng(seed))
    value = convert("blk.0.ffn_down.weight", T.Q6_K, raw, (rows, cols), q6k_blocks=True)
    assert isinstance(value, Q6KTensor)
    return quants.dequantize(raw, T.Q6_K), value


def test_blocks_keep_the_file_bytes_and_dequantize_exactly() -> None:
    ref, value = _blocks(6, 768, seed=1)
    assert value.weight.dtype == mx.uint8 and value.scales.dtype == mx.int8 and value.biases.dtype == mx.float16
    assert value.weight.nbytes + value.scales.nbytes + value.biases.nbytes == 6 * 768 // 256 * 210
    got = np.array(qmm_cpu.dequantize_q6k(value.weight, value.scales, value.biases))
    assert np.array_equal(got, ref)


@pytest.fixture
def _restore_op() -> Iterator[None]:
    from segserve.kernels.native import _segattn

    isa, threads, x8 = _segattn.qmm_isa(), _segattn.qmm_threads(), _segattn.qmm_x8()
    yield
    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_threads(threads)
    _segattn.qmm_set_x8(x8)


def _isas() -> list[str]:
    if not _OK:
        return []
    from segserve.kernels.native import _segattn

    return list(_segattn.qmm_supported_isas())


def _rounded_x8(x: np.ndarray, block: int) -> np.ndarray:
    """x as the op's 8-bit-x path sees it (qmm_dot8.cpp): per block of `block` values
    d * round(x / d), d = max|x| / 127, in float32 as the kernel computes it."""
    blocks = x.reshape(-1, block)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    rounded: np.ndarray = (np.rint(blocks * inv) * d).reshape(x.shape)
    return rounded


@needs_op
@pytest.mark.usefixtures("_restore_op")
@pytest.mark.parametrize("x8", ["auto", "off"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", _isas())
def test_op_equals_gguf_py_dequantize(isa: str, threads: int, x8: str) -> None:
    """Against gguf-py's dequantization in float64; with 8-bit x on (decode rows through the
    dot body, 24+ through its GEMM): the same on the rounded x (the rounding itself within
    its bound: half a step of each x times |w|)."""
    from segserve.kernels.native import _segattn

    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_threads(threads)
    _segattn.qmm_set_x8(x8)
    for n, k in [(1, 256), (7, 512), (131, 768), (37, 2816)]:
        ref_w, value = _blocks(n, k, seed=n + k)
        for rows in (1, 2, 3, 8, 23, 24, 37, 70):
            x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
            got = _segattn.qmm(mx.array(x), value.weight, value.scales, value.biases, 16, 6)
            assert got is not None, (n, k, rows)
            exact = x.astype(np.float64) @ ref_w.T.astype(np.float64)
            rounded = qmm_cpu.x8_serves(rows, k, 6)
            assert rounded == (x8 == "auto")
            # decode rows round x per 256 values (llama.cpp's Q8_K), the GEMM's rows per 32
            block = qmm_cpu.x8_block(rows, k, 6)
            assert block == (0 if not rounded else 256 if rows < 24 else 32)
            ref = _rounded_x8(x, block).astype(np.float64) @ ref_w.T.astype(np.float64) if rounded else exact
            peak = max(1.0, float(np.abs(ref).max()))
            err = float(np.abs(np.array(got) - ref).max())
            assert err <= 2e-5 * peak, (isa, n, k, rows, err)
            if rounded:  # the rounding moves each x by at most half its block's step d
                steps = np.repeat(np.abs(x).reshape(rows, -1, block).max(axis=2) / 127, block, axis=1)
                bound = 0.5 * steps.astype(np.float64) @ np.abs(ref_w.T).astype(np.float64)
                assert np.all(np.abs(np.array(got) - exact) <= bound * 1.001 + 2e-5 * peak), (isa, n, k, rows)


@needs_op
@pytest.mark.usefixtures("_restore_op")
@pytest.mark.parametrize("isa", _isas())
def test_x8_rows_are_independent_of_their_batch(isa: str) -> None:
    """With 8-bit x, a decode row's Q6_K product is the same bits alone or among 2..23 rows
    (the rows of a call share each tile's unpacking: batched decode gives each session what
    decoding alone gives)."""
    from segserve.kernels.native import _segattn

    _segattn.qmm_set_isa(isa)
    _segattn.qmm_set_x8("auto")
    _, value = _blocks(131, 768, seed=3)
    x = mx.array(np.random.default_rng(5).standard_normal((23, 768)).astype(np.float32))
    for rows in (2, 3, 5, 23):
        batch = _segattn.qmm(x[:rows], value.weight, value.scales, value.biases, 16, 6)
        assert batch is not None
        for r in sorted({0, rows // 2, rows - 1}):
            alone = _segattn.qmm(x[r : r + 1], value.weight, value.scales, value.biases, 16, 6)
            assert alone is not None and mx.array_equal(alone[0], batch[r]).item(), (isa, rows, r)


@needs_op
def test_op_declines_what_is_not_q6_k_blocks() -> None:
    from segserve.kernels.native import _segattn

    _, v = _blocks(4, 512, seed=2)
    x = mx.ones((1, 512))
    assert _segattn.qmm(x, v.weight, v.scales, v.biases, 32, 6) is None  # group size
    assert _segattn.qmm(mx.ones((1, 256)), v.weight, v.scales, v.biases, 16, 6) is None  # K
    assert _segattn.qmm(x, v.weight.astype(mx.uint32), v.scales, v.biases, 16, 6) is None  # codes dtype
    assert _segattn.qmm(x, v.weight, v.scales.astype(mx.float16), v.biases, 16, 6) is None  # scales dtype
    assert _segattn.qmm(x, v.weight, v.scales, v.biases.astype(mx.float32), 16, 6) is None  # d dtype


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("q6k") / "llama-Q4_K_M.gguf", "llama", "Q4_K_M", seed=5)


def _peak(a: mx.array) -> float:
    return max(1.0, float(mx.abs(a).max().item()))  # type: ignore[arg-type]  # item() of a 0-d float array


def _nbytes(model: nn.Module) -> int:
    flat: Any = tree_flatten(model.parameters())
    return sum(int(v.nbytes) for _, v in flat)


@needs_op
@pytest.mark.usefixtures("_restore_op")
def test_a_q4_k_m_file_serves_q6_k_blocks_through_the_native_layers(q4_k_m: Path) -> None:
    plain = load_gguf(q4_k_m, dequantize=False, q6k_blocks=True).model  # MLX ops (dequantize_q6k)
    routed = load_gguf(q4_k_m, dequantize=False, q6k_blocks=True).model
    blocks = [n for n, m in routed.named_modules() if type(m) is qmm_cpu.Q6KLinear]
    assert any(n.endswith("down_proj") for n in blocks) and any(n.endswith("v_proj") for n in blocks)
    regridded = load_gguf(q4_k_m, dequantize=False, q6k_blocks=False).model
    assert _nbytes(routed) < _nbytes(regridded)
    assert _nbytes(routed) <= 1.15 * q4_k_m.stat().st_size
    qmm_cpu.install(routed, model_shape(routed))
    assert not any(type(m) is qmm_cpu.Q6KLinear for _, m in routed.named_modules())
    tokens = mx.array([list(range(3, 40))])
    from segserve.kernels.native import _segattn

    _segattn.qmm_set_x8("off")  # the routing: float products, as MLX's ops
    got, want = routed(tokens), plain(tokens)
    assert mx.allclose(got, want, atol=1e-3 * _peak(want)).item()
    _segattn.qmm_set_x8("auto")  # the native layers against MLX's ops, both on the op
    if block_cpu._ext() is None:
        return
    from tests.test_block_cpu import _greedy

    on = decode_backend(routed)
    layers = batched._compiled_layers(on)
    assert layers is not None and all(c.native is not None for c in layers)
    off_model = load_gguf(q4_k_m, dequantize=False, q6k_blocks=True).model
    qmm_cpu.install(off_model, model_shape(off_model))
    a, la = _greedy(on)
    b, lb = _greedy(decode_backend(off_model, native_layers=False))
    assert a == b
    assert mx.allclose(la, lb, atol=1e-3 * _peak(lb)).item()


def test_eight_bit_weights_requantize_q6_k_blocks_and_compact_scales(q4_k_m: Path) -> None:
    model = load_gguf(q4_k_m, dequantize=False, q6k_blocks=True, k_scales=True).model
    assert any(type(m) is qmm_cpu.K8Linear for _, m in model.named_modules())  # the Q4_K matrices
    tokens = mx.array([list(range(3, 20))])
    before = model(tokens)
    assert requantize(model, 8) > 0
    assert not any(type(m) in (qmm_cpu.Q6KLinear, qmm_cpu.K8Linear) for _, m in model.named_modules())
    after = model(tokens)
    # 8-bit groups of 32 span two Q6_K sub-blocks of unrelated (random) scales: close, not equal
    rel = float((mx.abs(after - before).mean() / mx.abs(before).mean()).item())  # type: ignore[arg-type]
    assert rel < 0.05, rel


@pytest.fixture(scope="module")
def tied_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # llama.cpp's Q4_K_M stores a tied table as Q6_K (it is the output projection too)
    return write_gguf(tmp_path_factory.mktemp("q6k") / "tied-Q4_K_M.gguf", "llama", "Q4_K_M", seed=6, tied=True)


def test_a_tied_q6_k_table_keeps_its_blocks_for_rows_and_head(tied_q4_k_m: Path) -> None:
    raw = next(t for t in GGUFReader(str(tied_q4_k_m)).tensors if t.name == "token_embd.weight")
    assert raw.tensor_type == T.Q6_K
    ref = quants.dequantize(np.asarray(raw.data), T.Q6_K)  # [vocab, hidden] float32
    model = load_gguf(tied_q4_k_m, dequantize=False, q6k_blocks=True).model
    emb = model.model.embed_tokens
    assert type(emb) is qmm_cpu.Q6KEmbedding
    assert emb.weight.nbytes + emb.scales.nbytes + emb.biases.nbytes == int(raw.n_bytes)
    ids = mx.array([[0, 7, 511], [3, 3, 200]])
    rows = emb(ids)
    assert rows.dtype == mx.float16 and rows.shape == (2, 3, ref.shape[1])
    # the file's values, in the float16 a GGUF's quantized rows are served in
    assert np.array_equal(np.array(rows.astype(mx.float32)), ref[np.array(ids)].astype(np.float16).astype(np.float32))
    x = mx.random.normal((1, 2, ref.shape[1]), key=mx.random.key(3))
    want = np.array(x) @ ref.T
    with qmm_cpu.float_x():
        assert np.abs(np.array(emb.as_linear(x)) - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max()))
    if _OK:
        # through the op: the tied head shares the table's blocks
        assert qmm_cpu.install(model, model_shape(model)) > 0
        head = model["tied_head"]
        assert type(head) is qmm_cpu.CpuQuantizedHead and head._emb[0] is emb
        with qmm_cpu.float_x():
            got = np.array(head(x))
        assert np.abs(got - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max()))
        # the model's own forward (`as_linear`) takes the op too, never a dequantized table
        assert mx.array_equal(emb.as_linear(x), head(x)).item()
    # 8-bit weights: an affine table of the same values takes its place
    assert requantize(model, 8) > 0
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    again = np.array(model.model.embed_tokens(ids).astype(mx.float32))
    assert np.abs(again - ref[np.array(ids)]).max() <= 0.02 * float(np.abs(ref).max())
