"""The scheduler: which running sequences a backend step computes, in which chunks.

`Scheduler.plan` returns a `StepPlan` and changes no queue: decode tokens first (one per running
sequence, so streams never wait behind a prefill), then prefill chunks within the step's room
(prefill_sizing.py), the short ones first: a warm admit's new turn (QUICK_PREFILL tokens or fewer)
is one step's work and its agent is waiting on it, while a long prefill loses a step at most. Where
the pool is short it preempts the youngest sequence not yet planned (its blocks go
back through the KV manager at once, so the plan can use them) and names it in the plan; the loop
requeues it. Admission, sampling and settling are the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backends.base import SeqChunk
from .kv_manager import KVManager
from .output import OutputProcessor
from .prefill_sizing import PrefillSizing, StepRoom
from .sequence import Seq
from .spec.speculation import Speculator
from .step_costs import StepCost


@dataclass
class StepPlan:
    chunks: list[SeqChunk] = field(default_factory=list)
    members: list[Seq] = field(default_factory=list)  # chunks[i] is members[i]'s
    preempted: list[Seq] = field(default_factory=list)  # blocks released: requeue first, in this order
    failed: list[Seq] = field(default_factory=list)  # the KV cache cannot hold them even alone


QUICK_PREFILL = 512  # prompt tokens left at which a prefill goes before the longer ones


class Scheduler:
    def __init__(self, kv: KVManager, output: OutputProcessor, max_step_tokens: int, sizing: PrefillSizing,
                 speculator: Speculator | None = None):
        self.kv, self.output, self.speculator = kv, output, speculator
        self.max_step_tokens, self.sizing = max_step_tokens, sizing

    def plan(self, running: list[Seq], cost: StepCost | None = None) -> StepPlan:
        """cost: what a step takes at its depth (None: not known), which sizes prefill chunks while
        streams decode (prefill_sizing.py)."""
        plan = StepPlan()
        live = list(running)  # running, less what this plan preempts or fails
        def rank(s: Seq) -> tuple[bool, bool, int]:  # decode rows, then quick prefills, then the rest; oldest first
            todo = len(s.tokens) - s.kv.n_computed
            return todo > 1, todo > QUICK_PREFILL, s.number

        order = sorted(running, key=rank)
        decoding = sum(1 for s in running if s.kv.n_computed == len(s.tokens) - 1 and s.out.generated)
        room = self.sizing.room(cost, self.max_step_tokens, decoding > 0)
        for s in order:
            if room.tokens_left <= 0:
                break
            if s not in live or s.kv.restoring is not None:  # preempted, or still restoring
                continue
            todo = len(s.tokens) - s.kv.n_computed
            if todo <= 0:
                continue
            n = room.prefill(s.kv.n_computed, todo) if todo > 1 else 1
            if n <= 0:
                continue  # the step's time is spent: this prompt waits for the next
            draft = self._draft(s, decoding, room.tokens_left) if todo == 1 and s.out.generated else []
            if draft and not self.kv.grow(s, s.kv.n_computed + 1 + len(draft)):
                draft = []  # a draft never preempts anyone: without free blocks for it, no draft
            if not self._ensure_blocks(s, s.kv.n_computed + n, plan, live):
                continue
            at = s.kv.n_computed
            if draft:  # the last token and the guesses after it, every position's logits to check them
                s.spec.pending = draft  # type: ignore[union-attr]  # _draft drafts only with a SpecState
                self._add(plan, room, s, SeqChunk(np.asarray([s.tokens[at], *draft], np.int32), at, s.kv.blocks, "all"))
                continue
            want = "all" if s.req.prompt_logprobs and s.out.generated == 0 else (
                "last" if at + n == len(s.tokens) else "none")
            self._add(plan, room, s, SeqChunk(np.asarray(s.tokens[at : at + n], np.int32), at, s.kv.blocks, want,
                                              sample=self.output.device_sample(s) if want == "last" else None,
                                              prefill=n > 1 or s.out.generated == 0))
        return plan

    @staticmethod
    def _add(plan: StepPlan, room: StepRoom, s: Seq, chunk: SeqChunk) -> None:
        plan.chunks.append(chunk)
        plan.members.append(s)
        room.add(chunk)

    def _draft(self, s: Seq, decoding: int, budget: int) -> list[int]:
        """A decoding sequence's draft for this step, within the step's token budget ([]: none)."""
        if self.speculator is None or s.spec is None:
            return []
        left = s.req.max_tokens - s.out.generated - 1  # the position after the draft still yields a token
        draft = self.speculator.draft(s.spec, s.tokens, decoding, s.kv.blocks)
        return draft[: max(0, min(left, budget - 1))]

    def _ensure_blocks(self, s: Seq, length: int, plan: StepPlan, live: list[Seq]) -> bool:
        """Get blocks for `length` positions, preempting the youngest sequence not yet planned in
        this step if the pool is short. False: `s` sits this step out (or fails, if alone)."""
        while not self.kv.grow(s, length):
            candidates = [r for r in live if r is not s and r not in plan.members and r.kv.restoring is None]
            if candidates:
                victim = max(candidates, key=lambda r: r.number)
                self.kv.preempted(victim)
                live.remove(victim)
                plan.preempted.append(victim)
            elif plan.members:
                return False  # the planned ones free or grow first; try again next step
            else:
                live.remove(s)
                plan.failed.append(s)
                return False
        return True
