"""How the CUDA backend multiplies by a weight matrix: which kernel takes a matmul of n rows
(tensor cores, the int8 matvec, the staged or the streaming matvec), and the MLP's gate/up and down
projections with the activation fused where a kernel can take it. The forward pass (forward.py)
calls it; it holds the device, the stream, the switches and the MLP's buffers it is given, and
decides nothing about the model itself.
"""

from __future__ import annotations

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray, Stream

from ...model.config import ModelConfig
from ..base import present
from .layers import CudaLayer

# From this many rows a matmul decodes its weights to 16 bits and runs on the tensor cores (3
# launches) instead of the matvec (one launch, and one read of the weights, per 8 rows). Measured on
# the H200 at 64 rows: the 8B output projection took 6.5 ms as 8 matvec launches (Q6_K, 128256 x 4096).
TC_MIN_ROWS = 16
# Below this many output rows a single-row matvec takes the staged kernel (float x, one 16-byte load
# pass, weights loaded before the PDL wait) rather than the int8 one, whose per-warp x quantization
# does not pay off on so few rows (kernels/docs/code-choices.md, "Kernel choices in the CUDA backend":
# Gemma 3 270M's matrices).
INT8_MIN_ROWS = 1024
# From this many columns such a row is shared by a block's warps (ops.matvec split): one warp alone
# keeps the 270M's down projection waiting on its 2048-column rows (kernels/docs/code-choices.md, "Kernel
# choices in the CUDA backend").
SPLIT_MIN_COLS = 1024
# A single row through a Q8_0 matrix of at least this many rows (a tied output projection) streams it
# with int8 x (ops.matvec_stream_q8_0): the staged matvec is bound by instructions there (2.28 TB/s
# on the H200 for Gemma 3 270M's 262144 x 640).
STREAM_MIN_ROWS = 32768


class Matmuls:
    """The matmul choices of one CUDA backend's steps (see the module docstring)."""

    def __init__(self, dev: Device, stream: Stream, config: ModelConfig, output: ops.QuantMatrix, *,
                 int8_activations: bool, tensor_cores: bool, half_kind: str, g: DeviceArray, u: DeviceArray,
                 gu: DeviceArray | None):
        self.dev, self.stream, self.config = dev, stream, config
        self.output = output  # the output projection (its tensor-core scratch is its own)
        self.int8_activations, self.tensor_cores, self.half_kind = int8_activations, tensor_cores, half_kind
        self.g = g  # act(gate) * up, or gate alone
        self.u = u  # up, when gate and up are apart
        self.gu = gu  # gate | up, from a stacked matrix

    def _int8(self, w: ops.QuantMatrix, n: int, tc: bool = True) -> bool:
        """Whether a matmul of n rows runs as the int8 matvec (which can fuse the gated activation)."""
        return (self.int8_activations and n <= ops.KQ8_MAX_ROWS and ops.kq8_supported(w)
                and not (n == 1 and w.rows < INT8_MIN_ROWS)
                and not (tc and self.tensor_cores and n >= TC_MIN_ROWS))

    def _staged(self, w: ops.QuantMatrix, n: int, tc: bool = True) -> bool:
        """Whether linear() runs one row through the staged matvec (matvec.cu qmv)."""
        return (n == 1 and not (tc and self.tensor_cores and n >= TC_MIN_ROWS) and not self._int8(w, n, tc)
                and (w.rows < INT8_MIN_ROWS or not ops.kv2_supported(w)))

    def takes_post_norm(self, w: ops.QuantMatrix, n: int, tc: bool, gated: bool) -> bool:
        """Whether the matvec of w (gated: the stacked gate|up one) can compute its input itself
        (ops.matvec_post_norm), saving the rms_norm_add_norm launch."""
        if n != 1 or not ops.post_norm_supported(w):
            return False
        if gated:
            return not self._int8(w, n, tc) and w.type not in ops.KV2_TYPES and ops.matvec_gated_supported(w)
        return self._staged(w, n, tc)

    def streamed(self, w: ops.QuantMatrix, n: int) -> bool:
        """Whether linear() streams one row through a tall Q8_0 matrix (ops.matvec_stream_q8_0)."""
        return n == 1 and self.int8_activations and w.rows >= STREAM_MIN_ROWS and ops.stream_q8_0_supported(w)

    def linear(self, w: ops.QuantMatrix, x, y, n: int, res=None, tc: bool = True, argmax=None) -> None:
        out = w is self.output
        if isinstance(x, ops.PostNorm):  # one row, normalised by the matvec itself (step.PostNorms)
            ops.matvec_post_norm(self.dev, w, x, y, stream=self.stream)
        elif self.streamed(w, n):
            ops.matvec_stream_q8_0(self.dev, w, x, y, res=res, argmax=argmax, stream=self.stream)
        elif tc and self.tensor_cores and n >= TC_MIN_ROWS:
            # the output projection has scratch of its own: growing the layers' would move it under graphs
            ops.linear_tc(self.dev, w, x, y, n=n, res=res, kind=self.half_kind, scratch="gemm_out" if out else "gemm",
                          stream=self.stream)
        elif self._int8(w, n, tc):
            ops.matvec_q8(self.dev, w, x, y, n=n, res=res, stream=self.stream)
        else:
            small = n == 1 and w.rows < INT8_MIN_ROWS  # staged beats kv2 there too (Q4_K 640 x 1024: 2.28 vs 3.62 us)
            split = small and w.cols >= SPLIT_MIN_COLS and w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0
            ops.matvec(self.dev, w, x, y, n=n, res=res, variant="staged" if small else "auto", split=split,
                       stream=self.stream)

    def gate_up(self, lw: CudaLayer, h, n: int, tc: bool = True) -> bool:
        """The MLP's gate and up projections. True: a matvec took the stacked matrix and wrote
        act(gate) * up to self.g (the activation in its epilogue: the int8 one for K-quants, the staged
        one for the other types); else self.gu (or self.g, self.u) holds them apart."""
        act = self.config.recipe.act
        if not lw.gate_up_stacked:
            self.linear(present(lw.w_gate), h, self.g, n, tc=tc)
            self.linear(present(lw.w_up), h, self.u, n, tc=tc)
            return False
        w = present(lw.w_gu)
        if isinstance(h, ops.PostNorm):  # the staged gated matvec, normalising its input itself
            ops.matvec_post_norm(self.dev, w, h, self.g, act=act, stream=self.stream)
            return True
        if self._int8(w, n, tc) and act in ops.KQ8_ACTIVATIONS:
            ops.matvec_q8(self.dev, w, h, self.g, n=n, act=act, gated=True, stream=self.stream)
            return True
        matmul = tc and self.tensor_cores and n >= TC_MIN_ROWS
        if not matmul and w.type not in ops.KV2_TYPES and ops.matvec_gated_supported(w):
            ops.matvec_gated(self.dev, w, h, self.g, n=n, act=act, stream=self.stream)
            return True
        self.linear(w, h, self.gu, n, tc=tc)
        return False

    def down(self, lw: CudaLayer, y, n: int, res=None, tc: bool = True, gated: bool = False) -> None:
        """The MLP's down projection of act(gate) * up: already in self.g when `gated`; else the
        activation runs inside the int8 matvec when that takes the step, or as a kernel of its own."""
        cfg, w, act = self.config, present(lw.w_down), self.config.recipe.act
        if gated:
            self.linear(w, self.g, y, n, res=res, tc=tc)
            return
        gu = self.gu
        if lw.gate_up_stacked and self._int8(w, n, tc) and act in ops.KQ8_ACTIVATIONS:
            ops.matvec_q8(self.dev, w, present(gu), y, n=n, res=res, ldx=2 * cfg.ffn, act=act, up_offset=cfg.ffn,
                          stream=self.stream)
            return
        if lw.gate_up_stacked:
            gu = present(gu)
            ops.gated_act(self.dev, gu, gu.view(cfg.ffn, gu.size - cfg.ffn), self.g, n=n,
                          ffn=cfg.ffn, act=act, ldg=2 * cfg.ffn, ldu=2 * cfg.ffn, ldo=cfg.ffn, stream=self.stream)
        else:
            ops.gated_act(self.dev, self.g, self.u, self.g, n=n, ffn=cfg.ffn, act=act, stream=self.stream)
        self.linear(w, self.g, y, n, res=res, tc=tc)
