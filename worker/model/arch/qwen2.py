"""Qwen 2 and 2.5: llama's layer with q, k and v biases, and NeoX RoPE."""

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
    name="qwen2",
    keys=MetadataKeys.under("qwen2"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QKV_BIAS_LAYER}),
    recipe=Recipe(
        norms=Norms.PRE,
        qk_norm=False,
        attn_bias=Presence.REQUIRED,
        rope=Rope.NEOX,
        rope_scaling=RopeScaling.BY_TYPE,
        act=Act.SILU,
        embed_scale=EmbedScale.ONE,
        output_weight=Presence.OPTIONAL,
        half_type=HalfType.F16,
    ),
    formats=Formats(chat="chatml", tool="hermes"),
)
