"""How many prompt tokens a step prefills: fixed, or sized at every step to the decode-latency target.

Every running stream gets its decode token before any prefill chunk, so a step that carries a chunk
delays every decoding stream by the chunk's compute. A fixed chunk is right for one device, model and
depth only: 2048 tokens take about 11 ms on an H200 with a 270M model and about 150 ms with an 8B one,
and the same chunk 30k tokens into a conversation costs about twice what it costs at position 0 (its
queries score every key before them). Auto sizing (the default on cuda) plans each step by what it
will cost at the depth it runs at (step_costs.StepCost): decode rows first, then each prefill chunk as
large as keeps the step's predicted time within the target (`itl_target_ms`, 50 ms by default; planned
to HEADROOM of it, as real steps scatter around the prediction), in
multiples of MIN_CHUNK, within the backend's rows (the ceiling). While nothing decodes nobody waits on
the step, and a chunk is the ceiling. A prefill that waits gets at least MIN_CHUNK tokens a step, so
churn still progresses when the decode rows alone fill the target.

The cost model starts from steps timed before serving (`calibrate`: prefills of the floor's and the
ceiling's size at position 0, the floor's deep in the pool, one decode row shallow and deep) and
follows every planned step after (cost_sampling.py). Where nothing could be timed (the ceiling no more
than the floor, numpy's 256; or no room in the pool for the ceiling's blocks) the chunk is the ceiling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, SeqChunk
from .kv_blocks import BlockPool
from .step_costs import UNITS, StepCost, step_features

FLOOR_TOKENS = 256  # below this a prefill step is mostly fixed cost; a ceiling at or below it is not sized
MIN_CHUNK = 64  # the least a waiting prefill gets in a step, and the multiple a sized chunk is cut to
CALIBRATION_DEPTH = 32768  # how deep (at most) the start's timed steps run, within the pool's room
# The share of the target a step is planned to: real steps scatter around the model's prediction (an 8B on an
# H100 under the soak's churn, planned to the whole target: ITL p50 0.98 of it, p99 1.13), and the target
# is a p99 to hold.
HEADROOM = 0.85


@dataclass(frozen=True)
class PrefillSizing:
    most: int  # the fixed chunk, or auto's ceiling (the backend's rows per step)
    itl_target_s: float | None = None  # auto: what a step may take while streams decode; None: fixed chunks

    def calibrate(self, backend: Backend, pool: BlockPool, context: int) -> StepCost | None:
        """Time the start's steps on `backend` (unhooked: a measurement, not a step, so no fault fires),
        three rounds, the first a warm-up, the deep ones within `context` (no position beyond the
        worker's context exists to the backend); the StepCost they give, or None where auto sizing is
        off, the ceiling is the floor, or the pool has no room for the ceiling's blocks."""
        bs = backend.block_size
        if self.itl_target_s is None or self.most <= FLOOR_TOKENS or -(-self.most // bs) > pool.available:
            return None
        depth = min(CALIBRATION_DEPTH, context, pool.available * bs) - FLOOR_TOKENS
        depth = max(0, depth // bs * bs)
        depth = depth if depth >= 2 * self.most else 0  # too shallow to tell depth from size: position 0 only
        blocks = pool.allocate(-(-max(self.most, depth + FLOOR_TOKENS) // bs))
        steps = [(self.most, 0), (FLOOR_TOKENS, 0), (1, 0)] + ([(FLOOR_TOKENS, depth), (1, depth)] if depth else [])
        fit = StepCost()
        try:
            for rnd in range(3):
                for n, at in steps:
                    chunk = SeqChunk(np.full(n, 1, np.int32), at, blocks, "last", prefill=n > 1)
                    t0 = time.monotonic()
                    backend.forward([chunk])
                    if rnd:  # the first round warms up
                        fit.observe(step_features([chunk]), time.monotonic() - t0)
        finally:
            pool.release(blocks)  # never registered: their contents are never matched
        coef = fit.coefficients
        return StepCost(tuple(coef / UNITS)) if coef is not None else None  # type: ignore[arg-type]

    def room(self, cost: StepCost | None, tokens: int, decoding: bool) -> StepRoom:
        """One step's room: `tokens` in all and, while streams decode under a target, the target's time."""
        timed = decoding and cost is not None and self.itl_target_s is not None
        return StepRoom(self, cost if timed else None, tokens)


class StepRoom:
    """What a step being planned has left: tokens, and time where it is sized (`cost` given)."""

    def __init__(self, sizing: PrefillSizing, cost: StepCost | None, tokens: int):
        self.sizing, self.cost, self.tokens_left = sizing, cost, tokens
        self.features = (0, 0, 0)
        self.prefilled = 0  # prompt tokens planned so far

    def add(self, chunk: SeqChunk) -> None:
        """A chunk the step carries (decode rows first: the prefills are sized by what they leave)."""
        n = len(chunk.tokens)
        self.tokens_left -= n
        if chunk.prefill and n > 1:
            self.prefilled += n
        if self.cost is not None:  # only a timed step reads them
            self.features = tuple(a + b for a, b in zip(self.features, step_features([chunk]), strict=True))  # type: ignore[assignment]

    def prefill(self, at: int, todo: int) -> int:
        """Prompt tokens the next chunk of a sequence at position `at` with `todo` left may carry (0: none
        in this step)."""
        most = min(todo, self.sizing.most, self.tokens_left)
        if most <= 0 or self.cost is None:
            return max(most, 0)
        fit = self.cost.prefill_within(self.features, at, (self.sizing.itl_target_s or 0.0) * HEADROOM)
        if fit is None or fit >= most:
            return most
        n = fit // MIN_CHUNK * MIN_CHUNK
        if n == 0 and self.prefilled == 0:  # the decode rows fill the target: a prefill still moves
            n = MIN_CHUNK
        return min(n, most)
