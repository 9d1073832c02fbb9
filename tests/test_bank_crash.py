"""kill -9 while the SSD tier is writing: nothing committed is lost, nothing partial is served."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from segserve.bank import Bank, ColdTier
from segserve.bank.writer import block_path, checksum
from tests.bank_fakes import assert_rows_match

REPO = Path(__file__).resolve().parents[1]

# Writes sessions forever; after each flush prints the last session index known durable.
CHILD = """
import sys
from pathlib import Path
from segserve.bank import Bank, ColdTier
from tests.bank_fakes import chain
root = Path(sys.argv[1])
start = int(sys.argv[2])
bank = Bank("ns", 1 << 20, cold=ColdTier(root, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=4))
i = start
while True:
    bank.put(f"s{i}", chain([1, 2, 3, 4, 5, i % 5], [i, i + 1, i + 2] * (1 + i % 4)))
    if i % 4 == 3:
        bank.flush()
        print(i, flush=True)
    i += 1
"""


def tokens_of(i: int) -> list[int]:
    return [1, 2, 3, 4, 5, i % 5] + [i, i + 1, i + 2] * (1 + i % 4)


def run_and_kill(root: Path, start: int, min_committed: int, delay: float) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(start)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    committed = -1
    deadline = time.monotonic() + 30
    while committed < min_committed and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        committed = int(line)
    time.sleep(delay)  # land somewhere inside the next puts / writes
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert committed >= min_committed, "child did not get far enough"
    return committed


def verify_manifest(root: Path) -> int:
    db = sqlite3.connect(root / "manifest.sqlite3")
    try:
        rows = db.execute("SELECT id, nbytes, checksum FROM blocks").fetchall()
        for block_id, nbytes, digest in rows:
            data = block_path(root, block_id).read_bytes()
            assert len(data) == nbytes and checksum(data) == digest
        missing = db.execute(
            "SELECT count(*) FROM segment_blocks sb WHERE NOT EXISTS"
            " (SELECT 1 FROM blocks b WHERE b.id = sb.block_id)"
        ).fetchone()[0]
        assert missing == 0
    finally:
        db.close()
    return len(rows)


def test_kill_9_during_writes_loses_nothing_committed(tmp_path: Path) -> None:
    start = 0
    durable: list[int] = []  # every session a child reported committed, over both runs
    for delay in (0.0, 0.004, 0.02):
        committed = run_and_kill(tmp_path, start, start + 7, delay)
        durable.extend(range(start, committed + 1))
        assert verify_manifest(tmp_path) > 0  # what the dead process left is consistent
        cold = ColdTier(tmp_path, max_disk_bytes=1 << 30, min_free_disk_bytes=0, block_rows=4)
        bank = Bank("ns", 1 << 20, cold=cold)
        bank.check_invariants()
        assert not list(tmp_path.glob("blocks/*/*.tmp"))
        files = {p.stem for p in tmp_path.glob("blocks/*/*.blk")}
        assert len(files) == verify_manifest(tmp_path)  # uncommitted files were removed
        names = {i.id for i in bank.list_sessions()}
        for i in durable:
            assert f"s{i}" in names
            r = bank.lookup(tokens_of(i) + [0], session_id=f"s{i}")
            assert r.reused_tokens == len(tokens_of(i)) and r.tier == "ssd"
            assert_rows_match(r.snapshot, tokens_of(i))
        bank.check_invariants()
        assert bank.close() == 0
        verify_manifest(tmp_path)
        start = committed + 100
