"""Run-ahead decoding: launch decode step n + 1 before step n's tokens are read on the host.

When a backend `runs_ahead`, the engine may submit the next decode step with each sequence's token
fed on the device from the draw the current step makes. `launch` decides whether that step is
already known and submits it; the loop keeps it as `inflight` once this step's outputs are known,
and `take` hands its standing rows to the next step. `Ahead.valid_rows` is the one rule for which
rows still stand once the current step's tokens are read (the others are dropped and recomputed:
their KV slot is rewritten).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.base import Backend, Failure, SampledToken, SeqChunk, attempt
from ..logs import log
from .kv_manager import KVManager
from .output import OutputProcessor
from .sequence import Seq


class Ahead:
    """A run-ahead step in flight: row i fed from the draw of chunk sources[i] of the step before it.
    Once that step's outputs are known (fed_from), a row is valid if its sequence took exactly that
    token and is still running at that position."""

    def __init__(self, pending, chunks: list[SeqChunk], members: list[Seq], sources: list[int]):
        self.pending, self.chunks, self.members, self.sources = pending, chunks, members, sources
        self.tokens: list[int | None] = [None] * len(chunks)

    def fed_from(self, outputs: list) -> None:
        for i, j in enumerate(self.sources):
            out = outputs[j]
            self.tokens[i] = int(out) if isinstance(out, SampledToken) else None

    def valid_rows(self, running: list[Seq]) -> list[int]:
        """The rows still wanted; the pending step's result() then returns theirs alone."""
        keep = [i for i, (c, s, t) in enumerate(zip(self.chunks, self.members, self.tokens, strict=True))
                if t is not None and s in running and s.kv.n_computed == c.start and len(s.tokens) == c.start + 1
                and s.tokens[c.start] == t]
        for i in keep:
            self.chunks[i].tokens[0] = self.tokens[i]  # the token the device used, for a rerun on its own
        if len(keep) != len(self.chunks):
            self.pending = _Selected(self.pending, keep)
        return keep

    def discard(self) -> None:
        """Wait for the step and forget its rows (its error too; ContextPoisoned still propagates)."""
        attempt(self.pending.result)


class _Selected:
    """Some rows of a pending step's outputs."""

    def __init__(self, pending, rows: list[int]):
        self.pending, self.rows = pending, rows

    def result(self) -> list:
        out = self.pending.result()
        return [out[i] for i in self.rows]


class RunAhead:
    def __init__(self, backend: Backend, kv: KVManager, output: OutputProcessor, context: int):
        self.backend, self.kv, self.output, self.context = backend, kv, output, context
        self.inflight: Ahead | None = None  # launched during the last step, its outputs not read yet
        self.steps = self.rows_dropped = 0  # run-ahead steps launched, and rows of them recomputed

    def launch(self, chunks: list[SeqChunk], members: list[Seq], rows: list[int], running: list[Seq],
               admitting: bool, count_step: Callable[[], None]) -> Ahead | None:
        """Submit the decode step after this one, each sequence's token the draw this step makes on the
        device, when that step is already known: every running sequence is in this step, is drawing
        its next token on the device, and nothing waits to be admitted (`admitting`). Sequences this
        step ends (by length) sit it out; a sequence whose token turns out otherwise (a stop, a forced
        reasoning marker, a cancel) has its row dropped and recomputed (its KV slot is simply rewritten).
        rows[j]: chunk j's index in the step the backend ran (a run-ahead step may have dropped rows)."""
        if not self.backend.runs_ahead or len(members) != len(running) or admitting:
            return None
        eligible: list[tuple[int, Seq, int]] = []  # (chunk index, sequence, position of its next token)
        for j, (c, s) in enumerate(zip(chunks, members, strict=True)):
            at = c.start + len(c.tokens)
            if c.sample is None or c.logits != "last" or at != len(s.tokens) or s.kv.restoring is not None:
                return None
            if s.out.generated + 1 >= s.req.max_tokens or at + 1 >= self.context:
                continue  # this step's token is its last
            eligible.append((j, s, at))
        if not eligible:
            return None
        nxt_chunks, nxt_members, sources = [], [], []
        feed: list[int | None] = []
        for j, s, at in eligible:
            if not self.kv.grow(s, at + 1):
                return None  # the normal plan preempts if it must
            nxt_chunks.append(SeqChunk(np.zeros(1, np.int32), at, s.kv.blocks, "last",
                                       sample=self.output.device_sample(s, 1)))
            nxt_members.append(s)
            feed.append(rows[j])
            sources.append(j)
        count_step()
        pending = attempt(self.backend.submit, nxt_chunks, feed=feed)
        if isinstance(pending, Failure):
            e = pending.error
            log("engine_error", level="error", error=f"run-ahead step: {type(e).__name__}: {e}")
            return None
        self.steps += 1
        return Ahead(pending, nxt_chunks, nxt_members, sources)

    def take(self, running: list[Seq]) -> tuple[list[SeqChunk], list[Seq], list[int], object] | None:
        """The in-flight step's rows that still stand (their chunks, sequences and row indices) and its
        pending result, which then returns theirs alone; None when no step runs ahead."""
        ahead, self.inflight = self.inflight, None
        if ahead is None:
            return None
        rows = ahead.valid_rows(running)
        self.rows_dropped += len(ahead.chunks) - len(rows)
        return [ahead.chunks[i] for i in rows], [ahead.members[i] for i in rows], rows, ahead.pending

    def drop(self) -> None:
        """Wait for the step in flight and forget it (its rows are not wanted); raises ContextPoisoned."""
        ahead, self.inflight = self.inflight, None
        if ahead is not None:
            ahead.discard()
