"""Which key rows each query of a DeepSeek V4 step attends to, and which compress blocks the step closes,
planned on the host (hyper.py's step reads them from the device).

A layer's attention runs over one scratch of key rows for the whole step, so that each of its kernels is
one launch whatever the number of sequences: first every chunk's window rows (its positions `first` ..
end - 1, gathered from the pool: chunk after chunk, `wrows` naming their pool rows), then the layer's
compressed rows, chunk after chunk (row j of a chunk's is its compress block j, positions j * ratio ..,
gathered from the pieces the pool keeps of it: `comp`). A query at position p sees the window rows
p - window < p' <= p and the compressed rows of whole blocks up to p (j < (p + 1) // ratio): every one of
them in an HCA layer; in a CSA layer the lightning indexer picks at most top_k of those on the device
(their candidates: `crow`, `ccnt`), appended after the window's. The numpy twin is
hyper.HyperStack._attention's `allowed` and `visible` masks.

Before it reads them, the step makes the compressed rows of the blocks whose last position it computes
(`closing`: each from its positions' pool rows, named in `prow`, and for CSA the block before's) and
stores their pieces in the pool (HyperStack's module docstring: a row spread over its block's last
positions). So a step reads the per-position rows of the blocks it closes alone, not the whole context.

A captured decode step (hyper_step.py) needs the same launches every time it replays: `pad` plans it for
`rows` sequences of at most `context` positions, every size a function of those two alone. The rows past
the step's are padding: window rows, compressed rows and closed blocks read and write the trash block's
rows, a padded query attends to scratch row 0, sees no compressed row, and its outputs are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base import SeqChunk
from ..numpy.hyper import CSA, HCA, HyperStack


@dataclass
class ChunkRows:
    """One chunk's place in the step: its window's first position and row count, where its window rows
    start in the scratch, and which of its positions' pool rows the step's `prow` holds (lo .. end - 1)."""

    first: int
    m: int  # window rows gathered (positions first .. end - 1)
    end: int  # positions in the sequence after this step
    prow_at: int  # offset of position lo's pool row in StepKeys.prow
    win_at: int  # scratch row of its window's first row
    lo: int = 0  # the first position the blocks it closes read
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # its block table, int64


@dataclass
class KeyLists:
    """Per query row of the step, its key rows (scratch row ids, -1 unused) and how many."""

    idx: np.ndarray  # int32 [n, ldi]
    cnt: np.ndarray  # int32 [n]


@dataclass
class Compressed:
    """A layer kind's compressed rows of the step, chunk after chunk, after the window rows in the scratch,
    each gathered from its `spread` pieces in the pool."""

    pieces: np.ndarray  # int32 [rows * spread]: each row's pieces' pool rows, row after row
    spread: int
    at: list[int]  # per chunk, the index of its first compressed row

    @property
    def rows(self) -> int:
        return len(self.pieces) // self.spread


@dataclass
class Closing:
    """The compress blocks of a layer kind whose last position the step computes: made from their positions'
    pool rows (compress_rows), then stored as `spread` pieces in the pool."""

    starts: np.ndarray  # int32 [blocks, 2]: offsets in prow of its first position and the block before's (-1)
    positions: np.ndarray  # int32 [blocks]: its first position (its RoPE's)
    pieces: np.ndarray  # int32 [blocks * spread]: the pool rows its pieces go to, block after block
    spread: int

    @property
    def blocks(self) -> int:
        return len(self.positions)


@dataclass
class StepKeys:
    chunks: list[ChunkRows]
    prow: np.ndarray  # int32: each chunk's pool row of its positions lo .. end - 1, chunk after chunk
    wrows: np.ndarray  # int32 [window rows]: the pool row of each window row of the scratch
    lists: dict[int, KeyLists]  # by compress ratio (0: the window alone; CSA: the window, before the indexer's)
    crow: np.ndarray | None = None  # CSA: int32 [n, ldc] each query's candidate compressed rows (scratch rows)
    ccnt: np.ndarray | None = None  # int32 [n]: how many it sees
    comp: dict[int, Compressed] = field(default_factory=dict)  # by ratio
    closing: dict[int, Closing] = field(default_factory=dict)  # by ratio

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
    compressed = sorted(r for r in ratios if r)
    # the most positions the blocks a decode row closes read: HCA's block, CSA's and the one before it
    span = max((2 * r if r == CSA else r for r in compressed), default=0)
    rows, prows, wrows, at, win_at = [], [], [], 0, 0
    for c in chunks:
        end = c.start + len(c.tokens)
        w0 = max(0, c.start - window + 1)
        reads = min((max(0, (c.start // r - (r == CSA)) * r) for r in compressed), default=end)
        table = np.asarray(c.block_table, np.int64)  # once: a list of thousands of blocks is slow to convert
        prows.append(pool_rows(table, np.arange(reads, end), block_size))
        wrows.append(pool_rows(table, np.arange(w0, end), block_size))
        rows.append(ChunkRows(w0, end - w0, end, at, win_at, reads, table))
        at += end - reads
        win_at += end - w0
    pos = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
    n = len(pos)
    if pad is not None and at > pad.rows * span:
        raise ValueError(f"a step of {at} closing positions exceeds its padded shape {pad}")
    # padded: to rows * span, then trash rows for the padded closing blocks (from prow[at] on)
    tail = [] if pad is None else [np.full(pad.rows * span - at + max(compressed, default=0), pad.trash)]
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
    for r in compressed:
        seen = None if pad is None else (pad.rows * (pad.context // r), pad.trash)
        keys.comp[r] = _compressed(rows, r, block_size, seen)
        keys.closing[r] = _closing(chunks, rows, r, block_size, None if pad is None else (pad.rows, at, pad.trash))
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


def pool_rows(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool rows of a sequence's positions, by its block table (as kv_slots finds a new token's)."""
    return table[positions // block_size] * block_size + positions % block_size


def _pieces(table: np.ndarray, blocks: np.ndarray, ratio: int, block_size: int) -> np.ndarray:
    """The pool rows holding compress blocks' pieces, block after block (HyperStack._spread_rows): a block's
    pieces are consecutive rows of one pool block, so each block's first is found, then the rest added."""
    s = HyperStack.spread(ratio, block_size)
    return (pool_rows(table, (blocks + 1) * ratio - s, block_size)[:, None] + np.arange(s)[None, :]).reshape(-1)


def _compressed(rows: list[ChunkRows], ratio: int, block_size: int, pad: tuple[int, int] | None) -> Compressed:
    """Every chunk's compressed rows of whole blocks of `ratio` positions, gathered from their pieces;
    pad (rows, trash): as many rows, the rest read from the trash row. All chunks at once: a decode step at
    depth names thousands of rows a sequence, and a loop over the sequences was most of its host time."""
    s = HyperStack.spread(ratio, block_size)
    counts = np.array([ch.end // ratio for ch in rows], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(rows) else np.zeros(0, np.int64)
    total = int(counts.sum())
    size = total if pad is None else pad[0]
    pieces = np.full((size, s), -1 if pad is None else pad[1], np.int32)
    if total:
        owner = np.repeat(np.arange(len(rows)), counts)
        first = (np.arange(total) - np.repeat(starts, counts) + 1) * ratio - s  # each row's first piece's position
        longest = max(len(ch.table) for ch in rows)
        tables = np.zeros((len(rows), longest), np.int64)
        for i, ch in enumerate(rows):
            tables[i, : len(ch.table)] = ch.table
        pieces[:total] = (tables[owner, first // block_size] * block_size + first % block_size)[:, None] + np.arange(s)
    return Compressed(pieces.reshape(-1), s, [int(a) for a in starts])


def _closing(chunks: list[SeqChunk], rows: list[ChunkRows], ratio: int, block_size: int,
             pad: tuple[int, int, int] | None) -> Closing:
    """The blocks of `ratio` positions whose last position each chunk computes; pad (blocks, trash_at, trash):
    as many blocks (a decode row closes at most one), the rest made from prow[trash_at ..] into the trash row."""
    s = HyperStack.spread(ratio, block_size)
    starts, positions, pieces = [np.zeros((0, 2), np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for c, ch in zip(chunks, rows, strict=True):
        b = np.arange(c.start // ratio, ch.end // ratio, dtype=np.int64)
        own = ch.prow_at + b * ratio - ch.lo
        before = np.where(b > 0, own - ratio, -1) if ratio == CSA else np.full(len(b), -1)
        starts.append(np.stack([own, before], axis=1))
        positions.append(b * ratio)
        pieces.append(_pieces(ch.table, b, ratio, block_size))
    total = sum(len(p) for p in positions)
    if pad is not None:
        if total > pad[0]:
            raise ValueError(f"a padded step closes {total} blocks of {ratio} for {pad[0]} rows")
        starts.append(np.tile([pad[1], -1], (pad[0] - total, 1)))
        positions.append(np.zeros(pad[0] - total, np.int64))
        pieces.append(np.full((pad[0] - total) * s, pad[2]))
    return Closing(np.concatenate(starts).astype(np.int32), np.concatenate(positions).astype(np.int32),
                   np.concatenate(pieces).astype(np.int32), s)
