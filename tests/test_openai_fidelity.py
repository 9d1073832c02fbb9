"""OpenAI fidelity on a tiny random-weight model over real HTTP, mostly through the
official SDK: leniency where nothing changes, `unsupported_parameter` where something would,
sampling fields, structured output, `GET /v1/models/{id}`, logprob bytes, `/openapi.json`,
start-up checks of `--chat-template` / `--tool-parser`, and the GGUF pre-tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import httpx
import mlx.core as mx
import openai
import pytest

from segserve.config.settings import load_settings
from segserve.server.chat.template import normalize_messages
from segserve.server.http.app import _routes
from segserve.server.http.openapi import accepted_no_ops, request_bodies
from segserve.server.preflight import PreflightError, preflight
from segserve.server.runner import ChatTokenizer, embedded_model_path
from segserve.server.runner.tokenizer import UnknownPreTokenizer, build_bpe, pre_tokenizer_for
from segserve.server.runtime import Runtime
from tests.fidelity_support import HERMES_TEMPLATE, hermes_server, sdk

CHAT = "/v1/chat/completions"
USER: list[Any] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(gguf_tokenizer: ChatTokenizer) -> Iterator[tuple[str, Runtime]]:
    with hermes_server(gguf_tokenizer) as s:
        yield s


@pytest.fixture(scope="module")
def url(server: tuple[str, Runtime]) -> str:
    return server[0]


@pytest.fixture(scope="module")
def rt(server: tuple[str, Runtime]) -> Runtime:
    return server[1]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return sdk(url)


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
        yield c


def _error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


# ------------------------------------------------------------------ leniency


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": False},
        {"logit_bias": {}},
        {"metadata": {"team": "a"}},
        {"store": False},
        {"user": "u-1"},
        {"service_tier": "auto"},
        {"max_completion_tokens": 3},
        {"modalities": ["text"]},
        {"n": 1},
        {"n": None},
        {"frequency_penalty": 0, "presence_penalty": 0.0},
        {"messages": [{"role": "user", "content": "hi", "name": "alice"}]},
        {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "refusal": None, "audio": None,
             "function_call": None, "tool_calls": None, "annotations": None},
            {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        ]},
    ],
)
def test_fields_that_change_nothing_are_accepted(http: httpx.Client, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 3, "temperature": 0, **extra}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_sdk_history_from_model_dump(client: openai.OpenAI) -> None:
    """`message.model_dump()` of an answer (refusal, audio, annotations ... all null) goes back."""
    msgs: list[Any] = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
    msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": "More"}]
    r2 = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=4, temperature=0, metadata={"k": "v"},
        store=False, user="someone", service_tier="auto", max_completion_tokens=4,
    )
    assert r2.choices[0].message.role == "assistant"


def test_message_name_reaches_the_template(rt: Runtime) -> None:
    msgs = normalize_messages([{"role": "user", "content": "hi", "name": "alice"}])
    assert "user name=alice\nhi" in rt.loaded.tokenizer.render(msgs)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "path, field, value",
    [
        (CHAT, "functions", [{"name": "f"}]),
        (CHAT, "function_call", "auto"),
        (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
        (CHAT, "modalities", ["text", "audio"]),
        (CHAT, "prediction", {"type": "content", "content": "x"}),
        (CHAT, "web_search_options", {}),
        (CHAT, "store", True),
        (CHAT, "verbosity", "low"),
        ("/v1/completions", "suffix", "end"),
        ("/v1/completions", "echo", True),
        ("/v1/completions", "best_of", 3),
    ],
)
def test_unbuilt_fields_are_refused_by_name(
    http: httpx.Client, path: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = {"messages": USER} if path == CHAT else {"prompt": "Once"}
    body[field] = value
    err = _error(http.post(path, json=body))
    assert err["code"] == "unsupported_parameter"
    assert err["param"] == field
    assert err["type"] == "invalid_request_error"


def test_unsupported_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=USER, web_search_options={})
    assert e.value.code == "unsupported_parameter" and e.value.param == "web_search_options"


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"49152": 1.0}),  # the vocabulary has 49 152 tokens: ids 0 .. 49151
        ("tool_choice", "required"),  # without tools
        ("tool_choice", {"type": "function", "function": {"name": "nope"}}),
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema"}),
    ],
)
def test_bad_values_are_400_naming_the_field(http: httpx.Client, field: str, value: Any) -> None:
    err = _error(http.post(CHAT, json={"messages": USER, field: value}))
    assert err["code"] == "invalid_request"
    assert err["param"] == field or str(err["param"]).startswith(field + ".")


# ------------------------------------------------------------------ sampling fields


def test_sampling_fields_accepted_through_the_sdk(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=USER, max_tokens=6, seed=3, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"42": 5},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    c = client.completions.create(
        model="default", prompt="Once upon", max_tokens=4, seed=3, presence_penalty=1.0,
        extra_body={"top_k": -1, "min_p": 0.0},
    )
    assert c.choices[0].text is not None


def test_logit_bias_bans_and_forces_a_token(client: openai.OpenAI) -> None:
    """+100 makes a token all but certain; -100 bans it even when it would otherwise win."""
    kw: dict[str, Any] = {"model": "default", "messages": USER, "max_tokens": 4, "temperature": 1.0, "seed": 1}
    hello, world = "19556", "905"  # "Hello", " world"
    forced = client.chat.completions.create(**kw, logit_bias={hello: 100, world: 50})
    assert forced.choices[0].message.content == "Hello" * 4
    banned = client.chat.completions.create(**kw, logit_bias={hello: -100, world: 50})
    assert banned.choices[0].message.content == " world" * 4


# ------------------------------------------------------------------ structured output

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


def _valid_person(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "pet", "tags"}
        and isinstance(obj["name"], str) and len(obj["name"]) <= 12
        and isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
        and obj["pet"] in ("cat", "dog", None)
        and isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 5 for t in obj["tags"])
    )


def test_json_schema_strict_always_parses_and_validates(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(seed: int) -> tuple[str | None, str | None]:
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "A person, as JSON"}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=120,
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(100)))
    for seed, (text, finish) in enumerate(results):
        assert finish == "stop", (seed, text)
        assert text is not None and _valid_person(json.loads(text)), (seed, text)


def test_json_schema_through_the_sdk_parse_helper(client: openai.OpenAI) -> None:
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    r = client.beta.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "a point"}], response_format=Point,
        seed=5, max_tokens=60,
    )
    assert isinstance(r.choices[0].message.parsed, Point)


def test_json_object_is_an_object(http: httpx.Client) -> None:
    for seed in range(3):
        r = http.post(CHAT, json={"messages": USER, "response_format": {"type": "json_object"},
                                  "seed": seed, "max_tokens": 200})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        if ch["finish_reason"] == "stop":
            assert isinstance(json.loads(ch["message"]["content"]), dict)


def test_schema_the_engine_cannot_compile_is_named(http: httpx.Client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                  "schema": {"$ref": "#/definitions/missing"}}}
    err = _error(http.post(CHAT, json={"messages": USER, "response_format": bad}))
    assert err["param"] == "response_format" and "response_format" in err["message"]
    assert err["code"] in ("unsupported_parameter", "invalid_request")


# ------------------------------------------------------------------ models, logprobs, openapi


def test_models_retrieve(client: openai.OpenAI) -> None:
    assert client.models.retrieve("tiny-test").id == "tiny-test"
    assert client.models.retrieve("default").id == "tiny-test"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"


def test_logprob_bytes_are_the_tokens_own(client: openai.OpenAI, rt: Runtime) -> None:
    """Tokens holding part of an emoji: 40303 = ' \\xf0\\x9f\\x98', 218 = '\\x80'."""
    tok = rt.loaded.tokenizer
    allowed = {tuple(tok.token_bytes(40303)), tuple(tok.token_bytes(218))}
    assert allowed == {(32, 0xF0, 0x9F, 0x98), (0x80,)}
    r = client.chat.completions.create(
        model="default", messages=USER, max_tokens=6, seed=2, logprobs=True, top_logprobs=2,
        logit_bias={"40303": 100, "218": 100},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    for entry in content:
        assert tuple(entry.bytes or ()) in allowed
        for alt in entry.top_logprobs:  # whole-character tokens: bytes are the text's
            if "\ufffd" not in alt.token:
                assert bytes(alt.bytes or ()) == alt.token.encode()


def test_openapi_bodies_match_the_pydantic_models(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for route in _routes():
        path = route.path.replace(":path", "")
        assert path in doc["paths"], path
        for method in (route.methods or set()) - {"HEAD"}:
            assert method.lower() in doc["paths"][path], (method, path)
    for (method, path), model in request_bodies().items():
        op = doc["paths"][path][method.lower()]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rsplit("/", 1)[1]]
        wire = {f.alias or name for name, f in model.model_fields.items()}
        wire |= set(accepted_no_ops().get(model, {}))  # accepted as no-ops, dropped before validation
        assert set(body["properties"]) == wire, (path, set(body["properties"]) ^ wire)
        required = {f.alias or name for name, f in model.model_fields.items() if f.is_required()}
        assert set(body.get("required", [])) == required, path


# ------------------------------------------------------------------ start-up checks


def test_chat_template_and_tool_parser_checked_at_start(tmp_path: Any) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    def check(**over: str) -> None:
        s = load_settings({"bank_dir": "none", "port": "0", **over}, environ={})
        preflight(s, lambda n: "--" + n.replace("_", "-")).sock.close()

    with pytest.raises(PreflightError, match="--chat-template: invalid chat template"):
        check(chat_template=str(bad))
    with pytest.raises(PreflightError, match="--chat-template: cannot read"):
        check(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(PreflightError, match="--tool-parser: unknown tool parser 'bogus'"):
        check(tool_parser="bogus")
    check(chat_template=str(HERMES_TEMPLATE), tool_parser="hermes")


# ------------------------------------------------------------------ GGUF pre-tokenizer

# ids of the embedded SmolLM2 tokenizer before the pre-tokenizer followed `tokenizer.ggml.pre`
_GOLDEN = {
    "Hello world": [19556, 905],
    "In 2024, 1234567 people paid $3.50 each.":
        [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 35, 36, 37, 38, 39, 701, 5940, 1885, 35, 30, 37, 32, 971, 30],
    "  spaces\n\n\ttabs  ": [216, 5600, 1116, 197, 100, 7366, 256],
    "café naïve 😀 中文 𝔘": [83, 1939, 2756, 15486, 46494, 40303, 218, 216, 28589, 29184, 216, 23159, 238, 242],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "don't I'll we've": [12420, 982, 339, 3060, 392, 3543],
    "x=1+22*333/4444;": [104, 45, 33, 27, 34, 34, 26, 35, 35, 35, 31, 36, 36, 36, 36, 43],
}


def test_embedded_tokens_unchanged(gguf_tokenizer: ChatTokenizer) -> None:
    for text, ids in _GOLDEN.items():
        assert gguf_tokenizer.encode(text) == ids, text
        assert gguf_tokenizer.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_pre_tokenizer_follows_the_gguf() -> None:
    loaded: Any = mx.load(str(embedded_model_path()), return_metadata=True)
    meta = loaded[1]
    assert str(meta["tokenizer.ggml.pre"]) == "smollm"
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = list(meta["tokenizer.ggml.merges"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    smollm = build_bpe(tokens, merges, types, "smollm")
    gpt2 = build_bpe(tokens, merges, types, None)  # absent key: GPT-2's pre-tokenizer
    llama3 = build_bpe(tokens, merges, types, "llama-bpe")
    kinds = {json.loads(t.to_str())["pre_tokenizer"]["type"] for t in (smollm, llama3)}
    assert kinds == {"Sequence"}
    assert json.loads(gpt2.to_str())["pre_tokenizer"]["type"] == "ByteLevel"
    # the digit rule differs: SmolLM splits every digit, llama-bpe groups up to three
    assert smollm.pre_tokenizer.pre_tokenize_str("12345")[0][0] == "1"
    assert llama3.pre_tokenizer.pre_tokenize_str("12345")[0][0] == "123"
    with pytest.raises(UnknownPreTokenizer, match="'mystery-pre'"):
        pre_tokenizer_for("mystery-pre")


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_text_frames_equal_whole_chunks(chat: bool) -> None:
    """Plain streamed text is framed from a chunk serialized once per choice
    (`_Formatter.text_event`): every event is the JSON of the whole chunk, whatever the text."""
    from types import SimpleNamespace

    from segserve.server.http.openai_api import _TEXT_MARK, _Formatter, _sse

    for model in ('m"odel\\', f"odd{_TEXT_MARK}name"):  # the second: no frame, whole chunks
        fmt = _Formatter(model, "chatcmpl-1", chat, cast(Any, SimpleNamespace()))
        for index in (0, 2):
            for text in (" plain", 'quo"te\\ back', "line\nbreak\t", "\u2028 \u00e9 \U0001f600", "\x00\x1f",
                         _TEXT_MARK):
                event = fmt.text_event(text, index)
                assert event.startswith(b"data: ") and event.endswith(b"\n\n")
                assert json.loads(event[6:]) == json.loads(_sse(fmt.chunk(text=text, index=index))[6:])
