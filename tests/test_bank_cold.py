"""Session bank with the SSD cold tier: round trips, restart, corruption, full disk, dedupe."""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import segserve.bank.writer
from segserve.bank import Bank, BankError, ColdTier
from segserve.bank.blocks import (
    HEADER,
    chunk_payload,
    decode_block,
    encode_block,
    layout_of,
    plan_chunks,
)
from tests.bank_fakes import assert_rows_match, chain, checked, extend, fake_segment, merge_tail

ROW = 2 * 2 * 2 * 8 * 2  # bytes per row: layers * (K+V) * heads * dim * float16


def open_bank(root: Path, max_bytes: int = 1 << 30, **kw: int) -> Bank:
    cold = ColdTier(
        root,
        max_disk_bytes=kw.pop("max_disk_bytes", 1 << 30),
        min_free_disk_bytes=kw.pop("min_free_disk_bytes", 0),
        block_rows=kw.pop("block_rows", 8),
    )
    return checked(Bank("ns", max_bytes, cold=cold))


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*/*.blk"))


def disk_bytes(rows_per_block: list[int]) -> int:
    return sum(HEADER.size + r * ROW for r in rows_per_block)


T1 = list(range(100, 120))  # 20 rows: blocks [0,8) [8,16) [16,20)
T2 = list(range(200, 206))  # rows 20..26: chunks [20,24) [24,26)
T3 = list(range(300, 303))


def test_block_encoding_round_trip_and_chunk_ids() -> None:
    seg = fake_segment(T1, dtype=mx.bfloat16)
    layout = layout_of(seg)
    assert layout is not None and layout.dtype == "bfloat16"
    from segserve.bank.blocks import to_host

    host = to_host(seg, layout)
    data = encode_block(chunk_payload(host, 3, 9), 6)
    back = decode_block(data, layout, 6)
    assert np.array_equal(back.keys[1], host.keys[1][:, :, 3:9, :])
    chunks = plan_chunks("root", T1 + T2, 20, 6, 8)
    assert [c.rows for c in chunks] == [4, 2]
    # The same rows split differently get the same ids where whole blocks are covered.
    whole = plan_chunks("root", T1 + T2, 0, 26, 8)
    assert [c.rows for c in whole] == [8, 8, 8, 2]
    assert whole[-1] == chunks[-1]
    assert plan_chunks("other-ns", T1, 0, 20, 8)[0] != plan_chunks("root", T1, 0, 20, 8)[0]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_host_rows_are_views_that_outlive_the_segment(dtype: mx.Dtype) -> None:
    """`to_host` hands the writer views of the segment's own buffers (no copy): strided
    views of a larger tail buffer (as a seal keeps them) read the segment's rows, and stay
    valid after every MLX reference is gone and the memory is reused."""
    from segserve.bank.blocks import to_host
    from segserve.kv.segment import Segment

    rows, cap = len(T1), len(T1) + 12
    bufs = [mx.random.normal((1, 2, cap, 8), key=mx.random.key(i)).astype(dtype) for i in range(4)]
    seg = Segment.seal([b[:, :, :rows, :] for b in bufs[:2]], [b[:, :, :rows, :] for b in bufs[2:]], T1, "root")
    layout = layout_of(seg)
    assert layout is not None
    udt = {mx.float16: np.uint16, mx.bfloat16: np.uint16, mx.float32: np.uint32}[dtype]
    want = [np.array(b[:, :, :rows, :].view(mx.uint16 if udt is np.uint16 else mx.uint32)) for b in bufs]
    host = to_host(seg, layout)
    got = [*host.keys, *host.values]
    assert all(not h.flags["OWNDATA"] for h in got)  # views, not copies
    del seg, bufs
    junk = [mx.random.normal((1, 2, cap, 8)).astype(dtype) for _ in range(64)]
    mx.eval(junk)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == udt and np.array_equal(g, w)
    payload = chunk_payload(host, 2, 9)  # what the writer reads: rows 2..8 of every layer
    assert payload == b"".join(np.ascontiguousarray(w[:, :, 2:9, :]).tobytes() for w in (want[0], want[2], want[1], want[3]))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_ram_ssd_ram_round_trip_is_bit_identical(tmp_path: Path, dtype: mx.Dtype) -> None:
    b = open_bank(tmp_path)
    snap = chain(T1, T2, dtype=dtype)
    b.put("s", snap)
    assert b.flush()
    assert b.release(1 << 30) == snap.nbytes  # everything spilled
    st = b.stats()
    assert st.bytes_by_tier["ram"] == 0 and st.evictions_by_reason == {"spilled": 2}
    assert b.info("s").tier == "ssd"
    r = b.lookup(T1 + T2 + T3, session_id="s")
    assert (r.kind, r.tier, r.reused_tokens, r.restore_rows_from_ssd) == ("session", "ssd", 26, 26)
    for got, want in zip(r.snapshot.segments, snap.segments, strict=True):
        assert got.digest == want.digest and got.keys[0].dtype == dtype
        for a, c in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
            assert np.array_equal(np.array(a.view(mx.uint8)), np.array(c.view(mx.uint8)))
    assert b.stats().restores_by_tier == {"ssd": 2, "pending": 0}
    b.check_invariants()
    b.close()


def test_restore_from_the_write_queue_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = segserve.bank.writer.write_file_durably

    def slow(path: Path, data: bytes) -> None:
        gate.wait(5)
        real(path, data)

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", slow)
    b = open_bank(tmp_path)
    b.put("s", chain(T1))
    b.release(1 << 30)  # RAM copy dropped while the write is still queued
    r = b.lookup(T1 + [1], session_id="s")
    assert r.reused_tokens == 20 and b.stats().restores_by_tier["pending"] == 1
    assert_rows_match(r.snapshot, T1)
    gate.set()
    assert b.flush()
    b.check_invariants()
    b.close()


def test_restart_keeps_sessions(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    s1 = chain(T1)
    b.put("a", s1)
    b.put("a", extend(s1, T2))
    b.fork("a", 0, new_id="f")
    b.put("t", chain(T3), salt="tenant")
    assert b.close() == 0
    b2 = open_bank(tmp_path)
    assert {i.id: (i.turns, i.tokens, i.tier) for i in b2.list_sessions()} == {
        "a": (2, 26, "ssd"),
        "f": (1, 20, "ssd"),
    }
    assert [i.id for i in b2.list_sessions(salt="tenant")] == ["t"]
    r = b2.lookup(T1 + T2 + [0], session_id="a")
    assert (r.reused_tokens, r.tier) == (26, "ssd")
    assert_rows_match(r.snapshot, T1 + T2)
    b2.check_invariants()
    b2.close()
    other = Bank(
        "another-model",
        1 << 30,
        cold=ColdTier(tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0),
    )
    assert other.list_sessions() == [] and other.lookup(T1 + [0]).kind == "miss"
    assert other.stats().bytes_by_tier["ssd"] > 0  # the other namespace's blocks still count
    other.close()


def test_one_bank_per_directory(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    with pytest.raises(BankError, match="in use"):
        open_bank(tmp_path)
    b.close()
    open_bank(tmp_path).close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_bad_blocks_are_quarantined_never_served(tmp_path: Path, damage: str) -> None:
    b = open_bank(tmp_path)
    b.put("a", chain(T1))
    b.put("b", chain(T3))
    b.flush()
    b.release(1 << 30)
    victim = block_files(tmp_path)[0]
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    bad_sessions = [
        s for s, t in (("a", T1), ("b", T3)) if b.lookup(t + [0], session_id=s).kind == "miss"
    ]
    assert len(bad_sessions) == 1
    st = b.stats()
    assert st.quarantined_blocks == 1 and "quarantined" in (st.last_fault or "")
    assert st.evictions_by_reason["dropped: ssd block corrupt"] == 1
    assert [i.id for i in b.list_sessions()] == [s for s in ("a", "b") if s not in bad_sessions]
    if damage != "delete":
        assert len(list((tmp_path / "quarantine").iterdir())) == 1
    b.check_invariants()
    b.close()
    b2 = open_bank(tmp_path)  # the dropped entry stays dropped; the other one restores
    assert [i.id for i in b2.list_sessions()] == [s for s in ("a", "b") if s not in bad_sessions]
    b2.check_invariants()
    b2.close()


def test_free_disk_floor_refuses_spills(tmp_path: Path) -> None:
    b = open_bank(tmp_path, max_bytes=28 * ROW, min_free_disk_bytes=1 << 62)
    s = chain(T1)
    b.put("a", s)
    st = b.stats()
    assert (st.spills, st.spills_refused, st.bytes_by_tier["ssd"]) == (0, 1, 0)
    assert b.info("a").tier == "ram"  # kept in RAM
    b.put("b", chain(T2))
    b.put("c", chain(T3))  # over the RAM cap: the LRU entry is dropped, with a reason
    st = b.stats()
    assert st.evictions_by_reason == {"dropped: disk floor": 1}
    assert [i.id for i in b.list_sessions()] == ["c", "b"]
    assert block_files(tmp_path) == []
    b.check_invariants()
    b.close()


def test_enospc_loses_nothing_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = open_bank(tmp_path)
    b.put("old", chain(T1))
    b.flush()
    committed = block_files(tmp_path)

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", full)
    b.put("new", chain(T2, T3))
    b.flush()
    st = b.stats()
    assert st.spill_failures == 2 and "ENOSPC" in (st.last_fault or "")
    assert b.info("new").tier == "ram"  # the failed write leaves the RAM copy in place
    assert block_files(tmp_path) == committed
    b.check_invariants()
    b.release(1 << 30)  # "new" cannot spill now: dropped; "old" spills (already on disk)
    b.flush()  # "new"'s spill is queued and fails on the writer thread: wait for that verdict
    assert [i.id for i in b.list_sessions()] == ["old"]
    b.check_invariants()
    b.close()
    monkeypatch.undo()
    b2 = open_bank(tmp_path)
    assert [i.id for i in b2.list_sessions()] == ["old"]
    assert_rows_match(b2.lookup(T1 + [0]).snapshot, T1)
    b2.close()


def test_fork_adds_only_new_segments_in_ram_and_on_disk(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    s1 = extend(chain(T1), T2)
    b.put("main", s1)
    b.flush()
    ram0, disk0 = b.ram_bytes(), b.stats().bytes_by_tier["ssd"]
    assert disk0 == disk_bytes([8, 8, 4, 4, 2])
    b.fork("main", new_id="f")
    b.flush()
    assert (b.ram_bytes(), b.stats().bytes_by_tier["ssd"]) == (ram0, disk0)
    b.put("f", extend(s1, T3))
    b.flush()
    assert b.ram_bytes() == ram0 + 3 * ROW
    assert b.stats().bytes_by_tier["ssd"] == disk0 + disk_bytes([3])
    assert len(block_files(tmp_path)) == 6
    b.check_invariants()
    b.close()


def test_shared_rows_are_stored_once(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    split = chain(T1[:5], T1[5:])  # same history as one segment, split differently
    whole = chain(T1)
    b.put("split", split)
    b.put("whole", whole)
    b.put("merged", merge_tail(extend(whole, T2), 2))  # a tiered merge rewrites T1+T2
    b.flush()
    # Distinct chunks: split [0,5) [5,8) [8,16) [16,20); whole adds [0,8); merged adds
    # [16,24) [24,26) ([0,8) and [8,16) are shared).
    assert len(block_files(tmp_path)) == 7
    assert b.stats().bytes_by_tier["ssd"] == disk_bytes([5, 3, 8, 4, 8, 8, 2])
    b.delete("whole")
    b.delete("merged")
    b.flush()
    assert len(block_files(tmp_path)) == 4  # the blocks only they used are gone
    b.check_invariants()
    b.close()


def test_disk_cap_drops_least_recently_used_cold_entries(tmp_path: Path) -> None:
    cap = disk_bytes([8, 8, 4]) + disk_bytes([6])
    b = open_bank(tmp_path, max_bytes=1 << 30, max_disk_bytes=cap)
    b.put("a", chain(T1))
    b.put("b", chain(T2))
    b.flush()
    b.release(1 << 30)  # both cold now
    b.lookup(T1 + [0], session_id="a")
    b.release(1 << 30)
    b.put("c", chain(T3))  # needs room: "b" is the LRU cold leaf
    b.flush()
    assert [i.id for i in b.list_sessions()] == ["c", "a"]
    assert b.stats().evictions_by_reason["dropped: disk cap"] == 1
    assert b.stats().bytes_by_tier["ssd"] <= cap
    b.check_invariants()
    b.close()


def test_format_version_mismatch_is_moved_aside(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    b.put("a", chain(T1))
    b.close()
    db = sqlite3.connect(tmp_path / "manifest.sqlite3")
    db.execute("UPDATE meta SET value='999' WHERE key='format_version'")
    db.commit()
    db.close()
    b2 = open_bank(tmp_path)
    assert b2.list_sessions() == [] and "999" in (b2.stats().last_fault or "")
    assert len(list(tmp_path.glob("stale-format-999-*/blocks/*/*.blk"))) == 3
    b2.close()


def test_startup_removes_temp_and_orphan_files(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    b.put("a", chain(T1))
    b.close()
    d = block_files(tmp_path)[0].parent
    (d / "junk.blk.1.2.tmp").write_bytes(b"partial")
    (d / ("f" * 32 + ".blk")).write_bytes(b"orphan")
    b2 = open_bank(tmp_path)
    assert not list(d.glob("*.tmp")) and not (d / ("f" * 32 + ".blk")).exists()
    assert len(block_files(tmp_path)) == 3
    b2.close()


def test_close_counts_writes_it_could_not_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = segserve.bank.writer.write_file_durably

    def slow(path: Path, data: bytes) -> None:
        time.sleep(0.2)
        real(path, data)

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", slow)
    b = open_bank(tmp_path)
    for i in range(4):
        b.put(f"s{i}", chain([i * 50 + t for t in range(10)]))
    lost = b.close(timeout=0.05)
    assert lost >= 1
    with pytest.raises(BankError):
        b.lookup([1, 2])


def test_startup_drops_rows_no_turn_references(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    b.put("keep", chain(T1))
    b.put("gone", chain(T3))
    b.close()
    db = sqlite3.connect(tmp_path / "manifest.sqlite3")
    db.execute("DELETE FROM turns WHERE session='gone'")  # as if only the turn row survived
    db.commit()
    db.close()
    b2 = open_bank(tmp_path)
    assert [i.id for i in b2.list_sessions()] == ["keep"]
    assert len(block_files(tmp_path)) == 3  # T3's block went with its segment row
    assert b2.stats().bytes_by_tier["ssd"] == disk_bytes([8, 8, 4])
    b2.check_invariants()
    b2.close()


def test_unreadable_manifest_is_moved_aside(tmp_path: Path) -> None:
    b = open_bank(tmp_path)
    b.put("a", chain(T1))
    b.close()
    (tmp_path / "manifest.sqlite3").write_bytes(b"not a database" * 100)
    b2 = open_bank(tmp_path)
    assert b2.list_sessions() == [] and "moved aside" in (b2.stats().last_fault or "")
    assert len(list(tmp_path.glob("stale-unreadable-*/manifest.sqlite3"))) == 1
    b2.put("b", chain(T3))
    b2.close()


def test_restore_stops_where_ram_is_full(tmp_path: Path) -> None:
    b = open_bank(tmp_path, max_bytes=30 * ROW)
    s1 = chain(T1)
    b.put("s", s1)
    b.put("s", extend(s1, T2))
    b.flush()
    b.release(1 << 30)
    hot = chain([7] * 8)
    b.put("hot", hot)
    b.pin(hot)  # 8 rows pinned: T1 (20 rows) fits, T2 (6 more) does not
    r = b.lookup(T1 + T2 + [0], session_id="s")
    assert (r.reused_tokens, r.restore_rows_from_ssd, r.tier) == (20, 20, "ssd")
    assert r.degraded == "ram full: ssd restore skipped"
    assert_rows_match(r.snapshot, T1)
    b.unpin(hot)
    b.check_invariants()
    b.close()


def test_making_room_for_a_restore_never_drops_the_path_being_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = ColdTier(tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=8)
    b = checked(Bank("ns", 26 * ROW, cold=cold))
    b.put("c", extend(chain(T1), T2))  # 26 rows, written through
    b.flush()

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", full)
    b.put("h", chain([7] * 8))  # RAM only (its write fails); pushes "c" out of RAM
    b.flush()
    assert (b.info("c").tier, b.info("h").tier) == ("ssd", "ram")
    cold.max_disk_bytes = b.stats().bytes_by_tier["ssd"]  # the disk is now exactly full
    # Restoring "c" must evict "h", which cannot spill (disk cap); the only cold leaf that
    # could make room is "c"'s own tail, which the restore needs: "h" is dropped instead.
    r = b.lookup(T1 + T2 + [0], session_id="c")
    assert (r.reused_tokens, r.restore_rows_from_ssd) == (26, 26)
    assert_rows_match(r.snapshot, T1 + T2)
    assert b.stats().evictions_by_reason["dropped: disk cap"] == 1
    assert [i.id for i in b.list_sessions()] == ["c"]
    b.check_invariants()
    b.close()
