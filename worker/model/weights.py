"""Float32 weights for the numpy backend, dequantized once and cached on disk.

Dequantizing a whole model takes seconds; a worker that restarts after a crash must be serving
again at once. The first load writes each tensor as a .npy file in the model's cache folder (keyed
by the model fingerprint); later loads memory-map those files, so start-up costs nothing and the
page cache shares the weights between restarts.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from gguf.constants import GGMLQuantizationType

from ember.kernels.quants import UnsupportedQuantError, dequantize

from ..paths import model_cache_dir
from .arch import layer_tensors
from .config import ModelConfig
from .gguf_file import GGUFFile, ModelFileError

CACHE_VERSION = 2

# Projections that read the same input are stacked into one matrix: one product instead of two or
# three per layer (the decode step is a chain of small matrix-vector products, each with overhead).
_STACKS = {
    "wqkv": ("wq", "wk", "wv"),
    "bqkv": ("bq", "bk", "bv"),
    "w_gate_up": ("w_gate", "w_up"),
}


@dataclass
class LayerWeights:
    """One layer's weights by role (arch/recipe.py's ROLES, stacked as _STACKS says); a role that
    the family's recipe (or, for optional ones, the file) lacks is None."""

    attn_norm: np.ndarray
    wqkv: np.ndarray  # q, k and v stacked by rows
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate_up: np.ndarray | None = None  # a dense MLP: gate and up stacked by rows
    w_down: np.ndarray | None = None
    router: np.ndarray | None = None  # a mixture of experts: [experts, hidden]
    gate_exps: np.ndarray | None = None  # [experts, expert ffn, hidden]
    up_exps: np.ndarray | None = None
    down_exps: np.ndarray | None = None  # [experts, hidden, expert ffn]
    router_b: np.ndarray | None = None  # gpt-oss: biases of the router and the experts' matrices
    gate_exps_b: np.ndarray | None = None  # [experts, expert ffn]
    up_exps_b: np.ndarray | None = None
    down_exps_b: np.ndarray | None = None  # [experts, hidden]
    bqkv: np.ndarray | None = None
    bo: np.ndarray | None = None  # the output projection's bias (gpt-oss)
    sinks: np.ndarray | None = None  # [heads]: attention sink logits (gpt-oss)
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


@dataclass
class ModelWeights:
    token_embd: np.ndarray  # [vocab, hidden]
    output: np.ndarray  # [vocab, hidden]; the same array as token_embd when tied
    output_norm: np.ndarray
    layers: list[LayerWeights]
    rope_freqs: np.ndarray | None = None  # llama 3.1 style per-dimension frequency factors
    nbytes: int = field(default=0)
    # a HYPER stack (recipe.Stack): every tensor of the file by its name (layers stays empty); index
    # tables (I32) as int32, the rest float32
    by_name: dict[str, Any] = field(default_factory=dict)  # arrays, and QuantExperts where experts stay quantized


def _expected_shape(g: GGUFFile, name: str) -> tuple[int, ...]:
    return tuple(reversed(g.tensors[name].shape))


def load_weights(
    g: GGUFFile, config: ModelConfig, *, progress: Callable[[int, int], None] | None = None,
    lazy_experts: bool | None = None,
) -> ModelWeights:
    """Dequantize (first time) or memory-map (cached) every tensor the forward pass needs. lazy_experts
    (DeepSeek V4's stack): its experts as QuantExperts; None: where their float32 copy would not fit."""
    cache = model_cache_dir(g.fingerprint) / f"weights-f32-v{CACHE_VERSION}"
    for stale in cache.parent.glob("weights-f32-v*"):  # caches of older layouts are dead weight
        if stale != cache:
            shutil.rmtree(stale, ignore_errors=True)
    if config.hyper is not None:
        return _load_by_name(g, cache, progress, lazy_experts)
    names_of = config.family.tensors
    names = [names_of.token_embd, names_of.output_norm]
    if not config.tied_output:
        names.append(names_of.output)
    if names_of.rope_freqs is not None and names_of.rope_freqs in g.tensors:
        names.append(names_of.rope_freqs)
    plan = _plan(g, config, names, cache)
    _check_room(g, plan)
    total = sum(g.tensors[n].nbytes for f in plan for n in f.names)
    done = 0
    arrays: dict[str, np.ndarray] = {}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(config.n_layers)]
    for f in plan:
        arr = _load(g, f.names, f.path)
        if f.layer is None:
            arrays[f.role] = arr
        else:
            layers[f.layer][f.role] = arr
        done += sum(g.tensors[n].nbytes for n in f.names)
        if progress:
            progress(done, total)
    embd = arrays[names_of.token_embd]
    return ModelWeights(
        token_embd=embd,
        output=arrays.get(names_of.output, embd),
        output_norm=arrays[names_of.output_norm],
        layers=[LayerWeights(**t) for t in layers],
        rope_freqs=arrays.get(names_of.rope_freqs) if names_of.rope_freqs else None,
        nbytes=sum(a.nbytes for a in arrays.values()),
    )


class QuantExperts:
    """A mixture's expert matrices [experts, rows, cols] left in their GGUF blocks, an expert dequantized
    each time it is read (`experts[e]`): what the numpy reference reads where the float32 experts would fit
    neither the cache's disk nor the free memory (DeepSeek V4: 256 experts a layer, 200 GB for 8 layers in
    float32). A step then decodes the experts its tokens chose, so it is slower, not wrong: the values are
    dequantize()'s of the same blocks."""

    def __init__(self, g: GGUFFile, name: str):
        info = g.tensors[name]
        self.shape = _expected_shape(g, name)
        self.ggml_type = info.ggml_type
        self._raw = g.raw(name)
        self._per = info.nbytes // self.shape[0]
        self.nbytes = info.nbytes  # what it holds: the file's blocks (mapped, not copied)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> np.ndarray:
        e = int(e)
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"expert {e} of {self.shape[0]}")
        return dequantize(self._raw[e * self._per : (e + 1) * self._per], self.ggml_type, self.shape[1:])


def _is_experts(g: GGUFFile, name: str) -> bool:
    info = g.tensors[name]
    return name.endswith("_exps.weight") and len(info.shape) == 3 and info.ggml_type not in (
        GGMLQuantizationType.F32, GGMLQuantizationType.I32)


def _load_by_name(g: GGUFFile, cache: Path, progress: Callable[[int, int], None] | None,
                  lazy_experts: bool | None = None) -> ModelWeights:
    """Every tensor of the file by name (a HYPER stack reads its own)."""
    arrays = _by_name(g, list(g.tensors), cache, progress, lazy_experts)
    embd = arrays["token_embd.weight"]
    return ModelWeights(token_embd=embd, output=arrays.get("output.weight", embd),
                        output_norm=arrays["output_norm.weight"], layers=[],
                        nbytes=sum(a.nbytes for a in arrays.values()), by_name=arrays)


def load_tensors(g: GGUFFile, names: list[str]) -> dict[str, Any]:
    """The tensors `names` of a file that is not a model of its own (a next-token layer's file,
    model/mtp_file.py), through the file's own cache as load_weights reads a model's."""
    return _by_name(g, names, model_cache_dir(g.fingerprint) / f"weights-f32-v{CACHE_VERSION}", None, None)


def _by_name(g: GGUFFile, names: list[str], cache: Path, progress: Callable[[int, int], None] | None,
             lazy_experts: bool | None) -> dict[str, Any]:
    """Tensors by name, as _arrays reads them; lazy_experts: the experts among them as QuantExperts (None:
    where their float32 copy would not fit, so the reference still runs)."""
    experts = {n for n in names if _is_experts(g, n)}
    if lazy_experts is None:
        floats = [n for n in names if g.tensors[n].ggml_type != GGMLQuantizationType.I32]
        lazy_experts = bool(experts) and _room(g, [_CacheFile(cache / f"{n}.npy", [n], n) for n in floats]) is not None
    lazy = experts if lazy_experts else set()
    if lazy:
        print(f"ember: the experts' float32 weights do not fit; {len(lazy)} expert tensors stay quantized and "
              "each expert is dequantized when a step reads it (slower steps)", file=sys.stderr)
    arrays: dict[str, Any] = _arrays(g, [n for n in names if n not in lazy], cache, progress)
    arrays.update({n: QuantExperts(g, n) for n in lazy})
    return arrays


def _arrays(g: GGUFFile, names: list[str], cache: Path,
            progress: Callable[[int, int], None] | None) -> dict[str, np.ndarray]:
    """Tensors by name: floats through the cache as always, index tables as they are."""
    plan = [_CacheFile(cache / f"{n}.npy", [n], n) for n in names]
    _check_room(g, [f for f in plan if g.tensors[f.role].ggml_type != GGMLQuantizationType.I32])
    total, done = sum(g.tensors[n].nbytes for n in names), 0
    arrays: dict[str, np.ndarray] = {}
    for f in plan:
        info = g.tensors[f.role]
        if info.ggml_type == GGMLQuantizationType.I32:
            arrays[f.role] = g.raw(f.role).view("<i4").reshape(_expected_shape(g, f.role)).copy()
        else:
            arrays[f.role] = _load(g, f.names, f.path)
        done += info.nbytes
        if progress:
            progress(done, total)
    return arrays


@dataclass(frozen=True)
class _CacheFile:
    """One .npy file of the cache: the tensors `names` stacked by rows, for a model-level array (layer
    None, keyed by its tensor name) or a layer's role."""

    path: Path
    names: list[str]
    role: str
    layer: int | None = None


def _plan(g: GGUFFile, config: ModelConfig, names: list[str], cache: Path) -> list[_CacheFile]:
    """Every cache file the load reads or writes, in load order (stacks as _STACKS says)."""
    plan = [_CacheFile(cache / f"{n}.npy", [n], n) for n in names]
    for i in range(config.n_layers):
        present = dict(layer_tensors(g, config.family, i))
        for stack, members in _STACKS.items():
            if all(m in present for m in members):
                plan.append(_CacheFile(cache / f"blk.{i}.{stack}.npy", [present.pop(m) for m in members], stack, i))
        plan += [_CacheFile(cache / f"{name}.npy", [name], role, i) for role, name in present.items()]
    return plan


def _room(g: GGUFFile, plan: list[_CacheFile]) -> str | None:
    """Why the float32 weights the plan still has to write fit neither the cache's disk nor the free memory
    (None: they fit)."""
    need = sum(4 * g.tensors[n].n_elements for f in plan if not f.path.exists() for n in f.names)
    if need == 0:
        return None
    probe = plan[0].path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    disk = shutil.disk_usage(probe).free
    memory = psutil.virtual_memory().available
    if need > disk and need > memory:
        return (f"the numpy backend keeps float32 weights: {need / 1e9:.1f} GB, more than the {disk / 1e9:.1f} GB "
                f"free in {probe} and the {memory / 1e9:.1f} GB of free memory; use --backend cuda, or a smaller "
                "model")
    return None


def _check_room(g: GGUFFile, plan: list[_CacheFile]) -> None:
    """A one-line ModelFileError before any work where the float32 weights fit neither the cache's disk
    nor the free memory (a 30B model is 120 GB in float32): the load would otherwise fail half-way."""
    problem = _room(g, plan)
    if problem is not None:
        raise ModelFileError(g.path, problem)


def _load(g: GGUFFile, names: list[str], path: Path) -> np.ndarray:
    """The tensors `names` stacked by rows, as float32: mapped from the cache, or dequantized once."""
    shapes = [_expected_shape(g, n) for n in names]
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    if path.exists():
        try:
            arr = np.load(path, mmap_mode="r")
            if arr.shape == shape and arr.dtype == np.float32:
                return arr
        except (ValueError, OSError):
            pass  # a damaged cache entry is rebuilt below
    arr = np.empty(shape, dtype=np.float32)
    row = 0
    for name, sh in zip(names, shapes, strict=True):
        info = g.tensors[name]
        try:
            arr[row : row + sh[0]] = dequantize(g.raw(name), info.ggml_type, sh)
        except UnsupportedQuantError as e:
            raise ModelFileError(g.path, f"tensor {name}: {e}") from None
        row += sh[0]
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
        return np.load(path, mmap_mode="r")
    except OSError as e:  # a read-only or full cache only costs speed at the next start
        print(f"ember: warning: cannot cache dequantized weights in {path.parent}: {e}", file=sys.stderr)
        return arr


class LoadTimer:
    """Prints a one-line progress bar for slow first loads (only when it takes a while)."""

    def __init__(self, label: str, stream=sys.stderr, after_s: float = 1.0):
        self.label, self.stream, self.after_s = label, stream, after_s
        self.t0 = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if time.monotonic() - self.t0 < self.after_s and done < total:
            return
        if not self.shown and done >= total:
            return  # finished before the bar was worth showing
        self.shown = True
        pct = 100.0 * done / max(total, 1)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r{self.label}: {pct:5.1f}% of {total / 1e6:.0f} MB{end}")
        self.stream.flush()
