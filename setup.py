"""Build hooks: the wheel carries the compiled CPU extension (kernels/native `_segattn`).

Everything declarative lives in pyproject.toml; this file only adds the native build step.
`pip install .` / `pip wheel .` run CMake + nanobind against the `mlx` wheel of the build
environment (both pinned in `[build-system] requires`, so the module's nanobind ABI and
libmlx match the ones installed next to it) and put `_segattn<EXT_SUFFIX>` into the wheel,
which is then tagged for this interpreter and platform. Where the build cannot run (no C++
compiler, say), one line says why and the wheel is the pure one: the server then serves the
composed route and float32 weights.

Why setuptools and not scikit-build-core (MLX's extension example): the build must be
optional. scikit-build-core fails the install when CMake fails; here a failed compile
still installs a working (slower) server, the same rule `make setup` follows. The compile
itself is `kernels/native/build.py`, shared with the checkout's in-place build.

Editable installs (`make setup`: `pip install -e .`) skip this step: the Makefile's
`native` target builds in place, where `segserve.kernels.fused_cpu` checks the module against its
sources.

`SEGSERVE_BUILD_NATIVE=0` skips the compile (the CUDA image: its MLX is the CUDA build, and
the CPU extension would link against the wrong libmlx).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _native_build() -> ModuleType:
    """kernels/native/build.py loaded by path: importing `kernels` would import MLX code
    that the build environment does not need."""
    spec = importlib.util.spec_from_file_location("_segserve_native_build", ROOT / "kernels/native/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-free, but keep the import protocol whole
    spec.loader.exec_module(module)
    return module


class BuildPyWithNative(build_py):  # type: ignore[misc]  # setuptools: untyped here
    """build_py, then the extension compiled into the wheel's segserve/kernels/native/."""

    built_native: Path | None = None

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        if os.environ.get("SEGSERVE_BUILD_NATIVE", "1").strip().lower() in {"0", "false"}:
            print("segserve: SEGSERVE_BUILD_NATIVE=0: the CPU extension is not built")
            return
        native = _native_build()
        temp = Path(self.get_finalized_command("build").build_temp) / "segattn"
        try:
            BuildPyWithNative.built_native = native.build_into(temp, Path(self.build_lib) / "segserve" / "kernels" / "native")
        except (native.BuildError, OSError) as exc:
            log = temp / native.LOG.name
            print(
                f"note: CPU extension not built ({exc}); segserve installs without it and serves "
                f"the composed attention route and float32 weights on CPU"
                + (f" [log: {log}]" if log.exists() else ""),
                file=sys.stderr,
            )


class BdistWheelTagged(bdist_wheel):  # type: ignore[misc]
    """A platform wheel when the extension was built, the pure one when not: the tag is
    decided after the build step, which is where we learn whether it compiled."""

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build")
        built = BuildPyWithNative.built_native is not None
        self.root_is_pure = not built
        # `install` puts the tree in platlib only for a distribution with extensions; ours is
        # compiled by build_py, so say so, or the wheel would hold it under .data/purelib.
        self.distribution.has_ext_modules = lambda: built
        super().run()


setup(cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": BdistWheelTagged})
