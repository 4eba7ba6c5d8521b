"""Mixture-of-experts models (qwen3moe, gpt-oss): the router's math, the synthetic shapes, and a worker
serving each tiny synthetic model through all four APIs with forced tool calls in the format its
template speaks (qwen3moe: Hermes, <tool_call>{...}</tool_call>; gpt-oss: Harmony), checked through the
official clients.

The forward pass itself is checked against llama.cpp in tests/test_forward_oracle.py (synth-qwen3moe).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from ember.kernels import reference as ops
from ember.worker.bench import synth
from ember.worker.model.config import Yarn, read_config
from ember.worker.model.gguf_file import GGUFFile, ModelFileError

TOOL = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


# -- the router and the experts against a token-by-token definition -------------------------------------


def _naive_moe(x, router, gate, up, down, k, gating, norm):
    out = np.zeros((len(x), down.shape[1]), np.float64)
    for i, row in enumerate(x.astype(np.float64)):
        logits = router.astype(np.float64) @ row
        if gating == "softmax":
            p = np.exp(logits - logits.max())
            p /= p.sum()
            chosen = sorted(range(len(p)), key=lambda e: -p[e])[:k]
            w = p[chosen]
        else:
            chosen = sorted(range(len(logits)), key=lambda e: -logits[e])[:k]
            w = np.exp(logits[chosen] - logits[chosen].max())
            w /= w.sum()
        if norm:
            w = w / w.sum()
        for e, we in zip(chosen, w, strict=True):
            g = gate[e].astype(np.float64) @ row
            h = g / (1 + np.exp(-g)) * (up[e].astype(np.float64) @ row)
            out[i] += we * (down[e].astype(np.float64) @ h)
    return out


@pytest.mark.parametrize("gating,norm", [("softmax", True), ("softmax", False), ("softmax-topk", False)])
def test_moe_mlp_matches_token_by_token(gating, norm):
    rng = np.random.default_rng(0)
    n, hidden, ffn, experts, k = 9, 32, 24, 8, 3
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    router = rng.standard_normal((experts, hidden)).astype(np.float32)
    gate, up = (rng.standard_normal((experts, ffn, hidden)).astype(np.float32) * 0.2 for _ in range(2))
    down = rng.standard_normal((experts, hidden, ffn)).astype(np.float32) * 0.2
    got = ops.moe_mlp(x, router, gate, up, down, k=k, act="silu", gating=gating, norm_topk=norm)
    np.testing.assert_allclose(got, _naive_moe(x, router, gate, up, down, k, gating, norm), rtol=2e-4, atol=2e-5)
    top, w = ops.moe_route(x, router, k=k, gating=gating, norm_topk=norm)
    assert top.shape == (n, k) and all(len(set(r)) == k for r in top.tolist())
    if norm or gating == "softmax-topk":
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)


def test_unknown_gating_is_refused():
    with pytest.raises(ValueError, match="gating"):
        ops.moe_route(np.ones((1, 4), np.float32), np.ones((2, 4), np.float32), k=1, gating="sigmoid")


# -- the synthetic shapes --------------------------------------------------------------------------------


def test_qwen3_30b_a3b_plan_is_llama_cpps_q4_k_m():
    t = {p.name: p for p in synth.plan("qwen3moe", "qwen3-30b-a3b")}
    assert t["blk.0.ffn_gate_exps.weight"].shape == (2048, 768, 128)
    assert t["blk.0.ffn_down_exps.weight"].shape == (768, 2048, 128)
    assert t["blk.0.ffn_gate_inp.weight"].ggml_type.name == "F32"  # llama.cpp never quantizes the router
    assert t["blk.0.ffn_gate_exps.weight"].ggml_type.name == "Q4_K"
    assert t["blk.0.ffn_down_exps.weight"].ggml_type.name == "Q6_K"  # use_more_bits layers
    assert t["blk.7.ffn_down_exps.weight"].ggml_type.name == "Q4_K"
    assert "blk.0.ffn_gate.weight" not in t and "output.weight" in t
    total = sum(p.nbytes for p in t.values())
    assert 17.0e9 < total < 19.5e9, total  # a real Qwen3-30B-A3B Q4_K_M file is 18.6 GB


def test_qwen3_30b_a3b_q2_plan_is_a_2_to_3_bit_dynamic_mix():
    t = {p.name: p for p in synth.plan("qwen3moe", "qwen3-30b-a3b-q2")}
    types = {n: p.ggml_type.name for n, p in t.items()}
    assert (types["blk.0.ffn_gate_exps.weight"], types["blk.0.ffn_down_exps.weight"]) == ("IQ3_XXS", "Q3_K")
    assert (types["blk.7.ffn_up_exps.weight"], types["blk.7.ffn_down_exps.weight"]) == ("IQ2_XXS", "Q2_K")
    assert types["blk.7.attn_q.weight"] == "Q4_K" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    experts = sum(p.nbytes for n, p in t.items() if n.endswith("_exps.weight"))
    bits = 8 * experts / (48 * 3 * 128 * 768 * 2048)
    assert 2.0 < bits < 3.0, bits
    total = sum(p.nbytes for p in t.values())
    assert 8.0e9 < total < 11.5e9, total  # the users' 2-3-bit files of this model are 9-12 GB


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return synth.make_model("qwen3moe", "tiny", tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf", seed=0)


def test_the_bandwidth_limit_counts_the_active_experts_only(tiny_moe):
    """ember bench speed's limit: a token reads k of the E experts' bytes (and every other tensor but
    the embedding table)."""
    from ember.worker.bench.gpu_speed import weight_bytes_per_token
    from ember.worker.model.loader import open_model

    model = open_model(tiny_moe)
    t = model.gguf.tensors
    experts = sum(x.nbytes for n, x in t.items() if "_exps." in n)
    rest = sum(x.nbytes for n, x in t.items() if "_exps." not in n and n != "token_embd.weight")
    assert experts > 0 and weight_bytes_per_token(model) == int(rest + experts * 4 / 16)


def test_config_reads_the_experts(tiny_moe):
    cfg = read_config(GGUFFile(tiny_moe))
    assert (cfg.arch, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn) == ("qwen3moe", 16, 4, 64)
    assert cfg.recipe.moe is not None and cfg.recipe.qk_norm


def test_the_cuda_backend_takes_every_type_numpy_reads_and_refuses_others_in_one_line(tmp_path, monkeypatch):
    """The tiny low-bit model holds every 2-5-bit type ember reads (issue 39: each has CUDA kernels now; run
    there: test_cuda_backend.py). A type without kernels is refused in one line, naming it."""
    from ember.worker.backends.cuda import layers as cuda_layers

    g = GGUFFile(synth.make_model("qwen3moe", "tiny-lowbit", tmp_path / "lowbit.gguf"))
    cuda_layers.check_runs(g, read_config(g))
    fewer = {k: v for k, v in cuda_layers.BLOCK_SIZES.items() if k != "iq2_xxs"}
    monkeypatch.setattr(cuda_layers, "BLOCK_SIZES", fewer)
    with pytest.raises(ModelFileError) as e:
        cuda_layers.check_runs(g, read_config(g))
    assert "has quant type IQ2_XXS" in str(e.value) and "--backend numpy" in str(e.value)
    assert "\n" not in str(e.value)


# -- a worker serving it ---------------------------------------------------------------------------------


# each family's tiny model and the mark its forced calls are written in: Hermes for qwen3moe, Harmony's
# commentary channel for gpt-oss (its synthetic file carries Harmony's special tokens and template)
FAMILIES = {"qwen3moe": "<tool_call>", "gpt-oss": "<|channel|>commentary to=functions.get_weather"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_worker(request, start_worker, tmp_path_factory):
    path = synth.make_model(request.param, "tiny", tmp_path_factory.mktemp("moe") / f"{request.param}.gguf")
    w = start_worker("--max-seqs", "4", "--ctx", "2048", "--kv-mem", "64MiB", "--log-prompts", model=path)
    return w, FAMILIES[request.param]


def test_four_apis_generate_and_force_a_call(moe_worker, openai_factory):
    import anthropic

    moe_worker, call_mark = moe_worker
    oa = openai_factory(moe_worker)
    r = oa.completions.create(model="m", prompt="one two three", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL}}]
    # a random model never closes a <think> block of its own: each request asks for no reasoning
    r = oa.chat.completions.create(model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=60,
                                   parallel_tool_calls=False, seed=1, reasoning_effort="none")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TOOL)
    r = oa.responses.create(model="m", input=ASK, max_output_tokens=60, tool_choice="required",
                            reasoning={"effort": "none"},
                            tools=[{"type": "function", "name": "get_weather", "parameters": TOOL, "strict": True}])
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), TOOL)
    an = anthropic.Anthropic(base_url=moe_worker.url, api_key=moe_worker.api_key, max_retries=0, timeout=300)
    m = an.messages.create(model="m", max_tokens=60, messages=ASK, thinking={"type": "disabled"},
                           extra_body={"temperature": 0},
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           tools=[{"name": "get_weather", "input_schema": TOOL}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather", m
    jsonschema.validate(uses[0].input, TOOL)
    outputs = [json.loads(ln)["text"] for ln in moe_worker.log_path.read_text().splitlines() if '"output"' in ln]
    assert sum(call_mark in t for t in outputs) >= 3  # the family's own calls, translated by the APIs


def test_a_model_too_big_for_the_gpu_is_one_line(tiny_moe):
    from ember.worker.backends.cuda.layers import check_fits

    g = GGUFFile(tiny_moe)
    check_fits(g, (64 << 30, 80 << 30))
    with pytest.raises(ModelFileError) as e:
        check_fits(g, (100 << 20, 24 << 30))
    msg = str(e.value)
    assert "too big for this GPU" in msg and "0.1 GiB free of 24.0 GiB" in msg and "\n" not in msg


def test_gpt_oss_20b_plan_is_the_released_mix():
    t = {p.name: p for p in synth.plan("gpt-oss", "gpt-oss-20b")}
    assert t["blk.0.ffn_gate_exps.weight"].shape == (2880, 2880, 32)
    assert {t[f"blk.0.ffn_{m}_exps.weight"].ggml_type.name for m in ("gate", "up", "down")} == {"MXFP4"}
    assert t["blk.0.attn_q.weight"].ggml_type.name == "Q8_0" and t["blk.0.attn_sinks.weight"].shape == (64,)
    assert t["blk.0.ffn_down_exps.bias"].ggml_type.name == "F32"
    assert 11.5e9 < sum(p.nbytes for p in t.values()) < 12.6e9  # the released MXFP4 file: 12.1 GB


def test_attention_sinks_take_weight_from_the_keys():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((6, 2, 8)).astype(np.float32) for _ in range(2))
    pos = np.array([3, 4, 5])
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    got = ops.attention(q, k, v, pos, window=4, scale=0.3, sinks=sinks)
    for i, p in enumerate(pos):
        for h in range(4):
            keys = [j for j in range(6) if j <= p and p - j < 4]
            s = np.array([q[i, h] @ k[j, h // 2] * 0.3 for j in keys] + [sinks[h]], np.float64)
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[i, h], sum(w[a] * v[j, h // 2] for a, j in enumerate(keys)),
                                       rtol=1e-4, atol=1e-5)


def test_swiglu_oai_clamps_as_gpt_oss_does():
    gate = np.array([-10.0, 0.0, 3.0, 9.0], np.float32)
    up = np.array([-9.0, 1.0, 2.0, 8.0], np.float32)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    np.testing.assert_allclose(ops.swiglu_oai(gate, up), g / (1 + np.exp(-1.702 * g)) * (u + 1), rtol=1e-6)


def test_the_cuda_backend_takes_gpt_oss(tmp_path):
    """Sinks, YaRN, the biases, the clamped SwiGLU and its gating are in the CUDA backend's table (support.py;
    run there: test_cuda_backend.py)."""
    from ember.worker.backends.cuda.layers import check_runs

    g = GGUFFile(synth.make_model("gpt-oss", "tiny", tmp_path / "g.gguf"))
    cfg = read_config(g)
    assert cfg.rope_yarn == Yarn(32.0, 4096, local=True)
    assert cfg.local_layers == (True, False) and cfg.sliding_window == 16
    check_runs(g, cfg)


def test_the_cuda_backend_takes_qwen3moe(tiny_moe):
    """Its routing and expert types are ones the CUDA kernels have (run there: test_cuda_backend.py)."""
    from ember.worker.backends.cuda.layers import check_runs

    g = GGUFFile(tiny_moe)
    check_runs(g, read_config(g))


def test_the_numpy_backend_refuses_weights_it_has_no_room_for(tiny_moe, tmp_path, monkeypatch):
    """Float32 weights past both the cache's disk and the free memory: one line, before any work."""
    import collections

    from ember.worker.model import weights

    g = GGUFFile(tiny_moe)
    cfg = read_config(g)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    monkeypatch.setattr(weights.psutil, "virtual_memory", lambda: collections.namedtuple("vm", "available")(2000))
    with pytest.raises(ModelFileError) as e:
        weights.load_weights(g, cfg)
    assert "keeps float32 weights" in str(e.value) and "--backend cuda" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    assert weights.load_weights(g, cfg).layers[0].gate_exps.shape == (16, 64, 128)
    # once cached (stacked files included), no room is needed any more
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    monkeypatch.setattr(weights.psutil, "virtual_memory", lambda: collections.namedtuple("vm", "available")(2000))
    assert weights.load_weights(g, cfg).layers[0].wqkv.shape[1] == cfg.hidden


def test_expert_tensors_that_disagree_with_the_metadata_are_one_line(tiny_moe, tmp_path):
    data = bytearray(tiny_moe.read_bytes())
    key = b"qwen3moe.expert_feed_forward_length"
    at = data.index(key) + len(key) + 4  # the key, then its u32 value type, then the value
    assert int.from_bytes(data[at:at + 4], "little") == 64
    data[at:at + 4] = (32).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    shapes = r"ffn_gate_exps.weight has shape \[128, 64, 16\], expected \[128, 32, 16\]"
    with pytest.raises(ModelFileError, match=shapes):
        read_config(GGUFFile(bad))
