"""Which key rows each query of a DeepSeek V4 step attends to, planned on the host (hyper.py's step reads
them from the device).

A chunk's attention in a layer runs over a scratch of key rows: first its window's rows (positions
`first` .. end - 1, gathered from the pool: scratch row r is position first + r), then the layer's
compressed rows (scratch row m + j is compressed row j, the block of positions j * ratio ..). A query at
position p sees the window rows p - window < p' <= p and the compressed rows of whole blocks up to p
(j < (p + 1) // ratio): every one of them in an HCA layer; in a CSA layer the lightning indexer picks at
most top_k of those on the device (their candidates: `crow`, `ccnt`), appended after the window's. The
numpy twin is hyper.HyperStack._attention's `allowed` and `visible` masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import SeqChunk

CSA, HCA = 4, 128


@dataclass
class ChunkRows:
    """One chunk's scratch: its window's first position and row count, and where its positions' pool
    rows start in the step's `prow`."""

    first: int
    m: int  # window rows gathered (positions first .. end - 1)
    end: int  # positions in the sequence after this step
    prow_at: int  # offset of position 0's pool row in StepKeys.prow


@dataclass
class KeyLists:
    """Per query row of the step, its key rows (scratch row ids, -1 unused) and how many."""

    idx: np.ndarray  # int32 [n, ldi]
    cnt: np.ndarray  # int32 [n]


@dataclass
class StepKeys:
    chunks: list[ChunkRows]
    prow: np.ndarray  # int32: each chunk's pool row of every position 0 .. end - 1, chunk after chunk
    lists: dict[int, KeyLists]  # by compress ratio (0: the window alone; CSA: the window, before the indexer's)
    crow: np.ndarray | None = None  # CSA: int32 [n, ldc] each query's candidate compressed rows
    ccnt: np.ndarray | None = None  # int32 [n]: how many it sees
    scratch_rows: int = 0  # the most scratch rows a chunk needs in any layer
    comp_rows: dict[int, list[int]] = field(default_factory=dict)  # by ratio: each chunk's compressed rows


def plan(chunks: list[SeqChunk], *, block_size: int, window: int, ratios: set[int], top_k: int) -> StepKeys:
    """The key lists of every query row of a step (chunk after chunk) for each kind of layer in `ratios`."""
    rows, prows, at = [], [], 0
    for c in chunks:
        end = c.start + len(c.tokens)
        lo_pos = max(0, c.start - window + 1)
        p = np.arange(end)
        prows.append(np.asarray(c.block_table, np.int64)[p // block_size] * block_size + p % block_size)
        rows.append(ChunkRows(lo_pos, end - lo_pos, end, at))
        at += end
    prow = np.concatenate(prows).astype(np.int32) if prows else np.zeros(0, np.int32)
    pos = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
    n = len(pos)
    owner = np.repeat(np.arange(len(chunks)), [len(c.tokens) for c in chunks])
    first = np.array([r.first for r in rows])[owner]
    m = np.array([r.m for r in rows])[owner]
    n_win = np.minimum(pos + 1, window)  # keys p - window < p' <= p
    lo = pos - n_win + 1 - first  # the scratch row of the oldest
    comp = {r: [ch.end // r for ch in rows] for r in ratios if r}
    visible = {r: (pos + 1) // r for r in comp}
    scratch = max(ch.m + max((comp[r][i] for r in comp), default=0) for i, ch in enumerate(rows))

    lists: dict[int, KeyLists] = {}
    for r in sorted(ratios):
        extra = 0 if r == 0 else (min(top_k, max(comp[r])) if r == CSA else max(comp[r]))
        ldi = max(1, window + extra)
        idx = np.full((n, ldi), -1, np.int32)
        j = np.arange(window)
        win = lo[:, None] + j[None, :]
        idx[:, :window] = np.where(j[None, :] < n_win[:, None], win, -1)
        cnt = n_win.astype(np.int32)
        if r == HCA and extra:
            k = np.arange(extra)
            seen = k[None, :] < visible[r][:, None]
            idx_c = np.where(seen, m[:, None] + k[None, :], -1)
            # the compressed rows follow each query's own window rows
            for t in range(n):
                v = int(visible[r][t])
                idx[t, n_win[t] : n_win[t] + v] = idx_c[t, :v]
                idx[t, n_win[t] + v :] = -1
            cnt = (n_win + visible[r]).astype(np.int32)
        lists[r] = KeyLists(idx, cnt)
    keys = StepKeys(rows, prow, lists, scratch_rows=scratch, comp_rows=comp)
    if CSA in comp:
        ldc = max(1, max(comp[CSA]))
        k = np.arange(ldc)
        keys.crow = np.where(k[None, :] < visible[CSA][:, None], m[:, None] + k[None, :], -1).astype(np.int32)
        keys.ccnt = visible[CSA].astype(np.int32)
    return keys
