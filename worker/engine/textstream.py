"""Stop strings matched across token boundaries, without leaking partial stop text."""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text; get back text that is safe to emit.

    Text that could still turn into a stop string is held back until the next piece decides it.
    When a stop string appears, everything before it is released and the match is reported.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        self.pending += text
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            out = self.pending[: first[0]]
            self.pending = ""
            return out, first[1]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
