"""Build the `_segattn` MLX extension (CPU fused attention + quantized matmul) in place.

    python -m kernels.native.build            # configure + build when sources changed
    python -m kernels.native.build --force    # rebuild anyway
    python -m kernels.native.build --soft     # never fail: one line saying why not built

CMake (system or PyPI `cmake`, >= 3.25) builds against the headers and CMake config that
the installed `mlx` wheel ships, with nanobind from the venv (pinned in pyproject.toml to
the version the mlx wheel was built with: mlx.core.array crosses the module boundary only
when both sides share nanobind's ABI). The build folder is `kernels/native/build/`; the
module lands next to this file as `_segattn<EXT_SUFFIX>`; both are git-ignored.

Idempotent: a stamp holds a hash of the sources, the environment (sys.prefix, Python
version) and the mlx/nanobind versions; when it matches and the module exists, nothing
runs (a few ms). `kernels.fused_cpu.available()` uses the same check to refuse a module
that is older than its sources.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
REPO = NATIVE.parent.parent
BUILD = NATIVE / "build"
STAMP = BUILD / "segattn.stamp"
LOG = BUILD / "build.log"
MODULE_NAME = "_segattn"


class BuildError(RuntimeError):
    """The extension could not be built; the message says why in one line."""


def module_path() -> Path:
    return NATIVE / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _sources() -> list[Path]:
    files = [*NATIVE.glob("*.cpp"), *NATIVE.glob("*.h"), NATIVE / "CMakeLists.txt"]
    return sorted(files)


def has_sources() -> bool:
    """Whether the C++ sources are here (an install without them cannot be checked)."""
    return (NATIVE / "CMakeLists.txt").exists()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"


def fingerprint() -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for part in (sys.prefix, sys.version, _version("mlx"), _version("nanobind")):
        h.update(part.encode())
    return h.hexdigest()


def up_to_date() -> bool:
    return module_path().exists() and STAMP.exists() and STAMP.read_text() == fingerprint()


def _cmake() -> str:
    venv_cmake = Path(sys.executable).parent / "cmake"
    found = shutil.which("cmake") or (str(venv_cmake) if venv_cmake.exists() else None)
    if found is None:
        raise BuildError("cmake not found (apt-get install cmake, or pip install cmake)")
    return found


def _run(cmd: list[str], log: object) -> None:
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n")  # type: ignore[attr-defined]
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        reason = (errors or lines or [f"exit status {proc.returncode}"])[0]
        raise BuildError(f"{Path(cmd[0]).name} failed: {reason[:200]}")


def build(force: bool = False) -> Path:
    """Build the module unless up to date; returns its path, raises BuildError."""
    if not force and up_to_date():
        return module_path()
    if _version("nanobind") == "missing":
        raise BuildError("nanobind is not installed (pip install -e '.[dev]')")
    cmake = _cmake()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    cache = BUILD / "CMakeCache.txt"
    if cache.exists():  # a cache from another generator or interpreter cannot be reused
        text = cache.read_text(errors="replace")
        want_gen = "Ninja" if generator else "Unix Makefiles"
        if f"CMAKE_GENERATOR:INTERNAL={want_gen}" not in text or sys.executable not in text:
            shutil.rmtree(BUILD)
    BUILD.mkdir(parents=True, exist_ok=True)
    STAMP.unlink(missing_ok=True)
    module_path().unlink(missing_ok=True)  # never leave a module built from older sources
    jobs = str(max(1, os.cpu_count() or 1))
    with LOG.open("w") as log:
        _run([
            cmake, "-S", str(NATIVE), "-B", str(BUILD), *generator,
            "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSEGATTN_OUTPUT_DIR={NATIVE}",
        ], log)
        _run([cmake, "--build", str(BUILD), "-j", jobs], log)
        if not module_path().exists():
            raise BuildError(f"build finished but {module_path().name} is missing")
        # Import it in a fresh interpreter: catches ABI or symbol problems now, not at serve.
        _run([sys.executable, "-c", "import mlx.core; from kernels.native import _segattn; print(_segattn.isa(), _segattn.qmm_isa())"], log)
    STAMP.write_text(fingerprint())
    return module_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--soft", action="store_true", help="on failure print one line, exit 0")
    args = parser.parse_args(argv)
    try:
        fresh = args.force or not up_to_date()
        path = build(force=args.force)
    except (BuildError, OSError) as exc:
        line = (f"note: CPU extension unavailable ({exc}); serving uses the composed attention "
                "route and float32 weights on CPU")
        if LOG.exists():
            line += f" [log: {LOG.relative_to(REPO)}]"
        print(line)
        return 0 if args.soft else 1
    if fresh:
        print(f"built {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
