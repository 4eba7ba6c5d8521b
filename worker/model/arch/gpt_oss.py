"""gpt-oss (20b, 120b): a mixture of experts whose router takes the top k logits then a softmax over
them, with biases on the router and every expert; the clamped SwiGLU; attention with q/k/v/output
biases and a learned sink logit per head; sliding-window (128) and full layers alternating, all with
the same YaRN-scaled RoPE; the MLP's norm is the file's post_attention_norm."""

from .recipe import (
    ATTENTION_LAYER,
    MOE_BIAS_LAYER,
    MOE_LAYER,
    QKV_BIAS_LAYER,
    Act,
    Family,
    Gating,
    MetadataKeys,
    Moe,
    Presence,
    Recipe,
    Rope,
    SlidingWindow,
    TensorNames,
)

FAMILY = Family(
    name="gpt-oss",
    keys=MetadataKeys.under("gpt-oss", sliding_window=True),
    tensors=TensorNames(layer={**ATTENTION_LAYER, "ffn_norm": "post_attention_norm.weight", **QKV_BIAS_LAYER,
                               "bo": "attn_output.bias", "sinks": "attn_sinks.weight", **MOE_LAYER,
                               **MOE_BIAS_LAYER}),
    recipe=Recipe(
        attn_bias=Presence.REQUIRED,
        attn_out_bias=True,
        attn_sinks=True,
        rope=Rope.NEOX,
        act=Act.SWIGLU_OAI,
        sliding_window=SlidingWindow(period=2, local_rope_base=None, pattern_from_file=False),  # even layers local
        moe=Moe(gating=Gating.SOFTMAX_TOPK, norm_topk=False, biases=True),
    ),
    # gpt-oss speaks Harmony, which its files' own template shows (worker/text/formats/harmony.py, detected
    # from the template); its vocabulary has no built-in template's turn tokens, so none is declared
    formats=None,
)
