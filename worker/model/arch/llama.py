"""Llama (1, 2, 3, 3.1) and the files that reuse its architecture name (Mistral 7B, many fine-tunes)."""

from .recipe import (
    PRE_NORM_LAYER,
    QKV_BIAS_LAYER,
    Act,
    EmbedScale,
    Family,
    Formats,
    HalfType,
    MetadataKeys,
    Norms,
    Presence,
    Recipe,
    Rope,
    RopeScaling,
    TensorNames,
)

FAMILY = Family(
    name="llama",
    keys=MetadataKeys.under("llama"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QKV_BIAS_LAYER}, rope_freqs="rope_freqs.weight"),
    recipe=Recipe(
        norms=Norms.PRE,
        qk_norm=False,
        attn_bias=Presence.OPTIONAL,  # llama.cpp loads them where a fine-tune has them
        rope=Rope.NORMAL,
        rope_scaling=RopeScaling.BY_TYPE,
        act=Act.SILU,
        embed_scale=EmbedScale.ONE,
        output_weight=Presence.OPTIONAL,
        half_type=HalfType.F16,
    ),
    formats=Formats(chat="llama3", tool="llama3"),
)
