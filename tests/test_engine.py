"""Engine on a tiny random-weight llama: segmented vs stock vs cold prefill (golden tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from segserve.server.engine import (
    Done,
    Engine,
    Event,
    GenerationRequest,
    NullObserver,
    RequestHandle,
)
from segserve.server.runner import ChatTokenizer, SamplingParams
from tests.conftest import make_tiny_model, tiny_loaded
from tests.engine_support import make_engine, run


@pytest.fixture
def engines(gguf_tokenizer: ChatTokenizer) -> Iterator[Callable[[bool], Engine]]:
    made: list[Engine] = []
    model = make_tiny_model(seed=3)

    def make(segmented: bool) -> Engine:
        eng = make_engine(tiny_loaded(gguf_tokenizer, model), segmented=segmented)
        made.append(eng)
        return eng

    yield make
    for e in made:
        e.stop()


def _conversation(turns: int) -> list[list[int]]:
    """Each turn's prompt extends the previous prompt + its reply (filled in later)."""
    return [[100 + 7 * t + i for i in range(5 + 3 * t)] for t in range(turns)]


def test_twelve_turns_same_tokens_as_cold_prefill(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    seg, cold = engines(True), engines(True)
    history: list[int] = [1, 2, 3]
    for t, user in enumerate(_conversation(12)):
        prompt = history + user
        warm = run(seg, [make_request(prompt, 6, session_id="conv")])[0]
        ref = run(cold, [make_request(prompt, 6, salt=f"cold-{t}")])[0]  # a new salt: nothing to reuse
        assert warm.tokens == ref.tokens, f"turn {t}"
        assert ref.started is not None and ref.started.cached_tokens == 0
        assert warm.started is not None
        if t > 0:
            # Everything but the last prompt token came from the previous turn's segments.
            assert warm.started.cached_tokens >= len(history) - 1
        history = prompt + warm.tokens


def test_segmented_and_stock_agree(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    seg, stock = engines(True), engines(False)
    history: list[int] = [5, 6]
    for user in _conversation(4):
        prompt = history + user
        a = run(seg, [make_request(prompt, 5, session_id="s")])[0]
        b = run(stock, [make_request(prompt, 5, session_id="s")])[0]
        assert a.tokens == b.tokens
        assert a.started and b.started and a.started.cached_tokens == b.started.cached_tokens
        history = prompt + a.tokens


def test_fork_and_rollback_match_cold(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    seg, cold = engines(True), engines(True)
    base = list(range(200, 240))
    first = run(seg, [make_request(base, 4, session_id="a")])[0]
    # Fork: a different continuation of the same history, found by prefix.
    branch = base + first.tokens + [300, 301, 302]
    # Rollback: back to the middle of the first prompt (a view into a segment).
    rollback = base[:25] + [400, 401]
    for prompt in (branch, rollback):
        warm = run(seg, [make_request(prompt, 5)])[0]
        ref = run(cold, [make_request(prompt, 5, salt="cold")])[0]
        assert warm.tokens == ref.tokens
        assert warm.started and warm.started.cached_tokens > 0


def test_concurrent_requests_match_sequential(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    eng = engines(True)
    prompts = [[10 + i] * (20 + 13 * i) for i in range(3)]
    together = run(eng, [make_request(p, 6, salt=f"t{i}") for i, p in enumerate(prompts)])
    alone = [run(eng, [make_request(p, 6, salt=f"a{i}")])[0] for i, p in enumerate(prompts)]
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_max_tokens_gives_length(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    r = run(engines(True), [make_request([1, 2, 3], 3)])[0]
    assert r.done is not None and r.done.finish_reason in ("length", "stop")
    if r.done.finish_reason == "length":
        assert r.done.completion_tokens == 3


def test_engine_reports_kv_state(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest]
) -> None:
    eng = engines(True)
    run(eng, [make_request(list(range(50)), 4, session_id="k")])
    st = eng.kv_state()
    assert st["seals"] == 2  # end of prompt + end of generation
    assert st["live_segments"] >= 1 and st["bytes"]["segments"] > 0


def test_running_gauge_is_down_before_done_is_emitted(gguf_tokenizer: ChatTokenizer) -> None:
    # A client that scrapes /metrics right after its last byte must not count itself as
    # running: the engine updates the gauge before it emits Done (on its own thread, so
    # this reads the value the observer held at that moment, without a race).
    class Gauge(NullObserver):
        value = -1

        def running(self, n: int) -> None:
            self.value = n

    obs = Gauge()
    seen: list[int] = []

    class Handle(RequestHandle):
        def emit(self, event: Event) -> None:
            if isinstance(event, Done):
                seen.append(obs.value)
            super().emit(event)

    eng = make_engine(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3)), segmented=True, observer=obs)
    try:
        async def main() -> None:
            h = Handle(GenerationRequest("g", (1, 2, 3), 3, SamplingParams(temperature=0.0)),
                       asyncio.get_running_loop())
            eng.submit(h)
            while not isinstance(await h.queue.get(), Done):
                pass

        asyncio.run(main())
    finally:
        eng.stop()
    assert seen == [0]


def test_idle_hook_runs_when_the_last_request_ends(
    engines: Callable[[bool], Engine], make_request: Callable[..., GenerationRequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server hands freed heap back there (segserve.server.runtime.release_cpu_memory):
    # once work has ended, never while a request runs.
    from segserve.server import runtime

    seen: list[int] = []
    made: list[Engine] = []
    monkeypatch.setattr(runtime, "release_cpu_memory", lambda: seen.append(made[0].running))
    eng = engines(True)
    made.append(eng)
    assert seen == []  # nothing ran yet
    for reqs in ([make_request([1, 2, 3], 4), make_request([4, 5, 6, 7], 6)], [make_request([8, 9], 3)]):
        before = len(seen)
        run(eng, reqs)
        deadline = time.monotonic() + 10  # Done reaches the client first, then the hook runs
        while len(seen) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) > before
    assert all(r == 0 for r in seen)
