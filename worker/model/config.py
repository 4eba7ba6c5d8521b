"""One typed model configuration for every supported architecture, read from GGUF metadata."""

from __future__ import annotations

import math

import msgspec

from ember.kernels.quants import SUPPORTED_TYPES

from .gguf_file import GGUFFile, ModelFileError

SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")


class ModelConfig(msgspec.Struct, frozen=True):
    arch: str
    name: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_base_local: float  # sliding-window layers (gemma3); equal to rope_base elsewhere
    rope_scale: float  # linear position scaling of the global layers (1.0 = none)
    rope_neox: bool  # rotate halves (neox) rather than adjacent pairs (llama's "normal")
    attn_scale: float
    sliding_window: int  # 0 = none
    local_layers: tuple[bool, ...]  # per layer: uses the sliding window (and the local rope base)
    qk_norm: bool
    post_norms: bool  # gemma: norms after attention and after the MLP
    qkv_bias: bool
    embed_scale: float
    act: str  # "silu" or "gelu_tanh"
    tied_output: bool

    def is_local_layer(self, layer: int) -> bool:
        return bool(self.sliding_window) and self.local_layers[layer]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _req(g: GGUFFile, key: str):
    value = g.get(key)
    if value is None:
        raise ModelFileError(g.path, f"metadata is missing {key}")
    return value


def read_config(g: GGUFFile) -> ModelConfig:
    arch = g.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            g.path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for info in g.tensors.values():
        if info.ggml_type not in SUPPORTED_TYPES:
            names = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ModelFileError(
                g.path, f"tensor {info.name} has unsupported quant type {info.ggml_type.name} (supported: {names})"
            )
    hidden = int(_req(g, f"{arch}.embedding_length"))
    n_heads = int(_req(g, f"{arch}.attention.head_count"))
    n_kv = g.get(f"{arch}.attention.head_count_kv", n_heads)
    if not isinstance(n_kv, int):  # per-layer arrays exist in some files; we need one value
        n_kv = int(n_kv[0])
    head_dim = int(g.get(f"{arch}.attention.key_length", hidden // n_heads))
    if int(g.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelFileError(g.path, "unsupported: value head size differs from key head size")
    if n_heads % n_kv:
        raise ModelFileError(g.path, f"corrupt: {n_heads} heads are not a multiple of {n_kv} kv heads")
    tokens = g.get("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFileError(g.path, "missing tensor token_embd.weight")
    vocab = int(embd.shape[1])
    if tokens is not None and len(tokens) != vocab:
        raise ModelFileError(g.path, f"vocabulary has {len(tokens)} tokens but token_embd has {vocab} rows")
    rope_base = float(g.get(f"{arch}.rope.freq_base", 10000.0))
    scaling_type = g.get(f"{arch}.rope.scaling.type", "none")
    factor = float(g.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling_type not in ("none", "linear") and factor != 1.0:
        raise ModelFileError(g.path, f"unsupported rope scaling {scaling_type!r}")
    gemma = arch == "gemma3"
    sliding = int(g.get(f"{arch}.attention.sliding_window", 0)) if gemma else 0
    n_layers = int(_req(g, f"{arch}.block_count"))
    local_layers = _local_layers(g, arch, n_layers) if sliding else (False,) * n_layers
    return ModelConfig(
        arch=arch,
        name=str(g.get("general.name", g.path.stem)),
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(_req(g, f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=int(g.get(f"{arch}.context_length", 4096)),
        norm_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=rope_base,
        # llama.cpp hard-codes 10k for gemma3's local layers; honour the key where a file has it
        rope_base_local=float(g.get(f"{arch}.rope.freq_base_swa", 10000.0)) if gemma else rope_base,
        rope_scale=1.0 / factor if scaling_type == "linear" or (gemma and factor != 1.0) else 1.0,
        rope_neox=arch != "llama",
        attn_scale=1.0 / math.sqrt(head_dim),
        sliding_window=sliding,
        local_layers=local_layers,
        qk_norm=arch in ("gemma3", "qwen3"),
        post_norms=gemma,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        act="gelu_tanh" if gemma else "silu",
        tied_output="output.weight" not in g.tensors,
    )


def _local_layers(g: GGUFFile, arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: `attention.sliding_window_pattern` as a period
    (layer il is local when il % period < period - 1, llama.cpp's rule, default 6) or as a
    per-layer array of booleans."""
    pattern = g.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, int):
        return tuple(pattern > 0 and il % pattern < pattern - 1 for il in range(n_layers))
    flags = [bool(x) for x in pattern]
    if len(flags) != n_layers:
        raise ModelFileError(g.path, f"sliding_window_pattern has {len(flags)} entries for {n_layers} layers")
    return tuple(flags)
