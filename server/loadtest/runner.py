"""Drive the workload against one server: closed-loop users or an open-loop Poisson rate.

Closed loop (default): `users` conversations run at once, each sending its next turn as
soon as the previous answer ended; the request count is exactly users * turns unless
`max_seconds` cuts it short. Open loop (`rate`): requests are sent at the arrival times
of a Poisson process of `rate` requests/s (seeded), whatever the server's state, so a slow
server builds a queue instead of slowing the load down. Each arrival takes the next turn
of the conversation idle the longest; when every unfinished conversation has a request in
flight, the arrival opens a new conversation (the report counts them). users * turns
requests in all. No retries in either mode. While the load runs, `/metrics` (if the
server has one) is sampled every `metrics_interval` seconds for memory in use.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO

import httpx

from segserve.server.loadtest.client import (
    RequestRecord,
    auth_headers,
    base_url,
    discover_model,
    stream_chat,
)
from segserve.server.loadtest.prom import ServerSample, memory_in_use, samples, server_sample
from segserve.server.loadtest.workload import Conversation, Mode, chat_body, conversation


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    users: int = 4
    turns: int = 6
    max_tokens: int = 48
    words_per_turn: int = 200
    max_seconds: float = 600.0
    seed: int = 0
    model: str | None = None  # None: the first id from GET /v1/models
    rate: float | None = None  # requests/s (open loop); None: closed loop
    conversation: Mode = "history"
    temperature: float = 0.0
    metrics_interval: float = 1.0  # 0: do not sample /metrics during the run

    @property
    def total_requests(self) -> int:
        return self.users * self.turns


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]  # in completion order
    wall_s: float
    model: str
    run_id: str
    conversations: int
    sample: ServerSample | None  # /metrics after the load, if the server has it
    memory_series: str | None = None  # which series `memory` was read from
    memory: list[tuple[float, float]] = field(default_factory=list)  # (s since start, bytes)


class Progress:
    """A one-line text bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool = True) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.t0 = self.last = time.perf_counter()

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.enabled and (now - self.last >= 0.2 or self.done == self.total):
            self.last = now
            filled = 30 * self.done // max(self.total, 1)
            self.stream.write(
                f"\rloadtest [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
                f" failed {self.failed}  {now - self.t0:.1f}s"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class _Run:
    """The state one run shares between its users (all on one event loop)."""

    def __init__(self, cfg: LoadConfig, client: httpx.AsyncClient, base: str,
                 headers: dict[str, str], model: str, progress: Progress) -> None:
        self.cfg, self.client, self.headers, self.model = cfg, client, headers, model
        self.chat_url = f"{base}/v1/chat/completions"
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.run_id = secrets.token_hex(4)
        self.conversations: list[Conversation] = []
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + cfg.max_seconds

    def open_conversation(self) -> Conversation:
        c = self.cfg
        conv = conversation(len(self.conversations), c.seed, c.words_per_turn, c.turns,
                            c.conversation, self.run_id)
        self.conversations.append(conv)
        return conv

    async def turn(self, conv: Conversation, messages: list[dict[str, str]],
                   scheduled_s: float | None = None) -> None:
        """Send one turn (its user message already appended by `start_turn`)."""
        t0 = time.perf_counter()
        rec = RequestRecord(conv.user, conv.turn, start_s=t0 - self.t0, scheduled_s=scheduled_s)
        body = chat_body(self.model, messages, self.cfg.max_tokens, self.cfg.temperature)
        reply = ""
        try:
            reply = await asyncio.wait_for(
                stream_chat(self.client, self.chat_url, body,
                            {**self.headers, **conv.headers()}, rec, t0),
                timeout=max(self.deadline - t0, 0.0),
            )
        except asyncio.TimeoutError:
            rec.error_code = "client_deadline"
        except httpx.HTTPError as exc:  # transport failure: no (complete) response
            rec.error_code, rec.error_message = type(exc).__name__, str(exc)[:300]
        except ValueError as exc:  # malformed stream
            rec.error_code, rec.error_message = "bad_stream", str(exc)[:300]
        now = time.perf_counter()
        rec.e2e_s = now - t0
        self.records.append(rec)
        self.progress.advance(rec.ok)
        conv.end_turn(rec.ok, reply, now)

    async def closed_user(self, conv: Conversation) -> None:
        while not conv.done and time.perf_counter() < self.deadline:
            await self.turn(conv, conv.start_turn())

    async def closed_loop(self) -> None:
        convs = [self.open_conversation() for _ in range(self.cfg.users)]
        await asyncio.gather(*(self.closed_user(c) for c in convs))

    def _pick(self) -> Conversation:
        idle = [c for c in self.conversations if not c.busy and not c.done]
        if not idle:
            return self.open_conversation()
        return min(idle, key=lambda c: (c.idle_since, c.user))

    async def open_loop(self, rate: float) -> None:
        for _ in range(self.cfg.users):
            self.open_conversation()
        rng = random.Random(f"{self.cfg.seed}/arrivals")
        tasks: list[asyncio.Task[None]] = []
        at = 0.0
        for _ in range(self.cfg.total_requests):
            at += rng.expovariate(rate)
            if self.t0 + at >= self.deadline:
                break
            delay = self.t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conv = self._pick()
            tasks.append(asyncio.create_task(self.turn(conv, conv.start_turn(), at)))
        await asyncio.gather(*tasks)


async def _sample_memory(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                         interval: float, t0: float, stop: asyncio.Event,
                         out: list[tuple[float, float]]) -> str | None:
    """Poll `url` until `stop`; None (and no samples) when it has no memory series."""
    series: str | None = None
    while not stop.is_set():
        try:
            resp = await client.get(url, headers=headers, timeout=5.0)
        except httpx.HTTPError:
            return series
        got = memory_in_use(samples(resp.text)) if resp.status_code == 200 else None
        if got is None:
            return series
        series = got[0]
        out.append((time.perf_counter() - t0, got[1]))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return series


async def run_load(cfg: LoadConfig, api_key: str | None = None,
                   progress: Progress | None = None) -> RunResult:
    """Run the load once; raises LoadTestError for a bad URL or an undiscoverable model."""
    base = base_url(cfg.url)
    headers = auth_headers(api_key)
    bar = progress if progress is not None else Progress(cfg.total_requests)
    # No connection cap in the open loop: a request must never wait for a client slot.
    limits = httpx.Limits(max_connections=None if cfg.rate else cfg.users,
                          max_keepalive_connections=cfg.users)
    timeout = httpx.Timeout(cfg.max_seconds, connect=min(cfg.max_seconds, 30.0))
    # trust_env=False: an HTTP(S)_PROXY from the environment must not capture the load.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client, \
            httpx.AsyncClient(timeout=10.0, trust_env=False) as side:
        model = cfg.model or await discover_model(side, base, headers)
        run = _Run(cfg, client, base, headers, model, bar)
        stop = asyncio.Event()
        memory: list[tuple[float, float]] = []
        sampler: asyncio.Task[str | None] | None = None
        if cfg.metrics_interval > 0:
            sampler = asyncio.create_task(_sample_memory(
                side, f"{base}/metrics", headers, cfg.metrics_interval, run.t0, stop, memory))
        load: Callable[[], Awaitable[None]] = (
            run.closed_loop if cfg.rate is None else lambda: run.open_loop(float(cfg.rate or 0))
        )
        try:
            await load()
        finally:
            stop.set()
            series = await sampler if sampler is not None else None
        wall = time.perf_counter() - run.t0
        bar.close()
        try:
            resp = await side.get(f"{base}/metrics", headers=headers, timeout=5.0)
            sample = server_sample(resp.text) if resp.status_code == 200 else None
        except httpx.HTTPError:
            sample = None
    return RunResult(run.records, wall, model, run.run_id, len(run.conversations), sample,
                     series, memory)
