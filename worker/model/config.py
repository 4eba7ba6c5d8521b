"""One typed model configuration, read from a GGUF file through its family (arch/<family>.py).

The family says which metadata keys hold the numbers and how a layer is computed (its Recipe); this
module reads the numbers and resolves the recipe's file-dependent parts (the sliding-window layers,
RoPE scaling, a tied output) into plain values, so the backends never look at the family's name.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.kernels.quants import SUPPORTED_TYPES

from .arch import FAMILIES, family_of
from .arch.recipe import (
    EmbedScale,
    Family,
    HyperNames,
    MetadataKeys,
    Presence,
    Recipe,
    RopeScaling,
    SlidingWindow,
    Stack,
)
from .gguf_file import GGUFFile, ModelFileError, model_stem

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


class Yarn(msgspec.Struct, frozen=True):
    """YaRN RoPE scaling (rope.scaling.type yarn) with llama.cpp's defaults where the file is silent."""

    factor: float
    n_ctx_orig: int  # the context the model was trained at
    local: bool  # the sliding-window layers are scaled too (they share the global RoPE: gpt-oss)
    beta_fast: float = 32.0  # pairs turning more than this many times over n_ctx_orig keep their frequency
    beta_slow: float = 1.0  # pairs turning fewer times are interpolated by 1/factor
    ext_factor: float = 1.0  # the ramp's weight (0 turns YaRN into plain interpolation)
    attn_factor: float = 1.0  # multiplies the cos/sin scale


class HyperConfig(msgspec.Struct, frozen=True):
    """A HYPER stack's settings (recipe.Stack.HYPER, DeepSeek V4), read from the keys its family names
    (Family.hyper.keys, one a field)."""

    window: int  # every layer attends to the last `window` positions' rows
    n_rot: int  # RoPE on the last n_rot dimensions of each head (and of the indexer's)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple[int, ...]  # per layer: 0 window only, 4 CSA, 128 HCA
    compress_rope_base: float  # the RoPE base of the compressed layers (and of every compressed row)
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    hash_layers: int  # the first layers route each token by its id
    n_shared: int  # shared experts (one gated MLP of n_shared * expert_ffn)
    expert_weights_scale: float
    expert_weights_norm: bool
    swiglu_clamp_exp: tuple[float, ...]  # per layer; 0: no clamp
    swiglu_clamp_shexp: tuple[float, ...]
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    # next-token (MTP) layers after the trunk (the file's nextn_predict_layers): layer n_layers + i is
    # blk.N.nextn.* plus a window-only attention and a learned-routing MoE of its own; the clamps above
    # have an entry for them too
    nextn_layers: int = 0


class ModelConfig(msgspec.Struct, frozen=True):
    arch: str
    name: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_base_local: float  # sliding-window layers; equal to rope_base where the family has none
    rope_scale: float  # linear position scaling of the global layers (1.0 = none)
    rope_yarn: Yarn | None  # worker/model/rope.py turns it into frequencies and a scale
    attn_scale: float
    sliding_window: int  # 0 = none
    local_layers: tuple[bool, ...]  # per layer: uses the sliding window (and the local rope base)
    embed_scale: float
    tied_output: bool
    family: Family
    n_experts: int = 0  # mixture of experts (recipe.moe): experts per layer, 0 for a dense MLP
    n_experts_used: int = 0  # experts each token goes through
    expert_ffn: int = 0  # each expert's feed-forward length
    hyper: HyperConfig | None = None  # recipe.stack HYPER: its settings

    @property
    def recipe(self) -> Recipe:
        return self.family.recipe

    def is_local_layer(self, layer: int) -> bool:
        return bool(self.sliding_window) and self.local_layers[layer]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _req(g: GGUFFile, key: str):
    value = g.get(key)
    if value is None:
        raise ModelFileError(g.path, f"metadata is missing {key}")
    return value


def read_config(g: GGUFFile) -> ModelConfig:
    family = family_of(g)
    keys, recipe = family.keys, family.recipe
    for info in g.tensors.values():
        if info.ggml_type not in SUPPORTED_TYPES and not (info.ggml_type is GGMLQuantizationType.I32
                                                          and recipe.stack is Stack.HYPER):  # its routing table
            names = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ModelFileError(
                g.path, f"tensor {info.name} has unsupported quant type {info.ggml_type.name} (supported: {names})"
            )
    hidden = int(_req(g, keys.embedding_length))
    n_heads = int(_req(g, keys.head_count))
    n_kv = g.get(keys.head_count_kv, n_heads)
    if not isinstance(n_kv, int):  # per-layer arrays exist in some files; we need one value
        n_kv = int(n_kv[0])
    head_dim = int(g.get(keys.key_length, hidden // n_heads))
    if int(g.get(keys.value_length, head_dim)) != head_dim:
        raise ModelFileError(g.path, "unsupported: value head size differs from key head size")
    if n_heads % n_kv:
        raise ModelFileError(g.path, f"corrupt: {n_heads} heads are not a multiple of {n_kv} kv heads")
    tokens = g.get("tokenizer.ggml.tokens")
    embd = g.tensors.get(family.tensors.token_embd)
    if embd is None:
        raise ModelFileError(g.path, f"missing tensor {family.tensors.token_embd}")
    vocab = int(embd.shape[1])
    if tokens is not None and len(tokens) != vocab:
        raise ModelFileError(g.path, f"vocabulary has {len(tokens)} tokens but token_embd has {vocab} rows")
    rope_base = float(g.get(keys.rope_freq_base, 10000.0))
    scaling_type = g.get(keys.rope_scaling_type, "none")
    factor = float(g.get(keys.rope_scaling_factor, 1.0) or 1.0)
    if scaling_type not in ("none", "linear", "yarn") and factor != 1.0:
        raise ModelFileError(g.path, f"unsupported rope scaling {scaling_type!r}")
    swa = recipe.sliding_window
    yarn = _yarn(g, keys, factor, local=swa is not None and swa.local_rope_base is None) \
        if scaling_type == "yarn" and factor != 1.0 else None
    linear = scaling_type == "linear" or (recipe.rope_scaling is RopeScaling.LINEAR and factor != 1.0 and not yarn)
    sliding = int(g.get(keys.sliding_window, 0)) if swa else 0
    n_layers = int(_req(g, keys.block_count))
    if family.hyper is not None:  # a HYPER stack's trunk: block_count counts the next-token (MTP) layers after it
        n_layers -= _nextn_layers(g, family.hyper, n_layers)
    local_layers = _local_layers(g, family.keys, swa, n_layers) if swa and sliding else (False,) * n_layers
    return ModelConfig(
        arch=family.name,
        name=str(g.get("general.name", model_stem(g.path))),
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(g.get(keys.feed_forward_length, 0) if recipe.moe else _req(g, keys.feed_forward_length)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=int(g.get(keys.context_length, 4096)),
        norm_eps=float(g.get(keys.rms_eps, 1e-6)),
        rope_base=rope_base,
        rope_base_local=float(g.get(keys.rope_freq_base_swa, swa.local_rope_base or rope_base)) if swa else rope_base,
        rope_scale=1.0 / factor if linear else 1.0,
        rope_yarn=yarn,
        attn_scale=1.0 / math.sqrt(head_dim),
        sliding_window=sliding,
        local_layers=local_layers,
        embed_scale=math.sqrt(hidden) if recipe.embed_scale is EmbedScale.SQRT_HIDDEN else 1.0,
        tied_output=_tied_output(g, family),
        family=family,
        **_experts(g, family, hidden, n_layers),
        hyper=_hyper(g, family.hyper, n_layers, head_dim) if family.hyper is not None else None,
    )


def _nextn_layers(g: GGUFFile, names: HyperNames, n_all: int) -> int:
    """How many of the file's n_all blocks are next-token (MTP) layers, each with its nextn tensors."""
    key = names.keys["nextn_layers"]
    n = int(g.get(key, 0))
    if not 0 <= n < n_all:
        raise ModelFileError(g.path, f"corrupt: {n} next-token layers of {n_all} blocks")
    for il in range(n_all - n, n_all):
        if names.layer_name(il, "nextn_eh_proj") not in g.tensors:
            raise ModelFileError(g.path, f"{key} is {n} but {names.layer_name(il, 'nextn_eh_proj')} is missing")
    return n


def _hyper(g: GGUFFile, names: HyperNames, n_layers: int, head_dim: int) -> HyperConfig:
    """A HYPER stack's settings, checked where a wrong one would be an index error mid-request."""
    key = names.keys
    nextn = int(g.get(key["nextn_layers"], 0))
    n_all = n_layers + nextn

    def per_layer(key: str, default: tuple[float, ...] | None = None) -> tuple[float, ...]:
        value = g.get(key) if default is None else g.get(key, default)
        if value is None:
            raise ModelFileError(g.path, f"metadata is missing {key}")
        flat = np.atleast_1d(np.asarray(value, dtype=np.float64))  # a value for all layers, or one a layer
        values = tuple(float(v) for v in (flat if flat.size > 1 else np.repeat(flat, n_all)))
        if len(values) < n_all:
            raise ModelFileError(g.path, f"{key} has {len(values)} entries for {n_all} layers")
        return values[:n_all]

    ratios = tuple(int(r) for r in np.atleast_1d(np.asarray(_req(g, key["compress_ratios"]))))
    if len(ratios) < n_all:
        raise ModelFileError(g.path, f"{key['compress_ratios']} has {len(ratios)} entries for {n_all} layers")
    if any(r not in (0, 4, 128) for r in ratios[:n_layers]):
        raise ModelFileError(g.path, f"unsupported compress ratios {sorted(set(ratios))} (supported: 0, 4, 128)")
    if any(ratios[n_layers:n_all]):  # llama.cpp's MTP graph attends over a plain windowed cache
        raise ModelFileError(g.path, "unsupported: next-token layers with compress ratios "
                                     f"{list(ratios[n_layers:n_all])}")
    gating = int(_req(g, key["expert_gating"]))
    if gating != 4:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, all DeepSeek V4 uses
        raise ModelFileError(g.path, f"unsupported expert gating function {gating} (supported: 4, sqrt-softplus)")
    clamp = per_layer(key["swiglu_clamp_exp"])
    cfg = HyperConfig(
        window=int(_req(g, key["window"])),
        n_rot=int(_req(g, key["n_rot"])),
        q_lora_rank=int(_req(g, key["q_lora_rank"])),
        o_groups=int(_req(g, key["o_groups"])),
        o_lora_rank=int(_req(g, key["o_lora_rank"])),
        compress_ratios=ratios[:n_layers],
        compress_rope_base=float(_req(g, key["compress_rope_base"])),
        indexer_heads=int(_req(g, key["indexer_heads"])),
        indexer_dim=int(_req(g, key["indexer_dim"])),
        indexer_top_k=int(_req(g, key["indexer_top_k"])),
        hash_layers=int(_req(g, key["hash_layers"])),
        n_shared=int(_req(g, key["n_shared"])),
        expert_weights_scale=float(_req(g, key["expert_weights_scale"])),
        expert_weights_norm=bool(_req(g, key["expert_weights_norm"])),
        swiglu_clamp_exp=clamp,
        swiglu_clamp_shexp=per_layer(key["swiglu_clamp_shexp"], clamp),
        hc_mult=int(_req(g, key["hc_mult"])),
        hc_sinkhorn_iters=int(_req(g, key["hc_sinkhorn_iters"])),
        hc_eps=float(_req(g, key["hc_eps"])),
        nextn_layers=nextn,
    )
    if cfg.indexer_dim % 64:  # llama.cpp rotates the indexer's keys by Hadamard matrices of 64 and up
        raise ModelFileError(g.path, f"unsupported indexer key length {cfg.indexer_dim} (a multiple of 64)")
    if nextn and n_layers < cfg.hash_layers:  # llama.cpp's MTP graph routes by its learned router only
        raise ModelFileError(g.path, f"unsupported: a hash-routed next-token layer ({cfg.hash_layers} hash layers)")
    if cfg.window <= 0:
        raise ModelFileError(g.path, f"corrupt: sliding window {cfg.window}")
    if not (0 < cfg.n_rot <= min(head_dim, cfg.indexer_dim) and cfg.n_rot % 2 == 0):
        raise ModelFileError(g.path, f"corrupt: RoPE over {cfg.n_rot} dimensions of heads of {head_dim} "
                                     f"(indexer {cfg.indexer_dim})")
    return cfg


def _experts(g: GGUFFile, family: Family, hidden: int, n_layers: int) -> dict[str, int]:
    """The mixture of experts' sizes, checked against each other and every layer's expert tensors (an
    empty dict for a dense family): a mismatch is one line here, never an index error mid-request."""
    if family.recipe.moe is None:
        return {}
    keys = family.keys
    assert keys.expert_count and keys.expert_used_count and keys.expert_feed_forward_length
    n, used = int(_req(g, keys.expert_count)), int(_req(g, keys.expert_used_count))
    if not 0 < used <= n:
        raise ModelFileError(g.path, f"corrupt: {used} experts used per token of {n}")
    gate = g.tensors.get(family.tensors.layer_name(0, "gate_exps"))  # ggml shape [hidden, ffn, experts]
    ffn = int(g.get(keys.expert_feed_forward_length) or (gate.shape[1] if gate is not None else 0))
    expected = {"router": (hidden, n), "gate_exps": (hidden, ffn, n), "up_exps": (hidden, ffn, n),
                "down_exps": (ffn, hidden, n)}  # ggml order: the fastest-moving dimension first
    for il in range(n_layers):
        for role, shape in expected.items():
            t = g.tensors.get(family.tensors.layer_name(il, role))
            if t is not None and tuple(t.shape) != shape:
                raise ModelFileError(g.path, f"tensor {t.name} has shape {list(t.shape)}, expected {list(shape)} for "
                                             f"{n} experts of feed-forward length {ffn} (hidden {hidden})")
    return {"n_experts": n, "n_experts_used": used, "expert_ffn": ffn}


def _yarn(g: GGUFFile, keys: MetadataKeys, factor: float, *, local: bool) -> Yarn:
    assert keys.rope_scaling_original_context is not None
    n_ctx_orig = int(g.get(keys.rope_scaling_original_context) or g.get(keys.context_length, 4096))
    tuning = {}
    if keys.yarn_prefix:
        for name in ("beta_fast", "beta_slow", "ext_factor", "attn_factor"):
            value = g.get(f"{keys.yarn_prefix}.yarn_{name}")
            if value is not None:
                tuning[name] = float(value)
    return Yarn(factor=factor, n_ctx_orig=n_ctx_orig, local=local, **tuning)


def _tied_output(g: GGUFFile, family: Family) -> bool:
    need = family.recipe.output_weight
    present = family.tensors.output in g.tensors
    if need is Presence.REQUIRED and not present:
        raise ModelFileError(g.path, f"missing tensor {family.tensors.output}")
    return need is Presence.NONE or not present


def _local_layers(g: GGUFFile, keys: MetadataKeys, swa: SlidingWindow, n_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: `attention.sliding_window_pattern` as a period
    (layer il is local when il % period < period - 1, llama.cpp's rule) or as a per-layer array of
    booleans; the family's period when the file has neither."""
    pattern = g.get(keys.sliding_window_pattern, swa.period) if swa.pattern_from_file else swa.period
    if isinstance(pattern, int):
        return tuple(pattern > 0 and il % pattern < pattern - 1 for il in range(n_layers))
    flags = [bool(x) for x in pattern]
    if len(flags) != n_layers:
        raise ModelFileError(g.path, f"sliding_window_pattern has {len(flags)} entries for {n_layers} layers")
    return tuple(flags)
