"""One CUDA step's host-side plumbing: where its inputs sit in the pinned staging buffer (StepLayout)
and on the device (StepInputs), the handle of a launched step (PendingStep: it reads its results from
the host buffers it is told they land in), Gemma's post-norms held back until the matvecs that read
them are known (PostNorms, over the buffers it is given), and the guard that turns a sticky CUDA
error into the worker's ContextPoisoned. backend.py and forward.py drive them; none of them holds
the backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import DeviceArray
from ember.kernels.errors import StickyCudaError

from ..base import ContextPoisoned, SampledToken, SeqChunk, present

if TYPE_CHECKING:
    from ember.kernels.cuda_runtime import Device, Event, HostBuffer

    from .matmul import Matmuls


def poison_guard(fn):
    """Turn a sticky CUDA error into the worker's ContextPoisoned."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e

    return wrapper


@dataclass
class StepLayout:
    """Offsets (bytes) of a step's inputs in the pinned staging buffer and its device twin."""

    rows: int  # row capacity (tokens per step)
    seqs: int  # sequence capacity (chunks per step)
    table_cap: int  # int32 entries for all block tables

    def __post_init__(self):
        r, s = self.rows, self.seqs
        self.tok, self.pos, self.slots, self.seq = 0, 4 * r, 8 * r, 12 * r
        self.out_rows = 16 * r  # the rows whose logits are wanted (r at most)
        self.feed = 20 * r  # per row: the previous step's draw that is its token (run-ahead), or -1
        self.sample = 24 * r  # SampleParams for up to r rows (8-byte aligned: r is a multiple of 8)
        self.tiles = self.sample + ops.SampleParams.nbytes(r)  # flash attention's (row, count) pairs
        self.tile_cap = r // ops.FLASH_ROWS + s + 1
        self.tables = self.tiles + 8 * self.tile_cap
        self.nbytes = self.tables + 4 * self.table_cap


@dataclass
class StepInputs:
    """One slot's step inputs on the device: views of its buffer at the layout's offsets."""

    tok: DeviceArray
    pos: DeviceArray
    slots: DeviceArray
    seq: DeviceArray
    out_rows: DeviceArray
    feed: DeviceArray
    tiles: DeviceArray
    tables: DeviceArray
    sample: DeviceArray

    @classmethod
    def of(cls, buf, lay: StepLayout) -> StepInputs:
        def ints(off: int, n: int):
            return buf.view_bytes(off, n, np.int32)

        r = lay.rows
        return cls(ints(lay.tok, r), ints(lay.pos, r), ints(lay.slots, r), ints(lay.seq, r), ints(lay.out_rows, r),
                   ints(lay.feed, r), ints(lay.tiles, 2 * lay.tile_cap), ints(lay.tables, lay.table_cap),
                   buf.view_bytes(lay.sample, ops.SampleParams.nbytes(r), np.uint8))


@dataclass
class Landing:
    """Where a launched step's results arrive on the host: `done` is recorded once they have, `tokens`
    holds the draws (its first n_out int32) and `logits` the logits rows the host wants, in order."""

    dev: Device
    done: Event
    tokens: HostBuffer
    logits: HostBuffer | None  # None: no row's logits come to the host
    vocab: int


class PendingStep:
    """A launched step. result() waits for the device and returns what forward() would have."""

    def __init__(self, slot: int, chunks, want, sampled, n_out):
        self.slot, self.chunks, self.n_out = slot, chunks, n_out
        starts = row_starts(want)
        self.sampled = sampled
        first = {si: r for r, (si, _, _) in zip(starts, want, strict=True)}
        self.drawn_rows = {si: first[si] for si in sampled}  # chunk -> its row of the slot's draws
        self.host_rows = [(si, r, cnt) for r, (si, _, cnt) in zip(starts, want, strict=True)
                          if si not in self.drawn_rows]
        self.landing: Landing | None = None  # set once its copies to the host are queued
        self._outputs: list | None = None
        self._error: Exception | None = None

    def result(self) -> list:
        if self._error is not None:
            raise self._error
        if self._outputs is None:
            try:
                self._outputs = self._collect()
            except Exception as e:  # raised once more to whoever asks again, not to the next step
                self._error = e
                raise
        return self._outputs

    @poison_guard
    def _collect(self) -> list:
        """Wait for the results to land and read them: a SampledToken for each chunk drawn on the
        device, float32 logits [rows, vocab] for the others."""
        land = present(self.landing)
        land.dev.make_current()
        land.done.synchronize()
        out: list = [None] * len(self.chunks)
        if self.sampled:
            toks = host_view(land.tokens.array, 0, self.n_out, np.int32)
            for si, row in self.drawn_rows.items():
                out[si] = SampledToken(int(toks[row]))
        at, V = 0, land.vocab
        for si, _, cnt in self.host_rows:
            out[si] = host_view(present(land.logits).array, at, cnt * V, np.float32).reshape(cnt, V).copy()
            at += cnt * V * 4
        return out


class PostNorms:
    """One step's Gemma post-norms (rms_norm_add_norm: the residual += rms_norm(o) * w1, h =
    rms_norm(residual) * w2): each is held back (defer) until the matvecs that read h are known
    (inputs); when every one of them can compute h itself (one row, ops.matvec_post_norm) they do, the
    first writing the new residual to the other of two buffers (the rest of its grid still reads the
    old one), which saves a launch per post-norm; otherwise rms_norm_add_norm runs in place first."""

    def __init__(self, mm: Matmuls, n: int, tc: bool, x: DeviceArray, spare: DeviceArray | None, h: DeviceArray):
        """x: the residual; spare: the residual's second buffer (None: matvecs never take the norm); h:
        where rms_norm_add_norm writes the normed rows."""
        self.mm, self.n, self.tc, self.h = mm, n, tc, h
        self.x, self.spare = x, spare  # the residual now, and the other buffer (or None)
        self.pending: tuple | None = None

    def defer(self, o, w1, w2) -> None:
        self.pending = (o, w1, w2)

    def inputs(self, mats: list, gated: bool = False) -> list:
        """What each matrix in mats reads as h: a PostNorm each, or the h buffer (after the launch)."""
        mm = self.mm
        if self.pending is None:
            return [self.h] * len(mats)
        (o, w1, w2), self.pending = self.pending, None
        if mats and self.spare is not None and all(mm.takes_post_norm(w, self.n, self.tc, gated) for w in mats):
            out = [ops.PostNorm(o, self.x, self.spare if i == 0 else None, w1, w2, mm.config.norm_eps)
                   for i in range(len(mats))]
            self.x, self.spare = self.spare, self.x
            return out
        ops.rms_norm_add_norm(mm.dev, o, w1, self.x, w2, self.h, eps=mm.config.norm_eps, rows=self.n,
                              cols=mm.config.hidden, stream=mm.stream)
        return [self.h] * len(mats)


def feed_sources(chunks: list[SeqChunk], feed: list[int | None], last: PendingStep | None) -> np.ndarray:
    """Per row of a step, the row of the draws of `last` (the step submitted just before) that is its token, or
    -1: feed[i] = j says chunk i's one token is the draw of that step's chunk j (run-ahead)."""
    if len(feed) != len(chunks):
        raise ValueError("feed needs one entry per chunk")
    sources = np.full(sum(len(c.tokens) for c in chunks), -1, np.int32)
    at = 0
    for c, j in zip(chunks, feed, strict=True):
        if j is not None:
            if last is None or j not in last.drawn_rows:
                raise ValueError(f"feed {j}: the previous step drew no token for that chunk")
            if len(c.tokens) != 1:
                raise ValueError("a fed chunk has exactly one token")
            sources[at] = last.drawn_rows[j]
        at += len(c.tokens)
    return sources


def row_starts(want) -> list[int]:
    starts, at = [], 0
    for _, _, cnt in want:
        starts.append(at)
        at += cnt
    return starts


def host_view(buf: np.ndarray, offset: int, count: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    return buf[offset : offset + count * dt.itemsize].view(dt)

