"""The values a request carries to the runner and a sampled token carries back.

Owns: `SamplingParams` (a request's sampling parameters, validated; `for_choice` for n > 1)
and `TokenLogprob` (one token's log-probability and its top alternatives). Plain frozen
values, no arrays: the HTTP side builds them, the engine and the scheduler pass them along,
the runner's `Sampler` (segserve.server.runner.sampling) reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # in (0, 1]; 1: off
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    top_k: int = 0  # 0 or -1: off (also off when >= the vocabulary)
    min_p: float = 0.0  # in [0, 1], relative to the most likely token; 0: off
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens; 0: off
    frequency_penalty: float = 0.0  # OpenAI's, over generated tokens; 0: off
    repetition_penalty: float = 1.0  # mlx-lm's multiplicative one, > 0; 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, additive bias)

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (the HTTP layer checks
        ranges for its 400; this guards every other caller)."""
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("top_logprobs", self.top_logprobs >= 0),
            ("top_k", self.top_k >= -1),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("presence_penalty", math.isfinite(self.presence_penalty)),
            ("frequency_penalty", math.isfinite(self.frequency_penalty)),
            ("repetition_penalty",
             math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0),
            ("logit_bias", all(t >= 0 and math.isfinite(b) for t, b in self.logit_bias)),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name} is out of range: {getattr(self, name)!r}")

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index` of an `n` > 1 request: seed + index (wrapping at 2**64, the
        seed's range), so choice i draws what a lone request with seed + i draws. Without a
        seed every choice draws its own random seed (`Sampler`)."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % 2**64)

    @property
    def processes(self) -> bool:
        """Any logits processor on (False for the defaults: nothing is built)."""
        return bool(
            self.logit_bias or self.repetition_penalty != 1.0
            or self.presence_penalty or self.frequency_penalty
        )

    @property
    def plain_argmax(self) -> bool:
        """Greedy with no logits processor: the draw is the argmax of the model's logits
        (a grammar mask, which the request carries, may still stand between them)."""
        return self.temperature == 0.0 and not self.processes


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
