"""The numpy reference engine: paging, chunking and batching must not change the math."""

from __future__ import annotations

import numpy as np
import pytest

from ember.kernels import reference as ops
from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model
from ember.worker.model.config import read_config
from ember.worker.model.gguf_file import GGUFFile
from ember.worker.model.weights import load_weights

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = make_model(request.param, "tiny", tmp_path_factory.mktemp("m") / f"{request.param}.gguf", seed=1)
    g = GGUFFile(path)
    cfg = read_config(g)
    return cfg, load_weights(g, cfg)


def _backend(tiny, n_blocks=64, block_size=4):
    cfg, w = tiny
    return NumpyBackend(cfg, w, n_blocks=n_blocks, block_size=block_size)


def _tokens(cfg, n, seed):
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, n).astype(np.int32)


def test_chunked_prefill_matches_one_shot(tiny):
    cfg = tiny[0]
    toks = _tokens(cfg, 37, 0)  # longer than gemma's window of 8, crosses many 4-token blocks
    one = _backend(tiny).forward([SeqChunk(toks, 0, list(range(10)), "all")])[0]
    be = _backend(tiny)
    parts, at = [], 0
    for n in (5, 1, 13, 18):
        parts.append(be.forward([SeqChunk(toks[at : at + n], at, list(range(10)), "all")])[0])
        at += n
    np.testing.assert_allclose(np.concatenate(parts), one, rtol=1e-4, atol=1e-4)


def test_block_table_order_does_not_matter(tiny):
    cfg = tiny[0]
    toks = _tokens(cfg, 30, 1)
    a = _backend(tiny).forward([SeqChunk(toks, 0, list(range(8)), "all")])[0]
    scattered = [41, 3, 17, 60, 9, 28, 55, 0]
    b = _backend(tiny).forward([SeqChunk(toks, 0, scattered, "all")])[0]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_batched_step_matches_solo_runs(tiny):
    """A prefill chunk, a decode step and a mid-sequence chunk in one step equal their solo runs."""
    cfg = tiny[0]
    seqs = [_tokens(cfg, n, 10 + n) for n in (12, 20, 9)]
    solo = []
    for s in seqs:
        be = _backend(tiny)
        be.forward([SeqChunk(s[:-3], 0, list(range(8)), "none")])
        solo.append(be.forward([SeqChunk(s[-3:], len(s) - 3, list(range(8)), "all")])[0])
    be = _backend(tiny)
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    for s, t in zip(seqs, tables, strict=True):
        be.forward([SeqChunk(s[:-3], 0, t, "none")])
    together = be.forward([SeqChunk(s[-3:], len(s) - 3, t, "all") for s, t in zip(seqs, tables, strict=True)])
    for a, b in zip(solo, together, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_kv_block_round_trip(tiny):
    cfg = tiny[0]
    toks = _tokens(cfg, 16, 2)
    be = _backend(tiny)
    be.forward([SeqChunk(toks[:12], 0, [0, 1, 2], "none")])
    ref = be.forward([SeqChunk(toks[12:], 12, [0, 1, 2, 3], "all")])[0]
    saved = [be.read_block(b) for b in (0, 1, 2)]
    other = _backend(tiny)
    for dst, data in zip((7, 5, 6), saved, strict=True):
        other.write_block(dst, data)
    got = other.forward([SeqChunk(toks[12:], 12, [7, 5, 6, 9], "all")])[0]
    np.testing.assert_array_equal(ref, got)


# -- kernels against naive definitions ------------------------------------------------------------


def _naive_attention(q, k, v, pos, window, scale):
    n, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros_like(q)
    for i in range(n):
        for h in range(heads):
            keys = [j for j in range(len(k)) if j <= pos[i] and (not window or pos[i] - j < window)]
            s = np.array([q[i, h] @ k[j, h // group] for j in keys], dtype=np.float64) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[j, h // group] for pj, j in zip(p, keys, strict=True))
    return out


@pytest.mark.parametrize("n,window,heads,kv", [(1, 0, 4, 2), (5, 0, 4, 1), (6, 4, 4, 2), (1, 3, 2, 2), (30, 8, 8, 2)])
def test_attention_matches_naive(n, window, heads, kv):
    rng = np.random.default_rng(n + window)
    L, d = 40, 16
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    k = rng.standard_normal((L, kv, d)).astype(np.float32)
    v = rng.standard_normal((L, kv, d)).astype(np.float32)
    pos = np.arange(L - n, L)
    got = ops.attention(q, k, v, pos, window=window, scale=0.25)
    np.testing.assert_allclose(got, _naive_attention(q, k, v, pos, window, 0.25), rtol=1e-4, atol=1e-5)
    assert got.dtype == np.float32


def test_rope_flavours():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 5, 1000])
    inv = 1.0 / 10000.0 ** (np.arange(4) * 2 / 8)
    cos, sin = ops.rope_tables(pos, inv)
    neox, normal = ops.rope(x, cos, sin, neox=True), ops.rope(x, cos, sin, neox=False)
    for i, p in enumerate(pos):
        for j in range(4):
            a = p * inv[j]
            rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
            np.testing.assert_allclose(neox[i, :, [j, j + 4]], rot @ x[i, :, [j, j + 4]], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(normal[i, :, [2 * j, 2 * j + 1]], rot @ x[i, :, [2 * j, 2 * j + 1]], rtol=1e-5,
                                       atol=1e-5)
    np.testing.assert_array_equal(neox[0], x[0])  # position 0 is the identity


def test_rms_norm_and_activations_stay_float32():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    w = np.full(32, 2.0, np.float32)
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * 2,
                               rtol=1e-5)
    assert ops.gelu_tanh(x).dtype == np.float32 and ops.silu(x).dtype == np.float32
    np.testing.assert_allclose(ops.gelu_tanh(np.float32([0.0, 1.0]))[1], 0.841192, rtol=1e-5)


def test_kv_slots_follow_the_block_tables():
    """Slot of position p = table[p // bs] * bs + p % bs, for decode steps of many one-token chunks
    (the fast path) and for mixed steps; tables that do not cover a chunk or name a block outside
    the pool are refused."""
    from ember.worker.backends.base import kv_slots

    rng = np.random.default_rng(11)
    bs, pool = 16, 500
    for one_token in (True, False):
        chunks, want = [], []
        for _ in range(40):
            start = int(rng.integers(0, 300))
            m = 1 if one_token else int(rng.integers(1, 40))
            table = [int(b) for b in rng.choice(pool, -(-(start + m) // bs) + int(rng.integers(0, 3)), replace=False)]
            chunks.append(SeqChunk(np.zeros(m, np.int32), start, table, "last"))
            want += [table[p // bs] * bs + p % bs for p in range(start, start + m)]
        got = kv_slots(chunks, bs, pool)
        assert got.dtype == np.int64 and got.tolist() == want
    with pytest.raises(ValueError, match="covers 16 positions"):
        kv_slots([SeqChunk(np.zeros(1, np.int32), 16, [3], "last")], bs, pool)
    with pytest.raises(ValueError, match="outside the pool"):
        kv_slots([SeqChunk(np.zeros(1, np.int32), 0, [3, pool], "last")], bs, pool)
    with pytest.raises(ValueError, match="outside the pool"):
        kv_slots([SeqChunk(np.zeros(2, np.int32), 0, [-1], "last")], bs, pool)
