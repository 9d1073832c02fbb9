"""Process-level set-up that must happen before MLX loads: the OpenBLAS preload.

Owns: `maybe_reexec_with_openblas`. MLX's Linux CPU wheel links the reference BLAS
(about 6 GFLOP/s here); Debian's OpenBLAS (libopenblas0-pthread) gives about 65. The
dynamic loader only honours LD_PRELOAD at process start, so the launcher re-executes
itself once with it set. This module, like the rest of `config/`, may read the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
_MARK = "SEGSERVE_INTERNAL_REEXEC"


def openblas_path() -> str | None:
    for cand in OPENBLAS_CANDIDATES:
        if Path(cand).is_file():
            return cand
    return None


def openblas_active() -> bool:
    lib = openblas_path()
    return lib is not None and lib in os.environ.get("LD_PRELOAD", "")


def maybe_reexec_with_openblas(argv: Sequence[str], enabled: bool) -> None:
    """Re-exec this process with OpenBLAS preloaded (Linux, present, not yet loaded)."""
    if not enabled or not sys.platform.startswith("linux") or os.environ.get(_MARK):
        return
    lib = openblas_path()
    if lib is None or openblas_active():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "server.cli", *argv], env)


def strip_internal(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k != _MARK}
