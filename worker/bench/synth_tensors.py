"""Random tensor data for synthetic models: valid quantized blocks whose dequantized values have a
realistic spread, generated a chunk of rows at a time so a multi-GB file needs only a few MB, and
a pure function of (seed, tensor name, chunk index) so the same seed gives the same bytes."""

from __future__ import annotations

import functools
import zlib

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ember.kernels.quants import BLOCK_DTYPES, pack_k_scales

from .synth_shapes import PlannedTensor, SynthError

T = GGMLQuantizationType

WEIGHT_STD = 0.02  # target standard deviation of the dequantized random weights
_U = (0.5, 1.5)  # per-block spread of the scales around their target


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _signs(rng: np.random.Generator, shape) -> np.ndarray:
    return np.where(rng.random(shape) < 0.5, -1.0, 1.0)


def _uniform_std(levels: int) -> float:
    """Standard deviation of an integer uniform over `levels` consecutive values."""
    return float(np.sqrt((levels * levels - 1) / 12.0))


def _random_blocks(t: GGMLQuantizationType, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random blocks of type t as bytes: random codes, scales chosen for a ~WEIGHT_STD spread.

    Scale conventions follow what llama.cpp's quantizers emit: Q4_0/Q5_0/Q6_K scales of either sign
    (d = max / -8 etc.), Q8_0 codes in -127..127, K-quant 6-bit sub-block scales with mins that
    centre the 4/5-bit codes.
    """
    dt = BLOCK_DTYPES[t]
    raw = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=np.uint8).copy()
    b = raw.view(dt)
    spread = rng.uniform(*_U, size=n)
    if t == T.Q8_0:
        qs = b["qs"]
        qs[qs == -128] = -127
        b["d"] = _f16(WEIGHT_STD / _uniform_std(255) * spread)
    elif t in (T.Q4_0, T.Q5_0):
        levels = 16 if t == T.Q4_0 else 32
        b["d"] = _f16(WEIGHT_STD / _uniform_std(levels) * spread * _signs(rng, n))
    elif t in (T.Q4_1, T.Q5_1):
        levels = 16 if t == T.Q4_1 else 32
        d = _f16(WEIGHT_STD / _uniform_std(levels) * spread)
        b["d"] = d
        b["m"] = _f16(-d.astype(np.float64) * (levels - 1) / 2 * rng.uniform(0.9, 1.1, size=n))
    elif t in (T.Q4_K, T.Q5_K):
        levels = 16 if t == T.Q4_K else 32
        sc = rng.integers(24, 64, size=(n, 8))
        rms_sc = float(np.sqrt(np.mean(np.arange(24, 64) ** 2)))
        d = _f16(WEIGHT_STD / (rms_sc * _uniform_std(levels)) * spread)
        # dmin/d so that the largest min (63 * (levels-1)/2 / ratio) still fits in 6 bits
        ratio = rng.uniform((levels - 1) / 2, (levels - 1) / 2 * 1.2, size=n)
        dmin = _f16(d.astype(np.float64) * ratio)
        centre = sc * ((levels - 1) / 2) * (d.astype(np.float64) / dmin.astype(np.float64))[:, None]
        m = np.clip(np.rint(centre) + rng.integers(-1, 2, size=(n, 8)), 0, 63)
        b["d"], b["dmin"] = d, dmin
        b["scales"] = pack_k_scales(sc.astype(np.uint8), m.astype(np.uint8))
    elif t == T.Q6_K:
        mag = rng.integers(32, 128, size=(n, 16))
        b["scales"] = (mag * _signs(rng, (n, 16))).astype(np.int8)
        rms_sc = float(np.sqrt(np.mean(np.arange(32, 128) ** 2)))
        b["d"] = _f16(WEIGHT_STD / (rms_sc * _uniform_std(64)) * spread * _signs(rng, n))
    elif t in _SCALED_BY_GGUF:
        _scale_to_std(t, b, spread)
    else:
        raise SynthError(f"no random block generator for {t.name}")
    return raw


# The low-bit K-quants, the i-quants and MXFP4: random codes (every byte pattern is a valid grid index,
# sign pattern or scale), the block scale then set from what gguf-py decodes them to
_SCALED_BY_GGUF = (T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS, T.MXFP4)


def _halves(dt: np.dtype) -> list[str]:
    return [n for n in dt.names or () if dt[n] == np.dtype("<f2")]


@functools.cache
def _unit_std(t: GGMLQuantizationType) -> float:
    """The mean standard deviation of a block of random codes of type t as gguf-py decodes it with every
    float16 scale 1 (MXFP4: 2^0), over a fixed sample: decoding every block of a multi-GB file through
    gguf-py would take most of an hour (IQ2_XXS: a few MB/s)."""
    dt = BLOCK_DTYPES[t]
    rng = np.random.default_rng(np.random.SeedSequence([0x5CA1E, int(t)]))
    b = np.frombuffer(rng.bytes(_UNIT_SAMPLE * dt.itemsize), dtype=np.uint8).copy().view(dt)
    if t == T.MXFP4:
        b["e"] = 127
    for n in _halves(dt):
        b[n] = 1.0
    from gguf import quants as gguf_quants

    values = gguf_quants.dequantize(b.view(np.uint8).reshape(len(b), -1), t)
    return float(values.std(axis=-1).mean())


_UNIT_SAMPLE = 4096  # blocks


def _scale_to_std(t: GGMLQuantizationType, b: np.ndarray, spread: np.ndarray) -> None:
    """Scale the blocks (values linear in their float16 scales, or in 2^e for MXFP4) to about WEIGHT_STD *
    spread each: the codes' own spread is the sample's (_unit_std), not each block's."""
    target = WEIGHT_STD * spread / _unit_std(t)
    if t == T.MXFP4:
        b["e"] = np.clip(127 + np.rint(np.log2(target)), 1, 254).astype(np.uint8)
    for n in _halves(b.dtype):
        b[n] = _f16(target)


def random_rows(name: str, t: GGMLQuantizationType, n_rows: int, row_len: int,
                rng: np.random.Generator, n_index: int = 0) -> np.ndarray:
    """n_rows rows of tensor `name` as bytes. An I32 tensor is an index table: each row `row_len`
    distinct indices below `n_index` (deepseek4's hash routing, token -> experts)."""
    if t == T.I32:
        if not row_len <= n_index:
            raise SynthError(f"{name}: {row_len} distinct indices a row need n_index >= {row_len}, got {n_index}")
        rows = np.argsort(rng.random((n_rows, n_index)), axis=1)[:, :row_len]
        return rows.astype(np.int32).view(np.uint8).reshape(-1)
    if t in (T.F32, T.F16, T.BF16):
        if name.endswith(("norm.weight", "hc_attn_scale.weight", "hc_ffn_scale.weight", "output_hc_scale.weight")):
            # norms near 1 (gemma's stored 1 + w included); so are deepseek4's hyper-connection scales
            x = 1.0 + 0.05 * rng.standard_normal(n_rows * row_len, dtype=np.float32)
        else:  # biases and float weights
            x = WEIGHT_STD * rng.standard_normal(n_rows * row_len, dtype=np.float32)
        if t == T.F32:
            return x.view(np.uint8)
        if t == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, _ = GGML_QUANT_SIZES[t]
    return _random_blocks(t, n_rows * row_len // block, rng)


_CHUNK_BYTES = 8 << 20  # tensor data generated and written per step


def tensor_chunks(pt: PlannedTensor, seed: int, n_index: int = 0):
    """The tensor's bytes in chunks of whole rows; chunk k is a pure function of (seed, name, k).
    n_index: the bound of an index table's entries (random_rows)."""
    row_len = pt.shape[0]
    n_rows = int(np.prod(pt.shape[1:], dtype=np.int64)) if len(pt.shape) > 1 else 1
    block, size = GGML_QUANT_SIZES[pt.ggml_type]
    row_bytes = row_len // block * size
    step = max(1, _CHUNK_BYTES // row_bytes)
    name_key = zlib.crc32(pt.name.encode())
    for k, start in enumerate(range(0, n_rows, step)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, name_key, k]))
        yield random_rows(pt.name, pt.ggml_type, min(step, n_rows - start), row_len, rng, n_index)
