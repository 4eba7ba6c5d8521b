"""DeepSeek V4's DSpark block drafter as a synthetic file (`ember bench make-model --dspark-out`, issue 40
item 3's first piece): the tensors and keys llama.cpp's `dflash` loader reads, and llama.cpp itself as the
judge: its server loads the tiny trunk with the drafter (-md FILE --spec-type draft-dspark), drafts blocks
with it, and answers greedy exactly as it does without it."""

from __future__ import annotations

import re

import httpx
import pytest
from gguf import GGUFReader

from ember.worker.bench.synth import make_model, plan_dspark, resolve_shape
from ember.worker.bench.workerproc import LlamaServerProcess

SPEC = resolve_shape("deepseek4", "tiny")
assert SPEC.dsv4 is not None and SPEC.dsv4.dspark is not None
DS = SPEC.dsv4.dspark


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


def _complete(server, trunk, tmp_path, prompt: str, n: int, *draft: str) -> tuple[str, str]:
    """(llama-server's greedy completion of `prompt`, its log) with the extra flags `draft`."""
    with LlamaServerProcess(server, "-m", str(trunk), *draft, "-c", "512", "-t", "2", "--no-warmup",
                            log_path=tmp_path / f"server-{len(draft)}.log") as p:
        r = httpx.post(p.url + "/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0}, timeout=300)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == n
    return r.json()["content"], p.log_text()  # read once the server has stopped: its timings are in


def test_llama_server_drafts_blocks_with_it_and_answers_as_without(pair, tmp_path, llama_server):
    trunk, dspark = pair
    prompt = "Repeat after me: " + " ".join(f"w{i}" for i in range(20))
    plain, _ = _complete(llama_server, trunk, tmp_path, prompt, 12)
    drafted, log = _complete(llama_server, trunk, tmp_path, prompt, 12, "-md", str(dspark), "--spec-type",
                             "draft-dspark", "--spec-draft-n-max", str(DS.block_size))
    assert f"loading draft model '{dspark}'" in log
    assert f"block_size={DS.block_size}" in log and f"n_extract={len(DS.target_layers)}" in log
    (generated,) = [int(m) for m in re.findall(r"accepted /\s*(\d+) generated", log)]
    assert generated > 0
    assert drafted == plain
