"""`--spec dspark:PATH`: DeepSeek V4's DSpark block drafter on the numpy backend (issue 40 item 3).

On the tiny synthetic pair (`make-model --arch deepseek4 --dspark-out`): the file is read as llama.cpp's
dflash loader reads it and every way it can fail to be a drafter for the trunk is refused in one line;
the drafter's key rows in the pool are a function of the prefix (whatever the chunking, and restored
from saved blocks), the trunk's logits are untouched by them, and a draft is the Markov head's chain
over one block; greedy output through the engine and through a real worker is the same with and
without drafts; and the drafts are llama.cpp's own drafter's, step by step, on llama-server's committed
sequence, wherever the reference's top two logits are not a near-tie."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from dspark_support import load_pair, make_pair
from engine_runs import RecordingDrafter, generate

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import resolve_shape
from ember.worker.bench.workerproc import LlamaServerProcess
from ember.worker.engine.spec.dspark_drafter import DSparkDrafter
from ember.worker.model.dspark_file import check_dspark, open_dspark_file
from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.model.loader import open_model

SPEC = resolve_shape("deepseek4", "tiny")
assert SPEC.dsv4 is not None and SPEC.dsv4.dspark is not None
DS = SPEC.dsv4.dspark
BS = 16
CLEAR = 0.02  # a slot whose top two logits (Markov-biased, the reference's) are closer is a near-tie: the
# float16 keys and Q8_0 activations of llama.cpp's CPU kernels may order them either way


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("dspark"))


@pytest.fixture(scope="module")
def loaded(pair, tmp_path_factory):
    """(the trunk, its weights, the drafter file, the drafter's weights)."""
    return load_pair(*pair, tmp_path_factory.mktemp("cache"))


def _backend(loaded, n_blocks: int = 12, p_min: float = 0.0) -> NumpyBackend:
    m, w, f, fw = loaded
    b = NumpyBackend(m.config, w, n_blocks=n_blocks, block_size=BS, dspark=(f, fw))
    assert b.dspark is not None
    b.dspark.p_min = p_min
    return b


# -- the file ------------------------------------------------------------------------------------------


def test_the_file_reads_as_llama_cpps_dflash_loader_reads_it(loaded):
    m, _, f, fw = loaded
    assert f.target_layers == DS.target_layers and f.block_size == DS.block_size
    assert f.mask_token == SPEC.n_vocab - 1
    stage = f.config
    assert stage.n_layers == DS.stages and stage.hyper is not None
    assert stage.hyper.compress_ratios == (0,) * DS.stages and stage.hyper.hash_layers == 0
    assert f.key_width == DS.stages * SPEC.head_dim
    # the trunk's embeddings and output matrix serve, shared, not copied
    assert fw.by_name["token_embd.weight"] is loaded[1].by_name["token_embd.weight"]
    assert fw.by_name["markov_w1.weight"].shape == (SPEC.n_vocab, DS.markov_rank)


def _set(key, value):
    def change(g):
        g.metadata[key] = value
    return change


def _drop(name):
    def change(g):
        del g.tensors[name]
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_set("general.architecture", "deepseek4"), r"architecture deepseek4, not a DSpark drafter \(dflash\)"),
    (_set("dflash.hyper_connection.count", 0), r"not a DeepSeek V4 drafter \(dflash.hyper_connection.count is 0\)"),
    (_drop("markov_w1.weight"), r"no Markov head \(markov_w1.weight\): a DFlash drafter, not DSpark"),
    (_set("dflash.embedding_length", 256), "dflash.embedding_length is 256, trunk.gguf's hidden size is 128"),
    (_set("tokenizer.ggml.tokens", ["a", "b"]), r"its vocabulary \(2 tokens\) is not trunk.gguf's \(768\)"),
    (_set("dflash.target_layers", [2, 3, 5]), r"dflash.target_layers \[2, 3, 5\] are not within trunk.gguf's 0 to 4"),
    (_set("dflash.target_layers", [3, 4]), r"tensor fc.weight has shape \[384, 128\], not \[256, 128\]"),
    (_set("dflash.attention.compress_ratios", [0, 4]), r"compress ratios \[0, 4\]"),
    (_set("dflash.expert_gating_func", 1), "dflash.expert_gating_func is 1"),
    (_set("dflash.sample_from_anchor", False), "sample_from_anchor is false"),
    (_drop("blk.1.exp_probs_b.bias"), "missing tensor blk.1.exp_probs_b.bias"),
    (_set("tokenizer.ggml.mask_token_id", None), "tokenizer.ggml.mask_token_id is None"),
])
def test_a_file_that_is_not_a_drafter_for_the_trunk_is_refused_in_one_line(pair, change, message):
    trunk = open_model(str(pair[0]))
    g = GGUFFile(pair[1])
    change(g)  # as a file saying so would read
    with pytest.raises(ModelFileError, match=message) as e:
        check_dspark(g, trunk)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(pair[1]))


def test_a_drafter_beside_a_model_that_is_not_deepseek4_is_refused(pair, default_model_path):
    with pytest.raises(ModelFileError, match="a DSpark drafter needs a deepseek4 model; .* is gemma3"):
        open_dspark_file(pair[1], open_model(str(default_model_path)))


# -- the rows and the drafts ---------------------------------------------------------------------------


def _forward(b: NumpyBackend, tokens: list[int], chunk: int, table: list[int]) -> np.ndarray:
    out = []
    for start in range(0, len(tokens), chunk):
        c = SeqChunk(np.asarray(tokens[start : start + chunk], np.int32), start, table, "all")
        out.append(b.forward([c])[0])
    return np.concatenate(out)


def test_the_rows_are_a_function_of_the_prefix_and_blocks_carry_them(loaded):
    """60 positions (past the 16-token window) in chunks of 7 over scattered blocks: the trunk's logits are
    a plain backend's, the pool's drafter rows are those of one pass (and of the features by hand), a draft
    is the Markov chain of one block and writes nothing, and restored blocks draft the same."""
    m, w, f, _ = loaded
    n = 60
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 700, n)]
    table = np.random.default_rng(2).permutation(12)[:4].tolist()
    plain = _forward(NumpyBackend(m.config, w, n_blocks=12, block_size=BS), tokens, n, table)
    b = _backend(loaded)
    np.testing.assert_allclose(_forward(b, tokens, 7, table), plain, atol=2e-5)  # the drafter leaves the trunk be
    assert b.kv_layout == "numpy-hyper-dspark-v2" != NumpyBackend(m.config, w, n_blocks=1, block_size=BS).kv_layout
    assert NumpyBackend.kv_bytes_per_block(m.config, BS, drafter_width=f.key_width) == b.read_block(0).nbytes
    one = _backend(loaded)
    _forward(one, tokens, n, table)
    head = b.dspark
    assert head is not None and one.dspark is not None
    slots = [table[p // BS] * BS + p % BS for p in range(n)]
    rows = b.hyper.pool.reshape(-1, b.hyper.pool.shape[-1])[slots][:, head.cols]
    whole = one.hyper.pool.reshape(-1, one.hyper.pool.shape[-1])[slots][:, head.cols]
    np.testing.assert_allclose(rows, whole, atol=2e-3)  # float16 keys: one rounding step apart at most
    at = n - 1
    guesses, logits, conf = head.chain(table, tokens[at], at, DS.block_size)
    assert guesses == [int(np.argmax(row)) for row in logits] and len(guesses) == DS.block_size
    assert ((conf > 0) & (conf < 1)).all()
    assert head.draft(table, tokens[at], at, 8) == guesses  # a block is at most the file's block size
    assert head.draft(table, tokens[at], at, 2) == head.chain(table, tokens[at], at, 2)[0]
    assert head.draft(table, tokens[at], at, DS.block_size) == guesses  # drafting writes nothing to the pool
    restored = _backend(loaded)  # as the KV store restores blocks
    restored.load_blocks(table, b.save_blocks(table).wait())
    assert restored.dspark is not None and restored.dspark.draft(table, tokens[at], at, DS.block_size) == guesses
    # the confidence head cuts the draft before its first slot under p_min
    cut = float(np.sort(conf)[len(conf) // 2])
    b.dspark.p_min = cut
    expected = guesses[: int(np.argmax(conf < cut))] if (conf < cut).any() else guesses
    assert head.draft(table, tokens[at], at, DS.block_size) == expected


# -- through the engine and a worker -------------------------------------------------------------------


def _generate(loaded, spec: str, prompt: list[int], n: int):
    m = loaded[0]
    backend = _backend(loaded, n_blocks=64) if spec == "dspark" else NumpyBackend(m.config, loaded[1], n_blocks=64,
                                                                                   block_size=BS)
    drafter = RecordingDrafter(DSparkDrafter(backend.dspark)) if spec == "dspark" else None
    return (*generate(m, backend, spec, prompt, n, drafter), drafter)


def test_greedy_output_is_the_same_with_spec_dspark(loaded):
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 700, 40)]  # past the 16-token window
    off, _, _ = _generate(loaded, "off", prompt, 24)
    on, metrics, drafter = _generate(loaded, "dspark", prompt, 24)
    assert on == off and len(on) == 24
    assert metrics["ember_spec_drafted_tokens_total"] > 0 and metrics["ember_spec_verify_steps_total"] > 0
    # each draft is what a fresh pass over the tokens it followed drafts: refused guesses left nothing behind
    for tokens, draft in drafter.seen[:3] + drafter.seen[-2:]:
        fresh = _backend(loaded, n_blocks=8)
        fresh.forward([SeqChunk(np.asarray(tokens[:-1], np.int32), 0, list(range(8)), "none")])
        assert fresh.dspark.draft(list(range(8)), tokens[-1], len(tokens) - 1, len(draft)) == draft


def test_a_worker_with_spec_dspark_answers_as_one_without(start_worker, openai_factory, pair):
    """The worker builds the pool, its block budget and the drafter for --spec dspark:PATH itself: a completion
    past the window gets the answer a worker without drafts gives, twice (the second from the prefix cache,
    whose blocks carry the drafter's rows), and its metrics count the drafts."""
    prompt = "Repeat after me: " + " ".join(f"w{i}" for i in range(30))
    answers = {}
    for spec in ("off", f"dspark:{pair[1]}"):
        w = start_worker("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "32MiB", "--spec", spec, model=pair[0])
        oa = openai_factory(w)
        got = [oa.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0) for _ in range(2)]
        assert got[1].usage.prompt_tokens_details.cached_tokens >= 16 and got[0].usage.prompt_tokens > 16
        answers[spec[:6]] = [g.choices[0].text for g in got]
        metrics = httpx.get(w.url + "/metrics", headers={"Authorization": f"Bearer {w.api_key}"}).text
        drafted = [line for line in metrics.splitlines() if line.startswith("ember_spec_drafted_tokens_total")]
        assert (float(drafted[0].split()[-1]) > 0) == (spec != "off")
        assert w.stop(timeout=30) == 0
    assert answers["dspark"] == answers["off"] and answers["off"][0] == answers["off"][1] and answers["off"][0]


def test_spec_dspark_that_cannot_run_is_refused_in_one_line(worker_env, pair, default_model_path):
    from test_daemon_support import free_port

    message = "architecture gemma3, not a DSpark drafter"
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(free_port()), "--model",
                        str(pair[0]), "--spec", f"dspark:{default_model_path}"],
                       env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 78 and "Traceback" not in p.stderr
    (err,) = [e for e in map(json.loads, filter(lambda x: x.startswith("{"), p.stderr.splitlines()))
              if e["event"] == "config_error"]
    assert message in err["error"] and "\n" not in err["error"]


# -- llama.cpp's own drafter ---------------------------------------------------------------------------

CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(")
STEP = re.compile(r"generate_draft: id=(\d+), #tokens=\d+, #draft=\d+, pos_next=(\d+)")


def llama_drafts(log: str) -> list[tuple[int, int, list[int]]]:
    """llama-server's drafting steps from its -lv 5 log: (the last token, its position, the block's drafted
    tokens), each slot's candidate 0 (printed before the budget cuts the draft)."""
    steps, slots = [], {}
    for line in log.splitlines():
        if m := CANDIDATE.search(line):
            if m[1] == "0":
                slots[int(m[2])] = int(m[3])
        elif m := STEP.search(line):
            steps.append((int(m[1]), int(m[2]), [slots[i] for i in sorted(slots)]))
            slots = {}
    return steps


def test_the_drafts_are_llama_cpps(loaded, pair, tmp_path, llama_server):
    """llama-server drafts with the pair (a block of the file's block size a step); on the sequence it
    committed, ember's drafter makes each step's block from the same last token and prefix. Every slot
    whose inputs are llama.cpp's (the chain before it agrees) and whose top two logits are not a near-tie
    must draft llama.cpp's token, and most slots must be such."""
    trunk, dspark = pair
    prompt = "Repeat after me: " + " ".join(f"w{i}" for i in range(20))
    with LlamaServerProcess(llama_server, "-m", str(trunk), "-md", str(dspark), "--spec-type", "draft-dspark",
                            "--spec-draft-n-max", str(DS.block_size), "-lv", "5", "-c", "512", "-t", "2",
                            "--no-warmup", log_path=tmp_path / "server.log") as p:
        tokenized = httpx.post(p.url + "/tokenize", json={"content": prompt, "add_special": True}, timeout=60)
        ids = tokenized.json()["tokens"]
        r = httpx.post(p.url + "/completion", json={"prompt": ids, "n_predict": 12, "temperature": 0,
                                                    "return_tokens": True}, timeout=300)
        assert r.status_code == 200
    steps = llama_drafts(p.log_text())
    tokens = ids + r.json()["tokens"]
    assert len(steps) >= 6 and all(len(d) == DS.block_size for _, _, d in steps)
    b = _backend(loaded, n_blocks=8)
    table = list(range(8))
    b.forward([SeqChunk(np.asarray(tokens, np.int32), 0, table, "none")])  # the rows of the committed sequence
    checked = agreed = slots = 0
    misses = []
    for last, at, theirs in steps:
        assert tokens[at] == last
        assert b.dspark is not None
        ours, logits, _ = b.dspark.chain(table, last, at, DS.block_size)
        top2 = np.sort(logits, axis=1)[:, -2:]
        for i, (a, t) in enumerate(zip(ours, theirs, strict=True)):
            slots += 1
            if ours[:i] == theirs[:i] and top2[i, 1] - top2[i, 0] >= CLEAR:
                checked += 1
                agreed += a == t
                if a != t:
                    misses.append((at, i, a, t, float(top2[i, 1] - top2[i, 0])))
    print(f"dspark drafts: {agreed}/{checked} agree where checked, {checked}/{slots} slots checked")
    assert not misses, misses
    assert checked >= 0.6 * slots
