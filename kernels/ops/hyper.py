"""Launchers of hyper.cu, DeepSeek V4's own pieces. Twins: worker/backends/numpy/hyper.py's hc_mix (with
the mix logits a matmul made before: see hc_pre), head's mix, hc_merge and compress."""

from __future__ import annotations

import numpy as np

from ..constants import KERNEL_CONSTANTS
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import need

HC_MAX = KERNEL_CONSTANTS["HC_MAX"]
HC_THREADS = KERNEL_CONSTANTS["HC_THREADS"]


def _check_streams(hc: int) -> None:
    if not 0 < hc <= HC_MAX:
        raise ValueError(f"{hc} residual streams: hyper.cu takes 1 to {HC_MAX}")


def hc_pre(dev: Device, x: DeviceArray, raw: DeviceArray, scale: DeviceArray, base: DeviceArray, y: DeviceArray,
           post: DeviceArray | None, comb: DeviceArray | None, *, n: int, hc: int, hidden: int, eps: float,
           hc_eps: float, iters: int, ldr: int | None = None, stream=None) -> None:
    """A hyper-connection's input mix of n tokens' streams x [n, hc, hidden]: y [n, hidden] the sublayer's
    input, post [n, hc] and comb [n, hc, hc] for hc_merge. raw [n, ldr]: x [n, hc * hidden] times the mix
    matrix [(2 + hc) * hc, hc * hidden], transposed (the RMS norm the twin applies first is a scalar per
    token, applied here). post and comb None: the output head's mix (raw [n, hc], scale [1], base [hc]).
    Twin: hyper.hc_mix (hyper.HyperStack.head's mix)."""
    _check_streams(hc)
    head = post is None
    m = hc if head else (2 + hc) * hc
    ldr = m if ldr is None else ldr
    need(x, np.float32, n * hc * hidden, "x")
    need(raw, np.float32, (n - 1) * ldr + m, "raw")
    need(base, np.float32, m, "base")
    need(y, np.float32, n * hidden, "y")
    if not head:
        need(post, np.float32, n * hc, "post")
        need(comb, np.float32, n * hc * hc, "comb")
    dev.kernel("hyper", "hc_pre").launch((n,), (HC_THREADS,), x, raw, ldr, scale, base, n, hc, hidden, F32(eps),
                                         F32(hc_eps), iters, int(head), y, post, comb, stream=stream)


def hc_merge(dev: Device, x: DeviceArray, y: DeviceArray, post: DeviceArray, comb: DeviceArray, *, n: int, hc: int,
             hidden: int, stream=None) -> None:
    """In place, the streams after a sublayer: x[t, d] = post[t, d] * y[t] + sum over s of comb[t, s, d] * x[t, s].
    Twin: hyper.hc_merge."""
    _check_streams(hc)
    need(x, np.float32, n * hc * hidden, "x")
    need(y, np.float32, n * hidden, "y")
    dev.kernel("hyper", "hc_merge").launch((-(-hidden // HC_THREADS), n), (HC_THREADS,), x, y, post, comb, n, hc,
                                           hidden, stream=stream)


def compress_rows(dev: Device, kv: DeviceArray, score: DeviceArray, rows: DeviceArray, out: DeviceArray, *,
                  ld: int, first: int, blocks: int, ratio: int, width: int, overlap: bool, ldo: int | None = None,
                  stream=None) -> None:
    """The compressed rows of blocks first .. first + blocks of `ratio` positions into out [blocks, ldo]:
    position p's value and score rows are kv and score at rows[p] * ld (float offsets; kv and score may be
    column views of one pool). overlap (CSA): those rows are 2 * width wide and a block weighs the first
    halves of the block before it too. Twin: hyper.compress (its rows from `first` on)."""
    ldo = width if ldo is None else ldo
    need(rows, np.int32, (first + blocks) * ratio, "rows")
    need(out, np.float32, (blocks - 1) * ldo + width, "out")
    if blocks:
        dev.kernel("hyper", "compress_rows").launch(
            (-(-width // HC_THREADS), blocks), (HC_THREADS,), kv, score, I64(ld), rows, first, ratio, width,
            int(overlap), out, I64(ldo), stream=stream)
