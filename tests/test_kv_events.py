"""KV events (vLLM's ZeroMQ/msgpack format) against the bank's contents.

A subscriber rebuilds the set of announced blocks from the stream (Stored adds, Removed
removes, AllBlocksCleared empties) and compares it, after each step, with the blocks that
the bank's stored turns must produce (recomputed here from their tokens): after a
conversation, a fork, an eviction and a restart. The messages are decoded as plain msgpack
and checked field by field against vLLM's positional layout; replay by sequence number is
checked too. Privacy: by default no event (live or replayed) carries a token id, so a
subscriber learns nothing of another tenant's prompt; `token_ids=True` restores them; a
tenants config refuses sockets beyond loopback without `--kv-events-allow-remote`.
Delivery: a publisher that connects to a bound SUB loses none of its first events, and a
finished turn's events arrive with no further request. The last tests run a real server.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from segserve.bank import Bank, ColdTier
from segserve.bank.events import DEFAULT_BLOCK_SIZE, block_hashes
from segserve.bank.index import path_of
from segserve.config.settings import load_settings
from segserve.kv.segment import Snapshot
from segserve.server.http.tenants import bank_salt
from segserve.server.kv_events import (
    END_SEQ,
    KVEventPublisher,
    attach,
    exposed,
    exposure_error,
    replay_endpoint,
)
from segserve.server.preflight import PreflightError, preflight
from tests.bank_fakes import chain, checked, extend
from tests.http_support import free_port
from tests.process_support import REPO, ServerProcess, write_tiny_model_dir

B = DEFAULT_BLOCK_SIZE
SEG_BYTES_PER_ROW = 2 * 2 * 2 * 8 * 2  # layers * (K+V) * heads * dim * float16 (bank_fakes)
T1 = list(range(1000, 1040))  # 40 tokens: 2 full blocks + 8
T2 = list(range(2000, 2030))  # turn 2 completes block 2 across the segment boundary
T3 = list(range(3000, 3025))


class Subscriber:
    """SUB socket + the announced-block set it implies; replay over a DEALER socket."""

    def __init__(self, endpoint: str, *, tokens: bool = False, bind: bool = False) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.endpoint = endpoint
        self.tokens = tokens  # whether BlockStored events must carry their token ids
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        if bind:  # the router's side of a publisher that connects (tcp://HOST:PORT)
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.present: set[int] = set()
        self.next_seq = 0
        self.batches: list[list[Any]] = []

    def close(self) -> None:
        self.sub.close(0)

    def apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (from a replay): delivery is at least once
        assert seq == self.next_seq, f"sequence gap: got {seq}, expected {self.next_seq}"
        self.next_seq = seq + 1
        batch = msgspec.msgpack.decode(payload)
        # EventBatch, array_like: [ts, events] (data_parallel_rank omitted: default).
        assert isinstance(batch, list) and len(batch) == 2, batch
        ts, events = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 600
        self.batches.append(events)
        for ev in events:
            tag = ev[0]
            if tag == "BlockStored":
                # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
                assert len(ev) == 7, ev
                _, hashes, parent, tokens, size, lora, medium = ev
                assert size == B and hashes
                assert len(tokens) == (size * len(hashes) if self.tokens else 0), ev
                assert lora is None and medium is None
                assert all(isinstance(h, int) and 0 <= h < 1 << 63 for h in hashes)
                # Chained: the parent was announced (or this is a conversation's first block).
                assert parent is None or parent in self.present or parent in hashes[:0], ev
                self.present.update(hashes)
            elif tag == "BlockRemoved":
                assert len(ev) == 3 and ev[2] is None, ev
                assert set(ev[1]) <= self.present, "removed a block never stored"
                self.present.difference_update(ev[1])
            else:
                assert ev == ["AllBlocksCleared"], ev
                self.present.clear()

    def drain(self, quiet: float = 0.3, timeout: float = 10.0, *, live_only: bool = False) -> None:
        """Apply live messages until none came for `quiet` seconds. `live_only`: never
        replay, so a message lost on the live stream fails `apply` as a gap."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sub.poll(int(quiet * 1000)):
                return
            _topic, raw, payload = self.sub.recv_multipart()
            seq = int.from_bytes(raw, "big")
            if seq > self.next_seq and not live_only:  # joined late: ask the replay socket
                self.catch_up()
            self.apply(seq, payload)
        raise AssertionError("the event stream never went quiet")

    def replay(self, start: int = 0) -> list[tuple[int, bytes]]:
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(replay_endpoint(self.endpoint))
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[tuple[int, bytes]] = []
            while True:
                assert req.poll(5000), "no replay answer"
                _empty, seq, payload = req.recv_multipart()
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            req.close(0)

    def catch_up(self) -> None:
        """Replay from the next expected sequence number (covers PUB/SUB's slow join)."""
        for seq, payload in self.replay(self.next_seq):
            self.apply(seq, payload)


def expected(bank: Bank, salt: str | None = None) -> set[int]:
    """Blocks the bank's stored turns must produce, recomputed from their tokens."""
    store = bank._store
    out: set[int] = set()
    for sess in store.sessions.values():
        for leaf in sess.turns:
            toks = [t for n in path_of(leaf) for t in n.tokens]
            out.update(block_hashes(sess.scope, toks, B))
    return out


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/events"


@pytest.fixture
def wired(endpoint: str) -> Iterator[tuple[Bank, KVEventPublisher, Subscriber]]:
    bank = checked(Bank("ns", 1 << 30))
    pub = attach(bank, endpoint)
    sub = Subscriber(endpoint)
    try:
        yield bank, pub, sub
    finally:
        sub.close()
        pub.close()


def sync(bank: Bank, sub: Subscriber) -> None:
    time.sleep(0.2)  # let the publisher thread send what the bank queued
    sub.catch_up()
    sub.drain(quiet=0.2)
    assert sub.present == expected(bank)


def test_conversation_and_fork(wired: tuple[Bank, KVEventPublisher, Subscriber]) -> None:
    bank, _pub, sub = wired
    turn1 = chain(T1)
    bank.put("s", turn1)
    sync(bank, sub)
    assert len(sub.present) == 2  # 40 tokens: two full blocks; the partial one waits
    turn2 = extend(turn1, T2)
    bank.put("s", turn2)
    sync(bank, sub)
    assert len(sub.present) == 4  # 70 tokens
    # Attaching announces a fresh view: the first event. (The publisher sends what is queued
    # as one batch, so the next turn's events may share the batch when they come at once.)
    assert sub.batches[0][0] == ["AllBlocksCleared"]
    assert [e for batch in sub.batches for e in batch].count(["AllBlocksCleared"]) == 1
    # Turn 2's event continues turn 1's chain and carries the tokens of blocks 2 and 3.
    stored = [e for batch in sub.batches for e in batch if e[0] == "BlockStored"]
    assert stored[-1][2] == stored[0][1][-1]
    assert stored[-1][3] == []  # hashes only: token ids are withheld by default
    assert stored[-1][1] == block_hashes(bank._scope(None), T1 + T2, B)[2:]

    n_batches = len(sub.batches)
    fork = bank.fork("s", turn=0)  # shares turn 1: nothing new is stored
    sync(bank, sub)
    assert len(sub.batches) == n_batches
    bank.put(fork, extend(turn1, T3))  # 65 tokens: the branch's blocks 2 and 3 are new
    sync(bank, sub)
    assert len(sub.present) == 6
    bank.delete(fork)
    sync(bank, sub)
    assert len(sub.present) == 4


def test_same_tokens_split_differently_share_blocks(
    wired: tuple[Bank, KVEventPublisher, Subscriber],
) -> None:
    bank, _pub, sub = wired
    bank.put("whole", chain(T1 + T2))  # one segment of 70 tokens
    bank.put("split", chain(T1, T2))  # the same tokens as two segments: the same blocks
    sync(bank, sub)
    assert len(sub.present) == 4
    stored = [e for batch in sub.batches for e in batch if e[0] == "BlockStored"]
    assert sum(len(e[1]) for e in stored) == 4  # announced once
    bank.delete("whole")
    sync(bank, sub)
    assert len(sub.present) == 4  # still held through the other split
    bank.delete("split")
    sync(bank, sub)
    assert sub.present == set()


def test_eviction_removes_dropped_blocks(endpoint: str) -> None:
    # RAM only, room for about two conversations: the third evicts (drops) the LRU one.
    bank = checked(Bank("ns", 150 * SEG_BYTES_PER_ROW))
    pub = attach(bank, endpoint)
    sub = Subscriber(endpoint)
    try:
        for i, sid in enumerate(("a", "b", "c")):
            bank.put(sid, chain([t + 10_000 * i for t in T1 + T2]))
            sync(bank, sub)
        assert bank.stats().evictions_by_reason, "the test meant to evict"
        removed = [e for batch in sub.batches for e in batch if e[0] == "BlockRemoved"]
        assert removed, "an eviction that dropped rows must remove their blocks"
        assert [s.id for s in bank.list_sessions()] == ["c", "b"]
    finally:
        sub.close()
        pub.close()


def test_restart_reannounces_the_ssd_tier(tmp_path: Path, endpoint: str) -> None:
    def open_bank() -> Bank:
        cold = ColdTier(tmp_path / "bank", max_disk_bytes=1 << 30, min_free_disk_bytes=0)
        return Bank("ns", 1 << 30, cold=cold)

    bank = open_bank()
    pub = attach(bank, endpoint)
    sub = Subscriber(endpoint)
    try:
        bank.put("s", extend(chain(T1), T2))
        bank.put("t", chain(T3 + T1))
        assert bank.flush()
        sync(bank, sub)
        before = set(sub.present)
        assert len(before) == 4 + 4
        bank.close()  # shutdown: the replica announces it serves nothing
        time.sleep(0.2)
        sub.catch_up()
        sub.drain(quiet=0.2)
        assert sub.present == set()
    finally:
        sub.close()
        pub.close()

    again = open_bank()  # a new process: same blocks, same hashes, from the SSD tier
    pub2 = attach(again, endpoint)
    sub2 = Subscriber(endpoint)
    try:
        sync(again, sub2)
        assert sub2.batches[0][0] == ["AllBlocksCleared"]
        assert sub2.present == before
        # A restored conversation continues the same chain.
        r = again.lookup(T1 + T2 + [7], session_id="s")
        assert r.reused_tokens == len(T1 + T2) and r.tier == "ssd"
        again.put("s", extend(Snapshot(r.snapshot.segments), T3))
        sync(again, sub2)
        assert len(sub2.present) == len(before) + 1  # 95 tokens: block 4 completes
    finally:
        again.close()
        sub2.close()
        pub2.close()


def test_replay_by_sequence_number(wired: tuple[Bank, KVEventPublisher, Subscriber]) -> None:
    bank, _pub, sub = wired
    bank.put("s", chain(T1))
    time.sleep(0.3)  # the publisher batches what is queued at once: two batches here
    bank.put("s", extend(chain(T1), T2))
    time.sleep(0.3)
    everything = sub.replay(0)
    assert [s for s, _ in everything] == list(range(len(everything))) and len(everything) >= 2
    tail = sub.replay(1)
    assert tail == everything[1:]
    assert sub.replay(10_000) == []  # nothing buffered past the end: only the end marker


def free_port_pair() -> int:
    """A loopback port P with P + 1 free too (the PUB and the replay socket)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def ints_in(obj: Any) -> set[int]:
    if isinstance(obj, bool):
        return set()
    if isinstance(obj, int):
        return {obj}
    if isinstance(obj, list):
        return set().union(*(ints_in(o) for o in obj)) if obj else set()
    return set()


def test_no_token_ids_leave_by_default_live_or_replayed(
    wired: tuple[Bank, KVEventPublisher, Subscriber],
) -> None:
    # Two tenants' prompts (their bank salts, as the HTTP layer derives them); the
    # subscriber holds no key. Token ids 1000.. never equal block_size (16) or a 63-bit hash.
    bank, _pub, sub = wired
    bank.put("a", extend(chain(T1), T2), salt=bank_salt("acme", None))
    bank.put("b", chain(T3 + T1), salt=bank_salt("globex", "x"))
    time.sleep(0.2)
    sub.drain(quiet=0.2)  # Subscriber(tokens=False) asserts token_ids == [] per event
    assert len(sub.present) == 4 + 4
    prompt_tokens = set(T1 + T2 + T3)
    replayed = sub.replay(0)
    assert replayed and len(replayed) == sub.next_seq
    for _seq, payload in replayed:
        events = msgspec.msgpack.decode(payload)[1]
        for ev in events:
            if ev[0] == "BlockStored":
                assert ev[3] == []
        assert not ints_in(events) & prompt_tokens  # nothing of any tenant's prompt


def test_token_ids_when_asked(endpoint: str) -> None:
    bank = checked(Bank("ns", 1 << 30))
    pub = attach(bank, endpoint, token_ids=True)
    sub = Subscriber(endpoint, tokens=True)
    try:
        bank.put("s", extend(chain(T1), T2))
        sync(bank, sub)
        stored = [e for batch in sub.batches for e in batch if e[0] == "BlockStored"]
        assert [t for e in stored for t in e[3]] == (T1 + T2)[: 4 * B]
        replayed = [msgspec.msgpack.decode(p)[1] for _, p in sub.replay(0)]
        assert [e[3] for b in replayed for e in b if e[0] == "BlockStored"] == [e[3] for e in stored]
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize(
    ("endpoint", "remote"),
    [
        ("tcp://*:5557", ("tcp://*:5557", "tcp://*:5558")),
        ("tcp://[::]:5557", ("tcp://[::]:5557", "tcp://[::]:5558")),
        ("tcp://[::1]:5557", ()),
        ("tcp://127.0.0.1:5557", ()),  # connects; the replay socket binds loopback
        ("tcp://localhost:5557", ()),
        ("tcp://10.1.2.3:5557", ("tcp://10.1.2.3:5558",)),  # replay bound on that address
        ("ipc:///run/segserve/events", ()),
        ("inproc://events", ()),
    ],
)
def test_what_listens_beyond_loopback(endpoint: str, remote: tuple[str, ...]) -> None:
    assert exposed(endpoint) == remote
    why = exposure_error(endpoint, tenants=True, allow_remote=False, token_ids=False)
    assert (why is None) == (not remote)
    if why is not None:
        assert "--kv-events-allow-remote" in why and "block hashes" in why
        assert "token ids" not in why
    assert exposure_error(endpoint, tenants=True, allow_remote=True, token_ids=True) is None
    assert exposure_error(endpoint, tenants=False, allow_remote=False, token_ids=True) is None


def test_malformed_endpoint_is_an_error() -> None:
    for bad in ("tcp://*", "tcp://:x", "udp://*:5557"):
        with pytest.raises(ValueError, match="expected"):
            exposed(bad)


def _preflight(tmp_path: Path, keys: str, **cli: str) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(keys)
    settings = load_settings(
        {"api_key_file": str(key_file), "bank_dir": "none", "port": "0", **cli}, environ={}
    )
    preflight(settings, lambda name: "--" + name.replace("_", "-")).sock.close()


def test_tenants_refuse_a_remote_bind_unless_allowed(tmp_path: Path) -> None:
    tenants = "acme key-acme-1\nglobex key-globex-1\n"
    with pytest.raises(PreflightError) as err:
        _preflight(tmp_path, tenants, kv_events_endpoint="tcp://*:5557")
    msg = str(err.value)
    assert msg.startswith("--kv-events-endpoint: ") and "tcp://*:5557, tcp://*:5558" in msg
    with pytest.raises(PreflightError, match="token ids"):
        _preflight(tmp_path, tenants, kv_events_endpoint="tcp://*:5557", kv_events_token_ids="1")
    _preflight(tmp_path, tenants, kv_events_endpoint="tcp://*:5557", kv_events_allow_remote="true")
    _preflight(tmp_path, tenants, kv_events_endpoint=f"ipc://{tmp_path}/ev")
    _preflight(tmp_path, tenants, kv_events_endpoint="tcp://127.0.0.1:5557")
    _preflight(tmp_path, "key-only-one\n", kv_events_endpoint="tcp://*:5557")  # no tenants
    with pytest.raises(PreflightError, match="^--kv-events-endpoint: .*expected"):
        _preflight(tmp_path, tenants, kv_events_endpoint="tcp://*")


def test_cli_exits_2_naming_the_flag(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("acme key-acme-1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    env["SEGSERVE_KV_EVENTS_ENDPOINT"] = "tcp://*:5557"
    r = subprocess.run(
        [sys.executable, "-m", "segserve.server.cli", "serve", "--api-key-file", str(tmp_path / "keys"),
         "--bank-dir", "none", "--port", str(free_port())],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("segserve: SEGSERVE_KV_EVENTS_ENDPOINT: would"), r.stderr


def test_remote_bind_without_tenants_warns_what_it_exposes(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    for token_ids, allow, level, says in (
        (False, False, logging.WARNING, "block hashes, which reveal only"),
        (True, False, logging.WARNING, "token ids (the prompt text)"),
        (False, True, logging.INFO, "block hashes"),
    ):
        caplog.clear()
        port = free_port_pair()  # a fresh pair: ZeroMQ unbinds a closed socket later
        bank = Bank("ns", 1 << 20)
        with caplog.at_level(logging.INFO, logger="segserve"):
            pub = attach(bank, f"tcp://*:{port}", token_ids=token_ids, allow_remote=allow)
        pub.close()
        notes = [r for r in caplog.records if "beyond loopback" in r.getMessage()]
        assert len(notes) == 1 and notes[0].levelno == level and says in notes[0].getMessage()
        assert f"tcp://*:{port}, tcp://*:{port + 1}" in notes[0].getMessage()
    caplog.clear()
    bank = Bank("ns", 1 << 20)
    with caplog.at_level(logging.INFO, logger="segserve"):
        attach(bank, f"ipc://{tmp_path}/events").close()
    assert not [r for r in caplog.records if "beyond loopback" in r.getMessage()]


def test_connecting_publisher_loses_no_first_events() -> None:
    # The router binds; the server connects. ZeroMQ drops what a PUB sends before the
    # subscription arrives, and a bound SUB sends it only once polled: the publisher holds.
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    sub = Subscriber(endpoint, bind=True)
    bank = checked(Bank("ns", 1 << 30))
    pub = attach(bank, endpoint)  # AllBlocksCleared at once
    try:
        bank.put("s", chain(T1))  # and the first turn right away
        bank.put("t", chain(T3))
        sub.drain(quiet=0.5, live_only=True)
        # first the fresh view, then both turns (one batch or several: what was queued at once)
        assert sub.batches[0][0] == ["AllBlocksCleared"] and sub.next_seq >= 1
        assert sub.present == expected(bank) and len(sub.present) == 3
        bank.put("s", extend(chain(T1), T2))  # and later ones, live
        sub.drain(quiet=0.5, live_only=True)
        assert sub.present == expected(bank) and len(sub.present) == 5
    finally:
        sub.close()
        pub.close()


@pytest.mark.slow
def test_server_sends_a_finished_turn_without_another_request(tmp_path: Path) -> None:
    """Connect mode against a real server: the subscriber sees seq 0 on and the turn's
    blocks while no other request comes; no event carries a token id."""
    model = write_tiny_model_dir(tmp_path / "model")
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    sub = Subscriber(endpoint, bind=True)
    srv = ServerProcess(tmp_path / "server.log", "--model", str(model), "--bank-dir", "none",
                        "--kv-events-endpoint", endpoint)
    try:
        srv.wait_healthy(180)
        sub.drain(quiet=0.5, live_only=True)
        assert sub.batches == [[["AllBlocksCleared"]]] and not sub.present
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            r = c.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 8,
                "messages": [{"role": "user", "content": "The secret plan of tenant A. " * 8}]})
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
        # No further request: the turn's blocks arrive on their own (the bank stores the
        # prompt's rows and the generated ones).
        deadline = time.monotonic() + 10
        while len(sub.present) < prompt // B and time.monotonic() < deadline:
            sub.drain(quiet=0.2, timeout=10, live_only=True)
        assert len(sub.present) >= prompt // B >= 4, (prompt, sub.batches)
    finally:
        srv.kill()
        sub.close()


@pytest.mark.slow
def test_server_publishes_and_reannounces_after_restart(tmp_path: Path) -> None:
    model = write_tiny_model_dir(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/server-events"
    args = ("--model", str(model), "--bank-dir", str(tmp_path / "bank"),
            "--kv-events-endpoint", endpoint)

    def run_turns(srv: ServerProcess, turns: int) -> None:
        history: list[dict[str, Any]] = [
            {"role": "user", "content": "Tell me a long story about segments and banks. " * 4}]
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            for _ in range(turns):
                r = c.post("/v1/chat/completions", headers={"X-Session-Id": "ev"},
                           json={"model": "default", "messages": history, "max_tokens": 8})
                assert r.status_code == 200, r.text
                history += [r.json()["choices"][0]["message"],
                            {"role": "user", "content": "go on, in more detail please"}]

    srv = ServerProcess(tmp_path / "server1.log", *args)
    sub = Subscriber(endpoint)
    try:
        srv.wait_healthy(180)
        run_turns(srv, 2)
        time.sleep(0.5)
        sub.catch_up()
        sub.drain()
        first_run = set(sub.present)
        assert len(first_run) >= 4, sub.batches
        stored = [e for batch in sub.batches for e in batch if e[0] == "BlockStored"]
        chain_hashes = [h for e in stored for h in e[1]]
        assert len(chain_hashes) == len(set(chain_hashes))
        srv.proc.terminate()  # graceful: flushes the bank, announces AllBlocksCleared
        assert srv.wait_exit(60) == 0, srv.log()
        sub.drain()
        assert sub.batches[-1][-1] == ["AllBlocksCleared"] and sub.present == set()
    finally:
        srv.kill()
        sub.close()

    srv2 = ServerProcess(tmp_path / "server2.log", *args)
    sub2 = Subscriber(endpoint)
    try:
        srv2.wait_healthy(180)
        time.sleep(0.5)
        sub2.catch_up()
        sub2.drain()
        assert sub2.present == first_run, "a restart re-announces the SSD tier's blocks"
    finally:
        srv2.kill()
        sub2.close()
