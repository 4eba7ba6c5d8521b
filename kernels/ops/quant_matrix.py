"""A GGUF tensor on the device in its own block format (`QuantMatrix`), and the block sizes the kernels
read. Twin: quants.py (the numpy decoding of the same blocks); the matrices' launchers are in
matvecs.py, dequant.py and matmul.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import BLOCK_SIZES, GGML_TYPE_NAMES, KERNEL_CONSTANTS
from ..cuda_runtime import Device, DeviceArray
from .dequant import dequant_half

Q6K_BYTES = KERNEL_CONSTANTS["BLOCK_BYTES_Q6_K"]
Q6K_PAD = KERNEL_CONSTANTS["BLOCK_BYTES_Q6_KP"] - Q6K_BYTES  # zero bytes after each Q6_K block on the device


def repack_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes, only 2-byte aligned) -> 224-byte blocks (14 zero bytes appended), so
    the kernels read every field with 16-byte loads (quant.cuh GT_Q6_KP)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, Q6K_BYTES)
    return np.concatenate([blocks, np.zeros((len(blocks), Q6K_PAD), np.uint8)], axis=1).reshape(-1)


def _type_name(ggml_type) -> str:
    name = ggml_type.lower() if isinstance(ggml_type, str) else GGML_TYPE_NAMES.get(int(ggml_type), "")
    if name not in BLOCK_SIZES:
        raise ValueError(f"no CUDA kernels for tensor type {ggml_type!r} (have: {', '.join(BLOCK_SIZES)})")
    return name


def row_nbytes(ggml_type, cols: int) -> int:
    elems, size = BLOCK_SIZES[_type_name(ggml_type)]
    if cols % max(elems, 8):
        raise ValueError(f"a {_type_name(ggml_type)} row of {cols} elements is not a whole number of blocks (and of 8)")
    return cols // elems * size


@dataclass
class QuantMatrix:
    """A 2-D GGUF tensor on the device in its own block format: rows x cols (numpy order)."""

    data: DeviceArray  # uint8, rows * row_bytes
    type: str
    rows: int
    cols: int
    # a 16-bit copy (uint16 bits, [rows, cols]) for the tensor-core matmul, when the caller keeps one
    half: DeviceArray | None = None
    half_kind: str = ""
    stride: int = 0  # bytes from one row to the next (0: the blocks' own row size)

    def keep_half(self, dev: Device, kind: str, stream=None) -> None:
        """Decode the matrix to 16 bits once and keep it: linear_tc then skips the per-call decode
        (dequant.dequant_half)."""
        if self.half is None or self.half_kind != kind:
            self.half = dev.empty((self.rows * self.cols,), np.uint16)
            self.half_kind = kind
            dequant_half(dev, self, self.half, kind=kind, stream=stream)

    @property
    def row_bytes(self) -> int:
        return self.stride or row_nbytes(self.type, self.cols)

    @classmethod
    def upload(cls, dev: Device, raw: np.ndarray, ggml_type, rows: int, cols: int,
               align_rows: bool = True) -> QuantMatrix:
        """The GGUF bytes on the device; Q6_K is repacked to aligned blocks (q6_kp) on the way, and rows
        whose length is not a multiple of 16 bytes (Q4_0/Q5_0/Q8_0 rows of 640 columns: Gemma 3
        270M) are padded to one, so the matvec stages them with 16-byte loads (align_rows=False keeps
        them packed: the 2-byte-load path)."""
        name = _type_name(ggml_type)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        need = rows * row_nbytes(name, cols)
        if raw.size != need:
            raise ValueError(f"{name} [{rows}, {cols}] needs {need} bytes, got {raw.size}")
        if name == "q6_k":
            raw, name = repack_q6_k(raw), "q6_kp"
        natural = row_nbytes(name, cols)  # as stored (Q6_K's repacked blocks are already aligned)
        stride = 0
        if align_rows and natural % 16:
            stride = -(-natural // 16) * 16
            padded = np.zeros((rows, stride), np.uint8)
            padded[:, :natural] = raw.reshape(rows, natural)
            raw = padded.reshape(-1)
        return cls(dev.to_device(raw), name, rows, cols, stride=stride)
