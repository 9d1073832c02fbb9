"""`--compare`: start a segserve twice (segmented KV on, then off) and run the same load.

Each server gets a free loopback port (`{port}` in the command, else `--host 127.0.0.1
--port N` appended), is waited for on `/health`, and is stopped (SIGTERM, then SIGKILL
after 15 s) before the next one starts. Each mode starts cold: no SSD tier carried over
unless the caller set SEGSERVE_BANK_DIR.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import IO

import httpx

from segserve.server.loadtest.client import LoadTestError
from segserve.server.loadtest.runner import LoadConfig, Progress, RunResult, run_load

MODES = (("segmented", "1"), ("stock", "0"))


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-2000:]


def _wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float,
                  log: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LoadTestError(f"server exited with {proc.returncode}:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base}/health").status_code == 200:
                    return
            time.sleep(0.25)
    raise LoadTestError(f"server not healthy after {timeout_s:.0f}s:\n{_log_tail(log)}")


@contextlib.contextmanager
def running_server(cmd: str, env: dict[str, str], startup_timeout_s: float) -> Iterator[str]:
    """Start `cmd` on a free loopback port, wait for /health 200, yield its base URL, stop it."""
    port = free_loopback_port()
    if "{port}" in cmd:
        argv = shlex.split(cmd.replace("{port}", str(port)))
    else:
        argv = [*shlex.split(cmd), "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                    stderr=subprocess.STDOUT)
        except OSError as exc:
            raise LoadTestError(f"--server-cmd {cmd!r}: {exc}") from None
        try:
            _wait_healthy(proc, base, startup_timeout_s, log)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def compare(cfg: LoadConfig, server_cmd: str, bank_max_bytes: str | None,
            startup_timeout_s: float, api_key: str | None,
            progress: bool = True) -> dict[str, tuple[LoadConfig, RunResult]]:
    """{"segmented": (cfg, result), "stock": (cfg, result)}."""
    out: dict[str, tuple[LoadConfig, RunResult]] = {}
    for label, flag in MODES:
        env = {"SEGSERVE_SEGMENTED_KV": flag,
               "SEGSERVE_BANK_DIR": os.environ.get("SEGSERVE_BANK_DIR", "none")}
        if bank_max_bytes is not None:
            env["SEGSERVE_BANK_MAX_BYTES"] = bank_max_bytes
        with running_server(server_cmd, env, startup_timeout_s) as base:
            run_cfg = replace(cfg, url=base)
            bar = Progress(cfg.total_requests, enabled=progress)
            out[label] = (run_cfg, asyncio.run(run_load(run_cfg, api_key, bar)))
    return out
