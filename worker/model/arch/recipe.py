"""What a model family is, as data: the vocabulary every `arch/<family>.py` file is written in.

A family names its GGUF metadata keys (MetadataKeys), its tensors (TensorNames), how a layer is
computed (Recipe) and the text formats it speaks by default (Formats); a HYPER stack's family also
names the keys and tensors only that stack has (HyperNames). The loader reads a file
through these, and both backends build their forward pass from the Recipe alone: neither looks at
the architecture's name. This module holds no family itself; it says what a complete one holds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Presence(enum.Enum):
    """Whether a family's files carry a tensor (group): never, where they choose to, or always."""

    NONE = "none"
    OPTIONAL = "optional"
    REQUIRED = "required"


class Norms(enum.Enum):
    PRE = "pre"  # rms_norm before attention and before the MLP (llama)
    PRE_AND_POST = "pre+post"  # also after each, before it joins the residual (gemma's "sandwich")


class Rope(enum.Enum):
    NORMAL = "normal"  # rotate adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM)
    NEOX = "neox"  # rotate the two halves of a head against each other


class RopeScaling(enum.Enum):
    BY_TYPE = "by-type"  # the file's rope.scaling.type says linear (or none); a factor alone does nothing
    LINEAR = "linear"  # a rope.scaling.factor always scales positions linearly (llama.cpp's gemma3)


class Act(enum.StrEnum):
    """The gated MLP's activation; the value is the name the kernels (and their numpy twins) take."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: gate sigmoid(alpha gate) (up + 1), gate clamped above, up both ways


class EmbedScale(enum.Enum):
    ONE = "1"
    SQRT_HIDDEN = "sqrt(hidden)"  # gemma multiplies the token embeddings by sqrt(hidden size)


class HalfType(enum.StrEnum):
    """The 16-bit type a tensor-core matmul rounds activations (and weights) to on the GPU."""

    F16 = "f16"
    BF16 = "bf16"  # float32's exponent: for families whose activations outgrow float16 (gemma)


@dataclass(frozen=True)
class SlidingWindow:
    """Some layers attend only to the last `window` keys (the file's attention.sliding_window) and
    rotate with a RoPE base of their own. Which layers: the file's sliding_window_pattern, a period
    (layer il is local when il % period < period - 1) or one flag per layer."""

    period: int  # the pattern when the file has none
    local_rope_base: float | None  # the local layers' base without rope.freq_base_swa (None: the global RoPE)
    pattern_from_file: bool = True  # False: the period always holds (llama.cpp fixes gpt-oss's at 2)


class Gating(enum.Enum):
    """How a mixture-of-experts router turns its logits into the chosen experts' weights."""

    SOFTMAX = "softmax"  # softmax over all experts, then the top k (qwen3moe; renormalised if norm_topk)
    SOFTMAX_TOPK = "softmax-topk"  # the top k logits, then a softmax over those k (gpt-oss)
    SQRT_SOFTPLUS = "sqrt-softplus"  # sqrt(softplus(logit)) per expert, the top k of it plus a bias (deepseek4)


class Stack(enum.Enum):
    """What a layer is built around."""

    RESIDUAL = "residual"  # one residual stream, attention over a KV cache of every kept position
    # DeepSeek V4: several residual streams mixed by learned hyper-connections; one KV head that is key and
    # value; per layer a sliding window alone, or with compressed rows (CSA, picked by a lightning indexer;
    # HCA, all of them); a shared expert beside the routed ones, hash-routed first layers
    HYPER = "hyper-connections"


@dataclass(frozen=True)
class Moe:
    """The MLP is a mixture of experts: a router (ffn_gate_inp) picks the file's expert_used_count of
    its expert_count experts per token, each a gated MLP of expert_feed_forward_length, and the MLP's
    output is their outputs weighted as `gating` says."""

    gating: Gating = Gating.SOFTMAX
    norm_topk: bool = True  # the k chosen weights are scaled to sum to 1
    biases: bool = False  # the router and every expert matrix add a bias (gpt-oss)


@dataclass(frozen=True)
class Recipe:
    """How one layer (and the ends of the stack) is computed. Decided per family, never per file:
    the backends turn it into explicit per-layer choices once, when they load the weights."""

    # the defaults are Llama's pre-norm decoder layer: a family states where it differs
    norms: Norms = Norms.PRE
    qk_norm: bool = False  # rms_norm over each head of q and k before RoPE
    attn_bias: Presence = Presence.NONE  # q, k and v biases (all three or none, per layer)
    attn_out_bias: bool = False  # the output projection adds a bias (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    rope: Rope = Rope.NORMAL
    rope_scaling: RopeScaling = RopeScaling.BY_TYPE
    act: Act = Act.SILU
    embed_scale: EmbedScale = EmbedScale.ONE
    output_weight: Presence = Presence.OPTIONAL  # OPTIONAL: tied to token_embd when the file has none
    half_type: HalfType = HalfType.F16
    sliding_window: SlidingWindow | None = None
    moe: Moe | None = None  # None: a dense gated MLP
    stack: Stack = Stack.RESIDUAL  # HYPER: the layer is numpy/hyper.py's, its own tensors beside the roles below
    # Neither backend runs these yet; they are named so that a family needing one fails here, loudly
    mlp_bias: bool = False
    logit_softcap: float = 0.0  # 0: none

    def __post_init__(self) -> None:
        if self.mlp_bias:
            raise ValueError("recipe asks for MLP biases: neither backend runs them yet")
        if self.logit_softcap:
            raise ValueError("recipe asks for a logit softcap: neither backend runs one yet")

    @property
    def post_norms(self) -> bool:
        return self.norms is Norms.PRE_AND_POST

    def layer_roles(self) -> dict[str, Presence]:
        """Every tensor role a layer of this recipe has (ROLES), and whether a file must carry it. A HYPER
        layer shares only its norms, sinks and experts with ROLES; its other tensors are its own."""
        if self.stack is Stack.HYPER:
            return dict.fromkeys(("attn_norm", "sinks", "ffn_norm", *MOE_ROLES), Presence.REQUIRED)
        mlp = MOE_ROLES if self.moe else ("w_gate", "w_up", "w_down")
        roles = dict.fromkeys(("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", *mlp), Presence.REQUIRED)
        if self.attn_bias is not Presence.NONE:
            roles |= dict.fromkeys(BIAS_ROLES, self.attn_bias)
        if self.attn_out_bias:
            roles["bo"] = Presence.REQUIRED
        if self.attn_sinks:
            roles["sinks"] = Presence.REQUIRED
        if self.moe is not None and self.moe.biases:
            roles |= dict.fromkeys(MOE_BIAS_ROLES, Presence.REQUIRED)
        if self.qk_norm:
            roles |= dict.fromkeys(("q_norm", "k_norm"), Presence.REQUIRED)
        if self.post_norms:
            roles |= dict.fromkeys(("post_attn_norm", "post_ffn_norm"), Presence.REQUIRED)
        return roles


# The roles a layer's tensors play, in the order their weights are loaded (the CUDA backend's device
# allocations follow it, so it is part of its memory layout).
ROLES = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "sinks", "q_norm", "k_norm", "post_attn_norm",
         "ffn_norm", "w_gate", "w_up", "w_down", "router", "gate_exps", "up_exps", "down_exps", "router_b",
         "gate_exps_b", "up_exps_b", "down_exps_b", "post_ffn_norm")
MATRIX_ROLES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MOE_ROLES = ("router", "gate_exps", "up_exps", "down_exps")  # router [experts, hidden]; the rest 3-D
MOE_BIAS_ROLES = ("router_b", "gate_exps_b", "up_exps_b", "down_exps_b")  # [experts], then [experts, rows]
BIAS_ROLES = ("bq", "bk", "bv")


@dataclass(frozen=True)
class TensorNames:
    """GGUF tensor names: the model-wide ones, and per layer role the name after `blk.N.`."""

    layer: Mapping[str, str]
    token_embd: str = "token_embd.weight"
    output_norm: str = "output_norm.weight"
    output: str = "output.weight"
    rope_freqs: str | None = None  # per-dimension RoPE frequency factors (llama 3.1), where the family has them

    def layer_name(self, layer: int, role: str) -> str:
        return f"blk.{layer}.{self.layer[role]}"


# llama.cpp's names for the roles every pre-norm transformer has; families add their extras
ATTENTION_LAYER = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
}
DENSE_MLP_LAYER = {"w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
PRE_NORM_LAYER = {**ATTENTION_LAYER, **DENSE_MLP_LAYER}
QKV_BIAS_LAYER = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
QK_NORM_LAYER = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
POST_NORM_LAYER = {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight"}
MOE_BIAS_LAYER = {"router_b": "ffn_gate_inp.bias", "gate_exps_b": "ffn_gate_exps.bias",
                  "up_exps_b": "ffn_up_exps.bias", "down_exps_b": "ffn_down_exps.bias"}
MOE_LAYER = {"router": "ffn_gate_inp.weight", "gate_exps": "ffn_gate_exps.weight", "up_exps": "ffn_up_exps.weight",
             "down_exps": "ffn_down_exps.weight"}


@dataclass(frozen=True)
class MetadataKeys:
    """The GGUF metadata keys a family's settings are read from (None: the family has no such setting)."""

    block_count: str
    context_length: str
    embedding_length: str
    feed_forward_length: str
    head_count: str
    head_count_kv: str
    key_length: str
    value_length: str
    rms_eps: str
    rope_freq_base: str
    rope_scaling_type: str
    rope_scaling_factor: str
    sliding_window: str | None = None
    sliding_window_pattern: str | None = None
    rope_freq_base_swa: str | None = None
    expert_count: str | None = None
    expert_used_count: str | None = None
    expert_feed_forward_length: str | None = None
    rope_scaling_original_context: str | None = None  # YaRN: the context the model was trained at
    yarn_prefix: str | None = None  # YaRN's tuning keys (<prefix>.yarn_beta_fast, ...) where a file sets them

    @classmethod
    def under(cls, prefix: str, *, sliding_window: bool = False) -> MetadataKeys:
        """llama.cpp's keys for an architecture: `<prefix>.embedding_length` and so on."""
        swa = {"sliding_window": f"{prefix}.attention.sliding_window",
               "sliding_window_pattern": f"{prefix}.attention.sliding_window_pattern",
               "rope_freq_base_swa": f"{prefix}.rope.freq_base_swa"} if sliding_window else {}
        return cls(
            block_count=f"{prefix}.block_count",
            context_length=f"{prefix}.context_length",
            embedding_length=f"{prefix}.embedding_length",
            feed_forward_length=f"{prefix}.feed_forward_length",
            head_count=f"{prefix}.attention.head_count",
            head_count_kv=f"{prefix}.attention.head_count_kv",
            key_length=f"{prefix}.attention.key_length",
            value_length=f"{prefix}.attention.value_length",
            rms_eps=f"{prefix}.attention.layer_norm_rms_epsilon",
            rope_freq_base=f"{prefix}.rope.freq_base",
            rope_scaling_type=f"{prefix}.rope.scaling.type",
            rope_scaling_factor=f"{prefix}.rope.scaling.factor",
            expert_count=f"{prefix}.expert_count",
            expert_used_count=f"{prefix}.expert_used_count",
            expert_feed_forward_length=f"{prefix}.expert_feed_forward_length",
            rope_scaling_original_context=f"{prefix}.rope.scaling.original_context_length",
            yarn_prefix=f"{prefix}.rope.scaling",
            **swa,
        )


@dataclass(frozen=True)
class HyperNames:
    """A HYPER stack's own GGUF names (Stack.HYPER), which MetadataKeys and TensorNames have no place for:
    the metadata key of each of its settings, and its tensors by role."""

    keys: Mapping[str, str]  # a setting (config.HyperConfig's field, or a checked one) -> its metadata key
    layer: Mapping[str, str]  # role -> the name after `blk.N.` (beside TensorNames.layer's roles)
    model: Mapping[str, str]  # role -> a model-wide tensor's name

    def layer_name(self, layer: int, role: str) -> str:
        return f"blk.{layer}.{self.layer[role]}"


@dataclass(frozen=True)
class Formats:
    """The text formats a family speaks when its file does not say (names the text layer resolves),
    the one table the runtime reads for them: the built-in chat template for a file without one
    (when its vocabulary names no built-in's turn tokens: model/loader.py), and the tool-call format
    and reasoning markers a model speaks through that template (text/formats/registry.resolve;
    reasoning None: found as for any template, from its markers in the vocabulary). A file with a
    template of its own speaks what that template shows."""

    chat: str
    tool: str
    reasoning: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family: everything ember needs to know to load and run its GGUF files."""

    name: str  # general.architecture
    keys: MetadataKeys
    tensors: TensorNames
    recipe: Recipe
    formats: Formats | None  # None: no built-in template; a file of the family without one is refused
    hyper: HyperNames | None = None  # a HYPER stack's own names; every HYPER family has them, no other does

    def __post_init__(self) -> None:
        if (self.recipe.stack is Stack.HYPER) != (self.hyper is not None):
            raise ValueError(f"{self.name}: a HYPER recipe needs its own names (hyper), and no other has them")
