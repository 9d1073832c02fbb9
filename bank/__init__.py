"""Session bank: snapshots by session id and by token prefix, RAM tier, SSD cold tier.

Public API (engine thread): `Bank`, `bank_namespace`, `ColdTier`/`NullColdTier`, and the
result types. See `segserve.bank.bank` for call semantics and `segserve.bank.blocks`/`segserve.bank.manifest` for the
on-disk format.

Events (`segserve.bank.events`): `Bank.observe(BlockEvents(sink))` reports the bank's contents as
fixed-size blocks with chained hashes (stored / removed / all cleared), for KV-aware
routers; the server publishes them in vLLM's format (`segserve.server.kv_events`). No transport
is imported here.

Failover with a shared SSD tier (`--bank-shared`; `segserve.bank.shared`, `segserve.bank.shared_tier`,
`segserve.bank.sweep`). By default each replica owns its bank directory: it locks it, and its
start-up pass deletes block files its manifest does not name. With a shared directory,
replica B restores what replica A wrote after A died (A's conversations re-hashed onto B
by the router):
- Layout: `ROOT/blocks/` shared (block files, named by id, as before); `ROOT/chains/`
  shared; `ROOT/tmp/` writes in flight; `ROOT/replicas/<id>/` per replica (its sqlite
  manifest and its lock). The id is `--bank-replica-id`, else HOSTNAME-PORT.
- Chain entries: when a write completes full aligned block j (`block_rows` rows, the
  blocks' own alignment, `segserve.bank.blocks`), the writer publishes `chains/<A_{j+1}>` after the
  segment commit, where A is the aligned chain over the scope (namespace + cache salt) and
  all tokens through the block's end: the block's tokens, A_j, layout, and the ids, rows,
  sizes and checksums of the chunks (of this and earlier segments) that hold its rows.
- Lookup: when a prompt has a full block beyond the local match (a miss, or a local hit
  shorter than the prompt) and the entry of the first such block exists, B reads the
  entries A_1, A_2, ... until the first absent one, checking each against the prompt (its
  digest, parent digest, start and tokens: a digest alone never restores). The local full
  segments of the match are kept; the rows after them, up to the last full block found,
  are read from the block files (checksums verified; a bad block is quarantined with its
  chain entry and the read stops there) into one new segment, returned like any SSD
  restore (tier "ssd", `restore_rows_from_ssd`, priced by admission). The partial last
  block and the rest of the prompt are prefilled. B stores the turn as usual (under the
  client's session id, so the session continues there), adopting A's block files.
- One writer per file: write `tmp/<name>~<replica>~<n>.tmp`, fsync, then `os.link` it to
  `blocks/<id>` (EEXIST: another replica won; its file is adopted when its checksum equals
  ours or it has the same header and size, since another prefill's rounding may differ in
  bits; a malformed one is quarantined and ours published). Chain entries are published
  the same way and never rewritten. No file under blocks/ or chains/ is written in place.
- Collection: a replica never deletes a shared file at start-up or on a drop (only its own
  temp files). Every `gc_interval_s` a replica queues a sweep on its writer thread; under
  an flock on `ROOT/gc.lock` it deletes block files no replica manifest names, chain
  entries naming such a block, and temp files, each only when its mtime is older than the
  grace period (adopting a file touches it). An unreadable manifest stops the sweep.
- Not built: one disk cap over the whole shared directory (each replica caps the blocks
  its own manifest names); a replica that never returns keeps its blocks until an operator
  removes its `replicas/<id>/`. An entry another replica published first may name chunks
  its writer later drops; the sweep then removes the entry and the block is findable again
  only once a later write completes it anew.
- Tests: `tests/test_bank_shared.py` (two banks on one ROOT), `tests/test_failover_e2e.py`
  (two servers behind nginx, SIGKILL one mid-conversation); timing: `bench/failover.py`.
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
