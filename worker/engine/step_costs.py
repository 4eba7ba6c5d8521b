"""What a step costs on this device, fitted from the steps the engine times.

PrefillCost: a prefill's time is about `fixed + per_token * tokens`: the fixed part is the host's
launches and the weights read once per step, the per-token part the compute. A rate alone (tokens per
second) mixes the two, so small warm-admit prefills (tens of tokens, mostly fixed cost) would make the
device look slow and large prefills look slower than they are. The engine feeds every planned step to
a least-squares fit over its recent steps (older ones weigh less); with too little spread in the step
sizes it falls back to a rate through zero. It answers how long a prefill of N tokens takes (restore
or recompute), and is kept across restarts beside the KV blocks.

StepCost: a whole step's time at the depth it runs at (decode rows reading long KV, prefill chunks
deep in a conversation), which sizes the prefill a step may carry within the decode-latency target
(prefill_sizing.py).
"""

from __future__ import annotations

import math

import numpy as np

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

    def seconds(self, tokens: int) -> float | None:
        m = self.model
        return None if m is None else m[0] + m[1] * tokens

    def to_json(self) -> dict | None:
        m = self.model
        return None if m is None else {"fixed_s": m[0], "per_token_s": m[1]}

    @classmethod
    def from_json(cls, data) -> PrefillCost:
        if isinstance(data, dict) and float(data.get("per_token_s") or 0) > 0:
            return cls(max(0.0, float(data.get("fixed_s") or 0)), float(data["per_token_s"]))
        return cls()


# -- a step's time at the depth it runs at ------------------------------------------------------------------

# The units StepCost fits in: a step, a thousand tokens, a million keys, ten million query-key pairs (a
# step's features then lie around 0-10, and the normal equations stay well conditioned).
UNITS = (1.0, 1e3, 1e6, 1e7)
PRIOR_WEIGHT = 0.1  # what the calibration's figures weigh in the fit, in steps of unit features


def is_prompt_chunk(c) -> bool:
    """A chunk of more than one prompt token: compute-bound prefill. A decode row, a draft's positions
    and a cached prompt's last token (computed alone) are one row that reads its sequence's KV."""
    return c.prefill and len(c.tokens) > 1


def step_features(chunks) -> tuple[int, int, int]:
    """(tokens, keys, pairs) of a step's chunks (backends.base.SeqChunk). A decode row or a draft (a chunk
    that is not a prompt's, or one token) reads its sequence's whole KV once: its keys grow with depth,
    a memory-bound cost. A prefill chunk of n tokens at position `at` scores n*at + n(n+1)/2 query-key
    pairs: a compute-bound cost that grows with depth too."""
    tokens = keys = pairs = 0
    for c in chunks:
        n, at = len(c.tokens), c.start
        tokens += n
        if is_prompt_chunk(c):
            pairs += n * at + n * (n + 1) // 2
        else:
            keys += at + n
    return tokens, keys, pairs


class StepCost:
    """What a step takes: about fixed + per_token * tokens + per_key * keys + per_pair * pairs
    (step_features). A model of tokens alone, timed at position 0, sizes prefill chunks that take twice
    as long 30k tokens into a conversation, and stalls every decoding stream by the difference.

    Fitted by least squares over the engine's recent steps (older ones weigh less, DECAY), and pulled
    toward the figures timed at start (the prior, PRIOR_WEIGHT) where the steps leave a coefficient
    undetermined (nothing decodes deep yet, say). No coefficient is negative (one that would be is held
    at zero and the rest refitted)."""

    def __init__(self, prior: tuple[float, float, float, float] | None = None):
        self._prior = np.array(prior, float) * UNITS if prior is not None else None
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self._coef = self._prior
        self.steps = 0

    def observe(self, features: tuple[int, int, int], seconds: float) -> None:
        if seconds <= 0 or features[0] <= 0:
            return
        x = np.array((1.0, *features), float) / UNITS
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * seconds
        self.steps += 1
        self._coef = None  # refitted when next asked

    @property
    def coefficients(self) -> np.ndarray | None:
        """Seconds per unit of each feature (UNITS), or None before anything is known."""
        if self._coef is None and (self.steps or self._prior is not None):
            self._coef = _fit(self._xx, self._xy, self._prior)
        return self._coef

    def seconds(self, features: tuple[int, int, int]) -> float | None:
        c = self.coefficients
        return None if c is None else float(c @ (np.array((1.0, *features), float) / UNITS))

    def prefill_within(self, features: tuple[int, int, int], at: int, seconds: float) -> int | None:
        """The most prompt tokens a chunk at position `at` may add to a step of `features` that is to
        take at most `seconds` (0: not one; None: nothing known)."""
        c = self.coefficients
        base = self.seconds(features)
        if c is None or base is None:
            return None
        room = seconds - base
        if room <= 0:
            return 0
        per_token, per_pair = c[1] / UNITS[1], c[3] / UNITS[3]
        # per_pair/2 n^2 + (per_token + per_pair (at + 1/2)) n <= room
        b = per_token + per_pair * (at + 0.5)
        if per_pair <= 0:
            return int(room / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 2 * per_pair * room)) / per_pair)

    def to_json(self) -> dict | None:
        c = self.coefficients
        if c is None:
            return None
        return dict(zip(("fixed_s", "per_token_s", "per_key_s", "per_pair_s"), (c / UNITS).tolist(), strict=True))


def _fit(xx: np.ndarray, xy: np.ndarray, prior: np.ndarray | None) -> np.ndarray:
    """Least squares with the prior as a ridge, coefficients held at zero where they would go below it."""
    lam = PRIOR_WEIGHT if prior is not None else 1e-9
    target = prior if prior is not None else np.zeros(4)
    free = [0, 1, 2, 3]
    coef = np.zeros(4)
    while free:
        a = xx[np.ix_(free, free)] + lam * np.eye(len(free))
        b = xy[free] + lam * target[free]
        sol = np.linalg.solve(a, b)
        if (sol >= 0).all():
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))
    return coef
