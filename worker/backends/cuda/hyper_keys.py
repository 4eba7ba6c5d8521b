"""Which key rows each query of a DeepSeek V4 step attends to, planned on the host (hyper.py's step reads
them from the device).

A layer's attention runs over one scratch of key rows for the whole step, so that each of its kernels is
one launch whatever the number of sequences: first every chunk's window rows (its positions `first` ..
end - 1, gathered from the pool: chunk after chunk, `wrows` naming their pool rows), then the layer's
compressed rows, chunk after chunk (row j of a chunk's is the block of its positions j * ratio ..; `comp`
says where in `prow` each block's positions start). A query at position p sees the window rows
p - window < p' <= p and the compressed rows of whole blocks up to p (j < (p + 1) // ratio): every one of
them in an HCA layer; in a CSA layer the lightning indexer picks at most top_k of those on the device
(their candidates: `crow`, `ccnt`), appended after the window's. The numpy twin is
hyper.HyperStack._attention's `allowed` and `visible` masks.

A captured decode step (hyper_step.py) needs the same launches every time it replays: `pad` plans it for
`rows` sequences of at most `context` positions, every size a function of those two alone. The rows past
the step's are padding: window rows and compressed blocks read the trash block's rows, a padded query
attends to scratch row 0, sees no compressed row, and its outputs are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import SeqChunk

CSA, HCA = 4, 128


@dataclass
class ChunkRows:
    """One chunk's place in the step: its window's first position and row count, where its window rows
    start in the scratch, and where its positions' pool rows start in the step's `prow`."""

    first: int
    m: int  # window rows gathered (positions first .. end - 1)
    end: int  # positions in the sequence after this step
    prow_at: int  # offset of position 0's pool row in StepKeys.prow
    win_at: int  # scratch row of its window's first row


@dataclass
class KeyLists:
    """Per query row of the step, its key rows (scratch row ids, -1 unused) and how many."""

    idx: np.ndarray  # int32 [n, ldi]
    cnt: np.ndarray  # int32 [n]


@dataclass
class Compressed:
    """A layer kind's compressed rows of the step, chunk after chunk, after the window rows in the scratch."""

    starts: np.ndarray  # int32 [rows, 2]: offsets in prow of its block's first position and the block before's (-1)
    positions: np.ndarray  # int32 [rows]: its block's first position (its RoPE's)
    at: list[int]  # per chunk, the index of its first compressed row

    @property
    def rows(self) -> int:
        return len(self.positions)


@dataclass
class StepKeys:
    chunks: list[ChunkRows]
    prow: np.ndarray  # int32: each chunk's pool row of every position 0 .. end - 1, chunk after chunk
    wrows: np.ndarray  # int32 [window rows]: the pool row of each window row of the scratch
    lists: dict[int, KeyLists]  # by compress ratio (0: the window alone; CSA: the window, before the indexer's)
    crow: np.ndarray | None = None  # CSA: int32 [n, ldc] each query's candidate compressed rows (scratch rows)
    ccnt: np.ndarray | None = None  # int32 [n]: how many it sees
    comp: dict[int, Compressed] = field(default_factory=dict)  # by ratio

    @property
    def window_rows(self) -> int:
        return len(self.wrows)

    @property
    def scratch_rows(self) -> int:
        """The most scratch rows any layer kind needs: the window rows, then its compressed rows."""
        return self.window_rows + max((c.rows for c in self.comp.values()), default=0)


@dataclass(frozen=True)
class Pad:
    """The fixed shape of a captured step: `rows` query rows (one a sequence), each sequence at most `context`
    positions long; `trash` a pool row nothing reads (the block past the pool's)."""

    rows: int
    context: int
    trash: int


def plan(chunks: list[SeqChunk], *, block_size: int, window: int, ratios: set[int], top_k: int,
         pad: Pad | None = None) -> StepKeys:
    """The key lists of every query row of a step (chunk after chunk) for each kind of layer in `ratios`;
    with `pad`, at that fixed shape."""
    rows, prows, wrows, at, win_at = [], [], [], 0, 0
    for c in chunks:
        end = c.start + len(c.tokens)
        lo_pos = max(0, c.start - window + 1)
        p = np.arange(end)
        prow_c = np.asarray(c.block_table, np.int64)[p // block_size] * block_size + p % block_size
        prows.append(prow_c)
        wrows.append(prow_c[lo_pos:])
        rows.append(ChunkRows(lo_pos, end - lo_pos, end, at, win_at))
        at += end
        win_at += end - lo_pos
    pos = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
    n = len(pos)
    if pad is not None and at > pad.rows * pad.context:
        raise ValueError(f"a step of {at} positions exceeds its padded shape {pad}")
    # padded: to rows * context, then a block of trash rows for the padded compressed blocks
    tail = [] if pad is None else [np.full(pad.rows * pad.context - at + max(ratios), pad.trash)]
    prow = np.concatenate(prows + tail).astype(np.int32) if prows else np.zeros(0, np.int32)
    owner = np.repeat(np.arange(len(chunks)), [len(c.tokens) for c in chunks])
    first = np.array([r.first for r in rows])[owner]
    base = np.array([r.win_at for r in rows])[owner]
    n_win = np.minimum(pos + 1, window)  # keys p - window < p' <= p
    lo = base + pos - n_win + 1 - first  # the scratch row of the oldest
    if pad is not None:
        if n > pad.rows or win_at > pad.rows * window or max(r.end for r in rows) > pad.context:
            raise ValueError(f"a step of {n} rows to {at} positions exceeds its padded shape {pad}")
        wrows.append(np.full(pad.rows * window - win_at, pad.trash))
        pos, lo, n_win = (np.concatenate([a, np.full(pad.rows - n, v)]) for a, v in ((pos, 0), (lo, 0), (n_win, 1)))
        owner = np.concatenate([owner, np.full(pad.rows - n, -1)])
    keys = StepKeys(rows, prow, np.concatenate(wrows).astype(np.int32) if wrows else np.zeros(0, np.int32), {})
    for r in sorted(ratios):
        if r:
            keys.comp[r] = _compressed(rows, r, None if pad is None else (pad.rows * (pad.context // r),
                                                                           pad.rows * pad.context))
    visible = {r: np.where(owner >= 0, (pos + 1) // r, 0) for r in keys.comp}
    # the scratch row of each query's chunk's compressed row 0, by ratio
    comp0 = {r: keys.window_rows + np.asarray(c.at + [0], np.int64)[owner] for r, c in keys.comp.items()}
    if pad is None:
        most = {r: max((ch.end // r for ch in rows), default=0) for r in keys.comp}
    else:
        most = {r: pad.context // r for r in keys.comp}
    n = len(pos)

    for r in sorted(ratios):
        extra = 0 if r == 0 else (min(top_k, most[r]) if r == CSA else most[r])
        ldi = max(1, window + extra)
        idx = np.full((n, ldi), -1, np.int32)
        j = np.arange(window)
        idx[:, :window] = np.where(j[None, :] < n_win[:, None], lo[:, None] + j[None, :], -1)
        cnt = n_win.astype(np.int32)
        if r == HCA and extra:
            # the compressed rows follow each query's own window rows
            k = np.arange(ldi)[None, :] - n_win[:, None]
            seen = (k >= 0) & (k < visible[r][:, None])
            idx = np.where(seen, comp0[r][:, None] + k, idx).astype(np.int32)
            cnt = (n_win + visible[r]).astype(np.int32)
        keys.lists[r] = KeyLists(idx, cnt)
    if CSA in keys.comp:
        ldc = max(1, most[CSA])
        k = np.arange(ldc)
        keys.crow = np.where(k[None, :] < visible[CSA][:, None], comp0[CSA][:, None] + k[None, :], -1).astype(np.int32)
        keys.ccnt = visible[CSA].astype(np.int32)
    return keys


def _compressed(rows: list[ChunkRows], ratio: int, pad: tuple[int, int] | None) -> Compressed:
    """Every chunk's compressed rows of whole blocks of `ratio` positions (remade each step from the pool);
    pad (rows, trash): as many rows, the rest of them the block of trash rows at prow[trash]."""
    starts, positions, at, total = [], [], [], 0
    for ch in rows:
        b = np.arange(ch.end // ratio, dtype=np.int64)
        starts.append(np.stack([ch.prow_at + b * ratio, np.where(b > 0, ch.prow_at + (b - 1) * ratio, -1)], axis=1))
        positions.append(b * ratio)
        at.append(total)
        total += len(b)
    if pad is not None:
        starts.append(np.tile([pad[1], -1], (pad[0] - total, 1)))
        positions.append(np.zeros(pad[0] - total, np.int64))
    if not rows:
        return Compressed(np.zeros((0, 2), np.int32), np.zeros(0, np.int32), [])
    return Compressed(np.concatenate(starts).astype(np.int32), np.concatenate(positions).astype(np.int32), at)
