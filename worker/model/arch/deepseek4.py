"""DeepSeek V4 (V4-Flash): hyper-connections (four residual streams mixed per layer), low-rank queries,
one KV head that is both key and value with RoPE on its last dimensions, per-layer attention kinds set
by the file's compress_ratios (sliding window only; CSA: 4:1 compressed rows picked by a lightning
indexer; HCA: 128:1 compressed rows, all of them), a grouped low-rank output projection, and a mixture
of experts scored by sqrt(softplus) with a shared expert and hash-routed first layers. The numpy
backend runs it (backends/numpy/hyper.py, reading its tensors by the roles named here); the CUDA backend
refuses it. It speaks DeepSeek's chat format with DSML tool calls and thinking on or off."""

from .recipe import (
    MOE_LAYER,
    Family,
    Formats,
    Gating,
    HyperNames,
    MetadataKeys,
    Moe,
    Recipe,
    Rope,
    Stack,
    TensorNames,
)

# llama.cpp's deepseek4 keys for the stack's settings, by config.HyperConfig's field (expert_gating: checked, not kept)
HYPER_KEYS = {
    "window": "deepseek4.attention.sliding_window",
    "n_rot": "deepseek4.rope.dimension_count",
    "q_lora_rank": "deepseek4.attention.q_lora_rank",
    "o_groups": "deepseek4.attention.output_group_count",
    "o_lora_rank": "deepseek4.attention.output_lora_rank",
    "compress_ratios": "deepseek4.attention.compress_ratios",
    "compress_rope_base": "deepseek4.attention.compress_rope_freq_base",
    "indexer_heads": "deepseek4.attention.indexer.head_count",
    "indexer_dim": "deepseek4.attention.indexer.key_length",
    "indexer_top_k": "deepseek4.attention.indexer.top_k",
    "hash_layers": "deepseek4.hash_layer_count",
    "n_shared": "deepseek4.expert_shared_count",
    "expert_gating": "deepseek4.expert_gating_func",
    "expert_weights_scale": "deepseek4.expert_weights_scale",
    "expert_weights_norm": "deepseek4.expert_weights_norm",
    "swiglu_clamp_exp": "deepseek4.swiglu_clamp_exp",
    "swiglu_clamp_shexp": "deepseek4.swiglu_clamp_shexp",
    "hc_mult": "deepseek4.hyper_connection.count",
    "hc_sinkhorn_iters": "deepseek4.hyper_connection.sinkhorn_iterations",
    "hc_eps": "deepseek4.hyper_connection.epsilon",
    "nextn_layers": "deepseek4.nextn_predict_layers",
}

# a layer's tensors beside the norms, sinks and routed experts of TensorNames.layer
HYPER_LAYER = {
    # the hyper-connections' mixes around the attention and the MLP
    "attn_mix_fn": "hc_attn_fn.weight",
    "attn_mix_scale": "hc_attn_scale.weight",
    "attn_mix_base": "hc_attn_base.weight",
    "ffn_mix_fn": "hc_ffn_fn.weight",
    "ffn_mix_scale": "hc_ffn_scale.weight",
    "ffn_mix_base": "hc_ffn_base.weight",
    # low-rank queries, the single KV head, the grouped low-rank output
    "q_a": "attn_q_a.weight",
    "q_a_norm": "attn_q_a_norm.weight",
    "q_b": "attn_q_b.weight",
    "kv": "attn_kv.weight",
    "kv_norm": "attn_kv_a_norm.weight",
    "o_a": "attn_output_a.weight",
    "o_b": "attn_output_b.weight",
    # the compressor (CSA and HCA layers) and the lightning indexer with its own compressor (CSA)
    "compressor_kv": "attn_compressor_kv.weight",
    "compressor_gate": "attn_compressor_gate.weight",
    "compressor_ape": "attn_compressor_ape.weight",
    "compressor_norm": "attn_compressor_norm.weight",
    "indexer_compressor_kv": "indexer_compressor_kv.weight",
    "indexer_compressor_gate": "indexer_compressor_gate.weight",
    "indexer_compressor_ape": "indexer_compressor_ape.weight",
    "indexer_compressor_norm": "indexer_compressor_norm.weight",
    "indexer_q_b": "indexer.attn_q_b.weight",
    "indexer_proj": "indexer.proj.weight",
    # the MoE's hash routing (first layers), learned routing's selection bias, and the shared expert
    "token_to_experts": "ffn_gate_tid2eid.weight",
    "router_select_bias": "exp_probs_b.bias",
    "shared_gate": "ffn_gate_shexp.weight",
    "shared_up": "ffn_up_shexp.weight",
    "shared_down": "ffn_down_shexp.weight",
    # a next-token (MTP) layer's projection of [embedding, h]: the tensor that marks one
    "nextn_eh_proj": "nextn.eh_proj.weight",
}

# the head's hyper-connection mix of the streams into one, before the output norm
HYPER_MODEL = {"output_mix_fn": "output_hc_fn.weight", "output_mix_scale": "output_hc_scale.weight",
               "output_mix_base": "output_hc_base.weight"}

FAMILY = Family(
    name="deepseek4",
    keys=MetadataKeys.under("deepseek4"),
    tensors=TensorNames(layer={"attn_norm": "attn_norm.weight", "sinks": "attn_sinks.weight",
                               "ffn_norm": "ffn_norm.weight", **MOE_LAYER}),
    recipe=Recipe(attn_sinks=True, rope=Rope.NORMAL, moe=Moe(gating=Gating.SQRT_SOFTPLUS), stack=Stack.HYPER),
    # DeepSeek's own turn markers, DSML tool calls and <think> reasoning (text/formats/dsml.py), detected from
    # the file's template; the built-in one (templates/deepseek.jinja) for a file without
    formats=Formats(chat="deepseek", tool="dsml", reasoning="think"),
    hyper=HyperNames(keys=HYPER_KEYS, layer=HYPER_LAYER, model=HYPER_MODEL),
)
