"""Server subprocesses for the benchmarks: start on a free loopback port, wait, measure, stop.

Owns: `ManagedServer` (one child process, its base URL and its log file), the command lines
for `segserve serve` and `mlx_lm.server`, and `running_server`, the context manager that
guarantees the child is gone when the block exits (normal end, exception, Ctrl-C, timeout).

Used by bench/speed.py, bench/peers.py and bench/cpu_peers.py (llama.cpp's `llama-server`,
built by bench/llama_server_setup.sh); not imported by the server. Invariants: servers
bind 127.0.0.1 only; the child runs in its own session so that stopping it (SIGTERM, then
SIGKILL after a grace period) reaches every process it spawned and nothing else.
Resident memory is read from /proc/<pid>/status (Linux), so it covers exactly the server
process: `segserve serve` re-executes itself with a fast BLAS preloaded through execve, which
keeps the pid, and `mlx_lm.server` is a single process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """The server did not start, or died; the message carries the tail of its log."""


def free_loopback_port() -> int:
    # The port is free now; a race with another process is possible but harmless here
    # (the server would fail to bind and `wait_ready` reports its log).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def segserve_argv(port: int, extra: list[str] | None = None) -> list[str]:
    # `-m segserve.server.cli` rather than the `segserve` script: same code, and it works from any
    # venv whose interpreter runs this file.
    # A benchmark server gets no SSD tier unless asked: the default (the user's cache
    # directory) would carry sessions from one run into the next, and two servers started
    # side by side would contend for its lock.
    extra = list(extra or [])
    if "--bank-dir" not in extra:
        extra += ["--bank-dir", "none"]
    return [sys.executable, "-m", "segserve.server.cli", "serve", "--host", LOOPBACK,
            "--port", str(port), *extra]


def mlx_lm_argv(model_dir: str, port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--host", LOOPBACK,
            "--port", str(port), "--log-level", "WARNING", *(extra or [])]


# Built by `make bench-peers-setup` (bench/llama_server_setup.sh); never at serve time.
LLAMA_SERVER_BIN = Path(__file__).resolve().parent / "out" / "llama.cpp" / "bin" / "llama-server"


def llama_server_binary() -> Path | None:
    """llama.cpp's server as the peer benchmarks use it, or None when it is not built."""
    return LLAMA_SERVER_BIN if os.access(LLAMA_SERVER_BIN, os.X_OK) else None


def llama_server_argv(binary: Path, gguf: Path, port: int, *, slots: int, ctx_per_slot: int,
                      threads: int, poll: int = 0) -> list[str]:
    # One KV pool of slots x ctx_per_slot cells; --no-webui: nothing the benchmark needs.
    # --poll 0 (ggml's workers sleep instead of spinning between ops): on the shared 2-vCPU
    # machine the default spin (50) with -t 2 decoded 0.9-1.9 tok/s against 50-61 with
    # --poll 0 (and 42-44 with -t 1), one manual run each; segserve's pool also sleeps
    # after a short spin (QMM_SPIN_US).
    return [str(binary), "-m", str(gguf), "--host", LOOPBACK, "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads),
            "--poll", str(poll), "--no-webui"]


def blas_env() -> dict[str, str]:
    """LD_PRELOAD for a plain MLX process on Linux CPU (segserve preloads by itself).

    MLX's CPU wheel links the reference BLAS (~6 GFLOP/s here); the peer gets the same
    fast BLAS as segserve so that the comparison is about serving, not about BLAS.
    """
    from segserve.config.launcher import blas_library  # the one place that knows the library paths

    lib = blas_library("auto")
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return {}
    env = {"LD_PRELOAD": ":".join(p for p in (lib, os.environ.get("LD_PRELOAD", "")) if p)}
    env["BLIS_NUM_THREADS"] = os.environ.get("BLIS_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def read_proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of `pid` in bytes; {} when /proc is not available."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return out


@dataclass(slots=True)
class ManagedServer:
    name: str
    proc: subprocess.Popen[bytes]
    base_url: str
    log: IO[bytes]

    def rss_bytes(self) -> int | None:
        return read_proc_status(self.proc.pid).get("VmRSS")

    def peak_rss_bytes(self) -> int | None:
        return read_proc_status(self.proc.pid).get("VmHWM")

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n"
                              f"{self.log_tail()}")


def wait_ready(server: ManagedServer, timeout_s: float) -> float:
    """Poll GET /health until 200 (both servers have it); return seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    # trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback traffic.
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            server.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.25)
    raise ServerError(f"{server.name} not ready after {timeout_s:.0f}s:\n{server.log_tail()}")


def stop(server: ManagedServer, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; always reaps.

    Neither server forks workers, so the group is the server alone; signalling the group
    (not just the pid) still covers a helper process should a future version start one.
    """
    if server.proc.poll() is None:
        _signal_group(server.proc, signal.SIGTERM)
        try:
            server.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(server.proc, signal.SIGKILL)
            server.proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # start_new_session=True made the child a group leader: pgid == its pid, ours alone.
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.send_signal(sig)


@contextlib.contextmanager
def running_server(
    name: str, argv: list[str], *, env: dict[str, str] | None = None,
    startup_timeout_s: float = 300.0,
) -> Iterator[ManagedServer]:
    """Start `argv` (which must bind LOOPBACK on the port it names), wait, yield, stop.

    `argv` must contain `--port N`; the base URL is built from it. The child inherits this
    process's environment plus `env`.
    """
    port = int(argv[argv.index("--port") + 1])
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        server = ManagedServer(name, proc, f"http://{LOOPBACK}:{port}", log)
        try:
            wait_ready(server, startup_timeout_s)
            yield server
        finally:
            stop(server)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `running_server`'s finally stops the server.

    The server runs in its own session (so a terminal's Ctrl-C reaches only us and we stop
    it in order); Python's default SIGTERM action would exit without unwinding and leave it.
    """
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def convert_model(out_dir: str, timeout_s: float = 600.0) -> None:
    """`segserve convert OUT_DIR`: the embedded GGUF as an mlx-lm directory (same weights)."""
    done = subprocess.run([sys.executable, "-m", "segserve.server.cli", "convert", out_dir],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise ServerError(f"segserve convert failed ({done.returncode}):\n{done.stderr[-3000:]}")
