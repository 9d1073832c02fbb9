"""The engine's session store backed by the session bank (`bank.Bank`).

Owns: `BankStore` (adapts `bank.Bank` to `segserve.server.scheduling.SnapshotStore`) and `make_bank`.
Engine thread only: every call here runs on the thread that owns MLX, including the
session API's calls, which reach it through `Engine.call`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from segserve.bank import Bank, BankError, bank_namespace
from segserve.config.settings import Settings
from segserve.kv.segment import Snapshot
from segserve.server.runner import KV_LAYOUT_VERSION, LoadedModel, device_memory
from segserve.server.scheduling import LookupHit, parse_memory_budget

# Automatic RAM cap of the bank: a quarter of the memory available at start-up.
AUTO_BANK_FRACTION = 0.25


class BankStore:
    def __init__(self, bank: Bank) -> None:
        self.bank = bank

    def lookup(
        self, tokens: Sequence[int], *, session_id: str | None, salt: str | None, max_reuse: int
    ) -> LookupHit:
        r = self.bank.lookup(tokens, session_id=session_id, salt=salt, max_reuse=max_reuse)
        # Only an explicit id continues a session; a prefix hit starts a new one that
        # shares the matched segments (clients that resend history send no id).
        return LookupHit(r.snapshot, r.reused_tokens, r.kind, session_id, r.restore_rows_from_ssd)

    def put(self, session_id: str | None, snapshot: Snapshot, *, salt: str | None) -> str | None:
        if snapshot.rows == 0:
            return session_id
        return self.bank.put(session_id, snapshot, salt=salt)

    def pin(self, snapshot: Snapshot) -> None:
        self.bank.pin(snapshot)

    def unpin(self, snapshot: Snapshot) -> None:
        self.bank.unpin(snapshot)

    def ram_bytes(self) -> int:
        return self.bank.ram_bytes()

    def evictable_bytes(self) -> int:
        return self.bank.evictable_bytes()

    def ensure_free(self, nbytes: int) -> int:
        return self.bank.release(nbytes)

    def stats(self) -> dict[str, Any]:
        st = asdict(self.bank.stats())
        st["lookups"] = {**st["hits_by_kind"], "miss": st["misses"]}
        st["lost_writes"] = st["writes_lost"]
        return st

    def fork(self, session_id: str, turn: int | None, *, salt: str | None, new_id: str) -> bool:
        """`new_id` becomes a fork of `session_id` at `turn` (None: its latest): a
        request's `continue_from`. False when that session or turn is gone (the caller
        then prefills from text) or `new_id` exists."""
        try:
            self.bank.fork(session_id, turn, salt=salt, new_id=new_id)
        except BankError:  # SessionNotFound included
            return False
        return True

    def turn_index(self, session_id: str, *, salt: str | None) -> int | None:
        """The index of `session_id`'s latest turn (None: not stored)."""
        try:
            return self.bank.info(session_id, salt=salt).turns - 1
        except BankError:
            return None

    def close(self) -> None:
        lost = self.bank.close(timeout=30.0)
        if lost:
            import logging

            logging.getLogger("segserve.bank").error("%d queued SSD writes were lost", lost)


def namespace_for(loaded: LoadedModel) -> str:
    return bank_namespace(
        model=loaded.model_id,
        revision=loaded.revision,
        dtype=loaded.kv_dtype,
        quantization=loaded.quantization,
        kv_layout=KV_LAYOUT_VERSION,
        tokenizer=loaded.tokenizer.fingerprint,
        chat_template=loaded.tokenizer.fingerprint,
    )


def make_bank(settings: Settings, loaded: LoadedModel) -> Bank:
    if settings.bank_max_bytes:
        cap = parse_memory_budget(settings.bank_max_bytes, what="SEGSERVE_BANK_MAX_BYTES")
    else:
        cap = int(device_memory().available_bytes * AUTO_BANK_FRACTION)
    disk = parse_memory_budget(settings.bank_disk_max_bytes, what="SEGSERVE_BANK_DISK_MAX_BYTES")
    floor = parse_memory_budget(
        settings.bank_min_free_disk, what="SEGSERVE_BANK_MIN_FREE_DISK", minimum=0
    )
    cold = settings.cold_tier_dir()
    try:
        return Bank.open(
            namespace_for(loaded), cap, cold, max_disk_bytes=disk, min_free_disk_bytes=floor,
            shared_replica=settings.bank_replica(),
        )
    except BankError as exc:  # e.g. the directory is locked by another running server
        raise BankError(
            f"{exc} (SEGSERVE_BANK_DIR / --bank-dir: give another directory, or 'none' "
            "for a RAM-only bank)"
        ) from exc
