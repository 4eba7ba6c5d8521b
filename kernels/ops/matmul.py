"""Launchers of gemm.cu: the tensor-core matmul for prefill and large decode batches (`gemm`, with its
split-K policy), its 16-bit input conversion (`to_half`), and `linear_tc`, which puts them together with
dequant.dequant_half. Twin: reference.linear on the 16-bit values."""

from __future__ import annotations

import numpy as np

from ..constants import KERNEL_CONSTANTS
from ..cuda_runtime import I64, Device, DeviceArray
from .args import need
from .dequant import dequant_half
from .quant_matrix import QuantMatrix

GEMM_TILE_M = KERNEL_CONSTANTS["GEMM_TILE_M"]  # rows of C a CTA computes
GEMM_TILE_N = KERNEL_CONSTANTS["GEMM_TILE_N"]  # columns of C a CTA computes
GEMM_TILE_K = KERNEL_CONSTANTS["GEMM_TILE_K"]  # k must be a multiple of it
GEMM_THREADS = KERNEL_CONSTANTS["GEMM_THREADS"]
HALF_KINDS = ("f16", "bf16")


def to_half(dev: Device, x: DeviceArray, out: DeviceArray, n: int, *, kind: str = "f16", stream=None) -> None:
    """out (uint16 bits) = x rounded to f16 or bf16. Twin: numpy's astype(float16) (bf16: round to nearest
    even)."""
    need(out, np.uint16, n, "out")
    blocks = max(1, min(-(-n // 256), dev.sm_count * 16))
    dev.kernel("gemm", f"to_{kind}").launch((blocks,), (256,), x, out, I64(n), stream=stream)


def gemm(dev: Device, a: DeviceArray, b: DeviceArray, c: DeviceArray, *, m: int, n: int, k: int,
         res: DeviceArray | None = None, kind: str = "f16", stream=None) -> None:
    """c[m, n] = a[m, k] @ b[n, k].T (+ res[m, n]); a, b 16-bit (uint16 bits of f16 / bf16), c float32.
    Twin: reference.linear on the 16-bit values. k must be a multiple of GEMM_TILE_K (32)."""
    if kind not in HALF_KINDS:
        raise ValueError(f"kind must be one of {HALF_KINDS}")
    if k % GEMM_TILE_K:
        raise ValueError(f"the tensor-core matmul needs k a multiple of {GEMM_TILE_K} (got {k})")
    need(a, np.uint16, m * k, "a")
    need(b, np.uint16, n * k, "b")
    need(c, np.float32, m * n, "c")
    if res is not None:
        need(res, np.float32, m * n, "res")
    splits = gemm_splits(dev, m, n, k)
    if splits == 1:
        dev.kernel("gemm", f"gemm_{kind}").launch(
            (-(-n // GEMM_TILE_N), -(-m // GEMM_TILE_M)), (GEMM_THREADS,), a, b, res, c, m, n, k, I64(n),
            stream=stream)
        return
    ws = dev.scratch("gemm_splitk", gemm_splitk_bytes(dev))
    dev.kernel("gemm", f"gemm_{kind}").launch(
        (-(-n // GEMM_TILE_N), -(-m // GEMM_TILE_M), splits), (GEMM_THREADS,), a, b, None, ws, m, n, k, I64(n),
        stream=stream)
    blocks = max(1, min(-(-(m * n) // 256), dev.sm_count * 8))
    dev.kernel("gemm", "gemm_splitk_reduce").launch((blocks,), (256,), ws, splits, I64(m * n), res, c, stream=stream)


def gemm_splits(dev: Device, m: int, n: int, k: int) -> int:
    """K runs per output tile: enough CTAs for about two per SM when the tiles alone are too few (a
    small M: decode batches), each run at least 4 steps of GEMM_TILE_K; 1 for prefill-sized M."""
    tiles = -(-n // GEMM_TILE_N) * -(-m // GEMM_TILE_M)
    if tiles >= dev.sm_count:
        return 1
    return max(1, min(2 * dev.sm_count // tiles, k // GEMM_TILE_K // 4, 16))


def gemm_splitk_bytes(dev: Device) -> int:
    """The split-K workspace's bound: splits * tiles <= 2 * SMs, each tile at most GEMM_TILE_M x GEMM_TILE_N floats.
    Allocated once at that size, so a captured graph's pointer never moves."""
    return 2 * dev.sm_count * GEMM_TILE_M * GEMM_TILE_N * 4


def linear_tc(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int, res: DeviceArray | None = None,
              kind: str = "f16", scratch: str = "gemm", stream=None) -> None:
    """y[n, rows] = x[n, cols] @ dequantize(W).T (+ res) on the tensor cores: W decoded to 16 bits (or
    its kept copy, QuantMatrix.keep_half) and x converted into the device scratch buffers
    `<scratch>_w` / `<scratch>_x`, then gemm. For many rows (prefill, large decode batches); small
    batches use matvec. Twin: reference.linear on the 16-bit values."""
    xh = dev.scratch(f"{scratch}_x", n * w.cols * 2).view(0, n * w.cols, np.uint16)
    if w.half is not None and w.half_kind == kind:
        wh = w.half
    else:
        wh = dev.scratch(f"{scratch}_w", w.rows * w.cols * 2).view(0, w.rows * w.cols, np.uint16)
        dequant_half(dev, w, wh, kind=kind, stream=stream)
    to_half(dev, x, xh, n * w.cols, kind=kind, stream=stream)
    gemm(dev, xh, wh, y, m=n, n=w.rows, k=w.cols, res=res, kind=kind, stream=stream)
