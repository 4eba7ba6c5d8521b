"""Gemma 3 (text): sandwich norms, q/k norms, GELU, scaled embeddings, and sliding-window layers
(five local to one global by default) with a RoPE base of their own."""

from .recipe import (
    POST_NORM_LAYER,
    PRE_NORM_LAYER,
    QK_NORM_LAYER,
    Act,
    EmbedScale,
    Family,
    Formats,
    HalfType,
    MetadataKeys,
    Norms,
    Recipe,
    Rope,
    RopeScaling,
    SlidingWindow,
    TensorNames,
)

FAMILY = Family(
    name="gemma3",
    keys=MetadataKeys.under("gemma3", sliding_window=True),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QK_NORM_LAYER, **POST_NORM_LAYER}),
    recipe=Recipe(
        norms=Norms.PRE_AND_POST,
        qk_norm=True,
        rope=Rope.NEOX,
        rope_scaling=RopeScaling.LINEAR,
        act=Act.GELU_TANH,
        embed_scale=EmbedScale.SQRT_HIDDEN,
        half_type=HalfType.BF16,  # its activations outgrow float16's range
        # llama.cpp's defaults: period 6, and 10k for the local layers whatever the global base
        sliding_window=SlidingWindow(period=6, local_rope_base=10000.0),
    ),
    formats=Formats(chat="gemma", tool="fenced"),
)
