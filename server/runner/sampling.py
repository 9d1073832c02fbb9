"""Token sampling the way mlx-lm does it, per request and seeded; and log-probabilities.

Owns: `Sampler` (one request's key chain and logits processors) and the sampling defaults
read from a model's `generation_config.json`. Engine thread only. The parameters a request
carries (`SamplingParams`) and the log-probabilities it gets back (`TokenLogprob`) are plain
values defined with the step's messages (segserve.server.scheduling.params) and re-exported
here.

One decode step of one request, in this order (the order of `mlx_lm.generate`):

1. logits processors (`Sampler.process`), built once per request by
   `mlx_lm.sample_utils.make_logits_processors` and only for the parameters that are on:
   - `logit_bias` (token id -> additive bias; -100 bans a token, +100 forces it), then
   - `repetition_penalty` (mlx-lm's sign-aware multiplicative penalty; 1.0 = off) over the
     last `REPETITION_CONTEXT` (20, mlx-lm's default) tokens of prompt + generated text:
     these two see the whole sequence, as in mlx-lm (and vLLM, HF transformers);
   - `presence_penalty` / `frequency_penalty` (mlx-lm's `make_presence_penalty` /
     `make_frequency_penalty`, reached through the same call): OpenAI's definition,
     `logit[j] -= presence * (count[j] > 0) + frequency * count[j]` with `count[j]` the
     times token j was *generated* so far in this request. So these see the generated
     tokens only (never the prompt), all of them (no window; mlx-lm's own default window
     of 20 tokens would forget older repeats).
2. the grammar mask, when the request has one (the runner applies it: tokens it forbids
   go to -inf);
3. the draw: when a filter is on, logits -> log-probabilities and mlx-lm's filters in
   `make_sampler`'s order (`apply_top_p` when 0 < top_p < 1, `apply_min_p` when
   min_p > 0, `apply_top_k` when 0 < top_k < vocab); then
   `categorical(x * (1 / temperature))`, as mlx-lm's `categorical_sampling`; temperature 0
   is greedy (argmax, after processors and mask).

Why not call `make_sampler`'s closure itself: its last step draws from MLX's global
generator (`mx.random.state`), which all requests share and which can only be re-seeded
from an integer, so a request's draws would depend on its neighbours. Here each request
draws from its own `mx.random.key(seed)` chain (`key, sub = split(key)` per draw: the split
the global generator does). tests/test_sampling_fields.py checks that, for the same key,
the draws equal `make_sampler(...)`'s token for token (temperature, top_p, min_p, top_k)
on the same [V] log-probabilities.

Same seed, same prompt, same parameters -> same tokens, batched or alone: the key chain,
the processors' token history and the grammar state are per request, and sampling runs per
row on that row's logits.

Log-probabilities (`logprob`) report the model's own distribution: log-softmax of the raw
logits, before processors, grammar mask, temperature and filters (unchanged from before
these parameters existed; what vLLM returns by default too).

Cost when everything is off (the default): no processor is built (`Sampler.processes` is
False and the runner skips `process`), no mask, and the draw is the same work as before
these parameters existed: a scale (none at temperature 1) and a categorical over the
[V] row; no log-softmax, as the categorical does not need one
(bench/sampling_cost.py).

Defaults (`SamplingDefaults`, read by `read_generation_config`): a field a request leaves
out (or sends as null) takes the model's own value from its `generation_config.json`
(temperature, top_p, top_k, min_p, repetition_penalty), else the OpenAI default above; a
value in the request always wins. As vLLM's `--generation-config auto`, `do_sample` is not
read: a file's temperature applies even where transformers would decode greedily.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

# Re-exported: the runner's callers name them from here too.
from segserve.server.scheduling.params import SamplingParams as SamplingParams
from segserve.server.scheduling.params import TokenLogprob as TokenLogprob

REPETITION_CONTEXT = 20  # tokens `repetition_penalty` looks back over (mlx-lm's default)
_WHOLE = 2**31 - 1  # a context size that keeps every generated token (slices are int32)

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens [n], logits [1, V])



log = logging.getLogger("segserve.runner")

# Each default the model may set, and the range SamplingParams.validate accepts for it.
_DEFAULT_RANGES: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: math.isfinite(v) and v >= 0.0,
    "top_p": lambda v: 0.0 < v <= 1.0,
    "top_k": lambda v: v >= -1 and float(v).is_integer(),
    "min_p": lambda v: 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: math.isfinite(v) and v > 0.0,
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The model's own sampling defaults; None = the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = ""  # the file they were read from ("" = none)

    def as_dict(self) -> dict[str, float | int]:
        """The values set (what `/v1/models/{id}` and `/health` show)."""
        out: dict[str, float | int] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and v is not None:
                out[f.name] = v
        return out

    def pick(self, name: str, requested: float | None, fallback: float) -> float:
        """The request's value, else the model's, else `fallback` (OpenAI's default)."""
        if requested is not None:
            return requested
        own: float | None = getattr(self, name)
        return own if own is not None else fallback


def read_generation_config(path: Path) -> SamplingDefaults:
    """`generation_config.json` -> SamplingDefaults; a missing file sets nothing, and a
    value of the wrong type or out of range is left out with a warning (never a failed
    start: the request's own value or OpenAI's default serves instead)."""
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("generation config %s unreadable, model defaults not used: %s", path, exc)
        return SamplingDefaults()
    if not isinstance(raw, dict):
        log.warning("generation config %s is not a JSON object, model defaults not used", path)
        return SamplingDefaults()
    found: dict[str, Any] = {}
    for name, ok in _DEFAULT_RANGES.items():
        v = raw.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(float(v)):
            log.warning("generation config %s: %s=%r is out of range, not used", path, name, v)
            continue
        found[name] = int(v) if name == "top_k" else float(v)
    return SamplingDefaults(**found, source=str(path) if found else "")


class Sampler:
    """One request's sampling state: its key chain and its logits processors."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        # Processors that see prompt + generated tokens, and those that see generated only.
        self._on_all: list[LogitsProcessor] = []
        self._on_generated: list[LogitsProcessor] = []
        if params.processes:
            p = params
            self._on_all = make_logits_processors(
                logit_bias=dict(p.logit_bias) or None,
                repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
                repetition_context_size=REPETITION_CONTEXT,
            )
            self._on_generated = make_logits_processors(
                presence_penalty=p.presence_penalty or None,
                presence_context_size=_WHOLE,
                frequency_penalty=p.frequency_penalty or None,
                frequency_context_size=_WHOLE,
            )

    @property
    def processes(self) -> bool:
        return bool(self._on_all or self._on_generated)

    def check_vocab(self, vocab_size: int) -> None:
        """Every `logit_bias` token id must index the logits (called before any token)."""
        bad = [t for t, _ in self.params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is not below the vocabulary size {vocab_size}")

    def process(self, logits: mx.array, prompt: Sequence[int], generated: Sequence[int]) -> mx.array:
        """Apply the logits processors: logits [V] or [1, V] -> float32 [1, V] (lazy).
        Only call when `processes`; the input array is left as it was."""
        x = logits.astype(mx.float32).reshape(1, -1)
        if self._on_all:
            recent = [*prompt[-REPETITION_CONTEXT:], *generated][-REPETITION_CONTEXT:]
            tokens = mx.array(recent, dtype=mx.int32)
            for proc in self._on_all:
                x = proc(tokens, x)
        if self._on_generated and generated:
            tokens = mx.array(list(generated), dtype=mx.int32)
            for proc in self._on_generated:
                x = proc(tokens, x)
        return x

    def __call__(self, logits: mx.array) -> mx.array:
        """logits: [V] or [1, V] (processed and masked, or raw) -> a 0-d uint32 token id
        (lazy). Draws on a [V] row: `mx.random.categorical` draws different bits for a
        [1, V] row, and is slower there."""
        x = logits.astype(mx.float32).reshape(-1)
        if self.params.temperature == 0.0:
            return mx.argmax(x, axis=-1)  # mlx-lm's greedy_sampler
        return mx.random.categorical(self.weights(x), key=self.next_key())

    def next_key(self) -> mx.array:
        """A fresh key from this request's chain (one split per draw)."""
        self._key, sub = mx.random.split(self._key)
        return sub

    def weights(self, x: mx.array) -> mx.array:
        """float32 logits [V] or [N, V] (processed and masked, or raw) -> what the
        categorical draws from, row by row: the filters' log-probabilities (when a filter is
        on) scaled by 1 / temperature (lazy). Temperature > 0 only. Speculative decoding
        reads the same rows (`segserve.server.spec.accept_sampled`), so its tokens keep this
        distribution."""
        p = self.params
        top_p, top_k = 0.0 < p.top_p < 1.0, 0 < p.top_k < x.shape[-1]
        if top_p or p.min_p != 0.0 or top_k:
            # mlx-lm's filters take log-probabilities (top_p exponentiates them)
            x = x - mx.logsumexp(x, axis=-1, keepdims=True)
            if top_p:
                x = apply_top_p(x, p.top_p)
            if p.min_p != 0.0:
                x = apply_min_p(x, p.min_p, 1)
            if top_k:
                x = apply_top_k(x, p.top_k)
        # else: the categorical is shift-invariant, so the log-softmax (a pass of exp over
        # the vocabulary) is skipped; and x * 1.0 == x, so is the scale at temperature 1.
        if p.temperature != 1.0:
            x = x * (1.0 / p.temperature)
        return x

    def logprob(self, logits: mx.array, token: int) -> TokenLogprob:
        """The model's distribution: pass the raw logits (before processors and mask)."""
        logits = logits.reshape(-1).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1)
        k = self.params.top_logprobs
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            idx = mx.argpartition(-logp, kth=k - 1)[:k]
            vals = logp[idx]
            order = mx.argsort(-vals)
            idx, vals = idx[order], vals[order]
            top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))  # type: ignore[arg-type]
        return TokenLogprob(token, float(logp[token].item()), top)  # type: ignore[arg-type]
