"""The engine: the thread that owns MLX and runs schedule -> execute -> update.

Owns: `Engine` (the loop in `loop.py`), its `Mailbox` (new requests and session-API calls
run between steps), what a refused or failed request is told (`refusals.py`, `errors.py`:
domain values that the HTTP side maps to status codes), the typed messages between the
engine thread and the HTTP side (`GenerationRequest`, `RequestHandle`, the events
`Started`/`Token`/`Done`/`Failed`), the state it publishes after each step (`state.py`),
`EngineClient` (`client.py`, the HTTP side's one door in), and the observer interface the
loop reports to. The session bank (`segserve.bank.Bank`) is the scheduler's store as it is.
May import: `segserve.server.scheduling`, `segserve.server.runner`, `bank`, `kv`, `config`, mlx.
Never `segserve.server.http` or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from segserve.server.engine.events import (
        Done,
        Event,
        Failed,
        GenerationRequest,
        RequestHandle,
        Started,
        Token,
    )
    from segserve.server.engine.loop import Engine
    from segserve.server.engine.observer import EngineObserver, NullObserver
    from segserve.server.scheduling.params import SamplingParams, TokenLogprob

# Loaded on first use (PEP 562): importing a light module of this package (`errors`,
# `state`) must not import the runner, hence mlx-lm, which the CLI imports only once it
# has kept mlx-lm from lowering the open-file limit (`segserve.server.http.http_guard`).
_WHERE = {
    "Done": "events", "Event": "events", "Failed": "events", "GenerationRequest": "events",
    "RequestHandle": "events", "Started": "events", "Token": "events",
    "Engine": "loop", "EngineObserver": "observer", "NullObserver": "observer",
    # The request vocabulary the HTTP side builds requests with and reads tokens in.
    "SamplingParams": "segserve.server.scheduling.params",
    "TokenLogprob": "segserve.server.scheduling.params",
}

__all__ = [
    "Done", "Engine", "EngineObserver", "Event", "Failed", "GenerationRequest",
    "NullObserver", "RequestHandle", "SamplingParams", "Started", "Token", "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where if "." in where else f"{__name__}.{where}")
    value = getattr(module, name)
    globals()[name] = value
    return value
