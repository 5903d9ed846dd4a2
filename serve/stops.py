"""Stop strings over streamed text: nothing of a stop string ever reaches the client (case S7).

:class:`StopMatcher` receives decoded text piece by piece and releases only text that can no longer be part
of a stop string: a tail that is a prefix of some stop string is held back until the next piece resolves it.
When a stop string appears — even spanning many pieces — the output ends right before its first occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Incremental stop-string matcher.

    ``push(piece) -> str`` returns newly released text (possibly ""); once a stop string is found,
    ``stop_at`` is its character offset in the whole text and further pushes return "". ``finish() -> str``
    releases whatever is still held (call it when generation ends without a stop). ``released`` counts the
    characters released so far.
    """

    def __init__(self, stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0
        self.stop_at: int | None = None

    def push(self, piece: str) -> str:
        """Add decoded text; return the part that is now safe to send."""
        if self.stop_at is not None:
            return ""
        self.text += piece
        if not self.stops:
            return self._release(len(self.text))
        hits = [i for i in (self.text.find(s, self.released) for s in self.stops) if i >= 0]
        if hits:
            self.stop_at = min(hits)
            return self._release(self.stop_at)
        return self._release(self._hold_from())

    def finish(self) -> str:
        """Generation ended without (another) stop string: release everything held."""
        if self.stop_at is not None:
            return ""
        return self._release(len(self.text))

    def _hold_from(self) -> int:
        """The earliest offset whose tail could still grow into a stop string (len(text) when none)."""
        n = len(self.text)
        for p in range(max(self.released, n - self._longest + 1), n):
            tail = self.text[p:]
            if any(s.startswith(tail) for s in self.stops):
                return p
        return n

    def _release(self, upto: int) -> str:
        out = self.text[self.released:upto]
        self.released = upto
        return out
