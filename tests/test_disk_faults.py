"""SSD tier faults: a lost, empty or unreadable manifest never deletes block files, and
every disk fault is counted on `/health` and `/metrics`, not only logged."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import httpx
import pytest

import segserve.bank.writer
from segserve.bank import Bank, ColdTier
from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from tests.bank_fakes import chain, checked
from tests.conftest import tiny_loaded
from tests.http_support import serve_in_thread, tiny_runtime

T1 = list(range(100, 120))  # 20 rows: 3 blocks of 8
T2 = list(range(200, 230))  # 30 rows: 4 blocks


def _open(root: Path) -> Bank:
    cold = ColdTier(root, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=8)
    return checked(Bank("ns", 1 << 30, cold=cold))


def _stored(root: Path) -> list[bytes]:
    b = _open(root)
    b.put("a", chain(T1))
    b.put("b", chain(T2))
    b.close()
    files = sorted((root / "blocks").glob("*/*.blk"))
    assert len(files) == 7
    return sorted(p.read_bytes() for p in files)


def _everywhere(root: Path) -> list[bytes]:
    return sorted(p.read_bytes() for p in root.rglob("*.blk"))


def test_zero_length_manifest_keeps_every_block_file(tmp_path: Path) -> None:
    data = _stored(tmp_path)
    (tmp_path / "manifest.sqlite3").write_bytes(b"")
    for p in tmp_path.glob("manifest.sqlite3-*"):
        p.unlink()
    b = _open(tmp_path)
    st = b.stats()
    assert b.list_sessions() == [] and st.disk_faults["manifest_moved_aside"] == 1
    assert "empty" in (st.last_fault or "")
    assert _everywhere(tmp_path) == data  # nothing deleted: kept in stale-empty-*/
    kept = list(tmp_path.glob("stale-empty-*"))
    assert len(kept) == 1 and (kept[0] / "manifest.sqlite3").stat().st_size == 0
    b.put("c", chain(T1))  # the tier works on
    assert b.flush() and b.lookup(T1 + [1], session_id="c").reused_tokens == 20
    b.close()


def test_missing_manifest_keeps_the_blocks_aside(tmp_path: Path) -> None:
    data = _stored(tmp_path)
    for p in tmp_path.glob("manifest.sqlite3*"):
        p.unlink()
    b = _open(tmp_path)
    st = b.stats()
    assert st.disk_faults["orphans_kept"] == 1 and "just created" in (st.last_fault or "")
    assert list((tmp_path / "blocks").glob("*/*.blk")) == []
    assert _everywhere(tmp_path) == data
    b.close()


def test_a_manifest_naming_few_of_many_files_keeps_the_rest(tmp_path: Path) -> None:
    _stored(tmp_path)
    d = next((tmp_path / "blocks").iterdir())
    for i in range(70):  # far more unnamed files than one crash can leave
        (d / f"{i:032x}.blk").write_bytes(b"unnamed")
    b = _open(tmp_path)
    assert b.stats().disk_faults["orphans_kept"] == 1
    assert len(list((tmp_path / "blocks").glob("*/*.blk"))) == 7
    assert len(list(tmp_path.glob("stale-orphans-*/blocks/*/*.blk"))) == 70
    assert [s.id for s in b.list_sessions()] == ["b", "a"]
    b.close()


def test_write_failures_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segserve.bank.writer, "write_file_durably", full)
    b = _open(tmp_path)
    b.put("x", chain(T1))
    b.flush()
    assert b.stats().disk_faults["write_failed"] == 1
    b.close()


def test_disk_faults_show_on_health_and_metrics(gguf_tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    _stored(tmp_path)
    (tmp_path / "manifest.sqlite3").write_bytes(b"")
    cold = ColdTier(tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0)
    store = Bank("ns", 1 << 30, cold=cold)
    rt = tiny_runtime(tiny_loaded(gguf_tokenizer), load_settings({"bank_dir": "none"}, environ={}), store=store)
    try:
        with serve_in_thread(create_app(rt.serving)) as url, httpx.Client(base_url=url, trust_env=False) as c:
            bank_health = c.get("/health").json()["bank"]
            assert bank_health["disk_faults"]["manifest_moved_aside"] == 1
            assert "manifest moved aside" in bank_health["last_fault"]
            text = c.get("/metrics").text
            assert re.search(r'^segserve_bank_disk_faults_total\{kind="manifest_moved_aside"\} 1\.0$', text, re.M)
            assert re.search(r'^segserve_bank_disk_faults_total\{kind="write_failed"\} 0\.0$', text, re.M)
    finally:
        rt.engine.stop()
        rt.close()
