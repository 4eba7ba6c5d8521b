"""Failing alone: when a step raises, only the requests it touched fail.

A batched step that raised is run again chunk by chunk on the bare backend (its fault hooks already
ran), so only the culprit's request fails and the others get their outputs; the work done for one
sequence after the step (its tokens, its grammar, its blocks) fails that request alone. Both go
through backends.base.attempt, the one place that lets ContextPoisoned through: a poisoned context
is never one request's failure, it stops the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends.base import Backend, Failure, SeqChunk, attempt
from .sequence import Seq

FAILED: Any = object()  # an output slot whose request failed (it is settled already)


def rerun_alone(backend: Backend, chunks: list[SeqChunk], members: list[Seq],
                fail: Callable[[Seq, Exception], None]) -> list:
    """The outputs of a step that raised, each chunk run on its own: FAILED where it raised again (its
    request failed through `fail`)."""
    outputs: list = []
    for c, s in zip(chunks, members, strict=True):
        out = attempt(lambda c=c: backend.unhooked().forward([c])[0])
        if isinstance(out, Failure):
            fail(s, out.error)
            outputs.append(FAILED)
        else:
            outputs.append(out)
    return outputs


def alone(s: Seq, fail: Callable[[Seq, Exception], None], fn: Callable[..., None], *args) -> None:
    """fn(*args), work for sequence `s` alone: if it raises, that request fails (through `fail`)."""
    done = attempt(fn, *args)
    if isinstance(done, Failure):
        fail(s, done.error)
