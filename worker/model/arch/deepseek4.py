"""DeepSeek V4 (V4-Flash): hyper-connections (four residual streams mixed per layer), low-rank queries,
one KV head that is both key and value with RoPE on its last dimensions, per-layer attention kinds set
by the file's compress_ratios (sliding window only; CSA: 4:1 compressed rows picked by a lightning
indexer; HCA: 128:1 compressed rows, all of them), a grouped low-rank output projection, and a mixture
of experts scored by sqrt(softplus) with a shared expert and hash-routed first layers. The numpy
backend runs it (engine/numpy_hyper.py); the CUDA backend refuses it. It speaks DeepSeek's chat format
with DSML tool calls and thinking on or off."""

from .recipe import (
    MOE_LAYER,
    Family,
    Formats,
    Gating,
    MetadataKeys,
    Moe,
    Recipe,
    Rope,
    Stack,
    TensorNames,
)

FAMILY = Family(
    name="deepseek4",
    keys=MetadataKeys.under("deepseek4"),
    tensors=TensorNames(layer={"attn_norm": "attn_norm.weight", "sinks": "attn_sinks.weight",
                               "ffn_norm": "ffn_norm.weight", **MOE_LAYER}),
    recipe=Recipe(attn_sinks=True, rope=Rope.NORMAL, moe=Moe(gating=Gating.SQRT_SOFTPLUS), stack=Stack.HYPER),
    # DeepSeek's own turn markers, DSML tool calls and <think> reasoning (text/formats/dsml.py), detected from
    # the file's template; the built-in one (templates/deepseek.jinja) for a file without
    formats=Formats(chat="deepseek", tool="dsml", reasoning="think"),
)
