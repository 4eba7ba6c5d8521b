"""The kernels on the block types issue 39 brought to the CUDA backend (constants.LOW_BIT_TYPES: Q4_1, Q5_1,
Q2_K, Q3_K, the i-quants and MXFP4), each against its numpy twin on a real GPU, in every path a matrix
of the type takes: dequant.cu (rows to float32, bit for bit with gguf-py; whole matrices to f16/bf16,
the rounded twin), the staged matvec at batch 1 and small batches (with residual, split over a
block's warps, rows kept packed), the gated one, and a mixture of experts through the grouped matvec
and the tensor-core tiles (qgemm.cu). Outputs are NaN-poisoned before each launch; the float paths'
bar is ||out - ref|| / ||ref|| < 1e-5 against float64 math, as tests/test_kernels_gpu.py's.

The decoders' bit layouts are also held to gguf-py on the CPU, without a GPU
(tests/test_quant_decoders_host.py). All tests here are marked gpu and skip without a device.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as peer
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from moe_support import assert_fused_batch1_is_grouped

from ember.kernels import constants, ops, quants, reference
from ember.kernels.quants import BLOCK_DTYPES

pytestmark = pytest.mark.gpu

TYPES = {name: T(constants.GGML_TYPE_IDS[name]) for name in constants.LOW_BIT_TYPES}
FP32_BAR = 1e-5




def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite (unwritten?) elements"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_tensor(rng: np.random.Generator, t: T, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
    """Raw bytes of a random [rows, cols] tensor of type t: random codes (every grid index and sign
    pattern is valid), float16 scales about `scale` with a few blocks 30x larger, MXFP4 exponents near 2^-4."""
    block, size = GGML_QUANT_SIZES[t]
    n = rows * cols // block
    raw = rng.integers(0, 256, n * size, dtype=np.uint8)
    blocks = raw.view(BLOCK_DTYPES[t])
    for field in blocks.dtype.names:
        if blocks.dtype[field] == np.dtype("<f2"):
            blocks[field] = (rng.normal(0, scale, n) * rng.choice([1, 1, 1, 30], n)).astype(np.float16)
    if t == T.MXFP4:
        blocks["e"] = rng.integers(118, 127, n, dtype=np.uint8)
    return raw


def upload(dev, rng, tname: str, rows: int, cols: int, align_rows: bool = True, scale: float = 0.02):
    t = TYPES[tname]
    raw = random_tensor(rng, t, rows, cols, scale)
    w = ops.QuantMatrix.upload(dev, raw, t, rows, cols, align_rows=align_rows)
    return w, raw, quants.dequantize(raw, t, (rows, cols))


def half_bits(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 -> f16 / bf16 bits, rounded to nearest even (the kernels' f2h / f2bf)."""
    x = np.ascontiguousarray(x, np.float32)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# -- dequant.cu -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("align_rows", [True, False])
def test_dequant_is_gguf_py_bit_for_bit(dev, rng, tname, align_rows):
    """Rows by id (repeats, the first and the last) and the whole matrix to float32, equal to gguf-py's
    dequantize and the numpy twin's; the whole matrix to f16 and bf16, equal to their rounding; rows
    padded to 16 bytes on upload or kept packed (the 2-byte-aligned load path of dequant_*_a2)."""
    rows, cols = 67, 768  # 3 K-blocks or 24 small blocks a row: several types' rows need padding
    w, raw, wf = upload(dev, rng, tname, rows, cols, align_rows=align_rows)
    gg = peer.dequantize(raw.reshape(rows, -1), TYPES[tname]).reshape(rows, cols)
    np.testing.assert_array_equal(wf.view(np.uint32), gg.astype(np.float32).view(np.uint32))
    ids = rng.integers(0, rows, 41).astype(np.int32)
    ids[:3] = [0, rows - 1, ids[5]]
    out = dev.empty((ids.size, cols))
    out.poison()
    ops.dequant_rows(dev, w, out, dev.to_device(ids))
    np.testing.assert_array_equal(out.to_host().view(np.uint32), wf[ids].view(np.uint32))
    full = dev.empty((rows, cols))
    full.poison()
    ops.dequant_rows(dev, w, full, scale=1.0)
    np.testing.assert_array_equal(full.to_host().view(np.uint32), wf.view(np.uint32))
    for kind in ("f16", "bf16"):
        half = dev.empty(rows * cols, np.uint16)
        half.poison()
        ops.dequant_half(dev, w, half, kind=kind)
        np.testing.assert_array_equal(half.to_host().reshape(rows, cols), half_bits(wf, kind), err_msg=kind)


@pytest.mark.parametrize("tname", list(TYPES))
def test_embed_rows_scaled_and_normed(dev, rng, tname):
    """A step's first kernel on a table of the type: the scaled rows bit for bit, their RMSNorm < 1e-5."""
    rows, cols, n = 50, 512, 7
    w, raw, wf = upload(dev, rng, tname, rows, cols)
    ids = rng.integers(0, rows, n).astype(np.int32)
    norm_w = rng.normal(1, 0.1, cols).astype(np.float32)
    out, h = dev.empty((n, cols)), dev.empty((n, cols))
    out.poison()
    h.poison()
    ops.embed(dev, w, out, dev.to_device(ids), n=n, scale=2.5, norm=(dev.to_device(norm_w), 1e-6, h))
    rows_ref = (wf[ids] * np.float32(2.5)).astype(np.float32)
    np.testing.assert_array_equal(out.to_host().view(np.uint32), rows_ref.view(np.uint32))
    assert rel_err(h.to_host(), reference.rms_norm(rows_ref.astype(np.float64), norm_w.astype(np.float64), 1e-6)) \
        < FP32_BAR


# -- the staged matvec ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("n", [1, 3, 8, 11])
def test_matvec_matches_linear(dev, rng, tname, n):
    """Every rows-per-warp and batch (launches of up to 8 rows), 1000 rows (the last block of warps part
    empty), 2304 columns (a partial last chunk); + res."""
    rows, cols = 1000, 2304
    w, raw, wf = upload(dev, rng, tname, rows, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    res = rng.normal(0, 1, (n, rows)).astype(np.float32)
    ref = x.astype(np.float64) @ wf.T.astype(np.float64)
    y = dev.empty((n, rows))
    for r in (1, 2, 4):
        y.poison()
        ops.matvec(dev, w, dev.to_device(x), y, rows_per_warp=r, variant="staged")
        assert rel_err(y.to_host(), ref) < FP32_BAR, (tname, n, r)
    y.poison()
    ops.matvec(dev, w, dev.to_device(x), y, res=dev.to_device(res))  # the default choice
    assert rel_err(y.to_host(), ref + res) < FP32_BAR


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("cols", [1024, 2304])
def test_matvec_split_over_a_blocks_warps(dev, rng, tname, cols):
    """Batch 1 with R rows a block whose warps share the chunks (qmvs: loaded in the widest aligned
    width, 4 or 8 bytes where a quarter chunk of 66-110-byte blocks is not 16 bytes' multiple); a last
    block partly past the rows; + res."""
    rows = 1003
    w, raw, wf = upload(dev, rng, tname, rows, cols)
    x = rng.normal(0, 1, (1, cols)).astype(np.float32)
    res = rng.normal(0, 1, (1, rows)).astype(np.float32)
    ref = x.astype(np.float64) @ wf.T.astype(np.float64) + res
    y = dev.empty((1, rows))
    for r in (1, 2, 4):
        y.poison()
        ops.matvec(dev, w, dev.to_device(x), y, res=dev.to_device(res), variant="staged", split=True, rows_per_warp=r)
        assert rel_err(y.to_host(), ref) < FP32_BAR, (tname, cols, r)


@pytest.mark.parametrize("tname", [t for t in TYPES if GGML_QUANT_SIZES[TYPES[t]][0] == 32 or t == "q3_k"])
def test_matvec_packed_rows(dev, rng, tname):
    """Rows kept at their own length (not padded to 16 bytes): the 2-byte-load staging path, in place
    (MXFP4 rows of an even number of blocks: an odd row length is refused, test_matvec_refuses_odd_rows)."""
    rows, n = 77, 5
    cols = {"q3_k": 256 * 3, "mxfp4": 32 * 6}.get(tname, 32 * 5)
    w, raw, wf = upload(dev, rng, tname, rows, cols, align_rows=False)
    assert w.row_bytes % 16, "test meant for packed rows"
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    res = rng.normal(0, 1, (n, rows)).astype(np.float32)
    yd = dev.to_device(res)
    ops.matvec(dev, w, dev.to_device(x), yd, res=yd, variant="staged")
    assert rel_err(yd.to_host(), x.astype(np.float64) @ wf.T.astype(np.float64) + res) < FP32_BAR


def test_matvec_refuses_odd_rows(dev, rng):
    """MXFP4 rows of an odd number of 17-byte blocks, kept packed, cannot be staged 2 bytes at a time."""
    w, raw, wf = upload(dev, rng, "mxfp4", 4, 32 * 5, align_rows=False)
    with pytest.raises(ValueError, match="odd"):
        ops.matvec(dev, w, dev.to_device(np.ones((1, 160), np.float32)), dev.empty((1, 4)), variant="staged")


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("n", [1, 5])
def test_matvec_gated(dev, rng, tname, n):
    """The stacked [gate; up] matvec with the activation in its epilogue (the MLP's path for types
    without an int8 kernel)."""
    ffn, cols = 99, 768
    w, raw, wf = upload(dev, rng, tname, 2 * ffn, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float64)
    ref = reference.silu(x @ wf[:ffn].T.astype(np.float64)) * (x @ wf[ffn:].T.astype(np.float64))
    y = dev.empty((n, ffn))
    y.poison()
    ops.matvec_gated(dev, w, dev.to_device(x.astype(np.float32)), y, n=n, act="silu")
    assert rel_err(y.to_host(), ref) < FP32_BAR


@pytest.mark.parametrize("tname", ["q4_1", "iq4_xs", "iq2_xxs"])
def test_linear_tc(dev, rng, tname):
    """Prefill's dense matmul: the matrix decoded to 16 bits and multiplied on the tensor cores."""
    m, rows, cols = 70, 384, 1024
    w, raw, wf = upload(dev, rng, tname, rows, cols)
    x = rng.normal(0, 1, (m, cols)).astype(np.float32)
    y = dev.empty(m * rows)
    y.poison()
    ops.linear_tc(dev, w, dev.to_device(x), y, n=m, kind="f16")
    assert rel_err(y.to_host().reshape(m, rows), x.astype(np.float64) @ wf.T.astype(np.float64)) < 1e-2


# -- mixture of experts: the grouped matvec and the tensor-core tiles ---------------------------------------------


def _clear_rows(x: np.ndarray, router: np.ndarray, k: int) -> np.ndarray:
    """Rows whose choice of k experts is clear (float32 sums in another order cannot flip it)."""
    top = -np.sort(-reference.softmax(reference.linear(x, router)), axis=-1)
    return (top[:, k - 1] - top[:, k]) > 1e-4 * np.abs(top[:, :1]).max(axis=-1)


# (gate, up, down): the users' mixes (DeepSeek-V4-Flash's IQ2_XXS|Q2_K, a Qwen3 2-3-bit dynamic mix, gpt-oss's
# MXFP4), then every other type once (gate and up apart where their types differ)
MOE_MIXES = [("iq2_xxs", "iq2_xxs", "q2_k"), ("iq3_xxs", "iq3_xxs", "q3_k"), ("mxfp4", "mxfp4", "mxfp4"),
             ("iq2_xs", "iq2_s", "iq3_s"), ("iq4_xs", "iq4_xs", "iq4_nl"), ("q4_1", "q4_1", "q5_1")]


@pytest.mark.parametrize("types", MOE_MIXES, ids="-".join)
@pytest.mark.parametrize("n,half", [(1, None), (3, None), (40, "bf16"), (160, "f16")],
                         ids=["1", "3", "40-bf16", "160-f16"])
def test_moe_mlp_matches_reference(dev, rng, types, n, half):
    """Every row through its experts: one row (the grouped matvec's tiles of one pair), a few (tiles of
    8), and on the tensor cores in tiles of 16 pairs (bf16 inputs) and 64 (f16: inputs scaled down so
    products stay in range, the router up so routing stays clear)."""
    E, k, hidden, ffn = 16, 4, 512, 256
    tt = [TYPES[t] for t in types]
    router = rng.normal(0, 100.0 if half == "f16" else 0.1, (E, hidden)).astype(np.float32)
    raws = [random_tensor(rng, tt[0], E * ffn, hidden), random_tensor(rng, tt[1], E * ffn, hidden),
            random_tensor(rng, tt[2], E * hidden, ffn)]
    gate, up = (quants.dequantize(r, t, (E, ffn, hidden)) for r, t in zip(raws[:2], tt[:2], strict=True))
    down = quants.dequantize(raws[2], tt[2], (E, hidden, ffn))
    stacked = tt[0] == tt[1]
    em = ops.ExpertMatrices.upload
    w = ops.MoeWeights(
        router=ops.QuantMatrix.upload(dev, router, T.F32, E, hidden),
        down=em(dev, [raws[2]], tt[2], E, [hidden], ffn),
        gate_up=em(dev, raws[:2], tt[0], E, [ffn, ffn], hidden) if stacked else None,
        gate=None if stacked else em(dev, [raws[0]], tt[0], E, [ffn], hidden),
        up=None if stacked else em(dev, [raws[1]], tt[1], E, [ffn], hidden))
    x = rng.normal(0, 1, (8 * n, hidden)).astype(np.float32)
    if half == "f16":
        x = x * np.float32(1e-3)
    x, x_more = x[_clear_rows(x, router, k)][:n], x[: 3]
    assert len(x) == n
    res = rng.normal(0, 1, (n, hidden)).astype(np.float32)
    scratch = ops.MoeScratch.alloc(dev, n, E, k, hidden, ffn, apart=not stacked)
    for s in (scratch.xs, scratch.hs, scratch.ys):
        s.poison()
    y = dev.empty((n, hidden))
    y.poison()
    ops.moe_mlp(dev, w, dev.to_device(x), y, scratch, n=n, k=k, act="silu", gating="softmax", norm_topk=True,
                res=dev.to_device(res), half=half)
    ref = reference.moe_mlp(x, router, gate, up, down, k=k, act="silu")
    assert rel_err(y.to_host() - res, ref) < {None: FP32_BAR, "f16": 3e-3, "bf16": 1e-2}[half], types
    if n == 1:
        assert_fused_batch1_is_grouped(dev, w, x_more, k=k, apart=not stacked, act="silu", gating="softmax",
                                       norm_topk=True)


@pytest.mark.parametrize("up_type", ["mxfp4", "q5_1"], ids=["gate|up", "apart"])
@pytest.mark.parametrize("n,half", [(1, None), (3, None), (40, "bf16"), (160, "f16")],
                         ids=["1", "3", "40-bf16", "160-f16"])
def test_moe_mlp_gpt_oss(dev, rng, up_type, n, half):
    """gpt-oss's experts (32, 4 a token, as gpt-oss-20b): MXFP4 blocks (ffn 96: 17-byte blocks in rows padded to
    16 bytes), a bias on the router and on every expert's gate, up and down rows (added by the grouped products'
    epilogues, before the activation: qmoeg/qgemmg with gate and up stacked; qmoe/qgemm then gated_act with
    them apart), the softmax over the top k of the router's logits (no renormalisation) and the clamped
    SwiGLU, on every path: tiles of one pair, of 8, and the tensor cores' tiles of 16 and 64."""
    E, k, hidden, ffn = 32, 4, 512, 96
    gt, ut, dt = TYPES["mxfp4"], TYPES[up_type], TYPES["mxfp4"]
    router = rng.normal(0, 100.0 if half == "f16" else 0.1, (E, hidden)).astype(np.float32)
    rb = rng.normal(0, 0.5, E).astype(np.float32)
    gb, ub = (rng.normal(0, 2, (E, ffn)).astype(np.float32) for _ in range(2))  # gate/up past the clamps at 7 too
    db = rng.normal(0, 1, (E, hidden)).astype(np.float32)
    raws = [random_tensor(rng, gt, E * ffn, hidden), random_tensor(rng, ut, E * ffn, hidden),
            random_tensor(rng, dt, E * hidden, ffn)]
    gate, up = (quants.dequantize(r, t, (E, ffn, hidden)) for r, t in zip(raws[:2], (gt, ut), strict=True))
    down = quants.dequantize(raws[2], dt, (E, hidden, ffn))
    stacked = gt == ut
    em = ops.ExpertMatrices.upload
    w = ops.MoeWeights(
        router=ops.QuantMatrix.upload(dev, router, T.F32, E, hidden),
        down=em(dev, [raws[2]], dt, E, [hidden], ffn, biases=[db]),
        gate_up=em(dev, raws[:2], gt, E, [ffn, ffn], hidden, biases=[gb, ub]) if stacked else None,
        gate=None if stacked else em(dev, [raws[0]], gt, E, [ffn], hidden, biases=[gb]),
        up=None if stacked else em(dev, [raws[1]], ut, E, [ffn], hidden, biases=[ub]),
        router_bias=dev.to_device(rb))
    assert w.down.m.stride % 16 == 0 and w.down.m.stride != quants.row_nbytes(dt, ffn)  # padded MXFP4 rows
    x = rng.normal(0, 1, (8 * n, hidden)).astype(np.float32)
    if half == "f16":
        x = x * np.float32(1e-3)
    top = -np.sort(-reference.linear(x, router, rb), axis=-1)  # rows whose k largest logits are clear
    x, x_more = x[(top[:, k - 1] - top[:, k]) > 1e-4 * np.abs(top[:, :1]).max(axis=-1)][:n], x[:3]
    assert len(x) == n
    res = rng.normal(0, 1, (n, hidden)).astype(np.float32)
    scratch = ops.MoeScratch.alloc(dev, n, E, k, hidden, ffn, apart=not stacked)
    for s in (scratch.xs, scratch.hs, scratch.ys):
        s.poison()
    y = dev.empty((n, hidden))
    y.poison()
    ops.moe_mlp(dev, w, dev.to_device(x), y, scratch, n=n, k=k, act="swiglu_oai", gating="softmax-topk",
                norm_topk=False, res=dev.to_device(res), half=half)
    ref = reference.moe_mlp(x, router, gate, up, down, k=k, act="swiglu_oai", gating="softmax-topk", norm_topk=False,
                            biases=(rb, gb, ub, db))
    assert rel_err(y.to_host() - res, ref) < {None: FP32_BAR, "f16": 3e-3, "bf16": 1e-2}[half]
    if n == 1:
        assert_fused_batch1_is_grouped(dev, w, x_more, k=k, apart=not stacked, act="swiglu_oai",
                                       gating="softmax-topk", norm_topk=False)


@pytest.mark.parametrize("tname,cols", [(t, 4096) for t in TYPES] +
                         [(t, 768) for t in TYPES if GGML_QUANT_SIZES[TYPES[t]][0] == 32])
def test_grouped_matvec_at_batch_1_is_column_resident(dev, rng, tname, cols):
    """One token's pairs through the grouped matvec (tiles of one pair): the low-bit types take qmoc_b1 (a
    thread 32 columns of every row, x in registers), a partial block of rows (and at 768 columns, of a
    warp's: 24 threads), with the experts' biases; x one row for every pair, or a row a pair."""
    E, rows = 5, 40
    raw = random_tensor(rng, TYPES[tname], E * rows, cols)
    wf = quants.dequantize(raw, TYPES[tname], (E, rows, cols)).astype(np.float64)
    bias = rng.normal(0, 0.1, (E, rows)).astype(np.float32)
    w = ops.ExpertMatrices.upload(dev, [raw], TYPES[tname], E, [rows], cols, biases=[bias])
    ids = np.array([3, 0, 4, 1], np.int32)  # one token's k = 4 choices
    pairs = len(ids)
    pos, order = dev.empty((pairs,), np.int32), dev.empty((pairs,), np.int32)
    tiles = dev.empty((3 * ops.moe.max_tiles(pairs, E, 1),), np.int32)
    nt = ops.moe_group(dev, dev.to_device(ids), pos, order, tiles, pairs=pairs, experts=E, tile=1)
    experts = ids[order.to_host()]  # each grouped pair's expert
    for per_pair in (False, True):
        x = rng.normal(0, 1, (pairs if per_pair else 1, cols)).astype(np.float32)
        d_x = dev.to_device(x)
        assert ops.moe.qmoc_supported(w, d_x)
        y = dev.empty((pairs, rows))
        y.poison()
        ops.moe_matvec(dev, w, tiles, nt, d_x, y, tile=1, x_per_pair=per_pair)
        xs = x if per_pair else np.repeat(x, pairs, axis=0)
        ref = np.einsum("pc,prc->pr", xs.astype(np.float64), wf[experts]) + bias[experts]
        assert rel_err(y.to_host(), ref) < FP32_BAR, (tname, per_pair)


@pytest.mark.parametrize("tname", list(TYPES))
@pytest.mark.parametrize("tile,half", [(16, "bf16"), (64, "f16")])
def test_qgemm_tiles_match_linear(dev, rng, tname, tile, half):
    """qgemm.cu on one type, plain and gated, straight from moe_group's tiles: 3 experts, 2 * tile + 5
    pairs of expert 1 (two full tiles and a partial one) and 1 of expert 2, x read through `order`."""
    E, rows, cols = 3, 160, 512  # 160 rows: a CTA's 128 and a partial second
    raw = random_tensor(rng, TYPES[tname], E * rows, cols)
    wf = quants.dequantize(raw, TYPES[tname], (E, rows, cols)).astype(np.float64)
    w = ops.ExpertMatrices.upload(dev, [raw], TYPES[tname], E, [rows], cols)
    ids = np.array([1] * (2 * tile + 5) + [2], np.int32)
    pairs = len(ids)
    x = (rng.normal(0, 1, (pairs, cols)) * (1e-2 if half == "f16" else 1.0)).astype(np.float32)
    pos, order = dev.empty((pairs,), np.int32), dev.empty((pairs,), np.int32)
    tiles = dev.empty((3 * ops.moe.max_tiles(pairs, E, tile),), np.int32)
    nt = ops.moe_group(dev, dev.to_device(ids), pos, order, tiles, pairs=pairs, experts=E, tile=tile)
    order_h = order.to_host()
    xg = x[order_h]  # grouped order: what `order` reads in place (k = 1: pair q is token q)

    def rounded(a):
        bits = half_bits(a, half)
        return bits.view(np.float16).astype(np.float64) if half == "f16" else \
            (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    we = rounded(wf[ids[order_h]])  # each grouped pair's expert matrix, its weights in 16 bits
    ref = np.einsum("pc,prc->pr", rounded(xg), we)
    y = dev.empty((pairs, rows))
    y.poison()
    ops.moe_gemm(dev, w, tiles, nt, dev.to_device(x), y, tile=tile, half=half, order=order, k=1)
    assert rel_err(y.to_host(), ref) < 1e-4, tname
    ffn = rows // 2
    yg = dev.empty((pairs, ffn))
    yg.poison()
    ops.moe_gemm(dev, w, tiles, nt, dev.to_device(x), yg, tile=tile, half=half, order=order, k=1, act="silu")
    assert rel_err(yg.to_host(), reference.silu(ref[:, :ffn]) * ref[:, ffn:]) < 1e-4, tname


@pytest.mark.parametrize("tname", ["iq2_xxs", "q2_k"])
def test_grouped_matvec_at_batch_1_in_int8(dev, rng, tname):
    """qmoc8_b1: one token's pairs (tiles of one pair) with x quantized to int8 per 32 columns, the weights'
    quants dp4a'd (IQ2_XXS signed by byte masks, Q2_K's minimums through x's quant sums): the twin's
    linear_q8 per expert, to float32 rounding; x one row or a row a pair; the other types are refused."""
    E, rows, cols = 5, 40, 4096
    raw = random_tensor(rng, TYPES[tname], E * rows, cols)
    wf = quants.dequantize(raw, TYPES[tname], (E, rows, cols)).astype(np.float64)
    bias = rng.normal(0, 0.1, (E, rows)).astype(np.float32)
    w = ops.ExpertMatrices.upload(dev, [raw], TYPES[tname], E, [rows], cols, biases=[bias])
    ids = np.array([3, 0, 4, 1, 2, 3], np.int32)
    pairs = len(ids)
    pos, order = dev.empty((pairs,), np.int32), dev.empty((pairs,), np.int32)
    tiles = dev.empty((3 * ops.moe.max_tiles(pairs, E, 1),), np.int32)
    nt = ops.moe_group(dev, dev.to_device(ids), pos, order, tiles, pairs=pairs, experts=E, tile=1)
    experts = ids[order.to_host()]
    for per_pair in (False, True):
        x = rng.normal(0, 1, (pairs if per_pair else 1, cols)).astype(np.float32)
        d_x = dev.to_device(x)
        y = dev.empty((pairs, rows))
        y.poison()
        ops.moe_matvec(dev, w, tiles, nt, d_x, y, tile=1, x_per_pair=per_pair, int8=True)
        xs = x if per_pair else np.repeat(x, pairs, axis=0)
        ref = np.stack([reference.linear_q8(xs[p : p + 1], wf[e])[0] for p, e in enumerate(experts)]) + bias[experts]
        assert rel_err(y.to_host(), ref) < 1e-5, (tname, per_pair)
        plain = np.einsum("pc,prc->pr", xs.astype(np.float64), wf[experts]) + bias[experts]
        assert rel_err(y.to_host(), plain) < 2e-2  # int8 inputs: near the float32 product, not equal
    other = ops.ExpertMatrices.upload(dev, [random_tensor(rng, TYPES["iq3_s"], E * rows, cols)], TYPES["iq3_s"], E,
                                      [rows], cols)
    with pytest.raises(ValueError, match="int8 grouped matvec"):
        ops.moe_matvec(dev, other, tiles, nt, d_x, y, tile=1, int8=True)
