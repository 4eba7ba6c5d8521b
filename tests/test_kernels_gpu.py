"""Every CUDA kernel against its numpy twin (kernels/reference.py, kernels/quants.py) on fresh random
inputs, on a real GPU. Outputs are poisoned (NaN) before each launch, so an element a kernel fails
to write shows. Error is ||out - ref|| / ||ref|| against the twin's math done in float64 where the
twin's float32 rounding would blur it; the bar is 1e-5 (float32 paths) and 1e-2 (fp16 storage).

All tests are marked gpu and skip where no CUDA device (or no cuda-python) exists, as on CI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from moe_support import assert_fused_batch1_is_grouped

from ember.kernels import ops, quants, reference
from ember.kernels.constants import ACTIVATIONS
from ember.kernels.quants import BLOCK_DTYPES

pytestmark = pytest.mark.gpu

QTYPES = {"q4_0": T.Q4_0, "q5_0": T.Q5_0, "q8_0": T.Q8_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K,
          "f16": T.F16, "bf16": T.BF16, "f32": T.F32}
FP32_BAR = 1e-5
FP16_BAR = 1e-2




def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite (unwritten?) elements"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_tensor(rng: np.random.Generator, t: T, rows: int, cols: int) -> np.ndarray:
    """Raw bytes of a valid random [rows, cols] tensor of type t (scales of realistic size)."""
    block, size = GGML_QUANT_SIZES[t]
    n = rows * cols // block
    if t == T.F32:
        return rng.normal(0, 1, rows * cols).astype(np.float32).view(np.uint8)
    if t == T.F16:
        return rng.normal(0, 1, rows * cols).astype(np.float16).view(np.uint8)
    if t == T.BF16:
        return (rng.normal(0, 1, rows * cols).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    blocks = raw.view(BLOCK_DTYPES[t])
    for name in blocks.dtype.names:
        if blocks.dtype[name] == np.dtype("<f2"):
            blocks[name] = (rng.normal(0, 0.02, n) * rng.choice([1, 1, 1, 30], n)).astype(np.float16)
    return raw


def upload_matrix(dev, rng, tname: str, rows: int, cols: int, align_rows: bool = True):
    t = QTYPES[tname]
    raw = random_tensor(rng, t, rows, cols)
    w = ops.QuantMatrix.upload(dev, raw, t, rows, cols, align_rows=align_rows)
    return w, raw, quants.dequantize(raw, t, (rows, cols))


# -- quantized matvec --------------------------------------------------------------------------------


@pytest.mark.parametrize("tname", list(QTYPES))
@pytest.mark.parametrize("n", [1, 3, 8, 11])
def test_matvec_matches_linear(dev, rng, tname, n):
    rows, cols = 1000, 2304  # a partial row chunk, and rows that do not fill the last block of warps
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    xd = dev.to_device(x)
    y = dev.empty((n, rows))
    for r in (1, 2, 4):
        y.poison()
        ops.matvec(dev, w, xd, y, rows_per_warp=r, variant="staged")
        out = y.to_host()
        ref = x.astype(np.float64) @ wf.T.astype(np.float64)
        err = rel_err(out, ref)
        assert err < FP32_BAR, (tname, n, r, err)
        assert rel_err(out, reference.linear(x, wf)) < FP32_BAR  # the float32 twin itself
    if n == 1:  # R rows a block, their chunks split over the block's warps (+ res); 1003: a last block
        for c in (cols, 1024):  # partly past the rows; 1024 columns: x staged in shared memory
            rows_s = 1003
            w, raw, wf = upload_matrix(dev, rng, tname, rows_s, c)
            xs = x[:, :c].copy()
            res = rng.normal(0, 1, (1, rows_s)).astype(np.float32)
            ref = xs.astype(np.float64) @ wf.T.astype(np.float64)
            ys = dev.empty((1, rows_s))
            for r in (1, 2, 4):
                ys.poison()
                ops.matvec(dev, w, dev.to_device(xs), ys, res=dev.to_device(res), variant="staged", split=True,
                           rows_per_warp=r)
                assert rel_err(ys.to_host(), ref + res) < FP32_BAR, (tname, c, r)
            ys.poison()
            ops.matvec(dev, w, dev.to_device(xs), ys, variant="staged")  # unsplit, one row a warp
            assert rel_err(ys.to_host(), ref) < FP32_BAR, (tname, c)


@pytest.mark.parametrize("tname", ["f32", "q8_0", "q4_k", "q6_k"])
def test_matvec_groups_is_each_groups_own_matvec(dev, rng, tname):
    """DeepSeek V4's grouped output projection at batch 1: group g's row of x through its own rows of the
    stacked W, in one launch; 100 rows a group, so a group's last block of warps is partly past its rows
    (which must not write into the next group's)."""
    groups, rank, cols = 8, 100, 2304
    w, raw, wf = upload_matrix(dev, rng, tname, groups * rank, cols)
    assert ops.matvec_groups_supported(w, groups)  # upload aligns rows to 16 bytes
    x = rng.normal(0, 1, (groups, cols)).astype(np.float32)
    ref = np.einsum("gc,grc->gr", x.astype(np.float64), wf.reshape(groups, rank, cols).astype(np.float64))
    y = dev.empty((groups, rank))
    for r in (1, 2, 4):
        y.poison()
        ops.matvec_groups(dev, w, dev.to_device(x), y, groups=groups, rows_per_warp=r)
        assert rel_err(y.to_host(), ref) < FP32_BAR, (tname, r)
    with pytest.raises(ValueError, match="whole groups"):
        ops.matvec_groups(dev, w, dev.to_device(x), y, groups=7)


@pytest.mark.parametrize("tname", ["f32", "q8_0", "q4_k"])
def test_matvec_fan_writes_each_stacked_matrix_to_its_own_output(dev, rng, tname):
    """Matrices of one input stacked in one upload, made at batch 1 in one launch, each into its own
    array (DeepSeek V4's key row, query and compressor rows): sizes that allow 4, 2 and 1 rows a warp."""
    cols = 2304
    for rows in ([512, 1024, 256], [8, 24, 8, 40, 16, 8], [4, 12]):
        w, raw, wf = upload_matrix(dev, rng, tname, sum(rows), cols)
        assert ops.matvec_fan_supported(dev, w, rows)
        x = rng.normal(0, 1, cols).astype(np.float32)
        ref = wf.astype(np.float64) @ x.astype(np.float64)
        outs = [dev.empty((r,)) for r in rows]
        for y in outs:
            y.poison()
        ops.matvec_fan(dev, w, dev.to_device(x), outs, rows=rows)
        lo = 0
        for y, r in zip(outs, rows, strict=True):
            assert rel_err(y.to_host(), ref[lo : lo + r]) < FP32_BAR, (tname, rows, r)
            lo += r
    assert not ops.matvec_fan_supported(dev, w, [6, 10])  # not a whole number of warps' rows each
    w, _, _ = upload_matrix(dev, rng, tname, 4 * (ops.FAN_MAX + 1), cols)
    assert not ops.matvec_fan_supported(dev, w, [4] * (ops.FAN_MAX + 1))  # more than one launch makes


@pytest.mark.parametrize("tname", ["q4_k", "q5_k"])
@pytest.mark.parametrize("n,unroll,prefetch", [(1, 4, False), (1, 8, False), (2, 2, False), (2, 4, False),
                                               (1, 2, True), (1, 4, True), (2, 2, True)])
@pytest.mark.parametrize("rows,cols", [(1000, 2304), (37, 14336), (300, 256)])
def test_matvec_kv2_matches_linear(dev, rng, tname, n, unroll, prefetch, rows, cols):
    """The column-resident Q4_K/Q5_K kernel: partial warps (2304 = 9 super-blocks), 7 warps per row
    (14336), rows that do not fill a block, every unroll, with and without a residual."""
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    xd = dev.to_device(x)
    res = rng.normal(0, 1, (n, rows)).astype(np.float32)
    ref = x.astype(np.float64) @ wf.T.astype(np.float64)
    y = dev.empty((n, rows))
    for rpb in (None, unroll, 64):
        y.poison()
        ops.matvec(dev, w, xd, y, variant="kv2", unroll=unroll, rows_per_block=rpb, prefetch=prefetch)
        assert rel_err(y.to_host(), ref) < FP32_BAR, rpb
    y.poison()
    ops.matvec(dev, w, xd, y, res=dev.to_device(res), variant="kv2", unroll=unroll, prefetch=prefetch)
    assert rel_err(y.to_host(), ref + res) < FP32_BAR
    y.poison()
    ops.matvec(dev, w, xd, y)  # the default choice (kv2 or staged, with its measured parameters)
    assert rel_err(y.to_host(), ref) < FP32_BAR


@pytest.mark.parametrize("tname", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("n,unroll,prefetch", sorted(ops.KQ8_VARIANTS))
@pytest.mark.parametrize("rows,cols", [(1000, 2304), (37, 14336), (300, 256)])
def test_matvec_q8_matches_twin(dev, rng, tname, n, unroll, prefetch, rows, cols):
    """The int8-activation kernel against its twin (x quantized the same way, float64 dot): partial
    warps, 7 warps per row, rows that do not fill a block, residual in place, a strided x; n = 4 is
    also run as 11 rows (launches of 4, 4 and 3)."""
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols)
    x = (rng.normal(0, 1, (n, cols)) * rng.choice([1, 1, 10], (n, cols))).astype(np.float32)
    ref = reference.linear_q8(x, wf)
    y = dev.empty((n, rows))
    for rpb in (None, unroll, 64):
        y.poison()
        ops.matvec_q8(dev, w, dev.to_device(x), y, n=n, unroll=unroll, prefetch=prefetch, rows_per_block=rpb)
        assert rel_err(y.to_host(), ref) < FP32_BAR, rpb
    # int8 x stays close to the float product (the quantization's own error, not the kernel's; x has
    # outliers 10x the rest, which coarsen their blocks' steps)
    assert rel_err(y.to_host(), x.astype(np.float64) @ wf.T.astype(np.float64)) < 5e-2
    res = rng.normal(0, 1, (n, rows)).astype(np.float32)
    yd = dev.to_device(res)
    ops.matvec_q8(dev, w, dev.to_device(x), yd, n=n, res=yd, unroll=unroll, prefetch=prefetch)
    assert rel_err(yd.to_host(), ref + res) < FP32_BAR
    wide = np.zeros((n, cols + 64), np.float32)
    wide[:, :cols] = x
    y.poison()
    ops.matvec_q8(dev, w, dev.to_device(wide), y, n=n, ldx=cols + 64, unroll=unroll, prefetch=prefetch)
    assert rel_err(y.to_host(), ref) < FP32_BAR
    if n == 4:
        x11 = rng.normal(0, 1, (11, cols)).astype(np.float32)
        y11 = dev.empty((11, rows))
        y11.poison()
        ops.matvec_q8(dev, w, dev.to_device(x11), y11, n=11, unroll=unroll, prefetch=prefetch)
        assert rel_err(y11.to_host(), reference.linear_q8(x11, wf)) < FP32_BAR


@pytest.mark.parametrize("rows,cols", [(1003, 640), (4096, 576), (70, 64)])
def test_stream_q8_0_matches_twin(dev, rng, rows, cols):
    """The streaming Q8_0 matvec (int8 x, persistent grid) against its twin: a last group of fewer than
    eight rows, grids of one block (every warp walks many groups), of three, and the default; + res."""
    w, raw, wf = upload_matrix(dev, rng, "q8_0", rows, cols)
    assert ops.stream_q8_0_supported(w)
    x = (rng.normal(0, 1, cols) * rng.choice([1, 1, 10], cols)).astype(np.float32)
    ref = reference.linear_q8(x[None], wf)[0]
    y = dev.empty(rows)
    for blocks in (1, 3, None):
        y.poison()
        ops.matvec_stream_q8_0(dev, w, dev.to_device(x), y, blocks=blocks)
        assert rel_err(y.to_host(), ref) < FP32_BAR, blocks
    res = rng.normal(0, 1, rows).astype(np.float32)
    y.poison()
    ops.matvec_stream_q8_0(dev, w, dev.to_device(x), y, res=dev.to_device(res))
    assert rel_err(y.to_host(), ref + res) < FP32_BAR
    assert rel_err(y.to_host() - res, x.astype(np.float64) @ wf.T.astype(np.float64)) < 5e-2


@pytest.mark.parametrize("rows,blocks", [(262144, None), (1003, 3), (70, 1)])
def test_stream_q8_0_argmax(dev, rng, rows, blocks):
    """The streaming matvec's greedy token: numpy's argmax of the y it wrote (first index on ties, one
    planted across blocks), twice in a row (the counter is left at zero), and sample() taking it for a
    greedy row (one block) while a sampled row still draws from y."""
    cols = 64
    raw = random_tensor(rng, QTYPES["q8_0"], rows, cols)
    tied = [0, rows // 2, rows - 1]
    by_row = raw.reshape(rows, -1)
    by_row[tied[1:]] = by_row[0]  # three equal rows: with the same res, an exact tie; the first index wins
    w = ops.QuantMatrix.upload(dev, raw, QTYPES["q8_0"], rows, cols)
    x = rng.normal(0, 1, cols).astype(np.float32)
    res = np.zeros(rows, np.float32)
    res[tied] = 1e4
    a = ops.RowArgmax.alloc(dev)
    y = dev.empty(rows)
    for _ in range(2):
        y.poison()
        a.best_i.poison()
        ops.matvec_stream_q8_0(dev, w, dev.to_device(x), y, res=dev.to_device(res), blocks=blocks, argmax=a)
        yh = y.to_host()
        assert int(a.best_i.to_host()[0]) == int(np.argmax(yh)) == 0
        assert a.best_v.to_host()[0] == yh.max()
        a.best_i.poison()
        ops.matvec_stream_q8_0(dev, w, dev.to_device(x), y, blocks=blocks, argmax=a)
        assert int(a.best_i.to_host()[0]) == int(np.argmax(y.to_host()))
    assert int(a.counter.to_host()[0]) == 0
    for temp, expect in ((0.0, int(np.argmax(y.to_host()))), (1.0, None)):
        buf = np.zeros(ops.SampleParams.nbytes(1), np.uint8)
        ops.SampleParams.pack(buf, 1, temperature=[temp], top_k=[0], top_p=[1.0], min_p=[0.0], seed=[3], step=[1])
        out = dev.empty(1, np.int32)
        out.poison()
        ops.sample(dev, y, dev.to_device(buf), out, rows=1, vocab=rows, greedy=a)
        tok = int(out.to_host()[0])
        if expect is not None:
            assert tok == expect
        else:
            ref, _ = reference.sample_rows(y.to_host()[None], temperature=np.array([temp], np.float32),
                                           top_k=np.zeros(1, np.int32), top_p=np.ones(1, np.float32),
                                           min_p=np.zeros(1, np.float32), seed=np.array([3], np.uint64),
                                           step=np.array([1], np.uint32))
            assert tok == int(ref[0])


DENSE_ACTS = [a for a in ACTIVATIONS if a != "swiglu_oai"]  # the int8 matvec's (act.cuh dense_act)


@pytest.mark.parametrize("act", DENSE_ACTS)
@pytest.mark.parametrize("n", [1, 2])
def test_matvec_q8_fused_activation(dev, rng, act, n):
    """x = act(gate) * up read from a fused gate|up buffer: the same as gated_act, then the matvec.
    The activation is computed by the same device code in both, so the int8 inputs agree; against the
    host's float32 activation an element may round to the neighbouring int8 step, hence 1e-3 there."""
    ffn, rows = 2304, 640
    w, raw, wf = upload_matrix(dev, rng, "q4_k", rows, ffn)
    gu = rng.normal(0, 1.5, (n, 2 * ffn)).astype(np.float32)
    gud = dev.to_device(gu)
    g = dev.empty((n, ffn))
    ops.gated_act(dev, gud, gud.view(ffn, gud.size - ffn), g, n=n, ffn=ffn, act=act, ldg=2 * ffn, ldu=2 * ffn)
    y = dev.empty((n, rows))
    y.poison()
    ops.matvec_q8(dev, w, gud, y, n=n, ldx=2 * ffn, act=act, up_offset=ffn)
    assert rel_err(y.to_host(), reference.linear_q8(g.to_host(), wf)) < FP32_BAR
    assert rel_err(y.to_host(), reference.linear_q8(reference.gated(gu[:, :ffn], gu[:, ffn:], act), wf)) < 1e-3


def test_matvec_q8_refuses_swiglu_oai(dev, rng):
    """gpt-oss's clamped SwiGLU reaches only its experts' kernels: the int8 matvec, which applies a dense
    MLP's activation, refuses it in either place (the load path, the gated epilogue) instead of computing silu."""
    w, _, _ = upload_matrix(dev, rng, "q4_k", 2 * 64, 2304)
    x, y = dev.to_device(rng.normal(0, 1, (1, 2 * 2304)).astype(np.float32)), dev.empty((1, 2 * 64))
    with pytest.raises(ValueError, match="swiglu_oai"):
        ops.matvec_q8(dev, w, x, y, n=1, ldx=2 * 2304, act="swiglu_oai", up_offset=2304)
    with pytest.raises(ValueError, match="swiglu_oai"):
        ops.matvec_q8(dev, w, x, y, n=1, act="swiglu_oai", gated=True)


@pytest.mark.parametrize("tname", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("act", DENSE_ACTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 11])
@pytest.mark.parametrize("ffn", [1000, 37])
def test_matvec_q8_gated_gate_up(dev, rng, tname, act, n, ffn):
    """The stacked [gate; up] matrix with the activation in the epilogue: y = act(x Wg^T) * (x Wu^T),
    [n, ffn], against the twin on each half (each block pairs gate rows with their up rows; ffn not a
    multiple of a block's pairs; batches in launches of up to 4)."""
    cols = 2304
    w, raw, wf = upload_matrix(dev, rng, tname, 2 * ffn, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    ref = reference.gated(reference.linear_q8(x, wf[:ffn]), reference.linear_q8(x, wf[ffn:]), act)
    y = dev.empty((n, ffn))
    for rpb in (None, 8, 64):
        y.poison()
        ops.matvec_q8(dev, w, dev.to_device(x), y, n=n, act=act, gated=True, rows_per_block=rpb)
        assert rel_err(y.to_host(), ref) < FP32_BAR, rpb
    with pytest.raises(ValueError, match="gated"):
        ops.matvec_q8(dev, w, dev.to_device(x), y, n=n, gated=True)


@pytest.mark.parametrize("tname", ["q4_0", "q5_0", "q8_0", "q4_k", "q6_k", "f16"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("n", [1, 3, 8, 11])
def test_matvec_gated_staged(dev, rng, tname, act, n):
    """The staged matvec over a stacked [gate; up] matrix with the activation in its epilogue (a warp
    per gate row and its up row): 640 columns (rows padded to 16 bytes on upload), ffn not a multiple
    of the block's warps, batches in launches of up to 8."""
    ffn, cols = 99, 640 if not tname.endswith("_k") else 768
    w, raw, wf = upload_matrix(dev, rng, tname, 2 * ffn, cols)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    xd = x.astype(np.float64)
    ref = reference.gated(xd @ wf[:ffn].T.astype(np.float64), xd @ wf[ffn:].T.astype(np.float64), act)
    y = dev.empty((n, ffn))
    y.poison()
    ops.matvec_gated(dev, w, dev.to_device(x), y, n=n, act=act)
    assert rel_err(y.to_host(), ref) < FP32_BAR


@pytest.mark.parametrize("tname", ["q5_0", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("cols,gated", [(640, False), (1024, False), (640, True), (768, True)])
def test_matvec_post_norm(dev, rng, tname, cols, gated):
    """The matvec that makes its own input (Gemma's post-norm into the residual, then the next
    pre-norm: rms_norm_add_norm's twin math) in every block, block 0 storing the new residual in
    another buffer; plain (every rows-per-warp) and gated (act(gate) * up)."""
    if tname.endswith("_k") and cols % 256:
        cols = 768
    eps, rows = 1e-6, 198
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols)
    o = rng.normal(0, 3, cols).astype(np.float32)
    res = rng.normal(0, 1, cols).astype(np.float32)
    w1, w2 = (rng.normal(1, 0.1, cols).astype(np.float32) for _ in range(2))
    new_res = res.astype(np.float64) + reference.rms_norm(o.astype(np.float64), w1.astype(np.float64), eps)
    xn = reference.rms_norm(new_res, w2.astype(np.float64), eps)
    res_d, out_d = dev.to_device(res), dev.empty(cols)
    for r in (None,) if gated else (1, 2, 4):
        out_d.poison()
        pn = ops.PostNorm(dev.to_device(o), res_d, out_d, dev.to_device(w1), dev.to_device(w2), eps)
        if gated:
            ffn = rows // 2
            y = dev.empty(ffn)
            y.poison()
            ops.matvec_post_norm(dev, w, pn, y, act="gelu_tanh")
            ref = reference.gelu_tanh(xn @ wf[:ffn].T.astype(np.float64)) * (xn @ wf[ffn:].T.astype(np.float64))
        else:
            y = dev.empty(rows)
            y.poison()
            ops.matvec_post_norm(dev, w, pn, y, rows_per_warp=r)
            ref = xn @ wf.T.astype(np.float64)
        assert rel_err(y.to_host(), ref) < FP32_BAR, r
        assert rel_err(out_d.to_host(), new_res) < FP32_BAR
        np.testing.assert_array_equal(res_d.to_host(), res)  # the old residual is only read
    with pytest.raises(ValueError, match="at most 1024 columns"):
        big, _, _ = upload_matrix(dev, rng, "q8_0", 8, 2048)
        ops.matvec_post_norm(dev, big, pn, dev.empty(8))


@pytest.mark.parametrize("tname", ["q4_0", "q5_0", "q8_0", "q4_k"])  # q6_k is repacked to aligned blocks
@pytest.mark.parametrize("align_rows", [False, True])
def test_matvec_unaligned_rows_and_residual(dev, rng, tname, align_rows):
    """Rows whose byte length is not a multiple of 16: kept packed they take the 2-byte-load path;
    padded on upload (the default) the 16-byte one, every consumer honouring the row stride (the
    matvec, the embedding lookup, the 16-bit decode for the tensor cores); res is added."""
    cols = 256 * 3 if tname.endswith("_k") else 32 * 5
    rows = 77
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols, align_rows=align_rows)
    if tname != "q4_k":
        assert bool(w.row_bytes % 16) != align_rows, "test meant for the packed and the padded rows"
    n = 5
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    res = rng.normal(0, 1, (n, rows)).astype(np.float32)
    y = dev.empty((n, rows))
    y.poison()
    ops.matvec(dev, w, dev.to_device(x), y, res=dev.to_device(res), variant="staged")
    ref = x.astype(np.float64) @ wf.T.astype(np.float64) + res
    assert rel_err(y.to_host(), ref) < FP32_BAR
    # in place: y = x @ W.T + y
    yd = dev.to_device(res)
    ops.matvec(dev, w, dev.to_device(x), yd, res=yd, variant="staged")
    assert rel_err(yd.to_host(), ref) < FP32_BAR
    ids = np.array([76, 0, 41, 76], np.int32)
    rows_out = dev.empty((len(ids), cols))
    rows_out.poison()
    ops.dequant_rows(dev, w, rows_out, dev.to_device(ids))
    np.testing.assert_array_equal(rows_out.to_host().reshape(len(ids), cols), wf[ids])
    half = dev.empty((rows * cols,), np.uint16)
    ops.dequant_half(dev, w, half, kind="f16")
    np.testing.assert_array_equal(half.to_host().reshape(rows, cols), _half_bits(wf, "f16"))


# -- dequantization / embedding lookup ---------------------------------------------------------------------


@pytest.mark.parametrize("tname", list(QTYPES))
def test_dequant_rows_bit_exact(dev, rng, tname):
    rows, cols = 300, 1024 if tname.endswith("_k") else 640
    w, raw, wf = upload_matrix(dev, rng, tname, rows, cols)
    ids = rng.integers(0, rows, 57).astype(np.int32)
    ids[:3] = [0, rows - 1, ids[5]]
    out = dev.empty((ids.size, cols))
    out.poison()
    ops.dequant_rows(dev, w, out, dev.to_device(ids))
    got = out.to_host()
    want = quants.dequantize_rows(raw, QTYPES[tname], cols, ids)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    full = dev.empty((rows, cols))
    full.poison()
    ops.dequant_rows(dev, w, full)
    np.testing.assert_array_equal(full.to_host(), wf)


# -- RMSNorm, residual, rope, activations -------------------------------------------------------------------


# the norm kernels hold a row in registers: 4 columns per thread up to 4096, 8 up to 8192
NORM_COLS = [37, 640, 4096, 5120, 8192]


@pytest.mark.parametrize("cols", NORM_COLS)
def test_rms_norm_fused_residual(dev, rng, cols):
    rows, eps = 7, 1e-6
    x = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    r = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    w = rng.normal(1, 0.1, cols).astype(np.float32)
    xd, rd, wd = dev.to_device(x), dev.to_device(r), dev.to_device(w)
    h, y = dev.empty((rows, cols)), dev.empty((rows, cols))
    h.poison()
    y.poison()
    ops.rms_norm(dev, xd, wd, y, eps=eps, rows=rows, cols=cols, res=rd, h_out=h)
    assert rel_err(h.to_host(), x + r) == 0.0
    assert rel_err(y.to_host(), reference.rms_norm(x + r, w, eps)) < FP32_BAR
    # no residual, in place
    ops.rms_norm(dev, xd, wd, xd, eps=eps, rows=rows, cols=cols)
    assert rel_err(xd.to_host(), reference.rms_norm(x, w, eps)) < FP32_BAR
    # residual stream updated in place (h_out = x) while y goes elsewhere
    xd = dev.to_device(x)
    y.poison()
    ops.rms_norm(dev, xd, wd, y, eps=eps, rows=rows, cols=cols, res=rd, h_out=xd)
    assert rel_err(xd.to_host(), x + r) == 0.0
    assert rel_err(y.to_host(), reference.rms_norm(x + r, w, eps)) < FP32_BAR


def test_rms_norm_per_head_in_a_fused_qkv_buffer(dev, rng):
    n, hq, hk, d, eps = 5, 8, 2, 128, 1e-6
    width = (hq + 2 * hk) * d
    qkv = rng.normal(0, 2, (n, width)).astype(np.float32)
    w = rng.normal(1, 0.1, d).astype(np.float32)
    buf = dev.to_device(qkv)
    ops.rms_norm(dev, buf, dev.to_device(w), buf, eps=eps, rows=n * hq, cols=d, heads=hq, ldx=width, ldy=width)
    got = buf.to_host()
    q = qkv[:, : hq * d].reshape(n, hq, d)
    assert rel_err(got[:, : hq * d].reshape(n, hq, d), reference.rms_norm(q, w, eps)) < FP32_BAR
    np.testing.assert_array_equal(got[:, hq * d:], qkv[:, hq * d:])  # k and v untouched


@pytest.mark.parametrize("cols", NORM_COLS)
def test_rms_norm_add_into_the_residual(dev, rng, cols):
    rows = 5
    x = rng.normal(0, 3, (rows, cols)).astype(np.float32)
    w = rng.normal(1, 0.1, cols).astype(np.float32)
    res = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    out = dev.to_device(res)
    ops.rms_norm_add(dev, dev.to_device(x), dev.to_device(w), out, eps=1e-6, rows=rows, cols=cols)
    ref = res.astype(np.float64) + reference.rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-6)
    assert rel_err(out.to_host().reshape(rows, cols), ref) < FP32_BAR


def test_norm_rows_wider_than_the_kernels_are_refused(dev):
    x = dev.empty((8193,))
    with pytest.raises(ValueError, match="8192"):
        ops.rms_norm(dev, x, x, x, eps=1e-6, rows=1, cols=8193)


@pytest.mark.parametrize("tname", ["q8_0", "q6_k", "f16"])
@pytest.mark.parametrize("fed,normed", [(True, True), (False, True), (True, False), (False, False)])
def test_embed_feeds_looks_up_and_norms(dev, rng, tname, fed, normed):
    """A step's first kernel: ids[i] = drawn[source[i]] where source[i] >= 0 (run-ahead), then the
    scaled embedding rows, then the first layer's RMSNorm of them. Twin: indexing, the dequantized
    rows, reference.rms_norm."""
    vocab, cols, n = 3000, 768, 37
    w, _, wd = upload_matrix(dev, rng, tname, vocab, cols)
    drawn = rng.integers(0, vocab, 64).astype(np.int32)
    source = rng.integers(-1, 64, n).astype(np.int32) if fed else np.full(n, -1, np.int32)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    nw = rng.normal(1, 0.1, cols).astype(np.float32)
    td, x, h = dev.to_device(tokens), dev.empty((n, cols)), dev.empty((n, cols))
    x.poison()
    h.poison()
    ops.embed(dev, w, x, td, n=n, scale=25.3, feed=(dev.to_device(drawn), dev.to_device(source)) if fed else None,
              norm=(dev.to_device(nw), 1e-6, h) if normed else None)
    ids = np.where(source >= 0, drawn[np.maximum(source, 0)], tokens)
    np.testing.assert_array_equal(td.to_host(), ids)
    ref_x = wd[ids] * np.float32(25.3)
    np.testing.assert_array_equal(x.to_host(), ref_x)
    if normed:
        assert rel_err(h.to_host(), reference.rms_norm(ref_x, nw, 1e-6)) < FP32_BAR
    else:
        assert np.isnan(h.to_host()).all()


def test_add(dev, rng):
    a, b = rng.normal(size=1001).astype(np.float32), rng.normal(size=1001).astype(np.float32)
    out = dev.empty(1001)
    out.poison()
    ops.add(dev, dev.to_device(a), dev.to_device(b), out)
    np.testing.assert_array_equal(out.to_host(), a + b)


YARN_MSCALE = 1.3465735912322998  # YaRN's cos/sin scale at factor 32 (the gpt-oss files': 1 + 0.1 ln 32)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mscale", [1.0, YARN_MSCALE])
def test_rope_in_place_on_fused_qkv(dev, rng, neox, d, mscale):
    n, hq, hk = 9, 8, 2
    width = (hq + 2 * hk) * d
    qkv = rng.normal(0, 1, (n, width)).astype(np.float32)
    pos = rng.integers(0, 131072, n).astype(np.int32)
    pos[0] = 0
    inv_freq = (1.0 / (500000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    buf = dev.to_device(qkv)
    kview = buf.view(hq * d, (n * width - hq * d,))
    ops.rope(dev, buf, kview, dev.to_device(pos), dev.to_device(inv_freq), n=n, hq=hq, hk=hk, head_dim=d,
             neox=neox, ldq=width, ldk=width, mscale=mscale)
    got = buf.to_host()
    cos, sin = reference.rope_tables(pos, inv_freq, mscale)
    q = qkv[:, : hq * d].reshape(n, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].reshape(n, hk, d)
    assert rel_err(got[:, : hq * d].reshape(n, hq, d), reference.rope(q, cos, sin, neox=neox)) < FP32_BAR
    assert rel_err(got[:, hq * d: (hq + hk) * d].reshape(n, hk, d), reference.rope(k, cos, sin, neox=neox)) < FP32_BAR
    np.testing.assert_array_equal(got[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched


@pytest.mark.parametrize("cols", NORM_COLS)
def test_rms_norm_add_norm(dev, rng, cols):
    """The post-norm residual add and the next pre-norm in one launch."""
    rows, eps = 5, 1e-6
    x = rng.normal(0, 3, (rows, cols)).astype(np.float32)
    w1, w2 = (rng.normal(1, 0.1, cols).astype(np.float32) for _ in range(2))
    res = rng.normal(0, 1, (rows, cols)).astype(np.float32)
    out, h = dev.to_device(res), dev.empty((rows, cols))
    h.poison()
    ops.rms_norm_add_norm(dev, dev.to_device(x), dev.to_device(w1), out, dev.to_device(w2), h, eps=eps, rows=rows,
                          cols=cols)
    ref = res.astype(np.float64) + reference.rms_norm(x.astype(np.float64), w1.astype(np.float64), eps)
    assert rel_err(out.to_host(), ref) < FP32_BAR
    assert rel_err(h.to_host(), reference.rms_norm(ref, w2.astype(np.float64), eps)) < FP32_BAR


def _prologue_twin(qkv, hq, hk, d, pos, inv_freq, neox, norms, eps, mscale=1.0):
    """The decode prologue's twin for q|k|v rows [n, (hq + 2 hk) d]: q and k per-head RMSNorm (norms:
    (qw, kw) or None) and RoPE at pos (cos and sin times mscale); v as it is. Returns q [n, hq, d], k and
    v [n, hk, d]."""
    n = len(qkv)
    q = qkv[:, : hq * d].reshape(n, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].reshape(n, hk, d)
    v = qkv[:, (hq + hk) * d:].reshape(n, hk, d)
    if norms is not None:
        q, k = reference.rms_norm(q, norms[0], eps), reference.rms_norm(k, norms[1], eps)
    cos, sin = reference.rope_tables(pos, inv_freq, mscale)
    return reference.rope(q, cos, sin, neox=neox), reference.rope(k, cos, sin, neox=neox), v


@pytest.mark.parametrize("kv", [np.float16, np.float32])
@pytest.mark.parametrize("neox,qk_norm,mscale", [(True, True, 1.0), (False, False, 1.0), (True, False, 1.0),
                                                 (True, False, YARN_MSCALE)])
@pytest.mark.parametrize("d,hq,hk", [(64, 4, 1), (128, 32, 8), (256, 8, 4)])
def test_qk_rope_kv_is_norm_rope_and_kv_write(dev, rng, kv, neox, qk_norm, mscale, d, hq, hk):
    """The fused attention prologue against its twins in sequence: per-head RMSNorm (optional), RoPE,
    and the cache writes, on a fused qkv buffer with shuffled slots."""
    n, eps, n_slots = 7, 1e-6, 64
    width = (hq + 2 * hk) * d
    qkv = rng.normal(0, 2, (n, width)).astype(np.float32)
    pos = rng.integers(0, 131072, n).astype(np.int32)
    slots = rng.permutation(n_slots)[:n].astype(np.int32)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    qw, kw = (rng.normal(1, 0.1, d).astype(np.float32) for _ in range(2))
    buf = dev.to_device(qkv)
    kc, vc = dev.empty((n_slots, hk, d), kv), dev.empty((n_slots, hk, d), kv)
    kc.poison()
    vc.poison()
    ops.qk_rope_kv(dev, buf, buf.view(hq * d, n * width - hq * d), buf.view((hq + hk) * d, n * width - (hq + hk) * d),
                   kc, vc, dev.to_device(slots), dev.to_device(pos), dev.to_device(inv_freq), n=n, heads=hq,
                   kv_heads=hk, head_dim=d, neox=neox, q_norm=dev.to_device(qw) if qk_norm else None,
                   k_norm=dev.to_device(kw) if qk_norm else None, eps=eps, ldq=width, ldk=width, ldv=width,
                   mscale=mscale)
    qref, kref, v = _prologue_twin(qkv, hq, hk, d, pos, inv_freq, neox, (qw, kw) if qk_norm else None, eps, mscale)
    got = buf.to_host()
    assert rel_err(got[:, : hq * d].reshape(n, hq, d), qref) < FP32_BAR
    np.testing.assert_array_equal(got[:, hq * d:], qkv[:, hq * d:])  # k and v rows are only read
    # float16 slots: the kernel's and the twin's float32 may round to neighbouring halves
    bar = FP32_BAR if kv == np.float32 else 1e-3
    assert rel_err(kc.to_host()[slots].astype(np.float32), kref) < bar
    np.testing.assert_array_equal(vc.to_host()[slots], v.astype(kv))


def test_programmatic_dependent_launch_keeps_order(dev, rng):
    """A captured chain of 200 kernels launched with PDL, each reading what the one before wrote
    (and a matvec in between that prefetches weights before its wait): the result is exact, so every
    kernel waited for its input."""
    from ember.kernels.cuda_runtime import Graph, Stream, pdl_launches

    st = Stream()
    n = 1 << 16
    ones = dev.to_device(np.ones(n, np.float32))
    acc = dev.to_device(np.zeros(n, np.float32))
    w, _, wf = upload_matrix(dev, rng, "q4_k", 256, 256)
    y = dev.empty((1, 256))
    with Graph.capture(st) as g:
        ops.add(dev, acc, ones, acc, stream=st)  # the first node follows no kernel (as in the backend)
        with pdl_launches():
            for _ in range(199):
                ops.add(dev, acc, ones, acc, stream=st)
        ops.matvec_q8(dev, w, acc.view(0, 256), y, stream=st)
    for reps in (1, 2):
        g.launch()
        st.synchronize()
        np.testing.assert_array_equal(acc.to_host(), np.full(n, 200.0 * reps, np.float32))
        assert rel_err(y.to_host(), reference.linear_q8(np.full((1, 256), 200.0 * reps, np.float32), wf)) < FP32_BAR
    g.destroy()


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_gated_act_on_fused_gate_up(dev, rng, act):
    n, f = 5, 1000
    gu = rng.normal(0, 3, (n, 2 * f)).astype(np.float32)
    out = dev.empty((n, f))
    out.poison()
    buf = dev.to_device(gu)
    ops.gated_act(dev, buf, buf.view(f, (n * 2 * f - f,)), out, n=n, ffn=f, act=act, ldg=2 * f, ldu=2 * f)
    g, u = gu[:, :f], gu[:, f:]  # normal(0, 3): gpt-oss's clamps at 7 are met
    assert rel_err(out.to_host(), reference.gated(g.astype(np.float64), u.astype(np.float64), act)) < FP32_BAR
    assert rel_err(out.to_host(), reference.gated(g, u, act)) < FP32_BAR


# -- KV cache and paged attention ---------------------------------------------------------------------------


def _paged_setup(dev, rng, lens, hk, d, bs, kv_dtype):
    """Random K/V for sequences of the given lengths written through kv_write into a shuffled pool."""
    max_blocks = max(-(-L // bs) for L in lens)
    n_blocks = sum(-(-L // bs) for L in lens) + 3
    perm = rng.permutation(n_blocks)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    used = 0
    for s, L in enumerate(lens):
        nb = -(-L // bs)
        tables[s, :nb] = perm[used: used + nb]
        used += nb
    kc = dev.empty((n_blocks * bs, hk, d), kv_dtype)
    vc = dev.empty((n_blocks * bs, hk, d), kv_dtype)
    kc.poison()
    vc.poison()
    keys, values = [], []
    for s, L in enumerate(lens):
        k = rng.normal(0, 1, (L, hk, d)).astype(np.float32)
        v = rng.normal(0, 1, (L, hk, d)).astype(np.float32)
        p = np.arange(L)
        slots = (tables[s, p // bs] * bs + p % bs).astype(np.int32)
        ops.kv_write(dev, dev.to_device(k), dev.to_device(v), kc, vc, dev.to_device(slots), n=L, kv_heads=hk,
                     head_dim=d)
        # what the cache holds (fp16-rounded when the cache is fp16) is what the twin sees
        keys.append(k.astype(kv_dtype).astype(np.float32))
        values.append(v.astype(kv_dtype).astype(np.float32))
    host_k = kc.to_host()
    for s, L in enumerate(lens):  # kv_write put every row where the table says
        p = np.arange(L)
        np.testing.assert_array_equal(host_k[tables[s, p // bs] * bs + p % bs].astype(np.float32), keys[s])
    return kc, vc, dev.to_device(tables), max_blocks, keys, values


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("d,hq,hk", [(128, 32, 8), (256, 4, 1), (64, 8, 8), (128, 16, 2)])
@pytest.mark.parametrize("window", [0, 100])
def test_paged_decode_attention(dev, rng, kv_dtype, d, hq, hk, window):
    _check_paged_decode(dev, rng, kv_dtype, d, hq, hk, window)


def _check_paged_decode(dev, rng, kv_dtype, d, hq, hk, window, sinks=None):
    """attn (no prologue) over four sequences, one split and several (merged by attn_combine)."""
    lens, bs = [1, 37, 1500, 700], 16
    kc, vc, tables, max_blocks, keys, values = _paged_setup(dev, rng, lens, hk, d, bs, kv_dtype)
    q = rng.normal(0, 1, (len(lens), hq, d)).astype(np.float32)
    pos = np.array([L - 1 for L in lens], np.int32)
    seq = np.arange(len(lens), dtype=np.int32)
    scale = 1.0 / np.sqrt(d)
    refs = np.stack([
        reference.attention(q[s: s + 1], keys[s], values[s], pos[s: s + 1], window=window, scale=scale,
                            sinks=sinks)[0]
        for s in range(len(lens))
    ])
    out = dev.empty((len(lens), hq, d))
    bar = FP32_BAR  # the twin sees the same stored (fp16-rounded) keys and values
    for split in (None, 16, 64, 512):
        out.poison()
        ops.attention(dev, dev.to_device(q), kc, vc, tables, dev.to_device(seq), dev.to_device(pos), out,
                      rows=len(lens), heads=hq, kv_heads=hk, head_dim=d, block_size=bs, max_blocks=max_blocks,
                      max_keys=max(lens) if not window else min(window, max(lens)), window=window, scale=scale,
                      split=split, sinks=dev.to_device(sinks) if sinks is not None else None)
        err = rel_err(out.to_host(), refs)
        assert err < bar, (split, err)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("neox,qk_norm", [(True, True), (False, False)])
@pytest.mark.parametrize("d,hq,hk", [(256, 4, 1), (128, 32, 8), (64, 8, 8), (256, 8, 4), (128, 64, 8)])
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("kernel", ["warp", "block"])
def test_decode_attention_with_fused_prologue(dev, rng, kv_dtype, neox, qk_norm, d, hq, hk, window, kernel):
    """attn_warp and attn_decode: raw q/k/v rows in, the prologue (norms, RoPE, the new K/V into their
    slots) done by the attention kernel itself. The new key's slot is poisoned first: the kernel must
    store it and must not read it back."""
    splits = (None, 8, 16, 64) if kernel == "warp" else (None, 16, 512)
    _check_fused_decode(dev, rng, [1, 37, 1500, 700], kv_dtype, neox, qk_norm, d, hq, hk, window, kernel, splits)


@pytest.mark.parametrize("d,hq,hk", [(256, 4, 1), (128, 32, 8), (64, 8, 8)])
@pytest.mark.parametrize("lens", [[1], [17], [40], [128], [1, 64, 128, 9]])
def test_decode_attention_cluster_merge(dev, rng, d, hq, hk, lens):
    """Short decode contexts: attn_warp's splits (1 to 8 of them) run as one thread block cluster and
    merge in distributed shared memory; splits past the context hold no keys."""
    assert ops.attention_clustered(True, -(-128 // ops.attention_split_warp(d, 2, 128)))
    _check_fused_decode(dev, rng, lens, np.float16, True, True, d, hq, hk, 0, "warp", (None, 16, 32, 17),
                        max_keys=128)


def _check_fused_decode(dev, rng, lens, kv_dtype, neox, qk_norm, d, hq, hk, window, kernel, splits, max_keys=None,
                        sinks=None, mscale=1.0):
    """Decode attention with the prologue fused over random paged K/V of the given lengths against the
    twin, for each split (sinks: a logit per head in the softmaxes' denominators; mscale: YaRN's)."""
    bs, eps = 16, 1e-6
    kc, vc, tables, max_blocks, keys, values = _paged_setup(dev, rng, lens, hk, d, bs, kv_dtype)
    n = len(lens)
    pos = np.array([L - 1 for L in lens], np.int32)
    host_tables = tables.to_host()
    slots = (host_tables[np.arange(n), pos // bs] * bs + pos % bs).astype(np.int32)
    nan = np.full((n, hk, d), np.nan, np.float32)
    ops.kv_write(dev, dev.to_device(nan), dev.to_device(nan), kc, vc, dev.to_device(slots), n=n, kv_heads=hk,
                 head_dim=d)
    width = (hq + 2 * hk) * d
    qkv = rng.normal(0, 2, (n, width)).astype(np.float32)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    qw, kw = (rng.normal(1, 0.1, d).astype(np.float32) for _ in range(2))
    q, k, v = _prologue_twin(qkv, hq, hk, d, pos, inv_freq, neox, (qw, kw) if qk_norm else None, eps, mscale)
    k_new, v_new = k.astype(kv_dtype).astype(np.float32), v.astype(kv_dtype).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    refs = []
    for s in range(n):
        keys[s][-1], values[s][-1] = k_new[s], v_new[s]
        refs.append(reference.attention(q[s: s + 1], keys[s], values[s], pos[s: s + 1], window=window, scale=scale,
                                        sinks=sinks)[0])
    buf = dev.to_device(qkv)
    pro = ops.DecodePrologue(buf.view(hq * d, n * width - hq * d), buf.view((hq + hk) * d, n * width - (hq + hk) * d),
                             dev.to_device(slots), dev.to_device(inv_freq), neox, width, width,
                             dev.to_device(qw) if qk_norm else None, dev.to_device(kw) if qk_norm else None, eps,
                             mscale=mscale)
    out = dev.empty((n, hq, d))
    # float16 slots: the kernel's and the twin's float32 k may round to neighbouring halves
    bar = FP32_BAR if kv_dtype == np.float32 else 1e-3
    max_keys = max_keys or (max(lens) if not window else min(window, max(lens)))
    for split in splits:
        out.poison()
        ops.attention(dev, buf, kc, vc, tables, dev.to_device(np.arange(n, dtype=np.int32)), dev.to_device(pos), out,
                      rows=n, heads=hq, kv_heads=hk, head_dim=d, block_size=bs, max_blocks=max_blocks,
                      max_keys=max_keys, window=window, scale=scale,
                      split=split, ldq=width, prologue=pro, kernel=kernel,
                      sinks=dev.to_device(sinks) if sinks is not None else None)
        err = rel_err(out.to_host(), np.stack(refs))
        assert err < bar, (split, err)
    assert rel_err(kc.to_host()[slots].astype(np.float32), k_new) < bar
    np.testing.assert_array_equal(vc.to_host()[slots], v.astype(kv_dtype))
    np.testing.assert_array_equal(buf.to_host(), qkv)  # the q|k|v rows are only read


@pytest.mark.parametrize("window", [0, 64])
def test_paged_prefill_attention_rows(dev, rng, window):
    """One query row per prompt token (a chunk starting at position 200 of a 450-token sequence)."""
    d, hq, hk, bs = 128, 8, 2, 16
    L, start = 450, 200
    kc, vc, tables, max_blocks, keys, values = _paged_setup(dev, rng, [L], hk, d, bs, np.float16)
    n = L - start
    q = rng.normal(0, 1, (n, hq, d)).astype(np.float32)
    pos = np.arange(start, L, dtype=np.int32)
    out = dev.empty((n, hq, d))
    out.poison()
    ops.attention(dev, dev.to_device(q), kc, vc, tables, dev.to_device(np.zeros(n, np.int32)), dev.to_device(pos),
                  out, rows=n, heads=hq, kv_heads=hk, head_dim=d, block_size=bs, max_blocks=max_blocks,
                  max_keys=window if window else L, window=window, scale=0.1)
    ref = reference.attention(q, keys[0], values[0], pos, window=window, scale=0.1)
    assert rel_err(out.to_host(), ref) < FP32_BAR


@pytest.mark.parametrize("d,hq,hk", [(128, 32, 8), (256, 8, 4), (64, 4, 1), (128, 8, 8)])
@pytest.mark.parametrize("window", [0, 100])
def test_flash_prefill_attention(dev, rng, d, hq, hk, window):
    """Flash attention on the tensor cores against the twin, for one step of four chunks: 250 rows
    from position 200 (tiles of 64, 64, 64, 58), a 37-token prompt from 0, one decode row at position
    1499 and 60 rows ending a 700-token sequence; shuffled block tables. f16 Q and probabilities: 1e-2."""
    _check_flash(dev, rng, d, hq, hk, window)


def _check_flash(dev, rng, d, hq, hk, window, sinks=None):
    lens, bs = [450, 37, 1500, 700], 16
    kc, vc, tables, max_blocks, keys, values = _paged_setup(dev, rng, lens, hk, d, bs, np.float16)
    chunks = [(0, 200, 450), (1, 0, 37), (2, 1499, 1500), (3, 640, 700)]  # (sequence, first position, end)
    spans, seq, pos, at = [], [], [], 0
    for s_, p0, p1 in chunks:
        spans.append((at, at + p1 - p0))
        seq += [s_] * (p1 - p0)
        pos += list(range(p0, p1))
        at += p1 - p0
    n = at
    q = rng.normal(0, 1, (n, hq, d)).astype(np.float32)
    seq_a, pos_a = np.asarray(seq, np.int32), np.asarray(pos, np.int32)
    scale = 1.0 / np.sqrt(d)
    ref = np.concatenate([reference.attention(q[a:b], keys[s_], values[s_], pos_a[a:b], window=window, scale=scale,
                                              sinks=sinks)
                          for (s_, _, _), (a, b) in zip(chunks, spans, strict=True)])
    tiles = ops.flash_tiles(spans)
    assert [int(c) for c in tiles[:, 1]] == [64, 64, 64, 58, 37, 1, 60]
    out = dev.empty((n, hq, d))
    out.poison()
    ops.flash_attention(dev, dev.to_device(q), kc, vc, tables, dev.to_device(seq_a), dev.to_device(pos_a),
                        dev.to_device(tiles), out, n_tiles=len(tiles), heads=hq, kv_heads=hk, head_dim=d,
                        block_size=bs, max_blocks=max_blocks, window=window, scale=scale,
                        sinks=dev.to_device(sinks) if sinks is not None else None)
    got = out.to_host()
    for (a, b) in spans:  # every chunk, the single decode row included, on its own
        assert rel_err(got[a:b], ref[a:b]) < 1e-2, (a, b)


def _sinks(rng, heads: int) -> np.ndarray:
    """gpt-oss's sink logits: a few of each sign, and one far above any score (its head keeps little for the keys)."""
    s = rng.normal(0, 2, heads).astype(np.float32)
    s[0] = 30.0
    return s


@pytest.mark.parametrize("d,hq,hk", [(64, 4, 2), (64, 64, 8)], ids=["tiny-gpt-oss", "gpt-oss-20b"])
@pytest.mark.parametrize("window", [0, 128])
def test_attention_sinks_on_every_path(dev, rng, d, hq, hk, window):
    """gpt-oss's attention: a learned logit per head in each softmax's denominator (and, on its sliding
    layers, a window of 128), on every decode path -- attn with one split and with attn_combine's merge,
    attn_decode, attn_warp merged by attn_combine and inside a cluster -- with YaRN's scale in the fused
    prologue, and in flash attention's prefill rows."""
    sinks = _sinks(rng, hq)
    _check_paged_decode(dev, rng, np.float16, d, hq, hk, window, sinks)
    long, short = [1, 37, 1500, 700], [17, 40, 128, 3]
    for kernel, lens, splits in (("block", long, (None, 16, 512)), ("warp", long, (None, 8, 64)),
                                 ("warp", short, (None, 16, 32, 17))):  # short: 1-8 splits, one cluster
        _check_fused_decode(dev, rng, lens, np.float16, True, False, d, hq, hk, window, kernel, splits,
                            max_keys=min(max(lens), window) if window else max(lens), sinks=sinks,
                            mscale=YARN_MSCALE)
    _check_flash(dev, rng, d, hq, hk, window, sinks)


# -- sampling -------------------------------------------------------------------------------------------------


def test_argmax_first_index_of_ties(dev, rng):
    rows, vocab = 6, 151936
    x = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    x[1, 500] = x[1, 90000] = 100.0  # a tie: the first index wins, as in numpy
    x[2, :] = -np.inf
    x[3, vocab - 1] = 1e30
    idx, val = dev.empty(rows, np.int32), dev.empty(rows)
    idx.poison()
    val.poison()
    ops.argmax(dev, dev.to_device(x), idx, rows=rows, vocab=vocab, out_val=val)
    np.testing.assert_array_equal(idx.to_host(), np.argmax(x, axis=1))
    np.testing.assert_array_equal(val.to_host(), x[np.arange(rows), np.argmax(x, axis=1)])
    # odd row length (scalar loads), and a prefix of each row read with a row stride
    x2 = rng.normal(0, 1, (rows, 8195)).astype(np.float32)
    idx.poison()
    ops.argmax(dev, dev.to_device(x2), idx, rows=rows, vocab=8195)
    np.testing.assert_array_equal(idx.to_host(), np.argmax(x2, axis=1))
    idx.poison()
    ops.argmax(dev, dev.to_device(x), idx, rows=rows, vocab=9001, ld=vocab)
    np.testing.assert_array_equal(idx.to_host(), np.argmax(x[:, :9001], axis=1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_softmax_rows(dev, rng, temperature):
    rows, vocab = 3, 32000
    x = rng.normal(0, 4, (rows, vocab)).astype(np.float32)
    y = dev.empty((rows, vocab))
    y.poison()
    ops.softmax(dev, dev.to_device(x), y, rows=rows, cols=vocab, temperature=temperature)
    ref = reference.softmax(x.astype(np.float64) / temperature)
    assert rel_err(y.to_host(), ref) < FP32_BAR


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (the kernels' f2bf)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _half_bits(x: np.ndarray, kind: str) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint16) if kind == "f16" else _bf16_bits(x)


def _half_values(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# -- tensor-core matmul (prefill) -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (77, 200, 96), (256, 384, 640), (300, 1000, 2048), (64, 4096, 4096)])
def test_gemm_matches_linear_on_16_bit_inputs(dev, rng, kind, m, n, k):
    a = _half_bits(rng.normal(0, 1, (m, k)), kind)
    b = _half_bits(rng.normal(0, 0.05, (n, k)), kind)
    res = rng.normal(0, 1, (m, n)).astype(np.float32)
    c = dev.empty(m * n)
    for with_res in (False, True):
        c.poison()
        ops.gemm(dev, dev.to_device(a), dev.to_device(b), c, m=m, n=n, k=k, kind=kind,
                 res=dev.to_device(res) if with_res else None)
        ref = _half_values(a, kind) @ _half_values(b, kind).T + (res if with_res else 0.0)
        assert rel_err(c.to_host().reshape(m, n), ref) < FP32_BAR * 10  # products exact, float32 sums


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("tname", ["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "f16"])
def test_dequant_half_is_the_rounded_twin(dev, rng, tname, kind):
    rows, cols = 37, 512
    w, _, ref = upload_matrix(dev, rng, tname, rows, cols)
    out = dev.empty(rows * cols, np.uint16)
    out.poison()
    ops.dequant_half(dev, w, out, kind=kind)
    np.testing.assert_array_equal(out.to_host().reshape(rows, cols), _half_bits(ref, kind))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_linear_tc_matches_linear(dev, rng, kind):
    m, rows, cols = 150, 640, 2048
    w, _, wf = upload_matrix(dev, rng, "q4_k", rows, cols)
    x = rng.normal(0, 1, (m, cols)).astype(np.float32)
    res = rng.normal(0, 1, (m, rows)).astype(np.float32)
    y = dev.empty(m * rows)
    y.poison()
    ops.linear_tc(dev, w, dev.to_device(x), y, n=m, res=dev.to_device(res), kind=kind)
    ref = reference.linear(x.astype(np.float64), wf.astype(np.float64)) + res
    assert rel_err(y.to_host().reshape(m, rows), ref) < FP16_BAR


def test_gather_rows_and_add_bias(dev, rng):
    x = rng.normal(0, 1, (9, 100)).astype(np.float32)
    idx = np.array([8, 0, 3, 3], np.int32)
    out = dev.empty(4 * 100)
    out.poison()
    ops.gather_rows(dev, dev.to_device(x), dev.to_device(idx), out, n=4, cols=100)
    np.testing.assert_array_equal(out.to_host().reshape(4, 100), x[idx])
    bias = rng.normal(0, 1, 100).astype(np.float32)
    y = dev.to_device(x)
    ops.add_bias(dev, y, dev.to_device(bias), n=5, cols=100)
    np.testing.assert_array_equal(y.to_host().reshape(9, 100), np.concatenate([x[:5] + bias, x[5:]]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_kv_gather_and_scatter_match_their_twins(dev, rng, dtype):
    layers, blocks_in_pool, block_elems = 3, 11, 16 * 24
    layer_elems = blocks_in_pool * block_elems
    k = rng.normal(0, 1, layers * layer_elems).astype(dtype)
    v = rng.normal(0, 1, layers * layer_elems).astype(dtype)
    kd, vd = dev.to_device(k), dev.to_device(v)
    pick = np.array([7, 0, 10, 3], np.int32)
    staging = dev.empty(len(pick) * 2 * layers * block_elems, dtype)
    staging.poison()
    ops.kv_gather(dev, kd, vd, dev.to_device(pick), staging, n=len(pick), layers=layers, layer_elems=layer_elems,
                  block_elems=block_elems)
    want = reference.kv_gather(k, v, pick, layers=layers, layer_elems=layer_elems, block_elems=block_elems)
    np.testing.assert_array_equal(staging.to_host().reshape(want.shape), want)
    new = rng.normal(0, 1, want.shape).astype(dtype)
    ops.kv_scatter(dev, kd, vd, dev.to_device(pick[::-1].copy()), dev.to_device(new), n=len(pick), layers=layers,
                   layer_elems=layer_elems, block_elems=block_elems)
    reference.kv_scatter(k, v, pick[::-1], new, layers=layers, layer_elems=layer_elems, block_elems=block_elems)
    np.testing.assert_array_equal(kd.to_host(), k)
    np.testing.assert_array_equal(vd.to_host(), v)


def _sample_on_device(dev, x, **p):
    rows, vocab = x.shape
    buf = np.zeros(ops.SampleParams.nbytes(rows), np.uint8)
    ops.SampleParams.pack(buf, rows, **p)
    out, floor = dev.empty(rows, np.int32), dev.empty(rows)
    out.poison()
    floor.poison()
    ops.sample(dev, dev.to_device(x), dev.to_device(buf), out, rows=rows, vocab=vocab, out_floor=floor)
    return out.to_host(), floor.to_host()


def test_device_sampling_matches_its_twin(dev, rng):
    """top-k, top-p, min-p and temperature: the same kept set (the floor logit) and the same draw
    as reference.sample_rows, whose noise is the kernel's hash."""
    rows, vocab = 12, 32000
    x = (rng.normal(0, 3, (rows, vocab)) + rng.normal(0, 1, (rows, 1))).astype(np.float32)
    p = dict(temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 1.0, 0.8, 1.0, 2.0, 1.0, 0.5, 1.0],
             top_k=[0, 0, 40, 0, 0, 5, 50, 0, 0, 1, 0, 200],
             top_p=[1.0, 1.0, 1.0, 0.9, 0.5, 1.0, 0.95, 1.0, 0.3, 1.0, 0.99, 0.8],
             min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.0, 0.02],
             seed=rng.integers(0, 2**63, rows, dtype=np.uint64), step=rng.integers(0, 2**31, rows).astype(np.uint32))
    tokens, floors = _sample_on_device(dev, x, **p)
    ref_tokens, ref_floors = reference.sample_rows(x, *(np.asarray(p[k]) for k in
                                                        ("temperature", "top_k", "top_p", "min_p", "seed", "step")))
    for r in range(rows):
        if p["top_p"][r] < 1.0 and floors[r] != ref_floors[r]:
            # float32 sums on the device vs float64 here: only a crossing within rounding may differ
            row, k = x[r], p["top_k"][r]
            base = row if k == 0 else row[row >= np.sort(row)[-k]]
            w = np.exp(base.astype(np.float64) - row.max())
            at, above = w[base >= floors[r]].sum() / w.sum(), w[base > floors[r]].sum() / w.sum()
            assert at >= p["top_p"][r] - 1e-5 and above < p["top_p"][r] + 1e-5, (r, floors[r], ref_floors[r])
            continue
        assert floors[r] == ref_floors[r], (r, floors[r], ref_floors[r])
        assert x[r][tokens[r]] >= floors[r]
        assert tokens[r] == ref_tokens[r], r
    assert tokens[0] == np.argmax(x[0]) and tokens[9] == np.argmax(x[9])  # greedy, and top_k 1


@pytest.mark.parametrize("vocab", [262144, 100003, 8192, 77])
def test_greedy_sampling_split_over_blocks(dev, rng, vocab):
    """Greedy rows are argmax'd by several blocks per row and merged by the last one: numpy's first
    index of the maximum, with ties across the parts' borders, a row whose maximum is in its last
    part, and a sampled row in between (its other blocks leave). Run twice: the counters reset."""
    rows = 5
    x = rng.normal(0, 1, (rows, vocab)).astype(np.float32)
    x[0, [vocab - 1, vocab // 2, 3]] = 9.0  # ties: the first index wins
    x[1, vocab - 1] = 9.0
    x[3, [vocab // 3, vocab // 3 + 1]] = 7.0
    p = dict(temperature=[0.0, 0.0, 1.0, 0.0, 0.0], top_k=[0] * rows, top_p=[1.0] * rows, min_p=[0.0] * rows,
             seed=np.arange(rows, dtype=np.uint64), step=np.zeros(rows, np.uint32))
    for _ in range(2):
        tokens, floors = _sample_on_device(dev, x, **p)
        for r in (0, 1, 3, 4):
            assert tokens[r] == np.argmax(x[r]), r
            assert floors[r] == x[r].max()
        ref, _ = reference.sample_rows(x[2:3], *(np.asarray(p[k][2:3]) for k in
                                                 ("temperature", "top_k", "top_p", "min_p", "seed", "step")))
        assert tokens[2] == ref[0]


def test_device_sampling_follows_the_distribution(dev):
    """Many draws from one small row (different steps): frequencies match softmax(x / T) over the
    kept tokens (top-k 6 of 8, temperature 0.8)."""
    x = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    draws = 4096
    xs = np.tile(x, (draws, 1))
    tokens, _ = _sample_on_device(dev, xs, temperature=np.full(draws, 0.8), top_k=np.full(draws, 6),
                                  top_p=np.ones(draws), min_p=np.zeros(draws), seed=np.full(draws, 7, np.uint64),
                                  step=np.arange(draws, dtype=np.uint32))
    counts = np.bincount(tokens, minlength=8)
    assert counts[6] == counts[7] == 0
    expect = np.exp(x[:6] / 0.8) / np.exp(x[:6] / 0.8).sum() * draws
    chi2 = float((((counts[:6] - expect) ** 2) / expect).sum())
    assert chi2 < 25.0, (counts, expect)  # 5 degrees of freedom: p < 0.001


# -- sticky errors ----------------------------------------------------------------------------------------------


def test_illegal_address_poisons_the_context(dev):
    """In a child process (the context stays poisoned): a real out-of-bounds write surfaces as
    StickyCudaError 700 at the next synchronizing call, and every later call fails the same way."""
    code = textwrap.dedent(
        """
        import sys
        from ember.kernels import ops
        from ember.kernels.cuda_runtime import Device, poisoned
        from ember.kernels.errors import StickyCudaError
        dev = Device()
        try:
            ops.fault_illegal_address(dev)
        except StickyCudaError as e:
            print("STICKY", e.code, e.name, e.call)
            try:
                dev.synchronize()
            except StickyCudaError as e2:
                print("AGAIN", e2.code)
            print("POISONED", poisoned() is not None)
            sys.exit(75)
        print("NO ERROR")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 75, p.stdout + p.stderr
    assert "STICKY 700 CUDA_ERROR_ILLEGAL_ADDRESS" in p.stdout
    assert "AGAIN 700" in p.stdout and "POISONED True" in p.stdout


def test_launch_probes_measure_and_compute(dev, rng):
    """bench.py's launch probes (probe.cu) run and time every configuration; the dependent kernel's
    link computes what it claims (warp w of a 128-thread block: the sum of its threads' strided share
    of x, scaled, plus one)."""
    from ember.kernels import bench
    from ember.kernels.cuda_runtime import Stream

    r = bench.launch_probes(dev, Stream(), links=4, iters=10)
    assert len(r) == 12 + 3 + 3 and all(np.isfinite(v) and v > 0 for v in r.values()), r
    x = rng.normal(0, 1, 640).astype(np.float32)
    y = dev.empty((640,))
    y.poison()
    dev.kernel("probe", "probe_chain").launch((40,), (128,), dev.to_device(x), y, 640)
    share = np.array([x.astype(np.float64)[(np.arange(640) % 128) // 32 == w].sum() for w in range(4)])
    np.testing.assert_allclose(y.to_host()[:160], np.tile(share * 1e-3 + 1.0, 40), rtol=1e-5)


# -- mixture of experts ----------------------------------------------------------------------------------


def _clear_routing(logits: np.ndarray, k: int, gating: str) -> np.ndarray:
    """Rows whose choice of k experts is clear (float32 sums in another order cannot flip it)."""
    vals = reference.softmax(logits) if gating == "softmax" else logits
    top = -np.sort(-vals, axis=-1)
    return (top[:, k - 1] - top[:, k]) > 1e-4 * np.abs(top[:, :1]).max(axis=-1)


@pytest.mark.parametrize("gating", ["softmax", "softmax-topk"])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_moe_route_matches_reference(dev, rng, gating, n):
    E, k, hidden = 128, 8, 256
    router = rng.normal(0, 0.1, (E, hidden)).astype(np.float32)
    x = rng.normal(0, 1, (n, hidden)).astype(np.float32)
    bias = rng.normal(0, 0.5, E).astype(np.float32) if gating == "softmax-topk" else None
    logits = reference.linear(x, router, bias)
    ids, wts = dev.empty((n * k,), np.int32), dev.empty((n * k,))
    wts.poison()
    ops.moe_route(dev, dev.to_device(reference.linear(x, router)), ids, wts, n=n, experts=E, k=k, gating=gating,
                  norm_topk=gating == "softmax", bias=dev.to_device(bias) if bias is not None else None)
    top, weights = reference.moe_route(x, router, k=k, gating=gating, norm_topk=gating == "softmax", bias=bias)
    clear = _clear_routing(logits, k, gating)
    assert clear.mean() > 0.8
    got_ids, got_w = ids.to_host().reshape(n, k), wts.to_host().reshape(n, k)
    np.testing.assert_array_equal(got_ids[clear], top[clear])
    np.testing.assert_allclose(got_w[clear], weights[clear], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("experts,pairs,tile", [(256, 6, 1), (256, 6, 8), (60, 200, 8), (256, 2048, 16)])
def test_moe_group_tiles_every_experts_pairs_in_order(dev, rng, experts, pairs, tile):
    """moe_group's tiles are the experts' runs of pairs cut into tiles of `tile`, expert after expert, zeros
    past the last (its scans: 256 experts, eight a lane of its first warp, and a count not a multiple of 32);
    pos and order place each pair in its expert's run."""
    ids = rng.integers(0, experts, pairs).astype(np.int32)
    nt = ops.moe.max_tiles(pairs, experts, tile)
    pos, order, tiles = dev.empty((pairs,), np.int32), dev.empty((pairs,), np.int32), dev.empty((3 * nt,), np.int32)
    tiles.fill_bytes(0xFF)
    ops.moe_group(dev, dev.to_device(ids), pos, order, tiles, pairs=pairs, experts=experts, tile=tile)
    count = np.bincount(ids, minlength=experts)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    want = [(e, start[e] + j, min(tile, count[e] - j)) for e in range(experts) for j in range(0, count[e], tile)]
    want = (want + [(0, 0, 0)] * nt)[:nt]
    assert [tuple(t) for t in tiles.to_host().reshape(nt, 3)] == want
    got_pos, got_order = pos.to_host(), order.to_host()
    assert np.array_equal(got_order[got_pos], np.arange(pairs))
    assert np.array_equal(np.sort(got_pos), np.arange(pairs))
    assert all(start[e] <= q < start[e] + count[e] for e, q in zip(ids, got_pos, strict=True))


# (gate, up, down) types: stacked gate|up; gate and up apart (their types differ); padded 16-byte rows
MOE_TYPES = [("q4_k", "q4_k", "q6_k"), ("q4_k", "q5_k", "q4_k"), ("q8_0", "q8_0", "q5_0")]


@pytest.mark.parametrize("types", MOE_TYPES, ids="-".join)
@pytest.mark.parametrize("n,half", [(1, None), (3, None), (40, None), (40, "bf16"), (160, "bf16"), (160, "f16")],
                         ids=["1", "3", "40", "40-bf16", "160-bf16", "160-f16"])
def test_moe_mlp_matches_reference(dev, rng, types, n, half):
    """Every row through its experts: one row (tiles of one pair), a few, and enough rows that experts
    take several tiles of 8; on the tensor cores (qgemm) in tiles of 16 pairs and of 64, the inputs
    rounded to bf16 or f16 (whose range the random blocks' large scales would overflow: their inputs
    are scaled down, the router up); the routing as the numpy twin's wherever it is clear."""
    gt, ut, dt = (QTYPES[t] for t in types)
    E, k, hidden = 16, 4, 512
    ffn = 256 if GGML_QUANT_SIZES[dt][0] == 256 else 96  # 96 columns of Q5_0: rows padded to 16 bytes
    router = rng.normal(0, 100.0 if half == "f16" else 0.1, (E, hidden)).astype(np.float32)
    raws = [random_tensor(rng, gt, E * ffn, hidden), random_tensor(rng, ut, E * ffn, hidden),
            random_tensor(rng, dt, E * hidden, ffn)]
    gate, up = (quants.dequantize(r, t, (E, ffn, hidden)) for r, t in zip(raws[:2], (gt, ut), strict=True))
    down = quants.dequantize(raws[2], dt, (E, hidden, ffn))
    stacked = gt == ut
    em = ops.ExpertMatrices.upload
    w = ops.MoeWeights(
        router=ops.QuantMatrix.upload(dev, router, T.F32, E, hidden),
        down=em(dev, [raws[2]], dt, E, [hidden], ffn),
        gate_up=em(dev, raws[:2], gt, E, [ffn, ffn], hidden) if stacked else None,
        gate=None if stacked else em(dev, [raws[0]], gt, E, [ffn], hidden),
        up=None if stacked else em(dev, [raws[1]], ut, E, [ffn], hidden))
    x = rng.normal(0, 1, (8 * n, hidden)).astype(np.float32)
    if half == "f16":
        x = x * np.float32(1e-3)
    x, x_more = x[_clear_routing(reference.linear(x, router), k, "softmax")][:n], x[:3]  # rows routed clearly
    assert len(x) == n
    res = rng.normal(0, 1, (n, hidden)).astype(np.float32)
    scratch = ops.MoeScratch.alloc(dev, n, E, k, hidden, ffn, apart=not stacked)
    for s in (scratch.xs, scratch.hs, scratch.ys):
        s.poison()
    y = dev.empty((n, hidden))
    y.poison()
    ops.moe_mlp(dev, w, dev.to_device(x), y, scratch, n=n, k=k, act="silu", gating="softmax", norm_topk=True,
                res=dev.to_device(res), half=half)
    ref = reference.moe_mlp(x, router, gate, up, down, k=k, act="silu") + res
    out = y.to_host()
    assert rel_err(out - res, ref - res) < {None: FP32_BAR, "f16": 3e-3, "bf16": FP16_BAR}[half], types
    # in place, as the backend runs it (y is the residual), and again: nothing carried over
    xr = dev.to_device(res)
    ops.moe_mlp(dev, w, dev.to_device(x), xr, scratch, n=n, k=k, act="silu", gating="softmax", norm_topk=True,
                res=xr, half=half)
    assert np.array_equal(xr.to_host(), out)
    if n == 1:
        assert_fused_batch1_is_grouped(dev, w, x_more, k=k, apart=not stacked, act="silu", gating="softmax",
                                       norm_topk=True)


@pytest.mark.parametrize("gu_type", ["q4_k", "q5_k"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("hidden", [512, 2304])
def test_moe_mlp_int8_experts_at_batch_1(dev, rng, gu_type, act, hidden):
    """One token's stacked gate|up experts through the int8 matvec (kq8ge_b1_u4 on the tiles the batch-1 router
    writes; 2304 columns: a second warp with one super-block of eight), the down rows and their weighted sum
    as the float path's: the twin with int8 gate/up inputs, token after token through one scratch."""
    E, k, ffn = 32, 8, 256
    gt, dt = QTYPES[gu_type], QTYPES["q6_k"]
    router = rng.normal(0, 0.1, (E, hidden)).astype(np.float32)
    raws = [random_tensor(rng, gt, E * ffn, hidden), random_tensor(rng, gt, E * ffn, hidden),
            random_tensor(rng, dt, E * hidden, ffn)]
    gate, up = (quants.dequantize(r, gt, (E, ffn, hidden)) for r in raws[:2])
    down = quants.dequantize(raws[2], dt, (E, hidden, ffn))
    em = ops.ExpertMatrices.upload
    w = ops.MoeWeights(router=ops.QuantMatrix.upload(dev, router, T.F32, E, hidden),
                       down=em(dev, [raws[2]], dt, E, [hidden], ffn),
                       gate_up=em(dev, raws[:2], gt, E, [ffn, ffn], hidden))
    assert ops.moe_q8_supported(w.gate_up, act)
    x = rng.normal(0, 1, (16, hidden)).astype(np.float32)
    x = x[_clear_routing(reference.linear(x, router), k, "softmax")][:3]
    scratch = ops.MoeScratch.alloc(dev, 1, E, k, hidden, ffn)
    res = rng.normal(0, 1, hidden).astype(np.float32)
    for t in x:
        y = dev.to_device(res[None])
        ops.moe_mlp(dev, w, dev.to_device(t[None]), y, scratch, n=1, k=k, act=act, gating="softmax", norm_topk=True,
                    res=y, int8=True)
        ref = reference.moe_mlp(t[None], router, gate, up, down, k=k, act=act, q8_inputs=True)
        assert rel_err(y.to_host() - res, ref) < FP32_BAR
        assert rel_err(y.to_host() - res, reference.moe_mlp(t[None], router, gate, up, down, k=k, act=act)) < 3e-2


def test_matvec_rows_matches_linear(dev, rng):
    w, raw, wf = upload_matrix(dev, rng, "f32", 128, 2048)
    for n in (1, 8, 29):
        x = rng.normal(0, 1, (n, 2048)).astype(np.float32)
        y = dev.empty((n, 128))
        y.poison()
        ops.matvec_rows(dev, w, dev.to_device(x), y, n=n)
        assert rel_err(y.to_host(), x.astype(np.float64) @ wf.T.astype(np.float64)) < FP32_BAR

