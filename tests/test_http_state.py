"""What a client reads back must match what happened, at once: the cached-tokens counter
moves with `usage.prompt_tokens_details.cached_tokens`, /health and /metrics reflect a
session DELETE and fork before the next request, and `max_tokens` is honoured exactly."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def rt(gguf_tokenizer: ChatTokenizer) -> Iterator[Runtime]:
    # EOS disabled: every request generates exactly max_tokens tokens.
    loaded = tiny_loaded(gguf_tokenizer, context=1024)
    loaded = dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer, eos_ids=frozenset()))
    runtime = tiny_runtime(loaded, load_settings({}, environ={}))
    yield runtime
    runtime.engine.stop()


@pytest.fixture
def client(rt: Runtime) -> Iterator[httpx.Client]:
    with serve_in_thread(create_app(rt.serving)) as u, httpx.Client(base_url=u, timeout=120, trust_env=False) as c:
        yield c


def _metric(client: httpx.Client, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", client.get("/metrics").text, re.M)
    assert m is not None, name
    return float(m.group(1))


def _chat(client: httpx.Client, msgs: list[dict[str, str]], session: str, n: int = 3) -> dict[str, Any]:
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": n, "temperature": 0},
                    headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_cached_tokens_counter_moves_with_usage(client: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "a first turn whose rows the bank keeps"}]
    seen = []
    for turn in range(3):
        before = _metric(client, "segserve_cached_tokens_total")
        body = _chat(client, msgs, "cached-counter")
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert _metric(client, "segserve_cached_tokens_total") - before == cached
        seen.append(cached)
        msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"turn {turn + 2}"}]
    assert seen[0] == 0 and seen[1] > 0 and seen[2] > seen[1]


def _bank_now(client: httpx.Client) -> tuple[int, float, int]:
    h = client.get("/health").json()
    return h["bank"]["sessions"], _metric(client, "segserve_bank_entries"), h["kv"]["live_segments"]


def test_health_and_metrics_reflect_delete_and_fork_at_once(client: httpx.Client) -> None:
    _chat(client, [{"role": "user", "content": "a session to fork and delete"}], "state-src")
    sessions, entries, _ = _bank_now(client)
    fork = client.post("/v1/sessions/state-src/fork")
    assert fork.status_code == 201, fork.text
    # No request ran in between: the engine published the bank's state with the answer.
    assert _bank_now(client)[:2] == (sessions + 1, entries + 1)
    assert client.delete(f"/v1/sessions/{fork.json()['id']}").status_code == 200
    assert _bank_now(client)[:2] == (sessions, entries)
    assert client.delete("/v1/sessions/state-src").status_code == 200
    after_sessions, after_entries, after_segments = _bank_now(client)
    assert (after_sessions, after_entries) == (sessions - 1, entries - 1)
    assert after_segments == client.get("/health").json()["bank"]["segments"]


@pytest.mark.parametrize("n", [1, 5, 23])
def test_max_tokens_is_honoured_exactly(client: httpx.Client, n: int) -> None:
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": n, "temperature": 0}
    r = client.post(CHAT, json=body).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == n
    with client.stream("POST", CHAT, json={**body, "stream": True,
                                           "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == n
