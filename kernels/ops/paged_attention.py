"""Launchers of attention.cu (paged decode attention: `attention` with its split policy, the fused decode
prologue `DecodePrologue`, `kv_write`, `qk_rope_kv`) and flash.cu (`flash_attention`, prefill on the
tensor cores). Twin: reference.attention per sequence (with a sink logit per head where the model has
them: gpt-oss), reference.attention_partials and attention_merge for the split-K parts and their merge,
reference.flash_rows for flash's online softmax; the prologue's twins reference.rms_norm and
reference.rope (reference.rope_tables with YaRN's scale), then the cache assignment."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..constants import ATTN_GROUPS, ATTN_HEAD_DIMS, KERNEL_CONSTANTS
from ..cuda_runtime import F32, I64, Device, DeviceArray
from .args import need

ATT_THREADS = KERNEL_CONSTANTS["ATT_THREADS"]  # attn, attn_decode: threads a CTA
ATT_SPLIT_MAX = KERNEL_CONSTANTS["ATT_SPLIT_MAX"]  # attn, attn_decode: keys a CTA at most
ATTW_SPLIT_MAX = KERNEL_CONSTANTS["ATTW_SPLIT_MAX"]  # attn_warp: keys a CTA at most
ATTW_WARPS = KERNEL_CONSTANTS["ATTW_WARPS"]  # attn_warp: warps a CTA
ATTW_CLUSTER_MAX = KERNEL_CONSTANTS["ATTW_CLUSTER_MAX"]  # attn_warp: splits merged inside one cluster, at most

_KV_NAMES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}


def kv_write(dev: Device, k: DeviceArray, v: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
             slots: DeviceArray, *, n: int, kv_heads: int, head_dim: int, ldk: int | None = None,
             ldv: int | None = None, stream=None) -> None:
    """k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i] (rows [kv_heads, head_dim], converted). Twin: the
    assignment, rounded to the cache's dtype."""
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
               ldv: int | None = None, mscale: float = 1.0, stream=None) -> None:
    """The attention prologue in one launch: per head, q and k RMS-normalised (when q_norm / k_norm
    are given) and rotated at pos (cos and sin times mscale: YaRN's); q in place, k and v into the cache
    at slots. Twin: reference.rms_norm per head, reference.rope, then the cache assignment (= rms_norm,
    rope and kv_write in sequence)."""
    kvn = _KV_NAMES.get(k_cache.dtype)
    if kvn is None or v_cache.dtype != k_cache.dtype:
        raise TypeError("the KV cache must be float16 or float32 (both halves alike)")
    if head_dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"no fused attention prologue for head_dim {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    need(pos, np.int32, n, "pos")
    need(inv_freq, np.float32, head_dim // 2, "inv_freq")
    ldq = heads * head_dim if ldq is None else ldq
    ldk = kv_heads * head_dim if ldk is None else ldk
    ldv = kv_heads * head_dim if ldv is None else ldv
    warps = min(16, heads + 2 * kv_heads)
    dev.kernel("attention", f"qk_rope_kv_{kvn}").launch(
        (n,), (32 * warps,), q, I64(ldq), k, I64(ldk), v, I64(ldv), heads, kv_heads, head_dim, q_norm, k_norm,
        F32(eps), pos, inv_freq, F32(mscale), 1 if neox else 0, k_cache, v_cache, slots, n, stream=stream)


ATT_SPLIT_MIN = 16  # a short context split this fine still fills some SMs (one CTA per kv head is latency)

ATTW_STAGE_BYTES = 128 << 10  # the K and V rows an attn_warp CTA stages in shared memory, at most
ATTW_CLUSTER_MIN_SPLIT = 32  # keys per clustered CTA, at least (a sweep on the H200: kernels/docs/code-choices.md)
ATTW_SPREAD_CTAS = 128  # attn_warp spreads short contexts over more CTAs up to a grid of about this many
ATTW_MAX_KEYS = 1024  # beyond: attn_decode (its CTAs walk up to 512 keys)
ATTW_MAX_ROW_HEADS = 64  # and beyond this many (row, kv head) pairs


def attention_warp_stage_bytes(dev: Device, head_dim: int) -> int:
    """The K and V rows an attn_warp CTA stages on this device: ATTW_STAGE_BYTES, or what the block may
    opt in to beyond attn_warp.cuh's static arrays (cs, sn, slot_s, mrg) where that is less (99 KiB
    on the RTX cards: device_caps.py)."""
    static = 4 * head_dim + 4 * ATTW_SPLIT_MAX + 4 * ATTW_WARPS * (2 + head_dim) + 1024
    return min(ATTW_STAGE_BYTES, dev.caps.smem_optin - static)


def attention_warp_cap(head_dim: int, kv_bytes: int, stage_bytes: int = ATTW_STAGE_BYTES) -> int:
    """Keys an attn_warp CTA takes at most: the K and V rows it stages in shared memory."""
    return max(1, min(ATTW_SPLIT_MAX, stage_bytes // (2 * head_dim * kv_bytes)))


def attention_split_warp(head_dim: int, kv_bytes: int, max_keys: int, pairs: int = 1,
                         stage_bytes: int = ATTW_STAGE_BYTES) -> int:
    """Keys per CTA for attn_warp: the context of each of the `pairs` (row, kv head) pairs spread over
    at most ATTW_CLUSTER_MAX CTAs (fewer once the grid passes ATTW_SPREAD_CTAS), which run as one
    thread block cluster and merge their parts in distributed shared memory (no attn_combine
    launch), at least ATTW_CLUSTER_MIN_SPLIT keys each and at most what one CTA stages in shared
    memory (ATTW_STAGE_BYTES of K and V rows: 128 keys at D 256 in float16). A single CTA over the
    whole context grows slower with it, and many streams spread over 8 CTAs each lose more than they
    gain (the H200 measurements: kernels/docs/code-choices.md)."""
    cap = attention_warp_cap(head_dim, kv_bytes, stage_bytes)
    ctas = max(1, min(ATTW_CLUSTER_MAX, ATTW_SPREAD_CTAS // max(1, int(pairs))))
    spread = max(ATTW_CLUSTER_MIN_SPLIT, -(-int(max_keys) // ctas))
    return max(1, min(cap, spread, int(max_keys)))


def attention_clustered(warp: bool, parts: int, clusters: bool = True) -> bool:
    """attn_warp's split-K parts of one (kv head, row) run as one cluster and merge themselves (where
    the device has clusters: sm_90+; else attn_combine merges them)."""
    return clusters and warp and 1 < parts <= ATTW_CLUSTER_MAX


def attention_warp_smem(head_dim: int, kv_bytes: int, split: int) -> int:
    return 2 * split * head_dim * kv_bytes


def _split(dev: Device, rows: int, kv_heads: int, max_keys: int, warp: bool, head_dim: int, kv_bytes: int) -> int:
    if warp:
        return attention_split_warp(head_dim, kv_bytes, max_keys, rows * kv_heads,
                                    attention_warp_stage_bytes(dev, head_dim))
    return attention_split(dev, rows, kv_heads, max_keys)


def decode_kernel(rows: int, kv_heads: int, max_keys: int) -> str:
    """The decode attention kernel attention(kernel="auto") runs with a prologue: attn_warp for contexts
    of up to ATTW_MAX_KEYS keys and at most ATTW_MAX_ROW_HEADS (row, kv head) pairs; beyond,
    attn_decode, whose CTAs walk longer runs of keys (faster for many streams on the H200:
    kernels/docs/code-choices.md)."""
    return "warp" if max_keys <= ATTW_MAX_KEYS and rows * kv_heads <= ATTW_MAX_ROW_HEADS else "block"


def attention_parts(dev: Device, rows: int, heads: int, kv_heads: int, max_keys: int, head_dim: int,
                    decode: bool, kv_bytes: int = 2) -> int:
    """How many split-K parts attention() makes by default (decode: with a prologue; kv_bytes: the KV
    cache's element size), which sizes the partials buffers a captured graph owns."""
    max_keys = max(1, int(max_keys))
    warp = decode and decode_kernel(rows, kv_heads, max_keys) == "warp"
    parts = -(-max_keys // _split(dev, rows, kv_heads, max_keys, warp, head_dim, kv_bytes))
    return 1 if attention_clustered(warp, parts, dev.caps.clusters) else parts


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
    mscale: float = 1.0  # YaRN's scale of every cos and sin


def attention(dev: Device, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, block_tables: DeviceArray,
              row_seq: DeviceArray, row_pos: DeviceArray, out: DeviceArray, *, rows: int, heads: int,
              kv_heads: int, head_dim: int, block_size: int, max_blocks: int, max_keys: int, window: int = 0,
              scale: float, split: int | None = None, partials: tuple[DeviceArray, DeviceArray] | None = None,
              ldq: int | None = None, prologue: DecodePrologue | None = None, kernel: str = "auto",
              sinks: DeviceArray | None = None, stream=None) -> None:
    """Paged causal GQA attention: query row i (q[i] [heads, D]) belongs to sequence row_seq[i] at
    position row_pos[i] and sees keys j <= pos (pos - j < window when window > 0) through
    block_tables[seq]. out [rows, heads, D]. sinks [heads] (float32, or None): a logit per head that
    joins each softmax's denominator (gpt-oss). Twin: reference.attention per sequence (the split-K
    parts and their merge: reference.attention_partials, attention_merge).

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
    if g not in ATTN_GROUPS or head_dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"no attention kernel for {g} query heads per kv head and head_dim {head_dim}")
    if sinks is not None:
        need(sinks, np.float32, heads, "sinks")
    if prologue is not None:
        if (prologue.q_norm is None) != (prologue.k_norm is None):
            raise ValueError("q_norm and k_norm go together")
        need(prologue.inv_freq, np.float32, head_dim // 2, "inv_freq")
        need(prologue.slots, np.int32, rows, "slots")
    max_keys = max(1, int(max_keys))
    if kernel not in ("auto", "warp", "block") or (kernel == "warp" and prologue is None):
        raise ValueError("kernel is auto, block, or (with a prologue) warp")
    warp = prologue is not None and (decode_kernel(rows, kv_heads, max_keys) == "warp" if kernel == "auto"
                                     else kernel == "warp")
    if split is None:
        split = _split(dev, rows, kv_heads, max_keys, warp, head_dim, k_cache.dtype.itemsize)
    cap = attention_warp_cap(head_dim, k_cache.dtype.itemsize, attention_warp_stage_bytes(dev, head_dim))
    split = max(1, min(int(split), cap if warp else ATT_SPLIT_MAX))
    S = -(-max_keys // split)
    ldq = ldq or heads * head_dim

    clustered = attention_clustered(warp, S, dev.caps.clusters)

    def launch(out_, acc, ml):
        grid = (kv_heads, rows, S)
        if warp:
            p = prologue
            dev.kernel("attention", f"attn_warp_d{head_dim}_g{g}_{kvn}").launch(
                grid, (32 * ATTW_WARPS,), q, I64(ldq), p.k, I64(p.ldk), p.v, I64(p.ldv), p.q_norm, p.k_norm,
                F32(p.eps), p.inv_freq, F32(p.mscale), 1 if p.neox else 0, p.slots, k_cache, v_cache, block_tables,
                max_blocks, row_seq, row_pos, heads, kv_heads, block_size, window, F32(scale), sinks, split, out_,
                acc, ml,
                smem=attention_warp_smem(head_dim, k_cache.dtype.itemsize, split), stream=stream,
                cluster=(1, 1, S) if clustered else None)
            return
        if prologue is None:
            dev.kernel("attention", f"attn_d{head_dim}_g{g}_{kvn}").launch(
                grid, (ATT_THREADS,), q, k_cache, v_cache, block_tables, max_blocks, row_seq, row_pos, heads, kv_heads,
                block_size, window, F32(scale), sinks, split, out_, acc, ml, I64(ldq), stream=stream)
            return
        p = prologue
        dev.kernel("attention", f"attn_decode_d{head_dim}_g{g}_{kvn}").launch(
            grid, (ATT_THREADS,), q, I64(ldq), p.k, I64(p.ldk), p.v, I64(p.ldv), p.q_norm, p.k_norm, F32(p.eps),
            p.inv_freq, F32(p.mscale), 1 if p.neox else 0, p.slots, k_cache, v_cache, block_tables, max_blocks,
            row_seq, row_pos, heads, kv_heads, block_size, window, F32(scale), sinks, split, out_, acc, ml,
            stream=stream)

    if S == 1 or clustered:
        launch(out, None, None)
        return
    if partials is not None:
        acc, ml = partials
        need(acc, np.float32, rows * heads * S * head_dim, "partials[0]")
        need(ml, np.float32, rows * heads * S * 2, "partials[1]")
    else:
        acc = dev.scratch("attn_acc", rows * heads * S * head_dim * 4).view_bytes(0, rows * heads * S * head_dim,
                                                                                 np.float32)
        ml = dev.scratch("attn_ml", rows * heads * S * 2 * 4).view_bytes(0, rows * heads * S * 2, np.float32)
    launch(None, acc, ml)
    dev.kernel("attention", "attn_combine").launch((heads, rows), (head_dim,), acc, ml, S, heads, head_dim, sinks,
                                                   out, stream=stream)


FLASH_ROWS = KERNEL_CONSTANTS["FLASH_ROWS"]  # query rows a tile
FLASH_HEAD_DIMS = ATTN_HEAD_DIMS
FLASH_WARPS = KERNEL_CONSTANTS["FLASH_WARPS"]


def flash_tiles(spans) -> np.ndarray:
    """The flash kernel's tiles for a step: each chunk's rows (a, b) in runs of at most 64, as int32
    (first row, row count) pairs. A chunk's rows are consecutive positions of one sequence."""
    out = [(r, min(FLASH_ROWS, b - r)) for a, b in spans for r in range(a, b, FLASH_ROWS)]
    return np.asarray(out, dtype=np.int32).reshape(-1, 2)


def flash_smem_bytes(head_dim: int) -> int:
    """flash.cu's dynamic shared memory: the tile's Q rows and two buffers of K and V tiles, in halves."""
    keys = KERNEL_CONSTANTS["FLASH_TILE_KEYS"] if head_dim <= 128 else KERNEL_CONSTANTS["FLASH_TILE_KEYS_D256"]
    return (FLASH_ROWS + 4 * keys) * (head_dim + KERNEL_CONSTANTS["FLASH_PAD"]) * 2


def flash_attention(dev: Device, q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray,
                    block_tables: DeviceArray, row_seq: DeviceArray, row_pos: DeviceArray, tiles: DeviceArray,
                    out: DeviceArray, *, n_tiles: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    max_blocks: int, window: int = 0, scale: float, ldq: int | None = None,
                    sinks: DeviceArray | None = None, stream=None) -> None:
    """Paged causal GQA attention for prefill on the tensor cores (flash.cu): the same contract as
    attention() (sinks too) for the rows that `tiles` (flash_tiles) lists, each tile consecutive
    positions of one sequence; float16 KV only. Q and the probabilities are rounded to f16 (twin:
    reference.attention, to f16 precision; reference.flash_rows its online softmax)."""
    if k_cache.dtype != np.float16 or v_cache.dtype != np.float16:
        raise TypeError("flash attention reads a float16 KV cache")
    if heads % kv_heads or head_dim not in FLASH_HEAD_DIMS:
        raise ValueError(f"no flash kernel for {heads}/{kv_heads} heads and head_dim {head_dim}")
    need(tiles, np.int32, 2 * n_tiles, "tiles")
    if sinks is not None:
        need(sinks, np.float32, heads, "sinks")
    threads = FLASH_WARPS * 32 * (2 if head_dim == 256 else 1)  # head_dim 256: two row groups (flash.cu DSPLIT)
    dev.kernel("flash", f"flash_prefill_d{head_dim}").launch(
        (n_tiles, heads), (threads,), q, I64(ldq or heads * head_dim), k_cache, v_cache, block_tables, max_blocks,
        row_seq, row_pos, tiles, heads, kv_heads, block_size, window, F32(scale * math.log2(math.e)), sinks, out,
        I64(heads * head_dim), smem=flash_smem_bytes(head_dim), stream=stream)
