"""How many prompt tokens one engine step prefills: fixed, or sized once at start by measurement.

Every running stream gets its decode token before any prefill chunk, so a step that carries a
chunk delays every decoding stream by the chunk's compute. A fixed chunk is right for one device and
model only: 2048 tokens take about 11 ms on an H200 with a 270M model and about 150 ms with an 8B
one, an inter-token stall no agent's user accepts. Auto sizing (the default) measures the device
before serving: `calibrate` times prefills of the floor's and the ceiling's size (a step cost with
fixed and per-token parts, step_costs.PrefillCost), and `chunk` picks the largest chunk whose step
stays within a target time, the floor doubled while it fits, within the floor (smaller chunks waste
the tensor cores) and the rows the backend was built for (the ceiling). The engine does this once,
at start (Engine._calibrate), and keeps the chunk for the worker's life, so the same prompt is always
split the same way; where nothing could be timed (the ceiling no more than the floor, or no room in
the pool for the ceiling's blocks) the chunk is the ceiling. The step costs the engine samples while
it serves, and keeps across restarts beside the KV blocks (cost_sampling.py), feed the restore
policy, not the chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, SeqChunk
from .kv_blocks import BlockPool
from .step_costs import PrefillCost

FLOOR_TOKENS = 256  # below this a prefill step is mostly fixed cost


@dataclass(frozen=True)
class PrefillSizing:
    most: int  # the fixed chunk, or auto's ceiling (the backend's rows per step)
    target_s: float | None = None  # auto: the time a step carrying a chunk should take; None: fixed

    def chunk(self, cost: PrefillCost) -> int:
        """Prompt tokens for one sequence in the next step, given the measured step cost."""
        fit = cost.tokens_within(self.target_s) if self.target_s is not None else None
        if fit is None:
            return self.most
        least = min(FLOOR_TOKENS, self.most)
        if fit >= self.most:
            return self.most
        size = least
        while size * 2 <= fit:
            size *= 2
        return size

    def calibrate(self, backend: Backend, pool: BlockPool) -> PrefillCost | None:
        """Time prefills of the floor's and the ceiling's size on `backend` (unhooked: a measurement, not
        a step, so no fault fires), three of each, the first of each a warm-up; None where auto sizing is
        off, the ceiling is the floor, or the pool has no room for the ceiling's blocks."""
        need = -(-self.most // backend.block_size)
        if self.target_s is None or self.most <= FLOOR_TOKENS or need > pool.available:
            return None
        blocks = pool.allocate(need)
        samples = []
        try:
            for n in (FLOOR_TOKENS, self.most) * 3:  # the first of each size warms up
                chunk = SeqChunk(np.full(n, 1, np.int32), 0, blocks, "last")
                t0 = time.monotonic()
                backend.forward([chunk])
                samples.append((n, time.monotonic() - t0))
        finally:
            pool.release(blocks)  # never registered: their contents are never matched
        return PrefillCost.measured(samples[2:])
