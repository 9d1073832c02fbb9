"""The CUDA toolkit's compiler for the tests that compile kernel sources without a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


NVCC = _nvcc()  # looked up on PATH, then at /usr/local/cuda/bin/nvcc
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit absent)")
