"""What agent clients send, through the official SDK over real HTTP, on the embedded model's
own chat template (SmolLM2's: no tool syntax, reads `message['content']` unconditionally).

Tiny random-weight model (fast): a tool round trip sent back as the SDK's `message` (content
None) and as `model_dump(exclude_none=True)` (no content key); the tools reach the prompt as
the Hermes system block (`--tool-prompt auto`) or not at all (`none`); forced tool choices end
with `tool_calls` and no content, chat and Responses, streamed or not; null means unset;
`chat_template_kwargs` reach the template; `/tokenize` and `/detokenize`; CORS preflights;
Responses `truncation: "auto"`, `include`, `reasoning`.

Real embedded model (`model` marker): `tool_choice: "required"` with the default parallel
calls ends within the call's own tokens + 8 (random weights may spell a call in any
tokenization the grammar allows, so the token bound is checked on the real model only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from segserve.config.settings import load_settings
from segserve.server.chat.template import TOOL_PROMPT_HEAD, hermes_call_text
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.fidelity_support import TIME_TOOL, WEATHER_TOOL, sdk
from tests.http_support import serve_in_thread, tiny_runtime
from tests.process_support import ServerProcess

CHAT = "/v1/chat/completions"
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


@contextmanager
def tiny_server(tok: ChatTokenizer, **settings: str) -> Iterator[tuple[str, Runtime]]:
    """A server on the embedded tokenizer and template, tiny random weights."""
    values = {"max_tokens_default": "48", "bank_dir": "none", **settings}
    rt = tiny_runtime(tiny_loaded(tok, context=2048), load_settings(values, environ={}))
    try:
        with serve_in_thread(create_app(rt.serving)) as url:
            yield url, rt
    finally:
        rt.engine.stop()


@pytest.fixture(scope="module")
def server(gguf_tokenizer: ChatTokenizer) -> Iterator[tuple[str, Runtime]]:
    with tiny_server(gguf_tokenizer) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[str, Runtime]) -> openai.OpenAI:
    return sdk(server[0])


@pytest.fixture
def http(server: tuple[str, Runtime]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=120, trust_env=False) as c:
        yield c


def _prompt_text(http: httpx.Client, body: dict[str, Any]) -> str:
    """The prompt a chat request would run, as text (tokenize, then detokenize)."""
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    d = http.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert d.status_code == 200, d.text
    return str(d.json()["prompt"])


# ---- tool round trips on a template without tool syntax --------------------------------


@pytest.mark.parametrize("send_back", ["message", "model_dump_exclude_none"])
def test_tool_round_trip_on_the_embedded_template(
    client: openai.OpenAI, http: httpx.Client, send_back: str
) -> None:
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=200,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    back: Any = (choice.message if send_back == "message"
                 else choice.message.model_dump(exclude_none=True))
    if send_back == "model_dump_exclude_none":
        assert "content" not in back
    else:
        assert back.content is None
    msgs: list[Any] = [*ASK, back, {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    final = client.chat.completions.create(
        model="default", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0,
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the earlier call and its result are in the prompt, in the block's Hermes syntax
    wire = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in msgs]
    text = _prompt_text(http, {"messages": wire, "tools": TOOLS})
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert hermes_call_text(call.function.name, args) in text  # type: ignore[union-attr]
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


def test_tools_go_in_a_hermes_system_block(http: httpx.Client) -> None:
    text = _prompt_text(http, {"messages": ASK, "tools": TOOLS})
    assert text.startswith("system\n" + TOOL_PROMPT_HEAD)  # <|im_start|> is special: decoded away
    assert json.dumps(WEATHER_TOOL) in text and json.dumps(TIME_TOOL) in text
    assert "You are a helpful AI assistant named SmolLM" not in text
    sys_ask = [{"role": "system", "content": "Be brief."}, *ASK]
    text = _prompt_text(http, {"messages": sys_ask, "tools": TOOLS})
    assert text.startswith("system\nBe brief.\n\n" + TOOL_PROMPT_HEAD)
    # without tools: the template's own prompt, unchanged
    assert "<tools>" not in _prompt_text(http, {"messages": ASK})


def test_tool_prompt_none_leaves_tools_out(
    gguf_tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    with tiny_server(gguf_tokenizer, tool_prompt="none") as (url, _):
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as c, caplog.at_level("INFO"):
            text = _prompt_text(c, {"messages": ASK, "tools": TOOLS})
            again = _prompt_text(c, {"messages": ASK, "tools": TOOLS})
    assert "<tools>" not in text and "get_weather" not in text and again == text
    lines = [r.getMessage() for r in caplog.records if "tools are left out" in r.getMessage()]
    assert len(lines) <= 1  # once per template (an earlier test may have logged it already)


# ---- forced tool choices end after the call(s) --------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_required_ends_with_tool_calls(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            max_tokens=400, parallel_tool_calls=parallel,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        assert c.message.content is None and c.message.tool_calls
        names = [t.function.name for t in c.message.tool_calls]  # type: ignore[union-attr]
        assert len(names) == len(set(names)) <= (2 if parallel else 1)
        assert r.usage is not None and r.usage.completion_tokens < 400


def test_required_streamed_has_no_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
        max_tokens=400, stream=True, stream_options={"include_usage": True},
    )
    finish, content, calls = None, "", 0
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += sum(1 for t in ch.delta.tool_calls or [] if t.id)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls >= 1 and content == ""


def test_required_cut_off_leaks_no_markup(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", seed=1, max_tokens=5,
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_has_only_function_calls(client: openai.OpenAI, stream: bool) -> None:
    kw: Any = {"model": "default", "input": ASK[0]["content"], "store": False, "extra_body": {"seed": 2},
               "tool_choice": "required", "max_output_tokens": 400,
               "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    if stream:
        with client.responses.stream(**kw) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(**kw)
    assert resp.status == "completed" and resp.output
    assert all(item.type == "function_call" for item in resp.output), resp.output


# ---- null means unset, template kwargs, reasoning ------------------------------------------


NULLS = {"temperature": None, "top_p": None, "stream": None, "max_tokens": None, "n": None,
         "stop": None, "seed": None, "presence_penalty": None, "frequency_penalty": None,
         "logit_bias": None, "user": None, "logprobs": None, "stream_options": None}


def test_null_means_unset(http: httpx.Client) -> None:
    chat = http.post(CHAT, json={"messages": ASK, **NULLS, "tools": None, "tool_choice": None,
                                 "parallel_tool_calls": None, "response_format": None,
                                 "max_completion_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] <= 3
    comp = http.post("/v1/completions", json={"prompt": "Once", **NULLS})
    assert comp.status_code == 200, comp.text
    assert comp.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default for completions
    inner = http.post(CHAT, json={"messages": ASK, "max_tokens": 2, "stream": True,
                                  "stream_options": {"include_usage": None}})
    assert inner.status_code == 200 and '"usage"' not in inner.text.split("[DONE]")[0][-400:]
    resp = http.post("/v1/responses", json={
        "input": "hi", "max_output_tokens": 3, "temperature": None, "top_p": None, "stream": None,
        "store": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
        "truncation": None, "include": None, "reasoning": None, "instructions": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["store"] is True
    # an unknown field is refused whatever its value
    bad = http.post(CHAT, json={"messages": ASK, "not_a_field": None})
    assert bad.status_code == 400


def test_reasoning_fields_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=2,
                                       reasoning_effort="low")
    assert r.choices[0].message.content is not None
    resp = client.responses.create(model="default", input="hi", max_output_tokens=2,
                                   reasoning={"effort": "low"}, store=False,
                                   include=["reasoning.encrypted_content"])
    assert resp.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="hi", include=["message.output_text.logprobs"])
    assert e.value.code == "unsupported_parameter" and e.value.param == "include.0"


def test_chat_template_kwargs_reach_the_template(
    gguf_tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("[{{ greeting | default('none') }}|{{ reasoning_effort | default('-') }}]"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    with tiny_server(gguf_tokenizer, chat_template=str(template)) as (url, _):
        with httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
            plain = _prompt_text(c, {"messages": ASK})
            kw = _prompt_text(c, {"messages": ASK, "chat_template_kwargs": {"greeting": "hey"}})
            assert plain.startswith("[none|-]") and kw.startswith("[hey|-]")
            r = c.post(CHAT, json={"messages": ASK, "max_tokens": 1,
                                   "chat_template_kwargs": {"greeting": "hey"},
                                   "reasoning_effort": "high"})
            base = c.post(CHAT, json={"messages": ASK, "max_tokens": 1})
            assert r.status_code == 200 and base.status_code == 200
            # "[hey|high]" tokenizes longer than "[none|-]": the chat prompt used both
            hey = c.post("/tokenize", json={"messages": ASK, "chat_template_kwargs": {
                "greeting": "hey", "reasoning_effort": "high"}}).json()["count"]
            assert r.json()["usage"]["prompt_tokens"] == hey
            assert base.json()["usage"]["prompt_tokens"] == c.post(
                "/tokenize", json={"messages": ASK}).json()["count"]
            bad = c.post(CHAT, json={"messages": ASK, "chat_template_kwargs": {"messages": []}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


# ---- tokenize / detokenize -------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(http: httpx.Client, client: openai.OpenAI) -> None:
    text = "Hello world, ça va? 12345"
    t = http.post("/tokenize", json={"model": "default", "prompt": text, "return_token_strs": True})
    assert t.status_code == 200, t.text
    body = t.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 2048
    assert len(body["token_strs"]) == body["count"]  # per token: "ç" may be split in two
    d = http.post("/detokenize", json={"model": "default", "tokens": body["tokens"]})
    assert d.json() == {"prompt": text}
    # messages: exactly the prompt the chat route runs
    m = http.post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens == m["count"]
    no_gen = http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": False}).json()
    with_gen = http.post("/tokenize", json={"messages": ASK}).json()
    assert with_gen["tokens"][: no_gen["count"]] == no_gen["tokens"]
    assert with_gen["count"] > no_gen["count"]
    for bad in ({"prompt": "x", "messages": ASK}, {}, {"prompt": "x", "add_special_tokens": True},
                {"prompt": "x", "model": "other"}):
        e = http.post("/tokenize", json=bad)
        assert e.status_code in (400, 404) and "error" in e.json(), bad
    e = http.post("/detokenize", json={"tokens": [10**9]})
    assert e.status_code == 400 and e.json()["error"]["param"] == "tokens"


# ---- CORS --------------------------------------------------------------------------------------


PREFLIGHT = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_off_by_default(server: tuple[str, Runtime]) -> None:
    with TestClient(create_app(server[1].serving)) as c:
        r = c.options(CHAT, headers=PREFLIGHT)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        g = c.get("/v1/models", headers={"Origin": "http://app.example"})
        assert g.status_code == 200 and "access-control-allow-origin" not in g.headers


def test_cors_preflight_with_origins(gguf_tokenizer: ChatTokenizer) -> None:
    values = {"bank_dir": "none", "cors_allow_origins": "http://app.example, http://b.example",
              "api_key": "sk-test"}
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), load_settings(values, environ={}))
    try:
        with TestClient(create_app(rt.serving)) as c:
            r = c.options(CHAT, headers=PREFLIGHT)  # no key: a preflight never carries one
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == "http://app.example"
            assert "POST" in r.headers["access-control-allow-methods"]
            other = c.options(CHAT, headers={**PREFLIGHT, "Origin": "http://evil.example"})
            assert other.status_code == 400
            g = c.get("/v1/models", headers={"Origin": "http://b.example",
                                             "Authorization": "Bearer sk-test"})
            assert g.status_code == 200
            assert g.headers["access-control-allow-origin"] == "http://b.example"
            denied = c.get("/v1/models", headers={"Origin": "http://b.example"})
            assert denied.status_code == 401  # CORS headers do not skip the key check
            assert denied.headers["access-control-allow-origin"] == "http://b.example"
    finally:
        rt.engine.stop()


# ---- Responses truncation ----------------------------------------------------------------------


def test_responses_truncation_auto_drops_oldest_turns(http: httpx.Client) -> None:
    long = "word " * 600  # ~600 tokens a turn; four turns overflow the 2,048-token context
    turns: list[dict[str, Any]] = []
    for i in range(4):
        turns += [{"role": "user", "content": f"turn {i}: {long}"},
                  {"role": "assistant", "content": f"answer {i}"}]
    body: dict[str, Any] = {"input": [*turns, {"role": "user", "content": "last"}],
                            "max_output_tokens": 4, "store": False}
    refused = http.post("/v1/responses", json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    ok = http.post("/v1/responses", json={**body, "truncation": "auto"})
    assert ok.status_code == 200, ok.text
    out = ok.json()
    assert out["truncation"] == "auto"
    assert out["usage"]["input_tokens"] + 4 <= 2048
    assert out["usage"]["input_tokens"] > 600  # only the oldest turns went
    fits = http.post("/v1/responses", json={"input": "short", "max_output_tokens": 2,
                                            "truncation": "auto", "store": False})
    assert fits.status_code == 200


# ---- the real embedded model: the token bound ---------------------------------------------------


@pytest.mark.model
def test_required_ends_within_the_call_on_the_real_model(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "server.log", "--bank-dir", "none", "--max-tokens-default", "512")
    try:
        srv.wait_healthy(180)
        client = sdk(srv.url)
        with httpx.Client(base_url=srv.url, timeout=300, trust_env=False) as http:
            tools: list[Any] = [WEATHER_TOOL]
            for stream in (False, True):
                r: Any
                if stream:
                    with client.chat.completions.stream(
                        model="default", messages=ASK, tools=tools, tool_choice="required",
                        temperature=0, stream_options={"include_usage": True},
                    ) as s:
                        r = s.get_final_completion()
                else:
                    r = client.chat.completions.create(
                        model="default", messages=ASK, tools=tools, tool_choice="required",
                        temperature=0,
                    )
                c = r.choices[0]
                assert c.finish_reason == "tool_calls" and not c.message.content, c
                calls = c.message.tool_calls or []
                markup = "\n".join(hermes_call_text(t.function.name, t.function.arguments)
                                   for t in calls)
                own = http.post("/tokenize", json={"prompt": markup}).json()["count"]
                assert r.usage is not None and r.usage.completion_tokens <= own + 8, (r.usage, markup)
            fn: Any = {"type": "function", **WEATHER_TOOL["function"]}
            resp = client.responses.create(
                model="default", input=ASK[0]["content"], tool_choice="required", temperature=0,
                tools=[fn], store=False,
            )
            assert [o.type for o in resp.output] == ["function_call"], resp.output
            assert resp.usage is not None and resp.usage.output_tokens <= own + 8
    finally:
        srv.stop()
