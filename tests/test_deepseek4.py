"""DeepSeek V4 (`deepseek4`): the synthetic tiny file holds what llama.cpp's loader reads (names, shapes,
keys; the oracle fixtures prove llama.cpp loads and runs it), the loader reads its settings or refuses
in one line, the CUDA backend's batched forward refuses it in one line (the worker's CUDA backend for it is
backends/cuda/hyper.py: tests/test_cuda_deepseek4_*.py), and the numpy forward pass keeps its per-position
pool consistent: any chunking, scattered blocks, and blocks restored into a fresh backend give the same
logits; a worker serves it, from its prefix cache and, after a restart, from its block files.
Agreement with llama.cpp itself is test_forward_oracle.py's (synth-deepseek4-*)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.cuda.layers import check_runs
from ember.worker.backends.numpy import hyper as numpy_hyper
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model, plan, resolve_shape
from ember.worker.model.config import read_config
from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.model.weights import load_weights

SPEC = resolve_shape("deepseek4", "tiny")
D4 = SPEC.dsv4
assert D4 is not None

# llama.cpp's llama_model_deepseek4::load_arch_tensors, per layer: what every layer has, what a
# compressed (ratio 4 or 128) layer adds, what only CSA (ratio 4) adds, and the routing by layer
ALL_LAYERS = {"attn_norm", "attn_sinks", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv", "attn_kv_a_norm",
              "attn_output_a", "attn_output_b", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
              "hc_ffn_base", "hc_ffn_scale", "ffn_gate_inp", "ffn_norm", "ffn_gate_exps", "ffn_down_exps",
              "ffn_up_exps", "ffn_gate_shexp", "ffn_down_shexp", "ffn_up_shexp"}
COMPRESSED = {"attn_compressor_kv", "attn_compressor_gate", "attn_compressor_ape", "attn_compressor_norm"}
CSA_ONLY = {"indexer.proj", "indexer.attn_q_b", "indexer_compressor_kv", "indexer_compressor_gate",
            "indexer_compressor_ape", "indexer_compressor_norm"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf")


@pytest.fixture(scope="module")
def weights(tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the dequantized weights' cache: the test's own
        mp.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        g = GGUFFile(tiny)
        cfg = read_config(g)
        yield cfg, load_weights(g, cfg)


def test_tiny_covers_every_attention_kind_and_both_routings():
    assert set(D4.compress_ratios) == {0, 4, 128} and len(D4.compress_ratios) == SPEC.n_layer
    assert 0 < D4.hash_layers < SPEC.n_layer  # hash-routed first layers, learned routing after
    assert any(r for r in D4.compress_ratios[: D4.hash_layers]) and 4 in D4.compress_ratios[D4.hash_layers :]
    assert SPEC.sliding_window <= 32 and D4.indexer_top_k <= 16  # a few hundred tokens pass both


def test_plan_is_llama_cpps_tensor_list():
    names = {t.name: t for t in plan("deepseek4", "tiny")}
    assert {"token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
            "output_hc_base.weight", "output_hc_scale.weight"} <= set(names)
    for il, ratio in enumerate(D4.compress_ratios):
        want = set(ALL_LAYERS)
        if ratio:
            want |= COMPRESSED
        if ratio == 4:
            want |= CSA_ONLY
        got = {n.removeprefix(f"blk.{il}.").removesuffix(".weight").removesuffix(".bias")
               for n in names if n.startswith(f"blk.{il}.")}
        routing = "ffn_gate_tid2eid" if il < D4.hash_layers else "exp_probs_b"
        assert got == want | {routing}, il
        coff = 2 if ratio == 4 else 1
        if ratio:
            assert names[f"blk.{il}.attn_compressor_kv.weight"].shape == (SPEC.n_embd, coff * SPEC.head_dim)
            assert names[f"blk.{il}.attn_compressor_ape.weight"].shape == (coff * SPEC.head_dim, ratio)
    hd, hc = SPEC.head_dim, D4.hc_mult
    assert names["blk.0.attn_output_a.weight"].shape == (SPEC.n_head * hd // D4.o_groups, D4.o_lora_rank * D4.o_groups)
    assert names["blk.0.hc_attn_fn.weight"].shape == (hc * SPEC.n_embd, (2 + hc) * hc)
    assert names["blk.0.ffn_gate_tid2eid.weight"].shape == (SPEC.n_expert_used, SPEC.n_vocab)
    assert names["blk.0.ffn_gate_tid2eid.weight"].ggml_type == T.I32
    assert {t.ggml_type for t in names.values()} == {T.F32, T.Q8_0, T.I32}


def test_metadata_and_hash_table(tiny):
    g = GGUFFile(tiny)
    try:
        md = g.metadata
        assert md["deepseek4.attention.head_count_kv"] == 1
        assert md["deepseek4.attention.key_length"] == md["deepseek4.attention.value_length"] == SPEC.head_dim
        # the trunk's; the next-token layer's entry after them is tests/test_mtp.py's
        assert list(md["deepseek4.attention.compress_ratios"])[: SPEC.n_layer] == list(D4.compress_ratios)
        assert md["deepseek4.expert_gating_func"] == 4  # sqrt(softplus): llama.cpp's loader refuses the others
        assert md["deepseek4.attention.sliding_window"] == SPEC.sliding_window
        assert md["deepseek4.hash_layer_count"] == D4.hash_layers
        assert md["deepseek4.embedding_length_out"] == SPEC.n_embd * D4.hc_mult
        for key in ("attention.q_lora_rank", "attention.output_group_count", "attention.output_lora_rank",
                    "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k",
                    "attention.compress_rope_freq_base", "hyper_connection.count",
                    "hyper_connection.sinkhorn_iterations", "hyper_connection.epsilon", "expert_shared_count",
                    "expert_weights_scale", "expert_weights_norm", "swiglu_clamp_exp", "swiglu_clamp_shexp",
                    "rope.dimension_count"):
            assert f"deepseek4.{key}" in md, key
        table = g.raw("blk.0.ffn_gate_tid2eid.weight").view("<i4").reshape(SPEC.n_vocab, SPEC.n_expert_used)
        assert table.min() >= 0 and table.max() < SPEC.n_expert
        assert all(len(set(row)) == len(row) for row in table.tolist())  # distinct experts per token
    finally:
        g.close()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("deepseek4.attention.compress_ratios", [0, 4, 64, 4, 0], r"unsupported compress ratios \[0, 4, 64\]"),
    ("deepseek4.expert_gating_func", 1, "unsupported expert gating function 1"),
])
def test_unsupported_settings_are_one_line(tiny, key, value, message):
    g = GGUFFile(tiny)
    g.metadata[key] = value  # as a file saying so would read
    with pytest.raises(ModelFileError, match=message) as e:
        read_config(g)
    assert "\n" not in str(e.value)


def test_the_batched_cuda_forward_refuses_in_one_line(tiny):
    g = GGUFFile(tiny)
    with pytest.raises(ModelFileError, match="the cuda backend's batched forward does not run deepseek4") as e:
        check_runs(g, read_config(g))
    assert "\n" not in str(e.value) and "--backend numpy" in str(e.value)


def _logits(backend: NumpyBackend, tokens: list[int], chunk: int, table: list[int]) -> np.ndarray:
    out = []
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk], np.int32)
        (x,) = backend.forward([SeqChunk(part, start, table, "all")])
        out.append(x)
    return np.concatenate(out)


def test_each_compressed_row_is_made_once_into_its_blocks_last_positions(weights):
    """After 300 positions in chunks of 37 over scattered blocks, each closed compress block's row, read
    from its pieces in the pool, is compress() of its positions' rows (CSA: and the block before's), normed,
    RoPE at its first position; no other position holds a piece (the open HCA block, 256 .. 299, has none)."""
    cfg, w = weights
    bs, n = 16, 300
    b = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    table = np.random.default_rng(2).permutation(40)[: -(-n // bs)].tolist()
    _logits(b, [int(t) for t in np.random.default_rng(7).integers(0, 700, n)], 37, table)
    stack = b.hyper
    assert stack is not None
    rows = stack.pool.reshape(-1, stack.pool.shape[-1])
    seq = np.arange(n)
    past = rows[np.asarray(table)[seq // bs] * bs + seq % bs]
    chunk = SeqChunk(np.zeros(1, np.int32), n - 1, table, "last")
    norms = {"c": "compressor_norm", "i": "indexer_compressor_norm"}
    for li, ratio in enumerate(cfg.hyper.compress_ratios):
        cols = stack.columns[li]
        for kind in ("c", "i") if ratio == 4 else ("c",) if ratio else ():
            want = numpy_hyper.compress(past[:, cols[f"{kind}_kv"]], past[:, cols[f"{kind}_score"]], ratio, n // ratio,
                                        ratio == 4)
            want = numpy_hyper.rope_tail(numpy_hyper._norm(want, cfg.norm_eps, stack._t(li, norms[kind])),
                                         np.arange(n // ratio) * ratio, stack.rope_compressed)
            got = stack._compressed_rows(chunk, ratio, n // ratio, rows, cols[f"{kind}_row"])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        if ratio == 128:  # pieces at the closed blocks' last 16 positions alone (the open block has none yet)
            spread = stack.spread(ratio, bs)
            held = np.zeros(n, bool)
            for blk in range(n // ratio):
                held[(blk + 1) * ratio - spread : (blk + 1) * ratio] = True
            assert spread == bs and held.sum() == 32
            assert not past[~held, cols["c_row"]].any() and past[held, cols["c_row"]].any(axis=1).all()


def test_pool_is_consistent_across_chunks_blocks_and_restores(weights):
    """300 positions (past the window, 75 CSA rows and their indexer's top 8, two HCA blocks): whole,
    in chunks of 37, one token at a time over scattered blocks, and with the first blocks restored into a
    fresh backend (as the KV store does) instead of computed, all give the same logits."""
    cfg, w = weights
    bs, n = 16, 300
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 700, n)]
    a = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    straight = list(range(-(-n // bs)))
    whole = _logits(a, tokens, n, straight)
    assert np.isfinite(whole).all() and whole.std() > 0.05
    scattered = np.random.default_rng(1).permutation(40)[: len(straight)].tolist()
    b = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    np.testing.assert_allclose(_logits(b, tokens, 37, scattered), whole, atol=2e-5)
    c = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    np.testing.assert_allclose(_logits(c, tokens, 1, straight), whole, atol=2e-5)
    # restore the first 16 blocks (256 positions) from a's pool into a fresh backend, then go on
    d = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    d.load_blocks(list(range(16)), a.save_blocks(list(range(16))).wait())
    (rest,) = d.forward([SeqChunk(np.asarray(tokens[256:], np.int32), 256, straight, "all")])
    np.testing.assert_allclose(rest, whole[256:], atol=2e-5)
    assert a.read_block(0).shape == (bs, numpy_hyper.HyperStack.width(cfg, bs))
    assert NumpyBackend.kv_bytes_per_block(cfg, bs) == a.read_block(0).nbytes
    # the compressed rows matter: without the pool's older rows the late logits change
    e = NumpyBackend(cfg, w, n_blocks=40, block_size=bs)
    e.load_blocks(list(range(16)), [np.zeros_like(a.read_block(0))] * 16)
    (blind,) = e.forward([SeqChunk(np.asarray(tokens[256:], np.int32), 256, straight, "all")])
    assert np.abs(blind - whole[256:]).max() > 1e-2


def test_hyper_connection_mix_is_doubly_stochastic():
    rng = np.random.default_rng(0)
    h = resolve_shape("deepseek4", "tiny").dsv4
    cfg = type("H", (), {"hc_mult": 4, "hc_eps": h.hc_eps, "hc_sinkhorn_iters": 20})()
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    fn = 0.1 * rng.standard_normal((24, 32)).astype(np.float32)  # mixes of the size a model has
    y, post, comb = numpy_hyper.hc_mix(x, fn, np.ones(3, np.float32), np.zeros(24, np.float32), cfg, 1e-6)
    np.testing.assert_allclose(comb.sum(axis=1), 1, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=2), 1, atol=1e-3)
    assert y.shape == (3, 8) and ((post > 0) & (post < 2)).all()


def test_compression_weighs_each_block_and_its_predecessor():
    kv = np.arange(16, dtype=np.float32).reshape(8, 2)  # 8 positions, two halves of width 1
    score = np.zeros((8, 2), np.float32)
    # HCA-style, no overlap, ratio 4: the mean of each block
    np.testing.assert_allclose(numpy_hyper.compress(kv, score, 4, 2, False), [[3, 4], [11, 12]])
    # CSA-style: block 0 has no predecessor (its first halves weigh nothing), block 1 averages
    # block 0's first halves with its own second halves
    got = numpy_hyper.compress(kv, score, 4, 2, True)
    np.testing.assert_allclose(got[:, 0], [np.mean([1, 3, 5, 7]), np.mean([0, 2, 4, 6, 9, 11, 13, 15])])


def test_chat_through_the_worker_reuses_its_prefix_and_restarts_warm(start_worker, openai_factory, tiny,
                                                                     tmp_path):
    """The worker serves the tiny model through the OpenAI API; a prompt past the window and an HCA block
    comes back the same when its prefix is served from the prefix cache (the pool's per-position rows are
    reused, the compressed rows recomputed from them), and again from block files after a restart."""
    chat_reuses_prefix_and_restarts_warm(start_worker, openai_factory, tiny, tmp_path)


def chat_reuses_prefix_and_restarts_warm(start_worker, openai_factory, tiny, tmp_path, *extra: str):
    """The test above with the worker's `extra` flags (test_cuda_deepseek4_gpu.py: --backend cuda)."""
    flags = ("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "32MiB", "--kv-dir", str(tmp_path / "kv"), *extra)
    w = start_worker(*flags, model=tiny)
    oa = openai_factory(w)
    words = " ".join(f"w{i}" for i in range(150))
    messages = [{"role": "user", "content": f"Repeat after me: {words}"}]
    first = oa.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens > 160 and first.usage.completion_tokens > 0
    again = oa.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 128
    assert again.choices[0].message.content == first.choices[0].message.content
    assert w.stop(timeout=30) == 0
    w2 = start_worker(*flags, model=tiny)
    warm = openai_factory(w2).chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 128
    assert warm.choices[0].message.content == first.choices[0].message.content


def test_experts_left_quantized_give_the_same_logits(tiny, weights, tmp_path, monkeypatch):
    """Where the float32 experts would not fit (the L8 file's 256 a layer: 200 GB), the reference keeps them in
    their blocks and decodes each expert a step reads: the same values, so the same logits, bit for bit."""
    from ember.worker.model.weights import QuantExperts

    cfg, w = weights
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    g = GGUFFile(tiny)
    lazy = load_weights(g, cfg, lazy_experts=True)
    quant = {n: a for n, a in lazy.by_name.items() if isinstance(a, QuantExperts)}
    assert quant and all(n.endswith("_exps.weight") for n in quant)
    assert not any(isinstance(a, QuantExperts) for n, a in w.by_name.items())
    for n, q in quant.items():
        assert q.shape == w.by_name[n].shape and all(np.array_equal(q[e], w.by_name[n][e]) for e in range(len(q)))
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 700, 90)]
    want = _logits(NumpyBackend(cfg, w, n_blocks=10, block_size=16), tokens, 37, list(range(10)))
    got = _logits(NumpyBackend(cfg, lazy, n_blocks=10, block_size=16), tokens, 37, list(range(10)))
    assert np.array_equal(got, want)


def test_experts_stay_quantized_only_where_their_float32_copy_would_not_fit(tiny, weights, tmp_path, monkeypatch,
                                                                             capsys):
    from ember.worker.model import weights as weights_mod

    cfg, _ = weights
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(weights_mod, "_room", lambda g, plan: "no room" if any(
        n.endswith("_exps.weight") for f in plan for n in f.names) else None)
    w = load_weights(GGUFFile(tiny), cfg)
    assert any(isinstance(a, weights_mod.QuantExperts) for a in w.by_name.values())
    assert "stay quantized" in capsys.readouterr().err
    monkeypatch.setattr(weights_mod, "_room", lambda g, plan: "no room")  # not even without them: refused
    with pytest.raises(ModelFileError, match="no room"):
        load_weights(GGUFFile(tiny), cfg)
