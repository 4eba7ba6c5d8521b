"""What this worker's steps cost, sampled from the steps themselves, and kept for the next process.

Every step the scheduler planned (not one launched ahead, whose time overlaps the step before it)
is timed: the whole step feeds the step cost model that sizes prefill chunks at depth (step_costs.StepCost,
where the engine sizes them), its prompt tokens the prefill cost fit (step_costs.PrefillCost, through the
restore policy's RestoreCosts: restore or recompute), and a step without prefill feeds
speculative decoding's fit of what a wider decode step costs (spec/speculation.StepCosts). The
measured rates are written beside the KV blocks (`rates.json`) now and then and at shutdown, so a
restarted worker decides its first warm admits by them. Deciding anything from them is not here.
"""

from __future__ import annotations

from pathlib import Path

from ..backends.base import SeqChunk
from .restore_policy import RestoreCosts
from .spec.speculation import Speculator
from .step_costs import StepCost, step_features

RATES_SAVE_SECONDS = 30.0  # how often the measured prefill and restore rates are written for the next process


class CostSampler:
    def __init__(self, costs: RestoreCosts, speculator: Speculator | None, store=None):
        """store: the KVStore (None: no rates are kept); its directory holds rates.json."""
        self.costs, self.speculator, self.store = costs, speculator, store
        self.path: Path | None = store.dir / "rates.json" if store is not None else None
        if self.path is not None:
            costs.load(self.path)
        self._saved: float | None = None  # the first rate measured is written at once
        self.step_cost: StepCost | None = None  # the engine's, once calibrated

    def observe(self, chunks: list[SeqChunk], seconds: float) -> None:
        """A planned step took `seconds`."""
        if self.step_cost is not None:
            self.step_cost.observe(step_features(chunks), seconds)
        # a draft's positions are not prefill: only chunks of more than one prompt token count
        self.costs.observe_prefill(sum(len(c.tokens) for c in chunks if c.prefill and len(c.tokens) > 1), seconds)
        if self.speculator is not None and not any(c.prefill for c in chunks):  # what a wider step costs
            self.speculator.costs.observe(sum(len(c.tokens) for c in chunks), len(chunks), seconds)

    def save_due(self, now: float) -> None:
        """Write the rates if something was measured and the last write is RATES_SAVE_SECONDS old."""
        if self.path is None or not self.store.writable or self.costs.prefill.model is None:
            return
        if self._saved is None or now - self._saved > RATES_SAVE_SECONDS:
            self._saved = now
            self.costs.save(self.path)

    def save(self) -> None:
        """Write the rates now (the loop is stopping)."""
        if self.path is not None and self.store.writable:
            self.costs.save(self.path)
