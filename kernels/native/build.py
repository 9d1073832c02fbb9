"""Build the `_segattn` MLX extension (CPU fused attention + quantized matmul).

    python -m segserve.kernels.native.build            # configure + build when sources changed
    python -m segserve.kernels.native.build --force    # rebuild anyway
    python -m segserve.kernels.native.build --soft     # never fail: one line saying why not built
    python -m segserve.kernels.native.build --strict   # fail with the log's tail (CI: .ci/run)

Two callers: a checkout (`make setup`, the commands above) builds in place; the wheel build
(`setup.py`, at `pip install .` / `pip wheel .`) calls `build_into` to compile into its
own temporary folders and put the module into the wheel's tree, leaving the checkout alone.

CMake (system or PyPI `cmake`, >= 3.25) builds against the headers and CMake config that
the installed `mlx` wheel ships, with nanobind from the venv (pinned in pyproject.toml to
the version the mlx wheel was built with: mlx.core.array crosses the module boundary only
when both sides share nanobind's ABI). The build folder is `kernels/native/build/`; the
module lands next to this file as `_segattn<EXT_SUFFIX>`; both are git-ignored.

Idempotent: a stamp holds a hash of the sources, the environment (sys.prefix, Python
version) and the mlx/nanobind versions; when it matches and the module exists, nothing
runs (a few ms). `segserve.kernels.fused_cpu.available()` uses the same check to refuse a module
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


def rebuild_hint() -> str:
    """How to get the extension here: a checkout rebuilds in place; an installed wheel
    carries no C++ sources, so only a reinstall with a compiler can build it."""
    if has_sources():
        return "run `python -m segserve.kernels.native.build`"
    return ("reinstall segserve where a C++ compiler is present (apt-get install g++): "
            "`pip install --force-reinstall --no-deps <segserve source or sdist>`")


def _run(cmd: list[str], log: object) -> None:
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n")  # type: ignore[attr-defined]
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        reason = (errors or lines or [f"exit status {proc.returncode}"])[0]
        raise BuildError(f"{Path(cmd[0]).name} failed: {reason[:200]}")


def build(force: bool = False) -> Path:
    """Build the module in place unless up to date; returns its path, raises BuildError."""
    if not force and up_to_date():
        return module_path()
    STAMP.unlink(missing_ok=True)
    module_path().unlink(missing_ok=True)  # never leave a module built from older sources
    # The in-place module finds libmlx through the venv's absolute path (CMake's default).
    # Import it in a fresh interpreter: catches ABI or symbol problems now, not at serve.
    check = "import mlx.core; from segserve.kernels.native import _segattn; print(_segattn.isa(), _segattn.qmm_isa())"
    _compile(BUILD, NATIVE, rpath=None, check=check)
    STAMP.write_text(fingerprint())
    return module_path()


# The wheel's module sits in site-packages/kernels/native/ and mlx's library in
# site-packages/mlx/lib/: a relative run path, since the build environment's absolute
# path (a temporary folder at `pip install`) is gone once the wheel is installed.
WHEEL_RPATH = "$ORIGIN/../../mlx/lib"


def build_into(build_dir: Path, output_dir: Path) -> Path:
    """Compile for a wheel: objects in `build_dir`, the module in `output_dir` (the wheel's
    kernels/native/); the checkout is not touched. Returns the module path, raises BuildError."""
    build_dir, output_dir = build_dir.resolve(), output_dir.resolve()  # CMake reads relative
    out = output_dir / module_path().name                                # paths from its build dir
    check = ("import importlib.util as u, sys, mlx.core; "
             "s = u.spec_from_file_location('_segattn', sys.argv[1]); m = u.module_from_spec(s); "
             "s.loader.exec_module(m); print(m.isa(), m.qmm_isa())")
    _compile(build_dir, output_dir, rpath=WHEEL_RPATH, check=check, check_args=[str(out)])
    return out


def _compile(build_dir: Path, output_dir: Path, rpath: str | None, check: str,
             check_args: list[str] | None = None) -> None:
    if _version("nanobind") == "missing":
        raise BuildError("nanobind is not installed (pip install -e '.[dev]')")
    cmake = _cmake()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    cache = build_dir / "CMakeCache.txt"
    if cache.exists():  # a cache from another generator or interpreter cannot be reused
        text = cache.read_text(errors="replace")
        want_gen = "Ninja" if generator else "Unix Makefiles"
        if f"CMAKE_GENERATOR:INTERNAL={want_gen}" not in text or sys.executable not in text:
            shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir / module_path().name
    out.unlink(missing_ok=True)
    jobs = str(max(1, os.cpu_count() or 1))
    extra = [f"-DSEGATTN_RPATH={rpath}"] if rpath else []
    with (build_dir / LOG.name).open("w") as log:
        _run([
            cmake, "-S", str(NATIVE), "-B", str(build_dir), *generator,
            "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
            f"-DSEGATTN_OUTPUT_DIR={output_dir}", *extra,
        ], log)
        _run([cmake, "--build", str(build_dir), "-j", jobs], log)
        if not out.exists():
            raise BuildError(f"build finished but {out.name} is missing")
        _run([sys.executable, "-c", check, *(check_args or [])], log)


_LOG_TAIL = 60  # lines of the build log `--strict` prints on failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--soft", action="store_true", help="on failure print one line, exit 0")
    mode.add_argument("--strict", action="store_true",
                      help="on failure exit 1 with the build log's tail on stderr (CI)")
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
        if args.strict and LOG.exists():  # CI keeps no build folder: show why here
            tail = LOG.read_text(errors="replace").splitlines()[-_LOG_TAIL:]
            print("\n".join(tail), file=sys.stderr)
        return 0 if args.soft else 1
    if fresh:
        print(f"built {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
