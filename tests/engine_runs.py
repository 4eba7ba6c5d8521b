"""Generations through a real Engine (no server) with a drafter that records what it proposed: the
speculation tests of the model's own drafters (test_mtp.py's next-token layer, test_dspark.py's block
drafter) compare them with and without drafts."""

from __future__ import annotations

import asyncio

from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, GenerationRequest, RequestHandle
from ember.worker.engine.sampling import SamplingParams
from ember.worker.metrics import Metrics

GREEDY = SamplingParams(temperature=0.0)


class RecordingDrafter:
    """A drafter as it is, keeping each sequence's tokens with the draft it proposed after them."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.seen: list[tuple[list[int], list[int]]] = []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, st, k):
        draft, match = self.drafter.propose(st, k)
        if draft:
            self.seen.append((list(st.tokens), draft))
        return draft, match


def generate(model, backend, spec: str, prompt: list[int], n: int, drafter=None):
    """n greedy tokens after `prompt` through an Engine over `backend` with --spec `spec`; (tokens, the
    metrics' snapshot)."""
    engine = Engine(model, backend, EngineLimits(max_seqs=2, context=1024, spec=spec), metrics=Metrics(),
                    drafter=drafter)
    engine.start()

    async def collect():
        handle = RequestHandle(GenerationRequest("r", prompt, GREEDY, n), asyncio.get_running_loop())
        engine.submit(handle)
        return [t async for e in handle.events() if isinstance(e, Delta) for t in e.tokens]

    try:
        return asyncio.run(collect()), engine.metrics.snapshot()
    finally:
        engine.shutdown()
