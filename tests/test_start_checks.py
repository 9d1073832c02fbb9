"""Real processes: bad settings are one line before the model loads; slow clients cannot
starve `/health` (header timeout, connection cap; `segserve.server.http.http_guard`)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.http_support import free_port
from tests.process_support import REPO, ServerProcess, write_tiny_model_dir


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "segserve.server.cli", "serve", *args], capture_output=True, text=True,
        env={**base, **(env or {})}, cwd=REPO, timeout=60,
    )


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--memory-budget", "banana"], {}, "--memory-budget"),
        ([], {"SEGSERVE_MEMORY_BUDGET": "banana"}, "SEGSERVE_MEMORY_BUDGET"),
        (["--bank-max-bytes", "0"], {}, "--bank-max-bytes"),
        (["--bank-disk-max-bytes", "10%"], {}, "--bank-disk-max-bytes"),
        (["--model", "/nonexistent/model.gguf"], {}, "--model"),
        (["--model", "./missing-dir"], {}, "--model"),
        (["--api-key-file", "/nonexistent/keys"], {}, "--api-key-file"),
        (["--max-connections", "3"], {}, "--max-connections"),
        (["--header-timeout", "0"], {}, "--header-timeout"),
    ],
)
def test_bad_settings_are_one_line_naming_the_flag(
    args: list[str], env: dict[str, str], named: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    r = _run_cli("--bank-dir", str(tmp_path / "bank"), "--port", str(free_port()), *args, env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"segserve: {named}:"), r.stderr
    assert "Traceback" not in r.stderr and "model" not in r.stdout.lower()
    assert time.monotonic() - t0 < 30  # no model was loaded


def test_min_free_disk_zero_is_a_setting_not_a_traceback() -> None:
    from segserve.config.settings import load_settings
    from segserve.server.scheduling import parse_memory_budget

    s = load_settings({"bank_min_free_disk": "0"}, environ={})
    assert parse_memory_budget(s.bank_min_free_disk, minimum=0) == 0


def test_port_in_use_is_reported_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = _run_cli("--port", str(port), "--bank-dir", "none")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"segserve: --port: port {port} on 127.0.0.1 is already in use"]
    assert "loading" not in r.stderr.lower()


def test_help_documents_the_key_file_and_variable() -> None:
    r = subprocess.run([sys.executable, "-m", "segserve.server.cli", "serve", "--help"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    text = " ".join(r.stdout.split())
    assert "--api-key-file" in text and "SEGSERVE_API_KEY" in text
    assert "visible to other local users" in text


def _slow_client(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    return s


def test_slow_header_clients_do_not_starve_health(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Far more half-sent requests than the server may hold open: every new `/health`
    still answers at once (the oldest waiting connection is shed), and the slow ones are
    closed by the header timeout even though they keep trickling bytes."""
    srv = ServerProcess(tmp_path / "server.log", "--model", str(tiny_model_dir), "--bank-dir", "none",
                        "--max-connections", "40", "--header-timeout", "3")
    slow: list[socket.socket] = []
    try:
        srv.wait_healthy()
        for _ in range(150):
            slow.append(_slow_client(srv.port))
        for _ in range(5):
            t0 = time.monotonic()
            with httpx.Client(timeout=5, trust_env=False) as c:
                r = c.get(srv.url + "/health")
            assert r.status_code == 200 and time.monotonic() - t0 < 2.0
            for s in slow[-20:]:  # the newest are still open: a trickle must not keep them
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
        time.sleep(4)  # past the header timeout: every slow connection is closed
        closed = 0
        for s in slow:
            s.settimeout(2)
            try:
                s.sendall(b"Y-Header: 1\r\n")
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == len(slow)
        assert srv.proc.poll() is None
        assert "connections open (cap 40)" in srv.log()
    finally:
        for s in slow:
            s.close()
        srv.kill()


def test_fd_limit_is_never_reached(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With the open-file limit at 320 and the cap on auto, 600 idle connections cannot
    exhaust descriptors: `/health` answers throughout."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (320, 320))

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "segserve.server.cli", "serve", "--port", str(port), "--model", str(tiny_model_dir),
         "--bank-dir", "none"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        preexec_fn=low_limit,
    )
    idle: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for _ in range(600):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        t0 = time.monotonic()
        r = httpx.get(url + "/health", timeout=5, trust_env=False)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        assert "out of system resource" not in (tmp_path / "server.log").read_text()
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait(5)
        log.close()
