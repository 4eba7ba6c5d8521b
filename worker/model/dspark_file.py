"""`--spec dspark:PATH`: DeepSeek V4's DSpark block drafter, read from its own GGUF beside a trunk file.

llama.cpp's converter writes the drafter as a file of architecture `dflash` (conversion/deepseek.py,
DeepseekV4DSparkModel) and llama-server drafts with it as `-md PATH --spec-type draft-dspark`
(src/models/dflash.cpp, graph_dsv4; common/speculative.cpp). It holds a few DeepSeek V4 blocks ("stages":
hyper-connections, a window-only attention with sinks, learned routing and a shared expert) under the
trunk's tensor names, `fc` (the trunk's features at the target layers to one hidden vector), its norm, the
hyper-connection head and output norm, and two heads: the Markov head (markov_w1, markov_w2: a bias on each
slot's logits from the token before it) and the confidence head (conf_proj). It has no embeddings and no
output matrix: the trunk's serve. Its keys are DeepSeek V4's under `dflash.`, plus the target layers (the
trunk's layer inputs it reads, n_layers meaning the streams after the last), the trained block size and
the filler token of a block's slots after the first (tokenizer.ggml.mask_token_id).

Here the file is checked against the trunk, one line for each way llama.cpp would refuse the pair or
compute something else than backends/numpy/dspark.py does, and read into a DeepSeek V4 config of its
stages (the trunk's, with the drafter's settings), so that the stages run through the numpy HyperStack's
own pieces.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import numpy as np

from .config import ModelConfig
from .gguf_file import GGUFFile, ModelFileError
from .loader import Model
from .weights import ModelWeights, load_tensors

ARCH = "dflash"
MARKOV_IN, MARKOV_OUT, CONFIDENCE = "markov_w1.weight", "markov_w2.weight", "conf_proj.weight"
# what the DeepSeek V4 graph of the drafter reads beside its stages (dflash.cpp: fc.scale, markov_w2.scale
# and conf_proj.bias are optional, and refused below where present: the reference has no place for them)
GLOBAL = ("fc.weight", "enc.output_norm.weight", "output_norm.weight", "output_hc_fn.weight",
          "output_hc_base.weight", "output_hc_scale.weight", MARKOV_IN, MARKOV_OUT)
NOT_READ = ("fc.scale", "markov_w2.scale", "conf_proj.bias", "token_embd.weight", "output.weight", "d2t")
# a stage's tensors: a window-only DeepSeek V4 layer with a learned router (no compressor, no indexer,
# no hash routing), as dflash.cpp creates them
STAGE = ("attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight",
         "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
         "hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight", "hc_ffn_fn.weight",
         "hc_ffn_base.weight", "hc_ffn_scale.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias",
         "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight",
         "ffn_up_shexp.weight", "ffn_down_shexp.weight")
SQRT_SOFTPLUS = 4  # llama.cpp's expert_gating_func for DeepSeek V4's sqrt(softplus) scores: the only one it takes
DEFAULT_BLOCK_SIZE = 16  # common/speculative.cpp's where the key is absent


@dataclasses.dataclass
class DSparkFile:
    """A DSpark drafter file checked against its trunk."""

    gguf: GGUFFile
    config: ModelConfig  # the stages as a DeepSeek V4 stack: the trunk's config with the drafter's settings
    target_layers: tuple[int, ...]  # the trunk layer inputs its features are read at (n_layers: after the last)
    block_size: int  # the longest block it drafts
    mask_token: int  # the filler of a block's slots after the first

    @property
    def fingerprint(self) -> str:
        return self.gguf.fingerprint

    @property
    def key_width(self) -> int:
        """What it keeps per position of the trunk's pass: one key row a stage (the pool's extra columns)."""
        return self.config.n_layers * self.config.head_dim

    def weights(self, trunk: ModelWeights) -> ModelWeights:
        """Its tensors by name, with the trunk's embeddings and output matrix (which it reads as its own)."""
        arrays = load_tensors(self.gguf, list(self.gguf.tensors))
        t = self.config.family.tensors
        arrays[t.token_embd], arrays[t.output] = trunk.by_name[t.token_embd], trunk.by_name[t.output]
        return ModelWeights(token_embd=arrays[t.token_embd], output=arrays[t.output],
                            output_norm=arrays[t.output_norm], layers=[], by_name=arrays,
                            nbytes=sum(a.nbytes for n, a in arrays.items() if n in self.gguf.tensors))


def open_dspark_file(path: str | Path, model: Model) -> DSparkFile:
    """The drafter at `path` for the trunk `model`, or a one-line ModelFileError naming the file."""
    return check_dspark(GGUFFile(Path(path).expanduser()), model)


def check_dspark(g: GGUFFile, model: Model) -> DSparkFile:
    """g checked against the trunk as llama.cpp would draft with the pair."""
    cfg, name = model.config, model.path.name
    if cfg.hyper is None or cfg.family.hyper is None:
        raise ModelFileError(g.path, f"a DSpark drafter needs a deepseek4 model; {name} is {cfg.arch}")
    if g.architecture != ARCH:
        raise ModelFileError(g.path, f"architecture {g.architecture}, not a DSpark drafter ({ARCH})")
    if not int(g.get(f"{ARCH}.hyper_connection.count", 0)):
        raise ModelFileError(g.path, f"not a DeepSeek V4 drafter ({ARCH}.hyper_connection.count is 0)")
    if MARKOV_IN not in g.tensors:
        raise ModelFileError(g.path, f"no Markov head ({MARKOV_IN}): a DFlash drafter, not DSpark")
    hidden = _int(g, "embedding_length")
    if hidden != cfg.hidden:
        raise ModelFileError(g.path, f"{ARCH}.embedding_length is {hidden}, {name}'s hidden size is {cfg.hidden}")
    vocab = g.tensors[MARKOV_IN].shape[-1]
    tokens = g.get("tokenizer.ggml.tokens")
    if vocab != cfg.vocab_size or (tokens is not None and len(tokens) != cfg.vocab_size):
        n = vocab if vocab != cfg.vocab_size else len(tokens)
        raise ModelFileError(g.path, f"its vocabulary ({n} tokens) is not {name}'s ({cfg.vocab_size})")
    targets = tuple(int(t) for t in np.atleast_1d(np.asarray(g.get(f"{ARCH}.target_layers", []))))
    if not targets or not all(0 <= t <= cfg.n_layers for t in targets):
        raise ModelFileError(g.path, f"{ARCH}.target_layers {list(targets)} are not within {name}'s 0 to "
                                     f"{cfg.n_layers} (the layer inputs, and the streams after the last)")
    stages = _int(g, "block_count")
    _check_settings(g, stages)
    stage_cfg = _stage_config(g, cfg, stages)
    _check_tensors(g, stage_cfg, stages, len(targets))
    mask = g.get("tokenizer.ggml.mask_token_id")
    if mask is None or not 0 <= int(mask) < cfg.vocab_size:
        raise ModelFileError(g.path, f"tokenizer.ggml.mask_token_id is {mask}: a block's filler token is needed")
    block = int(g.get(f"{ARCH}.block_size", DEFAULT_BLOCK_SIZE))
    if block < 1:
        raise ModelFileError(g.path, f"{ARCH}.block_size is {block}")
    return DSparkFile(g, stage_cfg, targets, block, int(mask))


def _int(g: GGUFFile, key: str) -> int:
    value = g.get(f"{ARCH}.{key}")
    if value is None:
        raise ModelFileError(g.path, f"metadata is missing {ARCH}.{key}")
    return int(value)


def _check_settings(g: GGUFFile, stages: int) -> None:
    """What the reference computes as llama.cpp's DeepSeek V4 drafter graph does, and nothing else."""
    ratios = np.atleast_1d(np.asarray(g.get(f"{ARCH}.attention.compress_ratios", [0] * stages)))
    if ratios.any():  # dflash.cpp asserts it: every stage is window-only
        raise ModelFileError(g.path, f"compress ratios {ratios.tolist()} (a drafter's stages are window-only: 0)")
    gating = int(g.get(f"{ARCH}.expert_gating_func", SQRT_SOFTPLUS))
    if gating != SQRT_SOFTPLUS:
        raise ModelFileError(g.path, f"{ARCH}.expert_gating_func is {gating} "
                                     f"(supported: {SQRT_SOFTPLUS}, sqrt-softplus)")
    if _int(g, "attention.sliding_window") < 1:
        raise ModelFileError(g.path, f"{ARCH}.attention.sliding_window must be at least 1")
    if str(g.get(f"{ARCH}.sample_from_anchor", True)).lower() != "true":
        raise ModelFileError(g.path, f"{ARCH}.sample_from_anchor is false (a bonus-anchor export; supported: true)")
    if str(g.get(f"{ARCH}.attention.causal", False)).lower() == "true":
        raise ModelFileError(g.path, f"{ARCH}.attention.causal is true (supported: a non-causal block)")


def _stage_config(g: GGUFFile, cfg: ModelConfig, stages: int) -> ModelConfig:
    """The stages as a DeepSeek V4 stack of their own: the trunk's config with the drafter's settings, every
    layer window-only and learned-routed."""
    assert cfg.hyper is not None and cfg.family.hyper is not None
    hyper_keys = {f: k.replace(f"{cfg.arch}.", f"{ARCH}.", 1) for f, k in cfg.family.hyper.keys.items()}

    def hyper(field: str, cast=int):
        return cast(g.get(hyper_keys[field], getattr(cfg.hyper, field)))

    def clamps(field: str, default: tuple[float, ...] | None) -> tuple[float, ...]:
        value = g.get(hyper_keys[field])
        if value is None:
            if default is None:
                raise ModelFileError(g.path, f"metadata is missing {hyper_keys[field]}")
            return default
        flat = np.atleast_1d(np.asarray(value, np.float64))
        if flat.size not in (1, stages):
            raise ModelFileError(g.path, f"{hyper_keys[field]} has {flat.size} entries for {stages} stages")
        return tuple(float(v) for v in np.broadcast_to(flat, (stages,)))

    exp = clamps("swiglu_clamp_exp", None)
    h = msgspec.structs.replace(
        cfg.hyper, window=_int(g, "attention.sliding_window"), n_rot=hyper("n_rot"), q_lora_rank=hyper("q_lora_rank"),
        o_groups=hyper("o_groups"), o_lora_rank=hyper("o_lora_rank"), compress_ratios=(0,) * stages, hash_layers=0,
        n_shared=hyper("n_shared"), expert_weights_scale=hyper("expert_weights_scale", float),
        expert_weights_norm=bool(g.get(hyper_keys["expert_weights_norm"], cfg.hyper.expert_weights_norm)),
        swiglu_clamp_exp=exp, swiglu_clamp_shexp=clamps("swiglu_clamp_shexp", exp), hc_mult=hyper("hc_mult"),
        hc_sinkhorn_iters=hyper("hc_sinkhorn_iters"), hc_eps=hyper("hc_eps", float), nextn_layers=0)
    heads = _int(g, "attention.head_count")
    head_dim = int(g.get(f"{ARCH}.attention.key_length", cfg.head_dim))
    return msgspec.structs.replace(
        cfg, n_layers=stages, n_heads=heads, n_kv_heads=1, head_dim=head_dim,
        norm_eps=float(_req_float(g, "attention.layer_norm_rms_epsilon")),
        rope_base=float(g.get(f"{ARCH}.rope.freq_base", 10000.0)), rope_yarn=None,
        n_experts=int(g.get(f"{ARCH}.expert_count", cfg.n_experts)),
        n_experts_used=int(g.get(f"{ARCH}.expert_used_count", cfg.n_experts_used)),
        expert_ffn=int(g.get(f"{ARCH}.expert_feed_forward_length", cfg.expert_ffn)),
        local_layers=(True,) * stages, hyper=h)


def _req_float(g: GGUFFile, key: str) -> float:
    value = g.get(f"{ARCH}.{key}")
    if value is None:
        raise ModelFileError(g.path, f"metadata is missing {ARCH}.{key}")
    return float(value)


def _check_tensors(g: GGUFFile, stage: ModelConfig, stages: int, n_targets: int) -> None:
    """Every tensor the drafter's graph reads, `fc` as wide as its target layers' features, and none it would
    read that the reference does not."""
    for n in [*GLOBAL, *(f"blk.{s}.{t}" for s in range(stages) for t in STAGE)]:
        if n not in g.tensors:
            raise ModelFileError(g.path, f"missing tensor {n}")
    extra = [n for n in NOT_READ if n in g.tensors]
    if extra:
        raise ModelFileError(g.path, f"tensor {extra[0]} (the reference reads the trunk's, unscaled, without it)")
    fc = list(g.tensors["fc.weight"].shape)
    if fc != [n_targets * stage.hidden, stage.hidden]:
        raise ModelFileError(g.path, f"tensor fc.weight has shape {fc}, not [{n_targets * stage.hidden}, "
                                     f"{stage.hidden}] ({n_targets} target layers)")
    rank = g.tensors[MARKOV_IN].shape[0]
    if list(g.tensors[MARKOV_OUT].shape) != list(g.tensors[MARKOV_IN].shape):
        raise ModelFileError(g.path, f"tensor {MARKOV_OUT} has shape {list(g.tensors[MARKOV_OUT].shape)}, "
                                     f"{MARKOV_IN} has {list(g.tensors[MARKOV_IN].shape)}")
    if CONFIDENCE in g.tensors and list(g.tensors[CONFIDENCE].shape) != [stage.hidden + rank, 1]:
        raise ModelFileError(g.path, f"tensor {CONFIDENCE} has shape {list(g.tensors[CONFIDENCE].shape)}, not "
                                     f"[{stage.hidden + rank}, 1]")
