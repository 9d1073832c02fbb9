"""Randomized operation sequences against the bank; invariants and row contents after every step.

Every row a fake segment holds is a function of (token, absolute position), so each lookup
result is checked against what it must contain: a wrong restore cannot pass silently.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from segserve.bank import Bank, BankError, ColdTier
from segserve.kv.segment import Snapshot
from tests.bank_fakes import assert_rows_match, extend, merge_tail

ROW = 2 * 2 * 2 * 8 * 2
SYSTEMS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8, 8, 8, 8, 8, 8, 8, 8, 8]]
SALTS = [None, "t1"]


class Driver:
    def __init__(self, seed: int, root: Path | None) -> None:
        self.rng = random.Random(seed)
        self.root = root
        self.bank = self._open()
        self.model: dict[tuple[str | None, str], list[int]] = {}  # last tokens put per session
        self.pins: list[Snapshot] = []
        self.next_id = 0
        self.spilled = 0  # summed over restarts (stats are per process)
        self.ssd_restores = 0

    def _open(self) -> Bank:
        if self.root is None:
            return Bank("ns", 90 * ROW)
        cold = ColdTier(self.root, max_disk_bytes=40_000, min_free_disk_bytes=0, block_rows=4)
        return Bank("ns", 90 * ROW, cold=cold)

    def words(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 40) for _ in range(n)]

    def turn(self, key: tuple[str | None, str] | None, prompt: list[int]) -> None:
        salt, sid = key if key is not None else (self.rng.choice(SALTS), None)
        r = self.bank.lookup(prompt, session_id=sid, salt=salt)
        assert_rows_match(r.snapshot, prompt)
        assert r.reused_tokens == r.snapshot.rows < len(prompt)
        snap = extend(r.snapshot, prompt[r.reused_tokens :])
        if len(snap.segments) >= 3 and self.rng.random() < 0.3:
            snap = merge_tail(snap, 2)
        new_sid = self.bank.put(sid, snap, salt=salt)
        self.model[(salt, new_sid)] = prompt

    def pick(self) -> tuple[str | None, str] | None:
        return self.rng.choice(sorted(self.model, key=str)) if self.model else None

    def step(self) -> str:
        rng, b = self.rng, self.bank
        op = rng.choice(
            ["new", "turn", "turn", "turn", "rewind", "fork", "delete", "evict", "pin", "unpin"]
        )
        if self.root is not None and rng.random() < 0.12:
            op = rng.choice(["flush", "flush", "restart", "corrupt"])
        key = self.pick()
        if op == "new" or key is None:
            self.turn(None, list(rng.choice(SYSTEMS)) + self.words(rng.randrange(1, 12)))
        elif op == "turn":
            self.turn(key, self.model[key] + self.words(rng.randrange(1, 9)))
        elif op == "rewind":
            old = self.model[key]
            self.turn(key, old[: rng.randrange(1, len(old) + 1)] + self.words(rng.randrange(1, 5)))
        elif op == "fork":
            self._fork(key)
        elif op == "delete":
            self._delete(key)
        elif op == "evict":
            if rng.random() < 0.5:
                b.ensure_free(rng.randrange(0, 60) * ROW)
            else:
                b.release(rng.randrange(1, 40) * ROW)
        elif op == "pin":
            r = b.lookup(self.model[key] + [0], session_id=key[1], salt=key[0])
            assert_rows_match(r.snapshot, self.model[key])
            if r.reused_tokens:
                b.pin(r.snapshot)
                self.pins.append(r.snapshot)
        elif op == "unpin" and self.pins:
            b.unpin(self.pins.pop(rng.randrange(len(self.pins))))
        elif op == "flush":
            assert b.flush()
        elif op == "restart":
            self.restart()
        elif op == "corrupt":
            self._corrupt()
        return op

    def _fork(self, key: tuple[str | None, str]) -> None:
        try:
            turns = self.bank.info(key[1], salt=key[0]).turns
        except BankError:
            del self.model[key]
            return
        self.next_id += 1
        nid = self.bank.fork(
            key[1], self.rng.randrange(turns), salt=key[0], new_id=f"f{self.next_id}"
        )
        self.model[(key[0], nid)] = self.model[key]

    def _delete(self, key: tuple[str | None, str]) -> None:
        del self.model[key]
        try:
            self.bank.delete(key[1], salt=key[0])
        except BankError:
            pass  # evicted earlier

    def _corrupt(self) -> None:
        assert self.root is not None
        self.bank.flush()
        files = sorted((self.root / "blocks").glob("*/*.blk"))
        if files:
            f = self.rng.choice(files)
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))

    def restart(self) -> None:
        for p in self.pins:
            self.bank.unpin(p)
        self.pins.clear()
        st = self.bank.stats()
        self.spilled += st.evictions_by_reason.get("spilled", 0)
        self.ssd_restores += st.restores_by_tier.get("ssd", 0)
        assert self.bank.close() == 0
        self.bank = self._open()

    def check(self) -> None:
        b = self.bank
        b.check_invariants()
        assert b.evictable_bytes() + b.protected_bytes() == b.ram_bytes()
        if not self.pins:
            assert b.ram_bytes() <= b.max_bytes


@pytest.mark.parametrize("seed", [1, 2])
def test_random_ops_ram_only(seed: int) -> None:
    d = Driver(seed, None)
    seen = set()
    for _ in range(300):
        seen.add(d.step())
        d.check()
    st = d.bank.stats()
    assert st.evictions_by_reason and st.hits_by_kind
    assert {"new", "turn", "fork", "evict", "pin"} <= seen


@pytest.mark.parametrize("seed", [3, 4])
def test_random_ops_with_cold_tier(seed: int, tmp_path: Path) -> None:
    d = Driver(seed, tmp_path)
    for _ in range(300):
        d.step()
        d.check()
    d.restart()
    assert d.ssd_restores > 0 and d.spilled > 0
    d.check()
    # After a restart every listed session restores exactly what it stored (or misses).
    for key, toks in sorted(d.model.items(), key=str):
        r = d.bank.lookup(toks + [0], session_id=key[1], salt=key[0])
        assert_rows_match(r.snapshot, toks)
        d.check()
    d.bank.close()
