"""Qwen 2 and 2.5: llama's layer with q, k and v biases, and NeoX RoPE."""

from .recipe import PRE_NORM_LAYER, QKV_BIAS_LAYER, Family, Formats, MetadataKeys, Presence, Recipe, Rope, TensorNames

FAMILY = Family(
    name="qwen2",
    keys=MetadataKeys.under("qwen2"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QKV_BIAS_LAYER}),
    recipe=Recipe(attn_bias=Presence.REQUIRED, rope=Rope.NEOX),
    formats=Formats(chat="chatml", tool="hermes"),
)
