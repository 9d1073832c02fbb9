"""Acceptance of draft tokens, and how many to draft next.

Owns: `accept_sampled` (the rejection-sampling rule for a point-mass draft; `accept_one`
for one row) and
`DraftBudget` (adaptive K per session). Engine thread only (MLX arrays). Greedy rows are
accepted by the runner row by row (`ModelRunner._accept`): each row's token drawn as a
plain step draws it, up to the first that differs from its draft.

Verification runs the window `[last, d1 .. dK]` through the model once: row i's logits
are the model's distribution for the token after `window[i]`, so row i checks draft
d(i+1) and the row after the last accepted draft gives one more token of the model's own
(the "bonus"): every verify step yields between 1 and K + 1 tokens.

Sampled rows: an n-gram draft is a point mass q = 1{d}, so the standard rule
(accept with min(1, p(d) / q(d)), else draw from max(0, p - q) renormalised) becomes:
accept d with probability p(d); else draw from p with d removed, renormalised; and stop.
Here p is the request's own distribution after its temperature / top_p / min_p / top_k
transforms (`Sampler.weights`), so each emitted token has exactly the distribution the
plain path draws from (tests/test_speculative.py checks it with a chi-square test).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx


def accept_sampled(weights: mx.array, drafts: Sequence[int],
                   next_key: Callable[[], mx.array]) -> list[int]:
    """weights: [K + 1, V] the transformed logits each row draws from (a categorical's
    input: unnormalised log-probabilities, -inf for filtered tokens). `next_key` gives a
    fresh PRNG key per draw (the request's own chain). The accepted drafts, then either
    the residual draw at the first rejection or a draw from the row after the last draft."""
    k = len(drafts)
    logp = weights - mx.logsumexp(weights, axis=-1, keepdims=True)
    if k:
        idx = mx.array(list(drafts), dtype=mx.int32)
        p_draft = mx.exp(mx.take_along_axis(logp[:k], idx[:, None], axis=-1)[:, 0])
        u = mx.random.uniform(shape=(k,), key=next_key())
        mx.eval(p_draft, u)
        ok = cast(list[bool], (u < p_draft).tolist())
    else:
        ok = []
    out: list[int] = []
    for d, good in zip(drafts, ok, strict=True):
        if not good:
            out.append(_residual(logp[len(out)], d, next_key))
            return out
        out.append(int(d))
    out.append(_item(mx.random.categorical(logp[k], key=next_key())))
    return out


def accept_one(weights: mx.array, draft: int, next_key: Callable[[], mx.array]) -> tuple[int, bool]:
    """The rejection rule for one row: weights [V] (as `accept_sampled`'s rows). Returns the
    draft and True with probability p(draft), else a draw from p with the draft removed
    and False. For rows whose distribution depends on the tokens before them (a grammar, a
    logits processor), which the runner walks one row at a time."""
    logp = weights - mx.logsumexp(weights, axis=-1, keepdims=True)
    u = mx.random.uniform(key=next_key())
    if _item_float(u) < _item_float(mx.exp(logp[draft])):
        return int(draft), True
    return _residual(logp, draft, next_key), False


def _residual(logp: mx.array, draft: int, next_key: Callable[[], mx.array]) -> int:
    """A draw from the row's distribution with the rejected draft removed (the categorical
    renormalises by itself)."""
    row = mx.where(mx.arange(logp.shape[-1]) == draft, mx.array(-mx.inf, logp.dtype), logp)
    return _item(mx.random.categorical(row, key=next_key()))


def _item_float(x: mx.array) -> float:
    return float(cast(float, x.item()))


def _item(x: mx.array) -> int:
    return int(cast(int, x.item()))


@dataclass(eq=False)
class DraftBudget:
    """How many tokens to draft for one session, from its recent acceptance.

    Full acceptance grows K (by 2, up to `k_max`); a partial one sets K to what was
    accepted + 1; a verify that accepts nothing starts a cool-down (no drafting for 1, 2,
    4 .. 32 steps, doubling while misses continue), so a conversation where drafts keep
    failing pays almost nothing: one lookup, then plain decode steps."""

    k_max: int = 8
    k: int = 4
    misses: int = 0
    cooldown: int = 0
    drafted: int = 0  # totals of this session (the access log's acceptance)
    accepted: int = 0

    def want(self) -> int:
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return min(self.k, self.k_max)

    def update(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if drafted <= 0:
            return
        if accepted == 0:
            self.misses += 1
            self.cooldown = min(32, 1 << (self.misses - 1))
            self.k = 1
        else:
            self.misses = 0
            self.k = min(self.k_max, self.k + 2) if accepted == drafted else accepted + 1
