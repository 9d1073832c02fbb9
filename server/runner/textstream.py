"""Incremental detokenization with stop strings.

Owns: `TextStream`. Engine thread only.
Invariants: text already emitted is never retracted; a stop string is never emitted
(text that could still become a stop string is held back until it cannot); an incomplete
UTF-8 sequence (decoded as U+FFFD at the end) is held back until completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already sent
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the new text that is safe to send (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self._decode(self._ids)
        for stop in self._stops:
            at = text.find(stop, max(0, self._emitted - len(stop)))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        end = min(end, len(text) - self._held_for_stop(text))
        return self._take(text[:end])

    def flush(self) -> str:
        """End of generation: whatever is held back (not a stop) goes out."""
        if self.stopped:
            return ""
        text = self._decode(self._ids).rstrip("\ufffd")
        return self._take(text)

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best

    def _take(self, upto: str) -> str:
        if len(upto) <= self._emitted:
            return ""
        out = upto[self._emitted :]
        self._emitted = len(upto)
        return out
