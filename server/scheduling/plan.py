"""Typed messages of one engine step: the scheduler's plan, the runner's output, the update.

Owns: `StepPlan` (what to run now: who was admitted or refused, which prefill chunk, which
decode batch), `StepOutput` (what the runner did: sampled tokens, per-request failures) and
`StepUpdate` (what the scheduler concluded: who finished and why). All frozen, plain values:
the scheduler and its tests never see an array, the runner never sees a price.

The step, nano-vllm / vLLM v1 style:

    plan = scheduler.schedule(now)        # model-free
    out = runner.execute(plan)            # the model
    upd = scheduler.update_from_output(plan, out)

Token order per request: the chunk that ends the prompt also samples the first token; every
later step of that request feeds its last sampled token and samples the next (one decode
step = one forward + one sample), so a request yields one token per step once it decodes.

Choices (`n` > 1): one prefill of the prompt, then `n` rows, one per choice, each over the
sealed prompt (shared segment refs) with its own tail. A request in `StepPlan.decode` decodes
every choice of it that has not ended, so it yields one token per live choice per step;
`Sampled.choice` and `Finished.choice` say which one, `Finished.last` that it was the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from segserve.server.scheduling.admission import AdmissionDecision
    from segserve.server.scheduling.params import TokenLogprob
    from segserve.server.scheduling.store import LookupHit

Phase = Literal["admit", "prefill", "decode", "sample", "store"]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that starts this step: its history is pinned and its price reserved."""

    request_id: str
    hit: LookupHit
    waited_s: float
    speculate: bool = True  # may verify drafts (False: it fits only without their price)


@dataclass(frozen=True, slots=True)
class Refused:
    """A request that leaves the queue without running.

    `kind`: "queue_full" (429), "timeout" (503) or "insufficient_memory" (507); `decision`
    holds the numbers of an admission refusal (None for a timeout or a full queue)."""

    request_id: str
    kind: Literal["queue_full", "timeout", "insufficient_memory"]
    retry_after_s: float
    decision: AdmissionDecision | None = None


@dataclass(frozen=True, slots=True)
class AdmitFailed:
    """Lookup or pricing raised for this request (a bug): it alone is ended, holding nothing."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request_id: str
    start: int  # index into the prompt of the first token to run
    tokens: int  # how many prompt tokens run in this chunk
    last: bool  # the chunk ends the prompt: seal, then sample the first token


@dataclass(frozen=True, slots=True)
class StepPlan:
    admitted: tuple[Admitted, ...] = ()
    refused: tuple[Refused, ...] = ()
    admit_failed: tuple[AdmitFailed, ...] = ()
    cancelled: tuple[str, ...] = ()  # running requests whose client went away
    dropped: tuple[str, ...] = ()  # waiting requests whose client went away (nothing held)
    prefill: PrefillChunk | None = None
    # Feed each one's last token (every live choice's), sample the next (batched).
    decode: tuple[str, ...] = ()
    lookups: tuple[str, ...] = ()  # lookup kinds seen while deciding (for metrics)
    decisions: tuple[tuple[str, str], ...] = ()  # (decision, reason) per head decided

    @property
    def runs_model(self) -> bool:
        return self.prefill is not None or bool(self.decode)


@dataclass(frozen=True, slots=True)
class Sampled:
    """One sampled token. `text` is what the detokenizer released for it ("" for EOS)."""

    request_id: str
    token_id: int
    text: str
    logprob: TokenLogprob | None  # when the request asked for log-probabilities
    eos: bool
    stop_string: bool  # the detokenizer saw one of the request's stop strings
    grammar_done: bool = False  # the request's grammar allows nothing more (but EOS)
    choice: int = 0  # which of the request's `n` choices (0 when n == 1)


@dataclass(frozen=True, slots=True)
class RunFailure:
    request_id: str
    phase: Phase
    error: Exception


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: tuple[Sampled, ...] = ()
    failed: tuple[RunFailure, ...] = ()
    prefilled_tokens: int = 0  # prompt tokens that ran this step (0 when the chunk failed)


@dataclass(frozen=True, slots=True)
class Finished:
    """One choice ended; with `last` the request has no choice left and leaves."""

    request_id: str
    reason: FinishReason
    choice: int = 0
    last: bool = True


@dataclass(frozen=True, slots=True)
class StepUpdate:
    finished: tuple[Finished, ...] = ()
