"""DeepSeek V4's DSpark block drafter as a synthetic file (`ember bench make-model --dspark-out`, issue 40
item 3's first piece): the tensors and keys llama.cpp's `dflash` loader reads, and llama.cpp itself as the
judge: its server loads the tiny trunk with the drafter (-md FILE --spec-type draft-dspark), drafts blocks
with it, and answers greedy as it does without it (wherever the numpy reference's choice is not a
near-tie of the random weights' logits)."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
from gguf import GGUFReader

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model, plan_dspark, resolve_shape
from ember.worker.bench.workerproc import LlamaServerProcess
from ember.worker.model.loader import open_model
from ember.worker.model.weights import load_weights

SPEC = resolve_shape("deepseek4", "tiny")
assert SPEC.dsv4 is not None and SPEC.dsv4.dspark is not None
DS = SPEC.dsv4.dspark
NEAR_TIE = 0.005  # top-two logit gap under which llama.cpp's batch shapes may pick either token


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    trunk = make_model("deepseek4", "tiny", d / "trunk.gguf", mtp_out=d / "mtp.gguf", dspark_out=d / "dspark.gguf")
    return trunk, d / "dspark.gguf"


def _field(r: GGUFReader, key: str):
    f = r.fields[key]
    if len(f.data) == 1 and f.types[0].name != "ARRAY":
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0].name == "STRING" else v.tolist()[0]
    return [f.parts[i].tolist()[0] for i in f.data]


def test_the_drafter_holds_what_llama_cpps_dflash_loader_reads(pair):
    _, dspark = pair
    r = GGUFReader(dspark)
    assert _field(r, "general.architecture") == "dflash"
    assert _field(r, "dflash.block_count") == DS.stages
    assert _field(r, "dflash.target_layers") == list(DS.target_layers)
    assert _field(r, "dflash.block_size") == DS.block_size
    assert _field(r, "dflash.expert_gating_func") == 4
    assert _field(r, "dflash.attention.compress_ratios") == [0] * DS.stages
    assert _field(r, "dflash.hyper_connection.count") == 4
    assert _field(r, "tokenizer.ggml.mask_token_id") == SPEC.n_vocab - 1
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert names == {t.name: tuple(t.shape) for t in plan_dspark(SPEC)}
    # the trunk's embeddings and output projection serve: the drafter has none of its own
    assert not {"token_embd.weight", "output.weight"} & names.keys()
    assert names["fc.weight"] == (len(DS.target_layers) * SPEC.n_embd, SPEC.n_embd)
    assert names["markov_w1.weight"] == names["markov_w2.weight"] == (DS.markov_rank, SPEC.n_vocab)
    assert names["conf_proj.weight"] == (SPEC.n_embd + DS.markov_rank, 1)
    assert all(f"blk.{s}.exp_probs_b.bias" in names and f"blk.{s}.ffn_gate_tid2eid.weight" not in names
               for s in range(DS.stages))  # learned routing in every stage
    assert not any("compressor" in n or "indexer" in n for n in names)  # window-only stages


def _complete(server, trunk, tmp_path, prompt: str, n: int, *draft: str) -> tuple[list[int], list[int], str]:
    """(the prompt's token ids, llama-server's greedy completion of it as token ids, its log) with the extra
    flags `draft`."""
    with LlamaServerProcess(server, "-m", str(trunk), *draft, "-c", "512", "-t", "2", "--no-warmup",
                            log_path=tmp_path / f"server-{len(draft)}.log") as p:
        tokenized = httpx.post(p.url + "/tokenize", json={"content": prompt, "add_special": True}, timeout=60)
        ids = tokenized.json()["tokens"]
        r = httpx.post(p.url + "/completion", json={"prompt": ids, "n_predict": n, "temperature": 0,
                                                    "return_tokens": True}, timeout=300)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == n
    return ids, r.json()["tokens"], p.log_text()  # read once the server has stopped: its timings are in


def _clear_prefix(trunk, tokens: list[int], first: int) -> int:
    """How many tokens from `first` on the numpy reference chooses with a clear margin: its top two logits
    before each at least NEAR_TIE apart (a closer pair may come out either way between llama.cpp's one-row
    decode and its wider verification batch, which round differently)."""
    m = open_model(str(trunk))
    b = NumpyBackend(m.config, load_weights(m.gguf, m.config), n_blocks=8, block_size=16)
    logits = b.forward([SeqChunk(np.asarray(tokens, np.int32), 0, list(range(8)), "all")])[0]
    for i in range(first, len(tokens)):
        top2 = np.sort(logits[i - 1])[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            return i - first
    return len(tokens) - first


def test_llama_server_drafts_blocks_with_it_and_answers_as_without(pair, tmp_path, llama_server, monkeypatch):
    trunk, dspark = pair
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    prompt = "The quick brown fox jumps over the lazy dog. "  # a greedy path of clear margins on the tiny model
    ids, plain, _ = _complete(llama_server, trunk, tmp_path, prompt, 12)
    _, drafted, log = _complete(llama_server, trunk, tmp_path, prompt, 12, "-md", str(dspark), "--spec-type",
                                "draft-dspark", "--spec-draft-n-max", str(DS.block_size))
    assert f"loading draft model '{dspark}'" in log
    assert f"block_size={DS.block_size}" in log and f"n_extract={len(DS.target_layers)}" in log
    (generated,) = [int(m) for m in re.findall(r"accepted /\s*(\d+) generated", log)]
    assert generated > 0
    clear = _clear_prefix(trunk, ids + plain, len(ids))
    assert clear >= 8  # the comparison below cannot pass on a handful of tokens
    assert drafted[:clear] == plain[:clear]
