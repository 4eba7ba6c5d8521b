"""The shapes `ember bench make-model` knows, and the tensor table (names, shapes, quantization
types) it writes for each: llama.cpp's Q4_K_M type choice (llama-quant.cpp), or a table read from a
real file. Only data and pure functions; the tokenizer and the weights are synth_vocab and
synth_tensors, the file itself synth."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss", "deepseek4")


class SynthError(ValueError):
    """A bad request (unknown arch or shape, unusable output path); str() is one line."""


@dataclass(frozen=True)
class Dsv4Shape:
    """DeepSeek V4's settings beyond a transformer's (llama.cpp's deepseek4 keys): low-rank q and grouped
    low-rank output projections, one KV head that is both key and value, per-layer attention kinds by
    compress ratio (0 sliding window only, 4 CSA with the lightning indexer, 128 HCA), hash-routed first
    layers, a shared expert and hyper-connections."""

    q_lora_rank: int
    n_rot: int  # the RoPE part at the end of each head
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]  # one a layer
    compress_rope_base: float
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    hash_layers: int  # the first layers route by token id (ffn_gate_tid2eid)
    n_shared: int = 1
    expert_weights_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # next-token (MTP) layers after the trunk (DeepSeek V4 ships one): blocks n_layer.., each a window-only
    # layer with a learned router plus the nextn tensors
    nextn_layers: int = 1
    dspark: DSparkShape | None = None  # the DSpark block drafter written beside it (make-model --dspark-out)


@dataclass(frozen=True)
class DSparkShape:
    """DeepSeek V4's DSpark block drafter, as llama.cpp's converter writes it (conversion/deepseek.py,
    DeepseekV4DSparkModel: architecture `dflash`): `stages` window-only DeepSeek V4 blocks with learned
    routing over the trunk's token embeddings and output projection, fed the trunk's layer inputs at
    `target_layers` (the mean of the hyper-connection streams entering each, GGUF ids: HF's + 1) through
    `fc`; a Markov head of rank `markov_rank` biasing each slot's logits by the previous slot's token, and a
    confidence head. A draft is `block_size` slots at most."""

    stages: int
    block_size: int
    markov_rank: int
    target_layers: tuple[int, ...]


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rope_base: float
    rms_eps: float
    # "spm-llama" | "spm-gemma" | "bpe-qwen2" | "bpe-qwen3" | "bpe-llama3" | "bpe-gpt-oss" | "bpe-deepseek4"
    tokenizer: str
    tied: bool  # no output.weight: logits through token_embd
    sliding_window: int = 0  # gemma3: local attention window (5 local : 1 global layers)
    rope_base_swa: float | None = None  # gemma3: rope base of the local layers, written when set
    rope_scaling_linear: float | None = None  # linear rope scaling factor (gemma3 4B+)
    rope_yarn: tuple[float, int] | None = None  # YaRN: (factor, original context) (gpt-oss)
    n_expert: int = 0  # mixture of experts (qwen3moe, gpt-oss): experts per layer, each with n_ff_exp
    n_expert_used: int = 0
    n_ff_exp: int = 0
    mix: str = "q4_k_m"
    dsv4: Dsv4Shape | None = None  # deepseek4's own settings
    size_label: str = ""
    description: str = ""
    real: bool = False  # the shape of a released model (multi-GB file)
    # fixed per-tensor types (name -> type per layer) instead of the mix rule; see _GEMMA3_270M_TYPES
    type_table: dict[str, tuple[str, ...]] | None = field(default=None, repr=False, compare=False, hash=False)


# The tensor types of /work/models/gemma-3-270m-q4_k_m.gguf (read once from the file; the test
# checks that this table, the Q4_K_M rule and the file agree). Per-layer entries list layers 0..17.
_M, _L = "Q8_0", "Q5_0"  # attn_v: more bits (Q6_K -> Q8_0 fallback) / plain (Q4_K -> Q5_0 fallback)
_GEMMA3_270M_TYPES: dict[str, tuple[str, ...]] = {
    "output_norm.weight": ("F32",),
    "token_embd.weight": ("Q8_0",),
    "attn_k.weight": ("Q5_0",) * 18,
    "attn_k_norm.weight": ("F32",) * 18,
    "attn_norm.weight": ("F32",) * 18,
    "attn_output.weight": ("Q4_K",) * 18,
    "attn_q.weight": ("Q5_0",) * 18,
    "attn_q_norm.weight": ("F32",) * 18,
    "attn_v.weight": (_M, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _M, _M, _M),
    "ffn_down.weight": tuple("Q6_K" if t == _M else "Q4_K" for t in
                             (_M, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _M, _M, _M)),
    "ffn_gate.weight": ("Q5_0",) * 18,
    "ffn_norm.weight": ("F32",) * 18,
    "ffn_up.weight": ("Q5_0",) * 18,
    "post_attention_norm.weight": ("F32",) * 18,
    "post_ffw_norm.weight": ("F32",) * 18,
}
del _M, _L

# Every low-bit type ember reads, once each over two layers (layer 0, layer 1), in a tiny MoE model
# whose rows are 256 long so the K- and i-quants fit: the oracle test checks them all through llama.cpp
_F32 = ("F32", "F32")
_LOWBIT_TYPES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("Q4_1",), "output.weight": ("Q5_1",), "output_norm.weight": ("F32",),
    "attn_norm.weight": _F32, "attn_q_norm.weight": _F32, "attn_k_norm.weight": _F32, "ffn_norm.weight": _F32,
    "ffn_gate_inp.weight": _F32,
    "attn_q.weight": ("IQ3_S", "IQ4_XS"), "attn_k.weight": ("IQ4_NL", "Q3_K"), "attn_v.weight": ("Q3_K", "IQ4_NL"),
    "attn_output.weight": ("IQ4_XS", "IQ3_S"), "ffn_gate_exps.weight": ("IQ2_XXS", "MXFP4"),
    "ffn_up_exps.weight": ("IQ2_XS", "IQ3_XXS"), "ffn_down_exps.weight": ("Q2_K", "IQ2_S"),
}
del _F32

SHAPES: dict[str, ShapeSpec] = {
    s.name: s
    for s in [
        ShapeSpec("tiny-llama", "llama", n_vocab=512, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff=256, n_ctx=2048, rope_base=10000.0, rms_eps=1e-5, tokenizer="spm-llama", tied=False,
                  description="tiny llama test model, SentencePiece vocab, untied output"),
        ShapeSpec("tiny-qwen2", "qwen2", n_vocab=768, n_embd=128, n_layer=3, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff=512, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen2", tied=False,
                  description="tiny qwen2 test model, byte-level BPE vocab, qkv biases"),
        ShapeSpec("tiny-qwen3", "qwen3", n_vocab=1000, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=64,
                  n_ff=384, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen3", tied=True,
                  description="tiny qwen3 test model, q/k norms, head_dim*heads != hidden, tied embeddings"),
        ShapeSpec("tiny-gemma3", "gemma3", n_vocab=640, n_embd=128, n_layer=6, n_head=4, n_head_kv=1, head_dim=64,
                  n_ff=512, n_ctx=2048, rope_base=1000000.0, rms_eps=1e-6, tokenizer="spm-gemma", tied=True,
                  sliding_window=8, rope_base_swa=10000.0,
                  description="tiny gemma3 test model, 5 local (window 8) : 1 global layers"),
        ShapeSpec("tiny-qwen3moe", "qwen3moe", n_vocab=1000, n_embd=128, n_layer=2, n_head=4, n_head_kv=2,
                  head_dim=64, n_ff=384, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen3",
                  tied=False, n_expert=16, n_expert_used=4, n_ff_exp=64,
                  description="tiny qwen3moe test model, 16 experts (4 per token), q/k norms"),
        ShapeSpec("tiny-lowbit-qwen3moe", "qwen3moe", n_vocab=1000, n_embd=256, n_layer=2, n_head=4, n_head_kv=2,
                  head_dim=64, n_ff=512, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen3",
                  tied=False, n_expert=16, n_expert_used=4, n_ff_exp=256, type_table=_LOWBIT_TYPES,
                  description="tiny qwen3moe test model in every 2-5-bit type ember reads (Q2_K .. MXFP4)"),
        ShapeSpec("tiny-gpt-oss", "gpt-oss", n_vocab=768, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=64,
                  n_ff=128, n_ctx=131072, rope_base=150000.0, rms_eps=1e-5, tokenizer="bpe-gpt-oss", tied=False,
                  sliding_window=16, rope_yarn=(32.0, 4096), n_expert=8, n_expert_used=2, n_ff_exp=128,
                  mix="mxfp4", description="tiny gpt-oss test model: MXFP4 experts with biases, sinks, "
                  "window 16 on even layers, YaRN"),
        ShapeSpec("tiny-deepseek4", "deepseek4", n_vocab=768, n_embd=128, n_layer=4, n_head=4, n_head_kv=1,
                  head_dim=64, n_ff=0, n_ctx=4096, rope_base=10000.0, rms_eps=1e-6, tokenizer="bpe-deepseek4",
                  tied=False, sliding_window=16, n_expert=8, n_expert_used=2, n_ff_exp=64, mix="q8_0",
                  rope_yarn=(16.0, 256),  # V4-Flash's factor, its original context scaled down: prompts pass it
                  dsv4=Dsv4Shape(q_lora_rank=64, n_rot=16, o_groups=2, o_lora_rank=32,
                                 compress_ratios=(0, 4, 128, 4), compress_rope_base=160000.0, indexer_heads=8,
                                 indexer_dim=64, indexer_top_k=8, hash_layers=2,
                                 dspark=DSparkShape(stages=2, block_size=4, markov_rank=16, target_layers=(2, 3, 4))),
                  description="tiny deepseek4 test model: window 16, a sliding-window, two CSA (indexer: 8 heads, "
                  "top 8) and an HCA layer, two hash-routed layers, 8 experts (2 per token) and a shared one, "
                  "4 hyper-connection streams, YaRN on the compressed layers"),
        # DeepSeek-V4-Flash (its config.json, as llama.cpp's converter maps it): the first 8 of its 43 layers,
        # which hold every kind (window-only, CSA, HCA; hash routing in 0-2, learned after) and the MTP layer,
        # in the users' quant mix: IQ2_XXS gate/up experts, Q2_K down experts, Q8_0 for the rest
        ShapeSpec("deepseek-v4-flash-L8", "deepseek4", n_vocab=129280, n_embd=4096, n_layer=8, n_head=64,
                  n_head_kv=1, head_dim=512, n_ff=0, n_ctx=1048576, rope_base=10000.0, rms_eps=1e-6,
                  tokenizer="bpe-deepseek4", tied=False, sliding_window=128, n_expert=256, n_expert_used=6,
                  n_ff_exp=2048, mix="ds4-flash", rope_yarn=(16.0, 65536),
                  dsv4=Dsv4Shape(q_lora_rank=1024, n_rot=64, o_groups=8, o_lora_rank=1024,
                                 compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), compress_rope_base=160000.0,
                                 indexer_heads=64, indexer_dim=128, indexer_top_k=512, hash_layers=3,
                                 # V4-Flash-DSpark's as reported (3 stages, blocks of 5, rank 256, the last
                                 # three layers' inputs; not checked against its config), over the L8's last three
                                 dspark=DSparkShape(stages=3, block_size=5, markov_rank=256,
                                                    target_layers=(6, 7, 8))),
                  size_label="284B-A13B", real=True,
                  description="DeepSeek-V4-Flash's first 8 of 43 layers and its MTP layer: IQ2_XXS gate/up and "
                  "Q2_K down experts (256, 6 per token, and a shared one), Q8_0 elsewhere"),
        ShapeSpec("gemma3-270m", "gemma3", n_vocab=262144, n_embd=640, n_layer=18, n_head=4, n_head_kv=1,
                  head_dim=256, n_ff=2048, n_ctx=32768, rope_base=1000000.0, rms_eps=1e-6, tokenizer="spm-gemma",
                  tied=True, sliding_window=512, size_label="270M", real=True, type_table=_GEMMA3_270M_TYPES,
                  description="Gemma 3 270M, the embedded Q4_K_M file's tensor table"),
        ShapeSpec("gemma3-4b", "gemma3", n_vocab=262208, n_embd=2560, n_layer=34, n_head=8, n_head_kv=4,
                  head_dim=256, n_ff=10240, n_ctx=131072, rope_base=1000000.0, rms_eps=1e-6,
                  tokenizer="spm-gemma", tied=True, sliding_window=1024, rope_base_swa=10000.0,
                  rope_scaling_linear=8.0, size_label="4B", real=True,
                  description="Gemma 3 4B (text part), Q4_K_M"),
        ShapeSpec("llama-8b", "llama", n_vocab=128256, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8,
                  head_dim=128, n_ff=14336, n_ctx=8192, rope_base=500000.0, rms_eps=1e-5, tokenizer="bpe-llama3",
                  tied=False, size_label="8B", real=True, description="Llama 3 8B, Q4_K_M, Llama 3 BPE vocab"),
        ShapeSpec("qwen3-30b-a3b", "qwen3moe", n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4,
                  head_dim=128, n_ff=6144, n_ctx=262144, rope_base=10000000.0, rms_eps=1e-6,
                  tokenizer="bpe-qwen3", tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768,
                  size_label="30B-A3B", real=True,
                  description="Qwen3-Coder-30B-A3B, Q4_K_M (128 experts, 8 per token)"),
        ShapeSpec("qwen3-30b-a3b-q2", "qwen3moe", n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4,
                  head_dim=128, n_ff=6144, n_ctx=262144, rope_base=10000000.0, rms_eps=1e-6,
                  tokenizer="bpe-qwen3", tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768,
                  mix="q2-dynamic", size_label="30B-A3B", real=True,
                  description="Qwen3-Coder-30B-A3B in a 2-3-bit dynamic mix: IQ2_XXS gate/up and Q2_K down "
                              "experts, IQ3_XXS and Q3_K on llama.cpp's use_more_bits layers, Q4_K_M elsewhere"),
        ShapeSpec("gpt-oss-20b", "gpt-oss", n_vocab=201088, n_embd=2880, n_layer=24, n_head=64, n_head_kv=8,
                  head_dim=64, n_ff=2880, n_ctx=131072, rope_base=150000.0, rms_eps=1e-5, tokenizer="bpe-gpt-oss",
                  tied=False, sliding_window=128, rope_yarn=(32.0, 4096), n_expert=32, n_expert_used=4,
                  n_ff_exp=2880, mix="mxfp4", size_label="20B", real=True,
                  description="gpt-oss-20b: MXFP4 experts (32, 4 per token), Q8_0 elsewhere"),
    ]
}


def resolve_shape(arch: str, shape: str) -> ShapeSpec:
    """The ShapeSpec for `--arch arch --shape shape`; `tiny` means `tiny-<arch>`."""
    if arch not in ARCHS:
        raise SynthError(f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
    spec = SHAPES.get(shape) or SHAPES.get(f"{shape}-{arch}")
    if spec is None:
        known = sorted({"tiny"} | {n for n in SHAPES if not n.startswith("tiny-")})
        raise SynthError(f"unknown shape {shape!r} (known: {', '.join(known)})")
    if spec.arch != arch:
        raise SynthError(f"shape {spec.name} is a {spec.arch} shape, not {arch}")
    return spec


# -- the tensor plan ------------------------------------------------------------------------------


class PlannedTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml order (shape[0] is the row length), as GGUFFile's TensorInfo
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    # llama-quant.cpp
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _q2_dynamic_expert_type(name: str, i_layer: int, n_layer: int) -> GGMLQuantizationType:
    """A 2-3-bit MoE quant's expert types, as the users' dynamic quants are made: 2-bit i-quant gate/up and
    Q2_K down, a bit more (IQ3_XXS, Q3_K) on the layers llama.cpp gives more bits (use_more_bits)."""
    more = _use_more_bits(i_layer, n_layer)
    if name.startswith("ffn_down"):
        return T.Q3_K if more else T.Q2_K
    return T.IQ3_XXS if more else T.IQ2_XXS


def q4_k_m_type(kind: str, i_layer: int, n_layer: int, row_len: int, tied: bool) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M choice for a 2-D weight (kind: token_embd, output, attn_v, ffn_down, ...)."""
    kind = kind.removesuffix("_exps")  # llama.cpp matches "ffn_down" in ffn_down_exps too
    more_bits = kind in ("attn_v", "ffn_down") and _use_more_bits(i_layer, n_layer)
    t = T.Q6_K if kind == "output" or (kind == "token_embd" and tied) or more_bits else T.Q4_K
    if row_len % GGML_QUANT_SIZES[t][0]:
        t = _FALLBACK[t]
        if row_len % GGML_QUANT_SIZES[t][0]:
            t = T.F16
    return t


def _tensor_shapes(s: ShapeSpec) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """(global tensors, per-layer tensors) as (name, ggml shape); layer names without 'blk.N.'."""
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    glob = [("token_embd.weight", (s.n_embd, s.n_vocab)), ("output_norm.weight", (s.n_embd,))]
    if not s.tied:
        glob.append(("output.weight", (s.n_embd, s.n_vocab)))
    ffn_norm = "post_attention_norm.weight" if s.arch == "gpt-oss" else "ffn_norm.weight"
    layer = [
        ("attn_norm.weight", (s.n_embd,)),
        ("attn_q.weight", (s.n_embd, q_dim)),
        ("attn_k.weight", (s.n_embd, kv_dim)),
        ("attn_v.weight", (s.n_embd, kv_dim)),
        ("attn_output.weight", (q_dim, s.n_embd)),
        (ffn_norm, (s.n_embd,)),
    ]
    if s.n_expert:  # ggml order: [hidden, experts] for the router, [in, out, experts] for the experts
        layer += [
            ("ffn_gate_inp.weight", (s.n_embd, s.n_expert)),
            ("ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert)),
            ("ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert)),
            ("ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert)),
        ]
    else:
        layer += [
            ("ffn_gate.weight", (s.n_embd, s.n_ff)),
            ("ffn_up.weight", (s.n_embd, s.n_ff)),
            ("ffn_down.weight", (s.n_ff, s.n_embd)),
        ]
    if s.arch in ("qwen2", "gpt-oss"):
        layer += [("attn_q.bias", (q_dim,)), ("attn_k.bias", (kv_dim,)), ("attn_v.bias", (kv_dim,))]
    if s.arch == "gpt-oss":
        layer += [("attn_output.bias", (s.n_embd,)), ("attn_sinks.weight", (s.n_head,)),
                  ("ffn_gate_inp.bias", (s.n_expert,)), ("ffn_gate_exps.bias", (s.n_ff_exp, s.n_expert)),
                  ("ffn_up_exps.bias", (s.n_ff_exp, s.n_expert)), ("ffn_down_exps.bias", (s.n_embd, s.n_expert))]
    if s.arch in ("qwen3", "gemma3", "qwen3moe"):
        layer += [("attn_q_norm.weight", (s.head_dim,)), ("attn_k_norm.weight", (s.head_dim,))]
    if s.arch == "gemma3":
        layer += [("post_attention_norm.weight", (s.n_embd,)), ("post_ffw_norm.weight", (s.n_embd,))]
    return glob, layer


def _dsv4_tensor_shapes(s: ShapeSpec) -> tuple[list[tuple[str, tuple[int, ...]]],
                                                 list[list[tuple[str, tuple[int, ...]]]]]:
    """(global tensors, each layer's tensors) of a deepseek4 shape, as llama.cpp's loader creates them:
    a layer's compressor and indexer tensors follow its compress ratio, its router its hash routing. The
    next-token (MTP) layers come after the trunk's: a window-only layer's attention (ratio 0: llama.cpp's
    MTP graph attends over a plain windowed cache), a learned router's MoE (its graph routes by the
    router alone), and the nextn tensors: eh_proj over each stream's [embedding, h], enorm, hnorm and
    shared_head_norm (DeepSeek V4's converter writes no nextn.embed_tokens or shared_head_head: the
    trunk's serve)."""
    d = s.dsv4
    assert d is not None
    e, hd, hc = s.n_embd, s.head_dim, d.hc_mult
    hc_dim, hc_mix = hc * e, (2 + hc) * hc
    glob = [("token_embd.weight", (e, s.n_vocab)), ("output_norm.weight", (e,)), ("output.weight", (e, s.n_vocab)),
            ("output_hc_fn.weight", (hc_dim, hc)), ("output_hc_base.weight", (hc,)), ("output_hc_scale.weight", (1,))]
    nextn = [("nextn.eh_proj.weight", (2 * e, e)), ("nextn.enorm.weight", (e,)), ("nextn.hnorm.weight", (e,)),
             ("nextn.shared_head_norm.weight", (e,))]
    layers = []
    for il, ratio in enumerate([*d.compress_ratios, *[0] * d.nextn_layers]):
        t = [
            ("attn_norm.weight", (e,)), ("attn_sinks.weight", (s.n_head,)),
            ("attn_q_a.weight", (e, d.q_lora_rank)), ("attn_q_a_norm.weight", (d.q_lora_rank,)),
            ("attn_q_b.weight", (d.q_lora_rank, s.n_head * hd)),
            ("attn_kv.weight", (e, hd)), ("attn_kv_a_norm.weight", (hd,)),
            # the file's shape; llama.cpp reads it as [heads * head_dim / groups, rank, groups]
            ("attn_output_a.weight", (s.n_head * hd // d.o_groups, d.o_lora_rank * d.o_groups)),
            ("attn_output_b.weight", (d.o_groups * d.o_lora_rank, e)),
            ("hc_attn_fn.weight", (hc_dim, hc_mix)), ("hc_attn_base.weight", (hc_mix,)), ("hc_attn_scale.weight", (3,)),
            ("hc_ffn_fn.weight", (hc_dim, hc_mix)), ("hc_ffn_base.weight", (hc_mix,)), ("hc_ffn_scale.weight", (3,)),
            ("ffn_norm.weight", (e,)), ("ffn_gate_inp.weight", (e, s.n_expert)),
            ("ffn_gate_exps.weight", (e, s.n_ff_exp, s.n_expert)), ("ffn_up_exps.weight", (e, s.n_ff_exp, s.n_expert)),
            ("ffn_down_exps.weight", (s.n_ff_exp, e, s.n_expert)),
            ("ffn_gate_shexp.weight", (e, s.n_ff_exp * d.n_shared)),
            ("ffn_up_shexp.weight", (e, s.n_ff_exp * d.n_shared)),
            ("ffn_down_shexp.weight", (s.n_ff_exp * d.n_shared, e)),
        ]
        if il < d.hash_layers:
            t.append(("ffn_gate_tid2eid.weight", (s.n_expert_used, s.n_vocab)))
        else:
            t.append(("exp_probs_b.bias", (s.n_expert,)))
        if il >= len(d.compress_ratios):
            t += nextn
        if ratio:
            coff = 2 if ratio == 4 else 1  # CSA's blocks overlap: two halves of every state row
            t += [("attn_compressor_kv.weight", (e, coff * hd)), ("attn_compressor_gate.weight", (e, coff * hd)),
                  ("attn_compressor_ape.weight", (coff * hd, ratio)), ("attn_compressor_norm.weight", (hd,))]
        if ratio == 4:
            t += [("indexer.proj.weight", (e, d.indexer_heads)),
                  ("indexer.attn_q_b.weight", (d.q_lora_rank, d.indexer_heads * d.indexer_dim)),
                  ("indexer_compressor_kv.weight", (e, 2 * d.indexer_dim)),
                  ("indexer_compressor_gate.weight", (e, 2 * d.indexer_dim)),
                  ("indexer_compressor_ape.weight", (2 * d.indexer_dim, ratio)),
                  ("indexer_compressor_norm.weight", (d.indexer_dim,))]
        elif ratio not in (0, 128):
            raise SynthError(f"deepseek4 compress ratios are 0, 4 or 128, not {ratio}")
        layers.append(t)
    return glob, layers


# deepseek4's float tables: the hyper-connection mixers, the compressors' position biases, the router
_F32_TABLES = ("hc_attn_fn.weight", "hc_ffn_fn.weight", "output_hc_fn.weight", "attn_compressor_ape.weight",
               "indexer_compressor_ape.weight", "ffn_gate_inp.weight")


# the routed experts of the users' DeepSeek-V4-Flash files (about 81 GiB whole): 2-bit i-quant gate/up, Q2_K down
_DS4_FLASH_EXPERTS = {"ffn_gate_exps.weight": T.IQ2_XXS, "ffn_up_exps.weight": T.IQ2_XXS,
                      "ffn_down_exps.weight": T.Q2_K}


def plan_dspark(s: ShapeSpec) -> list[PlannedTensor]:
    """The tensor table of a deepseek4 shape's DSpark drafter (DSparkShape), in file order, as llama.cpp's
    dflash loader creates it: no embeddings and no output projection (the trunk's serve), `fc` from the
    target layers' features, its norm, the head's hyper-connection mix and norm, the Markov head's two
    [vocab, rank] tables and the confidence head; each stage a window-only layer with learned routing."""
    d = s.dsv4
    if d is None or d.dspark is None:
        raise SynthError(f"{s.name} has no DSpark drafter shape")
    ds, e, hc = d.dspark, s.n_embd, d.hc_mult
    glob = [("fc.weight", (len(ds.target_layers) * e, e)), ("enc.output_norm.weight", (e,)),
            ("output_norm.weight", (e,)), ("output_hc_fn.weight", (hc * e, hc)), ("output_hc_base.weight", (hc,)),
            ("output_hc_scale.weight", (1,)), ("markov_w1.weight", (ds.markov_rank, s.n_vocab)),
            ("markov_w2.weight", (ds.markov_rank, s.n_vocab)), ("conf_proj.weight", (e + ds.markov_rank, 1))]
    stage = [(n, sh) for n, sh in _dsv4_tensor_shapes(dataclasses.replace(
        s, dsv4=dataclasses.replace(d, compress_ratios=(0,), hash_layers=0, nextn_layers=0)))[1][0]]
    experts = _DS4_FLASH_EXPERTS if s.mix == "ds4-flash" else {}

    def kind(name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
        small = name in ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight")
        return T.F32 if len(shape) == 1 or small or name in _F32_TABLES else experts.get(name, T.Q8_0)

    out = [PlannedTensor(n, sh, kind(n, sh)) for n, sh in sorted(glob)]
    for il in range(ds.stages):
        out += [PlannedTensor(f"blk.{il}.{n}", sh, kind(n, sh)) for n, sh in sorted(stage)]
    return out


def plan_spec(s: ShapeSpec) -> list[PlannedTensor]:
    """The tensor table of a shape, in file order."""
    if s.mix not in ("q4_k_m", "mxfp4", "q8_0", "ds4-flash", "q2-dynamic"):
        raise SynthError(f"unknown quantization mix {s.mix!r}")
    if s.dsv4 is not None:  # Q8_0 matrices (as the released file has outside its experts), F32 tables
        glob, layers = _dsv4_tensor_shapes(s)
        experts = _DS4_FLASH_EXPERTS if s.mix == "ds4-flash" else {}

        def dsv4_type(name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
            if name == "ffn_gate_tid2eid.weight":
                return T.I32
            return T.F32 if len(shape) == 1 or name in _F32_TABLES else experts.get(name, T.Q8_0)

        out = [PlannedTensor(n, sh, dsv4_type(n, sh)) for n, sh in sorted(glob)]
        for il, layer_shapes in enumerate(layers):
            out += [PlannedTensor(f"blk.{il}.{n}", sh, dsv4_type(n, sh)) for n, sh in sorted(layer_shapes)]
        return out
    glob, layer = _tensor_shapes(s)

    def type_of(name: str, shape: tuple[int, ...], il: int) -> GGMLQuantizationType:
        if s.type_table is not None:
            types = s.type_table[name]
            return GGMLQuantizationType[types[il] if il >= 0 else types[0]]  # by name (mypy reads T[...] as a type)
        if len(shape) == 1 or name == "ffn_gate_inp.weight" or name.endswith(".bias"):  # the router stays F32
            return T.F32
        if s.mix == "mxfp4":  # gpt-oss as released: MXFP4 experts, the other matrices Q8_0
            return T.MXFP4 if name.endswith("_exps.weight") else T.Q8_0
        if s.mix == "q2-dynamic" and name.endswith("_exps.weight"):  # the users' 2-3-bit MoE quants' experts
            return _q2_dynamic_expert_type(name, il, s.n_layer)
        return q4_k_m_type(name.split(".")[0], il, s.n_layer, shape[0], s.tied)

    # order: global tensors, then layer by layer, names sorted (as in the embedded Gemma file)
    out = [PlannedTensor(n, sh, type_of(n, sh, -1)) for n, sh in sorted(glob)]
    for il in range(s.n_layer):
        out += [PlannedTensor(f"blk.{il}.{n}", sh, type_of(n, sh, il)) for n, sh in sorted(layer)]
    return out


def plan(arch: str, shape: str) -> list[PlannedTensor]:
    """The tensor table (name, ggml-order shape, type) that make_model writes, in file order."""
    return plan_spec(resolve_shape(arch, shape))
