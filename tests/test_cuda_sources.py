"""The CUDA kernels in kernels/cuda/*.cu compile, wrapped as mx.fast.cuda_kernel wraps them.

No GPU needed: nvcc generates PTX for sm_90 (the H200). Skipped where nvcc is absent
(looked up on PATH, then at /usr/local/cuda/bin/nvcc). The files are also checked
to be what the route loads (every file used, the placeholders filled).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from segserve.kernels import fused_cuda_source as src
from tests.cuda_support import NVCC, needs_nvcc

CASES = [
    ("in_kernel", 2, 128, 2, 0, False),  # header + body + in-kernel merge
    ("in_kernel", 8, 128, 2, 0, True),  # owned pieces (decode rows of distinct histories)
    ("two_pass", 3, 64, 3, 2, False),  # body without the merge, paired wide path
    ("reduce", 0, 128, 2, 0, False),  # header + the two-pass reduce body
]


@needs_nvcc
@pytest.mark.parametrize(("kernel", "pieces", "head_dim", "stages", "wide", "owned"), CASES)
def test_kernel_compiles(tmp_path: Path, kernel: str, pieces: int, head_dim: int, stages: int, wide: int,
                         owned: bool) -> None:
    assert NVCC is not None
    unit = tmp_path / f"{kernel}.cu"
    unit.write_text(src.compile_unit(kernel, pieces, head_dim, stages, wide, owned))  # type: ignore[arg-type]
    ptx = tmp_path / f"{kernel}.ptx"
    res = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(ptx), str(unit)],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    text = ptx.read_text()
    assert ".entry" in text and "kernel" in text  # the wrapped function was generated
    if kernel != "reduce":
        assert "mma.sync" in text


@needs_nvcc
def test_a_broken_body_fails_to_compile(tmp_path: Path) -> None:
    # The check can fail: a syntax error in the body is reported by nvcc.
    assert NVCC is not None
    unit = tmp_path / "bad.cu"
    unit.write_text(src.compile_unit("reduce").replace("const int NC =", "const int NC = ;"))
    res = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(tmp_path / "bad.ptx"), str(unit)],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode != 0


def test_sources_are_files_and_all_used() -> None:
    on_disk = sorted(p.name for p in src.CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(src.SOURCE_FILES)
    for merge in ("in_kernel", "two_pass"):
        body = src.kernel_source(merge, 4)
        assert "@PICK@" not in body and "@SELECT@" not in body and "@MERGE@" not in body
        assert "@OWN@" not in body and "own[b]" not in body
        assert "k3_shape" in body and "k4_shape" not in body
    assert src.read_source("segattn_merge.cu") in src.kernel_source("in_kernel", 2)
    assert src.read_source("segattn_merge.cu") not in src.kernel_source("two_pass", 2)
    assert src.header().strip().startswith("namespace segattn")
    assert src.HEADER == src.header() and src.BODY_REDUCE == src.body_reduce()


def test_owned_pieces_read_their_row_s_range_and_need_the_in_kernel_merge() -> None:
    body = src.kernel_source("in_kernel", 4, owned=True)
    assert "own[b]" in body and "OWNED = true" in body
    assert src.input_names(2, "in_kernel", owned=True) == ["q", "cfg", "sem", "own", "k0", "k1", "v0", "v1"]
    with pytest.raises(ValueError, match="in-kernel merge"):
        src.kernel_source("two_pass", 4, owned=True)
