"""Generations that end: a repetition (loop) guard and a bounded default output cap.

`LoopGuard` is fed generated token ids one at a time.  It reports True once the most recent
tokens are one block of length L repeated K times back to back, for some L in [1, max_period].

How: for every period L it keeps run[L] = how many consecutive most-recent positions i satisfy
tok[i] == tok[i-L].  The last K*L tokens are a block of length L repeated K times exactly when
run[L] >= (K-1)*L.  Each token costs O(max_period) time; memory is O(max_period).

Short periods are noisy in real text (four spaces, "----"), so `min_span` raises the repeat
count for them: period L must repeat max(repeats, ceil(min_span / L)) times.
"""

from __future__ import annotations


class LoopGuard:
    def __init__(self, max_period: int = 64, repeats: int = 8, min_span: int = 64):
        if max_period < 1:
            raise ValueError("max_period must be >= 1")
        if repeats < 2:
            raise ValueError("repeats must be >= 2")
        self.max_period = max_period
        self.repeats = repeats
        self.min_span = max(0, min_span)
        # need[L]: run length (matching positions) that proves L-periodicity over the required span
        self._need = [0] + [
            (max(repeats, -(-self.min_span // L)) - 1) * L for L in range(1, max_period + 1)
        ]
        self._run = [0] * (max_period + 1)
        self._ring = [0] * (max_period + 1)  # last max_period+1 tokens
        self._n = 0
        self.triggered = False
        self.period: int | None = None  # the period that triggered, for the log line

    def reset(self) -> None:
        self._run = [0] * (self.max_period + 1)
        self._n = 0
        self.triggered = False
        self.period = None

    def feed(self, token: int) -> bool:
        """Add one generated token; True when the tail is a loop (stays True once triggered)."""
        size = self.max_period + 1
        ring, run, need = self._ring, self._run, self._need
        n = self._n
        hit = None
        for L in range(1, min(n, self.max_period) + 1):
            if ring[(n - L) % size] == token:
                r = run[L] + 1
                run[L] = r
                if hit is None and r >= need[L]:
                    hit = L
            else:
                run[L] = 0
        ring[n % size] = token
        self._n = n + 1
        if hit is not None and not self.triggered:
            self.triggered = True
            self.period = hit
        return self.triggered


def default_max_tokens(context_limit: int, prompt_tokens: int, cap: int | None = None) -> int:
    """Output-token budget when the request gives none: what is left of the context, optionally
    capped.  Always a finite int >= 0 (0 means the prompt already fills the context)."""
    if context_limit is None or context_limit <= 0:
        raise ValueError("context_limit must be a positive int")
    left = max(0, int(context_limit) - max(0, int(prompt_tokens)))
    if cap is not None and cap > 0:
        left = min(left, int(cap))
    return left
