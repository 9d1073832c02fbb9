"""Session bank: snapshots by session id and by token prefix, RAM tier, SSD cold tier.

Public API (engine thread): `Bank`, `bank_namespace`, `ColdTier`/`NullColdTier`, and the
result types. See `bank.bank` for call semantics and `bank.blocks`/`bank.manifest` for the
on-disk format.

Events (`bank.events`): `Bank.observe(BlockEvents(sink))` reports the bank's contents as
fixed-size blocks with chained hashes (stored / removed / all cleared), for KV-aware
routers; the server publishes them in vLLM's format (`server.kv_events`). No transport
is imported here.

Failover with a shared SSD tier (design; not built yet). Today each replica locks its own
bank directory: blocks are content-addressed but the manifest (sessions, turns, segment ->
chunks) is per process, and the start-up pass deletes block files no manifest row names,
so two replicas must not share a directory. To let replica B restore what replica A wrote
after A died (its conversations re-hashed onto B by the router):
- Layout: `ROOT/blocks/` shared (block files, named by id, as now); `ROOT/chains/` shared;
  `ROOT/replicas/<id>/` per replica (its sqlite manifest and its lock; the lock moves there).
- Lookup by chain digest: for every full aligned block j (`block_rows` rows, the blocks'
  own alignment, `bank.blocks`) a writer also publishes `chains/<A_{j+1}>`, where A is the
  aligned chain over the scope (namespace + cache salt) and all tokens through the block's
  end: the block's tokens, layout, and the ids/rows/checksums of the chunks that hold its
  rows. On a local miss (or a local hit shorter than the prompt), B hashes the prompt's
  blocks A_1, A_2, ... and probes `chains/` until the first absent entry; entries whose
  tokens differ from the prompt's are ignored (a digest alone never restores, as now).
  The found prefix becomes a new path in B's index (one segment per block run), restored
  through the usual `materialize` (checksums verified, quarantine on mismatch) and priced as
  `restore_rows_from_ssd`; the partial last block is re-prefilled. Scopes keep tenants
  apart on disk exactly as the block ids do.
- One writer per block, atomic publication: write `tmp/<id>.<replica>.<n>`, fsync, then
  `os.link` it to `blocks/<id>` (fails with EEXIST when another replica won: unlink the
  temp and use the winner's file, identical by construction, after a checksum check);
  `chains/` entries are published the same way and never rewritten.
- Collection: a replica never deletes a shared file at start-up (only its own `tmp/`
  files). Each replica's manifest lists what it references; one sweeper at a time (an
  flock on `ROOT/gc.lock`) deletes blocks and chain entries that no replica manifest names
  and whose mtime is older than a grace period (a write in flight is never collected), and
  enforces the shared disk cap LRU by chain-entry atime.
- Sessions by id stay per replica: on B the first turn after a failover is a prefix hit,
  and B stores the turn under the client's X-Session-Id, so the session continues there.
- Test (to build): two replicas on one shared ROOT behind nginx, kill -9 the one holding a
  conversation mid-way; the next turn succeeds on the other (nginx `proxy_next_upstream
  error`), reports cached tokens with tier "ssd", and is timed against a re-prefill.
"""

from .bank import Bank, bank_namespace
from .cold import ColdTier
from .tier import ColdStats, ColdStore, NullColdTier
from .types import (
    BankError,
    BankStats,
    InvariantViolation,
    LookupResult,
    SessionInfo,
    SessionNotFound,
)

__all__ = [
    "Bank",
    "BankError",
    "BankStats",
    "ColdStats",
    "ColdStore",
    "ColdTier",
    "InvariantViolation",
    "LookupResult",
    "NullColdTier",
    "SessionInfo",
    "SessionNotFound",
    "bank_namespace",
]
