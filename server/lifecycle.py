"""Process lifecycle: serve until SIGTERM or SIGINT, then shut down without losing data.

Owns: `ShutdownSignals` (our SIGTERM/SIGINT handlers, installed for the whole process
life, before the model loads) and `run_http(rt, app, signals)` (uvicorn, with the graceful
drain below). `segserve.server.cli.serve` then stops the engine, flushes the bank and logs "stopped".

Why not uvicorn's own handling: uvicorn's `Server.capture_signals` re-raises the captured
signal once it has shut down, and a re-raised SIGTERM kills the process before our cleanup
runs (the SSD writer's queued writes were lost). Here uvicorn never sees a signal: the
subclass's `capture_signals` is a no-op and our handler sets `should_exit`.

On the first SIGTERM or SIGINT (both alike):
1. stop accepting: the listening sockets close; requests arriving on open connections
   get 503 `shutting_down`, and `/health` answers 503;
2. in-flight requests get `--shutdown-timeout` seconds to finish;
3. the engine stops: requests still running end with `ShuttingDown` — a started stream
   gets an error event then `data: [DONE]`, a non-streaming request a 503 — their sealed
   prompt rows are stored first;
4. uvicorn closes the connections (they are idle by now).
A second signal exits at once (code 128 + signal number), queued SSD writes included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from segserve.server.runtime import Runtime

log = logging.getLogger("segserve")

# After the drain every response has ended: what is left for uvicorn is closing sockets.
_AFTER_DRAIN_S = 5.0
_POLL_S = 0.05


class ShutdownSignals:
    """First SIGTERM/SIGINT: graceful shutdown. Second: exit at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.server: uvicorn.Server | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.received is not None:
            log.warning("second signal (%s): exiting now, without waiting", name)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(128 + sig)
        self.received = sig
        log.info("%s received: shutting down gracefully (send it again to exit at once)", name)
        if self.server is not None:
            self.server.should_exit = True


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, rt: Runtime) -> None:
        super().__init__(config)
        self.rt = rt

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are `ShutdownSignals`' (uvicorn's would re-raise them at the end)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in getattr(self, "servers", []):
            server.close()  # stop accepting new connections
        await drain(self.rt, self.rt.settings.shutdown_timeout)
        await super().shutdown(sockets)


async def drain(rt: Runtime, timeout: float) -> None:
    """Refuse new work, give in-flight requests `timeout` seconds, then stop the engine
    (which ends the rest with `ShuttingDown`) and let their handlers write the ending."""
    rt.serving.draining = True
    if not await _wait_idle(rt, timeout) and rt.serving.inflight:
        log.warning("%d request(s) still running after %gs: ending them", rt.serving.inflight, timeout)
    await asyncio.to_thread(rt.engine.stop)
    await _wait_idle(rt, _AFTER_DRAIN_S)


async def _wait_idle(rt: Runtime, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while rt.serving.inflight > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


def run_http(
    rt: Runtime, app: Any, signals: ShutdownSignals, sock: socket.socket | None = None
) -> None:
    """Serve until a signal; returns after the graceful drain (engine stopped). `sock` is
    the listening socket bound before the model loaded (`segserve.server.preflight.bind`); the
    protocol adds the header timeout and the connection cap (`segserve.server.http.http_guard`)."""
    from segserve.server.http.http_guard import protocol_kwargs

    config = uvicorn.Config(
        app, host=rt.settings.host, port=rt.settings.port, log_level="warning",
        access_log=False, timeout_graceful_shutdown=int(_AFTER_DRAIN_S),
        **protocol_kwargs(rt.settings),
    )
    server = _GracefulServer(config, rt)
    signals.server = server
    server.should_exit = signals.received is not None  # a signal came during start-up
    server.run(sockets=[sock] if sock is not None else None)
