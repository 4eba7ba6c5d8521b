"""The CUDA DeepSeek V4 step's key lists (worker/backends/cuda/hyper_keys.py), planned on the host: each query
row attends to exactly the keys the numpy twin's masks allow (hyper.HyperStack._attention: the window's
positions p - window < p' <= p, every compressed row of a whole block up to p in an HCA layer, the indexer's
candidates in a CSA layer), through the step's one scratch, whose rows name the right pool rows (a window
row) or the pool rows holding the right compress block's pieces (a compressed row); and the step closes
exactly the blocks whose last position it computes, from their positions' pool rows. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.cuda import hyper_keys
from ember.worker.backends.numpy.hyper import HyperStack

BS, WINDOW, TOP_K = 16, 16, 8


def _twin_masks(c: SeqChunk, ratio: int):
    """The twin's keys of each of the chunk's queries: (window positions, visible compressed rows) per row."""
    end = c.start + len(c.tokens)
    first = max(0, c.start - WINDOW + 1)
    kpos = np.arange(first, end)
    out = []
    for p in range(c.start, end):
        allowed = kpos[(kpos <= p) & (kpos > p - WINDOW)]
        visible = np.arange(end // ratio)[np.arange(end // ratio) < (p + 1) // ratio] if ratio else np.zeros(0, int)
        out.append((set(allowed.tolist()), set(visible.tolist())))
    return out


def _chunks(rng) -> list[SeqChunk]:
    """A step as the scheduler makes them: a long prefill chunk mid-sequence, a first chunk, decodes at
    depths on both sides of the HCA block and of the window, each over scattered blocks."""
    spec = [(260, 40), (0, 37), (15, 1), (16, 1), (127, 1), (128, 1), (300, 1), (0, 1)]
    perm = rng.permutation(200).tolist()
    out = []
    for start, n in spec:
        blocks = -(-(start + n) // BS)
        table, perm = perm[:blocks], perm[blocks:]
        out.append(SeqChunk(rng.integers(0, 700, n).astype(np.int32), start, table, "last"))
    return out


def _pool_rows(c: SeqChunk, positions) -> np.ndarray:
    p = np.asarray(positions)
    return np.asarray(c.block_table)[p // BS] * BS + p % BS


def _pieces(c: SeqChunk, block: int, ratio: int) -> list[int]:
    """The pool rows of compress block `block`'s pieces: its last `spread` positions' (HyperStack's layout)."""
    s = HyperStack.spread(ratio, BS)
    return _pool_rows(c, np.arange((block + 1) * ratio - s, (block + 1) * ratio)).tolist()


def _compressed_row(keys: hyper_keys.StepKeys, c: SeqChunk, ci: int, s: int, ratio: int) -> int:
    """Chunk ci's compressed row that scratch row s holds, checked to be gathered from its block's pieces."""
    ch, comp, M = keys.chunks[ci], keys.comp[ratio], keys.window_rows
    j = s - M - comp.at[ci]
    assert 0 <= j < ch.end // ratio
    sp = comp.spread
    assert comp.pieces[(s - M) * sp : (s - M + 1) * sp].tolist() == _pieces(c, j, ratio)
    return j


@pytest.mark.parametrize("ratios", [{0}, {0, 4, 128}, {4}, {128}])
def test_each_query_attends_to_the_twins_keys(ratios):
    chunks = _chunks(np.random.default_rng(3))
    keys = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios=ratios, top_k=TOP_K)
    M, row = keys.window_rows, 0
    for ci, c in enumerate(chunks):
        ch = keys.chunks[ci]
        end = c.start + len(c.tokens)
        assert ch.end == end and ch.first == max(0, c.start - WINDOW + 1) and ch.m == end - ch.first
        # the pool row of every position the blocks it closes read (HCA's open block, CSA's and the one
        # before it), as kv_slots computes a new token's
        want = _pool_rows(c, np.arange(end))
        reads = [max(0, (c.start // r - (r == 4)) * r) for r in ratios if r]
        assert ch.lo == min(reads, default=end)
        np.testing.assert_array_equal(keys.prow[ch.prow_at : ch.prow_at + end - ch.lo], want[ch.lo :])
        # its window rows in the scratch: positions first .. end - 1, from their pool rows
        np.testing.assert_array_equal(keys.wrows[ch.win_at : ch.win_at + ch.m], want[ch.first :])

        for ratio in ratios:
            twin = _twin_masks(c, ratio)
            lists = keys.lists[ratio]
            for t, (window, visible) in enumerate(twin):
                got = lists.idx[row + t, : lists.cnt[row + t]].tolist()
                assert -1 not in got and len(got) == len(set(got))
                assert all(ch.win_at <= r < ch.win_at + ch.m for r in got if r < M)  # its own chunk's
                win = {ch.first + r - ch.win_at for r in got if r < M}
                comp = {_compressed_row(keys, c, ci, r, ratio) for r in got if r >= M}
                assert win == window
                if ratio == 4:  # the window only: the indexer appends its picks on the device
                    assert not comp
                    assert keys.crow is not None and keys.ccnt is not None
                    cand = keys.crow[row + t, : keys.ccnt[row + t]]
                    assert {_compressed_row(keys, c, ci, r, ratio) for r in cand} == visible
                    assert len(cand) == len(visible)
                    assert lists.idx.shape[1] >= len(window) + min(TOP_K, len(visible))
                else:
                    assert comp == visible
        row += len(c.tokens)
    assert row == sum(len(c.tokens) for c in chunks)
    # the scratch holds the window rows and any layer kind's compressed rows at once
    assert keys.scratch_rows == M + max((comp.rows for comp in keys.comp.values()), default=0)
    for ratio, comp in keys.comp.items():
        assert comp.rows == sum((c.start + len(c.tokens)) // ratio for c in chunks)


@pytest.mark.parametrize("ratios", [{0, 4, 128}, {4}, {128}])
def test_the_step_closes_the_blocks_whose_last_position_it_computes(ratios):
    """Each compress block whose last position a chunk computes, once: made from its own positions (and in
    CSA the block before's, none before the first), RoPE at its first position, stored into its pieces."""
    chunks = _chunks(np.random.default_rng(3))
    keys = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios=ratios, top_k=TOP_K)
    for ratio in (r for r in ratios if r):
        cl, at = keys.closing[ratio], 0
        for ci, c in enumerate(chunks):
            ch, end = keys.chunks[ci], c.start + len(c.tokens)
            for b in range(c.start // ratio, end // ratio):  # the twin's: its last position in this chunk
                own, before = cl.starts[at].tolist()
                read = keys.prow[own : own + ratio].tolist()
                assert read == _pool_rows(c, np.arange(b * ratio, (b + 1) * ratio)).tolist()
                if ratio == 4 and b > 0:
                    read = keys.prow[before : before + 4].tolist()
                    assert read == _pool_rows(c, np.arange(b * 4 - 4, b * 4)).tolist()
                else:
                    assert before == -1
                assert cl.positions[at] == b * ratio
                assert cl.pieces[at * cl.spread : (at + 1) * cl.spread].tolist() == _pieces(c, b, ratio)
                at += 1
            assert ch.prow_at + end - ch.lo <= len(keys.prow)
        assert at == cl.blocks
    assert keys.closing[4 if 4 in ratios else 128].blocks > 0


def test_a_step_of_single_tokens_at_position_zero():
    chunks = [SeqChunk(np.array([5], np.int32), 0, [i], "last") for i in range(3)]
    keys = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios={0, 4, 128}, top_k=TOP_K)
    for r in (0, 4, 128):
        np.testing.assert_array_equal(keys.lists[r].cnt, [1, 1, 1])
        np.testing.assert_array_equal(keys.lists[r].idx[:, 0], [0, 1, 2])  # each its own window row
    assert keys.comp[4].rows == keys.comp[128].rows == 0
    assert keys.ccnt is not None and not keys.ccnt.any()
    np.testing.assert_array_equal(keys.prow, [0, BS, 2 * BS])


def _shapes(keys: hyper_keys.StepKeys) -> tuple:
    return (keys.prow.shape, keys.wrows.shape, keys.crow.shape if keys.crow is not None else None,
            {r: (kl.idx.shape, kl.cnt.shape) for r, kl in keys.lists.items()},
            {r: c.pieces.shape for r, c in keys.comp.items()},
            {r: (c.starts.shape, c.positions.shape, c.pieces.shape) for r, c in keys.closing.items()})


def test_a_padded_decode_step_keeps_its_shape_and_its_keys():
    """A captured step's plan: every array's shape a function of (rows, context) alone, so one graph
    replays for steps at different depths; the real rows see exactly the keys of the unpadded plan; the
    padded rows attend to scratch row 0, see no compressed row, and their blocks read the trash row."""
    rng = np.random.default_rng(5)
    ratios, trash = {0, 4, 128}, 10_000
    pad = hyper_keys.Pad(rows=4, context=512, trash=trash)

    def decode(depths):
        perm = rng.permutation(200).tolist()
        out = []
        for d in depths:
            blocks = -(-(d + 1) // BS)
            table, perm = perm[:blocks], perm[blocks:]
            out.append(SeqChunk(np.array([7], np.int32), d, table, "last"))
        return out

    shapes = set()
    for depths in ([3, 300], [130, 511, 17], [0]):
        chunks = decode(depths)
        plain = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios=ratios, top_k=TOP_K)
        padded = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios=ratios, top_k=TOP_K, pad=pad)
        shapes.add(str(_shapes(padded)))
        n = len(chunks)
        for r in ratios:
            a, b = plain.lists[r], padded.lists[r]
            for t in range(n):  # the same pool rows and compressed blocks, through each plan's scratch
                assert _keys_of(plain, r, a.idx[t, : a.cnt[t]]) == _keys_of(padded, r, b.idx[t, : b.cnt[t]])
            np.testing.assert_array_equal(b.cnt[n:], 1)
            np.testing.assert_array_equal(b.idx[n:, 0], 0)
        assert padded.ccnt is not None and plain.ccnt is not None and plain.crow is not None
        np.testing.assert_array_equal(padded.ccnt[:n], plain.ccnt)
        assert not padded.ccnt[n:].any()
        for t in range(n):
            assert (_keys_of(plain, 4, plain.crow[t, : plain.ccnt[t]])
                    == _keys_of(padded, 4, padded.crow[t, : padded.ccnt[t]]))
        assert (padded.wrows[plain.window_rows :] == trash).all()
        for r, comp in padded.comp.items():
            assert (comp.pieces[plain.comp[r].rows * comp.spread :] == trash).all()
            cl, real = padded.closing[r], plain.closing[r].blocks
            np.testing.assert_array_equal(cl.pieces[: real * cl.spread], plain.closing[r].pieces)
            extra = cl.starts[real:]
            assert (padded.prow[extra[:, 0, None] + np.arange(r)] == trash).all() and (extra[:, 1] == -1).all()
            assert (cl.pieces[real * cl.spread :] == trash).all()
    assert len(shapes) == 1


def _keys_of(keys: hyper_keys.StepKeys, ratio: int, rows) -> set:
    """What scratch rows hold: ("pool", pool row) for a window row, ("block", its pieces' pool rows) for a
    compressed row."""
    out = set()
    for s in rows:
        if s < keys.window_rows:
            out.add(("pool", int(keys.wrows[s])))
        else:
            comp, j = keys.comp[ratio], s - keys.window_rows
            out.add(("block", tuple(comp.pieces[j * comp.spread : (j + 1) * comp.spread].tolist())))
    return out
