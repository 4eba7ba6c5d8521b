"""Launchers of the row-wise kernels: norm.cu (RMSNorm with the residual add, Gemma's post-norms, adds,
row gathers, biases), rope.cu and act.cu (the gated MLP's activation). Twins: reference.rms_norm,
reference.rope with reference.rope_tables, reference.gated, and plain numpy for the adds and gathers."""

from __future__ import annotations

import numpy as np

from ..constants import KERNEL_CONSTANTS, NORM_COLS_PER_THREAD
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import act_code, need

NORM_MAX_THREADS = KERNEL_CONSTANTS["NORM_MAX_THREADS"]
NORM_MAX_COLS = max(NORM_COLS_PER_THREAD) * NORM_MAX_THREADS  # 8192
ROPE_MAX_HALF = KERNEL_CONSTANTS["ROPE_MAX_HALF"]


def norm_shape(cols: int) -> tuple[int, int]:
    """(columns per thread, threads) of the norm kernels for rows of `cols`: norm.cu holds a row in
    registers, 4 columns per thread up to 4096 and 8 up to NORM_MAX_COLS."""
    for per in NORM_COLS_PER_THREAD:
        if cols <= per * NORM_MAX_THREADS:
            warps = -(-cols // (32 * per))
            return per, 32 * max(1, warps)
    raise ValueError(f"rows of {cols} columns exceed the norm kernels' {NORM_MAX_COLS}")


def _norm_kernel(dev: Device, name: str, cols: int):
    per, threads = norm_shape(cols)
    return dev.kernel("norm", f"{name}_e{per}"), threads


def rms_norm(dev: Device, x: DeviceArray, weight: DeviceArray, y: DeviceArray, *, eps: float,
             rows: int, cols: int, res: DeviceArray | None = None, h_out: DeviceArray | None = None,
             heads: int = 1, ldx: int | None = None, ldy: int | None = None, stream=None) -> None:
    """h = x (+ res) (stored to h_out when given); y = rms_norm(h, weight, eps). Twin: reference.rms_norm.

    Row r is (token r // heads, head r % heads) at token * ld + head * cols: heads > 1 normalises
    per-head slices (q/k norm) in place with ld the token stride."""
    ldx = cols * heads if ldx is None else ldx
    ldy = cols * heads if ldy is None else ldy
    need(weight, np.float32, cols, "weight")
    kernel, threads = _norm_kernel(dev, "rms_norm_f32", cols)
    kernel.launch(
        (rows,), (threads,), x, res, h_out, weight, y, rows, cols, heads, I64(ldx), I64(ldy), F32(eps), stream=stream
    )


def rms_norm_add(dev: Device, x: DeviceArray, weight: DeviceArray, out: DeviceArray, *, eps: float, rows: int,
                 cols: int, stream=None) -> None:
    """out += rms_norm(x, weight, eps) row by row: Gemma's post-norms, folded into the residual add
    (twin: reference.rms_norm, then +)."""
    need(weight, np.float32, cols, "weight")
    kernel, threads = _norm_kernel(dev, "rms_norm_add_f32", cols)
    kernel.launch((rows,), (threads,), x, weight, out, rows, cols, F32(eps), stream=stream)


def rms_norm_add_norm(dev: Device, x: DeviceArray, w1: DeviceArray, out: DeviceArray, w2: DeviceArray,
                      h: DeviceArray, *, eps: float, rows: int, cols: int, stream=None) -> None:
    """out += rms_norm(x, w1); h = rms_norm(out, w2), row by row: a post-norm residual add and the
    next pre-norm in one launch (twin: reference.rms_norm, +, reference.rms_norm)."""
    need(w1, np.float32, cols, "w1")
    need(w2, np.float32, cols, "w2")
    kernel, threads = _norm_kernel(dev, "rms_norm_add_norm_f32", cols)
    kernel.launch((rows,), (threads,), x, w1, out, w2, h, rows, cols, F32(eps), stream=stream)


def add(dev: Device, a: DeviceArray, b: DeviceArray, out: DeviceArray, n: int | None = None, *, stream=None) -> None:
    """out = a + b over n elements (the residual add when no norm follows). Twin: numpy's +."""
    n = a.size if n is None else n
    dev.kernel("norm", "add_f32").launch((min(-(-n // 256), dev.sm_count * 16),), (256,), a, b, out, I64(n),
                                         stream=stream)


def rope(dev: Device, q: DeviceArray, k: DeviceArray | None, pos: DeviceArray, inv_freq: DeviceArray, *,
         n: int, hq: int, hk: int, head_dim: int, neox: bool, ldq: int | None = None,
         ldk: int | None = None, mscale: float = 1.0, head_stride: int | None = None, inverse: bool = False,
         stream=None) -> None:
    """In place: q [n, hq, D] and k [n, hk, D] (token strides ldq/ldk) rotated at positions pos (int32)
    with inv_freq [D/2], every cos and sin times mscale (YaRN's); twin reference.rope with
    reference.rope_tables(positions, inv_freq, mscale). head_stride: elements from one head to the next
    where only D of each turns (DeepSeek V4's last n_rot: q and k views at that offset; twin
    hyper.rope_tail); inverse: rotated back (the sin negated)."""
    need(pos, np.int32, n, "pos")
    need(inv_freq, np.float32, head_dim // 2, "inv_freq")
    hs = head_dim if head_stride is None else head_stride
    ldq = hq * hs if ldq is None else ldq
    ldk = hk * hs if ldk is None else ldk
    hk = hk if k is not None else 0
    if head_dim // 2 > ROPE_MAX_HALF:
        raise ValueError(f"head_dim above {2 * ROPE_MAX_HALF} is not supported by the rope kernel")
    pairs = (hq + hk) * (head_dim // 2)
    threads = min(256, max(32, -(-pairs // 32) * 32))
    # a token's pairs over several blocks where the tokens are few (a decode's 64 heads: one block walked
    # its 2,048 pairs in 8 rounds, each waiting on its loads), each block making its own cos/sin table
    chunks = max(1, min(-(-pairs // threads), 4 * dev.sm_count // max(n, 1)))
    dev.kernel("rope", "rope_f32").launch(
        (n, chunks), (threads,), q, I64(ldq), hq, k, I64(ldk), hk, pos, inv_freq, n, head_dim,
        1 if neox else 0, F32(mscale), I64(hs), int(inverse), stream=stream
    )


def gated_act(dev: Device, g: DeviceArray, u: DeviceArray, out: DeviceArray, *, n: int, ffn: int, act: str,
              ldg: int | None = None, ldu: int | None = None, ldo: int | None = None, stream=None) -> None:
    """out = act(g) * u over [n, ffn], act a name of constants.ACTIVATIONS (gpt-oss's "swiglu_oai" its
    clamped form). Twin: reference.gated."""
    code = act_code(act)
    total = n * ffn
    blocks = max(1, min(-(-total // 256), dev.sm_count * 16))
    dev.kernel("act", "gated_act_f32").launch(
        (blocks,), (256,), g, I64(ffn if ldg is None else ldg), u, I64(ffn if ldu is None else ldu), out,
        I64(ffn if ldo is None else ldo), n, ffn, code, stream=stream
    )


def gather_rows(dev: Device, x: DeviceArray, idx: DeviceArray, out: DeviceArray, *, n: int, cols: int,
                ldx: int | None = None, stream=None) -> None:
    """out[i] = x[idx[i]] (rows of cols floats). Twin: numpy indexing, x[idx]."""
    need(idx, np.int32, n, "idx")
    need(out, np.float32, n * cols, "out")
    dev.kernel("norm", "gather_rows_f32").launch((n,), (min(1024, max(32, -(-cols // 32) * 32)),), x,
                                                 I64(cols if ldx is None else ldx), idx, n, cols, out, stream=stream)


def add_bias(dev: Device, y: DeviceArray, bias: DeviceArray, *, n: int, cols: int, ldy: int | None = None,
             stream=None) -> None:
    """y[r] += bias for r < n (the q/k/v biases, gpt-oss's output bias). Twin: numpy's +=."""
    need(bias, np.float32, cols, "bias")
    dev.kernel("norm", "add_bias_f32").launch((n,), (min(1024, max(32, -(-cols // 32) * 32)),), y,
                                              I64(cols if ldy is None else ldy), bias, n, cols, stream=stream)
