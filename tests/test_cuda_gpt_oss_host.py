"""gpt-oss on the CUDA backend, checked on the CPU (the GPU runs: tests/test_cuda_backend.py,
test_kernels_gpu.py and test_cuda_gpt_oss_worker.py).

- The new kernels' twins against the numpy backend's own math: a sink logit in the split-K parts'
  merge (attn_combine, attn_warp's cluster merge) and at the end of flash attention's online softmax;
  YaRN's cos/sin scale as the device gets it; the experts' biases as the device holds them, through a
  mirror of the MoE kernels' indexing.
- The forward pass's kernels for gpt-oss's sliding and full layers, through a recording stand-in for
  ember.kernels.ops (tests/cuda_recorder.py), and the existing families' kernel calls (every argument,
  every switch combination) pinned to what they were before gpt-oss landed.
- The declared table of what the CUDA forward pass runs (backends/cuda/support.py), which check_runs reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import numpy as np
import pytest
from cuda_recorder import forward_for, step_cases
from gguf.constants import GGMLQuantizationType

from ember.kernels import quants, reference
from ember.worker.bench.synth import make_model
from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.model.loader import open_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")

    def get(arch: str, shape: str = "tiny"):
        path = folder / f"{arch}-{shape}.gguf"
        if not path.exists():
            make_model(arch, shape, path, seed=1)
        return open_model(path)

    return get


# -- the twins ------------------------------------------------------------------------------------------


def _kv(rng, length, kv_heads=2, d=16):
    return (rng.normal(0, 1, (length, kv_heads, d)).astype(np.float32) for _ in range(2))


SINKS = {"none": None, "mild": np.array([0.5, -1.0, 2.0, 0.0], np.float32),
         "dominant": np.array([40.0, 30.0, -2.0, 60.0], np.float32)}  # above every score: keys get little weight


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("window,split", [(0, 1), (0, 5), (0, 64), (7, 3), (30, 4)])
def test_split_k_parts_merge_to_attention_with_sinks(sinks, window, split):
    """attention.cu's CTAs each write (sum p v, max, sum p) of their run of keys and the merge adds the
    head's sink to the denominator once (reference.attention_partials / attention_merge); with parts past
    the context (empty: max -inf, sum 0) as a captured graph's grid has them."""
    rng = np.random.default_rng(3)
    pos = 45
    keys, values = _kv(rng, pos + 1)
    q = rng.normal(0, 1, (4, 16)).astype(np.float32)
    acc, m, lsum = reference.attention_partials(q, keys, values, pos, window=window, scale=0.3, split=split)
    empty = 2  # parts of a grid sized for a longer context
    acc = np.concatenate([acc, np.zeros((empty, *acc.shape[1:]), np.float32)])
    m = np.concatenate([m, np.full((empty, 4), -np.inf, np.float32)])
    lsum = np.concatenate([lsum, np.zeros((empty, 4), np.float32)])
    got = reference.attention_merge(acc, m, lsum, SINKS[sinks])
    want = reference.attention(q[None], keys, values, np.array([pos]), window=window, scale=0.3, sinks=SINKS[sinks])
    np.testing.assert_allclose(got, want[0], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("window,tile", [(0, 64), (0, 16), (16, 32), (100, 64)])
def test_flash_online_softmax_with_sinks_is_attention(sinks, window, tile):
    """flash.cu's rows: keys tile by tile in log2 units, a running max rescaling the sums, the sink (times
    log2 e) joining each row's denominator at the end (reference.flash_rows)."""
    rng = np.random.default_rng(4)
    keys, values = _kv(rng, 200)
    pos = np.arange(130, 194)  # a tile of 64 query rows, as flash_tiles cuts a chunk
    q = rng.normal(0, 1, (len(pos), 4, 16)).astype(np.float32)
    got = reference.flash_rows(q, keys, values, pos, window=window, scale=0.25, tile=tile, sinks=SINKS[sinks])
    want = reference.attention(q, keys, values, pos, window=window, scale=0.25, sinks=SINKS[sinks])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def _uploaded(model):
    """The CUDA backend's weights of `model` as upload_weights leaves them (fake device arrays holding
    what was uploaded)."""
    from cuda_recorder import FakeDevice

    from ember.worker.backends.cuda.layers import upload_weights

    return upload_weights(FakeDevice(), model.gguf, model.config, stack=True)


def test_yarn_scale_and_frequencies_on_the_device_are_numpys(models):
    """The device gets numpy's YaRN frequencies (float32) and its cos/sin scale (> 1 for gpt-oss); the
    kernels' rope_table (cos in double times the float32 scale, rounded) is numpy's rope_tables to an ulp."""
    from ember.worker.model.rope import inv_frequencies

    model = models("gpt-oss")
    w = _uploaded(model)
    inv_g, inv_l, mscale = inv_frequencies(model.config)
    assert mscale > 1.0 and w.rope_mscale == mscale
    np.testing.assert_array_equal(w.inv_freq_global.data, inv_g.astype(np.float32))
    np.testing.assert_array_equal(w.inv_freq_local.data, inv_l.astype(np.float32))  # gpt-oss: YaRN on both
    pos = np.arange(0, 131072, 997)
    inv = w.inv_freq_global.data.astype(np.float64)
    angles = pos[:, None].astype(np.float64) * inv[None, :]
    ms = float(np.float32(w.rope_mscale))  # the kernel's argument is a float
    device = (np.cos(angles) * ms).astype(np.float32), (np.sin(angles) * ms).astype(np.float32)
    twin = reference.rope_tables(pos, inv, mscale)
    for a, b in zip(device, twin, strict=True):
        assert np.max(np.abs(a.view(np.int32) - b.view(np.int32))) <= 1  # ulps


def _rows(em) -> np.ndarray:
    """An ExpertMatrices' rows as float32, decoded from the bytes the device holds (padded rows)."""
    m = em.m
    natural = quants.row_nbytes(GGMLQuantizationType[m.type.upper()], m.cols)
    raw = np.ascontiguousarray(m.data.data.reshape(m.rows, m.row_bytes)[:, :natural]).reshape(-1)
    return quants.dequantize(raw, GGMLQuantizationType[m.type.upper()], (m.rows, m.cols))


def test_expert_biases_as_the_device_holds_them(models, monkeypatch, tmp_path):
    """A mirror of the MoE kernels' indexing over the uploaded layout -- moe_route's softmax over the top k of
    the router's logits plus its bias, qmoeg's stacked [gate; up] rows of expert e with the biases at
    bias + e * rows (gate row j: [j], its up row: [ffn + j]), swiglu_oai, the down rows' biases, the weighted
    sum -- equals the numpy backend's reference.moe_mlp on its own weights."""
    from ember.worker.model.weights import load_weights

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = models("gpt-oss")
    cfg, k = model.config, model.config.n_experts_used
    w = _uploaded(model)
    nw = load_weights(model.gguf, cfg)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (6, cfg.hidden)).astype(np.float32)
    for lw, lnw in zip(w.layers, nw.layers, strict=True):
        mw = lw.moe
        assert mw is not None and mw.gate_up is not None and mw.router_bias is not None
        E, ffn, hidden = mw.experts, mw.ffn, cfg.hidden
        assert mw.gate_up.m.type == mw.down.m.type == "mxfp4"
        router = _rows(dataclasses.replace(mw.down, m=mw.router, experts=1))
        logits = x @ router.T + mw.router_bias.data
        gu, gub = _rows(mw.gate_up), mw.gate_up.bias.data
        down, db = _rows(mw.down), mw.down.bias.data
        out = np.zeros((len(x), hidden), np.float32)
        for t in range(len(x)):
            top = np.argsort(-logits[t], kind="stable")[:k]
            wts = reference.softmax(logits[t, top])
            for e, we in zip(top, wts, strict=True):
                rows = 2 * ffn
                pre = gu[e * rows:(e + 1) * rows] @ x[t] + gub[e * rows:(e + 1) * rows]
                h = reference.gated(pre[:ffn], pre[ffn:], cfg.recipe.act)
                out[t] += we * (down[e * hidden:(e + 1) * hidden] @ h + db[e * hidden:(e + 1) * hidden])
        want = reference.moe_mlp(x, lnw.router, lnw.gate_exps, lnw.up_exps, lnw.down_exps, k=k, act=cfg.recipe.act,
                                 gating="softmax-topk", norm_topk=False,
                                 biases=(lnw.router_b, lnw.gate_exps_b, lnw.up_exps_b, lnw.down_exps_b))
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        assert cfg.n_experts == E


# -- the forward pass's kernels ------------------------------------------------------------------------------


def _names(calls: list[str]) -> list[str]:
    return [c.split("(")[0] for c in calls]


GPT_OSS_DECODE_LAYER = ["matvec", "add_bias", "attention", "matvec", "add_bias", "rms_norm", "moe_mlp"]
GPT_OSS_PREFILL_LAYER = ["linear_tc", "add_bias", "qk_rope_kv", "flash_attention", "linear_tc", "add_bias", "rms_norm",
                         "moe_mlp"]


def test_gpt_oss_layers_issue_their_kernels(models, monkeypatch):
    """Layer 0 slides (window 16), layer 1 attends to everything; both take the head's sinks, YaRN's scale
    (in the fused decode prologue, and in qk_rope_kv before flash attention), the q/k/v biases on the
    stacked q|k|v rows (one add), the output bias into the residual, and the mixture of experts with its
    router bias, softmax over the top k and the clamped SwiGLU. A decode step is one captured graph of these."""
    model = models("gpt-oss")
    cfg = model.config
    f, rec, inputs = forward_for(model, monkeypatch)
    logs = step_cases(f, inputs, rec)
    decode, prefill = logs["decode-graph-1"], logs["prefill-flash"]
    assert _names(decode) == ["embed", *GPT_OSS_DECODE_LAYER, "rms_norm", *GPT_OSS_DECODE_LAYER, "rms_norm", "matvec",
                              "sample"]
    assert _names(prefill) == ["embed", *GPT_OSS_PREFILL_LAYER, "rms_norm", *GPT_OSS_PREFILL_LAYER, "gather_rows",
                               "rms_norm", "matvec"]
    ms = f"mscale={float(np.float32(f.w.rope_mscale))!r}"
    attn = [c for c in decode if c.startswith("attention(")]
    flash = [c for c in prefill if c.startswith("flash_attention(")]
    rope = [c for c in prefill if c.startswith("qk_rope_kv(")]
    for li, lw in enumerate(f.w.layers):
        window = cfg.sliding_window if li == 0 else 0
        assert cfg.is_local_layer(li) == (li == 0)
        assert f"window={window}," in attn[li] and f"window={window}," in flash[li]
        assert f"max_keys={16 if window else 64}," in attn[li]
        assert f"sinks={lw.sinks!r}" in attn[li] and f"sinks={lw.sinks!r}" in flash[li]
        assert ms in attn[li] and ms in rope[li]
        inv = f.w.inv_freq_local if li == 0 else f.w.inv_freq_global
        assert f"inv_freq={inv!r}" in attn[li]
    moe = [c for c in decode if c.startswith("moe_mlp(")]
    assert all("act=<Act.SWIGLU_OAI: 'swiglu_oai'>" in c and "gating='softmax-topk'" in c and "norm_topk=False" in c
               and "router_bias=w" in c for c in moe)
    biases = [c for c in decode if c.startswith("add_bias(")]
    qkv_width = cfg.q_dim + 2 * cfg.kv_dim
    assert [b.split(", ")[2] for b in biases] == [repr(a) for lw in f.w.layers for a in (lw.bqkv, lw.bo)]
    assert all(f"cols={qkv_width}, ldy={qkv_width}" in b for b in biases[::2])  # over the whole q|k|v rows
    assert all(f"cols={cfg.hidden}, stream" in b for b in biases[1::2])  # into the residual


# Each existing family's kernel calls (every argument), over every combination of the switches (stacking,
# tensor cores, int8 matvecs, device attention) and the step kinds of cuda_recorder.step_cases, as the code
# before gpt-oss landed made them (the new launcher arguments left out where they hold their defaults: no
# sinks, no YaRN scale, no expert biases), but for qwen2's stacked q|k|v rows, whose three biases are now
# one add (one launch instead of three; every other call the same), and for the batch-1 MoE path's scratch
# counter and int8 switch (MoeScratch.done and moe_mlp's int8, the backend's int8_activations: the same calls,
# the buffers after the scratch one number on). A change to
# one family's path that moves another's shows here; when a change is meant to, print the new digests with
# `_digest` and say why in the commit.
UNCHANGED = {("llama", "tiny"): "31014b5a43df96f2", ("qwen2", "tiny"): "ccf83a8468ec881f",
             ("qwen3", "tiny"): "a36d3c533099cc0b", ("gemma3", "tiny"): "d63cac0c2b7892c0",
             ("qwen3moe", "tiny"): "2799f0bac268d5fc", ("qwen3moe", "tiny-lowbit"): "45837d059b01b12f"}
NEW_DEFAULTS = {"sinks": None, "mscale": 1.0, "bias": None}


def _digest(model, arch: str, shape: str) -> tuple[str, int]:
    h, calls = hashlib.sha256(), 0
    logs = {}
    for stack, tc, i8, da in itertools.product((True, False), repeat=4):
        with pytest.MonkeyPatch.context() as mp:
            f, rec, inputs = forward_for(model, mp, stack=stack, tensor_cores=tc, int8=i8, device_attention=da,
                                         drop_defaults=NEW_DEFAULTS)
            for case, log in step_cases(f, inputs, rec).items():
                logs[f"{arch}/{shape}/stack={stack}/tc={tc}/int8={i8}/dev_attn={da}/{case}"] = log
    for key, log in sorted(logs.items()):
        h.update(key.encode())
        h.update("\n".join(log).encode())
        calls += len(log)
    return h.hexdigest()[:16], calls


@pytest.mark.parametrize("arch,shape", list(UNCHANGED), ids=[f"{a}-{s}" for a, s in UNCHANGED])
def test_existing_families_issue_the_kernels_they_did(models, arch, shape):
    digest, calls = _digest(models(arch, shape), arch, shape)
    assert calls > 1000
    assert digest == UNCHANGED[arch, shape], f"{arch}/{shape}: the forward pass's kernel calls changed"


# -- the table -------------------------------------------------------------------------------------------------


def test_the_cuda_backend_takes_gpt_oss(models):
    from ember.worker.backends.cuda.layers import check_runs

    model = models("gpt-oss")
    check_runs(model.gguf, model.config)


def _rows_off():
    from ember.worker.backends.cuda.support import RUNS

    off = {"attn_sinks": False, "attn_bias": False, "attn_out_bias": False, "yarn": False, "moe_biases": False,
           "acts": frozenset(), "gatings": frozenset(), "max_experts": 4, "max_top_k": 1,
           "sliding_window": False, "ropes": frozenset(), "norms": frozenset(), "stacks": frozenset()}
    assert set(off) | {"qk_norm", "moe_post_norms"} == {f.name for f in dataclasses.fields(RUNS)}
    return off


WORDS = {"attn_sinks": "attention sinks", "attn_bias": "q/k/v biases", "attn_out_bias": "output biases",
         "yarn": "YaRN RoPE", "moe_biases": "biases", "acts": "swiglu_oai experts", "gatings": "softmax-topk gating",
         "max_experts": "2 of 8 experts", "max_top_k": "2 of 8 experts", "sliding_window": "sliding windows",
         "ropes": "neox RoPE", "norms": "pre norms", "stacks": "does not run gpt-oss"}


@pytest.mark.parametrize("row", list(WORDS))
def test_each_row_of_the_table_is_what_check_runs_reads(models, row):
    """Turned off, every row the gpt-oss recipe needs refuses it in one line that names what is missing."""
    from ember.worker.backends.cuda import support

    model = models("gpt-oss")
    assert support.refusal(model.config) is None
    runs = dataclasses.replace(support.RUNS, **{row: _rows_off()[row]})
    why = support.refusal(model.config, runs)
    assert why is not None and WORDS[row] in why and "--backend numpy runs" in why and "\n" not in why


def test_what_the_table_lacks_is_refused_in_one_line(models, monkeypatch):
    """DeepSeek V4's stack, and a post-norm layer with experts (no family has one: forward.py's MoE path
    adds into the residual), are refused through the table, in one line."""
    from ember.worker.backends.cuda import layers, support

    ds = models("deepseek4")
    with pytest.raises(ModelFileError, match=r"does not run deepseek4 \(hyper-connections") as e:
        layers.check_runs(ds.gguf, ds.config)
    assert "\n" not in str(e.value)
    moe = models("qwen3moe")
    recipe = dataclasses.replace(moe.config.recipe, norms=support.Norms.PRE_AND_POST)
    cfg = dataclasses.replace(moe.config.family, recipe=recipe)
    import msgspec

    why = support.refusal(msgspec.structs.replace(moe.config, family=cfg))
    assert why is not None and "post-norms" in why and "\n" not in why
    g = GGUFFile(moe.gguf.path)
    monkeypatch.setattr(support, "RUNS", dataclasses.replace(support.RUNS, gatings=frozenset()))
    with pytest.raises(ModelFileError, match="softmax gating"):
        layers.check_runs(g, moe.config)
