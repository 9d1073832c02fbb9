"""Token sampling: greedy, temperature, top-p, seeded; and log-probabilities.

Owns: `SamplingParams` and `Sampler`. Engine thread only.
Same seed and same prompt give the same tokens: each request draws from its own
`mx.random.key(seed)` chain, never from the global generator.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """logits: [V] float → a 0-d uint32 token id (lazy)."""
        p = self.params
        if p.temperature == 0.0:
            return mx.argmax(logits, axis=-1)
        self._key, sub = mx.random.split(self._key)
        scaled = logits.astype(mx.float32) / p.temperature
        if p.top_p < 1.0:
            scaled = _top_p_filter(scaled, p.top_p)
        return mx.random.categorical(scaled, key=sub)

    def logprob(self, logits: mx.array, token: int) -> TokenLogprob:
        logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1)
        k = self.params.top_logprobs
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            idx = mx.argpartition(-logp, kth=k - 1)[:k]
            vals = logp[idx]
            order = mx.argsort(-vals)
            idx, vals = idx[order], vals[order]
            top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))  # type: ignore[arg-type]
        return TokenLogprob(token, float(logp[token].item()), top)  # type: ignore[arg-type]


def _top_p_filter(logits: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    order = mx.argsort(-logits)
    sorted_logits = logits[order]
    probs = mx.softmax(sorted_logits, axis=-1)
    cum = mx.cumsum(probs, axis=-1)
    # Keep a token if the mass before it is < top_p (so the first token always stays).
    keep_sorted = (cum - probs) < top_p
    masked = mx.where(keep_sorted, sorted_logits, -mx.inf)
    out = mx.zeros_like(logits)
    out[order] = masked
    return out
