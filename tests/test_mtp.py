"""`--spec mtp`: DeepSeek V4's next-token (MTP) layer drafts through the speculative-decoding interface.

The tiny deepseek4 file carries the layer as llama.cpp's loader reads it (blk.4.nextn.* after the four
trunk layers, the keys that say so), and the trunk is read and computed as before. The numpy head's
rows in the pool are those of a from-scratch pass whatever the chunking, its drafts are its greedy
chain, and through the engine greedy output is the same with and without drafts: on the file as made
(its random head guesses badly) and on a head made to agree with the trunk (every guess stands, and
with the trunk's layers partly on, guesses are refused and the head's rows written over: its drafts
are still those of a fresh pass over the accepted tokens). A model without the layer is refused in
one line. And the head computes what llama.cpp's own MTP graph computes (opt-in, with llama-cpp-python).

`--spec mtp:PATH` reads the layer from its own file, the pair llama.cpp's converter writes with --no-mtp
and --mtp (`make-model --mtp-out`): the pair is the whole file split, drafts as it does, a layer file's own
embedding, output and hyper-connection head are the ones its head reads, and every way a pair can
disagree is refused in one line; and llama-server drafts with the pair (where .ci/run built it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from engine_runs import RecordingDrafter, generate

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import MTP as MTP_PART
from ember.worker.bench.synth import TRUNK as TRUNK_PART
from ember.worker.bench.synth import make_model, plan, resolve_shape, write_model
from ember.worker.engine.spec.mtp_drafter import MtpDrafter
from ember.worker.model.arch import FAMILIES
from ember.worker.model.config import read_config
from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.model.loader import open_model
from ember.worker.model.mtp_file import OWN, check_pair, layer_tensors, model_tensors, open_mtp_file
from ember.worker.model.weights import load_weights

SPEC = resolve_shape("deepseek4", "tiny")
D4 = SPEC.dsv4
assert D4 is not None
MTP = SPEC.n_layer  # the next-token layer's block
# llama.cpp's load_arch_tensors for a layer past the trunk: a window-only layer's attention (its compress
# ratio is 0) and a learned router's MoE, and the nextn tensors (embed_tokens and shared_head_head are
# optional and DeepSeek V4's converter writes neither)
LAYER = {"attn_norm", "attn_sinks", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv", "attn_kv_a_norm",
         "attn_output_a", "attn_output_b", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
         "hc_ffn_scale", "ffn_gate_inp", "ffn_norm", "ffn_gate_exps", "ffn_down_exps", "ffn_up_exps",
         "ffn_gate_shexp", "ffn_down_shexp", "ffn_up_shexp", "exp_probs_b"}
NEXTN = {"nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model("deepseek4", "tiny", tmp_path_factory.mktemp("mtp") / "tiny.gguf")


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the dequantized weights' cache: the test's own
        mp.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        m = open_model(str(tiny))
        yield m, load_weights(m.gguf, m.config)


# -- the file ------------------------------------------------------------------------------------------


def test_the_file_carries_llama_cpps_next_token_layer(tiny):
    names = {t.name: t for t in plan("deepseek4", "tiny")}
    got = {n.removeprefix(f"blk.{MTP}.").removesuffix(".weight").removesuffix(".bias")
           for n in names if n.startswith(f"blk.{MTP}.")}
    assert got == LAYER | NEXTN
    assert names[f"blk.{MTP}.nextn.eh_proj.weight"].shape == (2 * SPEC.n_embd, SPEC.n_embd)  # [embedding, h] in
    assert not any(n.startswith(f"blk.{MTP + 1}.") for n in names)
    g = GGUFFile(tiny)
    try:
        md = g.metadata
        assert md["deepseek4.block_count"] == SPEC.n_layer + 1 and md["deepseek4.nextn_predict_layers"] == 1
        assert list(md["deepseek4.attention.compress_ratios"]) == [*D4.compress_ratios, 0]  # window only
        assert len(md["deepseek4.swiglu_clamp_exp"]) == len(md["deepseek4.swiglu_clamp_shexp"]) == SPEC.n_layer + 1
        cfg = read_config(g)
        assert cfg.n_layers == SPEC.n_layer and cfg.hyper is not None and cfg.hyper.nextn_layers == 1
        assert cfg.hyper.compress_ratios == D4.compress_ratios and len(cfg.hyper.swiglu_clamp_exp) == SPEC.n_layer + 1
    finally:
        g.close()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("deepseek4.nextn_predict_layers", 2, r"nextn_predict_layers is 2 but blk\.3\.nextn\.eh_proj\.weight is missing"),
    ("deepseek4.attention.compress_ratios", [0, 4, 128, 4, 4], r"next-token layers with compress ratios \[4\]"),
])
def test_a_next_token_layer_llama_cpp_could_not_run_is_refused_in_one_line(tiny, key, value, message):
    g = GGUFFile(tiny)
    g.metadata[key] = value  # as a file saying so would read
    with pytest.raises(ModelFileError, match=message) as e:
        read_config(g)
    assert "\n" not in str(e.value)


# -- the head ------------------------------------------------------------------------------------------


def _forward(backend: NumpyBackend, tokens: list[int], chunk: int, table: list[int]) -> np.ndarray:
    out = []
    for start in range(0, len(tokens), chunk):
        (x,) = backend.forward([SeqChunk(np.asarray(tokens[start : start + chunk], np.int32), start, table, "all")])
        out.append(x)
    return np.concatenate(out)


def test_the_heads_rows_and_drafts_are_a_fresh_pass_over_the_prefix(model):
    """60 positions (past the 16-token window) in chunks of 7 over scattered blocks: the trunk's logits are
    those of a backend without the head, the pool's h rows are the trunk's output streams, and each draft
    is the head's greedy chain, its first guess the argmax of a from-scratch pass over the sequence."""
    m, w = model
    cfg, bs, n = m.config, 16, 60
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 700, n)]
    table = np.random.default_rng(2).permutation(12)[:4].tolist()
    plain = _forward(NumpyBackend(cfg, w, n_blocks=12, block_size=bs), tokens, n, table)
    b = NumpyBackend(cfg, w, n_blocks=12, block_size=bs, mtp=True)
    np.testing.assert_allclose(_forward(b, tokens, 7, table), plain, atol=2e-5)  # the head leaves the trunk be
    assert b.kv_layout != NumpyBackend(cfg, w, n_blocks=1, block_size=bs).kv_layout  # blocks never mixed up
    assert NumpyBackend.kv_bytes_per_block(cfg, bs, mtp=True) == b.read_block(0).nbytes
    hyper = b.hyper
    assert hyper is not None and hyper.mtp is not None
    head, hc = hyper.mtp, cfg.hyper.hc_mult
    rows = hyper.pool.reshape(-1, hyper.pool.shape[-1])
    slots = [table[p // bs] * bs + p % bs for p in range(n)]
    h = rows[slots][:, head.cols["h"]].reshape(n, hc, cfg.hidden)
    np.testing.assert_allclose(hyper.head(h), plain, rtol=1e-4, atol=1e-4)  # h: the streams the logits come from
    prev = np.concatenate([np.zeros_like(h[:1]), h[:-1]])
    fresh = head.forward(prev, np.asarray(tokens))  # position p guesses the token at p + 1
    for at in (1, 15, 16, 40, n - 1):
        (first,) = head.draft(table, tokens[at], at, 1)
        assert first == int(np.argmax(fresh[at])), at
    chain = head.draft(table, tokens[n - 1], n - 1, 3)
    assert chain[0] == int(np.argmax(fresh[n - 1])) and len(chain) == 3
    assert chain == head.draft(table, tokens[n - 1], n - 1, 3)  # drafting writes nothing to the pool
    restored = NumpyBackend(cfg, w, n_blocks=12, block_size=bs, mtp=True)  # as the KV store restores blocks
    restored.load_blocks(table, b.save_blocks(table).wait())
    assert restored.hyper is not None and restored.hyper.mtp is not None
    assert restored.hyper.mtp.draft(table, tokens[n - 1], n - 1, 3) == chain


def test_a_model_without_the_layer_has_no_head(model):
    m, w = model
    bare = msgspec.structs.replace(m.config, hyper=msgspec.structs.replace(m.config.hyper, nextn_layers=0))
    with pytest.raises(ValueError, match="no next-token"):
        NumpyBackend(bare, w, n_blocks=4, block_size=16, mtp=True)


# -- through the engine --------------------------------------------------------------------------------


def _agreeing(m, w, layers: float):
    """The file's weights with a head that guesses what the trunk will say: the trunk's layers' outputs
    scaled by `layers` (0: each token's logits are its embedding's through the head), the head's input the
    token's embedding alone, through the trunk's output norm."""
    cfg, by, e = m.config, dict(w.by_name), m.config.hidden
    for li in range(cfg.n_layers + 1):
        for name in ("attn_output_b.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight"):
            by[f"blk.{li}.{name}"] = by[f"blk.{li}.{name}"] * np.float32(layers)
    by[f"blk.{MTP}.nextn.eh_proj.weight"] = np.concatenate([np.eye(e), np.zeros((e, e))], axis=1).astype(np.float32)
    by[f"blk.{MTP}.nextn.enorm.weight"] = np.ones(e, np.float32)
    by[f"blk.{MTP}.nextn.shared_head_norm.weight"] = by["output_norm.weight"]
    return dataclasses.replace(w, by_name=by)


def _generate(m, w, spec: str, prompt: list[int], n: int):
    backend = NumpyBackend(m.config, w, n_blocks=64, block_size=16, mtp=spec == "mtp")
    drafter = RecordingDrafter(MtpDrafter(backend.hyper.mtp)) if spec == "mtp" else None
    return (*generate(m, backend, spec, prompt, n, drafter), drafter)


PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 700, 40)]  # past the 16-token window


@pytest.mark.parametrize("variant", ["as made", "agreeing", "half agreeing"])
def test_greedy_output_is_the_same_with_spec_mtp(model, variant):
    m, w = model
    if variant != "as made":
        w = _agreeing(m, w, 0.0 if variant == "agreeing" else 0.3)
    off, _, _ = _generate(m, w, "off", PROMPT, 40)
    on, metrics, drafter = _generate(m, w, "mtp", PROMPT, 40)
    assert on == off and len(on) == 40
    drafted, accepted = metrics["ember_spec_drafted_tokens_total"], metrics["ember_spec_accepted_tokens_total"]
    steps = metrics["ember_spec_verify_steps_total"]
    print(f"{variant}: {accepted:.0f}/{drafted:.0f} guesses stood over {steps:.0f} steps with drafts")
    assert drafted > 0 and steps > 0 and len(drafter.seen) >= steps  # (a paused sequence's drafts are dropped)
    if variant == "agreeing":
        assert accepted == drafted  # every guess stands
    elif variant == "half agreeing":
        assert 0 < accepted < drafted
    # each draft is what a fresh pass over the tokens it followed drafts: refused guesses left nothing behind
    for tokens, draft in drafter.seen[:4] + drafter.seen[-2:]:
        fresh = NumpyBackend(m.config, w, n_blocks=8, block_size=16, mtp=True)
        fresh.forward([SeqChunk(np.asarray(tokens[:-1], np.int32), 0, list(range(8)), "none")])
        assert fresh.hyper.mtp.draft(list(range(8)), tokens[-1], len(tokens) - 1, len(draft)) == draft


def test_spec_mtp_on_a_model_without_the_layer_is_refused_in_one_line(worker_env, default_model_path):
    from test_daemon_support import free_port

    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(free_port()), "--model",
                        str(default_model_path), "--spec", "mtp"], env=worker_env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 78 and "Traceback" not in p.stderr
    (err,) = [e for e in map(json.loads, filter(lambda x: x.startswith("{"), p.stderr.splitlines()))
              if e["event"] == "config_error"]
    assert "spec: mtp needs a model with a next-token (MTP) layer" in err["error"] and "\n" not in err["error"]


# -- against llama.cpp's MTP graph (opt-in: $EMBER_ORACLE_PYTHON; never in CI) ---------------------------

MTP_SCRIPT = Path(__file__).resolve().parent / "oracle" / "mtp_logits.py"


@pytest.mark.oracle
@pytest.mark.slow
def test_the_head_is_llama_cpps_mtp_graph(tmp_path, monkeypatch):
    """Teacher-forced over 60 positions (past the window): llama.cpp's MTP context on the F32 copy of the
    file, fed the trunk's h_nextn as its speculative drafter feeds it, against our head on the file; then
    a draft of three from the last position, each step on the layer's own streams, as that drafter makes it.

    The file is the tiny shape with 128-wide indexer keys: llama.cpp forces its Hadamard key rotation on
    deepseek4 caches whose head size equals the indexer's key length (the tiny shape's 64 and 64), and
    its MTP context's cache, empty but for the window part, then divides by zero building that rotation
    (SIGFPE in llama_kv_cache::build_input_k_rot). The real model's 512 and 128 do not meet that."""
    from test_forward_oracle import oracle_python

    exe = oracle_python()
    if exe is None:
        pytest.skip("set EMBER_ORACLE_PYTHON to a python with llama-cpp-python to run the oracle")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_model(dataclasses.replace(SPEC, dsv4=dataclasses.replace(D4, indexer_dim=128)), tmp_path / "m.gguf")
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, 700, 60)]
    out = tmp_path / "mtp.npz"
    subprocess.run([exe, str(MTP_SCRIPT), str(path), str(out), ",".join(map(str, tokens)), "--f32"], check=True,
                   capture_output=True, timeout=600)
    ref = np.load(out)
    assert int(ref["n_layer_nextn"]) == 1
    m = open_model(str(path))
    b = NumpyBackend(m.config, load_weights(m.gguf, m.config), n_blocks=4, block_size=16, mtp=True)
    (trunk,) = b.forward([SeqChunk(np.asarray(tokens, np.int32), 0, [0, 1, 2, 3], "all")])
    hyper = b.hyper
    assert hyper is not None and hyper.mtp is not None
    n, cols = len(tokens), hyper.mtp.cols
    h = hyper.pool.reshape(-1, hyper.pool.shape[-1])[:n, cols["h"]]
    ours = hyper.mtp.forward(np.concatenate([np.zeros_like(h[:1]), h[:-1]]).reshape(n, D4.hc_mult, -1),
                             np.asarray(tokens))

    def corr(a, b):
        return np.array([np.corrcoef(x, y)[0, 1] for x, y in zip(a, b, strict=True)])

    top2 = np.sort(ref["mtp"], axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] >= 0.05
    print(f"trunk corr min {corr(trunk, ref['trunk']).min():.7f}, h max |diff| {np.abs(h - ref['h']).max():.5f}, "
          f"MTP corr min {corr(ours, ref['mtp']).min():.7f}, max |diff| {np.abs(ours - ref['mtp']).max():.5f}, "
          f"argmax {(ours.argmax(1) == ref['mtp'].argmax(1)).sum()}/{n}")
    assert corr(h, ref["h"]).min() >= 0.99999  # the streams it is fed: the trunk's h_nextn
    assert corr(ours, ref["mtp"]).min() >= 0.99999
    assert (ours.argmax(1) == ref["mtp"].argmax(1))[decided].all()
    # a draft of three from the last position: each step fed the layer's own streams and its last guess
    guesses, steps = hyper.mtp.chain([0, 1, 2, 3], tokens[-1], n - 1, len(ref["chain"]))
    theirs = ref["chain"].argmax(1).tolist()
    print(f"draft {guesses} (llama.cpp {theirs}), corr min {corr(steps, ref['chain']).min():.7f}")
    assert guesses == theirs and corr(steps, ref["chain"]).min() >= 0.99999


def test_a_worker_with_spec_mtp_answers_as_one_without(start_worker, openai_factory, tiny, tmp_path):
    """The worker builds the pool, its block budget and the drafter for --spec mtp itself: a completion past
    the window gets the answer a worker without drafts gives, twice (the second from the prefix cache, whose
    blocks carry the head's rows), and its metrics count the drafts."""
    import httpx

    prompt = "Repeat after me: " + " ".join(f"w{i}" for i in range(30))
    answers = {}
    for spec in ("off", "mtp"):
        w = start_worker("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "32MiB", "--spec", spec, model=tiny)
        oa = openai_factory(w)
        got = [oa.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0) for _ in range(2)]
        assert got[1].usage.prompt_tokens_details.cached_tokens >= 16 and got[0].usage.prompt_tokens > 16
        answers[spec] = [g.choices[0].text for g in got]
        metrics = httpx.get(w.url + "/metrics", headers={"Authorization": f"Bearer {w.api_key}"}).text
        drafted = [line for line in metrics.splitlines() if line.startswith("ember_spec_drafted_tokens_total")]
        assert (float(drafted[0].split()[-1]) > 0) == (spec == "mtp")
        assert w.stop(timeout=30) == 0
    assert answers["mtp"] == answers["off"] and answers["off"][0] == answers["off"][1] and answers["off"][0]


# -- the layer in its own file (--spec mtp:PATH) ---------------------------------------------------------


GLOBALS = model_tensors(FAMILIES["deepseek4"])  # the model-level tensors a layer file holds


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pair")
    return make_model("deepseek4", "tiny", d / "trunk.gguf", mtp_out=d / "mtp-tiny.gguf"), d / "mtp-tiny.gguf"


def test_the_pair_is_the_whole_file_split_as_llama_cpps_converter_splits_it(tiny, pair):
    """--no-mtp: the trunk's tensors and no nextn_predict_layers; --mtp: the layer's block, the model-level
    tensors its graph reads from its own model, and the keys that place the layer after the trunk."""
    files = [GGUFFile(p) for p in (tiny, *pair)]
    whole, trunk, layer = files
    try:
        block = {n for n in whole.tensors if n.startswith(f"blk.{MTP}.")}
        assert set(trunk.tensors) == set(whole.tensors) - block
        assert set(layer.tensors) == block | set(GLOBALS)
        # what a layer file must hold: llama.cpp's required tensors of the layer (shared_head_norm is optional)
        assert {f"blk.{MTP}.{n}" for n in layer_tensors(FAMILIES["deepseek4"])} == \
            block - {f"blk.{MTP}.nextn.shared_head_norm.weight"}
        for g in (trunk, layer):
            assert all(np.array_equal(g.raw(n), whole.raw(n)) for n in g.tensors)
        tmd, lmd = trunk.metadata, layer.metadata
        assert tmd["deepseek4.block_count"] == SPEC.n_layer and "deepseek4.nextn_predict_layers" not in tmd
        assert len(tmd["deepseek4.swiglu_clamp_exp"]) == SPEC.n_layer
        assert lmd["general.architecture"] == "deepseek4" and lmd["deepseek4.block_count"] == SPEC.n_layer + 1
        assert lmd["deepseek4.nextn_predict_layers"] == 1
        assert len(lmd["deepseek4.swiglu_clamp_shexp"]) == SPEC.n_layer + 1
        for md in (tmd, lmd):  # the checkpoint's ratios, the layer's included
            assert list(md["deepseek4.attention.compress_ratios"]) == [*D4.compress_ratios, 0]
        assert read_config(trunk).hyper.nextn_layers == 0
    finally:
        for g in files:
            g.close()


def test_spec_mtp_path_drafts_as_the_whole_file_does(model, pair):
    m, w = model
    trunk = open_model(str(pair[0]))
    layer = open_mtp_file(pair[1], trunk)
    assert layer.config == m.config  # the trunk's config with the layer: the whole file's
    weights = layer.attach(load_weights(trunk.gguf, trunk.config))
    assert set(weights.by_name) == set(w.by_name)  # the layer file's model-level tensors are the trunk's bytes
    tokens = [int(t) for t in np.random.default_rng(4).integers(3, 700, 40)]
    drafts = []
    for cfg, wts in ((m.config, w), (layer.config, weights)):
        b = NumpyBackend(cfg, wts, n_blocks=4, block_size=16, mtp=True)
        b.forward([SeqChunk(np.asarray(tokens[:-1], np.int32), 0, [0, 1, 2, 3], "none")])
        assert b.hyper is not None and b.hyper.mtp is not None
        drafts.append(b.hyper.mtp.chain([0, 1, 2, 3], tokens[-1], len(tokens) - 1, 3))
    assert drafts[0][0] == drafts[1][0]
    np.testing.assert_array_equal(drafts[0][1], drafts[1][1])
    assert trunk.fingerprint != dataclasses.replace(trunk, mtp_gguf=layer.gguf).fingerprint  # its KV blocks apart


def test_a_layer_files_own_embedding_output_and_head_are_read(model, pair, tmp_path):
    """A layer file whose model-level tensors are not the trunk's (another seed): they join as mtp.* and the
    head reads them, as llama.cpp's MTP graph reads the model it runs on; its logits are HyperStack.head's
    mix over them."""
    m, _ = model
    trunk = open_model(str(pair[0]))
    own = open_mtp_file(write_model(SPEC, tmp_path / "mtp-7.gguf", seed=7, part=MTP_PART), trunk)
    weights = own.attach(load_weights(trunk.gguf, trunk.config))
    assert {n for n in weights.by_name if n.startswith(OWN)} == {OWN + n for n in GLOBALS}
    b = NumpyBackend(own.config, weights, n_blocks=2, block_size=16, mtp=True)
    assert b.hyper is not None and b.hyper.mtp is not None
    head = b.hyper.mtp
    assert head.embd is weights.by_name[OWN + "token_embd.weight"] and head.head_out == OWN + "output.weight"
    assert head.head_norm == f"blk.{MTP}.nextn.shared_head_norm.weight"
    streams = np.random.default_rng(0).standard_normal((3, D4.hc_mult, SPEC.n_embd)).astype(np.float32)
    by = dict(weights.by_name) | {n: weights.by_name[OWN + n] for n in GLOBALS}  # the layer file's in their place
    theirs = NumpyBackend(own.config, dataclasses.replace(weights, by_name=by), n_blocks=2, block_size=16).hyper
    assert theirs is not None
    np.testing.assert_allclose(head.logits(streams), theirs.head(streams, head.head_norm), rtol=1e-5, atol=1e-5)
    assert not np.allclose(head.logits(streams), b.hyper.head(streams, head.head_norm), atol=1e-3)


def _set(key, value):
    def change(g):
        g.metadata[key] = value
    return change


def _drop(name):
    def change(g):
        del g.tensors[name]
    return change


def _reshape(name):
    def change(g):
        g.tensors[name] = dataclasses.replace(g.tensors[name], shape=(SPEC.n_embd, 7))
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_set("general.architecture", "qwen3moe"), "architecture qwen3moe, the model's is deepseek4"),
    (_set("deepseek4.nextn_predict_layers", 0), r"no next-token layer \(deepseek4.nextn_predict_layers is 0\)"),
    (_set("deepseek4.block_count", SPEC.n_layer + 2), f"follows {SPEC.n_layer + 1} trunk layers, trunk.gguf has 4"),
    (_set("deepseek4.embedding_length", 256), "deepseek4.embedding_length is 256, trunk.gguf's is 128"),
    (_set("deepseek4.hyper_connection.count", 2), "deepseek4.hyper_connection.count is 2"),
    (_set("tokenizer.ggml.tokens", ["a", "b"]), r"its vocabulary \(2 tokens\) is not trunk.gguf's"),
    (_drop(f"blk.{MTP}.nextn.hnorm.weight"), f"missing tensor blk.{MTP}.nextn.hnorm.weight"),
    (_drop("output_hc_fn.weight"), "missing tensor output_hc_fn.weight"),
    (_reshape(f"blk.{MTP}.attn_kv.weight"), rf"tensor blk.{MTP}.attn_kv.weight has shape \[128, 7\], blk.0.attn_kv"),
    (_set("deepseek4.attention.compress_ratios", [*D4.compress_ratios, 4]), "compress ratio is 4 \\(supported: 0\\)"),
])
def test_a_layer_file_that_does_not_fit_the_trunk_is_refused_in_one_line(pair, change, message):
    trunk = open_model(str(pair[0]))
    g = GGUFFile(pair[1])
    change(g)  # as a file saying so would read
    with pytest.raises(ModelFileError, match=message) as e:
        check_pair(g, trunk)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(pair[1]))


def test_a_layer_file_beside_a_model_that_cannot_take_it_is_refused(tiny, pair):
    trunk = open_model(str(pair[0]))
    dense = dataclasses.replace(trunk, config=msgspec.structs.replace(trunk.config, arch="qwen3", hyper=None))
    for model, message in ((open_model(str(tiny)), "tiny.gguf carries its own next-token layer; use --spec mtp"),
                           (dense, "a next-token layer file needs a deepseek4 model; trunk.gguf is qwen3")):
        with pytest.raises(ModelFileError, match=message):
            open_mtp_file(pair[1], model)


def test_a_worker_with_spec_mtp_path_answers_as_one_without(start_worker, openai_factory, pair, tmp_path):
    import httpx

    prompt = "Repeat after me: " + " ".join(f"w{i}" for i in range(30))
    answers = {}
    for spec in ("off", f"mtp:{pair[1]}"):
        w = start_worker("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "32MiB", "--spec", spec, model=pair[0])
        got = openai_factory(w).completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        answers[spec[:3]] = got.choices[0].text
        metrics = httpx.get(w.url + "/metrics", headers={"Authorization": f"Bearer {w.api_key}"}).text
        drafted = [line for line in metrics.splitlines() if line.startswith("ember_spec_drafted_tokens_total")]
        assert (float(drafted[0].split()[-1]) > 0) == (spec != "off")
        assert w.stop(timeout=30) == 0
    assert answers["mtp"] == answers["off"] and answers["off"]


def test_spec_mtp_path_with_a_file_of_another_model_is_refused_in_one_line(worker_env, pair, default_model_path):
    from test_daemon_support import free_port

    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(free_port()), "--model",
                        str(pair[0]), "--spec", f"mtp:{default_model_path}"], env=worker_env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 78 and "Traceback" not in p.stderr
    (err,) = [e for e in map(json.loads, filter(lambda x: x.startswith("{"), p.stderr.splitlines()))
              if e["event"] == "config_error"]
    assert "architecture gemma3, the model's is deepseek4" in err["error"] and "\n" not in err["error"]


def test_llama_server_drafts_with_the_pair(tmp_path, llama_server):
    """The pair is llama.cpp's: its server loads the trunk with the layer file as the MTP draft
    (-md FILE --spec-type draft-mtp) and drafts with it. The shape's indexer keys are 128 wide: llama.cpp's
    MTP context cannot start on the tiny shape's 64 (see test_the_head_is_llama_cpps_mtp_graph)."""
    import re

    import httpx

    from ember.worker.bench.workerproc import LlamaServerProcess

    spec = dataclasses.replace(SPEC, dsv4=dataclasses.replace(D4, indexer_dim=128))
    trunk = write_model(spec, tmp_path / "trunk.gguf", part=TRUNK_PART)
    layer = write_model(spec, tmp_path / "mtp-trunk.gguf", part=MTP_PART)
    with LlamaServerProcess(llama_server, "-m", str(trunk), "-md", str(layer), "--spec-type", "draft-mtp", "-c", "512",
                            "-t", "1", "--no-warmup", log_path=tmp_path / "server.log") as p:
        r = httpx.post(p.url + "/completion", json={"prompt": "Repeat after me: a b c d", "n_predict": 16,
                                                    "temperature": 0}, timeout=300)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 16
    text = p.log_text()  # the timings line is written as the slot ends: read once the server has stopped
    assert f"loading draft model '{layer}'" in text
    (generated,) = [int(m) for m in re.findall(r"accepted /\s*(\d+) generated", text)]
    assert generated > 0
