"""Build a server Runtime around a tiny model, and run it on loopback with uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from segserve.config.settings import Settings
from segserve.kernels.composed import attend_segments
from segserve.server.runner import LoadedModel
from segserve.server.runtime import KVVerdict, Runtime, build_runtime
from segserve.server.scheduling import SnapshotStore
from tests.conftest import ram_store


def tiny_runtime(
    loaded: LoadedModel,
    settings: Settings,
    *,
    segmented: bool = True,
    store: SnapshotStore | None = None,
    memory_in_use: Callable[[], int] | None = None,
) -> Runtime:
    """A started runtime built by the server's own factory, with the composed route."""
    mode = "segmented" if segmented else "stock"
    kv = KVVerdict(mode, mode, True, "tiny test model", "composed", True, "skipped in tests")
    rt = build_runtime(
        settings, loaded=loaded, store=store or ram_store(),
        kv=(kv, attend_segments if segmented else None), memory_in_use=memory_in_use,
    )
    rt.engine.start()
    return rt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not t.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)
