"""HTTP-layer limits: request bodies, slow clients, open connections.

Owns: `BodyGuard` (ASGI: the body size limit, checked from `Content-Length` and while
reading, on every endpoint; the body read timeout), `guarded_protocol` (uvicorn's h11
protocol plus a header timeout and a connection cap) and `connection_limits`.

What uvicorn 0.54 offers and what it does not: `timeout_keep_alive` closes a connection
idle *between* requests, but any byte received cancels it, and nothing times a request's
headers or body; `limit_concurrency` answers 503 only once a request's headers arrived,
so connections that never finish their headers hold a file descriptor each for ever, and
enough of them make `accept()` fail (EMFILE): `/health` becomes unreachable. Hence:

- header timeout: a connection waiting for a request's headers (a fresh one, or a
  keep-alive one after its response) is closed after `--header-timeout` seconds, however
  many bytes it trickles in;
- connection cap: past `--max-connections` (auto: the open-file limit, after raising the
  soft limit to the hard one, minus one accept burst and 256; `connection_limits`), a new connection closes the connection that has
  been waiting longest for its headers, so a flood of slow clients can never lock out a
  new one; when every connection is inside a request, the new one is closed instead.
  (mlx-lm sets the open-file limits to (2048, 4096) when imported, lowering a higher hard
  limit for good, and fails to import under a lower one: `import_mlx_lm_keeping_fd_limit`
  imports it first with that call skipped;)
- body: `Content-Length` over `--max-request-bytes` is a 413 before any byte is read; so
  is a chunk whose declared size takes the body over it, as soon as its size line arrives (the
  protocol reads h11's pending chunk size and tells `BodyGuard` through the scope, rather
  than waiting `--body-timeout` for bytes that would be refused); a body that grows past
  it while reading is a 413 at that point (never buffered whole); a body slower than
  `--body-timeout` is a 408 and the connection is closed. The app gets the body already
  read (replayed once), then the server's own `receive` (disconnects).
- framing: `Content-Length` together with `Transfer-Encoding` is a 400 and the connection
  is closed (RFC 9112 §6.3: a request smuggling vector; h11 would serve it as chunked).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from segserve.server.http.errors import (
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    ServerError,
    error_body,
)

log = logging.getLogger("segserve")

FD_RESERVE = 256  # descriptors kept for the model, the bank, sqlite, logs
MIN_CONNECTIONS = 16


def import_mlx_lm_keeping_fd_limit() -> None:
    """Import mlx_lm without letting it change RLIMIT_NOFILE (see the module doc)."""
    real = resource.setrlimit

    def keep_nofile(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = keep_nofile
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real


def connection_limits(configured: int | None) -> tuple[int, int]:
    """(connection cap, listen backlog). Raises the soft open-file limit to the hard one
    first (what most servers do). asyncio accepts up to `backlog` connections in one go
    before any is seen by the protocol, so the cap leaves room for one such burst:
    cap + backlog + `FD_RESERVE` stays within the open-file limit and `accept()` never
    fails with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    limit = int(soft) if soft != resource.RLIM_INFINITY else 1 << 20
    backlog = max(16, min(2048, limit // 4))
    auto = max(MIN_CONNECTIONS, limit - backlog - FD_RESERVE)
    return (configured if configured is not None else auto), backlog


# Scope key through which the protocol tells `BodyGuard` of a chunk over the body limit.
OVERSIZED_CHUNK = "segserve.oversized_chunk"


def guarded_protocol(
    header_timeout: float, max_connections: int, max_body_bytes: int | None = None
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout, the connection cap and the
    oversized-chunk check (see module)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_since: float | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._wait_for_headers()
            if len(self.connections) > max_connections:
                self._shed()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            self._waiting_since = None
            super().connection_lost(exc)

        _body_seen = 0  # body bytes of the current request that h11 has handed over

        def handle_events(self) -> None:
            cycle = self.cycle
            before = len(cycle.body) if cycle is not None else 0
            super().handle_events()
            if not self._between_requests():
                self._stop_timer()  # headers complete: the request is the app's now
                self._waiting_since = None
                if self.cycle is not cycle:  # a new request: its body so far is all new
                    self._body_seen, before = 0, 0
                self._body_seen += len(self.cycle.body) - before
                self._check_chunk()

        def _check_chunk(self) -> None:
            """A chunk that would take the body past the limit: wake the app's `receive`
            with the size in the scope. h11 (0.16) keeps what remains of the current chunk
            in its reader's `_bytes_in_chunk`, set as soon as the size line is parsed."""
            if max_body_bytes is None or self.cycle is None:
                return
            pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
            if isinstance(pending, int) and self._body_seen + pending > max_body_bytes:
                if OVERSIZED_CHUNK not in self.cycle.scope:
                    at_least = self._body_seen + pending
                    self.cycle.scope[OVERSIZED_CHUNK] = at_least  # type: ignore[literal-required]
                    self.cycle.message_event.set()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._between_requests() and not self.transport.is_closing():
                self._wait_for_headers()

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _wait_for_headers(self) -> None:
            self._stop_timer()
            self._waiting_since = self.loop.time()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self._close()

        def _close(self) -> None:
            self._stop_timer()
            self._waiting_since = None
            if self.conn.our_state not in (h11.ERROR, h11.CLOSED, h11.MUST_CLOSE):
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.close()

        def _shed(self) -> None:
            """Over the cap: close the connection waiting longest for its headers."""
            oldest: GuardedH11Protocol | None = None
            for c in self.connections:
                if not isinstance(c, GuardedH11Protocol) or c is self or c._waiting_since is None:
                    continue
                if c.transport.is_closing():
                    continue
                if oldest is None or c._waiting_since < (oldest._waiting_since or 0.0):
                    oldest = c
            victim = oldest if oldest is not None else self
            _SHED["count"] += 1
            if _SHED["count"] in (1, 10, 100, 1000) or _SHED["count"] % 10000 == 0:
                log.warning(
                    "%d connections open (cap %d): closed one waiting for headers "
                    "(%d so far)", len(self.connections), max_connections, _SHED["count"],
                )
            victim._close()

    return GuardedH11Protocol


_SHED = {"count": 0}


class BodyGuard:
    """Reads the request body under the size limit and the read timeout, then replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and any(k == b"transfer-encoding" for k, _ in scope.get("headers", [])):
            declared = InvalidRequest(
                "Content-Length and Transfer-Encoding together are ambiguous framing (RFC 9112 "
                "section 6.3); send one of them", param="Content-Length",
            )
        if isinstance(declared, ServerError):
            await _refuse(declared, send, close=True)
            return
        if declared is not None and declared > self.max_bytes:
            # Past several times the limit, draining the rest is not worth it: close.
            err = PayloadTooLarge(
                f"request body is {declared} bytes; the limit is {self.max_bytes}"
            )
            await _refuse(err, send, close=declared > 8 * self.max_bytes)
            return
        chunks: list[bytes] = []
        total = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        scope.setdefault("state", {})["client_gone"] = True
                        return
                    chunk = scope.get(OVERSIZED_CHUNK)
                    if chunk is not None:
                        await _refuse(PayloadTooLarge(
                            f"request body is at least {chunk} bytes (its chunk sizes say so); "
                            f"the limit is {self.max_bytes}"
                        ), send, close=True)
                        return
                    body = message.get("body", b"")
                    total += len(body)
                    if total > self.max_bytes:
                        await _refuse(PayloadTooLarge(
                            f"request body is over the limit of {self.max_bytes} bytes"
                        ), send, close=False)
                        return
                    if body:
                        chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _refuse(RequestTimeout(
                f"the request body took longer than {self.timeout_s:g}s to arrive"
            ), send, close=True)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | ServerError | None:
    values = [v for k, v in scope.get("headers", []) if k == b"content-length"]
    if not values:
        return None
    # h11 already refuses conflicting or malformed lengths; this is the belt to its braces.
    if len(set(values)) != 1 or not values[0].isdigit() or len(values[0]) > 18:
        return InvalidRequest("malformed Content-Length header")
    return int(values[0])


async def _refuse(err: ServerError, send: Send, *, close: bool) -> None:
    import json

    body = json.dumps(error_body(err)).encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# Seconds an idle keep-alive connection stays open after a response (uvicorn's own default,
# made explicit). A proxy that pools connections to replicas must drop idle ones sooner
# (deploy/nginx/segserve.conf: `keepalive_timeout` in the upstream block): otherwise a request
# it sends on a connection the replica is closing at that moment fails, and nginx counts that
# as the replica failing (max_fails=1): for fail_timeout every conversation moves away.
IDLE_KEEP_ALIVE_S = 5


def protocol_kwargs(settings: Any) -> dict[str, Any]:
    """uvicorn.Config arguments for the guarded protocol from the settings."""
    cap, backlog = connection_limits(settings.max_connections)
    log.info("connections: at most %d open (listen backlog %d)", cap, backlog)
    protocol = guarded_protocol(settings.header_timeout, cap, settings.max_request_bytes)
    return {"http": protocol, "backlog": backlog, "timeout_keep_alive": IDLE_KEEP_ALIVE_S}
