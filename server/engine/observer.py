"""What the engine reports while it works: a recorder interface and its no-op.

Owns: `EngineObserver` (Protocol) and `NullObserver`. The Prometheus implementation lives in
`segserve.server.http.metrics` (the only module importing prometheus_client); tests use the no-op or a
counting fake. Metrics off = `NullObserver`, not a flag checked at each call site.
"""

from __future__ import annotations

from typing import Protocol


class EngineObserver(Protocol):
    def waiting(self, n: int) -> None: ...
    def running(self, n: int) -> None: ...
    def prefilled_tokens(self, n: int) -> None: ...
    def cached_tokens(self, n: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def request_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, seconds: float,
        per_output_token_s: float | None,
    ) -> None:
        """A request ended with `reason` ("stop"/"length"): its usage numbers, arrival to
        last token, and the mean time per output token after the first (None for one)."""
    def session_segments(self, n: int) -> None: ...
    def lookup(self, kind: str) -> None: ...
    def cancelled(self) -> None: ...
    def decision(self, decision: str, reason: str) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def intervention(self, reason: str) -> None: ...
    def request_failed(self, phase: str) -> None: ...


class NullObserver:
    def waiting(self, n: int) -> None:
        pass

    def running(self, n: int) -> None:
        pass

    def prefilled_tokens(self, n: int) -> None:
        pass

    def cached_tokens(self, n: int) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def request_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, seconds: float,
        per_output_token_s: float | None,
    ) -> None:
        pass

    def session_segments(self, n: int) -> None:
        pass

    def lookup(self, kind: str) -> None:
        pass

    def cancelled(self) -> None:
        pass

    def decision(self, decision: str, reason: str) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def intervention(self, reason: str) -> None:
        pass

    def request_failed(self, phase: str) -> None:
        pass
