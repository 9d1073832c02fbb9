"""No client stalls another: tokenizing releases the GIL and gives `encode`'s ids; a prompt
longer than the context could hold is refused before it is tokenized (chat, completions,
responses, tokenize); grammar compiler failures reach the client without a native
backtrace, and a forced-call grammar stays linear in its functions."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from segserve.config.settings import load_settings
from segserve.server.chat import grammar
from segserve.server.chat.grammar import (
    MAX_GRAMMAR_FUNCTIONS,
    GrammarError,
    GrammarVocab,
    compile_tool_choice,
    compiler_reason,
)
from segserve.server.chat.tool_calls import ToolFamily
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runner.tokenizer import longest_token_chars
from segserve.server.runtime import Runtime
from tests.conftest import make_tiny_model, tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

CONTEXT = 64
CORPUS = [
    "Hello, world! The quick brown fox.",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "1234567890" * 50,
    "emoji 😀🎉 and CJK 中文字符 and ½ ² ٣٤٥",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing whitespace \t\t \n",
    "",
]


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    # tools stay out of the prompt (a 2,000-tool system block would not fit CONTEXT)
    settings = load_settings(
        {"max_tokens_default": "2", "bank_dir": "none", "tool_prompt": "none"}, environ={}
    )
    runtime = tiny_runtime(tiny_loaded(gguf_tokenizer, make_tiny_model(seed=3), context=CONTEXT), settings)
    yield runtime
    runtime.engine.stop()


@pytest.fixture(scope="module")
def client(rt: Runtime) -> Iterator[httpx.Client]:
    with serve_in_thread(create_app(rt.serving)) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        yield c


def test_encode_gives_the_ids_of_plain_encode(gguf_tokenizer: ChatTokenizer) -> None:
    backend = gguf_tokenizer.backend
    assert backend is not None
    for text in CORPUS:
        assert gguf_tokenizer.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_encode_lets_other_threads_run(gguf_tokenizer: ChatTokenizer) -> None:
    """While a long text is tokenized, another Python thread keeps running (with the GIL
    held for the whole call it would not get a single turn until the call returned)."""
    text = "1234567890" * 60_000
    ticks = 0
    started = threading.Event()
    out: list[int] = []

    def work() -> None:
        started.set()
        out.extend(gguf_tokenizer.encode(text))

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while t.is_alive():
        time.sleep(0.001)
        ticks += 1
    t.join()
    assert len(out) == len(text)  # SmolLM splits every digit
    assert ticks >= 20, ticks


def test_longest_token_bounds_the_characters(gguf_tokenizer: ChatTokenizer) -> None:
    longest = gguf_tokenizer.max_token_chars
    assert longest == max(len(gguf_tokenizer.token_bytes(i)) for i in range(gguf_tokenizer.vocab_size))
    for text in CORPUS:
        assert len(text) <= len(gguf_tokenizer.encode(text)) * longest
    assert gguf_tokenizer.char_limit(CONTEXT) == CONTEXT * longest


def test_no_bound_where_the_tokenizer_drops_or_fuses_characters() -> None:
    def build(fuse: bool, pre: pre_tokenizers.PreTokenizer | None) -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=fuse))
        if pre is not None:
            tok.pre_tokenizer = pre
        return tok

    def nbytes(i: int) -> bytes:
        return b"<unk>" if i == 1 else b"a"

    assert longest_token_chars(build(False, None), nbytes) == 5
    assert longest_token_chars(build(True, None), nbytes) is None  # "zzzz" is one <unk>
    assert longest_token_chars(build(False, pre_tokenizers.Whitespace()), nbytes) is None
    assert build(False, pre_tokenizers.Whitespace()).encode("a      a").ids == [0, 0]


def _too_long(rt: Runtime) -> str:
    limit = rt.tokenizer.char_limit(CONTEXT)
    assert limit is not None
    return "x" * (int(limit) + 1)


@pytest.mark.parametrize("route", ["chat", "completions", "responses", "tokenize"])
def test_a_prompt_past_the_context_is_refused_before_tokenizing(
    rt: Runtime, client: httpx.Client, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    text = _too_long(rt)
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        "completions": ("/v1/completions", {"prompt": text}),
        "responses": ("/v1/responses", {"input": text}),
        "tokenize": ("/tokenize", {"prompt": text}),
    }[route]
    calls: list[int] = []
    codec = type(rt.tokenizer.codec)
    real = codec.encode

    def counting(self: object, s: str) -> list[int]:
        calls.append(len(s))
        ids: list[int] = real(self, s)
        return ids

    monkeypatch.setattr(codec, "encode", counting)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    assert err["param"] in ("messages", "prompt")
    assert not any(n >= len(text) for n in calls), "the long text was tokenized"
    # Under the bound it is tokenized, then refused by its token count as before (SmolLM
    # splits every digit: one token each).
    under = client.post("/v1/completions", json={"prompt": "1" * (CONTEXT * 2)})
    assert under.status_code == 400 and under.json()["error"]["code"] == "context_length_exceeded"
    assert CONTEXT * 2 in calls


def _fn(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_compiler_panic_reaches_the_client_without_a_backtrace(
    gguf_tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = gguf_tokenizer.backend
    assert backend is not None
    vocab = GrammarVocab.from_tokenizer(backend, vocab_size=gguf_tokenizer.vocab_size, eos_ids=gguf_tokenizer.eos_ids)
    # Past the function cap, 4,000 one-call alternatives hit llguidance's symbol-count
    # assertion: a Rust panic, whose text carries a native backtrace with build paths.
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_FUNCTIONS", 10_000)
    raw: list[str] = []
    real = grammar.compiler_reason
    def recording(text: str) -> str:
        raw.append(text)
        return real(text)

    monkeypatch.setattr(grammar, "compiler_reason", recording)
    # Three properties per tool keep the grammar past the symbol limit whether or not the
    # objects are closed (closing them drops the extra-keys rule).
    props = {k: {"type": "string"} for k in ("a", "b", "c")}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": props}}} for i in range(4000)]
    with pytest.raises(GrammarError) as err:
        compile_tool_choice(ToolFamily.HERMES, tools, "required", vocab, parallel_tool_calls=False)
    assert raw and "<backtrace>" in raw[0]
    msg = err.value.message
    assert err.value.param == "tools" and "cannot be compiled" in msg
    assert "backtrace" not in msg and "\n" not in msg and ".c:" not in msg and "/tmp/" not in msg
    assert "limits" in msg and "assertion failed" in msg
    assert compiler_reason("unexpected token\n  at line 3") == "unexpected token"


def test_too_many_forced_functions_are_a_400(client: httpx.Client) -> None:
    tools = [_fn(f"f{i}") for i in range(2000)]
    for parallel in (True, False):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": parallel,
        })
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools" and str(MAX_GRAMMAR_FUNCTIONS) in err["message"]
        assert "backtrace" not in r.text and "/tmp/" not in r.text
    assert client.get("/health").status_code == 200


def _accepts(vocab: GrammarVocab, grammar_proto: Any, text: str) -> bool:
    m = grammar_proto.deep_copy()
    ids = vocab.tokenizer.tokenize_str(text, parse_special=True)
    return all(m.consume_token(t) for t in ids) and bool(m.is_accepting())


def test_parallel_required_is_each_function_at_most_once_in_order(gguf_tokenizer: ChatTokenizer) -> None:
    backend = gguf_tokenizer.backend
    assert backend is not None
    vocab = GrammarVocab.from_tokenizer(backend, vocab_size=gguf_tokenizer.vocab_size, eos_ids=gguf_tokenizer.eos_ids)
    g = compile_tool_choice(ToolFamily.HERMES, [_fn("a"), _fn("b"), _fn("c")], "required", vocab)
    assert g is not None

    def calls(*names: str) -> str:
        return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>' for n in names)

    for ok in (("a",), ("c",), ("a", "b"), ("a", "c"), ("b", "c"), ("a", "b", "c")):
        assert _accepts(vocab, g._proto, calls(*ok)), ok
    for bad in (("b", "a"), ("a", "a"), ("c", "b"), ("a", "b", "c", "a")):
        assert not _accepts(vocab, g._proto, calls(*bad)), bad
    # The limit compiles (the grammar is linear in its functions).
    many = compile_tool_choice(ToolFamily.HERMES, [_fn(f"f{i}") for i in range(MAX_GRAMMAR_FUNCTIONS)], "required", vocab)
    assert many is not None and json.dumps(many.kind) == '"tool_call:required"'
