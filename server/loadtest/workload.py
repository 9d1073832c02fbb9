"""The multi-turn workload: deterministic user text, one conversation's history, the body.

Shared by the load test and `bench/locustfile.py`, so both send the same requests. Each
conversation resends its whole history every turn, as OpenAI clients do; in `session`
mode it also names itself with `X-Session-Id` (segserve's hint for the session bank;
other servers ignore the header). A failed turn is dropped from the history, so the next
turn goes on as if it never happened.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["history", "session"]
MODES: tuple[Mode, ...] = ("history", "session")

_WORDS = (
    "memory segment tail snapshot river mountain lantern copper garden window violet "
    "harbor engine signal orbit ladder meadow thunder pocket silver marble canyon falcon "
    "compass winter quartz timber ember saddle beacon glacier velvet anchor cobalt prairie"
).split()


def user_text(seed: int, user: int, turn: int, words: int) -> str:
    """The user message of (seed, user, turn): the same text in every process and run."""
    rng = random.Random(f"{seed}/{user}/{turn}")  # a str seed hashes with SHA-512
    return f"User {user}, turn {turn}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def chat_body(
    model: str, messages: list[dict[str, str]], max_tokens: int, temperature: float
) -> dict[str, Any]:
    """A streamed chat completion that reports usage in its last chunk."""
    return {
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(slots=True)
class Conversation:
    """One simulated user's conversation: `turns` user messages, answered one at a time."""

    user: int
    seed: int
    words: int
    turns: int
    session_id: str | None = None  # sent as X-Session-Id when set
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0  # the next turn to send
    busy: bool = False
    idle_since: float = 0.0

    @property
    def done(self) -> bool:
        return self.turn >= self.turns

    def start_turn(self) -> list[dict[str, str]]:
        """Append the next user message; return the messages to send (a copy)."""
        self.busy = True
        self.messages.append(
            {"role": "user", "content": user_text(self.seed, self.user, self.turn, self.words)}
        )
        return list(self.messages)

    def end_turn(self, ok: bool, reply: str, now: float = 0.0) -> None:
        """Keep the answer (ok) or forget the turn's user message (failed); next turn."""
        if ok:
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.messages.pop()
        self.turn += 1
        self.busy = False
        self.idle_since = now

    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id} if self.session_id else {}


def conversation(
    user: int, seed: int, words: int, turns: int, mode: Mode, run_id: str
) -> Conversation:
    sid = f"loadtest-{run_id}-{user}" if mode == "session" else None
    return Conversation(user, seed, words, turns, sid)
