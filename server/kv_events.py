"""KV events for KV-aware routers, in the format vLLM publishes (`--kv-events-endpoint`).

Owns: the wire types (msgspec structs laid out like vLLM's `vllm.distributed.kv_events`),
`KVEventPublisher` (a ZeroMQ XPUB socket, a ROUTER socket for replay, one thread), the
endpoint rules (`binds`, `replay_endpoint`, `exposed`, `exposure_error`) and
`attach(bank, endpoint)`, which points a bank's `segserve.bank.events.BlockEvents` at a publisher.
The bank decides what happened (`segserve.bank.events`); this module only encodes and sends.

Wire format (what llm-d's KV-cache indexer and Dynamo's ZMQ relay decode):
- PUB multipart message: [topic (b""), sequence number (8 bytes, big-endian), payload].
- payload: msgpack of `EventBatch` = [ts (float seconds), [event, ...]]; each event an
  array led by its tag: ["BlockStored", block_hashes, parent_block_hash|nil, token_ids,
  block_size, lora_id (nil), medium (nil)], ["BlockRemoved", block_hashes, medium (nil)],
  ["AllBlocksCleared"]. Block hashes are 63-bit integers of segserve's own chain
  (`segserve.bank.events`), block_size 16. `token_ids` is empty (vLLM's decoders accept an empty
  list) unless `--kv-events-token-ids`: then the blocks' tokens in order, i.e. the prompts.
- Replay: send [b"", start_seq (8 bytes, big-endian)] from a REQ/DEALER socket to the
  replay endpoint; the answer is [b"", seq, payload] for every buffered batch with seq >=
  start_seq, then [b"", -1 (8 bytes, signed), b""]. The buffer holds the encoded batches,
  so replay never holds or returns more than the live stream did.
Endpoints follow vLLM's rule: a `*`, `::`, `ipc://` or `inproc://` endpoint is bound,
any other (`tcp://router-host:5557`) is connected to. The replay socket is always bound,
at the PUB port + 1 (`tcp://*:5557` -> `tcp://*:5558`; ipc/inproc: the path + "-replay").

Privacy: neither socket authenticates. `exposed(endpoint)` names what would listen beyond
loopback; with named tenants the server refuses that at start-up unless
`--kv-events-allow-remote` (`exposure_error`, called by the pre-flight checks), and
without tenants `attach` logs what is exposed.

Delivery: ZeroMQ drops what a PUB socket sends before a subscriber's subscription reached
it (always the first events of a publisher that connects to a bound SUB, which sends its
subscription only once its owner polls it). The publisher is an XPUB with verbose
(un)subscriptions, so it counts subscribers, and holds batches (in the replay buffer)
while there is none; the first subscription releases them in order. A subscriber that
joins later sees a sequence gap and asks the replay socket. The thread sends what the
engine queued within `CADENCE_S`, whether or not another request arrives.

Events describe presence in the bank (RAM or SSD tier), so `medium` is nil; each replica
starts with `AllBlocksCleared` followed by what its bank holds (after a restart: the SSD
tier's sessions), and ends with `AllBlocksCleared` when it shuts down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count, islice
from typing import Any

import msgspec
import zmq

from segserve.bank import Bank
from segserve.bank.events import (
    DEFAULT_BLOCK_SIZE,
    AllCleared,
    BankEvent,
    BlockEvents,
    BlocksRemoved,
    BlocksStored,
)

log = logging.getLogger("segserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # [ts, events]: vLLM's later optional data_parallel_rank is left out (a third element
    # would break decoders of the two-field form; msgspec writes defaults of array_like
    # structs too).
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(ev: BankEvent, *, token_ids: bool = False) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(ev, BlocksStored):
        # Withheld unless asked for, even if the observer was built to keep them.
        tokens = list(ev.token_ids) if token_ids else []
        return BlockStored(list(ev.block_hashes), ev.parent_block_hash, tokens,
                           ev.block_size, None, None)
    if isinstance(ev, BlocksRemoved):
        return BlockRemoved(list(ev.block_hashes), None)
    assert isinstance(ev, AllCleared)
    return AllBlocksCleared()


def replay_endpoint(endpoint: str) -> str:
    """The replay (ROUTER) endpoint beside a PUB endpoint: TCP port + 1, else "-replay"."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit() or host == "tcp:/":
            raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT")
        return f"{host}:{int(port) + 1}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint + "-replay"
    raise ValueError(f"{endpoint!r}: expected tcp://, ipc:// or inproc://")


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _loopback(tcp_endpoint: str) -> bool:
    host = tcp_endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def exposed(endpoint: str) -> tuple[str, ...]:
    """The endpoints this server would bind where other hosts can reach them: the PUB
    socket at `*`/`::`, the replay socket at any TCP address but loopback (ValueError for
    a malformed endpoint). ipc/inproc are local; a connected PUB goes to the one host
    named, which the operator chose."""
    replay = replay_endpoint(endpoint)
    if not endpoint.startswith("tcp://"):
        return ()
    out = [endpoint] if binds(endpoint) and not _loopback(endpoint) else []
    if not _loopback(replay):
        out.append(replay)
    return tuple(out)


def what_is_exposed(token_ids: bool) -> str:
    if token_ids:
        return "every stored prompt's token ids (the prompt text) and block hashes"
    return ("block hashes, which reveal only whether two prompts share a prefix, to "
            "someone able to guess that prefix")


def exposure_error(
    endpoint: str, *, tenants: bool, allow_remote: bool, token_ids: bool
) -> str | None:
    """Why the server must not start with this endpoint (None: it may). With named tenants
    a socket beyond loopback would show one tenant's cache to anyone on the network, so
    it needs the operator's explicit `--kv-events-allow-remote`."""
    remote = exposed(endpoint)
    if not remote or not tenants or allow_remote:
        return None
    return (
        f"would listen on {', '.join(remote)} beyond loopback with no authentication while "
        f"the API key file names tenants: any host that reaches it reads {what_is_exposed(token_ids)} "
        "of every tenant. Use ipc://PATH or a tcp://HOST:PORT that the server connects to, or "
        "set --kv-events-allow-remote (SEGSERVE_KV_EVENTS_ALLOW_REMOTE=true) to accept this"
    )


CADENCE_S = 0.05  # the publisher thread's longest sleep: queued events go out within it


class KVEventPublisher:
    """XPUB + replay ROUTER on one thread; `publish` only queues (engine thread safe)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        token_ids: bool = False,
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
        max_batch_events: int = 512,
    ) -> None:
        self.endpoint = endpoint
        self.replay = replay if replay is not None else replay_endpoint(endpoint)
        self.token_ids = token_ids
        self._topic = topic.encode()
        self._queue: queue.Queue[list[BankEvent] | None] = queue.Queue(max_queue)
        # Encoded batches by sequence number: what replay serves, and what is held (seq >=
        # _next_live) while no subscriber is there.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_live = 0
        self.subscribers = 0  # subscriptions that match the topic (publisher thread)
        self._max_batch = max_batch_events
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self.dropped = 0  # event lists dropped because the queue was full
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, for the count
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:  # errors (port taken, bad address) surface here, at start-up
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self._router.bind(self.replay)
        except zmq.ZMQError:
            self._pub.close(0)
            self._router.close(0)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[BankEvent]) -> None:
        if not self._running:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:  # never block the engine thread; a gap shows in the sequence
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(0)
        self._router.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(0):
                if sock is self._router:
                    self._serve_replay()
                else:
                    self._read_subscriptions()
            self._send_held()
            try:
                first = self._queue.get(timeout=CADENCE_S)
            except queue.Empty:
                continue
            stop = first is None
            events: list[BankEvent] = [] if first is None else list(first)
            while not stop and len(events) < self._max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    events.extend(more)
            if events:
                self._send(events)
            if stop:
                return

    def _send(self, events: list[BankEvent]) -> None:
        batch = KVEventBatch(time.time(), [to_wire(e, token_ids=self.token_ids) for e in events])
        try:
            payload = self._encoder.encode(batch)
        except msgspec.MsgspecError as exc:  # keep serving; the batch is skipped
            log.warning("kv events: could not encode a batch: %s", exc)
            return
        self._buffer.append((next(self._seq), payload))
        self._send_held()

    def _send_held(self) -> None:
        """Send every buffered batch not yet sent, once someone subscribes."""
        if self.subscribers <= 0 or not self._buffer or self._buffer[-1][0] < self._next_live:
            return
        # Sequence numbers are consecutive in the buffer: start at the first unsent one
        # (or the oldest kept, when held batches outgrew the buffer: a gap for replay).
        skip = max(0, self._next_live - self._buffer[0][0])
        for seq, payload in islice(self._buffer, skip, None):
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # keep serving; replay still has the batch
                log.warning("kv events: could not publish a batch: %s", exc)
            self._next_live = seq + 1

    def _read_subscriptions(self) -> None:
        while self._pub.poll(0):
            msg = self._pub.recv()
            if msg[:1] in (b"\x00", b"\x01") and self._topic.startswith(msg[1:]):
                self.subscribers += 1 if msg[:1] == b"\x01" else -1

    def _serve_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._router.send_multipart((client, b"", END_SEQ, b""))


def attach(
    bank: Bank,
    endpoint: str,
    *,
    block_size: int | None = None,
    token_ids: bool = False,
    allow_remote: bool = False,
) -> KVEventPublisher:
    """Publish `bank`'s block events at `endpoint` (before the engine starts). Token ids
    are left out of the events unless `token_ids`; a socket beyond loopback is logged
    with what it shows (the tenant rule is checked earlier, by `exposure_error`)."""
    pub = KVEventPublisher(endpoint, token_ids=token_ids)
    size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    bank.observe(BlockEvents(pub.publish, size, token_ids=token_ids))
    log.info("kv events: publishing at %s (replay %s), block size %d, token ids %s", endpoint,
             pub.replay, size, "on" if token_ids else "off")
    remote = exposed(endpoint)
    if remote:
        log.log(
            logging.INFO if allow_remote else logging.WARNING,
            "kv events: %s listen%s beyond loopback without authentication: anyone who can "
            "reach %s reads %s%s", ", ".join(remote), "s" if len(remote) == 1 else "",
            "it" if len(remote) == 1 else "them", what_is_exposed(token_ids),
            "" if allow_remote else " (set --kv-events-allow-remote to acknowledge)",
        )
    return pub
