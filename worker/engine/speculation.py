"""Speculative decoding: when to draft, how far, and what each sequence's drafts earned.

A decoding sequence's step may carry a draft (drafters.py) after its last token: the backend computes
every position's logits in that one step, and the output processor checks them in order
(OutputProcessor.verify): each position's token is chosen exactly as without a draft (greedy: the
argmax under the grammar's mask; sampling: rejection sampling against the draft, which keeps the
target distribution), and the draft's tokens count while they agree. The first disagreement is
replaced by the chosen token and ends the step. The KV of the positions past it is simply never
marked computed: the next step writes over it, and the prefix cache and the KV store only ever see
accepted tokens (they follow `n_computed`).

Knowing when not to: each sequence keeps a moving average of the share of its drafts accepted; the
draft length follows it (a draft is worth its extra positions only where they are likely to be kept),
and drafting pauses for a while where acceptance is too low to pay for the wider step. It is off for
batches larger than `max_batch` decoding sequences (the step is already wide; verification would cost
more than it saves) and past `max_context` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .drafters import NgramDrafter, SuffixDrafter, TokenIndex, make_drafter

ACCEPT_EMA = 0.3  # weight of the latest step in the acceptance average
START_ACCEPTANCE = 0.6  # a sequence's first drafts are trusted this much
PAUSE_BELOW = 0.2  # acceptance under this pauses drafting ...
PAUSE_STEPS = 16  # ... for this many steps, then it tries again
MIN_DRAFT = 1


@dataclass(eq=False)
class SpecState:
    """One sequence's drafting: its token index, the draft in flight, and what drafts have earned."""

    index: TokenIndex
    pending: list[int] = field(default_factory=list)  # the draft the planned step carries
    acceptance: float = START_ACCEPTANCE
    paused: int = 0  # steps left without drafting
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps run


class Speculator:
    """The engine's speculation: its drafter and the policy above."""

    def __init__(self, drafter: str, k: int = 8, max_batch: int = 8, max_context: int = 32768):
        self.drafter: NgramDrafter | SuffixDrafter = make_drafter(drafter)
        self.k, self.max_batch, self.max_context = k, max_batch, max_context
        self.draft_seconds = 0.0  # host time spent drafting, not yet counted in the metrics

    def state(self) -> SpecState:
        return SpecState(self.drafter.new_index())

    def draft(self, st: SpecState, tokens: list[int], decoding: int) -> list[int]:
        """The draft for a sequence's next step ([] for none). decoding: sequences decoding this step."""
        st.index.sync(tokens)
        if st.paused > 0:
            st.paused -= 1
            return []
        if decoding > self.max_batch or len(tokens) >= self.max_context:
            return []
        k = max(MIN_DRAFT, min(self.k, round(self.k * st.acceptance)))
        k = min(k, self.max_context - len(tokens) - 1)
        if k <= 0:
            return []
        t0 = time.monotonic()
        draft = self.drafter.propose(st.index, k)
        self.draft_seconds += time.monotonic() - t0
        return draft

    def take_draft_seconds(self) -> float:
        spent, self.draft_seconds = self.draft_seconds, 0.0
        return spent

    def record(self, st: SpecState, drafted: int, accepted: int) -> None:
        st.drafted += drafted
        st.accepted += accepted
        st.steps += 1
        st.acceptance = (1 - ACCEPT_EMA) * st.acceptance + ACCEPT_EMA * (accepted / drafted)
        if st.acceptance < PAUSE_BELOW:
            st.paused = PAUSE_STEPS
            st.acceptance = START_ACCEPTANCE / 2  # after the pause, short drafts first

    def finished(self, tokens: list[int], prompt_len: int) -> None:
        self.drafter.finished(tokens, prompt_len)
