"""DeepSeek V4's kernels (hyper.cu, and moe.cu's sqrt-softplus and hash routing) against the numpy
reference's own functions (worker/backends/numpy/hyper.py, kernels/reference.route) on random inputs
with the real model's shapes where they are small (4 streams, 4 Sinkhorn rounds, ratios 4 and 128).
Outputs are poisoned before each launch, so an element a kernel fails to write shows. Marked gpu."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ember.kernels import ops, reference
from ember.worker.backends.numpy import hyper

pytestmark = pytest.mark.gpu

HC, ITERS, HC_EPS, EPS = 4, 20, 1e-6, 1e-6


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def poisoned(dev, shape, dtype=np.float32):
    a = dev.empty(shape, dtype)
    if dtype == np.float32:
        a.poison()
    return a


H = SimpleNamespace(hc_mult=HC, hc_eps=HC_EPS, hc_sinkhorn_iters=ITERS)


def mix_case(rng, n: int, hidden: int, hc: int = HC):
    """A hyper-connection's inputs: streams x [n, hc, hidden], its mix weights fn [(2 + hc) * hc, hc * hidden],
    scale [3] and base."""
    m = (2 + hc) * hc
    x = rng.normal(0, 1, (n, hc, hidden)).astype(np.float32)
    fn = rng.normal(0, 0.02, (m, hc * hidden)).astype(np.float32)
    return x, fn, rng.uniform(0.5, 2, 3).astype(np.float32), rng.normal(0, 1, m).astype(np.float32)


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("hc", [4, 2, 3, 8])
def test_hc_pre_and_merge_match_the_reference(dev, rng, n, hc):
    """The many-token mix and merge; 4 and 2 streams take the comb a lane an element (shuffles), 3 and 8
    a lane a row and a column through shared memory."""
    hidden = 512
    x, fn, scale, base = mix_case(rng, n, hidden, hc)
    h = SimpleNamespace(hc_mult=hc, hc_eps=HC_EPS, hc_sinkhorn_iters=ITERS)
    want_y, want_post, want_comb = hyper.hc_mix(x, fn, scale, base, h, EPS)

    raw = x.reshape(n, -1) @ fn.T  # the matmul the forward pass runs before hc_pre (the norm is hc_pre's)
    d_x = dev.to_device(x)
    y, post, comb = poisoned(dev, (n, hidden)), poisoned(dev, (n, hc)), poisoned(dev, (n, hc, hc))
    ops.hc_pre(dev, d_x, dev.to_device(raw), dev.to_device(scale), dev.to_device(base), y, post, comb, n=n, hc=hc,
               hidden=hidden, eps=EPS, hc_eps=HC_EPS, iters=ITERS)
    assert rel(y.to_host(), want_y) < 1e-5
    assert rel(post.to_host(), want_post) < 1e-5
    assert rel(comb.to_host(), want_comb) < 1e-5
    np.testing.assert_allclose(comb.to_host().sum(axis=1), 1.0, atol=1e-3)  # Sinkhorn: columns sum to one

    sub = rng.normal(0, 1, (n, hidden)).astype(np.float32)  # a sublayer's output
    ops.hc_merge(dev, d_x, dev.to_device(sub), post, comb, n=n, hc=hc, hidden=hidden)
    assert rel(d_x.to_host(), hyper.hc_merge(sub, x, want_post, want_comb)) < 1e-5


@pytest.mark.parametrize("n,m,K", [(41, 24, 16384), (2048, 24, 4096), (5, 4, 200), (17, 80, 1000)])
def test_hc_logits_are_the_mix_matmul_in_float32(dev, rng, n, m, K):
    """Many tokens' mix logits: a prefill chunk at DeepSeek V4's width, many tokens, the head's 4 rows over
    columns that end mid-chunk, and 8 streams' 80 rows (three row blocks); out's rows wider than m."""
    from ember.kernels.ops.quant_matrix import QuantMatrix

    x = rng.normal(0, 1, (n, K)).astype(np.float32)
    fn = rng.normal(0, 0.02, (m, K)).astype(np.float32)
    out = poisoned(dev, (n, m + 3))
    ops.hc_logits(dev, dev.to_device(x), QuantMatrix.upload(dev, fn, "f32", m, K), out, n=n, ldo=m + 3)
    got = out.to_host()
    assert rel(got[:, :m], x.astype(np.float64) @ fn.T.astype(np.float64)) < 1e-5
    assert np.isnan(got[:, m:]).all()  # past each row's m: untouched (poisoned: NaN)


def test_hc_pre_head_mix(dev, rng):
    """The output head's mix: pre alone, from hc logits (HyperStack.head)."""
    n, hidden = 5, 256
    x = rng.normal(0, 1, (n, HC, hidden)).astype(np.float32)
    fn = rng.normal(0, 0.05, (HC, HC * hidden)).astype(np.float32)
    scale, base = np.float32([1.3]), rng.normal(0, 1, HC).astype(np.float32)
    mixes = reference.rms_norm(x.reshape(n, -1), np.ones(HC * hidden, np.float32), EPS) @ fn.T
    pre = 1 / (1 + np.exp(-(mixes * scale[0] + base))) + HC_EPS
    want = np.einsum("nse,ns->ne", x, pre)
    y = poisoned(dev, (n, hidden))
    ops.hc_pre(dev, dev.to_device(x), dev.to_device(x.reshape(n, -1) @ fn.T), dev.to_device(scale),
               dev.to_device(base), y, None, None, n=n, hc=HC, hidden=hidden, eps=EPS, hc_eps=HC_EPS, iters=ITERS)
    assert rel(y.to_host(), want) < 1e-5


@pytest.mark.parametrize("n,hidden", [(1, 4096), (3, 4096), (16, 4096), (2, 200)])
def test_hc_mix_matches_the_reference(dev, rng, n, hidden):
    """A decode's mix with its logits made within, over many blocks whose sums the last of a token adds up:
    at DeepSeek V4's width (and one whose columns end mid-block), the layer's mix and the head's, twice (the
    counts put back for the next launch)."""
    from ember.kernels.ops.quant_matrix import QuantMatrix

    x, fn, scale, base = mix_case(rng, n, hidden)
    want_y, want_post, want_comb = hyper.hc_mix(x, fn, scale, base, H, EPS)
    d_x = dev.to_device(x)
    work = ops.HcMixWork.make(dev, hc=HC, hidden=hidden)
    w = QuantMatrix.upload(dev, fn, "f32", len(fn), HC * hidden)
    for _ in range(2):
        y, post, comb = poisoned(dev, (n, hidden)), poisoned(dev, (n, HC)), poisoned(dev, (n, HC, HC))
        ops.hc_mix(dev, d_x, w, dev.to_device(scale), dev.to_device(base), y, post, comb, work, n=n, hc=HC,
                   hidden=hidden, eps=EPS, hc_eps=HC_EPS, iters=ITERS)
        assert rel(y.to_host(), want_y) < 1e-5
        assert rel(post.to_host(), want_post) < 1e-5
        assert rel(comb.to_host(), want_comb) < 1e-5

    head = QuantMatrix.upload(dev, fn[:HC], "f32", HC, HC * hidden)
    mixes = reference.rms_norm(x.reshape(n, -1), np.ones(HC * hidden, np.float32), EPS) @ fn[:HC].T
    pre = 1 / (1 + np.exp(-(mixes * scale[0] + base[:HC]))) + HC_EPS
    y = poisoned(dev, (n, hidden))
    ops.hc_mix(dev, d_x, head, dev.to_device(scale[:1]), dev.to_device(base[:HC]), y, None, None, work, n=n,
               hc=HC, hidden=hidden, eps=EPS, hc_eps=HC_EPS, iters=ITERS)
    assert rel(y.to_host(), np.einsum("nse,ns->ne", x, pre)) < 1e-5


def block_starts(blocks: range, at: int, ratio: int) -> np.ndarray:
    """compress_rows' starts for a sequence's blocks whose position 0 is rows[at]: each block's first
    position, and the block before's (-1 for block 0)."""
    b = np.asarray(blocks, np.int64)
    return np.stack([at + b * ratio, np.where(b > 0, at + (b - 1) * ratio, -1)], axis=1).astype(np.int32)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False)])
def test_compress_rows_match_the_reference(dev, rng, ratio, overlap):
    """CSA (ratio 4, overlapping) and HCA (128) rows from a pool whose positions sit in shuffled blocks
    of 16 rows (a block table), the value and score columns views of one pool row: two sequences in one
    launch, the first from a later block on (what a step adds), the second whole."""
    d, bs, n_pos = 64, 16, 512
    width = 2 * d if overlap else d
    row = 3 * width + 5  # other columns around them, as in the pool
    n_blocks = 2 * n_pos // bs
    table = rng.permutation(n_blocks)
    kv_at, score_at = 5, 5 + 2 * width
    pool = rng.normal(0, 1, (n_blocks * bs, row)).astype(np.float32)
    pool[:, score_at : score_at + width] *= 3
    seqs = []
    for s_ in range(2):
        p = np.arange(n_pos)
        seqs.append((table[s_ * n_pos // bs + p // bs] * bs + p % bs).astype(np.int32))
    blocks = n_pos // ratio
    want = [hyper.compress(pool[sl, kv_at : kv_at + width], pool[sl, score_at : score_at + width], ratio, blocks,
                           overlap) for sl in seqs]
    first = blocks // 2
    starts = np.concatenate([block_starts(range(first, blocks), 0, ratio), block_starts(range(blocks), n_pos, ratio)])
    d_pool = dev.to_device(pool)
    out = poisoned(dev, (len(starts), d))
    ops.compress_rows(dev, d_pool.view(kv_at, pool.size - kv_at), d_pool.view(score_at, pool.size - score_at),
                      dev.to_device(np.concatenate(seqs)), dev.to_device(starts), out, ld=row, blocks=len(starts),
                      ratio=ratio, width=d, overlap=overlap)
    assert rel(out.to_host(), np.concatenate([want[0][first:], want[1]])) < 1e-5


@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("hashed", [False, True])
def test_sqrt_softplus_routing_matches_the_reference(dev, rng, n, hashed):
    """deepseek4's routing: sqrt(softplus(logit)), the top k of it plus a selection bias (the weights
    unbiased), or a hash table's row for the token; normalised, times the model's scale."""
    E, k, vocab, scale = 256, 6, 1000, 1.5
    logits = rng.normal(0, 2, (n, E)).astype(np.float32)
    bias = rng.normal(0, 0.5, E).astype(np.float32)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    table = np.stack([rng.choice(E, k, replace=False) for _ in range(vocab)]).astype(np.int32)
    top, weights = reference.route(logits, k=k, gating="sqrt-softplus", norm_topk=True, scale=scale,
                                   select_bias=None if hashed else bias, chosen=table[tokens] if hashed else None)
    hashed_args = (dev.to_device(table), dev.to_device(tokens)) if hashed else None
    d_logits, d_bias = dev.to_device(logits), None if hashed else dev.to_device(bias)
    ranked = np.sort(np.sqrt(np.logaddexp(0, logits)) + bias, axis=-1)[:, ::-1]
    clear = np.ones(n, bool) if hashed else (ranked[:, k - 1] - ranked[:, k]) > 1e-5
    assert clear.mean() > 0.8

    def check(ids, wts):
        np.testing.assert_array_equal(ids.to_host()[: n * k].reshape(n, k)[clear], top[clear])
        np.testing.assert_allclose(wts.to_host()[: n * k].reshape(n, k)[clear], weights[clear], rtol=1e-5,
                                   atol=1e-7)

    ids, wts = dev.empty((n * k,), np.int32), poisoned(dev, (n * k,))
    ops.moe_route(dev, d_logits, ids, wts, n=n, experts=E, k=k, gating="sqrt-softplus", norm_topk=True,
                  bias=d_bias, scale=scale, hashed=hashed_args)
    check(ids, wts)
    # routing and grouping in one block (a decode step's few tokens), or two launches past its rows
    s = ops.MoeScratch.alloc(dev, n, E, k, hidden=64, ffn=64)
    s.wts.poison()
    nt = ops.moe_route_group(dev, d_logits, s, n=n, experts=E, k=k, gating="sqrt-softplus", norm_topk=True,
                             tile=8, bias=d_bias, scale=scale, hashed=hashed_args)
    check(s.ids, s.wts)
    tiles = s.tiles.to_host().reshape(-1, 3)[:nt]
    assert tiles[:, 2].sum() == n * k  # every pair in one tile


def test_hash_routing_needs_sqrt_softplus(dev):
    d = dev.empty((4,), np.int32)
    with pytest.raises(ValueError, match="sqrt-softplus"):
        ops.moe_route(dev, dev.empty((8,)), d, dev.empty((4,)), n=1, experts=8, k=4, gating="softmax",
                      norm_topk=True, hashed=(d, d))


@pytest.mark.parametrize("key_type", [np.float32, np.float16])
@pytest.mark.parametrize("n,splits", [(1, None), (6, None), (1, 1), (2, 8), (40, None)])
def test_attend_rows_matches_the_reference(dev, rng, key_type, n, splits):
    """Each query over its own list of pool rows (a window of 128 and picked compressed rows, some slots
    empty), with sinks, at DeepSeek V4's head size (one KV head of 512, 64 query heads); its keys in one
    block, or split over several and merged (twice: the split's counts put back for the next launch). At
    2 rows and 8 splits, some splits of the short rows hold no key."""
    heads, d, rows, ldi = 64, 512, 3000, 700
    pool = rng.normal(0, 1, (rows, d + 16)).astype(key_type)  # rows wider than d: the pool's stride
    q = rng.normal(0, 1, (n, heads, d)).astype(np.float32)
    sinks = rng.normal(0, 1, heads).astype(np.float32)
    cnt = rng.integers(1, ldi + 1, n).astype(np.int32)
    cnt[0] = ldi
    if n == 2:
        cnt[1] = 49  # 8 splits of 7 keys: the last holds none
    idx = np.full((n, ldi), -7, np.int32)  # past cnt: never read
    for t in range(n):
        idx[t, : cnt[t]] = rng.choice(rows, cnt[t], replace=False)
        listed = idx[t, : cnt[t]]
        listed[rng.random(cnt[t]) < 0.1] = -1  # empty slots
    if splits is None:
        assert (ops.hyper.attend_splits(dev, n, heads, ldi) > 1) == (n * heads < 2 * dev.sm_count)
    args = [dev.to_device(a) for a in (q, pool, idx, cnt, sinks)]
    for _ in range(2):
        out = poisoned(dev, (n, heads, d))
        ops.attend_rows(dev, *args, out, n=n, heads=heads, head_dim=d, ld=d + 16, ldi=ldi, splits=splits)
        got = out.to_host()
        for t in range(n):
            chosen = idx[t, : cnt[t]]
            keys = pool[np.maximum(chosen, 0), :d].astype(np.float32)
            want = hyper.attend(q[t : t + 1], keys, (chosen >= 0)[None, :], sinks)
            assert rel(got[t : t + 1], want) < 1e-5


@pytest.mark.parametrize("key_type", [np.float32, np.float16])
def test_indexer_scores_and_top_k_match_the_reference(dev, rng, key_type):
    """The lightning indexer at DeepSeek V4's sizes (64 heads of 128, the top 512): each query's scores of
    the compressed rows it sees, then its best 512 appended after its window's rows. Queries that see no
    more than 512 take all of theirs."""
    n, heads, di, k, rows, ldc, window = 4, 64, 128, 512, 5000, 2000, 100
    pool = rng.normal(0, 1, (rows, di + 8)).astype(key_type)
    q = rng.normal(0, 1, (n, heads, di)).astype(np.float32)
    w = rng.normal(0, 0.1, (n, heads)).astype(np.float32)
    ccnt = np.array([ldc, 1500, 512, 37], np.int32)
    crow = np.stack([rng.choice(rows, ldc, replace=False) for _ in range(n)]).astype(np.int32)
    d_crow, d_ccnt = dev.to_device(crow), dev.to_device(ccnt)
    score = poisoned(dev, (n, ldc))
    ops.indexer_scores(dev, dev.to_device(q), dev.to_device(w), dev.to_device(pool), d_crow, d_ccnt, score, n=n,
                       heads=heads, dim=di, ld=di + 8, ldc=ldc)
    got = score.to_host()
    want = [hyper.indexer_scores(q[t : t + 1], w[t : t + 1], pool[crow[t, : ccnt[t]], :di].astype(np.float32))[0]
            for t in range(n)]
    for t in range(n):
        assert rel(got[t, : ccnt[t]], want[t]) < 1e-5

    ldi = window + k
    idx = np.full((n, ldi), -5, np.int32)
    idx[:, :window] = 7  # the window's rows, placed before
    cnt = np.full(n, window, np.int32)
    d_idx, d_cnt = dev.to_device(idx), dev.to_device(cnt)
    ops.top_k_rows(dev, score, d_crow, d_ccnt, d_idx, d_cnt, n=n, k=k, ldc=ldc, ldi=ldi)
    idx, cnt = d_idx.to_host().reshape(n, ldi), d_cnt.to_host()
    for t in range(n):
        take = min(k, ccnt[t])
        assert cnt[t] == window + take and (idx[t, :window] == 7).all()
        picked = idx[t, window : window + take]
        if take == ccnt[t]:
            assert sorted(picked) == sorted(crow[t, : ccnt[t]])
            continue
        s = got[t, : ccnt[t]]
        order = np.sort(s)[::-1]
        assert order[k - 1] > order[k]  # clear at the k-th (random floats)
        assert set(picked) == set(crow[t, hyper.indexer_top_k(s[None, :], k)[0]])


def test_top_k_rows_breaks_ties_by_position(dev):
    """relu'd scores tie at exactly 0 (rows every head scores negative): the first ones by position fill
    the k, after every row above the tie."""
    n, k, ldc = 1, 8, 300
    s = np.zeros((n, ldc), np.float32)
    s[0, [250, 20, 99]] = [3.0, 2.0, 1.0]
    crow = np.arange(ldc, dtype=np.int32)[None, :] + 1000
    idx, cnt = dev.to_device(np.full((n, k), -1, np.int32)), dev.to_device(np.zeros(n, np.int32))
    ops.top_k_rows(dev, dev.to_device(s), dev.to_device(crow), dev.to_device(np.int32([ldc])), idx, cnt, n=n, k=k,
                   ldc=ldc, ldi=k)
    picked = idx.to_host().reshape(-1)
    assert cnt.to_host()[0] == k
    assert set(picked[:3]) == {1250, 1020, 1099} and list(picked[3:]) == [1000, 1001, 1002, 1003, 1004]


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_on_the_heads_last_dims_and_back(dev, rng, yarn):
    """DeepSeek V4's RoPE: adjacent pairs of each head's last n_rot dimensions turn (q's 64 heads and the
    KV row's one), and the attention output turns back (hyper.rope_tail, inverse too): rope.cu on views at
    that offset, with the head stride."""
    from ember.worker.model.config import Yarn

    n, heads, d, n_rot = 9, 64, 512, 64
    freqs = hyper.rope_frequencies(160000.0, n_rot, Yarn(16.0, 65536, False) if yarn else None)
    freqs = freqs.astype(np.float32).astype(np.float64)  # the kernel's inverse frequencies are float32
    pos = rng.integers(0, 60000, n).astype(np.int32)
    q = rng.normal(0, 1, (n, heads, d)).astype(np.float32)
    k = rng.normal(0, 1, (n, d)).astype(np.float32)
    d_q, d_k = dev.to_device(q), dev.to_device(k)
    off = d - n_rot
    args = dict(n=n, hq=heads, hk=1, head_dim=n_rot, neox=False, ldq=heads * d, ldk=d, head_stride=d)
    inv = dev.to_device(freqs.astype(np.float32))
    ops.rope(dev, d_q.view(off, q.size - off), d_k.view(off, k.size - off), dev.to_device(pos), inv, **args)
    got_q, got_k = d_q.to_host().reshape(q.shape), d_k.to_host().reshape(k.shape)
    close = dict(rtol=1e-6, atol=1e-6)  # cos and sin in double on both sides, each library's own last bit
    np.testing.assert_allclose(got_q, hyper.rope_tail(q, pos, freqs), **close)
    np.testing.assert_allclose(got_k, hyper.rope_tail(k, pos, freqs), **close)
    assert (got_q[..., :off] == q[..., :off]).all()  # the other dimensions untouched
    ops.rope(dev, d_q.view(off, q.size - off), None, dev.to_device(pos), inv, **args, inverse=True)
    back = d_q.to_host().reshape(q.shape)
    np.testing.assert_allclose(back, hyper.rope_tail(got_q, pos, freqs, inverse=True), **close)
    np.testing.assert_allclose(back, q, rtol=1e-5, atol=1e-5)  # there and back


@pytest.mark.parametrize("with_ape", [False, True])
def test_store_rows_into_pool_columns(dev, rng, with_ape):
    """A step's rows into a column range of the per-position pool at their slots (the twin's
    rows[slots, cols] = ...), a compressor's score rows with their position's bias."""
    n, width, ld, col, ratio = 37, 96, 300, 40, 4
    src = rng.normal(0, 1, (n, width)).astype(np.float32)
    slots = rng.permutation(200)[:n].astype(np.int32)
    pos = rng.integers(0, 1000, n).astype(np.int32)
    ape = rng.normal(0, 1, (ratio, width)).astype(np.float32)
    pool = rng.normal(0, 1, (200, ld)).astype(np.float32)
    want = pool.copy()
    want[slots, col : col + width] = src + (ape[pos % ratio] if with_ape else 0)
    d_pool = dev.to_device(pool)
    ops.store_rows(dev, dev.to_device(src), dev.to_device(slots), d_pool.view(col, d_pool.size - col), n=n,
                   width=width, lds=width, ldd=ld,
                   ape=(dev.to_device(ape), dev.to_device(pos), ratio) if with_ape else None)
    np.testing.assert_array_equal(d_pool.to_host(), want)  # untouched elsewhere, exact where written


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_clamped_swiglu_matches_the_twin(dev, rng, limit):
    n, ffn = 19, 160
    gu = rng.normal(0, 3, (n, 2 * ffn)).astype(np.float32)  # gate | up, as the stacked experts write them
    want = hyper.clamped_swiglu(gu[:, :ffn], gu[:, ffn:], limit)
    d = dev.to_device(gu)
    out = poisoned(dev, (n, ffn))
    ops.clamped_swiglu(dev, d, d.view(ffn, d.size - ffn), out, n=n, ffn=ffn, limit=limit, ldg=2 * ffn, ldu=2 * ffn)
    np.testing.assert_allclose(out.to_host(), want, rtol=1e-5, atol=1e-6)
    if limit:
        assert np.abs(gu).max() > 2 * limit  # the clamp was exercised


@pytest.mark.parametrize("a, b, width", [(5, 3, 70), (9000, 8, 3)], ids=["small", "past-grid-y"])
def test_swap_rows_is_a_transpose(dev, rng, a, b, width):
    """Also past the grid's 65535 rows in y (a 9000-token prefill chunk's rows times 8 output groups)."""
    x = rng.normal(0, 1, (a, b, width)).astype(np.float32)
    out = poisoned(dev, (b, a, width))
    ops.swap_rows(dev, dev.to_device(x), out, a=a, b=b, width=width)
    np.testing.assert_array_equal(out.to_host(), x.swapaxes(0, 1))


def test_store_rows_past_the_grids_rows(dev, rng):
    """More rows than a grid has in y (the MTP layer stores a 16k-token step's n * 4 stream rows at once)."""
    n, width = 70_000, 5
    src = rng.normal(0, 1, (n, width)).astype(np.float32)
    slots = rng.permutation(n + 100)[:n].astype(np.int32)
    pool = poisoned(dev, (n + 100, width))
    want = pool.to_host()
    want[slots] = src
    ops.store_rows(dev, dev.to_device(src), dev.to_device(slots), pool, n=n, width=width, lds=width, ldd=width)
    np.testing.assert_array_equal(pool.to_host(), want)


def test_mean_streams_into_a_column_block(dev, rng):
    """Each token's streams averaged, written at a row stride (a block drafter's features: one block of
    columns a target layer)."""
    x = rng.normal(0, 1, (6, 4, 300)).astype(np.float32)
    out = poisoned(dev, (6, 900))
    ops.mean_streams(dev, dev.to_device(x), out.view(300, 6 * 900 - 300), n=6, hc=4, hidden=300, ldo=900)
    got = out.to_host()
    np.testing.assert_allclose(got[:, 300:600], x.mean(axis=1), rtol=1e-6, atol=1e-6)
    assert np.isnan(got[:, :300]).all() and np.isnan(got[:, 600:]).all()  # the other columns untouched


def test_round_half_is_numpys_float16_rounding(dev, rng):
    x = np.concatenate([rng.normal(0, 3, 5000), [65504.0, 1e-8, -0.0, 0.1]]).astype(np.float32)
    buf = dev.to_device(x)
    ops.round_half(dev, buf, n=len(x))
    np.testing.assert_array_equal(buf.to_host(), x.astype(np.float16).astype(np.float32))
