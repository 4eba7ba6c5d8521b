"""Launchers of a mixture-of-experts MLP: moe.cu (routing, grouping by expert, gather, weighted sum)
around the grouped expert products, which read only the chosen experts' rows, in their GGUF block
formats (no 16-bit copy of the experts is ever made): matvec.cu's qmoe/qmoeg for one token or a few,
qgemm.cu's tensor-core matmul (decoded on load, 16-bit inputs) from QGEMM_MIN_ROWS tokens. A router's and
the experts' biases (gpt-oss) are added by the router's routing and by the expert products' epilogues,
before the activation. Twins: reference.moe_route and reference.moe_mlp over quants.dequantize of the
experts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import KERNEL_CONSTANTS, LOW_BIT_TYPES, QGEMM_TYPES
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import act_code, need
from .matmul import HALF_KINDS
from .matvecs import KQ8_ACTIVATIONS, KV2_MAX_RPB, MATVEC_WARPS, kq8_supported, kv2_rows_per_block, kv2_warps
from .norm import gated_act
from .quant_matrix import QuantMatrix

MOE_MAX_EXPERTS = KERNEL_CONSTANTS["MOE_MAX_EXPERTS"]
MOE_MAX_K = KERNEL_CONSTANTS["MOE_MAX_K"]
GATINGS = {"softmax": 0, "softmax-topk": 1, "sqrt-softplus": 2}  # moe.cuh GATING_*
MOE_WEIGHT_SUM_MIN = 6.103515625e-5  # as reference.MOE_WEIGHT_SUM_MIN (llama.cpp's clamp, 2^-14)
TILE_ROWS = 8  # pairs of one expert a grouped matvec block takes at most (qmoe_b8); one row: qmoe_b1
QG_ROWS = KERNEL_CONSTANTS["QG_ROWS"]  # weight rows a qgemm CTA computes
QGEMM_TILES = (16, 64)  # pairs of one expert a qgemm CTA takes: batched decode, prefill (qgemm_t16, _t64)
# From this many tokens the experts run on the tensor cores (each weight decoded once per tile of up
# to 64 pairs, not once per 8 of them); below, the grouped matvec.
QGEMM_MIN_ROWS = 8


@dataclass
class ExpertMatrices:
    """E experts' matrices of `rows` x cols each, one after another on the device (one QuantMatrix of
    E * rows rows); stacked [gate; up]: each expert's gate rows, then its up rows. bias: a float per row,
    in the same order ([E, rows]), added to the products (gpt-oss), or None."""

    m: QuantMatrix
    experts: int
    bias: DeviceArray | None = None

    @property
    def rows(self) -> int:
        return self.m.rows // self.experts

    @property
    def expert_bytes(self) -> int:
        return self.rows * self.m.row_bytes

    @classmethod
    def upload(cls, dev: Device, raws: list[np.ndarray], ggml_type, experts: int, rows: list[int],
               cols: int, biases: list[np.ndarray] | None = None) -> ExpertMatrices:
        """raws: the GGUF bytes of one or more [experts, rows_i, cols] tensors of one type, stacked
        expert by expert (gate and up: [gate_e; up_e] for each expert e); biases: their [experts, rows_i]
        biases (float32), stacked alike."""
        parts = [np.ascontiguousarray(r).view(np.uint8).reshape(experts, -1) for r in raws]
        raw = parts[0].reshape(-1) if len(parts) == 1 else np.concatenate(parts, axis=1).reshape(-1)
        m = QuantMatrix.upload(dev, raw, ggml_type, experts * sum(rows), cols)
        if m.row_bytes % 16 or m.data.ptr % 16:
            raise ValueError(f"{m.type} expert rows of {cols} columns are not 16-byte aligned")
        bias = None
        if biases is not None:
            stacked = np.concatenate([np.asarray(b, np.float32).reshape(experts, r) for b, r in
                                      zip(biases, rows, strict=True)], axis=1)
            bias = dev.to_device(np.ascontiguousarray(stacked).reshape(-1))
        return cls(m, experts, bias)


@dataclass
class MoeWeights:
    """One layer's mixture of experts on the device. gate_up: the stacked [gate; up] experts, or None
    with gate and up apart (their types differ)."""

    router: QuantMatrix  # [experts, hidden]
    down: ExpertMatrices  # [experts, hidden, ffn]
    gate_up: ExpertMatrices | None = None
    gate: ExpertMatrices | None = None
    up: ExpertMatrices | None = None
    router_bias: DeviceArray | None = None

    @property
    def experts(self) -> int:
        return self.router.rows

    @property
    def ffn(self) -> int:
        return self.down.m.cols

    def nbytes(self) -> int:
        mats = (self.router, self.down.m) + tuple(e.m for e in (self.gate_up, self.gate, self.up) if e is not None)
        return sum(m.rows * m.row_bytes for m in mats)


def max_tiles(pairs: int, experts: int, tile: int) -> int:
    """Tiles of at most `tile` pairs of one expert that `pairs` pairs can make: a grid's bound."""
    return pairs if tile == 1 else min(pairs, -(-pairs // tile) + experts)


@dataclass
class MoeScratch:
    """A step's buffers for moe_mlp at up to max_rows tokens (grouped order: pairs by expert)."""

    logits: DeviceArray  # [rows, experts]
    ids: DeviceArray  # [rows, k] int32: the chosen experts, best first
    wts: DeviceArray  # [rows, k] their weights
    pos: DeviceArray  # [rows, k] int32: each pair's place in grouped order
    order: DeviceArray  # [rows k] int32: the pair at each place
    tiles: DeviceArray  # [tiles, 3] int32
    xs: DeviceArray  # [rows k, hidden] the inputs in grouped order
    hs: DeviceArray  # [rows k, ffn] act(gate) * up
    gu: DeviceArray | None  # [rows k, 2 ffn] gate | up, where they are apart
    ys: DeviceArray  # [rows k, hidden] each pair's expert output
    done: DeviceArray  # [1] uint32: blocks of the batch-1 router done (qmvs_route_b1; 0 between launches)

    @classmethod
    def alloc(cls, dev: Device, max_rows: int, experts: int, k: int, hidden: int, ffn: int,
              apart: bool = False, pair_tile_rows: int = 1) -> MoeScratch:
        """pair_tile_rows: steps of up to this many tokens may group their pairs in tiles of one pair."""
        e, pairs = dev.empty, max_rows * k
        tiles = max(max_tiles(pairs, experts, TILE_ROWS), min(max_rows, pair_tile_rows) * k)
        s = cls(e((max_rows * experts,)), e((pairs,), np.int32), e((pairs,)), e((pairs,), np.int32),
                e((pairs,), np.int32), e((3 * tiles,), np.int32),
                e((pairs * hidden,)), e((pairs * ffn,)), e((pairs * 2 * ffn,)) if apart else None,
                e((pairs * hidden,)), e((1,), np.uint32))
        s.done.zero()
        return s


def matvec_rows(dev: Device, w: QuantMatrix, x: DeviceArray, y: DeviceArray, *, n: int, stream=None) -> None:
    """y[n, rows] = x[n, cols] @ W.T in one launch for any n (8 rows of x a block row, 16-byte rows):
    the router's logits. Twin: reference.linear."""
    need(x, np.float32, n * w.cols, "x")
    need(y, np.float32, n * w.rows, "y")
    if w.row_bytes % 16 or w.data.ptr % 16:
        raise ValueError("matvec_rows takes 16-byte aligned rows")
    dev.kernel(f"matvec_{w.type}", "qmvn_b8").launch(
        (-(-w.rows // MATVEC_WARPS), -(-n // 8)), (MATVEC_WARPS * 32,), w.data, I64(w.row_bytes), w.rows, w.cols,
        x, n, y, stream=stream)


def moe_route(dev: Device, logits: DeviceArray, ids: DeviceArray, wts: DeviceArray, *, n: int, experts: int, k: int,
              gating: str, norm_topk: bool, bias: DeviceArray | None = None, scale: float = 1.0,
              hashed: tuple[DeviceArray, DeviceArray] | None = None, stream=None) -> None:
    """Each row's k experts, best first, and their weights from the router's logits [n, experts]
    (+ bias: the logits' for softmax gatings, a selection bias for sqrt-softplus), the weights times
    scale. hashed: (table [vocab, k], tokens [n]), int32: row t's experts are table[tokens[t]] (deepseek4's
    first layers; sqrt-softplus only). Twin: reference.route (given the logits)."""
    _check_routing(experts, k, gating, hashed)
    need(logits, np.float32, n * experts, "logits")
    need(ids, np.int32, n * k, "ids")
    need(wts, np.float32, n * k, "wts")
    table, tokens = hashed or (None, None)
    dev.kernel("moe", "moe_route").launch((-(-n // 4),), (128,), logits, bias, n, experts, k, GATINGS[gating],
                                          int(norm_topk), F32(MOE_WEIGHT_SUM_MIN), ids, wts, F32(scale), table,
                                          tokens, stream=stream)


def moe_group(dev: Device, ids: DeviceArray, pos: DeviceArray, order: DeviceArray, tiles: DeviceArray, *, pairs: int,
              experts: int, tile: int, stream=None) -> int:
    """The pairs grouped by expert (pos, order) and cut into tiles of at most `tile` pairs of one
    expert; returns the number of tile slots written (the grouped matvec's grid)."""
    nt = max_tiles(pairs, experts, tile)
    need(tiles, np.int32, 3 * nt, "tiles")
    need(pos, np.int32, pairs, "pos")
    need(order, np.int32, pairs, "order")
    dev.kernel("moe", "moe_group").launch((1,), (1024,), ids, pairs, experts, tile, nt, pos, order, tiles,
                                          stream=stream)
    return nt


ROUTE_GROUP_MAX_ROWS = 32  # tokens moe_route_group routes in its one block (a warp each); more: two launches


def moe_route_group(dev: Device, logits: DeviceArray, s: MoeScratch, *, n: int, experts: int, k: int, gating: str,
                    norm_topk: bool, tile: int, bias: DeviceArray | None = None, scale: float = 1.0,
                    hashed: tuple[DeviceArray, DeviceArray] | None = None, stream=None) -> int:
    """moe_route then moe_group into the scratch's ids, wts, pos, order and tiles: one launch for up to
    ROUTE_GROUP_MAX_ROWS tokens (a decode step), else two. Returns the number of tile slots."""
    if n > ROUTE_GROUP_MAX_ROWS:
        moe_route(dev, logits, s.ids, s.wts, n=n, experts=experts, k=k, gating=gating, norm_topk=norm_topk, bias=bias,
                  scale=scale, hashed=hashed, stream=stream)
        return moe_group(dev, s.ids, s.pos, s.order, s.tiles, pairs=n * k, experts=experts, tile=tile, stream=stream)
    _check_routing(experts, k, gating, hashed)
    table, tokens = hashed or (None, None)
    pairs, nt = n * k, max_tiles(n * k, experts, tile)
    need(logits, np.float32, n * experts, "logits")
    need(s.ids, np.int32, pairs, "ids")
    need(s.wts, np.float32, pairs, "wts")
    need(s.tiles, np.int32, 3 * nt, "tiles")
    dev.kernel("moe", "moe_route_group").launch(
        (1,), (1024,), logits, bias, n, experts, k, GATINGS[gating], int(norm_topk), F32(MOE_WEIGHT_SUM_MIN), s.ids,
        s.wts, tile, nt, s.pos, s.order, s.tiles, F32(scale), table, tokens, stream=stream)
    return nt


def moe_matvec(dev: Device, w: ExpertMatrices, tiles: DeviceArray, n_tiles: int, x: DeviceArray, y: DeviceArray, *,
               tile: int, act: str | None = None, x_per_pair: bool = True, int8: bool = False, stream=None) -> None:
    """For every tile (expert e, first row r0, rows nb): y[r0 : r0 + nb] = x[r0 : r0 + nb] @ W_e^T (+ the
    expert's biases, w.bias), or with act, W_e = [gate; up] and y = act(x W_gate^T + b_gate) * (x W_up^T +
    b_up); x_per_pair=False (tiles of one pair): every pair reads x's one row, a single token's. int8 (tiles
    of one pair, IQ2_XXS and Q2_K, no activation): x quantized to int8 per 32 columns (qmoc8_b1). Twin:
    reference.linear per expert (with its bias), reference.gated; int8: reference.linear_q8."""
    if tile not in (1, TILE_ROWS):
        raise ValueError(f"tiles of 1 or {TILE_ROWS} rows")
    b = 1 if tile == 1 else 8
    m = w.m
    if int8 and not (act is None and tile == 1 and qmoc8_supported(w, x)):
        raise ValueError(f"the int8 grouped matvec takes tiles of one pair of {'/'.join(QMOC8_TYPES)} experts, "
                         "without an activation")
    if act is None and tile == 1 and qmoc_supported(w, x):
        threads = 32 * -(-m.cols // (32 * 32))
        dev.kernel(f"matvec_{m.type}", "qmoc8_b1" if int8 else "qmoc_b1").launch(
            (-(-w.rows // QMOC_RPB), n_tiles), (threads,), m.data, I64(m.row_bytes), I64(w.expert_bytes), w.rows,
            m.cols, tiles, x, int(x_per_pair), y, w.bias, stream=stream)
        return
    if act is None:
        dev.kernel(f"matvec_{m.type}", f"qmoe_b{b}").launch(
            (-(-w.rows // MATVEC_WARPS), n_tiles), (MATVEC_WARPS * 32,), m.data, I64(m.row_bytes),
            I64(w.expert_bytes), w.rows, m.cols, tiles, x, int(x_per_pair), y, w.bias, stream=stream)
        return
    code = act_code(act)
    dev.kernel(f"matvec_{m.type}", f"qmoeg_b{b}").launch(
        (-(-(w.rows // 2) // MATVEC_WARPS), n_tiles), (MATVEC_WARPS * 32,), m.data, I64(m.row_bytes),
        I64(w.expert_bytes), w.rows, m.cols, tiles, x, int(x_per_pair), y, code, w.bias, stream=stream)


QMOC_RPB = KERNEL_CONSTANTS["QMOC_RPB"]
QMOC_MAX_COLS = 32 * 32 * KERNEL_CONSTANTS["QMOC_MAX_WARPS"]  # a thread's 32 columns, a block's warps


def qmoc_supported(w: ExpertMatrices, x: DeviceArray) -> bool:
    """Whether the column-resident grouped matvec (matvec.cu qmoc_b1) takes these experts at batch 1: the
    low-bit types, rows of whole 32-column groups up to QMOC_MAX_COLS, x's rows 16-byte aligned."""
    return (w.m.type in LOW_BIT_TYPES and w.m.cols % 32 == 0 and w.m.cols <= QMOC_MAX_COLS
            and x.ptr % 16 == 0)


QMOC8_TYPES = ("iq2_xxs", "q2_k")  # the users' DeepSeek V4 expert types: qmoc8_b1's int8 dot products


def qmoc8_supported(w: ExpertMatrices, x: DeviceArray) -> bool:
    """Whether qmoc8_b1 (qmoc_b1 with x quantized to int8) takes these experts."""
    return w.m.type in QMOC8_TYPES and qmoc_supported(w, x)


def qgemm_supported(w: ExpertMatrices) -> bool:
    """Whether qgemm.cu decodes these experts' blocks (K in whole 32-column slices)."""
    return w.m.type in QGEMM_TYPES and w.m.cols % 32 == 0


def moe_gemm(dev: Device, w: ExpertMatrices, tiles: DeviceArray, n_tiles: int, x: DeviceArray, y: DeviceArray, *,
             tile: int, half: str = "f16", order: DeviceArray | None = None, k: int = 1, act: str | None = None,
             stream=None) -> None:
    """moe_matvec's product on the tensor cores (qgemm.cu): for every tile (expert e, first pair r0,
    pairs nb <= tile), y[r0 : r0 + nb] = x_rows @ W_e^T (+ w.bias's), or with act over the stacked [gate; up],
    act(x W_gate^T + b_gate) * (x W_up^T + b_up). x_rows: x[r0 : r0 + nb], or with `order` the tokens' own
    rows x[order[q] // k] (no gather). Inputs rounded to `half` (f16 or bf16), float32 sums.
    Twin: reference.linear per expert (with its bias), reference.gated."""
    if half not in HALF_KINDS:
        raise ValueError(f"unknown 16-bit kind {half!r} (have: {', '.join(HALF_KINDS)})")
    if tile not in QGEMM_TILES:
        raise ValueError(f"qgemm tiles of {' or '.join(map(str, QGEMM_TILES))} pairs")
    if not qgemm_supported(w):
        raise ValueError(f"no tensor-core expert matmul for {w.m.type} rows of {w.m.cols} columns")
    m = w.m
    # the biased kernels (qgemmb*) take the experts' biases and any activation; the others a dense MLP's two
    b = "b" if w.bias is not None or (act is not None and act not in KQ8_ACTIVATIONS) else ""
    if act is None:
        dev.kernel(f"qgemm_{m.type}", f"qgemm{b}_{half}_t{tile}").launch(
            (-(-w.rows // QG_ROWS), n_tiles), (256,), m.data, I64(m.row_bytes), I64(w.expert_bytes), w.rows, m.cols,
            tiles, x, order, k, y, w.bias, stream=stream)
        return
    code = act_code(act)
    dev.kernel(f"qgemm_{m.type}", f"qgemmg{b}_{half}_t{tile}").launch(
        (-(-(w.rows // 2) // (QG_ROWS // 2)), n_tiles), (256,), m.data, I64(m.row_bytes), I64(w.expert_bytes),
        w.rows, m.cols, tiles, x, order, k, y, code, w.bias, stream=stream)


def moe_mlp(dev: Device, w: MoeWeights, x: DeviceArray, y: DeviceArray, s: MoeScratch, *, n: int, k: int, act: str,
            gating: str, norm_topk: bool, res: DeviceArray | None = None, half: str | None = None,
            fused: bool = True, int8: bool = False, stream=None) -> None:
    """y[n, hidden] = res + each row through its k experts' gated MLPs, summed by the router's weights
    (one grid a launch whatever the routing: a decode step stays one graph). One token (fused): three
    launches, or four with gate and up apart (_moe_mlp_b1); else five to seven, the pairs grouped by expert.
    half ("f16"/"bf16"): from QGEMM_MIN_ROWS rows the experts' products run on the tensor cores
    (qgemm.cu, inputs in that type). int8 (fused batch 1): Q4_K/Q5_K gate|up experts take x quantized to
    int8 (kq8ge_b1_u4, dp4a), as the dense int8 matvecs do. Twin: reference.moe_mlp (+ res; int8:
    q8_inputs); without int8 the fused and the grouped batch-1 paths choose the same experts and agree to
    float32 rounding (their router matvecs sum in different orders)."""
    hidden, E = w.router.cols, w.experts
    need(x, np.float32, n * hidden, "x")
    need(y, np.float32, n * hidden, "y")
    _check_routing(E, k, gating)
    if n == 1 and fused and w.router.row_bytes % 16 == 0 and w.router.data.ptr % 16 == 0:
        _moe_mlp_b1(dev, w, x, y, s, k=k, act=act, gating=gating, norm_topk=norm_topk, res=res, int8=int8,
                    stream=stream)
        return
    matvec_rows(dev, w.router, x, s.logits, n=n, stream=stream)
    mats = [e for e in (w.gate_up, w.gate, w.up, w.down) if e is not None]
    gemm = half is not None and n >= QGEMM_MIN_ROWS and all(qgemm_supported(e) for e in mats)
    if gemm:  # tiles of 64 pairs where experts average 32 or more (prefill), else of 16 (batched decode)
        tile = QGEMM_TILES[1] if 2 * n * k >= QGEMM_TILES[1] * E else QGEMM_TILES[0]
    else:  # the grouped matvec: tiles of one pair for one token, else of 8
        tile = 1 if n == 1 else TILE_ROWS
    nt = moe_route_group(dev, s.logits, s, n=n, experts=E, k=k, gating=gating, norm_topk=norm_topk, tile=tile,
                         bias=w.router_bias, stream=stream)
    if half is not None and gemm:
        _moe_mlp_gemm(dev, w, x, s, nt, n=n, k=k, act=act, tile=tile, half=half, stream=stream)
    else:
        _moe_mlp_matvec(dev, w, x, s, nt, n=n, k=k, act=act, tile=tile, stream=stream)
    moe_combine(dev, s, y, n=n, k=k, hidden=hidden, res=res, stream=stream)


def _moe_mlp_gemm(dev: Device, w: MoeWeights, x: DeviceArray, s: MoeScratch, nt: int, *, n: int, k: int, act: str,
                  tile: int, half: str, stream=None) -> None:
    """The experts on the tensor cores, x read in place through the grouped order (no gather)."""
    pairs, ffn = n * k, w.ffn
    if w.gate_up is not None:
        moe_gemm(dev, w.gate_up, s.tiles, nt, x, s.hs, tile=tile, half=half, order=s.order, k=k, act=act,
                 stream=stream)
    else:
        gu = s.gu
        if w.gate is None or w.up is None or gu is None:
            raise ValueError("gate and up apart need both matrices and the scratch's gu")
        up = gu.view(pairs * ffn, pairs * ffn)
        moe_gemm(dev, w.gate, s.tiles, nt, x, gu, tile=tile, half=half, order=s.order, k=k, stream=stream)
        moe_gemm(dev, w.up, s.tiles, nt, x, up, tile=tile, half=half, order=s.order, k=k, stream=stream)
        gated_act(dev, gu, up, s.hs, n=pairs, ffn=ffn, act=act, stream=stream)
    moe_gemm(dev, w.down, s.tiles, nt, s.hs, s.ys, tile=tile, half=half, stream=stream)


def _moe_mlp_matvec(dev: Device, w: MoeWeights, x: DeviceArray, s: MoeScratch, nt: int, *, n: int, k: int, act: str,
                    tile: int, stream=None) -> None:
    """The experts through the grouped matvec; one token's pairs all read its row (no gather)."""
    pairs, ffn, hidden = n * k, w.ffn, w.router.cols
    xs, per_pair = (x, False) if n == 1 else (s.xs, True)
    if per_pair:
        moe_gather(dev, x, s, n=n, k=k, hidden=hidden, stream=stream)
    if w.gate_up is not None:
        moe_matvec(dev, w.gate_up, s.tiles, nt, xs, s.hs, tile=tile, act=act, x_per_pair=per_pair, stream=stream)
    else:
        gu = s.gu
        if w.gate is None or w.up is None or gu is None:
            raise ValueError("gate and up apart need both matrices and the scratch's gu")
        moe_matvec(dev, w.gate, s.tiles, nt, xs, gu, tile=tile, x_per_pair=per_pair, stream=stream)
        moe_matvec(dev, w.up, s.tiles, nt, xs, gu.view(pairs * ffn, pairs * ffn), tile=tile, x_per_pair=per_pair,
                   stream=stream)
        gated_act(dev, gu, gu.view(pairs * ffn, pairs * ffn), s.hs, n=pairs, ffn=ffn, act=act, stream=stream)
    moe_matvec(dev, w.down, s.tiles, nt, s.hs, s.ys, tile=tile, stream=stream)


def moe_gather(dev: Device, x: DeviceArray, s: MoeScratch, *, n: int, k: int, hidden: int, stream=None) -> None:
    """The pairs' inputs in grouped order: s.xs[q] = x[the token of the pair at place q] (s.order, moe_group's).
    Twin: x[order // k]."""
    need(x, np.float32, n * hidden, "x")
    dev.kernel("moe", "moe_gather").launch((n * k,), (256,), x, s.order, k, hidden, s.xs, stream=stream)


def moe_combine(dev: Device, s: MoeScratch, y: DeviceArray, *, n: int, k: int, hidden: int,
                res: DeviceArray | None = None, stream=None) -> None:
    """y[t] = res[t] + the sum over t's k pairs of their weight (s.wts) times their expert's output (s.ys at
    their place, s.pos); y may be res. Twin: reference.moe_mlp's weighted sum."""
    need(y, np.float32, n * hidden, "y")
    dev.kernel("moe", "moe_combine").launch((-(-hidden // 256), n), (256,), s.ys, s.pos, s.wts, k, hidden, res, y,
                                            stream=stream)


def _check_routing(experts: int, k: int, gating: str, hashed=None) -> None:
    if gating not in GATINGS:
        raise ValueError(f"unknown expert gating {gating!r} (have: {', '.join(GATINGS)})")
    if hashed is not None and gating != "sqrt-softplus":
        raise ValueError(f"hash routing takes its weights from sqrt-softplus gating, not {gating!r}")
    if not 0 < k <= min(experts, MOE_MAX_K) or experts > MOE_MAX_EXPERTS:
        raise ValueError(f"{k} of {experts} experts: the kernels take at most {MOE_MAX_K} of {MOE_MAX_EXPERTS}")


def moe_q8_supported(w: ExpertMatrices, act: str) -> bool:
    """Whether kq8ge_b1_u4 takes these stacked gate|up experts: Q4_K/Q5_K rows (Q6_K experts keep GGUF's
    210-byte blocks, which kq8 does not read), no biases, a dense MLP's activation."""
    return w.m.type in ("q4_k", "q5_k") and kq8_supported(w.m) and w.bias is None and act in KQ8_ACTIVATIONS


def moe_matvec_q8(dev: Device, w: ExpertMatrices, tiles: DeviceArray, n_tiles: int, x: DeviceArray,
                  y: DeviceArray, *, act: str, stream=None) -> None:
    """For every tile (expert e, pair r0, 1 pair) of one token: y[r0] = act(q8(x) W_gate_e^T) * (q8(x) W_up_e^T),
    x quantized to int8 per 32 columns (matvec_k.cu kq8ge_b1_u4). Twin: reference.gated over linear_q8."""
    if not moe_q8_supported(w, act):
        raise ValueError(f"no int8 expert matvec for {w.m.type} experts with {act} and biases {w.bias is not None}")
    m, half = w.m, w.rows // 2
    need(x, np.float32, m.cols, "x")
    need(y, np.float32, n_tiles * half, "y")
    rpb = min(KV2_MAX_RPB, kv2_rows_per_block(dev, n_tiles * w.rows, m.cols, 4))
    dev.kernel(f"matvec_k_{m.type}", "kq8ge_b1_u4").launch(
        (-(-half // (rpb // 2)), n_tiles), (32 * kv2_warps(m),), m.data, I64(m.row_bytes), I64(w.expert_bytes),
        w.rows, m.cols, tiles, x, act_code(act), y, rpb, stream=stream)


def _moe_mlp_b1(dev: Device, w: MoeWeights, x: DeviceArray, y: DeviceArray, s: MoeScratch, *, k: int, act: str,
                gating: str, norm_topk: bool, res: DeviceArray | None, int8: bool = False, stream=None) -> None:
    """One token in three launches (matvec.cu): the router's logits and, in its last block, the routing and
    the tiles (qmvs_route_b1); the chosen experts' gate|up with the activation (qmoeg_b1, tiles of one pair,
    slots best first); every chosen expert's down rows summed by their weights into res (qmoed_b1). Gate and
    up apart (their types differ): two matvecs and gated_act in place of qmoeg_b1."""
    r, hidden, ffn, E = w.router, w.router.cols, w.ffn, w.experts
    need(s.logits, np.float32, E, "logits")
    need(s.hs, np.float32, k * ffn, "hs")
    need(s.tiles, np.int32, 3 * k, "tiles")
    dev.kernel(f"matvec_{r.type}", "qmvs_route_b1").launch(
        (E,), (MATVEC_WARPS * 32,), r.data, I64(r.row_bytes), E, hidden, x, s.logits, w.router_bias, k,
        GATINGS[gating], int(norm_topk), F32(MOE_WEIGHT_SUM_MIN), s.ids, s.wts, s.tiles, s.done, stream=stream)
    if w.gate_up is not None and int8 and moe_q8_supported(w.gate_up, act):
        moe_matvec_q8(dev, w.gate_up, s.tiles, k, x, s.hs, act=act, stream=stream)
    elif w.gate_up is not None:
        moe_matvec(dev, w.gate_up, s.tiles, k, x, s.hs, tile=1, act=act, x_per_pair=False, stream=stream)
    else:
        gu = s.gu
        if w.gate is None or w.up is None or gu is None:
            raise ValueError("gate and up apart need both matrices and the scratch's gu")
        up = gu.view(k * ffn, k * ffn)
        moe_matvec(dev, w.gate, s.tiles, k, x, gu, tile=1, x_per_pair=False, stream=stream)
        moe_matvec(dev, w.up, s.tiles, k, x, up, tile=1, x_per_pair=False, stream=stream)
        gated_act(dev, gu, up, s.hs, n=k, ffn=ffn, act=act, stream=stream)
    d = w.down
    dev.kernel(f"matvec_{d.m.type}", "qmoed_b1").launch(
        (-(-hidden // MATVEC_WARPS),), (MATVEC_WARPS * 32,), d.m.data, I64(d.m.row_bytes), I64(d.expert_bytes),
        hidden, ffn, s.ids, s.wts, k, s.hs, res, y, d.bias, stream=stream)
