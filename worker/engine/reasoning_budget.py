"""The reasoning budget: a thinking model may spend at most `budget` generated tokens inside its
reasoning block; then the engine closes the block itself by emitting the `end` marker tokens as if
the model had sampled them, one per step, so the answer still follows and every consumer (the
client's stream, the API layer's reasoning parser, the grammar matcher) sees an ordinary close.

The budget bounds the whole generation: a model that opens a second block after spending it is
closed again at once.
"""

from __future__ import annotations

from .requests import ReasoningBudget


class ReasoningTracker:
    def __init__(self, budget: ReasoningBudget):
        self.start, self.end = list(budget.start), list(budget.end)
        self.budget = max(0, int(budget.budget))
        self.inside = budget.starts_inside
        self.spent = 0  # generated tokens inside reasoning blocks, markers' own tokens included
        self.forced = 0  # end-marker tokens the engine emitted itself
        self._tail: list[int] = []  # tokens since the last marker, bounded by the longest marker
        self._keep = max(len(self.start), len(self.end), 1)

    def forced_token(self) -> int | None:
        """The token the engine must emit next instead of sampling, or None to sample."""
        if not (self.inside and self.end and self.spent >= self.budget):
            return None
        return self.end[self._partial_end()]

    def feed(self, token: int) -> None:
        """Account for one emitted token (sampled or forced)."""
        self._tail.append(token)
        del self._tail[: -self._keep]
        if self.inside:
            self.spent += 1
            if _ends_with(self._tail, self.end):
                self.inside = False
                self._tail.clear()
        elif self.start and _ends_with(self._tail, self.start):
            self.inside = True
            self._tail.clear()

    def _partial_end(self) -> int:
        """How many leading tokens of `end` the block already ends with (the model began the
        marker itself): only the rest is emitted."""
        for k in range(min(len(self.end) - 1, len(self._tail)), 0, -1):
            if self._tail[-k:] == self.end[:k]:
                return k
        return 0


def _ends_with(seq: list[int], suffix: list[int]) -> bool:
    return bool(suffix) and len(seq) >= len(suffix) and seq[-len(suffix):] == suffix
