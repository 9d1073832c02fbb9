"""A full disk loses nothing: disk faults are environment errors, never corruption.

Fault-injected tests (always run) raise SQLITE_FULL / SQLITE_IOERR / ENOSPC where a full
disk raises them; `test_real_full_tmpfs` fills a 2 MiB tmpfs for real (root only). Also:
`writes_pending` on /health is the writer's queue now, not the engine's last publication.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import segserve.bank.cold
import segserve.bank.writer
from segserve.bank import Bank, BankError, ColdTier
from segserve.bank.manifest import Manifest
from segserve.bank.writer import disk_fault
from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from tests.bank_fakes import assert_rows_match, chain, checked
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

T1 = list(range(100, 120))  # 20 rows: 3 blocks of 8
T2 = list(range(200, 230))
T3 = list(range(300, 316))


def _open(root: Path, **kw: int) -> Bank:
    cold = ColdTier(
        root, max_disk_bytes=1 << 30, min_free_disk_bytes=kw.pop("floor", 0), block_rows=8,
        retry_interval_s=0.0,  # retry writing at every bank call: tests need no clock
    )
    return checked(Bank("ns", 1 << 30, cold=cold))


def _sqlite_error(code: int, name: str, text: str) -> sqlite3.OperationalError:
    e = sqlite3.OperationalError(text)
    e.sqlite_errorcode, e.sqlite_errorname = code, name  # what sqlite sets on a real one
    return e


def _full() -> sqlite3.OperationalError:
    return _sqlite_error(13, "SQLITE_FULL", "database or disk is full")


class _FullDiskManifest(Manifest):
    """Opening the file for writing fails as on a full disk; in-memory copies work."""

    def __init__(self, path: Path | sqlite3.Connection) -> None:
        if not isinstance(path, sqlite3.Connection):
            raise _full()
        super().__init__(path)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path (to prove nothing moved), but the lock
    and sqlite's shared-memory index and empty WAL, which a failed open may leave: they
    hold no data (a WAL with frames would be kept and compared)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock" and not p.name.endswith("-shm")
        and not (p.name.endswith("-wal") and p.stat().st_size == 0)
    }


def _stored(root: Path) -> dict[str, bytes]:
    b = _open(root)
    b.put("a", chain(T1))
    b.put("b", chain(T2))
    b.close()
    return _snapshot(root)


def test_disk_fault_names_environment_errors_only() -> None:
    for no in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        assert disk_fault(OSError(no, os.strerror(no))) == errno.errorcode[no]
    assert disk_fault(_full()) == "SQLITE_FULL"
    shm = _sqlite_error(10 | (19 << 8), "SQLITE_IOERR_SHMSIZE", "disk I/O error")
    assert disk_fault(shm) == "SQLITE_IOERR_SHMSIZE"
    # Corruption and other errors are not disk faults: those manifests are moved aside.
    assert disk_fault(_sqlite_error(11, "SQLITE_CORRUPT", "malformed")) is None
    assert disk_fault(sqlite3.DatabaseError("file is not a database")) is None
    assert disk_fault(OSError(errno.ENOENT, "gone")) is None


def test_full_disk_at_start_moves_nothing_and_serves_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = _stored(tmp_path)
    monkeypatch.setattr(segserve.bank.cold, "Manifest", _FullDiskManifest)
    caplog.set_level(logging.WARNING)
    b = _open(tmp_path)
    st = b.stats()
    assert st.cold_tier.startswith("read-only: disk full: SQLITE_FULL (")
    assert f"bytes free in {tmp_path})" in st.cold_tier
    assert st.disk_faults["disk_full_at_start"] == 1 and st.disk_faults["manifest_moved_aside"] == 0
    assert not list(tmp_path.glob("stale-*")) and _snapshot(tmp_path) == before
    assert any("SSD tier read-only" in r.getMessage() for r in caplog.records)
    assert sorted(s.id for s in b.list_sessions()) == ["a", "b"]
    assert_rows_match(b.lookup(T1 + [0], session_id="a").snapshot, T1)  # restored from blocks

    caplog.clear()
    b.put("c", chain(T3))
    b.put("d", chain(T3, T1))
    st = b.stats()
    assert st.spills_refused == st.disk_faults["spill_refused"] == 3  # 1 + 2 segments
    refused = [r for r in caplog.records if "spill(s) refused" in r.getMessage()]
    assert len(refused) == 1  # rate-limited: one line for the three
    assert "read-only" in (st.last_fault or "") and _snapshot(tmp_path) == before

    monkeypatch.undo()  # space is back: the next bank call opens the manifest for writing
    assert b.flush()
    assert b.stats().cold_tier == "read-write"
    assert b.flush()  # the re-spilled RAM-only turns are written
    assert b.close() == 0
    b2 = _open(tmp_path)
    assert sorted(s.id for s in b2.list_sessions()) == ["a", "b", "c", "d"]
    assert_rows_match(b2.lookup(T3 + T1 + [0], session_id="d").snapshot, T3 + T1)
    b2.close()


def test_unreadable_on_a_full_disk_fails_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _stored(tmp_path)

    def unreadable(cls: type[Manifest], path: Path) -> Manifest:
        raise _sqlite_error(10, "SQLITE_IOERR", "disk I/O error")

    monkeypatch.setattr(segserve.bank.cold, "Manifest", _FullDiskManifest)
    monkeypatch.setattr(_FullDiskManifest, "read_only_copy", classmethod(unreadable))
    with pytest.raises(BankError) as got:
        _open(tmp_path)
    msg = str(got.value)
    assert str(tmp_path) in msg and "bytes free" in msg and "Nothing was moved" in msg
    assert _snapshot(tmp_path) == before
    monkeypatch.undo()
    b = _open(tmp_path)  # the lock was released and everything is still there
    assert sorted(s.id for s in b.list_sessions()) == ["a", "b"]
    b.close()


def test_writes_failing_on_a_full_disk_resume_when_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    b = _open(tmp_path)
    b.put("a", chain(T1))
    assert b.flush()

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", full)
    caplog.set_level(logging.WARNING)
    b.put("b", chain(T2))
    assert b.flush()
    st = b.stats()
    assert st.disk_faults["write_failed"] == 1 and st.cold_tier.startswith("degraded: disk full: ENOSPC")
    assert any("writes are failing" in r.getMessage() for r in caplog.records)
    assert b.stats().rows_by_tier["ssd"] == len(T1)  # "b" is in RAM only
    monkeypatch.undo()
    b.put("c", chain(T3))  # this write succeeds: the fault ends and "b" is queued again
    assert b.flush() and b.flush()
    assert b.stats().cold_tier == "read-write"
    assert b.stats().rows_by_tier["ssd"] == len(T1) + len(T2) + len(T3)
    b.close()
    b2 = _open(tmp_path)
    assert sorted(s.id for s in b2.list_sessions()) == ["a", "b", "c"]
    b2.close()


def test_floor_refusals_are_counted_and_logged_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    b = _open(tmp_path, floor=1 << 62)
    for sid, toks in (("a", T1), ("b", T2), ("c", T3)):
        b.put(sid, chain(toks))
    st = b.stats()
    assert st.spills_refused == st.disk_faults["spill_refused"] == 3
    assert st.cold_tier.startswith("degraded: below the free-disk floor")
    lines = [r.getMessage() for r in caplog.records if "spill(s) refused" in r.getMessage()]
    assert len(lines) == 1 and "disk floor" in lines[0]
    b.close()


def test_writes_pending_is_the_writer_queue(
    gguf_tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real = segserve.bank.writer.write_file_durably

    def gated(path: Path, data: bytes) -> None:
        gate.wait(30)
        real(path, data)

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", gated)
    bk = Bank("ns", 1 << 30, cold=ColdTier(tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0))
    bk.put("a", chain(T1))
    bk.put("b", chain(T2))
    queued = bk.writer_queue()[0]
    assert queued == 4  # per put: one segment write and one session save, none finished
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), load_settings({"bank_dir": "none"}, environ={}), store=bk)
    try:
        with serve_in_thread(create_app(rt.serving)) as url, httpx.Client(base_url=url, trust_env=False) as c:
            assert c.get("/health").json()["bank"]["writes_pending"] == 4
            gate.set()
            deadline = time.monotonic() + 30
            while bk.writer_queue()[0] and time.monotonic() < deadline:
                time.sleep(0.02)
            health = c.get("/health").json()["bank"]
            # The engine published 4 and has not run since; /health reads the writer.
            assert rt.engine.bank_state()["writes_pending"] == 4
            assert health["writes_pending"] == 0 and health["cold_tier"] == "read-write"
    finally:
        rt.engine.stop()
        rt.close()


# ---- a real full disk --------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only; skipped where mount is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_real_full_tmpfs(tiny_disk: Path) -> None:
    root = tiny_disk / "bank"
    before = _stored(root)
    _fill(tiny_disk / "filler")
    b = _open(root)
    st = b.stats()
    assert st.cold_tier.startswith("read-only: disk full") and "0 bytes free" in st.cold_tier
    assert st.disk_faults["manifest_moved_aside"] == 0 and not list(root.glob("stale-*"))
    assert sorted(s.id for s in b.list_sessions()) == ["a", "b"]
    assert_rows_match(b.lookup(T2 + [0], session_id="b").snapshot, T2)
    b.put("c", chain(T3))
    assert b.stats().disk_faults["spill_refused"] == 1
    assert b.close() == 1  # still full: "c" could not be stored (counted lost, logged)
    assert _snapshot(root) == before
    (tiny_disk / "filler").unlink()
    b2 = _open(root)
    assert b2.stats().cold_tier == "read-write"
    assert sorted(s.id for s in b2.list_sessions()) == ["a", "b"]
    b2.put("c", chain(T3))
    b2.close()
    b3 = _open(root)
    assert sorted(s.id for s in b3.list_sessions()) == ["a", "b", "c"]
    b3.close()
