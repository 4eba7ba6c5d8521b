"""Numpy twins of ggml's dequantization: the reference math the CUDA kernels mirror.

Every quantized ggml type stores a row as a run of fixed-size blocks. Each block is described here
once, as a numpy structured dtype (`BLOCK_DTYPES`), in the byte order of ggml's C structs
(ggml-common.h), and decoded by one small function that works on an array of blocks at a time. The
arithmetic is done in float32 in the same order as ggml's `dequantize_row_*` (for example Q4_K:
`(d * sc) * q - (dmin * m)`), so the results are bit-identical to ggml's reference and to gguf-py's
`gguf.quants.dequantize`; a CUDA kernel that keeps this order (and does not contract the multiply and
subtract into an FMA) matches it exactly too.

Large tensors are decoded in chunks of rows into one preallocated float32 output, so the temporary
memory stays at a few tens of MB whatever the tensor size (the 262144 x 640 Q8_0 embedding of
Gemma 3 270M needs its 640 MB of output and nothing near that on top).

    dequantize(raw, ggml_type, shape)                  whole tensor, numpy-order shape (..., row_len)
    dequantize_rows(raw, ggml_type, row_len, row_ids)  selected rows only (embedding lookup)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "BLOCK_DTYPES",
    "QK_K",
    "SUPPORTED_TYPES",
    "UnsupportedQuantError",
    "dequantize",
    "dequantize_blocks",
    "dequantize_rows",
    "pack_k_scales",
    "row_nbytes",
    "to_q8_0",
    "unpack_k_scales",
]

QK_K = 256  # elements per K-quant super-block
QK = 32  # elements per legacy (Q4_0 .. Q8_0) block

T = GGMLQuantizationType

# One block of each type, field for field as in ggml-common.h (all little-endian, packed).
BLOCK_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    T.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", QK // 2)]),
    T.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", QK // 2)]),
    T.Q5_0: np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", QK // 2)]),
    T.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", QK // 2)]),
    T.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", QK)]),
    T.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", QK_K // 2)]),
    T.Q5_K: np.dtype(
        [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", QK_K // 8), ("qs", "u1", QK_K // 2)]
    ),
    T.Q6_K: np.dtype([("ql", "u1", QK_K // 2), ("qh", "u1", QK_K // 4), ("scales", "i1", QK_K // 16), ("d", "<f2")]),
    T.Q8_K: np.dtype([("d", "<f4"), ("qs", "i1", QK_K), ("bsums", "<i2", QK_K // 16)]),
    # 2-3-bit K-quants and the i-quants (grids of 8-value codes with packed signs and 4-bit scales)
    T.Q2_K: np.dtype([("scales", "u1", QK_K // 16), ("qs", "u1", QK_K // 4), ("d", "<f2"), ("dmin", "<f2")]),
    T.Q3_K: np.dtype([("hmask", "u1", QK_K // 8), ("qs", "u1", QK_K // 4), ("scales", "u1", 12), ("d", "<f2")]),
    T.IQ2_XXS: np.dtype([("d", "<f2"), ("qs", "<u2", QK_K // 8)]),
    T.IQ2_XS: np.dtype([("d", "<f2"), ("qs", "<u2", QK_K // 8), ("scales", "u1", QK_K // 32)]),
    T.IQ2_S: np.dtype([("d", "<f2"), ("qs", "u1", QK_K // 4), ("qh", "u1", QK_K // 32), ("scales", "u1", QK_K // 32)]),
    T.IQ3_XXS: np.dtype([("d", "<f2"), ("qs", "u1", 3 * QK_K // 8)]),
    T.IQ3_S: np.dtype([("d", "<f2"), ("qs", "u1", QK_K // 4), ("qh", "u1", QK_K // 32), ("signs", "u1", QK_K // 8),
                       ("scales", "u1", QK_K // 64)]),
    T.IQ4_NL: np.dtype([("d", "<f2"), ("qs", "u1", QK // 2)]),
    T.IQ4_XS: np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", QK_K // 64), ("qs", "u1", QK_K // 2)]),
    T.MXFP4: np.dtype([("e", "u1"), ("qs", "u1", QK // 2)]),  # e: an E8M0 scale, 2^(e - 127)
}
_BLOCK_ELEMENTS = {T.Q4_0: QK, T.Q4_1: QK, T.Q5_0: QK, T.Q5_1: QK, T.Q8_0: QK, T.IQ4_NL: QK, T.MXFP4: QK}
for _t, _dt in BLOCK_DTYPES.items():  # the layouts above must agree with gguf-py's table
    assert (_BLOCK_ELEMENTS.get(_t, QK_K), _dt.itemsize) == GGML_QUANT_SIZES[_t], _t

# Float types: one "block" is one element.
_FLOAT_DTYPES = {T.F32: np.dtype("<f4"), T.F16: np.dtype("<f2"), T.BF16: np.dtype("<u2")}


class UnsupportedQuantError(ValueError):
    """A tensor type this module cannot decode; str() is one line naming the type."""

    def __init__(self, ggml_type: object):
        name = getattr(ggml_type, "name", None) or str(ggml_type)
        self.ggml_type = ggml_type
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        super().__init__(f"unsupported tensor type {name} (supported: {supported})")


# -- helpers --------------------------------------------------------------------------------------

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


def _f16(x: np.ndarray) -> np.ndarray:
    """fp16 field -> float32 column vector, shape (n_blocks, 1)."""
    return x.astype(np.float32)[:, None]


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2, k) values: [:, 0] the low nibbles, [:, 1] the high nibbles."""
    return (qs[:, None, :] >> _NIBBLE_SHIFTS[None, :, None]) & np.uint8(0x0F)


def _bits(x: np.ndarray, n_bits: int) -> np.ndarray:
    """(n,) unsigned ints -> (n, n_bits) uint8 of their bits, least significant first."""
    shifts = np.arange(n_bits, dtype=x.dtype)
    return ((x[:, None] >> shifts) & x.dtype.type(1)).astype(np.uint8)


def unpack_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> (sc, m), each (n, 8) uint8 with 6-bit values.

    ggml's get_scale_min_k4: sub-blocks 0-3 keep their low 6 bits in bytes 0-3 (scale) and 4-7 (min);
    sub-blocks 4-7 keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the top
    2 bits of bytes 0-3 (scale) and 4-7 (min).
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of unpack_k_scales: (n, 8) 6-bit scales and mins -> (n, 12) packed bytes."""
    sc = np.asarray(sc, dtype=np.uint8)
    m = np.asarray(m, dtype=np.uint8)
    if (sc > 63).any() or (m > 63).any():
        raise ValueError("K-quant scales and mins are 6-bit values (0..63)")
    a = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=1).astype(np.uint8)


# -- one function per type: structured blocks (n,) -> float32 out (n, block_elements) --------------
# Each writes straight into its slice of the output through ufunc `out=` (the products are computed
# in float32: an integer code times a float32 scale uses numpy's float32 loop, exactly as C does).


def _q4_0(b: np.ndarray, out: np.ndarray) -> None:
    # element j = low nibble of qs[j], element j+16 = high nibble; value (q - 8) * d
    q = _low_high_nibbles(b["qs"]).reshape(len(b), QK).astype(np.int8) - np.int8(8)
    np.multiply(_f16(b["d"]), q, out=out)


def _q4_1(b: np.ndarray, out: np.ndarray) -> None:
    q = _low_high_nibbles(b["qs"]).reshape(len(b), QK)
    np.multiply(_f16(b["d"]), q, out=out)
    out += _f16(b["m"])


def _q5(b: np.ndarray) -> np.ndarray:
    """The 5-bit value of Q5_0/Q5_1: 4 bits from qs nibbles, bit 4 from bit j of the 32-bit qh."""
    ql = _low_high_nibbles(b["qs"]).reshape(len(b), QK)
    qh = _bits(b["qh"], QK)
    return ql | (qh << np.uint8(4))


def _q5_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _q5(b).astype(np.int8) - np.int8(16)
    np.multiply(_f16(b["d"]), q, out=out)


def _q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_f16(b["d"]), _q5(b), out=out)
    out += _f16(b["m"])


def _q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b["qs"], _f16(b["d"]), out=out)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per sub-block scale d*sc and offset dmin*m, each (n, 8, 1) float32."""
    sc, m = unpack_k_scales(b["scales"])
    d = _f16(b["d"]) * sc.astype(np.float32)
    dm = _f16(b["dmin"]) * m.astype(np.float32)
    return d[:, :, None], dm[:, :, None]


def _q4_k(b: np.ndarray, out: np.ndarray) -> None:
    # 8 sub-blocks of 32; qs bytes [32c, 32c+32) hold sub-block 2c (low nibbles) and 2c+1 (high);
    # value (d * sc) * q - (dmin * m)
    n = len(b)
    d, dm = _k_scales(b)
    q = _low_high_nibbles(b["qs"].reshape(n * 4, 32)).reshape(n, 8, 32)
    out3 = out.reshape(n, 8, 32)
    np.multiply(d, q, out=out3)
    out3 -= dm


def _q5_k(b: np.ndarray, out: np.ndarray) -> None:
    # as Q4_K, plus bit 4 of element l of sub-block s in bit s of qh[l]
    n = len(b)
    d, dm = _k_scales(b)
    ql = _low_high_nibbles(b["qs"].reshape(n * 4, 32)).reshape(n, 8, 32)
    qh = _bits(b["qh"].reshape(-1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
    out3 = out.reshape(n, 8, 32)
    np.multiply(d, ql | (qh << np.uint8(4)), out=out3)
    out3 -= dm


def _q6_k(b: np.ndarray, out: np.ndarray) -> None:
    # two halves of 128; in half h, ql[64h + l] low/high nibble -> elements l / 64 + l (l < 64),
    # qh[32h + l] bit pairs 0,1,2,3 -> the top 2 bits of elements l, 32 + l, 64 + l, 96 + l.
    # 16 sub-blocks of 16 elements with a signed 8-bit scale each; value (d * sc) * (q - 32).
    n = len(b)
    ql = _low_high_nibbles(b["ql"].reshape(n * 2, 64)).reshape(n, 2, 128)
    qh = (b["qh"].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & np.uint8(3)
    q = (ql | (qh.reshape(n, 2, 128) << np.uint8(4))).astype(np.int8) - np.int8(32)
    d = _f16(b["d"]) * b["scales"].astype(np.float32)
    np.multiply(d[:, :, None], q.reshape(n, 16, 16), out=out.reshape(n, 16, 16))


def _q8_k(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b["d"][:, None], b["qs"], out=out)


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray], None]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.Q8_K: _q8_k,
}

# The low-bit types are decoded by gguf-py's own dequantizers (the reference the issue names; their
# grids and sign tables live there once). Our twins above predate them and are checked against them.
_GGUF_DECODED = (T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS, T.MXFP4)

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (T.F32, T.F16, T.BF16, *_DECODERS, *_GGUF_DECODED)

# Elements decoded per chunk: bounds the temporaries (about 10 float32/uint8 arrays of this size).
_CHUNK_ELEMENTS = 1 << 20


def _as_type(ggml_type: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        t = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UnsupportedQuantError(ggml_type) from None
    if t not in SUPPORTED_TYPES:
        raise UnsupportedQuantError(t)
    return t


def _block_size(t: GGMLQuantizationType) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[t]


def row_nbytes(ggml_type: GGMLQuantizationType | int, row_len: int) -> int:
    """Bytes of one row of `row_len` elements."""
    t = _as_type(ggml_type)
    block, size = _block_size(t)
    if row_len <= 0 or row_len % block:
        raise ValueError(f"a {t.name} row of {row_len} elements is not a whole number of {block}-element blocks")
    return row_len // block * size


def _decode_flat(raw: np.ndarray, t: GGMLQuantizationType, out: np.ndarray) -> None:
    """Decode the bytes `raw` (a whole number of blocks) into the flat float32 `out`."""
    if t == T.F32:
        out[:] = raw.view("<f4")
    elif t == T.F16:
        out[:] = raw.view("<f2")
    elif t == T.BF16:  # bf16 is the top half of an f32
        out.view(np.uint32)[:] = raw.view("<u2").astype(np.uint32) << 16
    elif t in _GGUF_DECODED:
        with np.errstate(all="ignore"):  # inf/NaN scales decode to inf/NaN, as in ggml
            out[:] = gguf_quants.dequantize(raw.reshape(-1, BLOCK_DTYPES[t].itemsize), t).reshape(-1)
    else:
        blocks = raw.view(BLOCK_DTYPES[t])
        _DECODERS[t](blocks, out.reshape(len(blocks), -1))


def dequantize_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType | int) -> np.ndarray:
    """Decode a flat run of whole blocks (no chunking) -> flat float32; the building block."""
    t = _as_type(ggml_type)
    block, size = _block_size(t)
    raw = _as_bytes(raw)
    if raw.size % size:
        raise ValueError(f"{raw.size} bytes is not a whole number of {size}-byte {t.name} blocks")
    out = np.empty(raw.size // size * block, dtype=np.float32)
    _decode_flat(raw, t, out)
    return out


# Legacy types whose values are d * integer with no minimum: Q8_0 holds them exactly (same fp16 d,
# the integer as int8), so matrices of these types can be stacked into one Q8_0 matrix.
Q8_0_EXACT = (T.Q4_0, T.Q5_0, T.Q8_0)
_Q8_0_INTS = {T.Q4_0: lambda b: _low_high_nibbles(b["qs"]).reshape(len(b), QK).astype(np.int8) - np.int8(8),
              T.Q5_0: lambda b: _q5(b).astype(np.int8) - np.int8(16), T.Q8_0: lambda b: b["qs"]}


def to_q8_0(raw: np.ndarray, ggml_type: GGMLQuantizationType | int) -> np.ndarray:
    """Q4_0 / Q5_0 / Q8_0 blocks -> the Q8_0 blocks (bytes) that decode to bit-identical values."""
    t = _as_type(ggml_type)
    if t not in Q8_0_EXACT:
        raise ValueError(f"{t.name} has no exact Q8_0 form")
    blocks = _as_bytes(raw).view(BLOCK_DTYPES[t])
    out = np.empty(len(blocks), BLOCK_DTYPES[T.Q8_0])
    out["d"] = blocks["d"]
    out["qs"] = _Q8_0_INTS[t](blocks)
    return out.view(np.uint8)


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    return np.ascontiguousarray(raw).reshape(-1)


def _decode_rows(
    rows: np.ndarray, t: GGMLQuantizationType, out: np.ndarray, ids: np.ndarray | None = None
) -> None:
    """Decode rows (all of `rows`, or rows[ids]) into out, a chunk of rows at a time.

    rows: (n_rows, row_bytes) uint8; out: (n_out, row_len) float32 with n_out = len(ids) or n_rows.
    """
    n_out, row_len = out.shape
    step = max(1, _CHUNK_ELEMENTS // row_len)
    for start in range(0, n_out, step):
        stop = min(start + step, n_out)
        chunk = rows[start:stop] if ids is None else rows[ids[start:stop]]
        _decode_flat(np.ascontiguousarray(chunk).reshape(-1), t, out[start:stop].reshape(-1))


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: Sequence[int] | int) -> np.ndarray:
    """Decode a whole tensor to float32.

    raw: the tensor's bytes (uint8, e.g. `GGUFFile.raw(name)`); shape: numpy order, the last
    dimension is the row length (ggml's ne[0]), e.g. (rows, row_len) or (row_len,) for a vector.
    Returns a new, writeable float32 array of that shape.
    """
    t = _as_type(ggml_type)
    # np.isscalar's TypeIs names complex, not int: mypy narrows neither branch of an int | Sequence[int]
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)  # type: ignore[arg-type, union-attr]
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"bad tensor shape {shape}")
    row_len = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    rb = row_nbytes(t, row_len)
    raw = _as_bytes(raw)
    if raw.size != n_rows * rb:
        raise ValueError(
            f"{t.name} tensor of shape {shape} needs {n_rows * rb} bytes, got {raw.size}"
        )
    out = np.empty((n_rows, row_len), dtype=np.float32)
    _decode_rows(raw.reshape(n_rows, rb), t, out)
    return out.reshape(shape)


def dequantize_rows(
    raw: np.ndarray, ggml_type: GGMLQuantizationType | int, row_len: int, row_ids: Sequence[int] | np.ndarray
) -> np.ndarray:
    """Decode only the rows `row_ids` of a 2-D tensor (an embedding lookup) -> (len(row_ids), row_len).

    Negative ids and ids past the last row raise IndexError; ids may repeat and come in any order.
    """
    t = _as_type(ggml_type)
    rb = row_nbytes(t, row_len)
    raw = _as_bytes(raw)
    if raw.size % rb:
        raise ValueError(f"{raw.size} bytes is not a whole number of {t.name} rows of {row_len} elements")
    n_rows = raw.size // rb
    ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
        bad = int(ids[(ids < 0) | (ids >= n_rows)][0])
        raise IndexError(f"row id {bad} out of range for a tensor of {n_rows} rows")
    out = np.empty((ids.size, row_len), dtype=np.float32)
    _decode_rows(raw.reshape(n_rows, rb), t, out, ids)
    return out
