"""Launchers: one Python function per kernel, taking DeviceArrays and choosing the variant.

Each function names its numpy twin (``kernels/reference.py`` or ``kernels/quants.py``); the gpu tests
check every one against its twin. All activations are float32; the KV cache is float16 or float32.
Launches are asynchronous on the default stream; errors of a launch's configuration raise at once,
faults inside a kernel at the next synchronizing call (see cuda_runtime).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .build import GGML_TYPE_IDS, GGML_TYPE_NAMES
from .cuda_runtime import F32, I64, Device, DeviceArray, Pointer

# (elements, bytes) per block of each type the kernels read
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q4_0": (32, 18), "q5_0": (32, 22), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "q6_kp": (256, 224),  # Q6_K as stored on the device: blocks padded to 16-byte alignment
}
Q6K_PAD = 224 - 210


def repack_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes, only 2-byte aligned) -> 224-byte blocks (14 zero bytes appended), so
    the kernels read every field with 16-byte loads (quant.cuh GT_Q6_KP)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 210)
    return np.concatenate([blocks, np.zeros((len(blocks), Q6K_PAD), np.uint8)], axis=1).reshape(-1)
MATVEC_WARPS = 4  # MV_WARPS in matvec.cu


def _type_name(ggml_type) -> str:
    if isinstance(ggml_type, str):
        name = ggml_type.lower()
    else:
        name = GGML_TYPE_NAMES.get(int(ggml_type), "")
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
        """Decode the matrix to 16 bits once and keep it: linear_tc then skips the per-call decode."""
        if self.half is None or self.half_kind != kind:
            self.half = dev.empty((self.rows * self.cols,), np.uint16)
            self.half_kind = kind
            dequant_half(dev, self, self.half, kind=kind, stream=stream)

    @property
    def row_bytes(self) -> int:
        return self.stride or row_nbytes(self.type, self.cols)

    @classmethod
    def upload(cls, dev: Device, raw: np.ndarray, ggml_type, rows: int, cols: int,
               align_rows: bool = True) -> "QuantMatrix":
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


def _ptr(a: DeviceArray | None, offset_bytes: int = 0) -> Pointer:
    return Pointer(0 if a is None else a.ptr + offset_bytes)


def _need(a: DeviceArray, dtype, min_elems: int, what: str) -> None:
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{what} must be {np.dtype(dtype).name}, not {a.dtype.name}")
    if a.size < min_elems:
        raise ValueError(f"{what} holds {a.size} elements; {min_elems} needed")


# -- quantized matrix-vector / small-batch matmul ------------------------------------------------------


def _pick_rows_per_warp(dev: Device, rows: int) -> int:
    target = 8 * dev.sm_count  # warps: about two blocks of 4 warps per SM
    for r in (4, 2):
        if rows // r >= target:
            return r
    return 1


KV2_TYPES = ("q4_k", "q5_k")
KQ8_TYPES = ("q4_k", "q5_k", "q6_kp")
KV2_MAX_COLS = 8 * 2048  # KV2_MAX_WARPS warps of 2048 columns
# default for kv2 at batch 1: the software-pipelined variant (kv2p) measured faster for Q4_K, not Q5_K
KV2_PREFETCH = {"q4_k": True, "q5_k": False}


def kv2_supported(w: QuantMatrix) -> bool:
    return w.type in KV2_TYPES and w.cols <= KV2_MAX_COLS and w.data.ptr % 16 == 0


def kq8_supported(w: QuantMatrix) -> bool:
    """The int8 matvec (matvec_q8) takes these rows: K-quants, at most 16384 columns, 16-byte aligned."""
    return w.type in KQ8_TYPES and w.cols <= KV2_MAX_COLS and w.data.ptr % 16 == 0


def _kv2_rows_per_block(dev: Device, rows: int, cols: int, unroll: int) -> int:
    # measured on an H200 (132 SMs, 2026-12-02): 16 rows per block for the big and the wide matrices,
    # 8 for [4096 x 4096], 4 for [1024 x 4096] (small matrices want many blocks)
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
    _need(x, np.float32, n * w.cols, "x")
    _need(y, np.float32, n * w.rows, "y")
    if res is not None:
        _need(res, np.float32, n * w.rows, "res")
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
        rpb = rows_per_block or _kv2_rows_per_block(dev, w.rows, w.cols, u)
        if rpb % u or rpb > 64:
            raise ValueError("rows_per_block must be a multiple of the unroll and at most 64")
        warps = -(-(w.cols // 256) // 8)
        dev.kernel(f"matvec_k_{w.type}", f"kv2{'p' if pf else ''}_b{bt}_u{u}").launch(
            (-(-w.rows // rpb),), (32 * warps,), w.data, I64(w.row_bytes), w.rows, w.cols, x, n, res, y, rpb,
            stream=stream)
        return
    rb = w.row_bytes
    vec = 16 if rb % 16 == 0 and w.data.ptr % 16 == 0 else 2
    if split:
        if n != 1 or vec != 16:
            raise ValueError("the split matvec takes one row of x and 16-byte aligned rows")
        # rows a block: as many as still leave a block per SM (the grid of the unsplit kernel)
        r = rows_per_warp or next(r for r in (4, 2, 1) if w.rows // r >= dev.sm_count or r == 1)
        if r not in (1, 2, 4):
            raise ValueError("rows_per_warp must be 1, 2 or 4")
        dev.kernel(f"matvec_{w.type}", f"qmvs_b1_r{r}").launch((-(-w.rows // r),), (MATVEC_WARPS * 32,), w.data, I64(rb),
                                                               w.rows, w.cols, x, res, y, stream=stream)
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
                 _ptr(x, b0 * w.cols * 4), nb,
                 _ptr(res, b0 * w.rows * 4) if res is not None else None, _ptr(y, b0 * w.rows * 4), stream=stream)


def matvec_gated(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int, act: str,
                 stream=None) -> None:
    """y[n, rows / 2] = act(x W_gate^T) * (x W_up^T) for the stacked [gate; up] matrix W (matvec.cu
    qmvg: a warp takes a gate row and its up row, 16-byte aligned rows of any staged type). Twin:
    act(reference.linear(x, W_gate)) * reference.linear(x, W_up)."""
    if not matvec_gated_supported(w):
        raise ValueError("the gated matvec needs an even number of 16-byte aligned rows")
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {act!r}")
    ffn = w.rows // 2
    _need(x, np.float32, n * w.cols, "x")
    _need(y, np.float32, n * ffn, "y")
    grid = (-(-ffn // MATVEC_WARPS),)
    for b0 in range(0, n, 8):
        nb = min(8, n - b0)
        bt = 1 if nb == 1 else 2 if nb == 2 else 4 if nb <= 4 else 8
        dev.kernel(f"matvec_{w.type}", f"qmvg_b{bt}").launch(
            grid, (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, _ptr(x, b0 * w.cols * 4), nb,
            _ptr(y, b0 * ffn * 4), Q8_ACTIVATIONS[act], stream=stream)


def matvec_gated_supported(w: QuantMatrix) -> bool:
    return w.rows % 2 == 0 and w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0


XPRO_COLS = 1024  # matvec.cu: rows a block of qmvx / qmvgx normalises itself


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
        _need(a, np.float32, w.cols, name)
    if pn.res_out is not None:
        _need(pn.res_out, np.float32, w.cols, "res_out")
    args = (pn.o, pn.res, pn.res_out, pn.w1, pn.w2, F32(pn.eps))
    if act is not None:
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown activation {act!r}")
        _need(y, np.float32, w.rows // 2, "y")
        dev.kernel(f"matvec_{w.type}", "qmvgx_b1").launch(
            (-(-(w.rows // 2) // MATVEC_WARPS),), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, *args,
            y, Q8_ACTIVATIONS[act], stream=stream)
        return
    _need(y, np.float32, w.rows, "y")
    r = rows_per_warp or _pick_rows_per_warp(dev, w.rows)
    if r not in (1, 2, 4):
        raise ValueError("rows_per_warp must be 1, 2 or 4")
    dev.kernel(f"matvec_{w.type}", f"qmvx_b1_r{r}").launch(
        (-(-w.rows // (MATVEC_WARPS * r)),), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols, *args, y,
        stream=stream)


KQ8_VARIANTS = {(1, 4, False), (1, 8, False), (2, 4, False), (1, 2, True), (1, 4, True), (2, 2, True), (2, 4, True),
                (4, 2, False), (4, 2, True)}
KQ8_DEFAULT = {1: (4, False), 2: (4, False), 4: (2, False)}  # (unroll, prefetch) per batch: measured, H200
KQ8_MAX_ROWS = 16  # batches up to this many rows run in launches of 4 (each reads W once); more: tensor cores
Q8_ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}


def matvec_q8(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int = 1,
              res: DeviceArray | None = None, ldx: int | None = None, act: str | None = None, up_offset: int = 0,
              gated: bool = False, unroll: int | None = None, prefetch: bool | None = None,
              rows_per_block: int | None = None, stream=None) -> None:
    """y[n, rows] = q8(x)[n, cols] @ W.T (+ res) for Q4_K / Q5_K / Q6_K rows (matvec_k.cu kq8): x is quantized
    to int8 per 32 columns inside the kernel and multiplied with dp4a. Batches of 1, 2 or 4 rows per
    launch (larger n: launches of 4). Twin: reference.linear_q8(x, quants.dequantize(W)).

    ldx: x's row stride (default cols). act ("silu" / "gelu_tanh"): x = act(x) * x[up_offset:], the
    gated MLP's activation applied while loading (x is then the fused gate|up buffer). gated: W is the
    stacked [gate; up] matrix and y[n, rows / 2] = act(x W_gate^T) * (x W_up^T), the activation applied
    to the outputs, once per column (twin: act(linear_q8(x, W_gate)) * linear_q8(x, W_up))."""
    if not kq8_supported(w) or n < 1:
        raise ValueError(f"the int8 matvec takes Q4_K/Q5_K/Q6_K rows of at most {KV2_MAX_COLS} columns")
    if act not in Q8_ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}")
    if gated and (act is None or w.rows % 2 or res is not None or unroll or prefetch):
        raise ValueError("a gated matvec needs an activation, an even number of rows, and no residual")
    ldx = w.cols if ldx is None else ldx
    if ldx % 4 or up_offset % 4 or x.ptr % 16:
        raise ValueError("x rows must be 16-byte aligned")
    _need(x, np.float32, (n - 1) * ldx + w.cols + (up_offset if act and not gated else 0), "x")
    out_rows = w.rows // 2 if gated else w.rows
    _need(y, np.float32, n * out_rows, "y")
    if res is not None:
        _need(res, np.float32, n * w.rows, "res")
    warps = -(-(w.cols // 256) // 8)
    for b0 in range(0, n, 4):
        nb = min(4, n - b0)
        bt = 1 if nb == 1 else 2 if nb == 2 else 4
        du, dpf = KQ8_DEFAULT[bt]
        u = unroll or du
        pf = dpf if prefetch is None else prefetch
        if (bt, u, pf) not in KQ8_VARIANTS:
            raise ValueError(f"kq8 (batch, unroll, prefetch) must be one of {sorted(KQ8_VARIANTS)}")
        rpb = rows_per_block or _kv2_rows_per_block(dev, w.rows, w.cols, u)
        if rpb % u or rpb > 64 or (gated and rpb % 2):
            raise ValueError("rows_per_block must be a multiple of the unroll (and even when gated), at most 64")
        name = f"kq8g_b{bt}_u{u}" if gated else f"kq8{'p' if pf else ''}_b{bt}_u{u}"
        grid = -(-out_rows // (rpb // 2)) if gated else -(-w.rows // rpb)
        dev.kernel(f"matvec_k_{w.type}", name).launch(
            (grid,), (32 * warps,), w.data, I64(w.row_bytes), w.rows, w.cols,
            _ptr(x, b0 * ldx * 4), I64(ldx), I64(up_offset), Q8_ACTIVATIONS[act], nb,
            _ptr(res, b0 * w.rows * 4) if res is not None else None, _ptr(y, b0 * out_rows * 4), rpb, stream=stream)


SQ_WARPS, SQ_ROWS, SQ_MAX_ROW_BYTES = 8, 8, 768  # stream_q8_0.cu: warps a block, rows a warp stage, row size


def stream_q8_0_supported(w: QuantMatrix) -> bool:
    return (w.type == "q8_0" and w.cols % 64 == 0 and w.row_bytes % 16 == 0 and w.row_bytes <= SQ_MAX_ROW_BYTES
            and w.data.ptr % 16 == 0)


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
    def alloc(cls, dev: Device) -> "RowArgmax":
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
                         "bytes and a multiple of 64 columns")
    _need(x, np.float32, w.cols, "x")
    _need(y, np.float32, w.rows, "y")
    if res is not None:
        _need(res, np.float32, w.rows, "res")
    groups = -(-w.rows // SQ_ROWS)
    grid = max(1, min(blocks or 2 * dev.sm_count, -(-groups // SQ_WARPS)))
    a = argmax
    if a is not None and a.part_v.size < grid:
        raise ValueError(f"the argmax's parts hold {a.part_v.size} blocks; the grid has {grid}")
    dev.kernel("stream_q8_0", "sq8_b1").launch(
        (grid,), (32 * SQ_WARPS,), w.data, I64(w.row_bytes), w.rows, w.cols, x, res, y,
        *((a.part_v, a.part_i, a.counter, a.best_v, a.best_i) if a is not None else (None,) * 5),
        smem=stream_q8_0_smem(w), stream=stream)


# -- dequantization / embedding lookup ----------------------------------------------------------------


def dequant_rows(dev: Device, w: QuantMatrix, out: DeviceArray, ids: DeviceArray | None = None, *,
                 n: int | None = None, scale: float = 1.0, stream=None) -> None:
    """out[i] = dequantize(W[ids[i]]) (* scale); ids None: every row. Twin: quants.dequantize_rows /
    quants.dequantize. Out-of-range ids give a NaN row (validate ids on the host)."""
    if ids is not None:
        _need(ids, np.int32, 1, "ids")
        n = ids.size if n is None else n
    else:
        n = w.rows if n is None else n
    _need(out, np.float32, n * w.cols, "out")
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
    _need(ids, np.int32, n, "ids")
    _need(out, np.float32, n * w.cols, "out")
    if w.cols % 8:
        raise ValueError("embed needs rows of a multiple of 8 columns")
    if feed is not None:
        _need(feed[1], np.int32, n, "source")
    if norm is not None:
        _need(norm[0], np.float32, w.cols, "norm weight")
        _need(norm[2], np.float32, n * w.cols, "h")
    a8 = w.row_bytes % 8 == 0 and w.data.ptr % 8 == 0
    k = dev.kernel("dequant", f"embed_{w.type}_{'a8' if a8 else 'a2'}")
    threads = min(256, max(32, -(-(w.cols // 8) // 32) * 32))
    drawn, source = feed if feed is not None else (None, None)
    nw, eps, h = norm if norm is not None else (None, 0.0, None)
    k.launch((n,), (threads,), w.data, I64(w.row_bytes), w.rows, w.cols, drawn, source, ids, n, out, F32(scale), nw,
             F32(eps), h, stream=stream)


# -- norms, residuals, rope, activations ----------------------------------------------------------------


NORM_MAX_COLS = 8192


def norm_shape(cols: int) -> tuple[int, int]:
    """(columns per thread, threads) of the norm kernels for rows of `cols`: norm.cu holds a row in
    registers, 4 columns per thread up to 4096 and 8 up to NORM_MAX_COLS."""
    for per in (4, 8):
        if cols <= per * 1024:
            warps = -(-cols // (32 * per))
            return per, 32 * max(1, warps)
    raise ValueError(f"rows of {cols} columns exceed the norm kernels' {NORM_MAX_COLS}")


def _norm_kernel(dev: Device, name: str, cols: int):
    per, threads = norm_shape(cols)
    return dev.kernel("norm", f"{name}_e{per}"), threads


def rms_norm(dev: Device, x: DeviceArray, weight: DeviceArray, y: DeviceArray, *, eps: float,
             rows: int, cols: int, res: DeviceArray | None = None, h_out: DeviceArray | None = None,
             heads: int = 1, ldx: int | None = None, ldy: int | None = None, stream=None) -> None:
    """h = x (+ res) (stored to h_out when given); y = rms_norm(h, weight, eps) (reference.rms_norm).

    Row r is (token r // heads, head r % heads) at token * ld + head * cols: heads > 1 normalises
    per-head slices (q/k norm) in place with ld the token stride."""
    ldx = cols * heads if ldx is None else ldx
    ldy = cols * heads if ldy is None else ldy
    _need(weight, np.float32, cols, "weight")
    kernel, threads = _norm_kernel(dev, "rms_norm_f32", cols)
    kernel.launch(
        (rows,), (threads,), x, res, h_out, weight, y, rows, cols, heads, I64(ldx), I64(ldy), F32(eps), stream=stream
    )


def rms_norm_add(dev: Device, x: DeviceArray, weight: DeviceArray, out: DeviceArray, *, eps: float, rows: int,
                 cols: int, stream=None) -> None:
    """out += rms_norm(x, weight, eps) row by row: Gemma's post-norms, folded into the residual add
    (twin: reference.rms_norm, then +)."""
    _need(weight, np.float32, cols, "weight")
    kernel, threads = _norm_kernel(dev, "rms_norm_add_f32", cols)
    kernel.launch((rows,), (threads,), x, weight, out, rows, cols, F32(eps), stream=stream)


def rms_norm_add_norm(dev: Device, x: DeviceArray, w1: DeviceArray, out: DeviceArray, w2: DeviceArray,
                      h: DeviceArray, *, eps: float, rows: int, cols: int, stream=None) -> None:
    """out += rms_norm(x, w1); h = rms_norm(out, w2), row by row: a post-norm residual add and the
    next pre-norm in one launch (twin: reference.rms_norm, +, reference.rms_norm)."""
    _need(w1, np.float32, cols, "w1")
    _need(w2, np.float32, cols, "w2")
    kernel, threads = _norm_kernel(dev, "rms_norm_add_norm_f32", cols)
    kernel.launch((rows,), (threads,), x, w1, out, w2, h, rows, cols, F32(eps), stream=stream)


def add(dev: Device, a: DeviceArray, b: DeviceArray, out: DeviceArray, n: int | None = None, *, stream=None) -> None:
    n = a.size if n is None else n
    dev.kernel("norm", "add_f32").launch((min(-(-n // 256), dev.sm_count * 16),), (256,), a, b, out, I64(n), stream=stream)


def rope(dev: Device, q: DeviceArray, k: DeviceArray | None, pos: DeviceArray, inv_freq: DeviceArray, *,
         n: int, hq: int, hk: int, head_dim: int, neox: bool, ldq: int | None = None,
         ldk: int | None = None, stream=None) -> None:
    """In place: q [n, hq, D] and k [n, hk, D] (token strides ldq/ldk) rotated at positions pos (int32)
    with inv_freq [D/2]; twin reference.rope with reference.rope_tables."""
    _need(pos, np.int32, n, "pos")
    _need(inv_freq, np.float32, head_dim // 2, "inv_freq")
    ldq = hq * head_dim if ldq is None else ldq
    ldk = hk * head_dim if ldk is None else ldk
    hk = hk if k is not None else 0
    if head_dim // 2 > 256:
        raise ValueError("head_dim above 512 is not supported by the rope kernel")
    threads = min(256, max(32, -(-((hq + hk) * head_dim // 2) // 32) * 32))
    dev.kernel("rope", "rope_f32").launch(
        (n,), (threads,), q, I64(ldq), hq, k, I64(ldk), hk, pos, inv_freq, n, head_dim,
        1 if neox else 0, stream=stream
    )


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_act(dev: Device, g: DeviceArray, u: DeviceArray, out: DeviceArray, *, n: int, ffn: int, act: str,
              ldg: int | None = None, ldu: int | None = None, ldo: int | None = None, stream=None) -> None:
    """out = act(g) * u over [n, ffn] (twin: reference.silu / reference.gelu_tanh times u)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r} (have: {', '.join(ACTIVATIONS)})")
    total = n * ffn
    blocks = max(1, min(-(-total // 256), dev.sm_count * 16))
    dev.kernel("act", "gated_act_f32").launch(
        (blocks,), (256,), g, I64(ffn if ldg is None else ldg), u, I64(ffn if ldu is None else ldu), out,
        I64(ffn if ldo is None else ldo), n, ffn, ACTIVATIONS[act], stream=stream
    )


# -- KV cache and attention ------------------------------------------------------------------------------

_KV_NAMES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}


def kv_write(dev: Device, k: DeviceArray, v: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
             slots: DeviceArray, *, n: int, kv_heads: int, head_dim: int, ldk: int | None = None,
             ldv: int | None = None, stream=None) -> None:
    """k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i] (rows [kv_heads, head_dim], converted)."""
    kvn = _KV_NAMES.get(k_cache.dtype)
    if kvn is None or v_cache.dtype != k_cache.dtype:
        raise TypeError("the KV cache must be float16 or float32 (both halves alike)")
    w = kv_heads * head_dim
    dev.kernel("attention", f"kv_write_{kvn}").launch(
        (n,), (min(1024, max(32, -(-w // 32) * 32)),), k, I64(w if ldk is None else ldk), v,
        I64(w if ldv is None else ldv), k_cache, v_cache, slots, n, kv_heads, head_dim, stream=stream
    )


def qk_rope_kv(dev: Device, q: DeviceArray, k: DeviceArray, v: DeviceArray, k_cache: DeviceArray,
               v_cache: DeviceArray, slots: DeviceArray, pos: DeviceArray, inv_freq: DeviceArray, *, n: int,
               heads: int, kv_heads: int, head_dim: int, neox: bool, q_norm: DeviceArray | None = None,
               k_norm: DeviceArray | None = None, eps: float = 1e-6, ldq: int | None = None, ldk: int | None = None,
               ldv: int | None = None, stream=None) -> None:
    """The attention prologue in one launch: per head, q and k RMS-normalised (when q_norm / k_norm
    are given) and rotated at pos; q in place, k and v into the cache at slots. Twin:
    reference.rms_norm per head, reference.rope, then the cache assignment (= rms_norm, rope and
    kv_write in sequence)."""
    kvn = _KV_NAMES.get(k_cache.dtype)
    if kvn is None or v_cache.dtype != k_cache.dtype:
        raise TypeError("the KV cache must be float16 or float32 (both halves alike)")
    if head_dim not in (64, 128, 256):
        raise ValueError(f"no fused attention prologue for head_dim {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    _need(pos, np.int32, n, "pos")
    _need(inv_freq, np.float32, head_dim // 2, "inv_freq")
    ldq = heads * head_dim if ldq is None else ldq
    ldk = kv_heads * head_dim if ldk is None else ldk
    ldv = kv_heads * head_dim if ldv is None else ldv
    warps = min(16, heads + 2 * kv_heads)
    dev.kernel("attention", f"qk_rope_kv_{kvn}").launch(
        (n,), (32 * warps,), q, I64(ldq), k, I64(ldk), v, I64(ldv), heads, kv_heads, head_dim, q_norm, k_norm,
        F32(eps), pos, inv_freq, 1 if neox else 0, k_cache, v_cache, slots, n, stream=stream)


ATT_SPLIT_MAX = 512
ATT_SPLIT_MIN = 16  # a short context split this fine still fills some SMs (one CTA per kv head is latency)


ATTW_SPLIT_MAX = 256  # attention.cu: keys a CTA of attn_warp takes at most
ATTW_WARPS = 16  # attention.cu: warps of an attn_warp CTA
ATTW_STAGE_BYTES = 128 << 10  # the K and V rows an attn_warp CTA stages in shared memory, at most
ATTW_CLUSTER_MAX = 8  # attention.cu: attn_warp splits merged inside one cluster, at most
ATTW_CLUSTER_MIN_SPLIT = 32  # keys per clustered CTA, at least (270M tg128 on the H200: 16 and 32 tie, 64 loses 3%)
ATTW_SPREAD_CTAS = 128  # attn_warp spreads short contexts over more CTAs up to a grid of about this many
ATTW_MAX_KEYS = 1024  # beyond: attn_decode (its CTAs walk up to 512 keys)
ATTW_MAX_ROW_HEADS = 64  # and beyond this many (row, kv head) pairs


def attention_warp_cap(head_dim: int, kv_bytes: int) -> int:
    """Keys an attn_warp CTA takes at most: the K and V rows it stages in shared memory."""
    return min(ATTW_SPLIT_MAX, ATTW_STAGE_BYTES // (2 * head_dim * kv_bytes))


def attention_split_warp(head_dim: int, kv_bytes: int, max_keys: int, pairs: int = 1) -> int:
    """Keys per CTA for attn_warp: the context of each of the `pairs` (row, kv head) pairs spread over
    at most ATTW_CLUSTER_MAX CTAs (fewer once the grid passes ATTW_SPREAD_CTAS), which run as one
    thread block cluster and merge their parts in distributed shared memory (no attn_combine:
    measured on the H200, Gemma 3 270M at 40 keys, it took 3.3 us of a layer's 22), at least
    ATTW_CLUSTER_MIN_SPLIT keys each and at most what one CTA stages in shared memory
    (ATTW_STAGE_BYTES of K and V rows: 128 keys at D 256 in float16). A single CTA over the whole
    context was measured slower as it grew (11.0 us at 120 keys against 6.6 at 40; spread: 6.5 and
    7.0); spreading each of 64 streams over 8 CTAs too dropped them from 40,567 tok/s to 29,540."""
    cap = attention_warp_cap(head_dim, kv_bytes)
    ctas = max(1, min(ATTW_CLUSTER_MAX, ATTW_SPREAD_CTAS // max(1, int(pairs))))
    spread = max(ATTW_CLUSTER_MIN_SPLIT, -(-int(max_keys) // ctas))
    return max(1, min(cap, spread, int(max_keys)))


def attention_clustered(warp: bool, parts: int) -> bool:
    """attn_warp's split-K parts of one (kv head, row) run as one cluster and merge themselves."""
    return warp and 1 < parts <= ATTW_CLUSTER_MAX


def attention_warp_smem(head_dim: int, kv_bytes: int, split: int) -> int:
    return 2 * split * head_dim * kv_bytes


def _split(dev: Device, rows: int, kv_heads: int, max_keys: int, warp: bool, head_dim: int, kv_bytes: int) -> int:
    if warp:
        return attention_split_warp(head_dim, kv_bytes, max_keys, rows * kv_heads)
    return attention_split(dev, rows, kv_heads, max_keys)


def decode_kernel(rows: int, kv_heads: int, max_keys: int) -> str:
    """The decode attention kernel attention(kernel="auto") runs with a prologue: attn_warp for contexts
    of up to ATTW_MAX_KEYS keys and at most 64 (row, kv head) pairs; beyond, attn_decode, whose CTAs
    walk longer runs of keys (measured on the H200: 8B at 64 streams, 5,143 tok/s with attn_warp
    against 5,903 before it)."""
    return "warp" if max_keys <= ATTW_MAX_KEYS and rows * kv_heads <= ATTW_MAX_ROW_HEADS else "block"


def attention_parts(dev: Device, rows: int, heads: int, kv_heads: int, max_keys: int, head_dim: int,
                    decode: bool, kv_bytes: int = 2) -> int:
    """How many split-K parts attention() makes by default (decode: with a prologue; kv_bytes: the KV
    cache's element size), which sizes the partials buffers a captured graph owns."""
    max_keys = max(1, int(max_keys))
    warp = decode and decode_kernel(rows, kv_heads, max_keys) == "warp"
    parts = -(-max_keys // _split(dev, rows, kv_heads, max_keys, warp, head_dim, kv_bytes))
    return 1 if attention_clustered(warp, parts) else parts


def attention_split(dev: Device, rows: int, kv_heads: int, max_keys: int) -> int:
    """Keys per CTA: the longest run (at most 512) that still gives about two CTAs per SM."""
    split = ATT_SPLIT_MAX
    while split > ATT_SPLIT_MIN and rows * kv_heads * -(-max_keys // split) < 2 * dev.sm_count:
        split //= 2
    return split


@dataclass
class DecodePrologue:
    """For attention(prologue=...): qk_rope_kv's work fused into the attention kernel, for decode
    steps (one row per sequence, its only new key at its position). q is then the raw q rows; k and v
    the raw k and v rows (strides ldk, ldv); the new k (normed, rotated) and v go to their slots."""

    k: DeviceArray
    v: DeviceArray
    slots: DeviceArray
    inv_freq: DeviceArray
    neox: bool
    ldk: int
    ldv: int
    q_norm: DeviceArray | None = None
    k_norm: DeviceArray | None = None
    eps: float = 1e-6


def attention(dev: Device, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray,
              row_seq: DeviceArray, row_pos: DeviceArray, out: DeviceArray, *, rows: int, heads: int,
              kv_heads: int, head_dim: int, block_size: int, max_blocks: int, max_keys: int, window: int = 0,
              scale: float, split: int | None = None, partials: tuple[DeviceArray, DeviceArray] | None = None,
              ldq: int | None = None, prologue: DecodePrologue | None = None, kernel: str = "auto",
              stream=None) -> None:
    """Paged causal GQA attention: query row i (q[i] [heads, D]) belongs to sequence row_seq[i] at
    position row_pos[i] and sees keys j <= pos (pos - j < window when window > 0) through
    block_tables[seq]. out [rows, heads, D]. Twin: reference.attention per sequence.

    max_keys: an upper bound of the keys any row sees (min(pos + 1, window)); it sizes the split-K
    grid. split: keys per CTA (default: attention_split). partials: (acc, ml) buffers for the split-K
    partial results (default: the device's scratch; a captured graph passes its own, which never move).
    ldq: q's row stride (default heads * head_dim; larger when q sits in a fused qkv row). prologue:
    decode rows with qk_rope_kv fused in (twin: qk_rope_kv's, then attention). kernel: with a
    prologue, "warp" (attn_warp: its split's K and V rows staged in shared memory; the default up to
    ATTW_MAX_KEYS keys, see decode_kernel) or "block" (attn_decode)."""
    kvn = _KV_NAMES.get(k_cache.dtype)
    if kvn is None or v_cache.dtype != k_cache.dtype:
        raise TypeError("the KV cache must be float16 or float32 (both halves alike)")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    g = heads // kv_heads
    if g not in (1, 2, 4, 8) or head_dim not in (64, 128, 256):
        raise ValueError(f"no attention kernel for {g} query heads per kv head and head_dim {head_dim}")
    if prologue is not None:
        if (prologue.q_norm is None) != (prologue.k_norm is None):
            raise ValueError("q_norm and k_norm go together")
        _need(prologue.inv_freq, np.float32, head_dim // 2, "inv_freq")
        _need(prologue.slots, np.int32, rows, "slots")
    max_keys = max(1, int(max_keys))
    if kernel not in ("auto", "warp", "block") or (kernel == "warp" and prologue is None):
        raise ValueError("kernel is auto, block, or (with a prologue) warp")
    warp = prologue is not None and (decode_kernel(rows, kv_heads, max_keys) == "warp" if kernel == "auto"
                                     else kernel == "warp")
    if split is None:
        split = _split(dev, rows, kv_heads, max_keys, warp, head_dim, k_cache.dtype.itemsize)
    split = max(1, min(int(split), attention_warp_cap(head_dim, k_cache.dtype.itemsize) if warp else ATT_SPLIT_MAX))
    S = -(-max_keys // split)
    ldq = ldq or heads * head_dim

    clustered = attention_clustered(warp, S)

    def launch(out_, acc, ml):
        grid = (kv_heads, rows, S)
        if warp:
            p = prologue
            dev.kernel("attention", f"attn_warp_d{head_dim}_g{g}_{kvn}").launch(
                grid, (32 * ATTW_WARPS,), q, I64(ldq), p.k, I64(p.ldk), p.v, I64(p.ldv), p.q_norm, p.k_norm,
                F32(p.eps), p.inv_freq, 1 if p.neox else 0, p.slots, k_cache, v_cache, block_tables, max_blocks,
                row_seq, row_pos, heads, kv_heads, block_size, window, F32(scale), split, out_, acc, ml,
                smem=attention_warp_smem(head_dim, k_cache.dtype.itemsize, split), stream=stream,
                cluster=(1, 1, S) if clustered else None)
            return
        if prologue is None:
            dev.kernel("attention", f"attn_d{head_dim}_g{g}_{kvn}").launch(
                grid, (128,), q, k_cache, v_cache, block_tables, max_blocks, row_seq, row_pos, heads, kv_heads,
                block_size, window, F32(scale), split, out_, acc, ml, I64(ldq), stream=stream)
            return
        p = prologue
        dev.kernel("attention", f"attn_decode_d{head_dim}_g{g}_{kvn}").launch(
            grid, (128,), q, I64(ldq), p.k, I64(p.ldk), p.v, I64(p.ldv), p.q_norm, p.k_norm, F32(p.eps), p.inv_freq,
            1 if p.neox else 0, p.slots, k_cache, v_cache, block_tables, max_blocks, row_seq, row_pos, heads,
            kv_heads, block_size, window, F32(scale), split, out_, acc, ml, stream=stream)

    if S == 1 or clustered:
        launch(out, None, None)
        return
    if partials is not None:
        acc, ml = partials
        _need(acc, np.float32, rows * heads * S * head_dim, "partials[0]")
        _need(ml, np.float32, rows * heads * S * 2, "partials[1]")
    else:
        acc = dev.scratch("attn_acc", rows * heads * S * head_dim * 4).view_bytes(0, rows * heads * S * head_dim,
                                                                                 np.float32)
        ml = dev.scratch("attn_ml", rows * heads * S * 2 * 4).view_bytes(0, rows * heads * S * 2, np.float32)
    launch(None, acc, ml)
    dev.kernel("attention", "attn_combine").launch((heads, rows), (head_dim,), acc, ml, S, heads, head_dim, out, stream=stream)


FLASH_ROWS = 64  # query rows per tile (flash.cu FA_ROWS)
FLASH_HEAD_DIMS = (64, 128, 256)


def flash_tiles(spans) -> np.ndarray:
    """The flash kernel's tiles for a step: each chunk's rows (a, b) in runs of at most 64, as int32
    (first row, row count) pairs. A chunk's rows are consecutive positions of one sequence."""
    out = [(r, min(FLASH_ROWS, b - r)) for a, b in spans for r in range(a, b, FLASH_ROWS)]
    return np.asarray(out, dtype=np.int32).reshape(-1, 2)


def flash_smem_bytes(head_dim: int) -> int:
    keys = 64 if head_dim <= 128 else 32
    return (FLASH_ROWS + 4 * keys) * (head_dim + 8) * 2


def flash_attention(dev: Device, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
                    block_tables: DeviceArray, row_seq: DeviceArray, row_pos: DeviceArray, tiles: DeviceArray,
                    out: DeviceArray, *, n_tiles: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    max_blocks: int, window: int = 0, scale: float, ldq: int | None = None, stream=None) -> None:
    """Paged causal GQA attention for prefill on the tensor cores (flash.cu): the same contract as
    attention() for the rows that `tiles` (flash_tiles) lists, each tile consecutive positions of one
    sequence; float16 KV only. Q and the probabilities are rounded to f16 (twin: reference.attention,
    to f16 precision)."""
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError("flash attention reads a float16 KV cache")
    if heads % kv_heads or head_dim not in FLASH_HEAD_DIMS:
        raise ValueError(f"no flash kernel for {heads}/{kv_heads} heads and head_dim {head_dim}")
    _need(tiles, np.int32, 2 * n_tiles, "tiles")
    dev.kernel("flash", f"flash_prefill_d{head_dim}").launch(
        (n_tiles, heads), (256 if head_dim == 256 else 128,), q, I64(ldq or heads * head_dim), k_cache, v_cache, block_tables, max_blocks,
        row_seq, row_pos, tiles, heads, kv_heads, block_size, window, F32(scale * math.log2(math.e)), out,
        I64(heads * head_dim), smem=flash_smem_bytes(head_dim), stream=stream)


# -- sampling ---------------------------------------------------------------------------------------------


ARGMAX_CHUNK = 8192  # in sampling.cu


def argmax(dev: Device, logits: DeviceArray, out_idx: DeviceArray, *, rows: int, vocab: int,
           ld: int | None = None, out_val: DeviceArray | None = None, stream=None) -> None:
    """out_idx[r] = numpy.argmax(logits[r]) (first index of the maximum); two launches: chunks of
    8192 in parallel, then one warp per row."""
    _need(out_idx, np.int32, rows, "out_idx")
    chunks = -(-vocab // ARGMAX_CHUNK)
    pv = dev.scratch("argmax_v", rows * chunks * 4)
    pi = dev.scratch("argmax_i", rows * chunks * 4)
    dev.kernel("sampling", "argmax_part_f32").launch(
        (chunks, rows), (256,), logits, I64(vocab if ld is None else ld), vocab, pv, pi, stream=stream)
    dev.kernel("sampling", "argmax_final_f32").launch((rows,), (32,), pv, pi, chunks, out_idx, out_val, stream=stream)


def softmax(dev: Device, x: DeviceArray, y: DeviceArray, *, rows: int, cols: int, temperature: float = 1.0,
            ldx: int | None = None, ldy: int | None = None, stream=None) -> None:
    """y = reference.softmax(x / temperature) row by row."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError("temperature must be a positive number")
    dev.kernel("sampling", "softmax_f32").launch(
        (rows,), (1024,), x, I64(cols if ldx is None else ldx), y, I64(cols if ldy is None else ldy), cols,
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

    params: a SampleParams block on the device (see `sample_params`). work: (counters, partials), int32
    of at least rows (zeroed once: the kernel leaves them at zero) and 2 * rows * sample_parts(vocab)
    elements; default: the device's own (a captured graph must bring its own: those may move). greedy:
    one row's argmax found already (matvec_stream_q8_0's), taken if the row is greedy; the kernel then
    runs one block. Twin: reference.sample_rows."""
    _need(out, np.int32, rows, "out")
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
        (rows, parts), (1024,), logits, I64(vocab if ld is None else ld), vocab, Pointer(base + off["temperature"]),
        Pointer(base + off["top_k"]), Pointer(base + off["top_p"]), Pointer(base + off["min_p"]),
        Pointer(base + off["seed"]), Pointer(base + off["step"]), out, out_floor, Pointer(partials.ptr),
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


# -- tensor-core matmul (prefill) -------------------------------------------------------------------------

GEMM_TILE = 128
HALF_KINDS = ("f16", "bf16")


def to_half(dev: Device, x: DeviceArray, out: DeviceArray, n: int, *, kind: str = "f16", stream=None) -> None:
    """out (uint16 bits) = x rounded to f16 or bf16."""
    _need(out, np.uint16, n, "out")
    blocks = max(1, min(-(-n // 256), dev.sm_count * 16))
    dev.kernel("gemm", f"to_{kind}").launch((blocks,), (256,), x, out, I64(n), stream=stream)


def dequant_half(dev: Device, w: QuantMatrix, out: DeviceArray, *, kind: str = "f16", stream=None) -> None:
    """out [rows, cols] (uint16 bits) = W dequantized to f16 / bf16 (twin: quants.dequantize, rounded)."""
    _need(out, np.uint16, w.rows * w.cols, "out")
    threads = min(256, max(32, -(-(w.cols // 8) // 32) * 32))
    dev.kernel("dequant", f"dequant_{w.type}_{'h16' if kind == 'f16' else 'hbf'}").launch(
        (w.rows,), (threads,), w.data, I64(w.row_bytes), w.rows, w.cols, w.rows, out, stream=stream)


def gemm(dev: Device, a: DeviceArray, b: DeviceArray, c: DeviceArray, *, m: int, n: int, k: int,
         res: DeviceArray | None = None, kind: str = "f16", stream=None) -> None:
    """c[m, n] = a[m, k] @ b[n, k].T (+ res[m, n]); a, b 16-bit (uint16 bits of f16 / bf16), c float32.
    Twin: reference.linear on the 16-bit values. k must be a multiple of 32."""
    if kind not in HALF_KINDS:
        raise ValueError(f"kind must be one of {HALF_KINDS}")
    if k % 32:
        raise ValueError(f"the tensor-core matmul needs k a multiple of 32 (got {k})")
    _need(a, np.uint16, m * k, "a")
    _need(b, np.uint16, n * k, "b")
    _need(c, np.float32, m * n, "c")
    if res is not None:
        _need(res, np.float32, m * n, "res")
    splits = gemm_splits(dev, m, n, k)
    if splits == 1:
        dev.kernel("gemm", f"gemm_{kind}").launch(
            (-(-n // GEMM_TILE), -(-m // GEMM_TILE)), (256,), a, b, res, c, m, n, k, I64(n), stream=stream)
        return
    ws = dev.scratch("gemm_splitk", gemm_splitk_bytes(dev))
    dev.kernel("gemm", f"gemm_{kind}").launch(
        (-(-n // GEMM_TILE), -(-m // GEMM_TILE), splits), (256,), a, b, None, ws, m, n, k, I64(n), stream=stream)
    blocks = max(1, min(-(-(m * n) // 256), dev.sm_count * 8))
    dev.kernel("gemm", "gemm_splitk_reduce").launch((blocks,), (256,), ws, splits, I64(m * n), res, c, stream=stream)


def gemm_splits(dev: Device, m: int, n: int, k: int) -> int:
    """K runs per output tile: enough CTAs for about two per SM when the tiles alone are too few (a
    small M: decode batches), each run at least 4 steps of 32; 1 for prefill-sized M."""
    tiles = -(-n // GEMM_TILE) * -(-m // GEMM_TILE)
    if tiles >= dev.sm_count:
        return 1
    return max(1, min(2 * dev.sm_count // tiles, k // 32 // 4, 16))


def gemm_splitk_bytes(dev: Device) -> int:
    """The split-K workspace's bound: splits * tiles <= 2 * SMs, each tile at most 128 x 128 floats.
    Allocated once at that size, so a captured graph's pointer never moves."""
    return 2 * dev.sm_count * GEMM_TILE * GEMM_TILE * 4


def linear_tc(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int, res: DeviceArray | None = None,
              kind: str = "f16", scratch: str = "gemm", stream=None) -> None:
    """y[n, rows] = x[n, cols] @ dequantize(W).T (+ res) on the tensor cores: W decoded to 16 bits (or
    its kept copy, QuantMatrix.keep_half) and x converted into the device scratch buffers
    `<scratch>_w` / `<scratch>_x`, then gemm. For many rows (prefill, large decode batches); small
    batches use matvec."""
    xh = dev.scratch(f"{scratch}_x", n * w.cols * 2).view(0, n * w.cols, np.uint16)
    if w.half is not None and w.half_kind == kind:
        wh = w.half
    else:
        wh = dev.scratch(f"{scratch}_w", w.rows * w.cols * 2).view(0, w.rows * w.cols, np.uint16)
        dequant_half(dev, w, wh, kind=kind, stream=stream)
    to_half(dev, x, xh, n * w.cols, kind=kind, stream=stream)
    gemm(dev, xh, wh, y, m=n, n=w.rows, k=w.cols, res=res, kind=kind, stream=stream)


def gather_rows(dev: Device, x: DeviceArray, idx: DeviceArray, out: DeviceArray, *, n: int, cols: int,
                ldx: int | None = None, stream=None) -> None:
    """out[i] = x[idx[i]] (rows of cols floats)."""
    _need(idx, np.int32, n, "idx")
    _need(out, np.float32, n * cols, "out")
    dev.kernel("norm", "gather_rows_f32").launch((n,), (min(1024, max(32, -(-cols // 32) * 32)),), x,
                                                 I64(cols if ldx is None else ldx), idx, n, cols, out, stream=stream)


def add_bias(dev: Device, y: DeviceArray, bias: DeviceArray, *, n: int, cols: int, ldy: int | None = None,
             stream=None) -> None:
    """y[r] += bias for r < n."""
    _need(bias, np.float32, cols, "bias")
    dev.kernel("norm", "add_bias_f32").launch((n,), (min(1024, max(32, -(-cols // 32) * 32)),), y,
                                              I64(cols if ldy is None else ldy), bias, n, cols, stream=stream)


# -- KV blocks in and out of the pools ----------------------------------------------------------------


def _kv_block_words(pool: DeviceArray, block_elems: int) -> int:
    nbytes = block_elems * np.dtype(pool.dtype).itemsize
    if nbytes % 16:
        raise ValueError(f"a block's row of {nbytes} bytes is not a whole number of 16-byte words")
    return nbytes // 16


def kv_gather(dev: Device, k_pool: DeviceArray, v_pool: DeviceArray, blocks: DeviceArray, staging: DeviceArray, *,
              n: int, layers: int, layer_elems: int, block_elems: int, stream=None) -> None:
    """staging[j] = (K, V) of pool block blocks[j], every layer: [n, 2, layers, block_elems] in the
    pools' dtype. Twin: reference.kv_gather."""
    words = _kv_block_words(k_pool, block_elems)
    _need(blocks, np.int32, n, "blocks")
    if staging.nbytes < n * 2 * layers * words * 16:
        raise ValueError("the staging area is smaller than the blocks")
    dev.kernel("kv_copy", "kv_gather").launch((n * 2 * layers,), (min(256, -(-words // 32) * 32),), k_pool, v_pool,
                                              blocks, layers, I64(layer_elems * k_pool.dtype.itemsize // 16),
                                              words, staging, stream=stream)


def kv_scatter(dev: Device, k_pool: DeviceArray, v_pool: DeviceArray, blocks: DeviceArray, staging: DeviceArray, *,
               n: int, layers: int, layer_elems: int, block_elems: int, stream=None) -> None:
    """The reverse of kv_gather: pool block blocks[j] = staging[j]. Twin: reference.kv_scatter."""
    words = _kv_block_words(k_pool, block_elems)
    _need(blocks, np.int32, n, "blocks")
    if staging.nbytes < n * 2 * layers * words * 16:
        raise ValueError("the staging area is smaller than the blocks")
    dev.kernel("kv_copy", "kv_scatter").launch((n * 2 * layers,), (min(256, -(-words // 32) * 32),), k_pool,
                                               v_pool, blocks, layers, I64(layer_elems * k_pool.dtype.itemsize // 16),
                                               words, staging, stream=stream)


# -- fault injection ------------------------------------------------------------------------------------


def fault_illegal_address(dev: Device) -> None:
    """Launch a kernel that writes far outside any allocation and synchronize: raises
    StickyCudaError (700, CUDA_ERROR_ILLEGAL_ADDRESS) and poisons this process's context."""
    buf = dev.scratch("fault", 256)
    dev.kernel("fault", "fault_illegal_address").launch((1,), (1,), buf, I64(1 << 40))
    dev.synchronize()


# the public ops: every launcher, its support checks and sizes, and the types they take
__all__ = [
    "ACTIVATIONS", "BLOCK_SIZES", "GGML_TYPE_IDS", "DecodePrologue", "PostNorm", "QuantMatrix", "RowArgmax",
    "SampleParams",
    "add", "add_bias", "argmax", "attention", "attention_clustered", "attention_parts", "attention_split",
    "attention_split_warp", "attention_warp_cap", "attention_warp_smem", "decode_kernel", "dequant_half",
    "dequant_rows", "embed", "fault_illegal_address", "flash_attention", "flash_smem_bytes", "flash_tiles",
    "gated_act", "gather_rows", "gemm", "gemm_splitk_bytes", "gemm_splits", "kq8_supported", "kv2_supported",
    "kv_gather", "kv_scatter", "kv_write", "linear_tc", "matvec", "matvec_gated", "matvec_gated_supported",
    "matvec_post_norm",
    "matvec_q8", "matvec_stream_q8_0", "norm_shape", "post_norm_supported", "qk_rope_kv", "repack_q6_k",
    "rms_norm", "rms_norm_add", "rms_norm_add_norm", "rope", "row_nbytes", "sample", "sample_parts", "softmax",
    "stream_q8_0_smem", "stream_q8_0_supported", "to_half",
]
