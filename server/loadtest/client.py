"""One streamed chat completion, measured as the client sees it; model discovery.

Times are `time.perf_counter()` differences from the moment the request is sent: TTFT is
the arrival of the first chunk with content, inter-token latency (ITL) the gaps between
later content chunks (a server that packs several tokens in one chunk shows fewer, longer
gaps), end-to-end the arrival of `[DONE]`. Token counts come from the final `usage`
chunk; without one, each content chunk counts as one token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx


class LoadTestError(Exception):
    """A problem the user must fix (bad URL, no model, a server that does not start)."""


def base_url(url: str) -> str:
    """`http(s)://HOST[:PORT][/prefix]` without a trailing `/` or `/v1`; any host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadTestError(f"--url {url!r}: expected http(s)://HOST[:PORT]")
    return url.rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(slots=True)
class RequestRecord:
    user: int
    turn: int
    start_s: float  # when it was sent, since the run started
    scheduled_s: float | None = None  # open loop: its Poisson arrival time
    status: int = 0  # HTTP status; 0 when no response arrived
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks with content
    completion_tokens: int | None = None  # from usage
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_code is None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end-to-end - TTFT) / (tokens - 1)."""
        if self.ttft_s is None or self.tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    @property
    def output_tokens_per_s(self) -> float | None:
        """This user's streaming speed: 1 / TPOT."""
        tpot = self.tpot_s
        return 1.0 / tpot if tpot else None

    def to_json(self) -> dict[str, Any]:
        return {
            "user": self.user, "turn": self.turn, "start_s": self.start_s,
            "scheduled_s": self.scheduled_s, "status": self.status, "ok": self.ok,
            "ttft_s": self.ttft_s, "e2e_s": self.e2e_s, "tpot_s": self.tpot_s,
            "output_tokens_per_s": self.output_tokens_per_s, "tokens": self.tokens,
            "chunks": self.chunks, "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason, "error_code": self.error_code,
            "error_message": self.error_message, "itl_s": self.itl_s,
        }


def set_error(rec: RequestRecord, error: object) -> None:
    """Record an OpenAI-style `error` object (or anything else) on `rec`."""
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        rec.error_code = str(code) if code is not None else f"http_{rec.status}"
        rec.error_message = str(error.get("message", ""))[:300]
    else:
        rec.error_code, rec.error_message = f"http_{rec.status}", str(error)[:300]


def _apply_chunk(rec: RequestRecord, chunk: dict[str, Any], parts: list[str], t0: float,
                 last: list[float]) -> None:
    if "error" in chunk:  # a mid-stream failure: the status is already 200
        set_error(rec, chunk["error"])
        if rec.error_code == f"http_{rec.status}":
            rec.error_code = "stream_error"
        return
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            now = time.perf_counter() - t0
            if rec.ttft_s is None:
                rec.ttft_s = now
            else:
                rec.itl_s.append(now - last[0])
            last[0] = now
            parts.append(piece)
            rec.chunks += 1
        if choice.get("finish_reason"):
            rec.finish_reason = str(choice["finish_reason"])
    usage = chunk.get("usage")
    if usage:
        rec.completion_tokens = int(usage.get("completion_tokens", rec.chunks))
        rec.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
    rec: RequestRecord, t0: float,
) -> str:
    """POST `body` to `url`, stream it into `rec`; return the reply text.

    Raises httpx.HTTPError on transport failures and ValueError on a malformed stream.
    """
    parts: list[str] = []
    last = [0.0]
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                set_error(rec, payload["error"])
            else:
                set_error(rec, raw.decode("utf-8", "replace") or resp.reason_phrase)
            return ""
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
            _apply_chunk(rec, chunk, parts, t0, last)
        if not done and rec.error_code is None:
            rec.error_code, rec.error_message = "incomplete_stream", "the stream ended before [DONE]"
    return "".join(parts)


async def discover_model(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    """The first model id from `GET /v1/models`, or LoadTestError saying to pass --model."""
    url = f"{base}/v1/models"
    try:
        resp = await client.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise LoadTestError(f"GET {url}: {type(exc).__name__}: {exc}; is the server up?") from None
    if resp.status_code != 200:
        raise LoadTestError(
            f"GET {url} answered {resp.status_code}: {resp.text[:200]!r}; pass --model NAME"
            + (" (and --api-key?)" if resp.status_code in (401, 403) else "")
        )
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise LoadTestError(f"GET {url}: no model listed ({resp.text[:200]!r}); pass --model NAME") from None
