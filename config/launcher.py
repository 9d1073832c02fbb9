"""Process-level set-up that must happen before MLX loads: preloading a fast BLAS, and the
CPU extension's knobs.

Owns: `maybe_reexec_with_blas`, `blas_library`, `blas_active`, `apply_native_settings`.
The CPU extension (kernels/native) reads its knobs from its own variables (SEGATTN_ISA,
QMM_THREADS, ...) when it first runs an op, so `apply_native_settings` writes the settings
that name them into this process's environment before the model loads; a knob left on
auto leaves the variable as it is. MLX's Linux CPU wheel links
the reference BLAS (about 6 GFLOP/s here). Debian's BLIS (libblis4-pthread) and OpenBLAS
(libopenblas0-pthread) export the same CBLAS symbols and are far faster. Measured here with
`python bench/cpu_speed.py` (embedded model, float32, [in,out] layout): BLIS 137 tok/s
prefill and 12.6 tok/s decode against OpenBLAS 85 and 13.4, so `auto` prefers BLIS (time
to first token gains much more than decode loses). The dynamic loader only
honours LD_PRELOAD at process start, so the launcher re-executes itself once with it set.
This module, like the rest of `config/`, may read the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from segserve.config.settings import Settings

BlasChoice = Literal["auto", "blis", "openblas", "none"]

_ARCHES = ("x86_64-linux-gnu", "aarch64-linux-gnu")
_LIBS = {
    "blis": "blis-pthread/libblis.so.4",
    "openblas": "openblas-pthread/libopenblas.so.0",
}
REEXEC_MARK = "SEGSERVE_INTERNAL_REEXEC"  # set in the re-executed process (not a setting)


def blas_library(choice: BlasChoice) -> str | None:
    """The shared library to preload for `choice`, if it is installed."""
    names = ["blis", "openblas"] if choice == "auto" else [] if choice == "none" else [choice]
    for name in names:
        for arch in _ARCHES:
            path = Path("/usr/lib") / arch / _LIBS[name]
            if path.is_file():
                return str(path)
    return None


def blas_active() -> str | None:
    """Which of the known BLAS libraries this process has preloaded, if any."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name, rel in _LIBS.items():
        if rel in preload:
            return name
    return None


def maybe_reexec_with_blas(argv: Sequence[str], choice: BlasChoice) -> None:
    """Re-exec this process with a fast BLAS preloaded (Linux, installed, not yet loaded)."""
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_MARK) or blas_active():
        return
    lib = blas_library(choice)
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    # BLIS runs single-threaded unless told otherwise; OpenBLAS already uses every core.
    env.setdefault("BLIS_NUM_THREADS", str(os.cpu_count() or 1))
    env[REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "segserve.server.cli", *argv], env)


def native_environment(settings: Settings) -> dict[str, str]:
    """The extension's variables for the knobs `settings` sets (auto ones left out)."""
    from segserve.config.settings import NATIVE_KNOBS  # settings imports this module

    out = {}
    for name, var in NATIVE_KNOBS.items():
        value = getattr(settings, name)
        if value is not None:
            out[var] = str(value)
    return out


def apply_native_settings(settings: Settings) -> dict[str, str]:
    """Export the extension's knobs before it runs its first op; returns what was set."""
    env = native_environment(settings)
    os.environ.update(env)
    return env
