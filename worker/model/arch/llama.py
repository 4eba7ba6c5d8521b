"""Llama (1, 2, 3, 3.1) and the files that reuse its architecture name (Mistral 7B, many fine-tunes)."""

from .recipe import PRE_NORM_LAYER, QKV_BIAS_LAYER, Family, Formats, MetadataKeys, Presence, Recipe, TensorNames

FAMILY = Family(
    name="llama",
    keys=MetadataKeys.under("llama"),
    tensors=TensorNames(layer={**PRE_NORM_LAYER, **QKV_BIAS_LAYER}, rope_freqs="rope_freqs.weight"),
    recipe=Recipe(attn_bias=Presence.OPTIONAL),  # llama.cpp loads the biases where a fine-tune has them
    formats=Formats(chat="llama3", tool="llama3"),
)
