"""Speculative decoding: when to draft, how far, and what each sequence's drafts earned.

A decoding sequence's step may carry a draft (drafters.py) after its last token: the backend computes
every position's logits in that one step, and the output processor checks them in order
(OutputProcessor.verify): each position's token is chosen exactly as without a draft (greedy: the
argmax under the grammar's mask; sampling: rejection sampling against the draft, which keeps the
target distribution), and the draft's tokens count while they agree. The first disagreement is
replaced by the chosen token and ends the step. The KV of the positions past it is simply never
marked computed: the next step writes over it, and the prefix cache and the KV store only ever see
accepted tokens (they follow `n_computed`).

Knowing when not to: a draft of k tokens makes the step wider, and what a wider step costs is
measured (StepCosts: fitted online to this worker's own decode steps, with and without drafts). Each
sequence keeps its per-token acceptance (guesses kept against guesses refused, a moving average;
before it has a record, the length of the match its drafter found stands in for it); a
draft of k then yields (1 - a^(k+1)) / (1 - a) tokens where a step without one yields 1, for the
step's cost plus k times what a draft token costs to make (a draft model's passes). The draft
length is the k that gives the batch the most tokens per second, and there is no draft unless that
beats drafting nothing by MIN_GAIN: on a GPU, where a wider decode step costs little, drafts are long
where agent traffic repeats; on the CPU reference, where each position costs real time, only copies
are drafted. A sequence whose drafts do not pay pauses for PAUSE_STEPS steps, then probes with a
short draft to measure again. Drafting is off above `max_batch` decoding sequences and past
`max_context` tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from .drafters import Drafter, make_drafter

ACCEPT_EMA = 0.3  # weight of the latest step in the acceptance averages
START_ACCEPTANCE = 0.6  # a sequence's first drafts are trusted this much (per token)
MIN_GAIN = 1.03  # a draft must promise at least this many times the tokens per second of none
PAUSE_STEPS = 16  # a sequence whose drafts do not pay waits at least this many steps, then probes
PROBE_DRAFT = 2  # the probe's length
PROBE_BUDGET = 0.01  # ... and long enough that probes cost at most this share of its decode time
TRUST_STEPS = 4  # drafts checked before a sequence's own acceptance replaces the match-length prior
MATCH_PRIOR = 2.0  # a match of n tokens is trusted n / (n + MATCH_PRIOR) before that
LONG_MATCH = 8  # a match this long ends the pause of a sequence without a record (a copy has begun)
COST_MEMORY = 0.98  # forgetting factor of the step-cost fit (about the last 50 steps)
MIN_COST_STEPS = 8  # steps of each kind (with and without drafts) before the fit is trusted


class _Fit:
    """seconds = a + b x tokens by least squares, with forgetting (about the last 50 steps)."""

    def __init__(self) -> None:
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        m = COST_MEMORY
        self.n += 1
        self._w, self._x, self._y = m * self._w + 1, m * self._x + tokens, m * self._y + seconds
        self._xx, self._xy = m * self._xx + tokens * tokens, m * self._xy + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(a, b); b is 0 where every step had the same size (then a is their mean time)."""
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        b = max(0.0, (self._xy / self._w - mx * my) / var) if var > 1e-9 else 0.0
        return max(1e-6, my - b * mx), b


class StepCosts:
    """What a decode step costs, fitted online to this worker's own steps: steps of one token a
    sequence and wider ones apart, since a wider step may take another path altogether (the numpy
    backend's matmuls leave matrix-vector products for matrix products at two rows: 27 against 78 ms on
    the 270M's output projection, 2 cores)."""

    def __init__(self) -> None:
        self.narrow, self.wide = _Fit(), _Fit()

    def observe(self, tokens: int, sequences: int, seconds: float) -> None:
        (self.wide if tokens > sequences else self.narrow).add(tokens, seconds)

    @property
    def wants_narrow(self) -> bool:
        """A step without a draft is needed to fit the model (copies draft at every step)."""
        return self.narrow.n < MIN_COST_STEPS and self.wide.n >= self.narrow.n

    def model(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """((a, b) of steps without drafts, (a, b) of steps with them) once both were seen enough."""
        if self.narrow.n < MIN_COST_STEPS or self.wide.n < MIN_COST_STEPS:
            return None
        return self.narrow.line(), self.wide.line()


def tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens a step yields with a draft of k whose guesses each stand with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(eq=False)
class SpecState:
    """One sequence's drafting: its token index, the draft in flight, and what drafts have earned."""

    index: Any  # the drafter's per-sequence state (drafters.Drafter.new_index)
    pending: list[int] = field(default_factory=list)  # the draft the planned step carries
    kept: float = START_ACCEPTANCE  # moving averages of guesses kept and refused a step
    refused: float = 1.0 - START_ACCEPTANCE
    paused: int = 0  # steps left without drafting
    probe: bool = False  # the next draft is a probe (after a pause)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps run

    @property
    def acceptance(self) -> float:
        """The chance that a guess stands, given the one before it stood."""
        return self.kept / max(self.kept + self.refused, 1e-9)


class Speculator:
    """The engine's speculation: its drafter and the policy above."""

    def __init__(self, drafter: str | Drafter, k: int = 8, max_batch: int = 8, max_context: int = 32768):
        self.drafter: Drafter = make_drafter(drafter) if isinstance(drafter, str) else drafter
        self.k, self.max_batch, self.max_context = k, max_batch, max_context
        self.draft_seconds = 0.0  # host time spent drafting, not yet counted in the metrics
        self.costs = StepCosts()  # the engine feeds it every decode step's size and time
        self.draft_cost = 0.0  # seconds to make one draft token (a moving average)

    def state(self) -> SpecState:
        return SpecState(self.drafter.new_index())

    def draft(self, st: SpecState, tokens: list[int], decoding: int, blocks: list[int] | None = None) -> list[int]:
        """The draft for a sequence's next step ([] for none). decoding: sequences decoding this step;
        blocks: where the sequence's KV lives (read by a drafter that drafts from it: mtp)."""
        st.index.sync(tokens, blocks)
        if decoding > self.max_batch or len(tokens) >= self.max_context or self.costs.wants_narrow:
            return []
        if st.paused > 0 and st.steps >= TRUST_STEPS:  # nothing a draft says ends this pause: make none
            st.paused -= 1
            st.probe = st.paused == 0
            return []
        k = min(self.k, self.max_context - len(tokens) - 1)
        draft, match = self._propose(st, k) if k > 0 else ([], 0)
        if st.paused > 0:
            st.paused -= 1
            # a long match ends the pause of a sequence that has no record of its own yet
            if not (draft and st.steps < TRUST_STEPS and match >= LONG_MATCH):
                st.probe = st.paused == 0
                return []
            st.paused = 0
        if not draft:
            return []
        if st.probe:
            st.probe = False
            return draft[:PROBE_DRAFT]
        # a sequence's own record, once it has one; before, the match's length says how likely a copy is
        alpha = st.acceptance if st.steps >= TRUST_STEPS else max(st.acceptance, match / (match + MATCH_PRIOR))
        k = self.best_length(alpha, len(draft), decoding)
        if k == 0:
            st.paused = self.pause_steps(decoding)
        return draft[:k]

    def _propose(self, st: SpecState, k: int) -> tuple[list[int], int]:
        t0 = time.monotonic()
        draft, match = self.drafter.propose(st.index, k)
        spent = time.monotonic() - t0
        self.draft_seconds += spent
        if draft:  # what a drafted token costs to make (a draft model's forward passes; ~0 for the n-gram ones)
            self.draft_cost = (1 - ACCEPT_EMA) * self.draft_cost + ACCEPT_EMA * spent / len(draft)
        return draft, match

    def pause_steps(self, decoding: int) -> int:
        """Steps between probes: where a probe's wider step costs much more than a plain one (the CPU
        reference), probes are rare enough to cost at most PROBE_BUDGET of the decode time."""
        model = self.costs.model()
        if model is None:
            return PAUSE_STEPS
        (an, bn), (aw, bw) = model
        plain = an + bn * decoding
        extra = max(0.0, aw + bw * (decoding + PROBE_DRAFT) - plain)
        return max(PAUSE_STEPS, math.ceil(extra / (PROBE_BUDGET * plain)))

    def best_length(self, alpha: float, k_max: int, decoding: int) -> int:
        """The draft length that gives a step of `decoding` sequences the most tokens per second, or 0
        where none beats drafting nothing by MIN_GAIN (no cost fit yet: the longest)."""
        model = self.costs.model()
        if model is None:
            return k_max
        (an, bn), (aw, bw) = model
        best_k, best = 0, decoding / (an + bn * decoding) * MIN_GAIN
        for k in range(1, k_max + 1):
            rate = (decoding - 1 + tokens_per_step(alpha, k)) / (aw + bw * (decoding + k) + self.draft_cost * k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def take_draft_seconds(self) -> float:
        spent, self.draft_seconds = self.draft_seconds, 0.0
        return spent

    def record(self, st: SpecState, drafted: int, accepted: int) -> None:
        st.drafted += drafted
        st.accepted += accepted
        st.steps += 1
        st.kept = (1 - ACCEPT_EMA) * st.kept + ACCEPT_EMA * accepted
        st.refused = (1 - ACCEPT_EMA) * st.refused + ACCEPT_EMA * (1 if accepted < drafted else 0)

    def finished(self, tokens: list[int], prompt_len: int) -> None:
        self.drafter.finished(tokens, prompt_len)

    def release(self, st: SpecState) -> None:
        self.drafter.release(st.index)
