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
join the trunk's by name, so backends/numpy/mtp.MtpHead reads the layer as it reads one stored in the trunk's
file. Its model-level tensors join under "mtp." names where their bytes differ from the trunk's (the
head prefers them, as llama.cpp's graph reads its own model's); equal ones are not loaded twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import msgspec
import numpy as np

from .arch.recipe import Family
from .config import ModelConfig
from .gguf_file import GGUFFile, ModelFileError
from .loader import Model
from .weights import ModelWeights, load_tensors

# a next-token layer is a window-only layer (compress ratio 0) with a learned router, as llama.cpp's
# load_arch_tensors requires it past the trunk: the family's layer roles but these
NOT_IN_THE_LAYER = ("compressor_", "indexer_", "token_to_experts")
# and the nextn tensors beside eh_proj (the family's table names that one, backends/numpy/mtp.py reads these)
NEXTN = ("nextn.enorm.weight", "nextn.hnorm.weight")
OWN = "mtp."  # the prefix of the file's model-level tensors where they are not the trunk's
# the settings a layer must share with its trunk to run on the trunk's streams (beside the vocabulary):
# MetadataKeys' and the stack's own (HyperNames.keys), not those of the trunk's layers alone
SHARED = ("embedding_length", "head_count", "key_length", "rms_eps", "rope_freq_base", "expert_count",
          "expert_used_count", "expert_feed_forward_length")
SHARED_HYPER = ("window", "n_rot", "q_lora_rank", "o_groups", "o_lora_rank", "n_shared", "expert_gating",
                "expert_weights_scale", "expert_weights_norm", "hc_mult", "hc_sinkhorn_iters", "hc_eps")


def layer_tensors(family: Family) -> list[str]:
    """The names after `blk.N.` that a next-token layer of `family` must have."""
    assert family.hyper is not None
    roles = {**family.tensors.layer, **family.hyper.layer}
    return [*(name for role, name in roles.items() if not role.startswith(NOT_IN_THE_LAYER)), *NEXTN]


def model_tensors(family: Family) -> list[str]:
    """The model-level tensors a next-token layer's file holds: its graph reads them from its own model."""
    assert family.hyper is not None
    t = family.tensors
    return [t.token_embd, t.output_norm, t.output, *family.hyper.model.values()]


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
        own = [n for n in model_tensors(self.config.family) if not _same_bytes(g, n, self.trunk)]
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
    a, family = cfg.arch, cfg.family
    if cfg.hyper is None or family.hyper is None:
        raise ModelFileError(g.path, f"a next-token layer file needs a deepseek4 model; {model.path.name} is {a}")
    if cfg.hyper.nextn_layers:
        raise ModelFileError(g.path, f"{model.path.name} carries its own next-token layer; use --spec mtp")
    if g.architecture != a:
        raise ModelFileError(g.path, f"architecture {g.architecture}, the model's is {a}")
    hkeys = family.hyper.keys
    il = _layer_index(g, model, hkeys)
    _check_tensors(g, model, il)
    eh = family.hyper.layer_name(il, "nextn_eh_proj")
    if list(g.tensors[eh].shape) != [2 * cfg.hidden, cfg.hidden]:
        raise ModelFileError(g.path, f"tensor {eh} has shape {list(g.tensors[eh].shape)}, not "
                                     f"[{2 * cfg.hidden}, {cfg.hidden}]")
    ratios = np.atleast_1d(np.asarray(g.get(hkeys["compress_ratios"], [])))
    if len(ratios) <= il or int(ratios[il]):  # llama.cpp's MTP graph attends over a plain windowed cache
        raise ModelFileError(g.path, f"the next-token layer's compress ratio is "
                                     f"{int(ratios[il]) if len(ratios) > il else 'missing'} (supported: 0)")
    if il < cfg.hyper.hash_layers:  # its graph routes by the learned router only
        raise ModelFileError(g.path, f"a hash-routed next-token layer ({cfg.hyper.hash_layers} hash layers)")
    exp = _clamp(g, hkeys["swiglu_clamp_exp"], None, il)
    shexp = _clamp(g, hkeys["swiglu_clamp_shexp"], exp, il)
    hyper = msgspec.structs.replace(cfg.hyper, nextn_layers=1, swiglu_clamp_exp=(*cfg.hyper.swiglu_clamp_exp, exp),
                                    swiglu_clamp_shexp=(*cfg.hyper.swiglu_clamp_shexp, shexp))
    return MtpFile(g, trunk, msgspec.structs.replace(cfg, hyper=hyper))


def _layer_index(g: GGUFFile, model: Model, hkeys: Mapping[str, str]) -> int:
    """The index of g's next-token layer, checked: it follows the trunk's layers, and the settings the two must
    share are equal."""
    cfg, trunk, keys = model.config, model.gguf, model.config.family.keys
    nextn = int(g.get(hkeys["nextn_layers"], 0))
    if nextn < 1:
        raise ModelFileError(g.path, f"no next-token layer ({hkeys['nextn_layers']} is {nextn})")
    il = int(g.get(keys.block_count, 0)) - nextn
    if il != cfg.n_layers:
        raise ModelFileError(g.path, f"its next-token layer follows {il} trunk layers, {model.path.name} has "
                                     f"{cfg.n_layers}")
    for key in [getattr(keys, k) for k in SHARED] + [hkeys[k] for k in SHARED_HYPER]:
        ours, theirs = trunk.get(key), g.get(key)
        if not np.array_equal(np.asarray(ours), np.asarray(theirs)):
            raise ModelFileError(g.path, f"{key} is {theirs}, {model.path.name}'s is {ours}")
    return il


def _check_tensors(g: GGUFFile, model: Model, il: int) -> None:
    """The trunk's vocabulary, and every tensor of the layer (il) and of the model its graph reads, shaped as
    the trunk's."""
    cfg, trunk, family = model.config, model.gguf, model.config.family
    tokens, ours_tokens = g.get("tokenizer.ggml.tokens"), trunk.get("tokenizer.ggml.tokens")
    embd = g.tensors.get(family.tensors.token_embd)
    if embd is None or embd.shape != trunk.tensors[family.tensors.token_embd].shape or \
            list(tokens or []) != list(ours_tokens or []):
        n = len(tokens) if tokens is not None else "no"
        raise ModelFileError(g.path, f"its vocabulary ({n} tokens) is not {model.path.name}'s ({cfg.vocab_size}): "
                                     "a next-token layer must share the model's tokenizer")
    layer = layer_tensors(family)
    for name in [*(f"blk.{il}.{n}" for n in layer), *model_tensors(family)]:
        if name not in g.tensors:
            raise ModelFileError(g.path, f"missing tensor {name}")
    for n in layer:  # each the shape of the trunk's where a trunk layer has it
        like = next((f"blk.{li}.{n}" for li in range(cfg.n_layers) if f"blk.{li}.{n}" in trunk.tensors), None)
        if like is not None and trunk.tensors[like].shape != g.tensors[f"blk.{il}.{n}"].shape:
            raise ModelFileError(g.path, f"tensor blk.{il}.{n} has shape {list(g.tensors[f'blk.{il}.{n}'].shape)}, "
                                         f"{like} of {model.path.name} has {list(trunk.tensors[like].shape)}")


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
