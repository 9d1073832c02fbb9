"""`EngineClient`: the HTTP side's one door into the engine.

Generation through `generate`, typed session commands with domain errors, and `state()`:
the `EngineState` the engine thread publishes, which `/health` reads and nothing else.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from segserve.config.settings import load_settings
from segserve.server.engine import Done, GenerationRequest, SamplingParams, Started
from segserve.server.engine.client import EngineClient, LocalEngineClient
from segserve.server.engine.errors import EngineUnavailable, UnknownSession
from segserve.server.engine.state import EngineState
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.http_support import tiny_runtime


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    runtime = tiny_runtime(tiny_loaded(gguf_tokenizer, context=512), load_settings({}, environ={}))
    yield runtime
    runtime.engine.stop()


def _request(rid: str, session: str | None) -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(10, 40)), 3, SamplingParams(temperature=0.0), session_id=session)


async def _generate(client: EngineClient, req: GenerationRequest) -> Done:
    handle = client.generate(req)
    first = await handle.queue.get()
    assert isinstance(first, Started)
    while True:
        ev = await handle.queue.get()
        if isinstance(ev, Done):
            return ev


def test_generate_sessions_and_state(rt: Runtime) -> None:
    client = rt.serving.engine
    assert isinstance(client, LocalEngineClient) and client.has_sessions

    async def scenario() -> None:
        done = await _generate(client, _request("r1", "conv-a"))
        assert done.session_id == "conv-a" and done.completion_tokens == 3
        st = client.state()
        assert isinstance(st, EngineState) and st.alive and st.running == 0
        assert st.bank["sessions"] >= 1 and st.memory.weights == rt.loaded.weights_bytes
        info = await client.session_info("conv-a", None)
        assert info.id == "conv-a" and info.turns == 1
        fork = await client.fork_session("conv-a", 0, None, new_id="conv-b")  # fork + info, one trip
        assert fork.id == "conv-b" and fork.turns == 1 and fork.tokens == info.tokens
        assert {"conv-a", "conv-b"} <= {s.id for s in await client.list_sessions(None)}
        await client.delete_session("conv-b", None)
        with pytest.raises(UnknownSession):
            await client.session_info("conv-b", None)
        with pytest.raises(UnknownSession):  # another tenant's session is unknown
            await client.session_info("conv-a", "tenant-x")
        # Published after the DELETE, before the call returned.
        assert client.state().bank["sessions"] == st.bank["sessions"]

    asyncio.run(scenario())


def test_state_is_read_on_the_engine_thread(rt: Runtime) -> None:
    """The memory figures come from the engine thread: a reading function records where it
    ran, and `state()` on the caller's thread calls none of them."""
    eng = rt.engine
    seen: list[str] = []

    def peak() -> int:
        seen.append(threading.current_thread().name)
        return 123

    old = eng._readings
    eng._readings = type(old)(old.active, peak, old.cache)
    try:
        asyncio.run(_generate(rt.serving.engine, _request("r2", None)))
        assert seen and set(seen) == {"segserve-engine"}
        n = len(seen)
        assert rt.serving.engine.state().memory.peak == 123
        assert rt.serving.health()["admission"]["running"] == 0
        assert len(seen) == n  # reading the state (and /health) read no memory here
    finally:
        eng._readings = old


def test_a_dead_engine_is_a_domain_error(rt: Runtime, gguf_tokenizer: ChatTokenizer) -> None:
    other = tiny_runtime(tiny_loaded(gguf_tokenizer, context=512), load_settings({}, environ={}))
    other.engine.stop()
    client = other.serving.engine

    async def scenario() -> None:
        with pytest.raises(EngineUnavailable):
            client.generate(_request("r3", None))
        with pytest.raises(EngineUnavailable):
            await client.list_sessions(None)

    asyncio.run(scenario())
    assert not client.state().alive


def test_continue_from_is_one_engine_trip(rt: Runtime) -> None:
    """A request that continues a stored turn: the fork happens with the request (no
    session call first), the stored rows are reused, `Done.turn` names the new turn, and
    the continued session is left as it was."""
    client = rt.serving.engine

    async def run(req: GenerationRequest) -> tuple[Started, Done]:
        handle = client.generate(req)
        first = await handle.queue.get()
        assert isinstance(first, Started)
        while not isinstance(ev := await handle.queue.get(), Done):
            pass
        return first, ev

    async def scenario() -> None:
        base = GenerationRequest("c0", tuple(range(50, 90)), 2, SamplingParams(temperature=0.0), session_id="p")
        _, d0 = await run(base)
        assert d0.turn == 0
        longer = (*base.prompt, 7, 8, 9)
        calls: list[object] = []
        real_call = rt.engine.call

        def counted(fn: Any) -> Any:
            calls.append(fn)
            return real_call(fn)

        rt.engine.call = counted  # type: ignore[method-assign]
        cont = GenerationRequest("c1", longer, 2, SamplingParams(temperature=0.0), session_id="p-next",
                                 continue_from=("p", 0))
        try:
            started, d1 = await run(cont)
        finally:
            del rt.engine.call  # back to the class's method
        assert calls == []  # one trip: no session call besides the request itself
        assert started.cached_tokens >= len(base.prompt) - 1  # P's rows, not a cold prefill
        assert d1.session_id == "p-next" and d1.turn == 1  # P's turn, then this one
        assert (await client.session_info("p", None)).turns == 1  # P is never appended to
        gone = GenerationRequest("c2", longer, 2, SamplingParams(temperature=0.0), session_id="q-next",
                                 continue_from=("no-such-session", 0))
        started, d2 = await run(gone)
        assert d2.turn == 0  # nothing to fork: a new session, prefilled from the tokens

    asyncio.run(scenario())
