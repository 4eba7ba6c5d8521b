"""Qwen 3 (dense): Qwen 2's layer without biases, with q/k norms; heads * head_dim may differ from hidden."""

from .recipe import (
    PRE_NORM_LAYER,
    QK_NORM_LAYER,
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
    name="qwen3",
    keys=MetadataKeys.under("qwen3"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QK_NORM_LAYER}),
    recipe=Recipe(
        norms=Norms.PRE,
        qk_norm=True,
        attn_bias=Presence.NONE,
        rope=Rope.NEOX,
        rope_scaling=RopeScaling.BY_TYPE,
        act=Act.SILU,
        embed_scale=EmbedScale.ONE,
        output_weight=Presence.OPTIONAL,
        half_type=HalfType.F16,
    ),
    formats=Formats(chat="chatml", tool="hermes", reasoning="think"),
)
