"""Generations that end: a repetition (loop) guard (the default output cap is api/common.default_max_tokens).

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

    def repeats_for(self, period: int) -> int:
        """How many back-to-back copies of a block of length `period` trigger the guard."""
        return self._need[period] // period + 1
