"""What this worker's steps cost, sampled from the steps themselves, and kept for the next process.

Every step the scheduler planned (not one launched ahead, whose time overlaps the step before it)
is timed: the whole step feeds the step cost model that sizes prefill chunks at depth (step_costs.StepCost,
where the engine sizes them), its prompt tokens the prefill cost fit (step_costs.PrefillCost, through the
restore policy's RestoreCosts: restore or recompute), and a step without prefill feeds
speculative decoding's fit of what a wider decode step costs (spec/speculation.StepCosts). The
measured rates are written beside the KV blocks (`rates.json`) now and then and at shutdown, so a
restarted worker decides its first warm admits by them. Deciding anything from them is not here.

The same timings say how the decode-latency target is held: every step with a decoding stream in it
counts in `ember_step_seconds{kind}` (decode, or decode+prefill), one that took longer than
`--itl-target-ms` in `ember_steps_over_itl_target`, and such a step is logged (`step_over_target`: what it
carried, what the model predicted, what it took; at most one line every OVER_LOG_SECONDS, with the
count since the last), which is where a model that under-predicts some step shape shows.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..backends.base import SeqChunk
from ..logs import log
from ..metrics import Metrics
from .restore_policy import RestoreCosts
from .spec.speculation import Speculator
from .step_costs import StepCost, is_prompt_chunk, step_features

RATES_SAVE_SECONDS = 30.0  # how often the measured prefill and restore rates are written for the next process
OVER_LOG_SECONDS = 10.0  # at most one step_over_target line this often: a target missed every step is one line


class CostSampler:
    def __init__(self, costs: RestoreCosts, speculator: Speculator | None, store=None,
                 itl_target_s: float | None = None, metrics: Metrics | None = None):
        """store: the KVStore (None: no rates are kept); its directory holds rates.json. itl_target_s: the
        decode-latency target the steps with decoding streams are held to (None: none)."""
        self.costs, self.speculator, self.store = costs, speculator, store
        self.itl_target_s, self.metrics = itl_target_s, metrics
        self.path: Path | None = store.dir / "rates.json" if store is not None else None
        if self.path is not None:
            costs.load(self.path)
        self._saved: float | None = None  # the first rate measured is written at once
        self.step_cost: StepCost | None = None  # the engine's, once calibrated
        self._over_logged: float | None = None  # when the last step_over_target line was written
        self._over_since = 0  # steps over the target since that line

    def observe(self, chunks: list[SeqChunk], seconds: float, now: float | None = None) -> None:
        """A planned step took `seconds` (and ended at `now`, monotonic)."""
        features = step_features(chunks)
        predicted = self.step_cost.seconds(features) if self.step_cost is not None else None
        self._held_to_target(chunks, features, predicted, seconds, time.monotonic() if now is None else now)
        if self.step_cost is not None:
            self.step_cost.observe(features, seconds)
        self.costs.observe_prefill(sum(len(c.tokens) for c in chunks if is_prompt_chunk(c)), seconds)
        if self.speculator is not None and not any(c.prefill for c in chunks):  # what a wider step costs
            self.speculator.costs.observe(sum(len(c.tokens) for c in chunks), len(chunks), seconds)

    def _held_to_target(self, chunks: list[SeqChunk], features: tuple[int, int, int], predicted: float | None,
                        seconds: float, now: float) -> None:
        rows = [c for c in chunks if not is_prompt_chunk(c)]
        if not rows:  # nobody waited on this step's tokens
            return
        decode_rows = len(rows)
        prefill_tokens = features[0] - sum(len(c.tokens) for c in rows)
        if self.metrics is not None:
            self.metrics.step_seconds.labels("decode+prefill" if prefill_tokens else "decode").observe(seconds)
        if self.itl_target_s is None or self.step_cost is None or seconds <= self.itl_target_s:
            return  # no target, or steps not sized to it (nothing calibrated: numpy's fixed chunks)
        if self.metrics is not None:
            self.metrics.steps_over_target.inc()
        self._over_since += 1
        if self._over_logged is not None and now - self._over_logged < OVER_LOG_SECONDS:
            return
        log("step_over_target", level="warning", took_ms=round(seconds * 1000, 2),
            predicted_ms=None if predicted is None else round(predicted * 1000, 2),
            target_ms=round(self.itl_target_s * 1000, 1), decode_rows=decode_rows, prefill_tokens=prefill_tokens,
            keys=features[1], pairs=features[2], over_since_last=self._over_since)
        self._over_logged, self._over_since = now, 0

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
