"""Launchers of the decode matvecs: matvec.cu (the staged matvec, every type: `matvec`, `matvec_gated`,
`matvec_groups`, `matvec_fan`, `matvec_post_norm`), matvec_k.cu (K-quant rows held column-resident:
`matvec`'s kv2 path and the int8 `matvec_q8`) and stream_q8_0.cu (`matvec_stream_q8_0`, with `RowArgmax`).
Twins: reference.linear and reference.linear_q8 over quants.dequantize(W); the gated ones
act(x W_gate^T) * (x W_up^T)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import KERNEL_CONSTANTS
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import act_code, need, ptr_at
from .quant_matrix import QuantMatrix

MATVEC_WARPS = KERNEL_CONSTANTS["MATVEC_WARPS"]  # matvec.cu: warps a block
XPRO_COLS = KERNEL_CONSTANTS["XPRO_COLS"]  # matvec.cu: columns a block of qmvx / qmvgx normalises itself
KV2_MAX_WARPS = KERNEL_CONSTANTS["KV2_MAX_WARPS"]
KV2_WARP_SUPERBLOCKS = KERNEL_CONSTANTS["KV2_WARP_SUPERBLOCKS"]
KV2_MAX_RPB = KERNEL_CONSTANTS["KV2_MAX_RPB"]
SUPERBLOCK = KERNEL_CONSTANTS["BLOCK_ELEMS_Q4_K"]  # columns of a K-quant super-block (Q4_K, Q5_K, Q6_K alike)


def _pick_rows_per_warp(dev: Device, rows: int) -> int:
    target = 2 * MATVEC_WARPS * dev.sm_count  # warps: about two blocks per SM
    for r in (4, 2):
        if rows // r >= target:
            return r
    return 1


KV2_TYPES = ("q4_k", "q5_k")
KQ8_TYPES = ("q4_k", "q5_k", "q6_kp")
KV2_MAX_COLS = KV2_MAX_WARPS * KV2_WARP_SUPERBLOCKS * SUPERBLOCK  # 16384: the widest rows matvec_k.cu takes
# default for kv2 at batch 1: the software-pipelined variant (kv2p) measured faster for Q4_K, not Q5_K
KV2_PREFETCH = {"q4_k": True, "q5_k": False}


def kv2_supported(w: QuantMatrix) -> bool:
    return w.type in KV2_TYPES and w.cols <= KV2_MAX_COLS and w.data.ptr % 16 == 0


def kq8_supported(w: QuantMatrix) -> bool:
    """The int8 matvec (matvec_q8) takes these rows: K-quants, at most 16384 columns, 16-byte aligned."""
    return w.type in KQ8_TYPES and w.cols <= KV2_MAX_COLS and w.data.ptr % 16 == 0


def kv2_warps(w: QuantMatrix) -> int:
    """The block of matvec_k.cu's kernels: a warp per KV2_WARP_SUPERBLOCKS super-blocks of the row."""
    return -(-(w.cols // SUPERBLOCK) // KV2_WARP_SUPERBLOCKS)


def kv2_rows_per_block(dev: Device, rows: int, cols: int, unroll: int) -> int:
    # small matrices want many blocks: 16 rows per block for the big and the wide matrices, 8 and 4 for
    # smaller ones (tuned on the H200: kernels/docs/code-choices.md)
    per_sm = rows / dev.sm_count
    rpb = 16 if per_sm >= 64 or (per_sm >= 16 and cols >= 8192) else 8 if per_sm >= 16 else 4
    return max(unroll, rpb)


def matvec(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int | None = None,
           res: DeviceArray | None = None, rows_per_warp: int | None = None, variant: str = "auto",
           unroll: int | None = None, rows_per_block: int | None = None, prefetch: bool | None = None,
           split: bool = False, stream=None) -> None:
    """y[n, rows] = x[n, cols] @ W.T (+ res[n, rows]); twin: reference.linear(x, quants.dequantize(W)).

    Batches of any n run in launches of up to 8 rows of x (each launch reads W once). variant:
    "staged" (matvec.cu, every type and batch), "kv2" (matvec_k.cu: Q4_K/Q5_K, batch 1-2, the faster
    decode path) or "auto" (kv2 for Q4_K/Q5_K at batch 1, and batch 2 below 8192 columns; else staged).
    split (staged, batch 1, 16-byte rows): 1-4 rows a block (rows_per_warp), their chunks shared by the
    block's warps (matvec.cu qmvs): for wide rows of small matrices, whose one-warp decode chain is the
    latency."""
    n = x.shape[0] if n is None else n
    need(x, np.float32, n * w.cols, "x")
    need(y, np.float32, n * w.rows, "y")
    if res is not None:
        need(res, np.float32, n * w.rows, "res")
    if variant not in ("auto", "staged", "kv2"):
        raise ValueError(f"unknown matvec variant {variant!r}")
    # measured: kv2 wins at batch 1, and at batch 2 below 8192 columns; staged elsewhere
    use_kv2 = variant == "kv2" or (
        variant == "auto" and kv2_supported(w) and (n == 1 or (n == 2 and w.cols < 8192))
    )
    if use_kv2:
        if not kv2_supported(w) or n > 2:
            raise ValueError(f"the kv2 matvec takes Q4_K/Q5_K rows of at most {KV2_MAX_COLS} columns, batch 1-2")
        bt = n
        pf = (KV2_PREFETCH.get(w.type, False) and n == 1) if prefetch is None else prefetch
        u = unroll or (4 if bt == 1 else 2)
        combos = ((1, 2), (1, 4), (2, 2)) if pf else ((1, 4), (1, 8), (2, 2), (2, 4))
        if (bt, u) not in combos:
            raise ValueError(f"kv2{'p' if pf else ''} (batch, unroll) must be one of {combos}")
        rpb = rows_per_block or kv2_rows_per_block(dev, w.rows, w.cols, u)
        if rpb % u or rpb > KV2_MAX_RPB:
            raise ValueError(f"rows_per_block must be a multiple of the unroll and at most {KV2_MAX_RPB}")
        warps = kv2_warps(w)
        dev.kernel(f"matvec_k_{w.type}", f"kv2{'p' if pf else ''}_b{bt}_u{u}").launch(
            (-(-w.rows // rpb),), (32 * warps,), w.data, I64(w.row_bytes), w.rows, w.cols, x, n, res, y, rpb,
            stream=stream)
        return
    rb = w.row_bytes
    vec = 16 if rb % 16 == 0 and w.data.ptr % 16 == 0 else 2
    if rb % 2:  # MXFP4 rows of an odd number of 17-byte blocks, kept packed (upload pads them by default)
        raise ValueError(f"the staged matvec takes rows of an even number of bytes; {w.type} rows of {rb} are odd "
                         "(upload them with align_rows)")
    if split:
        if n != 1 or vec != 16:
            raise ValueError("the split matvec takes one row of x and 16-byte aligned rows")
        # rows a block: as many as still leave a block per SM (the grid of the unsplit kernel)
        r = rows_per_warp or next(r for r in (4, 2, 1) if w.rows // r >= dev.sm_count or r == 1)
        if r not in (1, 2, 4):
            raise ValueError("rows_per_warp must be 1, 2 or 4")
        dev.kernel(f"matvec_{w.type}", f"qmvs_b1_r{r}").launch(
            (-(-w.rows // r),), (MATVEC_WARPS * 32,), w.data, I64(rb), w.rows, w.cols, x, res, y, stream=stream)
        return
    r = 1 if vec == 2 else (rows_per_warp or _pick_rows_per_warp(dev, w.rows))
    if r not in (1, 2, 4):
        raise ValueError("rows_per_warp must be 1, 2 or 4")
    grid = (-(-w.rows // (MATVEC_WARPS * r)),)
    for b0 in range(0, n, 8):
        nb = min(8, n - b0)
        bt = 1 if nb == 1 else 2 if nb == 2 else 4 if nb <= 4 else 8
        k = dev.kernel(f"matvec_{w.type}", f"qmv_b{bt}_r{r}_v{vec}")
        k.launch(grid, (MATVEC_WARPS * 32,), w.data, I64(rb), w.rows, w.cols,
                 ptr_at(x, b0 * w.cols * 4), nb,
                 ptr_at(res, b0 * w.rows * 4) if res is not None else None, ptr_at(y, b0 * w.rows * 4), stream=stream)


def _staged16(w: QuantMatrix) -> bool:
    """W's rows take the staged matvec's 16-byte loads, and its columns come in fours (so each x row
    a stacked kernel reads is 16-byte aligned too)."""
    return w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0 and w.cols % 4 == 0


def matvec_groups_supported(w: QuantMatrix, groups: int) -> bool:
    """Whether matvec_groups takes W as `groups` stacked matrices: whole groups of 16-byte rows."""
    return _staged16(w) and w.rows % groups == 0


def matvec_groups(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, groups: int,
                  rows_per_warp: int | None = None, stream=None) -> None:
    """y[g] = x[g] @ W_g^T for each group g at batch 1, in one launch (matvec.cu qmv_b1_r*_v16_groups):
    W [groups * rank, cols] is the groups' matrices stacked, W_g its g-th rank rows; x [groups, cols];
    y [groups, rank]. Twin: reference.linear of each group's row by its rows."""
    if not matvec_groups_supported(w, groups):
        raise ValueError(f"matvec_groups takes {groups} whole groups of 16-byte aligned rows of columns in fours; "
                         f"W is {w.rows} x {w.cols} {w.type}")
    rank = w.rows // groups
    need(x, np.float32, groups * w.cols, "x")
    need(y, np.float32, groups * rank, "y")
    r = rows_per_warp or _pick_rows_per_warp(dev, w.rows)
    if r not in (1, 2, 4):
        raise ValueError("rows_per_warp must be 1, 2 or 4")
    dev.kernel(f"matvec_{w.type}", f"qmv_b1_r{r}_v16_groups").launch(
        (-(-rank // (MATVEC_WARPS * r)), groups), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), rank, w.cols,
        I64(rank * w.row_bytes), x, I64(w.cols), y, I64(rank), stream=stream)


FAN_MAX = KERNEL_CONSTANTS["FAN_MAX"]


def _fan_rows_per_warp(dev: Device, w: QuantMatrix, rows: list[int]) -> int | None:
    """The rows a warp of matvec_fan, as the plain matvec picks them, fewer where a matrix's rows are not a
    whole number of blocks; None where not even one a warp fits."""
    best = _pick_rows_per_warp(dev, w.rows)
    return next((r for r in (4, 2, 1) if r <= best and all(n % (MATVEC_WARPS * r) == 0 for n in rows)), None)


def matvec_fan_supported(dev: Device, w: QuantMatrix, rows: list[int]) -> bool:
    """Whether matvec_fan makes these stacked matrices: at most FAN_MAX of them, their rows W's, each a
    multiple of MATVEC_WARPS; 16-byte rows."""
    return (0 < len(rows) <= FAN_MAX and sum(rows) == w.rows and _staged16(w)
            and _fan_rows_per_warp(dev, w, rows) is not None)


def matvec_fan(dev: Device, w: QuantMatrix, x: DeviceArray, outs: list[DeviceArray], *, rows: list[int],
               stream=None) -> None:
    """outs[i] = x @ W_i^T for one row of x, W [sum(rows), cols] the matrices W_i (rows[i] rows each)
    stacked, in one launch (matvec.cu qmv_b1_r*_v16_fan). Twin: reference.linear by each W_i."""
    if len(outs) != len(rows) or not matvec_fan_supported(dev, w, rows):
        raise ValueError(f"matvec_fan takes 1 to {FAN_MAX} stacked matrices of a multiple of {MATVEC_WARPS} rows "
                         f"each, with an output each; got rows {rows} of W {w.rows} x {w.cols} {w.type} and "
                         f"{len(outs)} outputs")
    need(x, np.float32, w.cols, "x")
    for y, n in zip(outs, rows, strict=True):
        need(y, np.float32, n, "an output")
    r = _fan_rows_per_warp(dev, w, rows)
    assert r is not None
    ends = list(np.cumsum(rows)) + [w.rows] * (FAN_MAX - len(rows))
    ys = outs + [outs[-1]] * (FAN_MAX - len(outs))  # past the last matrix: never chosen
    args = [a for y, e in zip(ys, ends, strict=True) for a in (y, int(e))]
    dev.kernel(f"matvec_{w.type}", f"qmv_b1_r{r}_v16_fan").launch(
        (-(-w.rows // (MATVEC_WARPS * r)),), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, x,
        *args, stream=stream)


def matvec_gated(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int, act: str,
                 stream=None) -> None:
    """y[n, rows / 2] = act(x W_gate^T) * (x W_up^T) for the stacked [gate; up] matrix W (matvec.cu
    qmvg: a warp takes a gate row and its up row, 16-byte aligned rows of any staged type). Twin:
    act(reference.linear(x, W_gate)) * reference.linear(x, W_up)."""
    if not matvec_gated_supported(w):
        raise ValueError("the gated matvec needs an even number of 16-byte aligned rows")
    code = act_code(act)
    ffn = w.rows // 2
    need(x, np.float32, n * w.cols, "x")
    need(y, np.float32, n * ffn, "y")
    grid = (-(-ffn // MATVEC_WARPS),)
    for b0 in range(0, n, 8):
        nb = min(8, n - b0)
        bt = 1 if nb == 1 else 2 if nb == 2 else 4 if nb <= 4 else 8
        dev.kernel(f"matvec_{w.type}", f"qmvg_b{bt}").launch(
            grid, (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, ptr_at(x, b0 * w.cols * 4), nb,
            ptr_at(y, b0 * ffn * 4), code, stream=stream)


def matvec_gated_supported(w: QuantMatrix) -> bool:
    return w.rows % 2 == 0 and w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0


@dataclass
class PostNorm:
    """The input of matvec_post_norm, made in the kernel: x = rms_norm(res + rms_norm(o) * w1) * w2 --
    Gemma's post-norm into the residual and the next pre-norm, rms_norm_add_norm's math -- with block 0
    storing the new residual res + rms_norm(o) * w1 in res_out (not res: the other blocks still read it;
    None: not stored)."""

    o: DeviceArray
    res: DeviceArray
    res_out: DeviceArray | None
    w1: DeviceArray
    w2: DeviceArray
    eps: float


def post_norm_supported(w: QuantMatrix) -> bool:
    return w.cols <= XPRO_COLS and w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0


def matvec_post_norm(dev: Device, w: QuantMatrix, pn: PostNorm, y: DeviceArray, *, act: str | None = None,
                     rows_per_warp: int | None = None, stream=None) -> None:
    """One row: y = x @ W.T with x = the PostNorm's (act given: W is the stacked [gate; up] matrix and
    y = act(x W_gate^T) * (x W_up^T), as matvec_gated). Saves the rms_norm_add_norm launch before it.
    Twin: rms_norm_add_norm, then matvec / matvec_gated."""
    if not post_norm_supported(w) or (act is not None and not matvec_gated_supported(w)):
        raise ValueError(f"the post-norm matvec takes 16-byte aligned rows of at most {XPRO_COLS} columns")
    for a, name in ((pn.o, "o"), (pn.res, "res"), (pn.w1, "w1"), (pn.w2, "w2")):
        need(a, np.float32, w.cols, name)
    if pn.res_out is not None:
        need(pn.res_out, np.float32, w.cols, "res_out")
    args = (pn.o, pn.res, pn.res_out, pn.w1, pn.w2, F32(pn.eps))
    if act is not None:
        code = act_code(act)
        need(y, np.float32, w.rows // 2, "y")
        dev.kernel(f"matvec_{w.type}", "qmvgx_b1").launch(
            (-(-(w.rows // 2) // MATVEC_WARPS),), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, *args,
            y, code, stream=stream)
        return
    need(y, np.float32, w.rows, "y")
    r = rows_per_warp or _pick_rows_per_warp(dev, w.rows)
    if r not in (1, 2, 4):
        raise ValueError("rows_per_warp must be 1, 2 or 4")
    dev.kernel(f"matvec_{w.type}", f"qmvx_b1_r{r}").launch(
        (-(-w.rows // (MATVEC_WARPS * r)),), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, *args, y,
        stream=stream)


KQ8_VARIANTS = {(1, 4, False), (1, 8, False), (2, 4, False), (1, 2, True), (1, 4, True), (2, 2, True), (2, 4, True),
                (4, 2, False), (4, 2, True)}
KQ8_DEFAULT = {1: (4, False), 2: (4, False), 4: (2, False)}  # (unroll, prefetch) per batch: measured, H200
KQ8_ACTIVATIONS = frozenset({"silu", "gelu_tanh"})  # a dense MLP's, which kq8 applies (act.cuh dense_act)
KQ8_MAX_ROWS = 16  # batches up to this many rows run in launches of 4 (each reads W once); more: tensor cores


def matvec_q8(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int = 1,
              res: DeviceArray | None = None, ldx: int | None = None, act: str | None = None, up_offset: int = 0,
              gated: bool = False, unroll: int | None = None, prefetch: bool | None = None,
              rows_per_block: int | None = None, stream=None) -> None:
    """y[n, rows] = q8(x)[n, cols] @ W.T (+ res) for Q4_K / Q5_K / Q6_K rows (matvec_k.cu kq8): x is quantized
    to int8 per 32 columns inside the kernel and multiplied with dp4a. Batches of 1, 2 or 4 rows per
    launch (larger n: launches of 4). Twin: reference.linear_q8(x, quants.dequantize(W)).

    ldx: x's row stride (default cols). act (a name of constants.ACTIVATIONS): x = act(x) * x[up_offset:], the
    gated MLP's activation applied while loading (x is then the fused gate|up buffer). gated: W is the
    stacked [gate; up] matrix and y[n, rows / 2] = act(x W_gate^T) * (x W_up^T), the activation applied
    to the outputs, once per column (twin: act(linear_q8(x, W_gate)) * linear_q8(x, W_up))."""
    if not kq8_supported(w) or n < 1:
        raise ValueError(f"the int8 matvec takes Q4_K/Q5_K/Q6_K rows of at most {KV2_MAX_COLS} columns")
    code = act_code(act, none=True)
    if act is not None and act not in KQ8_ACTIVATIONS:  # gpt-oss's clamped SwiGLU reaches its experts' kernels only
        raise ValueError(f"the int8 matvec applies {' or '.join(sorted(KQ8_ACTIVATIONS))}, not {act}")
    if gated and (act is None or w.rows % 2 or res is not None or unroll or prefetch):
        raise ValueError("a gated matvec needs an activation, an even number of rows, and no residual")
    ldx = w.cols if ldx is None else ldx
    if ldx % 4 or up_offset % 4 or x.ptr % 16:
        raise ValueError("x rows must be 16-byte aligned")
    need(x, np.float32, (n - 1) * ldx + w.cols + (up_offset if act and not gated else 0), "x")
    out_rows = w.rows // 2 if gated else w.rows
    need(y, np.float32, n * out_rows, "y")
    if res is not None:
        need(res, np.float32, n * w.rows, "res")
    warps = kv2_warps(w)
    for b0 in range(0, n, 4):
        nb = min(4, n - b0)
        bt = 1 if nb == 1 else 2 if nb == 2 else 4
        du, dpf = KQ8_DEFAULT[bt]
        u = unroll or du
        pf = dpf if prefetch is None else prefetch
        if (bt, u, pf) not in KQ8_VARIANTS:
            raise ValueError(f"kq8 (batch, unroll, prefetch) must be one of {sorted(KQ8_VARIANTS)}")
        rpb = rows_per_block or kv2_rows_per_block(dev, w.rows, w.cols, u)
        if rpb % u or rpb > KV2_MAX_RPB or (gated and rpb % 2):
            raise ValueError("rows_per_block must be a multiple of the unroll (and even when gated), "
                             f"at most {KV2_MAX_RPB}")
        name = f"kq8g_b{bt}_u{u}" if gated else f"kq8{'p' if pf else ''}_b{bt}_u{u}"
        grid = -(-out_rows // (rpb // 2)) if gated else -(-w.rows // rpb)
        dev.kernel(f"matvec_k_{w.type}", name).launch(
            (grid,), (32 * warps,), w.data, I64(w.row_bytes), w.rows, w.cols,
            ptr_at(x, b0 * ldx * 4), I64(ldx), I64(up_offset), code, nb,
            ptr_at(res, b0 * w.rows * 4) if res is not None else None, ptr_at(y, b0 * out_rows * 4), rpb, stream=stream)


SQ_WARPS, SQ_ROWS = KERNEL_CONSTANTS["SQ_WARPS"], KERNEL_CONSTANTS["SQ_ROWS"]
SQ_MAX_ROW_BYTES = 32 * 16 * KERNEL_CONSTANTS["SQ_VECS"] // SQ_ROWS  # 768: what a warp's lanes hold of SQ_ROWS rows
SQ_PAIR_COLS = 2 * KERNEL_CONSTANTS["BLOCK_ELEMS_Q8_0"]  # sq8_b1 reads Q8_0 blocks in pairs


def stream_q8_0_supported(w: QuantMatrix) -> bool:
    return (w.type == "q8_0" and w.cols % SQ_PAIR_COLS == 0 and w.row_bytes % 16 == 0
            and w.row_bytes <= SQ_MAX_ROW_BYTES and w.data.ptr % 16 == 0)


def stream_q8_0_smem(w: QuantMatrix) -> int:
    return -(-(w.cols + w.cols // 8) // 16) * 16 + SQ_WARPS * SQ_ROWS * w.row_bytes


@dataclass
class RowArgmax:
    """Where matvec_stream_q8_0 leaves its row's greedy token -- best_i[0] the first index of the
    largest output, best_v[0] that value -- and the work it needs: a (value, index) per block and a
    counter (zeroed here; the kernel leaves it at zero)."""

    part_v: DeviceArray
    part_i: DeviceArray
    counter: DeviceArray
    best_v: DeviceArray
    best_i: DeviceArray

    @classmethod
    def alloc(cls, dev: Device) -> RowArgmax:
        blocks = 2 * dev.sm_count  # matvec_stream_q8_0's largest grid
        counter = dev.empty((1,), np.uint32)
        counter.zero()
        return cls(dev.empty((blocks,)), dev.empty((blocks,), np.int32), counter, dev.empty((1,)),
                   dev.empty((1,), np.int32))


def matvec_stream_q8_0(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *,
                       res: DeviceArray | None = None, blocks: int | None = None, argmax: RowArgmax | None = None,
                       stream=None) -> None:
    """One row: y = q8(x) @ W.T (+ res) for a tall Q8_0 matrix of short rows (stream_q8_0.cu: the tied
    output projection of Gemma 3 270M), x quantized to int8 per 32 columns in every block and
    multiplied with dp4a; a persistent grid (default two blocks per SM) streams the rows. argmax: also
    y's greedy token (sample() then takes it instead of a pass over y). Twin:
    reference.linear_q8(x, quants.dequantize(W)); the argmax: numpy.argmax of y."""
    if not stream_q8_0_supported(w):
        raise ValueError(f"the streaming Q8_0 matvec takes 16-byte aligned Q8_0 rows of at most {SQ_MAX_ROW_BYTES} "
                         f"bytes and a multiple of {SQ_PAIR_COLS} columns")
    need(x, np.float32, w.cols, "x")
    need(y, np.float32, w.rows, "y")
    if res is not None:
        need(res, np.float32, w.rows, "res")
    groups = -(-w.rows // SQ_ROWS)
    grid = max(1, min(blocks or 2 * dev.sm_count, -(-groups // SQ_WARPS)))
    a = argmax
    if a is not None and a.part_v.size < grid:
        raise ValueError(f"the argmax's parts hold {a.part_v.size} blocks; the grid has {grid}")
    dev.kernel("stream_q8_0", "sq8_b1").launch(
        (grid,), (32 * SQ_WARPS,), w.data, I64(w.row_bytes), w.rows, w.cols, x, res, y,
        *((a.part_v, a.part_i, a.counter, a.best_v, a.best_i) if a is not None else (None,) * 5),
        smem=stream_q8_0_smem(w), stream=stream)
