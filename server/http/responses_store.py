"""Stored responses of `/v1/responses`: one sqlite3 table, durable per commit.

Owns: `ResponseRecord` and `ResponseStore`. A record is what a later request needs to
continue or show a response: the response object as returned, the conversation after it
(chat-shape messages, so the continuation's prompt is rendered by the chat template from
the same text), this response's own input items, and where its KV rows live in the bank
(the bank session and the turn index of this response in it).

Where: `responses.sqlite3` in the bank's SSD directory when the SSD tier is on (so stored
responses survive a restart together with the bank's sessions), else an in-memory
database (lost at exit, like the RAM-only bank). WAL journal with `synchronous=FULL`:
every `put`/`delete` is one transaction, so a committed record survives `kill -9` and a
power cut; an interrupted one is simply absent.

Tenancy: every row carries the scope of its tenant (a hash of the request's bank salt:
API-key tenant + `X-Cache-Salt`); reads and deletes match (scope, id), so another
tenant's id is indistinguishable from an unknown one.

Thread-safety: one connection behind a lock; the HTTP side calls in through a worker
thread (`anyio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILENAME = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    scope TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL,
    input_items TEXT NOT NULL,
    bank_session TEXT,
    bank_turn INTEGER,
    PRIMARY KEY (scope, id)
)
"""


def scope_of(salt: str | None) -> str:
    """The stored scope of a bank salt (None and "" are the same tenant)."""
    return hashlib.sha256(("segserve.responses\n" + (salt or "")).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    id: str
    scope: str
    created_at: float
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    bank_session: str | None
    bank_turn: int | None


class ResponseStore:
    def __init__(self, directory: Path | None) -> None:
        self.path: Path | None = None
        if directory is None:
            target = ":memory:"
        else:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / FILENAME
            target = str(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        with self._lock:
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)

    @property
    def durable(self) -> bool:
        return self.path is not None

    def put(self, rec: ResponseRecord) -> None:
        row = (
            rec.scope, rec.id, rec.created_at, json.dumps(rec.response), json.dumps(rec.conversation),
            json.dumps(rec.input_items), rec.bank_session, rec.bank_turn,
        )
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?,?,?,?,?,?,?,?)", row)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, scope: str, rid: str) -> ResponseRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, scope, created_at, response, conversation, input_items, bank_session,"
                " bank_turn FROM responses WHERE scope = ? AND id = ?",
                (scope, rid),
            ).fetchone()
        if row is None:
            return None
        return ResponseRecord(
            str(row[0]), str(row[1]), float(row[2]), json.loads(row[3]), json.loads(row[4]),
            json.loads(row[5]), row[6], row[7],
        )

    def delete(self, scope: str, rid: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE scope = ? AND id = ?", (scope, rid))
            return cur.rowcount > 0

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
