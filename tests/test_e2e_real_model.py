"""End-to-end over real HTTP on loopback, the real embedded model, the official OpenAI SDK.

One server process (`python -m segserve.server.cli serve`, so the CLI and the OpenBLAS re-exec
are exercised too) for the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.process_support import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("e2e")
    srv = ServerProcess(tmp / "server.log", "--max-tokens-default", "64", "--bank-dir", str(tmp / "bank"))
    try:
        srv.wait_healthy(180)
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    # openai types http_client as httpx2.Client; at run time it also takes an httpx.Client.
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, http_client=httpx.Client(trust_env=False, timeout=120))  # type: ignore[arg-type]


def test_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=20
    )
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Count to five."}], temperature=0, max_tokens=16,
        stream=True, stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text and finish in ("stop", "length")
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stop_never_emitted(client: openai.OpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
    free = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=20).choices[0].message.content or ""
    assert "Paris" in free
    r = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=20, stop=["Paris"])
    out = r.choices[0].message.content or ""
    assert "Paris" not in out and free.startswith(out)
    assert r.choices[0].finish_reason == "stop"


def test_seed_determinism(client: openai.OpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a short story."}]
    a = client.chat.completions.create(model="default", messages=msgs, temperature=0.9, seed=11, max_tokens=12)
    b = client.chat.completions.create(model="default", messages=msgs, temperature=0.9, seed=11, max_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_followup_reuses_cache(client: openai.OpenAI) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of Germany?"}]
    r1 = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=16)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content or ""}, {"role": "user", "content": "And Italy?"}]
    r2 = client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=16)
    assert r1.usage is not None and r2.usage is not None and r2.usage.prompt_tokens_details is not None
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= r1.usage.prompt_tokens


def test_errors_through_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], n=17)
    assert "n" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=9000)
    assert e.value.code == "context_length_exceeded"


def test_models_and_health(client: openai.OpenAI, server_url: str) -> None:
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    h = httpx.get(server_url + "/health", trust_env=False).json()
    assert h["kv"]["mode"] == "segmented" and h["kv"]["self_check"]["ok"] is True
