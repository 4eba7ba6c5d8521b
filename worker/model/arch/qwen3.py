"""Qwen 3 (dense): Qwen 2's layer without biases, with q/k norms; heads * head_dim may differ from hidden."""

from .recipe import PRE_NORM_LAYER, QK_NORM_LAYER, Family, Formats, MetadataKeys, Recipe, Rope, TensorNames

FAMILY = Family(
    name="qwen3",
    keys=MetadataKeys.under("qwen3"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QK_NORM_LAYER}),
    recipe=Recipe(qk_norm=True, rope=Rope.NEOX),
    formats=Formats(chat="chatml", tool="hermes", reasoning="think"),
)
