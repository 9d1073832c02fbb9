"""The shared SSD tier: several banks (replicas) on one ROOT, model-free.

Two `Bank`s on one shared ROOT stand for two replicas: B restores what A wrote (A gone),
racing writers of one block, a corrupt shared block (quarantined, re-prefill from there),
tenant scopes, chain entries that name other tokens, and the sweeper (never a named file,
never a fresh one). Rows are checked bit for bit (`assert_rows_match`).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

import segserve.bank.shared
from segserve.bank import Bank, BankError
from segserve.bank.blocks import HEADER, aligned_chain
from segserve.bank.shared import SharedLayout, publish, read_entry
from segserve.bank.shared_tier import SharedColdTier
from segserve.bank.sweep import SweepResult, sweep
from segserve.config.settings import SettingsError, load_settings
from segserve.kv.segment import namespace_digest
from tests.bank_fakes import assert_rows_match, chain, checked, extend

B = 8  # rows per aligned block in these tests
T1 = list(range(100, 120))  # 20 rows: full blocks [0,8) [8,16), partial [16,20)
T2 = list(range(200, 206))  # rows 20..26: completes block [16,24)
T3 = list(range(300, 303))
PROMPT = T1 + T2 + T3  # 29 tokens: 3 full blocks (24 rows) + 5


def replica(root: Path, name: str, max_bytes: int = 1 << 30, **kw: float) -> Bank:
    cold = SharedColdTier(
        root, replica=name, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=B,
        gc_grace_s=kw.pop("gc_grace_s", 600.0), gc_interval_s=kw.pop("gc_interval_s", 3600.0),
    )
    return checked(Bank("ns", max_bytes, cold=cold))


def files(root: Path, kind: str) -> list[Path]:
    ext = {"blocks": "blk", "chains": "chn"}[kind]
    return sorted((root / kind).glob(f"*/*.{ext}"))


def write_conversation(root: Path, name: str = "a", salt: str | None = None) -> None:
    a = replica(root, name)
    a.put("conv", chain(T1, T2), salt=salt)
    assert a.flush()
    a.close()  # what A committed is on disk; A is gone


def age(paths: list[Path], seconds: float) -> None:
    past = time.time() - seconds
    for p in paths:
        os.utime(p, (past, past))


def test_b_restores_what_a_wrote(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    assert len(files(tmp_path, "chains")) == 3  # one per full aligned block
    b = replica(tmp_path, "b")
    r = b.lookup(PROMPT, session_id="conv")  # B never saw the session: a prefix restore
    assert (r.kind, r.tier, r.reused_tokens, r.restore_rows_from_ssd) == ("prefix", "ssd", 24, 24)
    assert_rows_match(r.snapshot, PROMPT)
    assert b.stats().restores_by_tier["shared"] == 1
    # The engine prefills the rest and stores the turn: B now names those blocks itself.
    b.pin(r.snapshot)
    b.put("conv", extend(r.snapshot, PROMPT[24:]))
    b.unpin(r.snapshot)
    assert b.flush()
    again = b.lookup([*PROMPT, 1, 2], session_id="conv")
    assert (again.kind, again.tier, again.reused_tokens) == ("session", "ram", 29)
    b.close()


def test_a_longer_shared_prefix_extends_a_shorter_local_hit(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    b = replica(tmp_path, "b")
    b.put("mine", chain(T1[:12]))  # B holds 12 rows of its own, in RAM
    r = b.lookup(PROMPT)
    assert (r.tier, r.reused_tokens, r.restore_rows_from_ssd) == ("ssd", 24, 12)
    assert [s.rows for s in r.snapshot.segments] == [12, 12]  # local rows, then shared ones
    assert_rows_match(r.snapshot, PROMPT)
    # A prompt the shared tier cannot beat stays a plain local hit (no shared read).
    local = b.lookup(T1[:12] + [7])
    assert (local.tier, local.reused_tokens) == ("ram", 12)
    assert b.stats().restores_by_tier["shared"] == 1
    b.close()


def test_the_cap_keeps_the_last_token_to_run(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    b = replica(tmp_path, "b")
    r = b.lookup(T1 + T2[:4])  # exactly 3 full blocks: the last token must still run
    assert r.reused_tokens == 23
    assert_rows_match(r.snapshot, T1 + T2[:4])
    b.close()


def test_racing_writers_publish_each_block_once(tmp_path: Path) -> None:
    banks = [replica(tmp_path, f"r{i}") for i in range(4)]
    snap = chain(T1, T2)
    for i, bk in enumerate(banks):
        bk.put(f"s{i}", snap)  # four writer threads race for the same block ids
    assert all(bk.flush() for bk in banks)
    blocks = files(tmp_path, "blocks")
    assert len(blocks) == 5  # chunks [0,8) [8,16) [16,20) | [20,24) [24,26): once each
    assert not list((tmp_path / "tmp").iterdir())  # every temp file was linked or removed
    st = [bk.stats() for bk in banks]
    assert all(s.spill_failures == 0 and s.disk_faults["write_failed"] == 0 for s in st)
    for bk in banks:
        bk.close()
    c = replica(tmp_path, "c")
    r = c.lookup(PROMPT)
    assert r.reused_tokens == 24
    assert_rows_match(r.snapshot, PROMPT)
    c.close()


def test_publish_races_have_one_winner_and_keep_its_bytes(tmp_path: Path) -> None:
    layout = SharedLayout(tmp_path, "x")
    layout.make_dirs()
    dest = tmp_path / "blocks" / "ab" / "abc.blk"
    won: list[bool] = []
    start = threading.Barrier(8)

    def race(i: int) -> None:
        start.wait()
        won.append(publish(layout, dest, bytes([i]) * 4096))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]
    data = dest.read_bytes()
    assert len(data) == 4096 and len(set(data)) == 1  # one writer's bytes, whole
    assert not list(layout.tmp_dir.iterdir())


def test_a_writer_adopts_the_winner_s_block_and_replaces_a_malformed_one(tmp_path: Path) -> None:
    write_conversation(tmp_path, "a")
    blocks = files(tmp_path, "blocks")
    # Same shape, other bits (another prefill's rounding): adopted as it is.
    same_shape = blocks[0].read_bytes()
    blocks[0].unlink()
    blocks[0].write_bytes(same_shape[: HEADER.size] + bytes(len(same_shape) - HEADER.size))
    # Wrong size: malformed, moved aside, this writer's bytes published instead.
    blocks[1].write_bytes(b"junk")
    b = replica(tmp_path, "b")
    b.put("conv", chain(T1, T2))
    assert b.flush()
    assert blocks[0].read_bytes()[HEADER.size :] == bytes(len(same_shape) - HEADER.size)
    assert blocks[1].stat().st_size > HEADER.size
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    b.release(1 << 30)  # B's rows go to SSD: a restore reads the blocks B named
    r = b.lookup(PROMPT, session_id="conv")
    assert r.reused_tokens == 26 and r.tier == "ssd"
    b.close()


def test_a_corrupt_shared_block_is_quarantined_and_the_rest_re_prefilled(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    layout = SharedLayout(tmp_path, "b")
    scope_chain = _chain_for(PROMPT)
    second = read_entry(layout, scope_chain[2])
    assert second is not None
    bad = tmp_path / "blocks" / second.chunks[0].block_id[:2] / f"{second.chunks[0].block_id}.blk"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    b = replica(tmp_path, "b")
    r = b.lookup(PROMPT)
    assert r.reused_tokens == 8  # block 0 only: the engine re-prefills from row 8
    assert r.degraded is not None and "checksum" in r.degraded
    assert_rows_match(r.snapshot, PROMPT)
    st = b.stats()
    assert st.quarantined_blocks == 1 and st.disk_faults["block_quarantined"] == 1
    assert not bad.exists() and not layout.chain_path(scope_chain[2]).exists()
    # Later lookups stop before the bad block; nothing wrong is ever served.
    assert b.lookup(PROMPT).reused_tokens == 8
    b.close()


def test_a_corrupt_first_block_is_a_miss(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    first = read_entry(SharedLayout(tmp_path, "b"), _chain_for(PROMPT)[1])
    assert first is not None
    cid = first.chunks[0].block_id
    (tmp_path / "blocks" / cid[:2] / f"{cid}.blk").write_bytes(b"x" * 40)
    b = replica(tmp_path, "b")
    r = b.lookup(PROMPT)
    assert (r.kind, r.reused_tokens) == ("miss", 0)
    assert b.stats().quarantined_blocks == 1
    b.close()


def test_tenant_scopes_stay_apart(tmp_path: Path) -> None:
    write_conversation(tmp_path, salt="tenant-1")
    b = replica(tmp_path, "b")
    assert b.lookup(PROMPT, salt="tenant-2").kind == "miss"
    assert b.lookup(PROMPT).kind == "miss"  # no salt is a tenant of its own
    r = b.lookup(PROMPT, salt="tenant-1")
    assert r.reused_tokens == 24
    assert_rows_match(r.snapshot, PROMPT)
    b.close()


def test_a_chain_entry_naming_other_tokens_never_restores(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    layout = SharedLayout(tmp_path, "b")
    other = [9] * 8 + PROMPT[8:]
    mine, theirs = _chain_for(PROMPT), _chain_for(other)
    entry = read_entry(layout, mine[1])
    assert entry is not None and entry.tokens == tuple(PROMPT[:8])
    # A's entry for block 0 under the other prompt's name, claiming its digests: only the
    # tokens still differ, and they decide.
    forged = replace(entry, digest=theirs[1], parent=theirs[0])
    dst = layout.chain_path(theirs[1])
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(forged.encode())
    b = replica(tmp_path, "b")
    assert b.lookup(other).kind == "miss"
    dst.write_bytes(forged.encode().replace(b'"format":1', b'"format":2'))
    assert b.lookup(other).kind == "miss"
    dst.write_bytes(b"{not json")  # and an unreadable entry is a gap, not an error
    assert b.lookup(other).kind == "miss"
    b.close()


def test_start_up_never_deletes_shared_files(tmp_path: Path) -> None:
    write_conversation(tmp_path)
    layout = SharedLayout(tmp_path, "b")
    stray = tmp_path / "blocks" / "ff" / ("f" * 32 + ".blk")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"another replica's write, not committed yet")
    theirs = layout.tmp_dir / "x.blk~a~1-1.tmp"
    mine = layout.tmp_dir / "x.blk~b~1-1.tmp"
    theirs.write_bytes(b"a")
    mine.write_bytes(b"b")
    before = files(tmp_path, "blocks") + files(tmp_path, "chains")
    b = replica(tmp_path, "b")
    assert stray.exists() and theirs.exists() and not mine.exists()
    assert set(before) <= set(files(tmp_path, "blocks") + files(tmp_path, "chains"))
    b.close()


def test_one_replica_id_is_one_process(tmp_path: Path) -> None:
    a = replica(tmp_path, "a")
    with pytest.raises(BankError, match="in use"):
        replica(tmp_path, "a")
    b = replica(tmp_path, "b")  # another id on the same ROOT is fine
    a.close()
    b.close()


def test_the_sweeper_keeps_named_and_fresh_files(tmp_path: Path) -> None:
    write_conversation(tmp_path, "a")
    layout = SharedLayout(tmp_path, "gc")
    layout.make_dirs()
    named = files(tmp_path, "blocks") + files(tmp_path, "chains")
    age(named, 3600)
    assert sweep(layout, grace_s=60) == SweepResult()  # everything is named: nothing to do
    assert files(tmp_path, "blocks") + files(tmp_path, "chains") == named
    # A drops the conversation: its manifest no longer names the blocks. Its files stay
    # (start-up and drops never delete shared files) until they are old enough.
    a = replica(tmp_path, "a")
    a.delete("conv")
    assert a.flush()
    assert sweep(layout, grace_s=86400).blocks_deleted == 0  # fresh enough: kept
    got = sweep(layout, grace_s=60)
    assert (got.blocks_deleted, got.chains_deleted) == (len(named) - 3, 3)
    assert files(tmp_path, "blocks") == files(tmp_path, "chains") == []
    a.close()


def test_the_sweeper_keeps_what_another_manifest_still_names(tmp_path: Path) -> None:
    write_conversation(tmp_path, "a")
    b = replica(tmp_path, "b")
    r = b.lookup(PROMPT)
    b.put("kept", extend(r.snapshot, PROMPT[24:]))  # B adopts A's blocks
    assert b.flush()
    a = replica(tmp_path, "a")
    a.delete("conv")
    assert a.flush()
    a.close()
    all_files = files(tmp_path, "blocks") + files(tmp_path, "chains")
    age(all_files, 3600)
    got = sweep(SharedLayout(tmp_path, "b"), grace_s=60)
    # B stored block 2 as other chunks than A did (its segment starts at row 0): A's
    # chunks and the entry naming them go; blocks 0 and 1 are B's too and stay findable.
    assert got.skipped is None and (got.blocks_deleted, got.chains_deleted) == (3, 1)
    c = replica(tmp_path, "c")
    assert c.lookup(PROMPT).reused_tokens == 16
    c.close()
    # What remains is exactly what B names; B still restores it after losing its RAM.
    b.release(1 << 30)
    again = b.lookup(PROMPT, session_id="kept")
    assert again.reused_tokens == 28
    assert_rows_match(again.snapshot, PROMPT)
    b.close()


def test_an_unreadable_manifest_stops_the_sweep(tmp_path: Path) -> None:
    write_conversation(tmp_path, "a")
    stale = tmp_path / "replicas" / "old"
    stale.mkdir()
    (stale / "manifest.sqlite3").write_bytes(b"not a database" * 100)
    age(files(tmp_path, "blocks"), 3600)
    (tmp_path / "replicas" / "a" / "manifest.sqlite3").rename(tmp_path / "moved")
    got = sweep(SharedLayout(tmp_path, "gc"), grace_s=60)
    assert got.skipped is not None and got.blocks_deleted == 0
    assert files(tmp_path, "blocks")


def test_sweeps_run_on_the_writer_thread_when_due(tmp_path: Path) -> None:
    write_conversation(tmp_path, "a")
    a = replica(tmp_path, "a", gc_interval_s=0.0, gc_grace_s=60.0)
    a.delete("conv")
    assert a.flush()
    age(files(tmp_path, "blocks") + files(tmp_path, "chains"), 3600)
    a.stats()  # a public call polls: the due sweep is queued
    assert a.flush()
    assert files(tmp_path, "blocks") == []
    a.close()


def test_settings_for_a_shared_tier(tmp_path: Path) -> None:
    s = load_settings({"bank_dir": str(tmp_path), "port": "8123"}, {"SEGSERVE_BANK_SHARED": "1"})
    rid = s.bank_replica()
    assert s.bank_shared and rid is not None and rid.endswith("-8123")
    other = load_settings({"bank_dir": str(tmp_path), "port": "8124", "bank_shared": "true"}, {})
    assert other.bank_replica() != rid  # two replicas on one machine never collide
    named = load_settings({"bank_shared": "1", "bank_replica_id": "r-1"}, {})
    assert named.bank_replica() == "r-1"
    assert load_settings({}, {}).bank_replica() is None
    with pytest.raises(SettingsError, match="SEGSERVE_BANK_SHARED"):
        load_settings({}, {"SEGSERVE_BANK_SHARED": "yes"})
    with pytest.raises(SettingsError, match="--bank-replica-id"):
        load_settings({"bank_replica_id": "../x"}, {})
    with pytest.raises(SettingsError, match="--bank-shared"):
        load_settings({"bank_shared": "1", "bank_dir": "none"}, {})


def _chain_for(tokens: list[int], salt: str = "") -> list[str]:
    """A_0..A_k of `tokens` in the scope `Bank("ns", ...)` gives `salt` (as segserve.bank.bank does)."""
    from segserve.bank.blocks import FORMAT_VERSION

    ns = namespace_digest("segserve.bank", str(FORMAT_VERSION), "ns")
    return aligned_chain(namespace_digest(ns, "salt", salt), tokens, B)


def test_a_full_disk_loses_nothing_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = replica(tmp_path, "a")
    a.put("kept", chain(T1, T2))
    assert a.flush()
    before = files(tmp_path, "blocks") + files(tmp_path, "chains")

    def full(layout: SharedLayout, dest: Path, data: bytes) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segserve.bank.shared, "publish", full)
    a.put("lost", chain([7] * 30))
    assert a.flush()
    st = a.stats()
    assert st.spill_failures == 1 and st.disk_faults["write_failed"] == 1
    assert files(tmp_path, "blocks") + files(tmp_path, "chains") == before
    assert not list((tmp_path / "tmp").iterdir())
    monkeypatch.undo()
    b = replica(tmp_path, "b")
    r = b.lookup(PROMPT)
    assert r.reused_tokens == 24
    assert_rows_match(r.snapshot, PROMPT)
    b.close()
    a.close()


def test_a_shared_and_a_private_directory_are_never_mixed(tmp_path: Path) -> None:
    write_conversation(tmp_path / "shared")
    blocks = files(tmp_path / "shared", "blocks")
    with pytest.raises(BankError, match="shared SSD tier"):
        Bank.open("ns", 1 << 20, tmp_path / "shared", min_free_disk_bytes=0)
    assert files(tmp_path / "shared", "blocks") == blocks  # nothing moved aside
    private = Bank.open("ns", 1 << 20, tmp_path / "private", min_free_disk_bytes=0)
    private.close()
    with pytest.raises(BankError, match="private bank"):
        Bank.open("ns", 1 << 20, tmp_path / "private", min_free_disk_bytes=0,
                  shared_replica="a")
