"""Speculative decoding drawn from the session's own segments.

Owns: the draft indexes (`index`: per sealed segment, shared by every snapshot that holds
it, and one for the running turn), the acceptance rules and adaptive draft length
(`accept`) and the verify forward (`verify`). The runner (`segserve.server.runner.runner`) decides
which rows speculate and applies the result to their caches (a trim of rejected rows).
"""

from segserve.server.spec.accept import DraftBudget, accept_one, accept_sampled
from segserve.server.spec.index import (
    INDEX_BYTES_PER_TOKEN,
    IndexedSegment,
    IndexRegistry,
    Proposal,
    SegmentIndex,
    TailIndex,
    propose,
)
from segserve.server.spec.verify import logits_window

__all__ = [
    "INDEX_BYTES_PER_TOKEN",
    "DraftBudget",
    "IndexRegistry",
    "IndexedSegment",
    "Proposal",
    "SegmentIndex",
    "TailIndex",
    "accept_one",
    "accept_sampled",
    "logits_window",
    "propose",
]
