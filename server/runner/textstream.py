"""Incremental detokenization with stop strings.

Owns: `TextStream`. Engine thread only (one stream per request; not shared).
Why on the engine thread: a stop string ends generation at the token that completes it, so
the turn the bank stores holds exactly the text the client received; a stream run on
another thread would learn of the stop a step or more late and the stored turn would hold
tokens the client never saw. The window below keeps the cost per token small and flat
(`bench/detokenize.py`).
Invariants: text already emitted is never retracted; a stop string is never emitted
(text that could still become a stop string is held back until it cannot); an incomplete
UTF-8 sequence (decoded as U+FFFD at the end) is held back until completed; the cost of a
token does not grow with the length of the output.

How (the scheme of vLLM's and text-generation-inference's incremental detokenizers): only
a short window of ids is decoded per token. `_prefix.._read` are context ids whose text is
already final; `_read..` are ids whose text is not yet final. Each token decodes the
window `ids[_prefix:]` and keeps the part past the context's own text
(`decode(ids[_prefix:_read])`). The context is there because a window's first token can
decode differently alone (SentencePiece strips the leading space of the first piece).
When the new text ends cleanly (no trailing U+FFFD) the window slides: the read ids become
the next context. While it ends in U+FFFD (a multi-byte character split across byte
tokens, or a run of byte-fallback tokens, which decode as one U+FFFD per byte until the run
is valid UTF-8) nothing is final and the window grows; a valid character needs at most 4
byte tokens, so only invalid bytes keep it growing, and after `_MAX_PENDING` ids with no
clean end the replacement characters are taken as final (a full decode could then differ
only inside such invalid bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
# Ids that may stay undecided before their text is taken as final (see the module doc).
_MAX_PENDING = 32


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self._ids: list[int] = []
        self._prefix = 0  # first id of the decode window (context only)
        self._read = 0  # first id whose text is not final
        self._context = ""  # decode(ids[_prefix:_read]), cached
        self._held = ""  # final text not yet sent: it could begin a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the new text that is safe to send (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token)
        return self._emit(self._advance(final=False), at_end=False)

    def flush(self) -> str:
        """End of generation: whatever is held back (not a stop) goes out."""
        if self.stopped:
            return ""
        return self._emit(self._advance(final=True), at_end=True)

    def _advance(self, *, final: bool) -> str:
        """The text that became final since the last call."""
        if self._read == len(self._ids):
            return ""
        pending = self._decode(self._ids[self._prefix :])[len(self._context) :]
        clean = pending.rstrip(_REPLACEMENT)
        too_long = len(self._ids) - self._read > _MAX_PENDING
        if final:  # an incomplete character at the very end is dropped, as before
            pending = clean
        elif clean != pending and not too_long:
            # Characters before the trailing U+FFFDs can still change (byte fallback), so
            # nothing of this window is passed on until it ends cleanly.
            return ""
        self._slide()
        return pending

    def _slide(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._context = self._decode(self._ids[self._prefix : self._read])

    def _emit(self, new: str, *, at_end: bool) -> str:
        """Stop-string handling on the final text: send what cannot begin a stop."""
        buf = self._held + new
        hits = [at for at in (buf.find(stop) for stop in self._stops) if at != -1]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = 0 if at_end else self._held_for_stop(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
