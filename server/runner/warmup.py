"""Start-up warm-up: the decode step at every batch size a server will meet, run once before
the first request.

Why: on a GPU, MLX compiles on first use. A decode step at a batch size not seen before
re-traces every compiled graph of the step (per layer, the parts around attention, and the
tail merge) and, at some sizes, compiles new CUDA kernels (NVRTC); measured through the
server on an H100 with an 8B model, 32 clients arriving together met steps of 2.0-2.8 s at
batch sizes 2, 5 and 9 and 70-200 ms at the others while the batch grew, so the time to first
token of the last arrivals reached ~24 s (docs/performance.md). GPU servers pay this before
serving instead (vLLM captures its CUDA graphs for a list of batch sizes at start-up); so does
this module: one step at every size 1..N, over sessions that share one history (the
shared-part calls) and over sessions with a history each (the owned calls), plus a prefill
chunk of the configured size and a shorter one.

Invariants: nothing it makes outlives it (its caches are local and dropped; no snapshot
reaches the session store, no request is seen by the scheduler); a failure is logged and
serving goes on (the warm-up only moves compile time, it never decides what runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from segserve.server.runner.batched import decode_batch
from segserve.server.runner.forward import logits_last

log = logging.getLogger("segserve.runner")

HISTORY_TOKENS = 8  # each warm-up session's history: enough for a sealed segment


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    """What the warm-up ran and how long it took (logged at start-up, shown on `/health`)."""

    max_batch: int
    seconds: float
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch, "seconds": round(self.seconds, 2), "error": self.error}


def warm_up(
    model: Any,
    decode: Any,
    new_cache: Callable[[Any], Any],
    *,
    max_batch: int,
    prefill_chunk: int,
    vocab: int,
    stopped: Callable[[], bool] = lambda: False,
) -> WarmUpReport:
    """One decode step at every batch size 1..`max_batch` over a shared history and over
    histories of their own, and a prefill chunk of `prefill_chunk` tokens and of half that.
    `decode`: the model's batched-decode backend (None: the model does not batch, and only
    the prefill chunks run); `new_cache(base)`: a cache over a snapshot (None: empty);
    `stopped`: asked between batch sizes (a shutdown during the warm-up ends it there)."""
    t0 = time.perf_counter()
    if max_batch <= 0:
        return WarmUpReport(0, 0.0)
    try:
        histories = [_history(model, new_cache, vocab, salt) for salt in range(max_batch)]
        for n in (prefill_chunk, max(1, prefill_chunk // 2)):
            cache = new_cache(histories[0])
            mx.eval(logits_last(model, _tokens(vocab, n, salt=max_batch), cache.layers))
            _drop(cache)
        if decode is not None:
            for b in range(1, max_batch + 1):
                if stopped():
                    return WarmUpReport(max_batch, time.perf_counter() - t0, f"stopped at batch size {b}")
                for bases in ([histories[0]] * b, histories[:b]):
                    caches = [new_cache(base) for base in bases]
                    logits = decode_batch(decode, _tokens(vocab, b, salt=b), [c.layers for c in caches])
                    mx.eval(mx.argmax(logits, axis=-1))
                    for cache in caches:
                        _drop(cache)
    except Exception as exc:  # a warm-up that fails costs compile time later, nothing else
        log.warning("warm-up failed; serving without it", exc_info=True)
        return WarmUpReport(max_batch, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    return WarmUpReport(max_batch, time.perf_counter() - t0)


def _tokens(vocab: int, n: int, salt: int) -> list[int]:
    return [(7 * i + 11 + 13 * salt) % vocab for i in range(n)]


def _history(model: Any, new_cache: Callable[[Any], Any], vocab: int, salt: int) -> Any:
    """A sealed history of `HISTORY_TOKENS` tokens (its own segment)."""
    cache = new_cache(None)
    tokens = _tokens(vocab, HISTORY_TOKENS, salt)
    mx.eval(logits_last(model, tokens, cache.layers))
    cache.record_tokens(tokens)
    return cache.seal()


def _drop(cache: Any) -> None:
    """Drop the rows written after the base (a segmented cache's tail; a stock cache is
    simply let go)."""
    drop = getattr(cache, "drop_tail", None)
    if drop is not None:
        drop()
