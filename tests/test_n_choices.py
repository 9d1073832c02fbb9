"""`n` > 1 as forks of one prefilled prompt.

Differential tests against the plain path: n greedy choices equal one request's answer;
choice i with `seed` equals a lone request with `seed + i`. Then: the forks share the
prompt's segments by reference (same objects, and the memory a step holds grows by tails,
not prompts), admission prices one prompt plus n tails (and the measured peak stays within
that price), the scheduler ends choices one by one, HTTP shapes (non-streaming choices,
streamed `index`es, usage with the prompt once, n out of range), per-choice grammars, the
official SDK with `n=2`, and `/v1/responses` leaving no bank session for a client that left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest

import segserve.server.scheduling.scheduler as scheduler_mod
from segserve.bank import Bank, LookupResult
from segserve.config.settings import load_settings
from segserve.kernels.composed import attend_segments
from segserve.kernels.hook import install
from segserve.kv.segment import Snapshot
from segserve.server.engine import (
    Engine,
    GenerationRequest,
    RequestHandle,
    Token,
)
from segserve.server.http.app import create_app
from segserve.server.runner import (
    ChatTokenizer,
    LoadedModel,
    ModelRunner,
    SamplingParams,
)
from segserve.server.runtime import Runtime
from segserve.server.scheduling import (
    PrefillChunk,
    RequestCost,
    Sampled,
    StepOutput,
    StepPlan,
    price,
)
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.engine_support import make_engine, price_spy, run_n, with_peak
from tests.fidelity_support import HERMES_TEMPLATE, WEATHER_TOOL, hermes_server, sdk
from tests.http_support import serve_in_thread, tiny_runtime
from tests.test_scheduler import FakeStore, Req, Tk, _limits

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "tell me about forks"}]


@pytest.fixture(scope="module")
def loaded(gguf_tokenizer: ChatTokenizer) -> LoadedModel:
    """EOS off: every answer runs to max_tokens, so token counts are exact."""
    lm = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5), context=4096)
    return dataclasses.replace(lm, tokenizer=dataclasses.replace(lm.tokenizer, eos_ids=frozenset()))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    eng = make_engine(loaded, segmented=True, chunk=64)
    yield eng
    eng.stop()


# ---- engine helpers ------------------------------------------------------------------------
def _req(rid: str, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens, sampling, **kw)


PROMPT = [300 + (i * 13) % 700 for i in range(90)]


# ---- differential: forks vs the plain path --------------------------------------------------
def test_greedy_choices_are_identical_and_equal_one_request(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0.0)
    (one,) = run_n(engine, [_req("g1", PROMPT, 7, greedy, salt="one")])
    (three,) = run_n(engine, [_req("g3", PROMPT, 7, greedy, salt="three", n=3)])
    assert one.failed is None and three.failed is None
    assert len(one.tokens[0]) == 7
    assert three.tokens == {0: one.tokens[0], 1: one.tokens[0], 2: one.tokens[0]}
    assert sorted(three.done) == [0, 1, 2]
    for i, d in three.done.items():
        assert (d.index, d.finish_reason, d.completion_tokens) == (i, "length", 7)
        assert d.prompt_tokens == len(PROMPT) and d.cached_tokens == 0
    # Decoded together: every step carries one token of each live choice.
    assert three.order[:6] == [0, 1, 2, 0, 1, 2]


def test_seeded_choice_i_equals_a_lone_request_with_seed_plus_i(engine: Engine) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, logprobs=True, top_logprobs=2)

    (multi,) = run_n(engine, [_req("s3", PROMPT, 8, params(1234), salt="multi", n=3)])
    assert multi.failed is None
    # A new salt each: nothing reused, so every answer comes from a cold prefill of the prompt.
    lone = run_n(engine, [_req(f"s1-{i}", PROMPT, 8, params(1234 + i), salt=f"lone{i}") for i in range(3)])
    for i, a in enumerate(lone):
        assert multi.tokens[i] == a.tokens[0], f"choice {i}"
        assert [lp.token_id for lp in multi.logprobs[i]] == multi.tokens[i]
        for got, want in zip(multi.logprobs[i], a.logprobs[0], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    # The offsets matter: the three choices did not all draw the same tokens.
    assert len({tuple(t) for t in multi.tokens.values()}) > 1


def test_stock_mode_forks_too(loaded: LoadedModel) -> None:
    """Stock caches fork by restoring the prompt's snapshot (a view each first write copies)."""
    stock = make_engine(loaded, segmented=False, chunk=64)
    try:
        greedy = SamplingParams(temperature=0.0)
        (one,) = run_n(stock, [_req("k1", PROMPT, 5, greedy, salt="k1")])
        (three,) = run_n(stock, [_req("k3", PROMPT, 5, greedy, salt="k3", n=3)])
        assert three.failed is None and three.tokens == {i: one.tokens[0] for i in range(3)}
    finally:
        stock.stop()


def test_choice_zero_is_the_stored_turn(engine: Engine) -> None:
    sampling = SamplingParams(temperature=1.0, seed=77)
    (a,) = run_n(engine, [_req("sess", PROMPT, 6, sampling, session_id="n-sess", n=2)])
    assert a.failed is None and a.tokens[0] != a.tokens[1]
    # The stored snapshot holds the prompt and every generated token of choice 0 but the last.
    greedy = SamplingParams(temperature=0.0)
    (follow0,) = run_n(engine, [_req("f0", [*PROMPT, *a.tokens[0], 5], 2, greedy, session_id="n-sess")])
    assert follow0.started is not None
    assert follow0.started.cached_tokens == len(PROMPT) + len(a.tokens[0]) - 1


# ---- forks share the prompt -----------------------------------------------------------------
def test_forks_share_the_prompt_segments_and_add_only_tails(gguf_tokenizer: ChatTokenizer) -> None:
    model = make_tiny_model(seed=9)
    install(model)
    lm = tiny_loaded(gguf_tokenizer, model, context=4096)
    runner = ModelRunner(lm, segmented=True, route=attend_segments)
    prompt = [100 + (i * 7) % 3000 for i in range(2000)]
    n = 8
    req = _req("fork", prompt, 16, SamplingParams(temperature=0.0), n=n)
    runner.begin(req, LookupResult(Snapshot(), 0, "miss", "none", "no stored prefix", 0))
    chunk = 500
    for start in range(0, len(prompt) - chunk, chunk):
        runner.execute(StepPlan(prefill=PrefillChunk("fork", start, chunk, last=False)))
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()  # the prompt's rows are all written (its tail reserved)
    start = len(prompt) - chunk
    out = runner.execute(StepPlan(prefill=PrefillChunk("fork", start, chunk, last=True)))
    assert [s.choice for s in out.sampled] == list(range(n))
    gc.collect()
    mx.synchronize()
    decode_start = mx.get_active_memory()  # the forks exist: nothing of theirs is written yet
    assert decode_start - before < prompt_rows_bytes(lm, len(prompt)) // 4
    mx.reset_peak_memory()  # the decode steps' peak (the prefill chunk's scores are not forks')
    for _ in range(4):
        out = runner.execute(StepPlan(decode=("fork",)))
        assert not out.failed and len(out.sampled) == n
    mx.synchronize()
    rows = runner._seqs["fork"]  # white box: the rows' caches
    prompt_segs = rows[0].cache.base.segments
    prompt_bytes = sum(s.owner.nbytes for s in prompt_segs)
    assert prompt_bytes == len(prompt) * lm.kv_bytes_per_token
    for row in rows.values():
        assert all(a is b for a, b in zip(row.cache.base.segments, prompt_segs, strict=True))
        assert row.cache.tail_nbytes() > 0  # each choice writes its own tail
    gc.collect()
    held = mx.get_active_memory() - before
    peak = mx.get_peak_memory() - decode_start
    # n - 1 copies of the prompt would hold 7 x prompt_bytes (about 28 MB here); what is held
    # is 8 tails of one 64-row step (1 MB); the steps' peak adds the [8, vocab] logits and
    # the samplers' float32 rows (about 3 MB with this vocabulary, whatever the prompt).
    assert held < prompt_bytes, (held, prompt_bytes)
    assert peak < 2 * prompt_bytes, (peak, prompt_bytes)


def prompt_rows_bytes(lm: LoadedModel, tokens: int) -> int:
    return tokens * lm.kv_bytes_per_token


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RequestCost]]:
    yield price_spy(monkeypatch)


def test_n_choices_peak_is_within_its_price(
    gguf_tokenizer: ChatTokenizer, costs: list[RequestCost]
) -> None:
    """The tests/test_admission_peak.py check with n = 4: peak <= price <= 2 x peak (without
    speculation, as there: with it each choice is priced for a full verify window)."""
    engine = make_engine(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3), context=4096), segmented=True,
                         chunk=64, settings_over={"speculative": "off"})
    try:
        prompt = [100 + (i * 7) % 5000 for i in range(600)]
        req = _req("peak", prompt, 40, SamplingParams(temperature=0.0), n=4)
        (a,), peak = with_peak(lambda: run_n(engine, [req]))
        assert a.failed is None
        cost = costs[-1]
        assert cost.choices == 4
        priced = price(cost, engine.scheduler.limits).total_bytes
        assert peak <= priced <= 2 * peak, f"peak {peak} B, price {priced} B"
    finally:
        engine.stop()


# ---- the scheduler, model-free ---------------------------------------------------------------
def test_scheduler_ends_choices_one_by_one_and_releases_with_the_last() -> None:
    s: scheduler_mod.Scheduler[Tk] = scheduler_mod.Scheduler(
        _limits(budget=10**9, chunk=100), weights_bytes=0, store=FakeStore(),  # type: ignore[arg-type]  # FakeStore for a SnapshotStore
    )
    s.enqueue(Tk(Req("r", tuple(range(20)), 3, n=3)), 0.0)
    plan = s.schedule(0.0)
    (adm,) = plan.admitted
    run = s.get("r")
    assert run is not None and run.n == 3
    assert s.reserved["r"] == price(scheduler_mod.request_cost(20, 3, adm.hit, 3), s.limits).total_bytes

    def out(plan: StepPlan, eos: set[int]) -> StepOutput:
        assert plan.prefill is None or plan.prefill.last
        live = [i for i in range(3) if i not in run.ended]
        return StepOutput(tuple(Sampled("r", 7, "x", None, eos=i in eos, stop_string=False, choice=i) for i in live))

    upd = s.update_from_output(plan, out(plan, eos={1}))  # prompt ends, choice 1 samples EOS
    assert [(f.choice, f.reason, f.last) for f in upd.finished] == [(1, "stop", False)]
    plan = s.schedule(0.0)
    assert plan.decode == ("r",)
    assert s.update_from_output(plan, out(plan, set())).finished == ()
    plan = s.schedule(0.0)
    upd = s.update_from_output(plan, out(plan, set()))
    assert [(f.choice, f.reason, f.last) for f in upd.finished] == [(0, "length", False), (2, "length", True)]
    assert run.per_choice == [3, 1, 3] and run.generated == 7
    s.release("r")
    assert not s.running and not s.reserved


# ---- HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[tuple[str, Runtime]]:
    values = {"bank_dir": "none", "chat_template": str(HERMES_TEMPLATE)}
    rt = tiny_runtime(loaded, load_settings(values, environ={}), store=ram_store())
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            yield url, rt
    finally:
        rt.engine.stop()


@pytest.fixture
def http(server: tuple[str, Runtime]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], trust_env=False, timeout=120) as c:
        yield c


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_out_of_range_is_a_400_naming_n(http: httpx.Client, n: int) -> None:
    for path, body in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "Once"})):
        r = http.post(path, json={**body, "n": n})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "n"
        assert "16" in err["message"]


def test_non_streaming_has_n_choices_and_usage_counts_the_prompt_once(http: httpx.Client) -> None:
    one = http.post(CHAT, json={"messages": USER, "max_tokens": 5, "temperature": 0}).json()
    body = {"messages": USER, "max_tokens": 5, "temperature": 0.8, "seed": 11, "n": 3, "logprobs": True}
    r = http.post(CHAT, json=body, headers={"X-Cache-Salt": "usage"})
    assert r.status_code == 200, r.text
    j = r.json()
    assert [c["index"] for c in j["choices"]] == [0, 1, 2]
    for c in j["choices"]:
        assert c["finish_reason"] == "length" and len(c["logprobs"]["content"]) == 5
    u = j["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 15 and u["total_tokens"] == u["prompt_tokens"] + 15
    # Completions too: text choices, same usage rule.
    c = http.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 4, "n": 2, "temperature": 0}).json()
    assert [ch["index"] for ch in c["choices"]] == [0, 1]
    assert c["choices"][0]["text"] == c["choices"][1]["text"]
    assert c["usage"]["completion_tokens"] == 8


def test_stream_chunks_carry_each_choice_index(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", CHAT, json=body, headers={"X-Cache-Salt": "stream"}) as r:
        assert r.status_code == 200
        chunks = _sse(r)
    plain = http.post(CHAT, json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
                      headers={"X-Cache-Salt": "plain"}).json()
    role = [c["choices"][0]["index"] for c in chunks[:3]]
    assert role == [0, 1, 2] and all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks[:3])
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]  # OpenAI's shape: one choice per chunk, named by its index
        text[ch["index"]] += ch["delta"].get("content", "")
        if ch["finish_reason"] is not None:
            finish[ch["index"]] = ch["finish_reason"]
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert text == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert usage["usage"]["completion_tokens"] == 18


@pytest.fixture(scope="module")
def hermes(gguf_tokenizer: ChatTokenizer) -> Iterator[httpx.Client]:
    """A server whose tokenizer has EOS (grammars end on it) and a tool-calling template."""
    with hermes_server(gguf_tokenizer) as (url, _), \
            httpx.Client(base_url=url, trust_env=False, timeout=120) as c:
        yield c


def test_each_choice_has_its_own_grammar(hermes: httpx.Client) -> None:
    """A matcher shared by the choices would be fed all their tokens interleaved: no choice
    would then hold a whole valid answer. Short grammars, so every choice completes."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}},
              "required": ["city"], "additionalProperties": False}
    body = {"messages": USER, "max_tokens": 40, "temperature": 1.0, "seed": 4, "n": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}}
    r = hermes.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop"] * 3
    for c in choices:
        assert json.loads(c["message"]["content"])["city"] in ("Paris", "London", "Tokyo")
    tools = {"messages": USER, "max_tokens": 80, "temperature": 1.0, "seed": 8, "n": 2,
             "tools": [WEATHER_TOOL], "tool_choice": "required"}
    r = hermes.post(CHAT, json=tools)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        call = c["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "London", "Tokyo")


def test_official_sdk_with_n_2(server: tuple[str, Runtime]) -> None:
    client = sdk(server[0])
    msgs: Any = USER
    one = client.chat.completions.create(model="default", messages=msgs, max_tokens=6, temperature=0)
    two = client.chat.completions.create(model="default", messages=msgs, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage is not None and one.usage is not None
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="default", messages=msgs, max_tokens=6, temperature=0,
                                                n=2, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    comp = client.completions.create(model="default", prompt="Once upon", max_tokens=4, n=2, temperature=0)
    assert [c.index for c in comp.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=msgs, n=17)
    assert e.value.param == "n"


# ---- /v1/responses: a client that leaves leaves nothing ----------------------------------------
def _wait_idle(rt: Runtime, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while rt.engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rt.engine.running == 0


@pytest.mark.parametrize("continued", [False, True])
def test_responses_stream_left_mid_way_leaves_no_session(
    server: tuple[str, Runtime], http: httpx.Client, continued: bool
) -> None:
    url, rt = server
    salt = {"X-Cache-Salt": f"resp-{continued}"}  # its own bank scope: only this test's sessions
    prev: str | None = None
    if continued:
        first = http.post("/v1/responses", json={"input": "hello", "max_output_tokens": 3, "temperature": 0},
                          headers=salt)
        assert first.status_code == 200, first.text
        prev = first.json()["id"]
    before = _bank_sessions_salted(http, salt)
    body: dict[str, Any] = {"input": "go on and on", "max_output_tokens": 400, "temperature": 0, "stream": True}
    if prev is not None:
        body["previous_response_id"] = prev
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as c, \
            c.stream("POST", "/v1/responses", json=body, headers=salt) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # the client leaves mid-stream
    _wait_idle(rt)
    deadline = time.monotonic() + 10  # the drop runs on the engine thread after the cancel
    while _bank_sessions_salted(http, salt) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _bank_sessions_salted(http, salt) == before
    assert (prev is not None) == bool(before)


def _bank_sessions_salted(http: httpx.Client, salt: dict[str, str]) -> set[str]:
    r = http.get("/v1/sessions", headers=salt)
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["data"]}


def test_engine_stores_nothing_for_an_unfinished_request_that_says_so(engine: Engine) -> None:
    """`store_unfinished=False`: a cancelled request leaves no session (the race-free half
    of the responses fix); the default keeps the sealed prompt, as before."""

    async def cancel_after_first_token(req: GenerationRequest) -> None:
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        while not isinstance(await asyncio.wait_for(h.queue.get(), 60), Token):
            pass
        h.cancel()

    def sessions() -> set[str]:
        async def ask() -> Any:
            bank = engine.store
            assert isinstance(bank, Bank)
            return await engine.call(lambda: {s.id for s in bank.list_sessions(salt="u")})

        return set(asyncio.run(ask()))

    for rid, keep in (("keep", True), ("drop", False)):
        req = _req(rid, PROMPT, 500, SamplingParams(temperature=0.0), session_id=f"s-{rid}", salt="u",
                   store_unfinished=keep)
        asyncio.run(cancel_after_first_token(req))
        deadline = time.monotonic() + 20
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.02)
    assert sessions() == {"s-keep"}


# ---- the bench ---------------------------------------------------------------------------------
def test_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/n_choices.py end to end on the tiny random llama: the report's shape and that
    choice i drew what the i-th separate request drew (never its times)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "n_choices.py"
    spec = importlib.util.spec_from_file_location("segserve_bench_n_choices", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    report = mod.main(["--model", "tiny", "--prompt-tokens", "48", "--max-tokens", "3", "--ns", "1,3"])
    assert json.loads(capsys.readouterr().out) == report
    assert set(report["runs"]) == {"1", "3"} and set(report["runs"]["1"]) == {"one"}
    three = report["runs"]["3"]
    assert set(three) == {"one", "sequential", "concurrent"}
    for r in three.values():
        assert r["tokens"] == 3 and r["wall_s"] > 0 and r["peak_above_start_bytes"] > 0
    assert three["sequential"]["tokens_match"] and three["concurrent"]["tokens_match"]
