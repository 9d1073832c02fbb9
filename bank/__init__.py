"""Session bank: snapshots by session id and by token prefix, RAM tier, SSD cold tier.

Public API (engine thread): `Bank`, `bank_namespace`, `ColdTier`/`NullColdTier`, and the
result types. See `bank.bank` for call semantics and `bank.blocks`/`bank.manifest` for the
on-disk format.
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
