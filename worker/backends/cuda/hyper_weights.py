"""DeepSeek V4's weights on the device, for hyper.py's step: every matrix in its GGUF block format (the
experts too: IQ2_XXS/Q2_K in the users' files), the float tables (mixers, position biases, norms) as
float32, the hash-routing table as int32. Read by the roles the family names (arch/deepseek4.py), as
the numpy twin (backends/numpy/hyper.py) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray

from ...model.config import ModelConfig
from ...model.gguf_file import GGUFFile, ModelFileError
from ..numpy.hyper import rope_frequencies
from .layers import _Uploader


@dataclass
class HyperLayer:
    ratio: int  # 0 window only, 4 CSA, 128 HCA
    attn_mix: tuple[ops.QuantMatrix, DeviceArray, DeviceArray]  # (fn, scale [3], base) of the mix around attention
    ffn_mix: tuple[ops.QuantMatrix, DeviceArray, DeviceArray]
    attn_norm: DeviceArray
    ffn_norm: DeviceArray
    sinks: DeviceArray
    q_a: ops.QuantMatrix
    q_a_norm: DeviceArray
    q_b: ops.QuantMatrix
    kv: ops.QuantMatrix
    kv_norm: DeviceArray
    # what reads the attention's input (kv, q_a, and a compressed layer's compressor's and indexer's value and
    # score matrices, in that order) stacked in one upload where they stack, those then its views: a batch-1
    # step makes all their rows in one launch (ops.matvec_fan)
    attn_in: ops.QuantMatrix | None
    o_a: list[ops.QuantMatrix]  # one [rank, heads * head_dim / groups] a group of heads
    o_a_all: ops.QuantMatrix  # the same, stacked [groups * rank, heads * head_dim / groups] (o_a its views)
    o_b: ops.QuantMatrix
    experts: ops.MoeWeights  # its router too
    shared_gate: ops.QuantMatrix
    shared_up: ops.QuantMatrix
    shared_down: ops.QuantMatrix
    # the shared expert's gate and up stacked [gate; up] in one upload where they stack (shared_gate and
    # shared_up then its views): one matmul makes both
    shared_gate_up: ops.QuantMatrix | None
    clamp: float  # the routed experts' SwiGLU limit (0: none)
    clamp_shared: float
    select_bias: DeviceArray | None = None  # learned routing's selection bias (None: hash-routed)
    token_experts: DeviceArray | None = None  # hash routing: int32 [vocab, k]
    # compressed layers: the compressor's value and score matrices, its position bias [ratio, width], its norm
    compressor: tuple[ops.QuantMatrix, ops.QuantMatrix, DeviceArray, DeviceArray] | None = None
    # CSA: the indexer's compressor (as above), its query matrix and its head weights (scaled as the twin does)
    indexer: tuple[ops.QuantMatrix, ops.QuantMatrix, DeviceArray, DeviceArray] | None = None
    indexer_q_b: ops.QuantMatrix | None = None
    indexer_proj: ops.QuantMatrix | None = None

    def matmuls(self) -> list[ops.QuantMatrix]:
        """The matrices the step multiplies by through its matmuls (hyper_step.tensor_core_matrices picks
        those that may take the tensor cores)."""
        shared = [self.shared_gate_up] if self.shared_gate_up is not None else [self.shared_gate, self.shared_up]
        out = [self.attn_mix[0], self.ffn_mix[0], self.q_a, self.q_b, self.kv, *self.o_a, self.o_b,
               self.experts.router, *shared, self.shared_down]
        out += [m for m in (self.indexer_q_b, self.indexer_proj) if m is not None]
        for part in (self.compressor, self.indexer):
            out += [part[0], part[1]] if part is not None else []
        return out


@dataclass
class HyperWeights:
    token_embd: ops.QuantMatrix
    output: ops.QuantMatrix
    output_norm: DeviceArray
    output_mix: tuple[ops.QuantMatrix, DeviceArray, DeviceArray]  # the head's (fn, scale [1], base [hc])
    layers: list[HyperLayer]
    rope_window: DeviceArray  # inverse frequencies (float32) of the window-only layers' RoPE
    rope_compressed: DeviceArray  # ... and of the compressed layers', their rows' and the indexer's (YaRN)
    ones: DeviceArray  # a weight of ones (q's per-head norm has none), head_dim long

    def matrices(self) -> list[ops.QuantMatrix]:
        out = [self.token_embd, self.output, self.output_mix[0]]
        for lw in self.layers:
            out += lw.matmuls()
        return out


class _Reader(_Uploader):
    """layers.py's uploader (its host vectors and its experts: gate and up stacked where their types agree,
    no biases here), with a missing tensor named in one line, a scale folded into a matrix and a grouped
    projection's matrices."""

    def info(self, name: str):
        if name not in self.g.tensors:
            raise ModelFileError(self.g.path, f"missing tensor {name}")
        return self.g.tensors[name]

    def device_vector(self, name: str) -> DeviceArray:
        self.info(name)
        return self.dev.to_device(self.host_vector(name))

    def matrix(self, name: str, scale: float | None = None) -> ops.QuantMatrix:
        """A 2-D tensor in its block format; scale: multiplied in, as float32 (the indexer's head weights)."""
        info = self.info(name)
        if scale is None:
            return super().matrix(name)
        if len(info.shape) != 2:
            raise ModelFileError(self.g.path, f"tensor {name} is not 2-D")
        cols, rows = int(info.shape[0]), int(info.shape[1])
        data = self.host_vector(name) * np.float32(scale)
        return ops.QuantMatrix.upload(self.dev, data, GGMLQuantizationType.F32, rows, cols)

    def groups(self, name: str, groups: int) -> tuple[ops.QuantMatrix, list[ops.QuantMatrix]]:
        """A grouped projection [groups * rank, width]: the whole, and one matrix a group (views of it)."""
        whole = self.matrix(name)
        return whole, _split_rows(whole, [whole.rows // groups] * groups)

    def fan(self, names: list[str]) -> tuple[ops.QuantMatrix | None, list[ops.QuantMatrix]]:
        """Matrices that read one input: stacked in one upload where they stack (the whole, and each a view
        of it), else apart (None, and each)."""
        if not self.stackable(names):
            return None, [self.matrix(n) for n in names]
        whole = self.stacked(names)
        return whole, _split_rows(whole, [int(self.info(n).shape[1]) for n in names])


def _split_rows(whole: ops.QuantMatrix, rows: list[int]) -> list[ops.QuantMatrix]:
    """Consecutive blocks of whole's rows, each a matrix viewing its bytes."""
    out, at = [], 0
    for r in rows:
        nbytes = r * whole.row_bytes
        out.append(ops.QuantMatrix(whole.data.view(at, nbytes), whole.type, r, whole.cols, stride=whole.stride))
        at += nbytes
    return out


def _layer(rd: _Reader, config: ModelConfig, li: int, ratio: int) -> HyperLayer:
    """Block li's weights: a trunk layer's, or the next-token layer's (li = n_layers: window-only, learned
    routing), by the family's roles."""
    h, family = config.hyper, config.family
    assert h is not None and family.hyper is not None
    roles = {**family.tensors.layer, **family.hyper.layer}

    def name(role: str) -> str:
        return f"blk.{li}.{roles[role]}"

    def mix(role: str):
        return (rd.matrix(name(f"{role}_fn")), rd.device_vector(name(f"{role}_scale")),
                rd.device_vector(name(f"{role}_base")))

    hashed = li < h.hash_layers
    o_a_all, o_a = rd.groups(name("o_a"), h.o_groups)
    shared_gate_up, (shared_gate, shared_up) = rd.fan([name("shared_gate"), name("shared_up")])
    # what reads the attention's input, in HyperLayer.attn_in's order
    indexed = ratio == 4 and name("indexer_q_b") in rd.g.tensors
    readers = ["kv", "q_a"] + ["compressor_kv", "compressor_gate"] * bool(ratio)
    readers += ["indexer_compressor_kv", "indexer_compressor_gate"] * indexed
    attn_in, inputs = rd.fan([name(r) for r in readers])
    m = dict(zip(readers, inputs, strict=True))
    lw = HyperLayer(
        ratio=ratio, attn_mix=mix("attn_mix"), ffn_mix=mix("ffn_mix"),
        attn_norm=rd.device_vector(name("attn_norm")), ffn_norm=rd.device_vector(name("ffn_norm")),
        sinks=rd.device_vector(name("sinks")),
        q_a=m["q_a"], q_a_norm=rd.device_vector(name("q_a_norm")), q_b=rd.matrix(name("q_b")),
        kv=m["kv"], kv_norm=rd.device_vector(name("kv_norm")), attn_in=attn_in, o_a=o_a,
        o_a_all=o_a_all, o_b=rd.matrix(name("o_b")),
        experts=rd.experts({r: name(r) for r in ("router", "gate_exps", "up_exps", "down_exps")}),  # no biases
        shared_gate=shared_gate, shared_up=shared_up, shared_down=rd.matrix(name("shared_down")),
        shared_gate_up=shared_gate_up,
        clamp=float(h.swiglu_clamp_exp[li]), clamp_shared=float(h.swiglu_clamp_shexp[li]),
        select_bias=None if hashed else rd.device_vector(name("router_select_bias")),
        token_experts=(rd.dev.to_device(np.ascontiguousarray(rd.g.raw(name("token_to_experts")).view("<i4")))
                       if hashed else None))
    if ratio:
        lw.compressor = (m["compressor_kv"], m["compressor_gate"],
                         rd.device_vector(name("compressor_ape")), rd.device_vector(name("compressor_norm")))
    if indexed:
        lw.indexer = (m["indexer_compressor_kv"], m["indexer_compressor_gate"],
                      rd.device_vector(name("indexer_compressor_ape")),
                      rd.device_vector(name("indexer_compressor_norm")))
        lw.indexer_q_b = rd.matrix(name("indexer_q_b"))
        # the twin divides the head weights by sqrt(heads * dim) after the product: folded into the matrix
        lw.indexer_proj = rd.matrix(name("indexer_proj"), scale=1.0 / np.sqrt(h.indexer_dim * h.indexer_heads))
    return lw


def upload_hyper_weights(dev: Device, g: GGUFFile, config: ModelConfig) -> HyperWeights:
    h, family = config.hyper, config.family
    assert h is not None and family.hyper is not None
    rd, t = _Reader(dev, g), family.tensors
    model = family.hyper.model
    layers = [_layer(rd, config, li, h.compress_ratios[li]) for li in range(config.n_layers)]
    rope_window = rope_frequencies(config.rope_base, h.n_rot)
    rope_compressed = rope_frequencies(h.compress_rope_base, h.n_rot, config.rope_yarn)
    return HyperWeights(
        token_embd=rd.matrix(t.token_embd), output=rd.matrix(t.output), output_norm=rd.device_vector(t.output_norm),
        output_mix=(rd.matrix(model["output_mix_fn"]), rd.device_vector(model["output_mix_scale"]),
                    rd.device_vector(model["output_mix_base"])), layers=layers,
        rope_window=dev.to_device(rope_window.astype(np.float32)),
        rope_compressed=dev.to_device(rope_compressed.astype(np.float32)),
        ones=dev.to_device(np.ones(config.head_dim, np.float32)))
