"""The engine's refusals and failures are plain values; the HTTP side maps each once.

`segserve.server.engine.errors` carries what the engine knows (retry seconds, admission's
pricing, the failed phase); `segserve.server.http.errors.from_engine` picks the status, the
error type and code, and `Retry-After`; the app then answers in OpenAI's shape, or in
Anthropic's under `/v1/messages`.
"""

from __future__ import annotations

import json

import pytest

from segserve.server.engine import errors as eng
from segserve.server.engine.refusals import queue_full_error
from segserve.server.http import anthropic_api, openai_api
from segserve.server.http.errors import from_engine

CASES = [
    # engine error, status, OpenAI type, code, Retry-After, Anthropic type
    (eng.QueueFull("full", retry_after_s=2.7, waiting=3), 429, "rate_limit_error", "queue_full", "2",
     "rate_limit_error"),
    (eng.WaitTimedOut("waited", retry_after_s=4.0), 503, "server_error", "wait_timeout", "4",
     "overloaded_error"),
    (eng.InsufficientMemory("no room", detail={"price_bytes": 5}), 507, "server_error",
     "insufficient_memory", None, "overloaded_error"),
    (eng.InsufficientMemory("grew", reason="memory_guard"), 507, "server_error", "memory_guard", None,
     "overloaded_error"),
    (eng.EngineFailure("prefill failed: boom", phase="prefill"), 500, "server_error", "generation_failed",
     None, "api_error"),
    (eng.EngineUnavailable("gone"), 503, "server_error", "engine_unavailable", None, "api_error"),
    (eng.ShuttingDown(), 503, "server_error", "shutting_down", "5", "overloaded_error"),
]


@pytest.mark.parametrize(("exc", "status", "kind", "code", "retry", "anthropic_kind"), CASES)
def test_engine_errors_map_once_to_both_shapes(
    exc: eng.EngineError, status: int, kind: str, code: str, retry: str | None, anthropic_kind: str
) -> None:
    err = from_engine(exc)
    assert (err.status, err.type, err.code, err.message) == (status, kind, code, exc.message)
    assert err.headers.get("Retry-After") == retry

    r = openai_api.error_response(err)
    body = json.loads(bytes(r.body))["error"]
    assert r.status_code == status
    assert (body["type"], body["code"], body["message"], body["param"]) == (kind, code, exc.message, None)
    if isinstance(exc, eng.InsufficientMemory) and exc.detail is not None:
        assert body["detail"] == exc.detail  # what admission priced rides along

    a = anthropic_api.error_response(err)
    abody = json.loads(bytes(a.body))
    assert a.status_code == status
    assert abody["type"] == "error" and abody["error"]["type"] == anthropic_kind


def test_queue_full_refusal_is_a_value_with_the_waiting_count() -> None:
    """The scheduler's queue holds the request being admitted at its head: what waits is
    the rest, and the retry time is passed through untouched."""
    exc = queue_full_error(queue_length=4, retry_after_s=1.5)
    assert isinstance(exc, eng.QueueFull)
    assert (exc.waiting, exc.retry_after_s) == (3, 1.5)
    assert "3 requests" in exc.message
