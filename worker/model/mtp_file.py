"""`--spec mtp:PATH`: DeepSeek V4's next-token (MTP) layer read from its own GGUF, beside a trunk file.

llama.cpp's converter writes DeepSeek V4 without the layer by default (conversion/deepseek.py,
DeepseekV4Model: the checkpoint's mtp.* tensors are skipped, no nextn_predict_layers) and the layer
alone with --mtp, as "mtp-NAME.gguf": architecture deepseek4, block_count over trunk and layer,
nextn_predict_layers, the layer's block at blk.{trunk layers} (its nextn.eh_proj, enorm, hnorm and
shared_head_norm beside a window-only attention and a learned router's MoE), and the model-level
tensors its graph reads from its own model: token_embd, output_norm, output, and the layer's own
hyper-connection head (the checkpoint's mtp.0.hc_head_* under the root names output_hc_*). llama.cpp
loads that file as a model of its own whose trunk tensors are absent (src/models/deepseek4.cpp: "mtp_only"
when blk.0.attn_norm.weight is missing) and runs its MTP graph on it, fed the trunk context's streams
(common/speculative.cpp, draft-mtp with -md PATH).

Here the file is checked against the trunk (one line for each way a pair can disagree) and its tensors
join the trunk's by name, so numpy_mtp.MtpHead reads the layer as it reads one stored in the trunk's
file. Its model-level tensors join under "mtp." names where their bytes differ from the trunk's (the
head prefers them, as llama.cpp's graph reads its own model's); equal ones are not loaded twice.
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

# the layer's block as llama.cpp's load_arch_tensors requires it past the trunk: a window-only layer's
# attention (compress ratio 0) and a learned router's MoE, then the nextn tensors its MTP graph asserts
LAYER = ("attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight",
         "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
         "hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight", "hc_ffn_fn.weight",
         "hc_ffn_base.weight", "hc_ffn_scale.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias",
         "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight",
         "ffn_up_shexp.weight", "ffn_down_shexp.weight", "nextn.eh_proj.weight", "nextn.enorm.weight",
         "nextn.hnorm.weight")
OPTIONAL = ("nextn.shared_head_norm.weight", "nextn.embed_tokens.weight", "nextn.shared_head_head.weight")
# the file's own model-level tensors (all required by llama.cpp's loader)
GLOBALS = ("token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
           "output_hc_base.weight", "output_hc_scale.weight")
OWN = "mtp."  # the prefix of the file's model-level tensors where they are not the trunk's
# the keys a layer must share with its trunk to run on the trunk's streams (beside the vocabulary)
SHARED_KEYS = ("embedding_length", "embedding_length_out", "head_count", "attention.key_length",
               "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
               "attention.sliding_window", "attention.q_lora_rank", "attention.output_group_count",
               "attention.output_lora_rank", "expert_count", "expert_used_count", "expert_feed_forward_length",
               "expert_shared_count", "expert_weights_scale", "expert_weights_norm", "expert_gating_func",
               "hyper_connection.count", "hyper_connection.sinkhorn_iterations", "hyper_connection.epsilon")


@dataclasses.dataclass
class MtpFile:
    """A next-token layer file checked against its trunk: the trunk's config with the layer, and the files."""

    gguf: GGUFFile
    trunk: GGUFFile
    config: ModelConfig  # the trunk's, with nextn_layers 1 and the layer's clamps

    @property
    def fingerprint(self) -> str:
        return self.gguf.fingerprint

    def attach(self, weights: ModelWeights) -> ModelWeights:
        """The trunk's weights with the layer's, and the file's model-level tensors that are not the trunk's."""
        g, il = self.gguf, self.config.n_layers
        names = [n for n in g.tensors if n.startswith(f"blk.{il}.")]
        own = [n for n in GLOBALS if not _same_bytes(g, n, self.trunk)]
        arrays = load_tensors(g, names + own)
        by_name = dict(weights.by_name)
        by_name.update({n: arrays[n] for n in names})
        by_name.update({OWN + n: arrays[n] for n in own})
        return dataclasses.replace(weights, by_name=by_name,
                                   nbytes=weights.nbytes + sum(a.nbytes for a in arrays.values()))


def open_mtp_file(path: str | Path, model: Model) -> MtpFile:
    """The next-token layer at `path` for the trunk `model`, or a one-line ModelFileError naming the file."""
    return check_pair(GGUFFile(Path(path).expanduser()), model)


def check_pair(g: GGUFFile, model: Model) -> MtpFile:
    """g checked against the trunk as llama.cpp would run them together (and where it would not notice a
    mismatch, as its MTP context only checks the streams' width)."""
    cfg, trunk = model.config, model.gguf
    a = cfg.arch
    if cfg.hyper is None:
        raise ModelFileError(g.path, f"a next-token layer file needs a deepseek4 model; {model.path.name} is {a}")
    if cfg.hyper.nextn_layers:
        raise ModelFileError(g.path, f"{model.path.name} carries its own next-token layer; use --spec mtp")
    if g.architecture != a:
        raise ModelFileError(g.path, f"architecture {g.architecture}, the model's is {a}")
    nextn = int(g.get(f"{a}.nextn_predict_layers", 0))
    if nextn < 1:
        raise ModelFileError(g.path, f"no next-token layer ({a}.nextn_predict_layers is {nextn})")
    il = int(g.get(f"{a}.block_count", 0)) - nextn
    if il != cfg.n_layers:
        raise ModelFileError(g.path, f"its next-token layer follows {il} trunk layers, {model.path.name} has "
                                     f"{cfg.n_layers}")
    for key in SHARED_KEYS:
        ours, theirs = trunk.get(f"{a}.{key}"), g.get(f"{a}.{key}")
        if not np.array_equal(np.asarray(ours), np.asarray(theirs)):
            raise ModelFileError(g.path, f"{a}.{key} is {theirs}, {model.path.name}'s is {ours}")
    tokens, ours_tokens = g.get("tokenizer.ggml.tokens"), trunk.get("tokenizer.ggml.tokens")
    embd = g.tensors.get("token_embd.weight")
    if embd is None or embd.shape != trunk.tensors["token_embd.weight"].shape or \
            list(tokens or []) != list(ours_tokens or []):
        n = len(tokens) if tokens is not None else "no"
        raise ModelFileError(g.path, f"its vocabulary ({n} tokens) is not {model.path.name}'s ({cfg.vocab_size}): "
                                     "a next-token layer must share the model's tokenizer")
    for name in [*(f"blk.{il}.{n}" for n in LAYER), *GLOBALS]:
        if name not in g.tensors:
            raise ModelFileError(g.path, f"missing tensor {name}")
    for name in (f"blk.{il}.{n}" for n in LAYER):  # each the shape of the trunk's where a trunk layer has it
        like = next((f"blk.{li}.{name.split('.', 2)[2]}" for li in range(cfg.n_layers)
                     if f"blk.{li}.{name.split('.', 2)[2]}" in trunk.tensors), None)
        if like is not None and trunk.tensors[like].shape != g.tensors[name].shape:
            raise ModelFileError(g.path, f"tensor {name} has shape {list(g.tensors[name].shape)}, {like} of "
                                         f"{model.path.name} has {list(trunk.tensors[like].shape)}")
    eh = g.tensors[f"blk.{il}.nextn.eh_proj.weight"].shape
    if list(eh) != [2 * cfg.hidden, cfg.hidden]:
        raise ModelFileError(g.path, f"tensor blk.{il}.nextn.eh_proj.weight has shape {list(eh)}, not "
                                     f"[{2 * cfg.hidden}, {cfg.hidden}]")
    ratios = np.atleast_1d(np.asarray(g.get(f"{a}.attention.compress_ratios", [])))
    if len(ratios) <= il or int(ratios[il]):  # llama.cpp's MTP graph attends over a plain windowed cache
        raise ModelFileError(g.path, f"the next-token layer's compress ratio is "
                                     f"{int(ratios[il]) if len(ratios) > il else 'missing'} (supported: 0)")
    if il < cfg.hyper.hash_layers:  # its graph routes by the learned router only
        raise ModelFileError(g.path, f"a hash-routed next-token layer ({cfg.hyper.hash_layers} hash layers)")
    exp = _clamp(g, f"{a}.swiglu_clamp_exp", None, il)
    shexp = _clamp(g, f"{a}.swiglu_clamp_shexp", exp, il)
    hyper = msgspec.structs.replace(cfg.hyper, nextn_layers=1,
                                    swiglu_clamp_exp=(*cfg.hyper.swiglu_clamp_exp, exp),
                                    swiglu_clamp_shexp=(*cfg.hyper.swiglu_clamp_shexp, shexp))
    return MtpFile(g, trunk, msgspec.structs.replace(cfg, hyper=hyper))


def _clamp(g: GGUFFile, key: str, default: float | None, il: int) -> float:
    """Layer il's entry of a per-layer clamp (one value for all layers, or one a layer)."""
    value = g.get(key, default)
    if value is None:
        raise ModelFileError(g.path, f"metadata is missing {key}")
    flat = np.atleast_1d(np.asarray(value, np.float64))
    if 1 < flat.size <= il:
        raise ModelFileError(g.path, f"{key} has {flat.size} entries for {il + 1} layers")
    return float(flat[il] if flat.size > 1 else flat[0])


def _same_bytes(g: GGUFFile, name: str, trunk: GGUFFile) -> bool:
    a, b = g.tensors[name], trunk.tensors.get(name)
    return (b is not None and a.ggml_type == b.ggml_type and a.shape == b.shape
            and np.array_equal(g.raw(name), trunk.raw(name)))
