"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen 3's attention (q/k norms, no biases) with a
mixture-of-experts MLP in every layer: softmax over the experts' logits, the top k, renormalised."""

from .recipe import (
    ATTENTION_LAYER,
    MOE_LAYER,
    QK_NORM_LAYER,
    Family,
    Formats,
    MetadataKeys,
    Moe,
    Recipe,
    Rope,
    TensorNames,
)

FAMILY = Family(
    name="qwen3moe",
    keys=MetadataKeys.under("qwen3moe"),
    tensors=TensorNames(layer={**ATTENTION_LAYER, **QK_NORM_LAYER, **MOE_LAYER}),
    recipe=Recipe(qk_norm=True, rope=Rope.NEOX, moe=Moe()),
    formats=Formats(chat="chatml", tool="hermes", reasoning="think"),
)
