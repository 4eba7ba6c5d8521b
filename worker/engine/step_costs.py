"""What a prefill step costs on this device: a fixed part and a part per prompt token.

A step's time is about `fixed + per_token * tokens`: the fixed part is the host's launches and the
weights read once per step, the per-token part the compute. A rate alone (tokens per second) mixes
the two, so small warm-admit prefills (tens of tokens, mostly fixed cost) would make the device
look slow and large prefills look slower than they are. The engine feeds every planned step to a
least-squares fit over its recent steps (older ones weigh less); with too little spread in the
step sizes it falls back to a rate through zero. The fit answers how long a prefill of N tokens
takes (restore or recompute) and how many tokens fit a step time (the prefill chunk), and is kept
across restarts beside the KV blocks.
"""

from __future__ import annotations

MIN_TOKENS = 16  # steps with fewer prefill tokens are decode steps
DECAY = 0.98  # of the older steps' weight at each new one (about the last fifty steps count)
READY_WEIGHT = 2.5  # (decayed) steps before the fit replaces the remembered figures


class PrefillCost:
    def __init__(self, fixed_s: float | None = None, per_token_s: float | None = None):
        # from a previous process
        self._prior: tuple[float, float] | None = (fixed_s or 0.0, per_token_s) if per_token_s else None
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        d = DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds

    @property
    def model(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before anything is known."""
        if self._w < (READY_WEIGHT if self._prior else 1e-9):
            return self._prior
        w, x, y = self._w, self._x, self._y
        var = self._xx * w - x * x
        if var > (0.1 * x) ** 2:  # sizes spread enough to tell the fixed part from the rest
            per = (self._xy * w - x * y) / var
            fixed = (y - per * x) / w
            if per > 0 and fixed >= 0:
                return fixed, per
        # noise hid the fixed part: a rate through zero, fitted so the large steps count most
        return 0.0, self._xy / self._xx

    @classmethod
    def measured(cls, samples: list[tuple[int, float]]) -> PrefillCost:
        """The cost as `samples` (tokens, seconds) of prefills timed on purpose show it."""
        cost = cls()
        for tokens, seconds in samples:
            cost.observe(tokens, seconds)
        m = cost.model
        return cls(*m) if m is not None else cls()

    def seconds(self, tokens: int) -> float | None:
        m = self.model
        return None if m is None else m[0] + m[1] * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """Prompt tokens one step can prefill in `seconds` (0 when its fixed part alone is longer)."""
        m = self.model
        return None if m is None else max(0, int((seconds - m[0]) / m[1]))

    def to_json(self) -> dict | None:
        m = self.model
        return None if m is None else {"fixed_s": m[0], "per_token_s": m[1]}

    @classmethod
    def from_json(cls, data) -> PrefillCost:
        if isinstance(data, dict) and float(data.get("per_token_s") or 0) > 0:
            return cls(max(0.0, float(data.get("fixed_s") or 0)), float(data["per_token_s"]))
        return cls()
