"""Typed messages between the engine thread and the HTTP side.

Owns: `GenerationRequest` (in), the events `Started`, `Token`, `Done`, `Failed` (out) and
`RequestHandle` (the HTTP side's end: an asyncio queue fed by the engine thread through
`loop.call_soon_threadsafe`, plus a thread-safe cancel flag).

Event order of one request: `Started`, then `Token`s, then one `Done` per choice (or one
`Failed`, which ends the request whatever choices were done). With `n` > 1 choices, `Token`
and `Done` carry the choice's `index`; a reader waits for `n` `Done`s. Every `Done` carries
the request's prompt and cached token counts (count them once) and its own choice's
`completion_tokens`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from segserve.server.engine.errors import EngineError
from segserve.server.scheduling.params import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    session_id: str | None = None
    salt: str | None = None
    # A per-request grammar matcher (`segserve.server.chat.grammar.GrammarMatcher`: `mask()`,
    # `accept(token)`, `is_finished()`) for `response_format` / forced tool calls; None =
    # unconstrained. The runner masks the logits with it and ends the row when it finishes;
    # with n > 1 each further choice gets a `copy()` of it, made before any token.
    matcher: Any | None = None
    # Choices: one prefill, then n rows over the sealed prompt (shared segments, a tail
    # each); choice i samples with seed + i when a seed is given. Choice 0's turn is the
    # one stored in the session (the others' tails are dropped when they end).
    n: int = 1
    # False: a request that is cancelled or fails stores nothing (not even its sealed
    # prompt); its caller drops the session (`/v1/responses`: nothing uncommitted stays).
    store_unfinished: bool = True
    # Continue a stored conversation: (session, turn; None = its latest). The scheduler,
    # just before the request's first lookup, makes `session_id` a fork of it (its segments shared, no
    # rows copied), so the lookup reuses them; if that turn is gone, nothing is forked and the
    # prompt is prefilled from text. Needs `session_id` (the new session's id).
    continue_from: tuple[str, int | None] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing between the logits and the argmax and no logprobs: the
        runner's `_plain_greedy` rows, which admission prices with less step scratch."""
        return self.sampling.plain_argmax and not self.sampling.logprobs and self.matcher is None


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    cached_tokens: int
    session_id: str | None


@dataclass(frozen=True, slots=True)
class Token:
    text: str
    token_id: int
    logprob: TokenLogprob | None
    index: int = 0  # the choice


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    session_id: str | None
    tail_text: str = ""  # held-back text released at the end (no token attached)
    index: int = 0  # the choice that ended; completion_tokens are its own
    # Speculative decoding of this choice: draft tokens verified and accepted (access log).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Where the stored turn (choice 0's) sits in its session: its turn index (for a later
    # `continue_from`); None when nothing was stored or the store keeps no sessions.
    turn: int | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    error: EngineError


Event = Started | Token | Done | Failed


@dataclass(eq=False)
class RequestHandle:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def emit(self, event: Event) -> None:
        """Engine thread → event loop; never blocks the engine."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            self._cancel.set()  # the event loop is gone: nobody is listening any more

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()
