"""Drive an `Engine` from tests: submit requests on a private event loop, collect events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from config.settings import load_settings
from kernels.composed import attend_segments
from server.engine import (
    Done,
    Engine,
    EngineObserver,
    Failed,
    GenerationRequest,
    NullObserver,
    RequestHandle,
    Started,
    Token,
)
from server.runner import LoadedModel
from server.runtime import make_engine as runtime_engine
from server.scheduling import SnapshotStore
from tests.conftest import ram_store


@dataclass
class Result:
    tokens: list[int]
    text: str
    done: Done | None
    failed: Failed | None
    started: Started | None


def make_engine(
    loaded: LoadedModel, *, segmented: bool, store: SnapshotStore | None = None, chunk: int = 16,
    settings_over: dict[str, str] | None = None,
    memory_in_use: Callable[[], int] | None = None,
    observer: EngineObserver | None = None,
) -> Engine:
    settings = load_settings({"prefill_chunk": str(chunk), **(settings_over or {})}, environ={})
    kw = {"memory_in_use": memory_in_use} if memory_in_use is not None else {}
    route = attend_segments if segmented else None
    eng = runtime_engine(settings, loaded, store or ram_store(), observer or NullObserver(), route=route, **kw)
    eng.start()
    return eng


async def _collect(handle: RequestHandle) -> Result:
    toks: list[int] = []
    text: list[str] = []
    started = None
    while True:
        ev = await asyncio.wait_for(handle.queue.get(), 120)
        if isinstance(ev, Started):
            started = ev
        elif isinstance(ev, Token):
            toks.append(ev.token_id)
            text.append(ev.text)
        elif isinstance(ev, Done):
            return Result(toks, "".join(text) + ev.tail_text, ev, None, started)
        elif isinstance(ev, Failed):
            return Result(toks, "".join(text), None, ev, started)


def run(engine: Engine, reqs: Sequence[GenerationRequest]) -> list[Result]:
    """Submit all requests at once (they run concurrently) and wait for every result."""

    async def main() -> list[Result]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in reqs]
        for h in handles:
            engine.submit(h)
        return list(await asyncio.gather(*(_collect(h) for h in handles)))

    return asyncio.run(main())
