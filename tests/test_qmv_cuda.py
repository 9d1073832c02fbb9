"""Products of a few rows with 4/8-bit weights on a CUDA GPU (`segserve.kernels.qmv_cuda`).

On any machine: which calls the kernel takes, that the body compiles as MLX wraps it
(nvcc, no GPU needed; skipped without the toolkit), that `install` changes exactly the
affine quantized layers and that a routed layer off the GPU is MLX's own product. On a CUDA
GPU: the kernel against a float64 product of the dequantized weights and against
`mx.quantized_matmul`, for every row count, width, group size and activation dtype it takes,
and a routed model's batched logits against the unrouted model's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from segserve.kernels import qmv_cuda
from tests.cuda_support import NVCC, needs_nvcc

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend on a GPU")


def _takes(rows: int, k: int = 4096, bits: int = 4, group_size: int = 64, mode: str = "affine",
           dtype: mx.Dtype = mx.bfloat16, scale_dtype: mx.Dtype | None = None) -> bool:
    return qmv_cuda.takes(rows, k, bits, group_size, mode, dtype, dtype if scale_dtype is None else scale_dtype)


def test_takes_two_to_max_rows_of_affine_4_and_8_bit() -> None:
    assert _takes(2) and _takes(qmv_cuda.MAX_ROWS)
    assert not _takes(1)  # MLX's qmv reads the weights once already
    assert not _takes(qmv_cuda.MAX_ROWS + 1)
    assert _takes(4, bits=8, group_size=32, dtype=mx.float16)
    assert not _takes(4, bits=3) and not _takes(4, bits=6) and not _takes(4, group_size=16)
    assert not _takes(4, k=4096 + 16) and not _takes(4, mode="mxfp4")
    assert not _takes(4, dtype=mx.float32) and not _takes(4, scale_dtype=mx.float16)


@needs_nvcc
@pytest.mark.parametrize(("dtype", "rows", "bits", "gs"),
                         [("__nv_bfloat16", 8, 4, 64), ("__half", 2, 8, 32), ("__nv_bfloat16", 5, 4, 128)])
def test_kernel_compiles(tmp_path: Path, dtype: str, rows: int, bits: int, gs: int) -> None:
    assert NVCC is not None
    unit = tmp_path / "qmv.cu"
    unit.write_text(qmv_cuda.compile_unit(dtype, rows, bits, gs))
    ptx = tmp_path / "qmv.ptx"
    res = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(ptx), str(unit)],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # every (column, row) pair of every weight is one FMA: CW * 32 values * M per lane
    assert ptx.read_text().count("fma.rn.f32") >= qmv_cuda.COLUMNS * 32 * rows


class _Tiny(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped for mypy
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 64)
        self.b = nn.Linear(128, 96, bias=False)
        self.c = nn.Linear(128, 32)
        self.e = nn.Embedding(16, 128)


def _quantized_tiny() -> _Tiny:
    model = _Tiny()
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p in ("a", "b"))
    return model


def test_install_routes_the_affine_quantized_layers_and_nothing_else() -> None:
    model = _quantized_tiny()
    assert qmv_cuda.install(model) == 2
    assert type(model.a) is qmv_cuda.GpuQuantizedLinear and type(model.b) is qmv_cuda.GpuQuantizedLinear
    assert type(model.c) is nn.Linear and type(model.e) is nn.Embedding
    assert qmv_cuda.install(model) == 0  # already routed


@pytest.mark.skipif(ON_CUDA, reason="checks the product off the GPU")
def test_a_routed_layer_off_the_gpu_is_mlx_s_own_product() -> None:
    model = _quantized_tiny()
    x = mx.random.normal((4, 128), key=mx.random.key(3))
    before = model.a(x)
    qmv_cuda.install(model)
    assert mx.array_equal(model.a(x), before).item()


def _weights(n: int, k: int, bits: int, gs: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, ...]:
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return q, s.astype(dtype), b.astype(dtype)


def _reference(x: mx.array, q: mx.array, s: mx.array, b: mx.array, gs: int, bits: int) -> np.ndarray:
    dense = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    out: np.ndarray = np.array(x.astype(mx.float32), dtype=np.float64) @ np.array(dense, dtype=np.float64).T
    return out


# (dtype, bits, group size, row counts): every row count on the common case, a few on the
# others (each (dtype, rows, bits, group size) is a kernel of its own for NVRTC to compile).
CASES = [
    (mx.bfloat16, 4, 64, tuple(range(2, 9))),  # the kernel serves up to 8 rows; `takes` hands it fewer
    (mx.bfloat16, 4, 32, (2, 5)),
    (mx.bfloat16, 4, 128, (3, 8)),
    (mx.bfloat16, 8, 64, (2, 7)),
    (mx.float16, 4, 64, (4,)),
    (mx.float16, 8, 32, (6,)),
]


@needs_cuda
@pytest.mark.parametrize(("dtype", "bits", "gs", "row_counts"), CASES)
def test_kernel_equals_the_dequantized_product(dtype: mx.Dtype, bits: int, gs: int, row_counts: tuple[int, ...]) -> None:
    """Against float64 over the same dequantized weights: only the output's rounding to the
    activation dtype (and float32 sums) apart; within the same bound of MLX's own op."""
    for n, k in [(64, 256), (257, 1024), (1000, 2816)]:  # 257, 1000: a partial last block of columns
        q, s, b = _weights(n, k, bits, gs, dtype, seed=n + k + bits)
        for rows in row_counts:
            x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
            got = qmv_cuda.small_matmul(x, q, s, b, gs, bits)
            assert got.shape == (rows, n) and got.dtype == dtype
            ref = _reference(x, q, s, b, gs, bits)
            tol = 2 * float(np.finfo(np.float16).eps if dtype == mx.float16 else 2.0 ** -8)
            scale = np.maximum(np.abs(ref), 1e-2)
            err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - ref) / scale
            assert float(err.max()) <= tol, (n, k, rows, float(err.max()))
            theirs = np.array(mx.quantized_matmul(x, q, s, b, group_size=gs, bits=bits).astype(mx.float32))
            assert float(np.abs(theirs - ref).max()) <= 0.05 * float(np.abs(ref).max()) + 1e-2


@needs_cuda
@pytest.mark.parametrize("columns", [2, 4, 8])
def test_columns_per_warp_change_nothing(columns: int) -> None:
    q, s, b = _weights(300, 1024, 4, 64, mx.bfloat16, seed=1)
    x = mx.random.normal((3, 1024), key=mx.random.key(2)).astype(mx.bfloat16)
    ref = qmv_cuda.small_matmul(x, q, s, b, 64, 4)
    assert mx.array_equal(qmv_cuda.small_matmul(x, q, s, b, 64, 4, columns=columns), ref).item()


@needs_cuda
def test_a_routed_model_gives_the_unrouted_logits() -> None:
    """A 4-bit model's forward over a few rows (a batch of decode rows, a verify window) with
    the layers routed and not: MLX's GEMM and this kernel differ only in rounding."""
    model = _quantized_tiny()
    model.set_dtype(mx.bfloat16)
    x = mx.random.normal((3, 2, 128), key=mx.random.key(5)).astype(mx.bfloat16)  # 6 rows
    before = [model.a(x), model.b(x)]
    assert qmv_cuda.install(model) == 2
    after = [model.a(x), model.b(x)]
    for got, ref in zip(after, before, strict=True):
        assert got.shape == ref.shape
        diff = float(np.abs(np.array(got.astype(mx.float32)) - np.array(ref.astype(mx.float32))).max())
        assert diff <= 0.03 * max(1.0, float(np.abs(np.array(ref.astype(mx.float32))).max()))
    one = model.a(x[:1, :1])  # one row: MLX's qmv, unchanged
    assert one.shape == (1, 1, 64)


@needs_cuda
def test_more_rows_go_to_mlx_as_one_matrix() -> None:
    """Past MAX_ROWS a decode batch [B, 1, K] reaches MLX's op as [B, K] (one product of B
    rows, not B products of one): the same values as MLX's op on the batch's own shape."""
    model = _quantized_tiny()
    model.set_dtype(mx.bfloat16)
    b = qmv_cuda.MAX_ROWS + 9
    x = mx.random.normal((b, 1, 128), key=mx.random.key(6)).astype(mx.bfloat16)
    ref = model.a(x)
    qmv_cuda.install(model)
    got = model.a(x)
    assert got.shape == (b, 1, 64)
    diff = float(np.abs(np.array(got.astype(mx.float32)) - np.array(ref.astype(mx.float32))).max())
    assert diff <= 0.03 * max(1.0, float(np.abs(np.array(ref.astype(mx.float32))).max()))
