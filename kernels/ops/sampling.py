"""Launchers of sampling.cu: greedy `argmax`, `softmax` with temperature, and `sample` (the host
sampler's chain on the device, its per-row parameters packed by `SampleParams`). Twins: numpy.argmax,
reference.softmax, reference.sample_rows."""

from __future__ import annotations

import math

import numpy as np

from ..constants import KERNEL_CONSTANTS
from ..cuda_runtime import F32, I64, Device, DeviceArray, Pointer
from .args import need
from .matvecs import RowArgmax

ARGMAX_CHUNK = KERNEL_CONSTANTS["ARGMAX_CHUNK"]  # entries of a row one argmax_part_f32 block reduces
ARGMAX_THREADS = KERNEL_CONSTANTS["ARGMAX_THREADS"]
SAMPLE_THREADS = KERNEL_CONSTANTS["SAMPLE_THREADS"]
SOFTMAX_THREADS = 1024  # softmax_f32 strides over its row by blockDim: any multiple of 32 up to 1024


def argmax(dev: Device, logits: DeviceArray, out_idx: DeviceArray, *, rows: int, vocab: int,
           ld: int | None = None, out_val: DeviceArray | None = None, stream=None) -> None:
    """out_idx[r] = numpy.argmax(logits[r]) (first index of the maximum); two launches: chunks of
    ARGMAX_CHUNK in parallel, then one warp per row. Twin: numpy.argmax."""
    need(out_idx, np.int32, rows, "out_idx")
    chunks = -(-vocab // ARGMAX_CHUNK)
    pv = dev.scratch("argmax_v", rows * chunks * 4)
    pi = dev.scratch("argmax_i", rows * chunks * 4)
    dev.kernel("sampling", "argmax_part_f32").launch(
        (chunks, rows), (ARGMAX_THREADS,), logits, I64(vocab if ld is None else ld), vocab, pv, pi, stream=stream)
    dev.kernel("sampling", "argmax_final_f32").launch((rows,), (32,), pv, pi, chunks, out_idx, out_val, stream=stream)


def softmax(dev: Device, x: DeviceArray, y: DeviceArray, *, rows: int, cols: int, temperature: float = 1.0,
            ldx: int | None = None, ldy: int | None = None, stream=None) -> None:
    """y = softmax(x / temperature) row by row. Twin: reference.softmax."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError("temperature must be a positive number")
    dev.kernel("sampling", "softmax_f32").launch(
        (rows,), (SOFTMAX_THREADS,), x, I64(cols if ldx is None else ldx), y, I64(cols if ldy is None else ldy), cols,
        F32(1.0 / temperature), stream=stream
    )


SAMPLE_PART = 8192  # entries of a greedy row one block of sample_f32 takes
SAMPLE_MAX_PARTS = 64


def sample_parts(vocab: int) -> int:
    return min(SAMPLE_MAX_PARTS, max(1, -(-vocab // SAMPLE_PART)))


def sample(dev: Device, logits: DeviceArray, params: DeviceArray, out: DeviceArray, *, rows: int, vocab: int,
           ld: int | None = None, out_floor: DeviceArray | None = None,
           work: tuple[DeviceArray, DeviceArray] | None = None, greedy: RowArgmax | None = None,
           stream=None) -> None:
    """out[r] = a token drawn from row r with its own temperature / top-k / top-p / min-p / seed / step.

    params: a SampleParams block on the device (SampleParams.pack). work: (counters, partials), int32
    of at least rows (zeroed once: the kernel leaves them at zero) and 2 * rows * sample_parts(vocab)
    elements; default: the device's own (a captured graph must bring its own: those may move). greedy:
    one row's argmax found already (matvec_stream_q8_0's), taken if the row is greedy; the kernel then
    runs one block. Twin: reference.sample_rows."""
    need(out, np.int32, rows, "out")
    if greedy is not None and rows != 1:
        raise ValueError("a precomputed greedy token is one row's")
    parts = 1 if greedy is not None else sample_parts(vocab)
    if work is None:
        work = (dev.scratch("sample_counters", 4 * rows, zero=True), dev.scratch("sample_parts", 8 * rows * parts))
    counters, partials = work
    if counters.nbytes < 4 * rows or partials.nbytes < 8 * rows * parts:
        raise ValueError("the sampler's work buffers are too small")
    base = params.ptr
    off = SampleParams.offsets(rows)
    dev.kernel("sampling", "sample_f32").launch(
        (rows, parts), (SAMPLE_THREADS,), logits, I64(vocab if ld is None else ld), vocab,
        Pointer(base + off["temperature"]), Pointer(base + off["top_k"]), Pointer(base + off["top_p"]),
        Pointer(base + off["min_p"]), Pointer(base + off["seed"]), Pointer(base + off["step"]), out, out_floor,
        Pointer(partials.ptr),
        Pointer(partials.ptr + 4 * rows * parts), Pointer(counters.ptr), greedy.best_v if greedy else None,
        greedy.best_i if greedy else None, stream=stream)


class SampleParams:
    """Per-row sampling parameters packed in one buffer (one copy per step): seeds (u64) first, then
    temperature, top_p, min_p (f32), top_k (i32) and step (u32), each `rows` long."""

    FIELDS = (("seed", np.uint64), ("temperature", np.float32), ("top_p", np.float32), ("min_p", np.float32),
              ("top_k", np.int32), ("step", np.uint32))

    @classmethod
    def offsets(cls, rows: int) -> dict[str, int]:
        out, at = {}, 0
        for name, dt in cls.FIELDS:
            out[name] = at
            at += rows * np.dtype(dt).itemsize
        return out

    @classmethod
    def nbytes(cls, rows: int) -> int:
        return sum(rows * np.dtype(dt).itemsize for _, dt in cls.FIELDS)

    @classmethod
    def pack(cls, into: np.ndarray, rows: int, **values) -> None:
        """Write the fields (sequences of `rows` values) into a uint8 host buffer of nbytes(rows)."""
        off = cls.offsets(rows)
        for name, dt in cls.FIELDS:
            n = rows * np.dtype(dt).itemsize
            into[off[name] : off[name] + n].view(dt)[:] = np.asarray(values[name], dtype=dt)
