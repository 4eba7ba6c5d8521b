"""Launchers of dequant.cu: rows of a quantized matrix as float32 (embedding lookups, whole tensors), a
step's first kernel (`embed`), and a whole matrix as 16 bits for the tensor-core matmul (`dequant_half`).
Twins: quants.dequantize_rows, quants.dequantize."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import need

if TYPE_CHECKING:  # quant_matrix imports this module (QuantMatrix.keep_half)
    from .quant_matrix import QuantMatrix


def dequant_rows(dev: Device, w: QuantMatrix, out: DeviceArray, ids: DeviceArray | None = None, *,
                 n: int | None = None, scale: float = 1.0, stream=None) -> None:
    """out[i] = dequantize(W[ids[i]]) (* scale); ids None: every row. Twin: quants.dequantize_rows /
    quants.dequantize. Out-of-range ids give a NaN row (validate ids on the host)."""
    if ids is not None:
        need(ids, np.int32, 1, "ids")
        n = ids.size if n is None else n
    else:
        n = w.rows if n is None else n
    need(out, np.float32, n * w.cols, "out")
    a8 = w.row_bytes % 8 == 0 and w.data.ptr % 8 == 0
    k = dev.kernel("dequant", f"dequant_{w.type}_{'a8' if a8 else 'a2'}")
    threads = min(256, max(32, -(-(w.cols // 8) // 32) * 32))
    k.launch((n,), (threads,), w.data, I64(w.row_bytes), w.rows, w.cols, ids, n, out, F32(scale), stream=stream)


def embed(dev: Device, w: QuantMatrix, out: DeviceArray, ids: DeviceArray, *, n: int, scale: float = 1.0,
          feed: tuple[DeviceArray, DeviceArray] | None = None,
          norm: tuple[DeviceArray, float, DeviceArray] | None = None, stream=None) -> None:
    """A step's first kernel: out[i] = dequantize(W[ids[i]]) * scale (dequant_rows), with feed = (drawn,
    source): first ids[i] = drawn[source[i]] where source[i] >= 0 (run-ahead decoding), and norm = (weight, eps,
    h): then h = rms_norm(out, weight, eps) (rms_norm). Twin: those three in order."""
    need(ids, np.int32, n, "ids")
    need(out, np.float32, n * w.cols, "out")
    if w.cols % 8:
        raise ValueError("embed needs rows of a multiple of 8 columns")
    if feed is not None:
        need(feed[1], np.int32, n, "source")
    if norm is not None:
        need(norm[0], np.float32, w.cols, "norm weight")
        need(norm[2], np.float32, n * w.cols, "h")
    a8 = w.row_bytes % 8 == 0 and w.data.ptr % 8 == 0
    k = dev.kernel("dequant", f"embed_{w.type}_{'a8' if a8 else 'a2'}")
    threads = min(256, max(32, -(-(w.cols // 8) // 32) * 32))
    drawn, source = feed if feed is not None else (None, None)
    nw, eps, h = norm if norm is not None else (None, 0.0, None)
    k.launch((n,), (threads,), w.data, I64(w.row_bytes), w.rows, w.cols, drawn, source, ids, n, out, F32(scale), nw,
             F32(eps), h, stream=stream)


def dequant_half(dev: Device, w: QuantMatrix, out: DeviceArray, *, kind: str = "f16", stream=None) -> None:
    """out [rows, cols] (uint16 bits) = W dequantized to f16 / bf16 (twin: quants.dequantize, rounded)."""
    need(out, np.uint16, w.rows * w.cols, "out")
    threads = min(256, max(32, -(-(w.cols // 8) // 32) * 32))
    dev.kernel("dequant", f"dequant_{w.type}_{'h16' if kind == 'f16' else 'hbf'}").launch(
        (w.rows,), (threads,), w.data, I64(w.row_bytes), w.rows, w.cols, w.rows, out, stream=stream)
