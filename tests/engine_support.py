"""Drive an `Engine` from tests: submit requests on a private event loop, collect events."""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import mlx.core as mx
import pytest

import segserve.server.scheduling.scheduler as scheduler_mod
from segserve.config.settings import load_settings
from segserve.kernels.composed import attend_segments
from segserve.server.engine import (
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
from segserve.server.runner import LoadedModel, SamplingParams
from segserve.server.runtime import make_engine as runtime_engine
from segserve.server.scheduling import LookupHit, RequestCost, SnapshotStore, price
from segserve.server.scheduling.params import TokenLogprob
from tests.conftest import ram_store

T = TypeVar("T")


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


def run_all(engine: Engine, reqs: Sequence[GenerationRequest],
             collect: Callable[[RequestHandle], Awaitable[T]]) -> list[T]:
    """Submit all requests at once (they run concurrently); `collect` each one's events."""

    async def main() -> list[T]:
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(r, loop) for r in reqs]
        for h in handles:
            engine.submit(h)
        return list(await asyncio.gather(*(collect(h) for h in handles)))

    return asyncio.run(main())


def run(engine: Engine, reqs: Sequence[GenerationRequest]) -> list[Result]:
    """Submit all requests at once (they run concurrently) and wait for every result."""
    return run_all(engine, reqs, _collect)


@dataclass
class Answer:
    started: Started | None = None
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    done: dict[int, Done] = field(default_factory=dict)
    failed: Failed | None = None
    order: list[int] = field(default_factory=list)  # choice index of each event after Started


def run_n(engine: Engine, reqs: Sequence[GenerationRequest]) -> list[Answer]:
    """Submit all at once; collect every choice of each until n `Done`s (or a `Failed`)."""

    async def collect(h: RequestHandle) -> Answer:
        a = Answer()
        while len(a.done) < h.request.n:
            ev = await asyncio.wait_for(h.queue.get(), 120)
            if isinstance(ev, Started):
                a.started = ev
            elif isinstance(ev, Token):
                a.tokens.setdefault(ev.index, []).append(ev.token_id)
                if ev.logprob is not None:
                    a.logprobs.setdefault(ev.index, []).append(ev.logprob)
                a.order.append(ev.index)
            elif isinstance(ev, Done):
                a.done[ev.index] = ev
            elif isinstance(ev, Failed):
                a.failed = ev
                break
        return a

    return run_all(engine, reqs, collect)


def price_spy(monkeypatch: pytest.MonkeyPatch) -> list[RequestCost]:
    """Every RequestCost the scheduler prices from now on, in order."""
    seen: list[RequestCost] = []
    original = scheduler_mod.request_cost

    def spy(
        prompt_tokens: int, max_tokens: int, hit: LookupHit, n: int = 1, plain_greedy: bool = False
    ) -> RequestCost:
        cost = original(prompt_tokens, max_tokens, hit, n, plain_greedy)
        seen.append(cost)
        return cost

    monkeypatch.setattr(scheduler_mod, "request_cost", spy)
    return seen


def with_peak(fn: Callable[[], T]) -> tuple[T, int]:
    """`fn()` and MLX's peak memory above what was active when it started (caches cleared
    first, so freed buffers kept for reuse do not hide an allocation)."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    return out, mx.get_peak_memory() - base


def check_turns_within_price(engine: Engine, costs: list[RequestCost]) -> None:
    """Three turns of one session, sized so the tiered merge runs in one of them: MLX's
    peak above each turn's start <= the price admission computed <= 2 x that peak."""
    history: list[int] = []
    merged = 0
    for turn, (n_new, max_tokens) in enumerate([(600, 40), (300, 40), (900, 24)]):
        prompt = history + [100 + (i * 7 + turn) % 5000 for i in range(n_new)]
        req = GenerationRequest(
            f"t{turn}", tuple(prompt), max_tokens, SamplingParams(temperature=0.0), session_id="s"
        )
        (res,), peak = with_peak(functools.partial(run, engine, [req]))
        assert res.failed is None and len(res.tokens) == max_tokens
        cost = costs[-1]
        merged += cost.merge_rows
        priced = price(cost, engine.scheduler.limits).total_bytes
        # Shown with `pytest -s`: the margin, not only the verdict.
        print(f"turn {turn}: peak {peak} B, price {priced} B, price / peak {priced / max(1, peak):.2f}")
        assert peak <= priced <= 2 * peak, f"turn {turn}: peak {peak} B, price {priced} B"
        history = prompt + res.tokens
    assert merged > 0, "no turn merged segments: the merge price went untested"
