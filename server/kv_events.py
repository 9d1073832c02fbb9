"""KV events for KV-aware routers, in the format vLLM publishes (`--kv-events-endpoint`).

Owns: the wire types (msgspec structs laid out like vLLM's `vllm.distributed.kv_events`),
`KVEventPublisher` (a ZeroMQ PUB socket, a ROUTER socket for replay, one thread) and
`attach(bank, endpoint)`, which points a bank's `bank.events.BlockEvents` at a publisher.
The bank decides what happened (`bank.events`); this module only encodes and sends.

Wire format (what llm-d's KV-cache indexer and Dynamo's ZMQ relay decode):
- PUB multipart message: [topic (b""), sequence number (8 bytes, big-endian), payload].
- payload: msgpack of `EventBatch` = [ts (float seconds), [event, ...]]; each event an
  array led by its tag: ["BlockStored", block_hashes, parent_block_hash|nil, token_ids,
  block_size, lora_id (nil), medium (nil)], ["BlockRemoved", block_hashes, medium (nil)],
  ["AllBlocksCleared"]. Block hashes are 63-bit integers of segserve's own chain
  (`bank.events`), block_size 16, token ids the blocks' tokens in order.
- Replay: send [b"", start_seq (8 bytes, big-endian)] from a REQ/DEALER socket to the
  replay endpoint; the answer is [b"", seq, payload] for every buffered batch with seq >=
  start_seq, then [b"", -1 (8 bytes, signed), b""].
Endpoints follow vLLM's rule: a `*`, `::`, `ipc://` or `inproc://` endpoint is bound,
any other (`tcp://router-host:5557`) is connected to. The replay socket is always bound,
at the PUB port + 1 (`tcp://*:5557` -> `tcp://*:5558`; ipc/inproc: the path + "-replay").

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
from itertools import count
from typing import Any

import msgspec
import zmq

from bank import Bank
from bank.events import AllCleared, BankEvent, BlockEvents, BlocksRemoved, BlocksStored

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


def to_wire(ev: BankEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(ev, BlocksStored):
        return BlockStored(list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                           ev.block_size, None, None)
    if isinstance(ev, BlocksRemoved):
        return BlockRemoved(list(ev.block_hashes), None)
    assert isinstance(ev, AllCleared)
    return AllBlocksCleared()


def replay_endpoint(endpoint: str) -> str:
    """The replay (ROUTER) endpoint beside a PUB endpoint: TCP port + 1, else "-replay"."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT")
        return f"{host}:{int(port) + 1}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint + "-replay"
    raise ValueError(f"{endpoint!r}: expected tcp://, ipc:// or inproc://")


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """PUB + replay ROUTER on one thread; `publish` only queues (engine thread safe)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
        max_batch_events: int = 512,
    ) -> None:
        self.endpoint = endpoint
        self.replay = replay if replay is not None else replay_endpoint(endpoint)
        self._topic = topic.encode()
        self._queue: queue.Queue[list[BankEvent] | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._max_batch = max_batch_events
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self.dropped = 0  # event lists dropped because the queue was full
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
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
        while True:
            if self._router.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
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
        batch = KVEventBatch(time.time(), [to_wire(e) for e in events])
        try:
            payload = self._encoder.encode(batch)
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        except (zmq.ZMQError, msgspec.MsgspecError) as exc:  # keep serving; log once per fault
            log.warning("kv events: could not publish a batch: %s", exc)

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


def attach(bank: Bank, endpoint: str, *, block_size: int | None = None) -> KVEventPublisher:
    """Publish `bank`'s block events at `endpoint` (before the engine starts)."""
    pub = KVEventPublisher(endpoint)
    obs = BlockEvents(pub.publish) if block_size is None else BlockEvents(pub.publish, block_size)
    bank.observe(obs)
    log.info("kv events: publishing at %s (replay %s), block size %d", endpoint, pub.replay,
             obs.block_size)
    return pub
