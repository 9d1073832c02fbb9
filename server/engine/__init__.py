"""The engine: the thread that owns MLX and runs schedule -> execute -> update.

Owns: `Engine` (the loop in `loop.py`, the published kv/bank state), its `Mailbox` (new
requests and session-API calls run between steps), what a refused or failed request is told
(`refusals.py`, `errors.py`: domain values that the HTTP side maps to status codes), the
typed messages between the engine thread and the HTTP side (`GenerationRequest`, `RequestHandle`, the events `Started`/`Token`/`Done`/`Failed`), the
observer interface the loop reports to, and `BankStore` (the session bank behind the
scheduler's store protocol).
May import: `segserve.server.scheduling`, `segserve.server.runner`, `bank`, `kv`, `config`, mlx.
Never `segserve.server.http` or prometheus_client.
"""

from segserve.server.engine.bank_store import BankStore, make_bank, namespace_for
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

# The request vocabulary the HTTP side builds requests with and reads tokens in.
from segserve.server.runner import SamplingParams, TokenLogprob

__all__ = [
    "BankStore", "Done", "Engine", "EngineObserver", "Event", "Failed", "GenerationRequest",
    "NullObserver", "RequestHandle", "SamplingParams", "Started", "Token", "TokenLogprob", "make_bank",
    "namespace_for",
]
