"""Launchers of hyper.cu, DeepSeek V4's own pieces. Twins: worker/backends/numpy/hyper.py's hc_mix (with
the mix logits a matmul made before: see hc_pre), head's mix, hc_merge, compress, attend,
indexer_scores, indexer_top_k and clamped_swiglu; store_rows and swap_rows are numpy indexing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import KERNEL_CONSTANTS
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import need
from .quant_matrix import QuantMatrix

HC_MAX = KERNEL_CONSTANTS["HC_MAX"]
HC_THREADS = KERNEL_CONSTANTS["HC_THREADS"]
HCM_THREADS = KERNEL_CONSTANTS["HCM_THREADS"]
HC_MIX_MAX_ROWS = 16  # tokens a step at most that mix with hc_mix (more: a matmul, then hc_pre)
GRID_Y_MAX = 65535  # CUDA's bound on a grid's y dimension (the kernels that may need more stride over it)


def _check_streams(hc: int) -> None:
    if not 0 < hc <= HC_MAX:
        raise ValueError(f"{hc} residual streams: hyper.cu takes 1 to {HC_MAX}")


def _check_mix(x: DeviceArray, base: DeviceArray, y: DeviceArray, post: DeviceArray | None,
               comb: DeviceArray | None, *, n: int, hc: int, hidden: int, m: int) -> None:
    """A mix's streams, bias and outputs (hc_pre's and hc_mix's): post and comb both, or neither (a head)."""
    need(x, np.float32, n * hc * hidden, "x")
    need(base, np.float32, m, "base")
    need(y, np.float32, n * hidden, "y")
    if post is not None and comb is not None:
        need(post, np.float32, n * hc, "post")
        need(comb, np.float32, n * hc * hc, "comb")
    elif post is not None or comb is not None:
        raise ValueError("post and comb go together (neither: the head's mix)")


def hc_pre(dev: Device, x: DeviceArray, raw: DeviceArray, scale: DeviceArray, base: DeviceArray, y: DeviceArray,
           post: DeviceArray | None, comb: DeviceArray | None, *, n: int, hc: int, hidden: int, eps: float,
           hc_eps: float, iters: int, ldr: int | None = None, stream=None) -> None:
    """A hyper-connection's input mix of n tokens' streams x [n, hc, hidden]: y [n, hidden] the sublayer's
    input, post [n, hc] and comb [n, hc, hc] for hc_merge. raw [n, ldr]: x [n, hc * hidden] times the mix
    matrix [(2 + hc) * hc, hc * hidden], transposed (the RMS norm the twin applies first is a scalar per
    token, applied here). post and comb None: the output head's mix (raw [n, hc], scale [1], base [hc]).
    Twin: hyper.hc_mix (hyper.HyperStack.head's mix)."""
    _check_streams(hc)
    head = post is None
    m = hc if head else (2 + hc) * hc
    ldr = m if ldr is None else ldr
    need(raw, np.float32, (n - 1) * ldr + m, "raw")
    _check_mix(x, base, y, post, comb, n=n, hc=hc, hidden=hidden, m=m)
    dev.kernel("hyper", "hc_pre").launch((n,), (HC_THREADS,), x, raw, ldr, scale, base, n, hc, hidden, F32(eps),
                                         F32(hc_eps), iters, int(head), y, post, comb, stream=stream)


HCL_TOKENS, HCL_ROWS = KERNEL_CONSTANTS["HCL_TOKENS"], KERNEL_CONSTANTS["HCL_ROWS"]


def hc_logits(dev: Device, x: DeviceArray, fn: QuantMatrix, out: DeviceArray, *, n: int, ldo: int | None = None,
              stream=None) -> None:
    """Many tokens' mix logits for hc_pre: out [n, ldo] = x [n, fn.cols] @ fn.T, fn float32 [m, cols] (the
    mix weights), in float32. Twin: x @ fn.T (hyper.hc_mix's product before its scalar norm)."""
    if fn.type != "f32":
        raise ValueError(f"hc_logits takes float32 mix weights, not {fn.type}")
    m, K = fn.rows, fn.cols
    ldo = m if ldo is None else ldo
    need(x, np.float32, n * K, "x")
    need(out, np.float32, (n - 1) * ldo + m if n else 0, "out")
    if n:
        dev.kernel("hyper", "hc_logits").launch((-(-n // HCL_TOKENS), -(-m // HCL_ROWS)), (HC_THREADS,), x, I64(K),
                                                fn.data, I64(fn.row_bytes // 4), n, m, K, out, ldo, stream=stream)


@dataclass
class HcMixWork:
    """hc_mix's buffers for up to `rows` tokens: each block's sums, a count a token (zero between launches) and
    the tokens' pre weights. Made once (a captured step keeps their addresses)."""

    part: DeviceArray
    count: DeviceArray
    pre: DeviceArray
    rows: int

    @classmethod
    def make(cls, dev: Device, *, hc: int, hidden: int, rows: int = HC_MIX_MAX_ROWS) -> HcMixWork:
        _check_streams(hc)
        blocks = -(-hidden // HCM_THREADS)
        count = dev.empty((rows,), np.uint32)
        count.zero()
        return cls(dev.empty((rows * blocks * ((2 + hc) * hc + 1),)), count, dev.empty((rows * hc,)), rows)


def hc_mix_supported(fn: QuantMatrix, *, n: int, hc: int, hidden: int) -> bool:
    """Whether hc_mix takes these tokens' mix: float32 weights of hc * hidden columns, a step of few tokens."""
    return fn.type == "f32" and fn.cols == hc * hidden and n <= HC_MIX_MAX_ROWS


def hc_mix(dev: Device, x: DeviceArray, fn: QuantMatrix, scale: DeviceArray, base: DeviceArray, y: DeviceArray,
           post: DeviceArray | None, comb: DeviceArray | None, work: HcMixWork, *, n: int, hc: int, hidden: int,
           eps: float, hc_eps: float, iters: int, stream=None) -> None:
    """hc_pre with the mix logits made within (x [n, hc * hidden] @ fn.T, fn float32 [m, hc * hidden]), over many
    blocks (hc_mix_dots: the logits, the sums of squares and, in each token's last block, the coefficients),
    then hc_weigh: for a decode's few tokens, two launches where a matvec and hc_pre's one block a token were
    slow. post and comb None: the head's mix. Twin: hyper.hc_mix (hyper.HyperStack.head's mix)."""
    _check_streams(hc)
    head = post is None
    m = hc if head else (2 + hc) * hc
    if not hc_mix_supported(fn, n=n, hc=hc, hidden=hidden) or fn.rows != m:
        raise ValueError(f"hc_mix takes float32 mix weights [{m}, {hc * hidden}] and at most {HC_MIX_MAX_ROWS} "
                         f"tokens; got {fn.type} [{fn.rows}, {fn.cols}] and {n}")
    if n > work.rows:
        raise ValueError(f"hc_mix's work holds {work.rows} tokens; {n} asked")
    _check_mix(x, base, y, post, comb, n=n, hc=hc, hidden=hidden, m=m)
    blocks = -(-hidden // HCM_THREADS)
    dev.kernel("hyper", "hc_mix_dots").launch(
        (blocks, n), (HCM_THREADS,), x, fn.data, I64(fn.row_bytes // 4), scale, base, n, hc, hidden, F32(eps),
        F32(hc_eps), iters, int(head), work.part, work.count, work.pre, post, comb, stream=stream)
    dev.kernel("hyper", "hc_weigh").launch((-(-hidden // HC_THREADS), n), (HC_THREADS,), x, work.pre, n, hc, hidden,
                                           y, stream=stream)


def hc_merge(dev: Device, x: DeviceArray, y: DeviceArray, post: DeviceArray, comb: DeviceArray, *, n: int, hc: int,
             hidden: int, stream=None) -> None:
    """In place, the streams after a sublayer: x[t, d] = post[t, d] * y[t] + sum over s of comb[t, s, d] * x[t, s].
    Twin: hyper.hc_merge."""
    _check_streams(hc)
    need(x, np.float32, n * hc * hidden, "x")
    need(y, np.float32, n * hidden, "y")
    dev.kernel("hyper", "hc_merge").launch((-(-hidden // HC_THREADS), n), (HC_THREADS,), x, y, post, comb, n, hc,
                                           hidden, stream=stream)


def compress_rows(dev: Device, kv: DeviceArray, score: DeviceArray, rows: DeviceArray, starts: DeviceArray,
                  out: DeviceArray, *, ld: int, blocks: int, ratio: int, width: int, overlap: bool,
                  ldo: int | None = None, stream=None) -> None:
    """`blocks` compressed rows of `ratio` positions each into out [blocks, ldo]: position p's value and score
    rows are kv and score at rows[p] * ld (float offsets; kv and score may be column views of one pool);
    row b's block is the positions rows[starts[b, 0] ..][:ratio] (starts int32 [blocks, 2]). overlap (CSA):
    those rows are 2 * width wide and a block weighs the first halves of the block before it too, the
    positions rows[starts[b, 1] ..][:ratio] (-1: none, a sequence's first block). Rows of several sequences
    go in one launch, each block pointing into its own sequence's rows. Twin: hyper.compress (per sequence)."""
    ldo = width if ldo is None else ldo
    need(starts, np.int32, 2 * blocks, "starts")
    need(out, np.float32, (blocks - 1) * ldo + width, "out")
    if blocks:
        dev.kernel("hyper", "compress_rows").launch(
            (-(-width // HC_THREADS), blocks), (HC_THREADS,), kv, score, I64(ld), rows, starts, ratio, width,
            int(overlap), out, I64(ldo), stream=stream)


ATTS_MAX_KEYS = KERNEL_CONSTANTS["ATTS_MAX_KEYS"]
ATTS_MAX_D = KERNEL_CONSTANTS["ATTS_MAX_D"]


ATTS_MAX_SPLITS = 8
ATTS_SPLIT_KEYS = 64  # the fewest keys a split is given


def attend_splits(dev: Device, n: int, heads: int, ldi: int) -> int:
    """Over how many blocks attend_rows deals a (token, head)'s keys: enough for about two blocks an SM
    where the step has few rows (a decode), at least ATTS_SPLIT_KEYS keys each."""
    rows = n * heads
    if rows >= 2 * dev.sm_count:
        return 1
    return max(1, min(ATTS_MAX_SPLITS, -(-2 * dev.sm_count // rows), ldi // ATTS_SPLIT_KEYS))


def attend_rows(dev: Device, q: DeviceArray, keys: DeviceArray, idx: DeviceArray, cnt: DeviceArray,
                sinks: DeviceArray, out: DeviceArray, *, n: int, heads: int, head_dim: int, ld: int, ldi: int,
                splits: int | None = None, stream=None) -> None:
    """Attention of q [n, heads, head_dim] (head_dim a multiple of 4) over each row's own key rows, keys
    [rows, ld] (float32 or float16, ld a multiple of 4; each row the key and the value), with a sink logit
    per head: row t's keys are the rows idx[t, j] (int32 [n, ldi]; -1: none) for j < cnt[t].
    out [n, heads, head_dim]. splits: over how many blocks each (row, head)'s keys are dealt (default
    attend_splits; more than one is merged by the last). Twin: hyper.attend (with keys[idx[t]] and
    allowed = idx[t] >= 0)."""
    if not 0 < ldi <= ATTS_MAX_KEYS:
        raise ValueError(f"{ldi} keys a row: attend_rows takes 1 to {ATTS_MAX_KEYS}")
    if not 0 < head_dim <= ATTS_MAX_D or head_dim % 4:
        raise ValueError(f"head_dim {head_dim}: attend_rows takes a multiple of 4 up to {ATTS_MAX_D}")
    if ld % 4 or keys.ptr % (4 * keys.dtype.itemsize) or q.ptr % 16:
        raise ValueError("attend_rows reads 4 columns at a time: the key rows' stride must be a multiple of 4 "
                         "and the keys and q aligned to 4 elements")
    need(q, np.float32, n * heads * head_dim, "q")
    need(idx, np.int32, n * ldi, "idx")
    need(cnt, np.int32, n, "cnt")
    need(sinks, np.float32, heads, "sinks")
    need(out, np.float32, n * heads * head_dim, "out")
    splits = attend_splits(dev, n, heads, ldi) if splits is None else splits
    if not 1 <= splits <= ATTS_MAX_SPLITS:
        raise ValueError(f"splits {splits}: attend_rows takes 1 to {ATTS_MAX_SPLITS}")
    part = count = None
    if splits > 1:
        # sized for the most an automatic split needs (fewer than 2 * sm_count (row, head)s, so fewer than
        # 4 * sm_count blocks), so they are allocated once, by the first (an eager step, before any capture)
        blocks = max(4 * dev.sm_count, n * heads * splits)
        part = dev.scratch("attend_rows_part", 4 * blocks * (ATTS_MAX_D + 2))
        count = dev.scratch("attend_rows_count", 4 * max(2 * dev.sm_count, n * heads), zero=True)
    dev.kernel("hyper", f"attend_rows_{_key_kind(keys)}").launch(
        (heads, n, splits), (HC_THREADS,), q, keys, I64(ld), idx, ldi, cnt, sinks, n, heads, head_dim,
        F32(1.0 / np.sqrt(head_dim)), out, splits, part, count, stream=stream)


IDX_MAX_Q = KERNEL_CONSTANTS["IDX_MAX_Q"]
IDX_MAX_DIM = KERNEL_CONSTANTS["IDX_MAX_DIM"]


def indexer_scores(dev: Device, q: DeviceArray, w: DeviceArray, keys: DeviceArray, crow: DeviceArray,
                   ccnt: DeviceArray, score: DeviceArray, *, n: int, heads: int, dim: int, ld: int, ldc: int,
                   stream=None) -> None:
    """The lightning indexer's score [n, ldc] of each query q [n, heads, dim] (weights w [n, heads]) for the
    compressed indexer rows it sees: keys [rows, ld] (float32 or float16) at crow[t, j] (int32 [n, ldc]) for
    j < ccnt[t]. Twin: hyper.indexer_scores."""
    if heads * dim > IDX_MAX_Q or dim > IDX_MAX_DIM:
        raise ValueError(f"an indexer of {heads} heads of {dim}: indexer_scores takes {IDX_MAX_Q} floats a query, "
                         f"{IDX_MAX_DIM} a head")
    need(q, np.float32, n * heads * dim, "q")
    need(w, np.float32, n * heads, "w")
    need(crow, np.int32, n * ldc, "crow")
    need(ccnt, np.int32, n, "ccnt")
    need(score, np.float32, n * ldc, "score")
    warps = HC_THREADS // 32
    dev.kernel("hyper", f"indexer_scores_{_key_kind(keys)}").launch(
        (-(-ldc // warps), n), (HC_THREADS,), q, w, keys, I64(ld), crow, ldc, ccnt, n, heads, dim, score,
        stream=stream)


def top_k_rows(dev: Device, score: DeviceArray, crow: DeviceArray, ccnt: DeviceArray, idx: DeviceArray,
               cnt: DeviceArray, *, n: int, k: int, ldc: int, ldi: int, stream=None) -> None:
    """Appends to each query's key rows idx [n, ldi] (cnt[t] of them so far; cnt grows) the rows crow[t, j]
    of its k best scores score[t, j < ccnt[t]] (all of them where it has no more than k); ties at the k-th
    value go to the first j. Twin: hyper.indexer_top_k (which breaks ties its own way)."""
    need(score, np.float32, n * ldc, "score")
    need(crow, np.int32, n * ldc, "crow")
    need(idx, np.int32, n * ldi, "idx")
    need(cnt, np.int32, n, "cnt")
    dev.kernel("hyper", "top_k_rows").launch((n,), (HC_THREADS,), score, crow, ldc, ccnt, k, idx, ldi, cnt, n,
                                             stream=stream)


def store_rows(dev: Device, src: DeviceArray, idx: DeviceArray, dst: DeviceArray, *, n: int, width: int,
               lds: int, ldd: int, ape: tuple[DeviceArray, DeviceArray, int] | None = None, stream=None) -> None:
    """dst[idx[t] * ldd : + width] = src[t * lds : + width] for t < n (the pool's rows at a step's slots; dst may
    be a column view of it), with ape = (table [ratio, width], pos [n] int32, ratio): + table[pos[t] % ratio]
    (a compressor's score rows). Twin: numpy's dst[idx] = src (+ table[pos % ratio])."""
    need(idx, np.int32, n, "idx")
    need(src, np.float32, (n - 1) * lds + width if n else 0, "src")
    table, pos, ratio = ape or (None, None, 1)
    if table is not None and pos is not None:
        need(table, np.float32, ratio * width, "ape")
        need(pos, np.int32, n, "pos")
    if n:
        dev.kernel("hyper", "store_rows").launch((-(-width // HC_THREADS), min(n, GRID_Y_MAX)), (HC_THREADS,), src,
                                                 I64(lds), idx, dst, I64(ldd), n, width, table, pos, ratio,
                                                 stream=stream)


def clamped_swiglu(dev: Device, g: DeviceArray, u: DeviceArray, out: DeviceArray, *, n: int, ffn: int, limit: float,
                   ldg: int | None = None, ldu: int | None = None, ldo: int | None = None, stream=None) -> None:
    """out = silu(min(g, limit)) * clamp(u, -limit, limit) over [n, ffn] (limit 0: unclamped), row strides ldg,
    ldu, ldo (ffn where not given). Twin: worker/backends/numpy/hyper.py's clamped_swiglu."""
    ldg, ldu, ldo = (ffn if v is None else v for v in (ldg, ldu, ldo))
    need(out, np.float32, (n - 1) * ldo + ffn if n else 0, "out")
    blocks = max(1, min(-(-n * ffn // HC_THREADS), dev.sm_count * 16))
    dev.kernel("hyper", "clamped_swiglu").launch((blocks,), (HC_THREADS,), g, I64(ldg), u, I64(ldu), out, I64(ldo),
                                                 n, ffn, F32(limit), stream=stream)


def swap_rows(dev: Device, src: DeviceArray, dst: DeviceArray, *, a: int, b: int, width: int, stream=None) -> None:
    """dst [b, a, width] = src [a, b, width] with its first two axes swapped. Twin: numpy's swapaxes(0, 1)."""
    need(src, np.float32, a * b * width, "src")
    need(dst, np.float32, a * b * width, "dst")
    if a * b:
        dev.kernel("hyper", "swap_rows").launch((-(-width // HC_THREADS), min(a * b, GRID_Y_MAX)), (HC_THREADS,), src,
                                                dst, a, b, width, stream=stream)


def mean_streams(dev: Device, x: DeviceArray, out: DeviceArray, *, n: int, hc: int, hidden: int, ldo: int | None = None,
                 stream=None) -> None:
    """out[t] = the mean of token t's hc streams, x [n, hc, hidden]; out rows at stride ldo (hidden where not
    given). Twin: numpy's x.mean(axis=1)."""
    ldo = hidden if ldo is None else ldo
    need(x, np.float32, n * hc * hidden, "x")
    need(out, np.float32, (n - 1) * ldo + hidden if n else 0, "out")
    if n:
        dev.kernel("hyper", "mean_streams").launch((-(-hidden // HC_THREADS), n), (HC_THREADS,), x, n, hc, hidden, out,
                                                   I64(ldo), stream=stream)


def round_half(dev: Device, x: DeviceArray, *, n: int, stream=None) -> None:
    """x[:n] rounded to the nearest float16, in place (float32 still). Twin: x.astype(float16).astype(float32)."""
    need(x, np.float32, n, "x")
    if n:
        blocks = max(1, min(-(-n // HC_THREADS), dev.sm_count * 8))
        dev.kernel("hyper", "round_half").launch((blocks,), (HC_THREADS,), x, I64(n), stream=stream)


def _key_kind(keys: DeviceArray) -> str:
    kind = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(keys.dtype)
    if kind is None:
        raise TypeError(f"keys must be float32 or float16, not {keys.dtype.name}")
    return kind
