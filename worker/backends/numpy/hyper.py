"""DeepSeek V4's layer stack (recipe.Stack.HYPER) on the numpy backend: the readable reference.

Computed as llama.cpp's deepseek4 graph computes it (its oracle): hyper-connections around every
attention and MLP (several residual streams, mixed by a Sinkhorn-normalised matrix per token), low-rank
queries, one KV head that is key and value at once with RoPE on its last dimensions (undone on the
output), a sliding window in every layer plus, by the layer's compress ratio, compressed rows: CSA
(ratio 4, blocks overlapping their predecessor, of which a lightning indexer picks the top k for each
query) or HCA (ratio 128, all of them). The MLP is routed experts (hash-routed by token id in the first
layers) plus a shared expert, with clamped SwiGLUs.

The KV pool holds per position each layer's key row and the compressors' value and score rows (the
indexer's too), and the compressed rows themselves, made once: when a step computes the last position
of a compress block, its row (normed, RoPE at the block's first position) is stored spread over the
block's last `spread(ratio, block_size)` positions, a piece in each position's row, all in one pool
block. A compressed row is a pure function of the positions of its block (and, for CSA, the block
before), so every pool row still belongs to one position, as a dense model's K and V do: prefix
caching, block files and restores work unchanged (kv_layout names the layout), and a block is whole
once its positions are. A row's pieces are read only once its block is complete, so a block copied for
a truncation may carry stale pieces of an open block until that block closes and overwrites them.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from ember.kernels import reference as ops

from ...model.config import HyperConfig, ModelConfig, Yarn
from ...model.rope import yarn_factors
from ...model.weights import ModelWeights
from ..base import SeqChunk, chunk_logits, step_rows

CSA, HCA = 4, 128  # the compress ratios llama.cpp knows (0: window only)

# -- the pieces -----------------------------------------------------------------------------------


def _norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    return ops.rms_norm(x, np.ones(x.shape[-1], np.float32) if weight is None else weight, eps)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def rope_frequencies(base: float, n_rot: int, yarn: Yarn | None = None) -> np.ndarray:
    """The inverse frequencies of the n_rot / 2 rotated pairs (float64), with YaRN's per-pair multipliers
    where given. Their cos and sin stay unscaled: llama.cpp's deepseek4 passes YaRN an attention factor
    of 1 / (1 + 0.1 ln factor), which cancels the magnitude YaRN would give them."""
    inv = base ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)
    return inv if yarn is None else inv * yarn_factors(n_rot, base, yarn)[0]


def rope_tail(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """RoPE on the last 2 * len(inv_freq) dimensions, adjacent pairs rotated (llama.cpp's NORMAL type with
    an offset); x [n, ..., dim], pos [n]. inverse: rotate back (the attention output's de-rotation)."""
    n_rot = 2 * len(inv_freq)
    theta = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [n, n_rot/2]
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    if inverse:
        sin = -sin
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (n_rot // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    out = x.copy()
    tail = x[..., x.shape[-1] - n_rot :]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    out[..., x.shape[-1] - n_rot :: 2] = x0 * cos - x1 * sin
    out[..., x.shape[-1] - n_rot + 1 :: 2] = x0 * sin + x1 * cos
    return out


def hc_mix(x: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, h: HyperConfig,
           eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A hyper-connection's input mix: (the layer's input [n, hidden], post [n, hc], comb [n, src, dst]).
    x [n, hc, hidden]; fn [(2 + hc) * hc, hc * hidden] turns the normalised streams into the mix logits."""
    n, hc = x.shape[0], h.hc_mult
    mixes = _norm(x.reshape(n, -1), eps) @ fn.T
    pre = _sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + np.float32(h.hc_eps)
    post = 2.0 * _sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(n, hc, hc)  # [n, src, dst]
    # Sinkhorn: a softmax over each source's destinations, then columns and rows normalised in turn
    comb = ops.softmax(comb, axis=2) + np.float32(h.hc_eps)
    comb = comb / (comb.sum(axis=1, keepdims=True) + np.float32(h.hc_eps))
    for _ in range(1, h.hc_sinkhorn_iters):
        comb = comb / (comb.sum(axis=2, keepdims=True) + np.float32(h.hc_eps))
        comb = comb / (comb.sum(axis=1, keepdims=True) + np.float32(h.hc_eps))
    return np.einsum("nse,ns->ne", x, pre), post, comb


def hc_merge(y: np.ndarray, residual: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The streams after a sublayer: stream d = post[d] * y + sum over s of comb[s, d] * residual[s]."""
    return post[:, :, None] * y[:, None, :] + np.einsum("nse,nsd->nde", residual, comb)


def compress(kv: np.ndarray, score: np.ndarray, ratio: int, n_blocks: int, overlap: bool) -> np.ndarray:
    """n_blocks compressed rows from per-position compressor rows kv, score [positions, width]: each
    block's positions softmax-weighted per dimension by their scores. overlap (CSA): rows are two halves,
    and a block also weighs the first halves of the block before it (none before the first)."""
    if n_blocks == 0:
        return np.zeros((0, kv.shape[1] // (2 if overlap else 1)), np.float32)
    kv = kv[: n_blocks * ratio].reshape(n_blocks, ratio, -1)
    score = score[: n_blocks * ratio].reshape(n_blocks, ratio, -1)
    if overlap:
        d = kv.shape[2] // 2
        prev_kv = np.concatenate([np.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]])
        prev_score = np.concatenate([np.full_like(score[:1, :, :d], -np.inf), score[:-1, :, :d]])
        kv = np.concatenate([prev_kv, kv[:, :, d:]], axis=1)
        score = np.concatenate([prev_score, score[:, :, d:]], axis=1)
    return (kv * ops.softmax(score, axis=1)).sum(axis=1)


def indexer_scores(iq: np.ndarray, iw: np.ndarray, ik: np.ndarray) -> np.ndarray:
    """The lightning indexer's score [n, rows] of each query for each compressed indexer row ik [rows, dim]:
    the sum over its heads of weight iw [n, heads] times relu(iq [n, heads, dim] . row)."""
    return np.einsum("nhk,nh->nk", np.maximum(np.einsum("nhd,kd->nhk", iq, ik), 0), iw)


def indexer_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The k compressed rows of highest indexer score per query, a tie at the k-th score to the earlier rows
    (as the kernel's select: scores tie often, at 0, where every head's relu is)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    if limit > 1e-6:
        gate, up = np.minimum(gate, np.float32(limit)), np.clip(up, -limit, limit)
    return ops.silu(gate) * up


def attend(q: np.ndarray, keys: np.ndarray, allowed: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Attention of queries q [n, heads, d] over key rows [k, d] (the values too) where allowed [n, k], a
    learned sink logit per head joining each softmax's denominator."""
    logits = np.einsum("nhd,kd->nhk", q, keys) * np.float32(1.0 / np.sqrt(q.shape[-1]))
    logits = np.where(allowed[:, None, :], logits, -np.inf)
    top = np.maximum(logits.max(axis=2), sinks[None, :])
    p = np.exp(logits - top[:, :, None])
    p /= (p.sum(axis=2) + np.exp(sinks[None, :] - top))[:, :, None]
    return np.einsum("nhk,kd->nhd", p, keys)


# -- the stack ------------------------------------------------------------------------------------


class NextTokenRows(Protocol):
    """The next-token layer's part in a trunk's pass (mtp.MtpHead): its rows of the positions computed."""

    def write_rows(self, x: np.ndarray, tokens: np.ndarray, positions: np.ndarray, chunks: list[SeqChunk],
                   spans: list[tuple[int, int]], slots: np.ndarray, rows: np.ndarray) -> None: ...


class FeatureRows(Protocol):
    """A block drafter's part in a trunk's pass (dspark.DSparkHead): its rows of the positions computed, from
    the mean of the streams entering the trunk layers it reads (n_layers: the streams after the last)."""

    target_layers: tuple[int, ...]

    def write_rows(self, features: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None: ...


class HyperStack:
    """The weights, the per-position pool and the forward pass of a HYPER model."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, n_blocks: int, block_size: int,
                 mtp: bool = False, drafter_width: int = 0):
        """mtp: the pool also keeps what the next-token layer drafts from (its columns); the layer itself
        (mtp.MtpHead, which the backend attaches as `mtp`) writes them after each pass. drafter_width: the
        pool also keeps that many columns a position for a block drafter (dspark.DSparkHead, attached as
        `dspark`), which it writes from the trunk's features during each pass."""
        assert config.hyper is not None and config.family.hyper is not None
        self.config, self.h, self.w = config, config.hyper, weights.by_name
        # the family's tensor names (arch/<family>.py): the stack's own roles beside the generic ones
        self.tensors, self.model_names = config.family.tensors, config.family.hyper.model
        self.layer_names = {**self.tensors.layer, **config.family.hyper.layer}
        self.block_size, self.n_blocks = block_size, n_blocks
        # window-only layers turn at the model's base; compressed layers, their rows and the indexer at the
        # compressed base, with the file's YaRN (llama.cpp's deepseek4: YaRN on the compressed ropes only)
        self.rope_window = rope_frequencies(config.rope_base, self.h.n_rot)
        self.rope_compressed = rope_frequencies(self.h.compress_rope_base, self.h.n_rot, config.rope_yarn)
        self.columns = self.layout(config, block_size, mtp, drafter_width)
        self.pool = np.zeros((n_blocks, block_size, self.width(config, block_size, mtp, drafter_width)), np.float32)
        self.mtp: NextTokenRows | None = None
        self.dspark: FeatureRows | None = None

    @staticmethod
    def spread(ratio: int, block_size: int) -> int:
        """Over how many positions a compressed row of `ratio` is stored: its block's last ones, aligned to
        their count, so that they lie in one pool block (the one its block closes in)."""
        return math.gcd(ratio, block_size)

    @classmethod
    def layout(cls, config: ModelConfig, block_size: int, mtp: bool = False,
               drafter_width: int = 0) -> list[dict[str, slice]]:
        """Per layer, the pool columns of each per-position row: kv (the key/value row), and by the
        layer's ratio the compressor's (c_kv, c_score) and the indexer's (i_kv, i_score) rows, and this
        position's piece of its compressed rows (c_row, i_row; see the module docstring). mtp: one more
        entry, the next-token layer's: its kv row, and h, the trunk's output streams at the position
        (what the next position's row, and a draft from there, are made of). drafter_width: one more
        entry, a block drafter's: its key rows (drafter), drafter_width floats."""
        h = config.hyper
        assert h is not None
        d, di, at, out = config.head_dim, h.indexer_dim, 0, []
        for r in {r for r in h.compress_ratios if r}:
            s = cls.spread(r, block_size)
            if d % s or (r == CSA and di % s):
                raise ValueError(f"a compressed row of {d} (indexer {di}) values does not split over {s} positions")
        kinds: list[int | str | None] = [*h.compress_ratios, *([None] if mtp else []),
                                         *(["drafter"] if drafter_width else [])]
        for ratio in kinds:
            widths = {"kv": d}
            if ratio == "drafter":
                widths = {"drafter": drafter_width}
            elif ratio is None:
                widths |= {"h": h.hc_mult * config.hidden}
            elif ratio == CSA:
                s = cls.spread(ratio, block_size)
                widths |= {"c_kv": 2 * d, "c_score": 2 * d, "i_kv": 2 * di, "i_score": 2 * di,
                           "c_row": d // s, "i_row": di // s}
            elif ratio == HCA:
                widths |= {"c_kv": d, "c_score": d, "c_row": d // cls.spread(ratio, block_size)}
            cols = {}
            for name, n in widths.items():
                cols[name], at = slice(at, at + n), at + n
            out.append(cols)
        return out

    @classmethod
    def width(cls, config: ModelConfig, block_size: int, mtp: bool = False, drafter_width: int = 0) -> int:
        return max(c.stop for layer in cls.layout(config, block_size, mtp, drafter_width) for c in layer.values())

    def _t(self, layer: int, role: str) -> np.ndarray:
        return self.w[f"blk.{layer}.{self.layer_names[role]}"]

    # -- forward ----------------------------------------------------------------------------------

    def logits(self, chunks: list[SeqChunk]) -> list[np.ndarray | None]:
        cfg, h, w = self.config, self.h, self.w
        eps = cfg.norm_eps
        tokens, positions, spans, slots = step_rows(chunks, self.block_size, self.n_blocks)
        rows = self.pool.reshape(-1, self.pool.shape[-1])

        x = np.repeat(np.asarray(w[self.tensors.token_embd][tokens], np.float32)[:, None, :], h.hc_mult, axis=1)
        taps = self.dspark.target_layers if self.dspark is not None else ()
        features: dict[int, np.ndarray] = {}  # the block drafter's: the mean of the streams entering a layer
        for li in range(cfg.n_layers):
            if li in taps:
                features[li] = x.mean(axis=1)
            a, post, comb = hc_mix(x, self._t(li, "attn_mix_fn"), self._t(li, "attn_mix_scale"),
                                   self._t(li, "attn_mix_base"), h, eps)
            a = self._attention(li, _norm(a, eps, self._t(li, "attn_norm")), positions, chunks, spans,
                                slots, rows)
            x = hc_merge(a, x, post, comb)
            m, post, comb = hc_mix(x, self._t(li, "ffn_mix_fn"), self._t(li, "ffn_mix_scale"),
                                   self._t(li, "ffn_mix_base"), h, eps)
            x = hc_merge(self.mlp(li, _norm(m, eps, self._t(li, "ffn_norm")), tokens), x, post, comb)

        if self.mtp is not None:  # the next-token layer's rows of these positions (they depend on nothing later)
            self.mtp.write_rows(x, tokens, positions, chunks, spans, slots, rows)
        if self.dspark is not None:  # the block drafter's rows of these positions (the same)
            features[cfg.n_layers] = x.mean(axis=1)
            self.dspark.write_rows(np.concatenate([features[t] for t in taps], axis=1), positions, slots, rows)
        return chunk_logits(chunks, spans, x, self.head)

    def head(self, streams: np.ndarray, norm: str | None = None, out: str | None = None,
             mix: tuple[str, str, str] | None = None) -> np.ndarray:
        """Logits from the streams [n, hc, hidden]: mixed into one by the head's own weights, normed, projected.
        norm, out, mix: other tensors for the norm, the projection and the mix's (fn, scale, base), by full
        name (the next-token layer's, where its file has its own)."""
        w, eps = self.w, self.config.norm_eps
        y = self.head_mix(streams, mix)
        return ops.linear(_norm(y, eps, w[norm or self.tensors.output_norm]), w[out or self.tensors.output])

    def head_mix(self, streams: np.ndarray, mix: tuple[str, str, str] | None = None) -> np.ndarray:
        """The head's mix of the streams [n, hc, hidden] into one [n, hidden], before its norm (what a block
        drafter's confidence head reads)."""
        w, h, eps, model = self.w, self.h, self.config.norm_eps, self.model_names
        fn, scale, base = (w[n] for n in mix or (model["output_mix_fn"], model["output_mix_scale"],
                                                 model["output_mix_base"]))
        mixes = _norm(streams.reshape(len(streams), -1), eps) @ fn.T
        pre = _sigmoid(mixes * scale[0] + base) + np.float32(h.hc_eps)
        return np.einsum("nse,ns->ne", streams, pre)

    def _attention(self, li: int, x: np.ndarray, positions: np.ndarray, chunks: list[SeqChunk],
                   spans: list[tuple[int, int]], slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        cfg, h, t = self.config, self.h, self._t
        d, n_head, n = cfg.head_dim, cfg.n_heads, len(x)
        ratio, cols = h.compress_ratios[li], self.columns[li]
        freqs = self.rope_compressed if ratio else self.rope_window

        qr, q = self.query(li, x, positions, freqs)
        rows[slots, cols["kv"]] = self.key(li, x, positions, freqs)
        if ratio:
            rows[slots, cols["c_kv"]] = x @ t(li, "compressor_kv").T
            rows[slots, cols["c_score"]] = (x @ t(li, "compressor_gate").T
                                            + t(li, "compressor_ape")[positions % ratio])
        if ratio == CSA:
            rows[slots, cols["i_kv"]] = x @ t(li, "indexer_compressor_kv").T
            rows[slots, cols["i_score"]] = (x @ t(li, "indexer_compressor_gate").T
                                            + t(li, "indexer_compressor_ape")[positions % ratio])
            iq = (qr @ t(li, "indexer_q_b").T).reshape(n, h.indexer_heads, h.indexer_dim)
            iq = rope_tail(iq, positions, self.rope_compressed)
            iw = (x @ t(li, "indexer_proj").T) / np.float32(np.sqrt(h.indexer_dim * h.indexer_heads))

        sinks = t(li, "sinks")
        out = np.empty((n, n_head, d), np.float32)
        for c, (a, b) in zip(chunks, spans, strict=True):
            end = c.start + len(c.tokens)
            pos = positions[a:b]
            # the window: keys at positions p - window < p' <= p
            first = max(0, c.start - h.window + 1)
            keys = rows[self._pool_rows(c, np.arange(first, end)), cols["kv"]]
            kpos = np.arange(first, end)
            allowed = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - h.window)
            if ratio:
                self._close_blocks(li, c, rows)
                n_comp = end // ratio
                comp = self._compressed_rows(c, ratio, n_comp, rows, cols["c_row"])
                visible = np.arange(n_comp)[None, :] < ((pos + 1) // ratio)[:, None]  # whole blocks up to p
                if ratio == CSA:
                    ik = self._compressed_rows(c, ratio, n_comp, rows, cols["i_row"])
                    visible &= self._indexer_pick(ik, iq[a:b], iw[a:b], visible)
                keys = np.concatenate([keys, comp])
                allowed = np.concatenate([allowed, visible], axis=1)
            out[a:b] = attend(q[a:b], keys, allowed, sinks)
        return self.output(li, out, positions, freqs)

    def _pool_rows(self, c: SeqChunk, seq: np.ndarray) -> np.ndarray:
        """The pool rows of a chunk's sequence's positions `seq`."""
        table = np.asarray(c.block_table, np.int64)
        return table[seq // self.block_size] * self.block_size + seq % self.block_size

    def _spread_rows(self, c: SeqChunk, ratio: int, blocks: np.ndarray) -> np.ndarray:
        """The pool rows holding the pieces of compress blocks `blocks`, block after block (module docstring)."""
        s = self.spread(ratio, self.block_size)
        seq = (blocks[:, None] + 1) * ratio - s + np.arange(s)[None, :]
        return self._pool_rows(c, seq.reshape(-1))

    def _close_blocks(self, li: int, c: SeqChunk, rows: np.ndarray) -> None:
        """The compressed rows of the compress blocks whose last position this chunk computes, made from the
        pool's per-position rows (those of the step written already) and stored spread over their positions."""
        ratio, cols, t = self.h.compress_ratios[li], self.columns[li], self._t
        end = c.start + len(c.tokens)
        b0, b1 = c.start // ratio, end // ratio
        if b1 <= b0:
            return
        lead = 1 if ratio == CSA and b0 > 0 else 0  # CSA: the block before weighs in
        past = rows[self._pool_rows(c, np.arange((b0 - lead) * ratio, b1 * ratio))]
        firsts = np.arange(b0, b1) * ratio
        made = [("c_kv", "c_score", "c_row", "compressor_norm")]
        if ratio == CSA:
            made.append(("i_kv", "i_score", "i_row", "indexer_compressor_norm"))
        spread = self._spread_rows(c, ratio, np.arange(b0, b1))
        for kv, score, piece, norm in made:
            comp = compress(past[:, cols[kv]], past[:, cols[score]], ratio, b1 - b0 + lead, ratio == CSA)[lead:]
            comp = rope_tail(_norm(comp, self.config.norm_eps, t(li, norm)), firsts, self.rope_compressed)
            width = cols[piece].stop - cols[piece].start
            rows[spread, cols[piece]] = comp.reshape(-1, width)

    def _compressed_rows(self, c: SeqChunk, ratio: int, n_comp: int, rows: np.ndarray, piece: slice) -> np.ndarray:
        """A chunk's sequence's first n_comp compressed rows [n_comp, width], their pieces read from the pool."""
        got = rows[self._spread_rows(c, ratio, np.arange(n_comp)), piece]
        return got.reshape(n_comp, (piece.stop - piece.start) * self.spread(ratio, self.block_size))

    # the attention's pieces, shared with the next-token layer (mtp.py)

    def query(self, li: int, x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the low-rank query qr [n, rank], which the indexer reads too; the heads [n, heads, head_dim])."""
        cfg, t, eps = self.config, self._t, self.config.norm_eps
        qr = _norm(x @ t(li, "q_a").T, eps, t(li, "q_a_norm"))
        q = _norm((qr @ t(li, "q_b").T).reshape(len(x), cfg.n_heads, cfg.head_dim), eps)
        return qr, rope_tail(q, positions, freqs)

    def key(self, li: int, x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
        """The single KV head's row of each position (the key, and the value too)."""
        t, eps = self._t, self.config.norm_eps
        return rope_tail(_norm(x @ t(li, "kv").T, eps, t(li, "kv_norm")), positions, freqs)

    def output(self, li: int, out: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
        """The heads' outputs [n, heads, head_dim], their RoPE undone, through the grouped low-rank projection."""
        h, t, n = self.h, self._t, len(out)
        out = rope_tail(out, positions, freqs, inverse=True)
        # grouped low-rank output: each group of heads through its own [rank, group width] matrix
        groups = out.reshape(n, h.o_groups, -1)
        wo_a = t(li, "o_a").reshape(h.o_groups, h.o_lora_rank, -1)
        oa = np.einsum("ngi,gri->ngr", groups, wo_a).reshape(n, -1)
        return oa @ t(li, "o_b").T

    def _indexer_pick(self, ik: np.ndarray, iq: np.ndarray, iw: np.ndarray, visible: np.ndarray) -> np.ndarray:
        """The lightning indexer: each query's top k visible compressed rows, by sum over the indexer's
        heads of weight * relu(q . k) against its own compressed keys ik [rows, indexer_dim]."""
        h, n_comp = self.h, visible.shape[1]
        score = indexer_scores(iq, iw, ik)
        picked = np.zeros_like(visible)
        k = min(h.indexer_top_k, n_comp)
        if k:
            np.put_along_axis(picked, indexer_top_k(np.where(visible, score, -np.inf), k), True, axis=1)
        return picked

    def mlp(self, li: int, x: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        cfg, h, t = self.config, self.h, self._t
        # sqrt(softplus(logit)) per expert: the first layers routed by the token id, the others by the top k
        # of it plus a selection bias (the weights stay unbiased)
        hashed = li < h.hash_layers
        chosen, weights = ops.route(x @ t(li, "router").T, k=cfg.n_experts_used, gating="sqrt-softplus",
                                    norm_topk=h.expert_weights_norm, scale=h.expert_weights_scale,
                                    select_bias=None if hashed else t(li, "router_select_bias"),
                                    chosen=t(li, "token_to_experts")[tokens] if hashed else None)
        gate, up, down = t(li, "gate_exps"), t(li, "up_exps"), t(li, "down_exps")
        out = np.zeros_like(x)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            xe = x[rows]
            y = clamped_swiglu(xe @ gate[e].T, xe @ up[e].T, h.swiglu_clamp_exp[li]) @ down[e].T
            np.add.at(out, rows, y * weights[rows, slot][:, None])
        shared = clamped_swiglu(x @ t(li, "shared_gate").T, x @ t(li, "shared_up").T,
                                h.swiglu_clamp_shexp[li])
        return out + shared @ t(li, "shared_down").T
