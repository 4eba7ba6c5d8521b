"""The CUDA DeepSeek V4 step's key lists (worker/backends/cuda/hyper_keys.py), planned on the host: each query
row attends to exactly the keys the numpy twin's masks allow (hyper.HyperStack._attention: the window's
positions p - window < p' <= p, every compressed row of a whole block up to p in an HCA layer, the indexer's
candidates in a CSA layer), through scratch rows that name the right pool rows. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.cuda import hyper_keys

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


@pytest.mark.parametrize("ratios", [{0}, {0, 4, 128}, {4}, {128}])
def test_each_query_attends_to_the_twins_keys(ratios):
    chunks = _chunks(np.random.default_rng(3))
    keys = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios=ratios, top_k=TOP_K)
    row = 0
    for ci, c in enumerate(chunks):
        ch = keys.chunks[ci]
        end = c.start + len(c.tokens)
        assert ch.end == end and ch.first == max(0, c.start - WINDOW + 1) and ch.m == end - ch.first
        # the pool row of every position of the sequence, as kv_slots computes a new token's
        p = np.arange(end)
        want = np.asarray(c.block_table)[p // BS] * BS + p % BS
        np.testing.assert_array_equal(keys.prow[ch.prow_at : ch.prow_at + end], want)
        for ratio in ratios:
            twin = _twin_masks(c, ratio)
            lists = keys.lists[ratio]
            for t, (window, visible) in enumerate(twin):
                got = lists.idx[row + t, : lists.cnt[row + t]].tolist()
                assert -1 not in got and len(got) == len(set(got))
                win = {ch.first + r for r in got if r < ch.m}  # scratch row r: position first + r
                comp = {r - ch.m for r in got if r >= ch.m}  # scratch row m + j: compressed row j
                assert win == window
                if ratio == 4:  # the window only: the indexer appends its picks on the device
                    assert not comp
                    assert keys.crow is not None and keys.ccnt is not None
                    cand = keys.crow[row + t, : keys.ccnt[row + t]] - ch.m
                    assert set(cand.tolist()) == visible and len(cand) == len(visible)
                    assert lists.idx.shape[1] >= len(window) + min(TOP_K, len(visible))
                else:
                    assert comp == visible
        row += len(c.tokens)
    assert row == sum(len(c.tokens) for c in chunks)
    # the scratch holds any chunk's window rows and its compressed rows at once
    for ci, ch in enumerate(keys.chunks):
        assert keys.scratch_rows >= ch.m + max((keys.comp_rows[r][ci] for r in keys.comp_rows), default=0)


def test_a_step_of_single_tokens_at_position_zero():
    chunks = [SeqChunk(np.array([5], np.int32), 0, [i], "last") for i in range(3)]
    keys = hyper_keys.plan(chunks, block_size=BS, window=WINDOW, ratios={0, 4, 128}, top_k=TOP_K)
    for r in (0, 4, 128):
        np.testing.assert_array_equal(keys.lists[r].cnt, [1, 1, 1])
        np.testing.assert_array_equal(keys.lists[r].idx[:, 0], [0, 0, 0])
    assert keys.ccnt is not None and not keys.ccnt.any()
    np.testing.assert_array_equal(keys.prow, [0, BS, 2 * BS])
