"""ember.worker.bench.synth: synthetic GGUF models.

Tiny shapes are generated for real and read back with our GGUF reader and dequantizers; the real
(multi-GB) shapes are checked through their tensor plan only, Gemma 3 270M against the embedded
file's tensor table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from ember.kernels.quants import dequantize
from ember.worker.bench import synth
from ember.worker.bench.synth import SHAPES, SynthError, make_model, plan, resolve_shape
from ember.worker.bench.synth_shapes import plan_spec
from ember.worker.bench.synth_tensors import random_rows
from ember.worker.model.gguf_file import GGUFFile

TINY = {s.arch: s for s in SHAPES.values() if s.name == f"tiny-{s.arch}"}
REAL = [s for s in SHAPES.values() if s.real]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("synth")
    return {arch: make_model(arch, "tiny", d / f"{arch}.gguf") for arch in TINY}


def test_every_arch_has_a_tiny_shape():
    assert set(TINY) == set(synth.ARCHS)
    for arch, s in TINY.items():
        assert resolve_shape(arch, "tiny") is s
        assert s.n_layer >= 2 and s.n_head_kv < s.n_head and 32 <= s.head_dim <= 64
        assert 512 <= s.n_vocab <= 1000


def test_tiny_gemma3_has_local_and_global_layers():
    s = TINY["gemma3"]
    assert s.n_layer >= 6  # llama.cpp's default pattern: 5 sliding-window layers, then 1 global
    assert 0 < s.sliding_window <= 16
    assert s.rope_base_swa is not None and s.rope_base_swa != s.rope_base


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_is_deterministic(arch, tiny_files, tmp_path):
    again = make_model(arch, "tiny", tmp_path / "again.gguf", seed=0)
    assert sha256(again) == sha256(tiny_files[arch])
    other = make_model(arch, "tiny", tmp_path / "other.gguf", seed=1)
    assert sha256(other) != sha256(tiny_files[arch])
    assert not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_reads_back_with_plan_and_metadata(arch, tiny_files):
    s = TINY[arch]
    g = GGUFFile(tiny_files[arch])
    try:
        assert [(t.name, t.shape, t.ggml_type) for t in g.tensors.values()] == [tuple(p) for p in plan(arch, "tiny")]
        md = g.metadata
        assert g.architecture == arch
        assert md[f"{arch}.context_length"] == s.n_ctx
        assert md[f"{arch}.embedding_length"] == s.n_embd
        assert md[f"{arch}.block_count"] == s.n_layer + (1 if arch == "deepseek4" else 0)  # its next-token layer
        assert md[f"{arch}.feed_forward_length"] == s.n_ff
        assert md[f"{arch}.attention.head_count"] == s.n_head
        assert md[f"{arch}.attention.head_count_kv"] == s.n_head_kv
        assert md[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(s.rms_eps)
        assert md[f"{arch}.rope.freq_base"] == pytest.approx(s.rope_base)
        if arch in ("qwen3", "gemma3"):
            assert md[f"{arch}.attention.key_length"] == md[f"{arch}.attention.value_length"] == s.head_dim
        if arch == "gemma3":
            assert md["gemma3.attention.sliding_window"] == s.sliding_window
            assert md["gemma3.rope.freq_base_swa"] == pytest.approx(s.rope_base_swa)
        tokens = md["tokenizer.ggml.tokens"]
        assert len(tokens) == len(set(tokens)) == s.n_vocab == len(md["tokenizer.ggml.token_type"])
        assert g.tensors["token_embd.weight"].shape == (s.n_embd, s.n_vocab)
        assert ("output.weight" in g.tensors) == (not s.tied)
        assert md["general.file_type"] == (7 if s.mix == "q8_0" else 15)  # MOSTLY_Q8_0 (deepseek4), MOSTLY_Q4_K_M
        assert md["ember.synthetic.shape"] == s.name
    finally:
        g.close()


def _tokens(g: GGUFFile) -> tuple[list[str], np.ndarray]:
    return g.metadata["tokenizer.ggml.tokens"], np.asarray(g.metadata["tokenizer.ggml.token_type"])


def test_llama_vocab_is_sentencepiece(tiny_files):
    g = GGUFFile(tiny_files["llama"])
    tokens, types = _tokens(g)
    assert g.metadata["tokenizer.ggml.model"] == "llama"
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and list(types[:3]) == [2, 3, 3]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)] and (types[3:259] == 6).all()
    assert (g.metadata["tokenizer.ggml.bos_token_id"], g.metadata["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert len(g.metadata["tokenizer.ggml.scores"]) == len(tokens)
    assert "\u2581the" in tokens  # merged pieces learned from the built-in text
    assert "tokenizer.ggml.merges" not in g.metadata


def test_gemma3_vocab_has_gemma_control_tokens(tiny_files):
    g = GGUFFile(tiny_files["gemma3"])
    tokens, types = _tokens(g)
    assert tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    for t in ("<start_of_turn>", "<end_of_turn>", "<mask>"):
        assert types[tokens.index(t)] == 3
    md = g.metadata
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (2, 1)
    assert md["tokenizer.ggml.add_space_prefix"] is False
    assert "<0x0A>" in tokens and "<start_of_turn>" in md["tokenizer.chat_template"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_vocab_is_byte_level_bpe(arch, tiny_files):
    g = GGUFFile(tiny_files[arch])
    tokens, types = _tokens(g)
    md = g.metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
    ids = {t: i for i, t in enumerate(tokens)}
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[ids[t]] == 3
    assert md["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert len([t for t in tokens[:256] if len(t) == 1]) == 256  # every byte has a token
    merges = md["tokenizer.ggml.merges"]
    assert len(merges) > 300
    for m in merges:  # each merge joins two tokens into a token
        a, b = m.split(" ")
        assert a in ids and b in ids and a + b in ids
    if arch == "qwen3":
        assert "<think>" in ids and "</think>" in ids


def test_llama3_vocab_plan():
    v = synth.build_vocab(SHAPES["llama-8b"])
    assert (v.model, v.pre) == ("gpt2", "llama-bpe")
    assert len(v.tokens) == 128256
    assert v.tokens[128000] == "<|begin_of_text|>" and v.tokens[128009] == "<|eot_id|>"
    assert v.tokens[128006:128008] == ["<|start_header_id|>", "<|end_header_id|>"]
    assert (v.special["bos"], v.special["eos"]) == (128000, 128009)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_tiny_weights_dequantize_to_sane_statistics(arch, tiny_files):
    g = GGUFFile(tiny_files[arch])
    seen = set()
    try:
        for name, info in g.tensors.items():
            if info.ggml_type == T.I32:  # deepseek4's hash routing: ids, checked in test_deepseek4.py
                continue
            x = dequantize(g.raw(name), info.ggml_type, tuple(reversed(info.shape)))
            assert np.isfinite(x).all(), name
            seen.add(info.ggml_type)
            if name.endswith(("norm.weight", "hc_attn_scale.weight", "hc_ffn_scale.weight", "output_hc_scale.weight")):
                assert abs(x.mean() - 1) < 0.05 and x.std() < 0.1, name
            elif x.size >= 64:  # weights and biases: centred, std near 0.02 (gpt-oss's 4 sinks: too few to tell)
                assert abs(x.mean()) < 5 * 0.02 / np.sqrt(x.size) + 1e-3, name
                assert 0.015 < x.std() < 0.027, (name, x.std())
                assert np.abs(x).max() < 0.2, name
    finally:
        g.close()
    # gpt-oss: its released mix; deepseek4: Q8_0 matrices (its released file's, outside the experts)
    quantized = {T.MXFP4, T.Q8_0} if arch == "gpt-oss" else {T.Q8_0} if arch == "deepseek4" else {T.Q4_K, T.Q6_K}
    assert T.F32 in seen and (seen & quantized) and (seen & {T.Q8_0, T.Q5_0})


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F32, T.F16, T.BF16],
                         ids=lambda t: t.name)
def test_random_blocks_of_every_type(t):
    rng = np.random.default_rng(0)
    raw = random_rows("blk.0.ffn_up.weight", t, 64, 512, rng)
    x = dequantize(raw, t, (64, 512))
    assert np.isfinite(x).all()
    assert abs(x.mean()) < 5e-4 and 0.018 < x.std() < 0.024, (x.mean(), x.std())
    # the same stream gives the same bytes
    again = random_rows("blk.0.ffn_up.weight", t, 64, 512, np.random.default_rng(0))
    assert again.tobytes() == raw.tobytes()


# -- real shapes: the plan only -------------------------------------------------------------------


def test_gemma3_270m_plan_is_the_embedded_files_tensor_table(default_model_path):
    g = GGUFFile(default_model_path)
    try:
        table = [(t.name, t.shape, t.ggml_type) for t in g.tensors.values()]
        assert [tuple(p) for p in plan("gemma3", "gemma3-270m")] == table
        # the hard-coded table, llama.cpp's Q4_K_M rule and the file agree
        by_rule = plan_spec(replace(SHAPES["gemma3-270m"], type_table=None))
        assert [tuple(p) for p in by_rule] == table
        md = g.metadata
        s = SHAPES["gemma3-270m"]
        assert (s.n_embd, s.n_layer, s.n_ff, s.n_head, s.n_head_kv, s.head_dim, s.sliding_window, s.n_ctx) == (
            md["gemma3.embedding_length"], md["gemma3.block_count"], md["gemma3.feed_forward_length"],
            md["gemma3.attention.head_count"], md["gemma3.attention.head_count_kv"],
            md["gemma3.attention.key_length"], md["gemma3.attention.sliding_window"], md["gemma3.context_length"])
        assert s.n_vocab == len(md["tokenizer.ggml.tokens"])
    finally:
        g.close()


def _more_bits(n_layer):
    return [i for i in range(n_layer) if i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2]


def test_llama_8b_plan_is_llama3_8b_q4_k_m():
    p = {t.name: t for t in plan("llama", "llama-8b")}
    assert len(p) == 2 + 1 + 32 * 9
    assert p["token_embd.weight"].shape == (4096, 128256) and p["token_embd.weight"].ggml_type == T.Q4_K
    assert p["output.weight"].ggml_type == T.Q6_K
    assert p["blk.0.attn_k.weight"].shape == (4096, 1024)
    assert p["blk.0.ffn_down.weight"].shape == (14336, 4096)
    more = _more_bits(32)
    assert 14 <= len(more) <= 18  # about half the layers
    for i in range(32):
        want = T.Q6_K if i in more else T.Q4_K
        assert p[f"blk.{i}.attn_v.weight"].ggml_type == want
        assert p[f"blk.{i}.ffn_down.weight"].ggml_type == want
        assert p[f"blk.{i}.attn_q.weight"].ggml_type == T.Q4_K
        assert p[f"blk.{i}.attn_norm.weight"].ggml_type == T.F32
    total = sum(t.nbytes for t in p.values())
    assert 4.85e9 < total < 4.95e9  # llama.cpp's Llama-3-8B Q4_K_M is 4.92 GB


def test_deepseek_v4_flash_l8_plan_is_the_real_models_layers_in_the_users_mix():
    """V4-Flash's config (hidden 4096, 64 heads of 512 over one KV head, q and output ranks 1024 in 8
    groups, 256 experts of 2048, vocabulary 129,280, indexer 64 x 128): 8 of its 43 layers, whose
    compress ratios hold every attention kind, and the MTP layer; IQ2_XXS gate/up, Q2_K down, Q8_0 else."""
    s = SHAPES["deepseek-v4-flash-L8"]
    assert s.dsv4 is not None and set(s.dsv4.compress_ratios) == {0, 4, 128} and s.dsv4.hash_layers == 3
    p = {t.name: t for t in plan("deepseek4", "deepseek-v4-flash-L8")}
    assert p["token_embd.weight"].shape == (4096, 129280) and p["token_embd.weight"].ggml_type == T.Q8_0
    for il in range(9):  # the 8 trunk layers and the MTP layer (blk.8)
        assert p[f"blk.{il}.ffn_gate_exps.weight"].shape == (4096, 2048, 256)
        assert p[f"blk.{il}.ffn_gate_exps.weight"].ggml_type == p[f"blk.{il}.ffn_up_exps.weight"].ggml_type == T.IQ2_XXS
        assert p[f"blk.{il}.ffn_down_exps.weight"].ggml_type == T.Q2_K
        assert p[f"blk.{il}.attn_q_b.weight"].shape == (1024, 64 * 512)
        assert p[f"blk.{il}.attn_output_a.weight"].shape == (64 * 512 // 8, 8 * 1024)
        assert p[f"blk.{il}.attn_q_a.weight"].ggml_type == T.Q8_0
        assert (f"blk.{il}.ffn_gate_tid2eid.weight" in p) == (il < 3)  # hash routing in the first three
    assert "blk.2.indexer.attn_q_b.weight" in p and p["blk.2.indexer.attn_q_b.weight"].shape == (1024, 64 * 128)
    assert "blk.3.attn_compressor_kv.weight" in p and "blk.3.indexer.proj.weight" not in p  # HCA: no indexer
    assert "blk.8.nextn.eh_proj.weight" in p
    total = sum(t.nbytes for t in p.values())
    assert 18.5e9 < total < 19.3e9
    # the same per-layer bytes over the real 43 layers and the MTP layer: the users' file of about 81 GiB
    model_level = sum(t.nbytes for n, t in p.items() if not n.startswith("blk."))
    assert 79 * 2**30 < model_level + (total - model_level) / 9 * 44 < 84 * 2**30


def test_gemma3_4b_plan():
    s = SHAPES["gemma3-4b"]
    p = {t.name: t for t in plan("gemma3", "gemma3-4b")}
    assert "output.weight" not in p and p["token_embd.weight"].ggml_type == T.Q6_K
    assert p["token_embd.weight"].shape == (2560, 262208)
    assert p["blk.0.attn_q.weight"].shape == (2560, 2048) and p["blk.0.attn_k_norm.weight"].shape == (256,)
    assert Counter(t.ggml_type for t in p.values()) == {T.F32: 1 + 34 * 6, T.Q4_K: 34 * 7 - 2 * len(_more_bits(34)),
                                                         T.Q6_K: 1 + 2 * len(_more_bits(34))}
    assert 2.4e9 < sum(t.nbytes for t in p.values()) < 2.55e9
    assert s.rope_base_swa == 10000.0 and s.rope_scaling_linear == 8.0


@pytest.mark.parametrize("spec", REAL, ids=lambda s: s.name)
def test_real_shape_vocab_fits(spec):
    v = synth.build_vocab(spec)
    assert len(v.tokens) == len(set(v.tokens)) == spec.n_vocab


def test_q4_k_m_fallbacks():
    assert synth.q4_k_m_type("attn_q", 0, 18, 640, True) == T.Q5_0
    assert synth.q4_k_m_type("token_embd", -1, 18, 640, True) == T.Q8_0
    assert synth.q4_k_m_type("token_embd", -1, 32, 4096, False) == T.Q4_K
    assert synth.q4_k_m_type("output", -1, 32, 4096, False) == T.Q6_K
    assert synth.q4_k_m_type("ffn_down", 0, 32, 14336, False) == T.Q6_K
    assert synth.q4_k_m_type("ffn_down", 5, 32, 14336, False) == T.Q4_K


# -- errors and CLI -------------------------------------------------------------------------------


def test_unknown_arch_and_shape():
    with pytest.raises(SynthError, match="unknown arch"):
        plan("gpt5", "tiny")
    with pytest.raises(SynthError, match="unknown shape"):
        plan("llama", "huge")
    with pytest.raises(SynthError, match="gemma3 shape"):
        plan("llama", "gemma3-270m")


def test_progress_reports_bytes(tmp_path):
    calls = []
    make_model("llama", "tiny", tmp_path / "m.gguf", progress=lambda d, t: calls.append((d, t)))
    total = sum(t.nbytes for t in plan("llama", "tiny"))
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False))


def _cli(argv):
    parser = argparse.ArgumentParser(prog="ember bench")
    synth.add_make_model_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_writes_model_and_prints_sha(tmp_path, capsys):
    out = tmp_path / "q.gguf"
    assert _cli(["make-model", "--arch", "qwen2", "--shape", "tiny", "--out", str(out), "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{out}  sha256 {sha256(out)}"
    assert "writing" in captured.err and "100%" in captured.err


def test_cli_writes_the_split_pair_and_prints_both_shas(tmp_path, capsys):
    out, mtp = tmp_path / "trunk.gguf", tmp_path / "mtp-tiny.gguf"
    assert _cli(["make-model", "--arch", "deepseek4", "--shape", "tiny", "--out", str(out), "--mtp-out", str(mtp)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{out}  sha256 {sha256(out)}", f"{mtp}  sha256 {sha256(mtp)}"]


def test_cli_ctx_sets_the_declared_context_length(tmp_path, capsys):
    """--ctx: a long-conversation benchmark on a shape whose real model declares a short context."""
    out = tmp_path / "long.gguf"
    assert _cli(["make-model", "--arch", "llama", "--shape", "tiny", "--out", str(out), "--ctx", "32768"]) == 0
    assert GGUFFile(out).metadata["llama.context_length"] == 32768
    plain = tmp_path / "plain.gguf"
    assert _cli(["make-model", "--arch", "llama", "--shape", "tiny", "--out", str(plain)]) == 0
    assert GGUFFile(plain).metadata["llama.context_length"] == resolve_shape("llama", "tiny").n_ctx != 32768


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "mamba", "--shape", "tiny"], "unknown arch"),
        (["--arch", "llama", "--shape", "70b"], "unknown shape"),
        (["--arch", "llama", "--shape", "tiny", "--seed", "-1"], "seed"),
        (["--arch", "llama", "--shape", "tiny", "--ctx", "8"], "ctx must be in 16.."),
        (["--arch", "llama", "--shape", "tiny", "--mtp-out", "mtp.gguf"], "no next-token (MTP) layer to split off"),
    ],
)
def test_cli_bad_request_is_one_line_exit_2(argv, message, tmp_path, capsys):
    assert _cli(["make-model", *argv, "--out", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_cli_unwritable_path_exit_2(tmp_path, capsys):
    assert _cli(["make-model", "--arch", "llama", "--shape", "tiny", "--out", str(tmp_path / "no" / "x.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _cli(["make-model", "--arch", "llama", "--shape", "tiny", "--out", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_cli_read_only_directory_exit_2(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert _cli(["make-model", "--arch", "llama", "--shape", "tiny", "--out", str(ro / "x.gguf")]) == 2
    assert "not writable" in capsys.readouterr().err
