"""`/v1/responses` through the official SDK: previous_response_id turns and branches on the
bank, the same greedy text as chat completions with the history resent, a restart with
the SSD tier, streaming assembled by the SDK, tenancy, 404s."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from segserve.bank import Bank
from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.http.tenants import KeyTable
from segserve.server.runner import ChatTokenizer, LoadedModel
from segserve.server.runtime import Runtime
from tests.conftest import make_tiny_model, ram_store, tiny_loaded
from tests.fidelity_support import TIME_TOOL, WEATHER_TOOL, hermes_server
from tests.http_support import serve_in_thread, tiny_runtime
from tests.process_support import ServerProcess

N = 6  # tokens per answer (EOS is off: every answer has exactly N)


@pytest.fixture(scope="module")
def loaded(gguf_tokenizer: ChatTokenizer) -> LoadedModel:
    lm = tiny_loaded(gguf_tokenizer, make_tiny_model(seed=5), context=2048)
    return dataclasses.replace(lm, tokenizer=dataclasses.replace(lm.tokenizer, eos_ids=frozenset()))


def _sdk(url: str, key: str = "unused") -> openai.OpenAI:
    http = httpx.Client(trust_env=False, timeout=120)
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, http_client=http)  # type: ignore[arg-type]


@contextmanager
def _serve(loaded: LoadedModel, store: Bank | None = None, keys: KeyTable | None = None) -> Iterator[tuple[Runtime, str]]:
    rt = tiny_runtime(loaded, load_settings({}, environ={}), store=store or ram_store())
    try:
        with serve_in_thread(create_app(rt.serving, keys=keys)) as url:
            yield rt, url
    finally:
        rt.engine.stop()


@pytest.fixture(scope="module")
def server(loaded: LoadedModel) -> Iterator[tuple[Runtime, str]]:
    with _serve(loaded) as s:
        yield s


@pytest.fixture
def client(server: tuple[Runtime, str]) -> openai.OpenAI:
    return _sdk(server[1])


def _chat_text(client: openai.OpenAI, msgs: list[dict[str, Any]], n: int = N) -> str:
    r = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=n)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def _turn(client: openai.OpenAI, text: str, prev: str | None = None, **kw: Any) -> Any:
    return client.responses.create(
        model="default", input=text, previous_response_id=prev, temperature=0, max_output_tokens=N, **kw
    )


def _turns(url: str, sid: str) -> int:
    """Turns of a bank session, through the session API (the bank is engine-thread only)."""
    r = httpx.get(f"{url}/v1/sessions/{sid}", trust_env=False)
    assert r.status_code == 200, r.text
    return int(r.json()["turns"])


def test_three_turns_reuse_the_bank_and_match_chat(client: openai.OpenAI, server: tuple[Runtime, str]) -> None:
    history: list[dict[str, Any]] = []
    prev, prev_input = None, 0
    for i, text in enumerate(["the first question", "a second one", "and a third"]):
        r = _turn(client, text, prev)
        assert r.status == "incomplete" and r.incomplete_details is not None  # N tokens, EOS off
        assert r.usage is not None and r.usage.output_tokens == N
        assert r.usage.total_tokens == r.usage.input_tokens + N
        cached = r.usage.input_tokens_details.cached_tokens
        if i == 0:
            assert cached == 0
        else:
            # everything the previous turn prefilled is reused: only the new input is prefilled
            assert cached >= prev_input, (cached, prev_input)
        history.append({"role": "user", "content": text})
        assert r.output_text == _chat_text(client, history)
        history.append({"role": "assistant", "content": r.output_text})
        prev, prev_input = r.id, r.usage.input_tokens
    assert prev is not None
    got = client.responses.retrieve(prev)
    assert got.id == prev and got.output_text == history[-1]["content"]
    assert got.previous_response_id is not None
    # each response is its own bank session: 1, 2 and 3 turns
    assert _turns(server[1], prev) == 3


def test_two_branches_do_not_see_each_other(client: openai.OpenAI, server: tuple[Runtime, str]) -> None:
    root = _turn(client, "a shared start")
    a = _turn(client, "branch A goes left", root.id)
    b = _turn(client, "branch B goes right", root.id)
    assert root.usage is not None and a.usage is not None and b.usage is not None
    for r in (a, b):
        assert r.usage is not None and r.usage.input_tokens_details.cached_tokens >= root.usage.input_tokens
    base = [{"role": "user", "content": "a shared start"}, {"role": "assistant", "content": root.output_text}]
    assert b.output_text == _chat_text(client, [*base, {"role": "user", "content": "branch B goes right"}])
    b2 = _turn(client, "go on", b.id)
    hist_b = [*base, {"role": "user", "content": "branch B goes right"},
              {"role": "assistant", "content": b.output_text}, {"role": "user", "content": "go on"}]
    assert b2.output_text == _chat_text(client, hist_b)
    url = server[1]
    # the root stays one turn; each branch has the root's turn + its own only
    assert _turns(url, root.id) == 1
    assert _turns(url, a.id) == 2 and _turns(url, b.id) == 2 and _turns(url, b2.id) == 3
    # branch A's input is not in B's continuation
    items = client.responses.input_items.list(b2.id)
    assert [getattr(i, "role", None) for i in items.data] == ["user"]
    assert b2.usage is not None and a.usage is not None
    assert b2.usage.input_tokens_details.cached_tokens >= b.usage.input_tokens


def test_stream_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    plain = _turn(client, "stream this answer please")
    with client.responses.stream(
        model="default", input="stream this answer please", temperature=0, max_output_tokens=N
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text and final.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert k in kinds, k
    # stored as streamed: continue from it
    nxt = _turn(client, "and then?", final.id)
    assert nxt.usage is not None and final.usage is not None
    assert nxt.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens
    seqs = [e.sequence_number for e in client.responses.create(
        model="default", input="count", temperature=0, max_output_tokens=N, stream=True)]
    assert seqs == list(range(len(seqs)))


def test_restart_with_the_ssd_tier(tmp_path: Path, loaded: LoadedModel) -> None:
    def store() -> Bank:
        return Bank.open("responses-test", 1 << 30, tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0)

    s1 = store()
    with _serve(loaded, s1) as (_, url):
        c = _sdk(url)
        r1 = _turn(c, "remember this across a restart", instructions="Be brief.")
        r2 = _turn(c, "second turn", r1.id, instructions="Be brief.")
    s1.close()
    assert (tmp_path / "responses.sqlite3").exists()
    s2 = store()
    with _serve(loaded, s2) as (_, url):
        c = _sdk(url)
        assert c.responses.retrieve(r2.id).output_text == r2.output_text
        r3 = _turn(c, "third, after the restart", r2.id, instructions="Be brief.")
        assert r3.usage is not None and r2.usage is not None
        assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens
        health = httpx.get(url + "/health", trust_env=False).json()
        assert health["bank"]["restores_by_tier"].get("ssd", 0) > 0
        hist = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "remember this across a restart"},
                {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "second turn"},
                {"role": "assistant", "content": r2.output_text},
                {"role": "user", "content": "third, after the restart"}]
        assert r3.output_text == _chat_text(c, hist)
    s2.close()


def test_evicted_rows_are_reprefilled_from_the_stored_text(client: openai.OpenAI, server: tuple[Runtime, str]) -> None:
    r1 = _turn(client, "a turn whose rows go away")
    # as if evicted from a RAM-only bank: the record stays, the session is gone
    assert httpx.delete(f"{server[1]}/v1/sessions/{r1.id}", trust_env=False).status_code == 200
    r2 = _turn(client, "still works", r1.id)
    assert r2.output_text == _chat_text(client, [
        {"role": "user", "content": "a turn whose rows go away"},
        {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "still works"}])


def test_other_tenants_cannot_see_read_continue_or_delete(loaded: LoadedModel) -> None:
    keys = KeyTable(((b"key-alice", "alice"), (b"key-bob", "bob")))
    with _serve(loaded, keys=keys) as (_, url):
        alice, bob = _sdk(url, "key-alice"), _sdk(url, "key-bob")
        r = _turn(alice, "alice's secret")
        errors = []
        for call in (
            lambda: bob.responses.retrieve(r.id),
            lambda: bob.responses.delete(r.id),
            lambda: bob.responses.input_items.list(r.id),
            lambda: _turn(bob, "peek", r.id),
            lambda: bob.responses.retrieve("resp_unknown"),
        ):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            errors.append(e.value)
        msgs = {str(e.body).replace(r.id, "ID").replace("resp_unknown", "ID") for e in errors[:3] + errors[4:]}
        assert len(msgs) == 1  # the same answer as for an id that never existed
        assert alice.responses.retrieve(r.id).output_text == r.output_text
        # X-Cache-Salt is part of the scope too
        salted = _sdk(url, "key-alice").with_options(default_headers={"X-Cache-Salt": "other"})
        with pytest.raises(openai.NotFoundError):
            salted.responses.retrieve(r.id)


def test_delete_store_false_and_404s(client: openai.OpenAI, server: tuple[Runtime, str]) -> None:
    r = _turn(client, "to be deleted", metadata={"k": "v"})
    assert client.responses.retrieve(r.id).metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    assert items.data[0].type == "message"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        _turn(client, "continue a deleted one", r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    eph = _turn(client, "not stored", store=False)
    assert eph.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(eph.id)
    # store=false ran on a temporary bank session, gone once answered; a deleted
    # response's session is gone too
    sessions = {s["id"] for s in httpx.get(server[1] + "/v1/sessions", trust_env=False).json()["data"]}
    assert not any(sid.startswith("tmp-") for sid in sessions) and r.id not in sessions


def test_unsupported_and_invalid_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _turn(client, "x", include=["message.output_text.logprobs"])
    assert e.value.code == "unsupported_parameter" and e.value.param == "include.0"
    image: Any = [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.invalid/x.png", "detail": "auto"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input=image)
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    # Names follow OpenAI's patterns, as in chat completions.
    bad_tool: Any = [{"type": "function", "name": "get weather!", "parameters": {"type": "object"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="x", tools=bad_tool)
    assert "tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        good_tool: Any = [{**bad_tool[0], "name": "ok"}]
        long_name: Any = {"type": "function", "name": "x" * 65}
        client.responses.create(model="default", input="x", tools=good_tool, tool_choice=long_name)
    assert "tool_choice" in str(e.value)
    bad_format: Any = {"format": {"type": "json_schema", "name": "a.b", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="x", text=bad_format)
    assert "text" in str(e.value)


def test_function_tools_forced_call_streamed_and_continued(gguf_tokenizer: ChatTokenizer) -> None:
    """Hermes tool template; constrained decoding makes the random weights call."""
    defs: list[Any] = [WEATHER_TOOL, TIME_TOOL]
    tools: Any = [{"type": "function", **t["function"]} for t in defs]
    ask: Any = [{"role": "user", "content": [{"type": "input_text", "text": "What time is it?"}]}]
    with hermes_server(gguf_tokenizer) as (url, _):
        client = _sdk(url)
        kw: Any = {"model": "default", "input": ask, "tools": tools, "instructions": "You are a helpful assistant.",
                   "tool_choice": {"type": "function", "name": "get_time"}, "extra_body": {"seed": 1}, "max_output_tokens": 60}
        r = client.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_time", r.output
        assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
        with client.responses.stream(**kw) as stream:
            final = stream.get_final_response()
        scalls = [o for o in final.output if o.type == "function_call"]
        assert [(c.name, c.arguments) for c in scalls] == [(c.name, c.arguments) for c in calls]
        nxt = client.responses.create(
            model="default", previous_response_id=r.id, tools=tools, instructions="You are a helpful assistant.",
            extra_body={"seed": 1}, max_output_tokens=8,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}],
        )
        assert nxt.usage is not None and r.usage is not None
        assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
        kinds = [i.type for i in client.responses.input_items.list(nxt.id).data]
        assert kinds == ["function_call_output"]


# ---- the real embedded model, a real server process (kill -9 in between) ---------------


def _start_cli(bank_dir: Path, log: Path) -> ServerProcess:
    srv = ServerProcess(log, "--bank-dir", str(bank_dir), append=True)
    try:
        srv.wait_healthy(240)
    except RuntimeError:
        srv.kill()
        raise
    return srv


@pytest.mark.model
def test_real_model_turns_match_chat_and_survive_kill_9(tmp_path: Path) -> None:
    srv = _start_cli(tmp_path / "bank", tmp_path / "server.log")
    try:
        c = _sdk(srv.url)
        hist: list[dict[str, Any]] = []
        prev: Any = None
        for q in ("What is the capital of France?", "And of Italy?"):
            r = c.responses.create(model="default", input=q, previous_response_id=prev.id if prev else None,
                                   temperature=0, max_output_tokens=16)
            hist.append({"role": "user", "content": q})
            assert r.output_text == _chat_text(c, hist, 16)
            hist.append({"role": "assistant", "content": r.output_text})
            assert r.usage is not None
            if prev is not None:
                assert prev.usage is not None
                # the previous prompt and (all but its last token) answer come from the bank
                assert r.usage.input_tokens_details.cached_tokens >= prev.usage.total_tokens - 2
            prev = r
        assert "Paris" in hist[1]["content"]
        srv.kill()  # kill -9: committed records must survive
        srv = _start_cli(tmp_path / "bank", tmp_path / "server.log")
        c = _sdk(srv.url)
        assert c.responses.retrieve(prev.id).output_text == prev.output_text
        r3 = c.responses.create(model="default", input="And of Spain?", previous_response_id=prev.id,
                                temperature=0, max_output_tokens=16)
        hist.append({"role": "user", "content": "And of Spain?"})
        assert r3.output_text == _chat_text(c, hist, 16)
    finally:
        srv.stop()
