"""The CUDA backend's weights: each layer uploaded in its GGUF block formats, with its variants
decided once, here, from the family's recipe and the file's quant types.

A CudaLayer says explicitly how its step runs: whether q, k and v are one stacked matrix, q and k
one with v apart, or three; whether gate and up are one; which norms, biases and sinks it has (None
where the recipe has none); a mixture of experts carries its router's and experts' biases with its
matrices. The forward pass (forward.py) branches on these fields only. Upload order is the allocation
order on the device, so it follows the recipe's ROLES, vectors first. check_runs refuses, in one
line, a model the backend cannot run (support.py's table, and the quant types it has kernels for).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.kernels import ops, quants
from ember.kernels.constants import BLOCK_SIZES, GGML_TYPE_NAMES
from ember.kernels.cuda_runtime import Device, DeviceArray

from ...model.arch import layer_tensors
from ...model.arch.recipe import BIAS_ROLES, MATRIX_ROLES, MOE_BIAS_ROLES, MOE_ROLES
from ...model.config import ModelConfig
from ...model.gguf_file import GGUFFile, ModelFileError
from ...model.rope import inv_frequencies
from .support import refusal

# A stack of mixed legacy types is upcast to Q8_0 when that adds at most this many bytes to a step
# (about a quarter of a microsecond of the H200's bandwidth, against a launch of 2-4 us it saves).
STACK_UPCAST_MAX_BYTES = 1 << 20


class QKV(enum.Enum):
    """How a layer's q, k and v projections are held. Matrices that read the same input are stacked
    into one (when their types agree): one launch and one pass over the input instead of three. A
    Q4_K_M file's v is Q6_K in some layers, which then stack only q and k."""

    STACKED = "q|k|v"  # wqkv: q, k and v are column slices of its output rows
    QK_STACKED = "q|k, v"  # wqk, and wv on its own
    APART = "q, k, v"  # wq, wk, wv


@dataclass
class CudaLayer:
    qkv: QKV
    gate_up_stacked: bool  # w_gu (gate rows, then up rows) rather than w_gate and w_up
    attn_norm: DeviceArray
    ffn_norm: DeviceArray
    wo: ops.QuantMatrix
    w_down: ops.QuantMatrix | None = None  # a dense MLP (None: the layer's MLP is `moe`)
    moe: ops.MoeWeights | None = None  # a mixture of experts, in its block formats (never a 16-bit copy)
    wqkv: ops.QuantMatrix | None = None
    wqk: ops.QuantMatrix | None = None
    wq: ops.QuantMatrix | None = None
    wk: ops.QuantMatrix | None = None
    wv: ops.QuantMatrix | None = None
    w_gu: ops.QuantMatrix | None = None
    w_gate: ops.QuantMatrix | None = None
    w_up: ops.QuantMatrix | None = None
    bq: DeviceArray | None = None  # q, k and v's biases where their matrices are apart (or q|k stacked)
    bk: DeviceArray | None = None
    bv: DeviceArray | None = None
    bqkv: DeviceArray | None = None  # the three, stacked as the q|k|v rows are (wqkv)
    bo: DeviceArray | None = None  # the output projection's bias (gpt-oss)
    sinks: DeviceArray | None = None  # a logit per query head in each softmax's denominator (gpt-oss)
    q_norm: DeviceArray | None = None
    k_norm: DeviceArray | None = None
    post_attn_norm: DeviceArray | None = None
    post_ffn_norm: DeviceArray | None = None

    def matrices(self) -> list[ops.QuantMatrix]:
        """Every matrix of the layer the tensor-core matmul may take: the single ones in recipe order,
        then the stacks (not the experts: only the grouped expert matvec reads those)."""
        mats = (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down, self.wqkv, self.wqk, self.w_gu)
        return [m for m in mats if m is not None]


@dataclass
class CudaWeights:
    token_embd: ops.QuantMatrix
    output: ops.QuantMatrix  # token_embd itself when tied
    output_norm: DeviceArray
    layers: list[CudaLayer]
    inv_freq_global: DeviceArray  # RoPE inverse frequencies (float32), global and sliding-window layers
    inv_freq_local: DeviceArray
    rope_mscale: float = 1.0  # YaRN's scale of every cos and sin, both kinds of layer (1 without YaRN)


# The stacks a layer may take, in order of preference; a matrix joins at most one
_STACKS = {"wqkv": ("wq", "wk", "wv"), "wqk": ("wq", "wk"), "w_gu": ("w_gate", "w_up")}


class _Uploader:
    def __init__(self, dev: Device, g: GGUFFile):
        self.dev, self.g = dev, g

    def matrix(self, name: str) -> ops.QuantMatrix:
        info = self.g.tensors[name]
        if len(info.shape) != 2:
            raise ModelFileError(self.g.path, f"tensor {name} is not 2-D")
        cols, rows = int(info.shape[0]), int(info.shape[1])
        return ops.QuantMatrix.upload(self.dev, self.g.raw(name), info.ggml_type, rows, cols)

    def host_vector(self, name: str) -> np.ndarray:
        """A tensor as float32 on the host, flat (numpy order)."""
        info = self.g.tensors[name]
        shape = tuple(reversed(info.shape))
        return np.asarray(quants.dequantize(self.g.raw(name), info.ggml_type, shape), dtype=np.float32).reshape(-1)

    def vector(self, name: str) -> tuple[DeviceArray, np.ndarray]:
        arr = self.host_vector(name)
        return self.dev.to_device(arr), arr

    def stackable(self, names: list[str]) -> bool:
        infos = [self.g.tensors[n] for n in names]
        if len({t.shape[0] for t in infos}) > 1:
            return False
        types = {t.ggml_type for t in infos}
        if len(types) == 1:
            return True
        # mixed legacy types (Gemma 3 270M: q, k Q5_0, v Q8_0) stack as Q8_0, which holds them exactly,
        # where the extra bytes cost less than the launch they save
        if not types <= set(quants.Q8_0_EXACT):
            return False
        cols = int(infos[0].shape[0])
        extra = sum(int(t.shape[1]) * (quants.row_nbytes(GGMLQuantizationType.Q8_0, cols)
                                       - quants.row_nbytes(t.ggml_type, cols)) for t in infos)
        return extra <= STACK_UPCAST_MAX_BYTES

    def stacked(self, names: list[str]) -> ops.QuantMatrix:
        infos = [self.g.tensors[n] for n in names]
        same = len({t.ggml_type for t in infos}) == 1
        raw = np.concatenate([np.asarray(self.g.raw(t.name)).view(np.uint8).reshape(-1) if same
                              else quants.to_q8_0(self.g.raw(t.name), t.ggml_type) for t in infos])
        return ops.QuantMatrix.upload(self.dev, raw, infos[0].ggml_type if same else GGMLQuantizationType.Q8_0,
                                      sum(int(t.shape[1]) for t in infos), int(infos[0].shape[0]))

    def experts(self, names: dict[str, str]) -> ops.MoeWeights:
        """A mixture of experts: the router, and each expert's gate and up stacked [gate_e; up_e] where
        their types agree, as the grouped matvec reads them; the router's and experts' biases (gpt-oss)
        with them, stacked alike."""
        gate, up, down = (self.g.tensors[names[r]] for r in ("gate_exps", "up_exps", "down_exps"))
        hidden, ffn, n = (int(v) for v in gate.shape)  # ggml order
        router = self.matrix(names["router"])
        router_bias = self.vector(names["router_b"])[0] if "router_b" in names else None
        biases = {r: self.host_vector(names[f"{r}_b"]) for r in ("gate_exps", "up_exps", "down_exps")
                  if f"{r}_b" in names}

        def experts(infos, roles: list[str], rows: int, cols: int) -> ops.ExpertMatrices:
            bias = [biases[r] for r in roles] if all(r in biases for r in roles) else None
            return ops.ExpertMatrices.upload(self.dev, [self.g.raw(t.name) for t in infos], infos[0].ggml_type, n,
                                             [rows] * len(infos), cols, biases=bias)

        stacked = gate.ggml_type == up.ggml_type
        return ops.MoeWeights(router=router, down=experts([down], ["down_exps"], hidden, ffn),
                              gate_up=experts([gate, up], ["gate_exps", "up_exps"], ffn, hidden) if stacked else None,
                              gate=None if stacked else experts([gate], ["gate_exps"], ffn, hidden),
                              up=None if stacked else experts([up], ["up_exps"], ffn, hidden), router_bias=router_bias)

    def layer(self, names: dict[str, str], stack: bool) -> CudaLayer:
        """One layer: its vectors (q, k and v's biases as one where the matrices stack), then its matrices,
        each stack uploaded where its first member was."""
        joins: dict[str, str] = {}  # matrix -> the stack it joins (decided from the file's types: no upload)
        for name, parts in _STACKS.items():
            if stack and not any(p in joins for p in parts) and all(p in names for p in parts) \
                    and self.stackable([names[p] for p in parts]):
                joins.update(dict.fromkeys(parts, name))
        # the stacked q|k|v rows take their three biases in one add (one launch, not three)
        stacked_bias = joins.get("wq") == "wqkv" and all(b in names for b in BIAS_ROLES)
        t: dict = {role: self.vector(name)[0] for role, name in names.items()
                   if role not in MATRIX_ROLES and role not in MOE_ROLES and role not in MOE_BIAS_ROLES
                   and not (stacked_bias and role in BIAS_ROLES)}
        if stacked_bias:
            t["bqkv"] = self.dev.to_device(np.concatenate([self.host_vector(names[b]) for b in BIAS_ROLES]))
        if "router" in names:
            t["moe"] = self.experts(names)
        for role in (r for r in MATRIX_ROLES if r in names):  # after the stacking decision: nothing held twice
            joined = joins.get(role)
            if joined is None:
                t[role] = self.matrix(names[role])
            elif joined not in t:
                t[joined] = self.stacked([names[p] for p in _STACKS[joined]])
        qkv = QKV.STACKED if "wqkv" in t else QKV.QK_STACKED if "wqk" in t else QKV.APART
        return CudaLayer(qkv=qkv, gate_up_stacked="w_gu" in t, **t)


def check_runs(g: GGUFFile, config: ModelConfig) -> None:
    """A one-line ModelFileError, before anything is allocated, for a model this backend cannot run (the
    numpy backend runs them all): a recipe asking for what support.RUNS lacks (a HYPER stack: DeepSeek
    V4), or a matrix of a type it has no kernels for."""
    why = refusal(config)
    if why is not None:
        raise ModelFileError(g.path, why)
    names = config.family.tensors
    matrices = [names.token_embd] + ([] if config.tied_output else [names.output])
    for i in range(config.n_layers):
        matrices += [n for role, n in layer_tensors(g, config.family, i).items()
                     if role in MATRIX_ROLES or role in MOE_ROLES]
    for name in matrices:
        t = g.tensors[name].ggml_type
        if GGML_TYPE_NAMES.get(int(t)) not in BLOCK_SIZES:
            have = ", ".join(n.upper() for n in BLOCK_SIZES if n != "q6_kp")
            raise ModelFileError(g.path, f"tensor {name} has quant type {t.name}, which the cuda backend has no "
                                         f"kernels for yet (it runs {have}); --backend numpy runs it")


WORKING_SET_BYTES = 512 << 20  # beyond the weights: the smallest KV pool, step buffers and scratch


def check_fits(g: GGUFFile, memory: tuple[int, int]) -> None:
    """A one-line ModelFileError, before the upload starts, where the weights cannot fit the device's free
    memory: a load never dies half-way with an out-of-memory error (memory: (free, total) bytes)."""
    free, total = memory
    need = sum(t.nbytes for t in g.tensors.values()) + WORKING_SET_BYTES
    if need > free:
        raise ModelFileError(g.path, f"too big for this GPU: needs about {need / 2**30:.1f} GiB of device memory "
                                     f"({need} bytes), {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")


def upload_weights(dev: Device, g: GGUFFile, config: ModelConfig, *, stack: bool) -> CudaWeights:
    """Every tensor the forward pass reads, on the device. stack: matrices may be stacked (the
    host attention fallback reads q from a buffer of its own, so it needs them apart)."""
    up, names = _Uploader(dev, g), config.family.tensors
    token_embd = up.matrix(names.token_embd)
    output = token_embd if config.tied_output else up.matrix(names.output)
    output_norm, _ = up.vector(names.output_norm)
    layers = [up.layer(layer_tensors(g, config.family, i), stack) for i in range(config.n_layers)]
    freqs = None
    if names.rope_freqs is not None and names.rope_freqs in g.tensors:
        freqs = np.asarray(up.vector(names.rope_freqs)[1], np.float64)
    inv_global, inv_local, mscale = inv_frequencies(config, freqs)
    return CudaWeights(token_embd, output, output_norm, layers, dev.to_device(inv_global.astype(np.float32)),
                       dev.to_device(inv_local.astype(np.float32)), float(mscale))
