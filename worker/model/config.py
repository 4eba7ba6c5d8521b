"""One typed model configuration, read from a GGUF file through its family (arch/<family>.py).

The family says which metadata keys hold the numbers and how a layer is computed (its Recipe); this
module reads the numbers and resolves the recipe's file-dependent parts (the sliding-window layers,
RoPE scaling, a tied output) into plain values, so the backends never look at the family's name.
"""

from __future__ import annotations

import math

import msgspec

from ember.kernels.quants import SUPPORTED_TYPES

from .arch import FAMILIES, family_of
from .arch.recipe import EmbedScale, Family, MetadataKeys, Presence, Recipe, RopeScaling, SlidingWindow
from .gguf_file import GGUFFile, ModelFileError

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
        if info.ggml_type not in SUPPORTED_TYPES:
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
    local_layers = _local_layers(g, family.keys, swa, n_layers) if swa and sliding else (False,) * n_layers
    return ModelConfig(
        arch=family.name,
        name=str(g.get("general.name", g.path.stem)),
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
    )


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
