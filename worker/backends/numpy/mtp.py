"""DeepSeek V4's next-token (MTP) layer on the numpy backend: the readable reference of llama.cpp's
deepseek4 MTP graph, and what `--spec mtp` drafts with (engine/spec/mtp_drafter.py).

The layer (blk.{n_layers}: its nextn.* tensors and a block's attention and MoE tensors) guesses the
token after next. At position p it takes the trunk's output streams at p - 1 (h, each stream normed by
nextn.hnorm) and the embedding of the token at p (normed by nextn.enorm, the same for every stream),
projects each stream's [embedding, h] through nextn.eh_proj, and runs one block as the trunk runs its
own: hyper-connections, an attention over the sliding window only (with sinks), learned routing with
the shared expert. The model's head (its hyper-connection mix, then nextn.shared_head_norm and
nextn.shared_head_head where the file has them, else the output norm and matrix) gives its logits,
and its output streams stand in for the trunk's h at the next step of a longer draft. A layer read from
its own file (--spec mtp:PATH, model/mtp_file.py) brings that file's embedding, output norm and matrix
and hyper-connection head, under "mtp." names where they are not the trunk's: llama.cpp's MTP graph
reads them from the model it runs on, which is then that file.

Its attention reads this layer's key rows over the window. The trunk's forward pass writes them into
the pool with every position it computes (HyperStack.columns[n_layers]: at position p the layer's key
row, made of the trunk's h at p - 1 and the token at p, and the trunk's h at p for the row after it).
So they are, as every pool row, a function of the prefix alone: a draft's own rows never enter the
pool, a refused guess's row is written over when its position is computed for real, and prefix
caching and block files carry them with the rest.
"""

from __future__ import annotations

import numpy as np

from ember.kernels import reference as ops

from ...model.mtp_file import OWN
from ..base import SeqChunk
from .hyper import HyperStack, attend, hc_merge, hc_mix


class MtpHead:
    """The first next-token layer of a HYPER stack (llama.cpp drafts with one: its graph asserts it)."""

    def __init__(self, stack: HyperStack):
        cfg, h = stack.config, stack.h
        if h.nextn_layers < 1:
            raise ValueError("the model has no next-token (MTP) layer")
        self.s, self.li = stack, cfg.n_layers
        self.cols = stack.columns[cfg.n_layers]
        w, nextn = stack.w, f"blk.{cfg.n_layers}.nextn."

        def pick(*names: str) -> str:  # the first the weights hold (the last always is)
            return next(n for n in names if n in w)

        t, model = stack.tensors, stack.model_names
        self.embd = w[pick(nextn + "embed_tokens.weight", OWN + t.token_embd, t.token_embd)]
        self.head_norm = pick(nextn + "shared_head_norm.weight", OWN + t.output_norm, t.output_norm)
        self.head_out = pick(nextn + "shared_head_head.weight", OWN + t.output, t.output)
        fn, scale, base = (pick(OWN + model[role], model[role])
                           for role in ("output_mix_fn", "output_mix_scale", "output_mix_base"))
        self.hc_head = (fn, scale, base)

    @property
    def block_size(self) -> int:
        return self.s.block_size

    def _t(self, name: str) -> np.ndarray:
        return self.s.w[f"blk.{self.li}.{name}"]

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return ops.rms_norm(x, weight, self.s.config.norm_eps)

    def _input(self, h_prev: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The layer's input streams [n, hc, hidden] from the trunk's streams before each position
        h_prev [n, hc, hidden] and the token at it."""
        hc = self.s.h.hc_mult
        e = self._norm(np.asarray(self.embd[tokens], np.float32), self._t("nextn.enorm.weight"))
        hn = self._norm(h_prev, self._t("nextn.hnorm.weight"))
        both = np.concatenate([np.repeat(e[:, None, :], hc, axis=1), hn], axis=2)  # [n, hc, 2 * hidden]
        return both @ self._t("nextn.eh_proj.weight").T

    def _attn_input(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self._t
        a, post, comb = hc_mix(x, t("hc_attn_fn.weight"), t("hc_attn_scale.weight"), t("hc_attn_base.weight"),
                               self.s.h, self.s.config.norm_eps)
        return self._norm(a, t("attn_norm.weight")), post, comb

    def _key(self, a: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.s.key(self.li, a, positions, self.s.rope_window)  # a window-only layer: no YaRN

    def _block(self, x: np.ndarray, tokens: np.ndarray, positions: np.ndarray, keys: np.ndarray,
               kpos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block over input streams x at positions, attending over key rows `keys` at kpos (those
        before, which this pass's own rows join): (its output streams, its own key rows)."""
        s, t, freqs = self.s, self._t, self.s.rope_window
        a, post, comb = self._attn_input(x)
        kv = self._key(a, positions)
        keys, kpos = np.concatenate([keys, kv]), np.concatenate([kpos, positions])
        _, q = s.query(self.li, a, positions, freqs)
        allowed = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None] - s.h.window)
        out = attend(q, keys, allowed, t("attn_sinks.weight"))
        x = hc_merge(s.output(self.li, out, positions, freqs), x, post, comb)
        m, post, comb = hc_mix(x, t("hc_ffn_fn.weight"), t("hc_ffn_scale.weight"), t("hc_ffn_base.weight"), s.h,
                               s.config.norm_eps)
        return hc_merge(s.mlp(self.li, self._norm(m, t("ffn_norm.weight")), tokens), x, post, comb), kv

    def logits(self, streams: np.ndarray) -> np.ndarray:
        """The model's head over this layer's hyper-connection head, norm and projection (the trunk's, or
        its own file's)."""
        return self.s.head(streams, self.head_norm, self.head_out, self.hc_head)

    def forward(self, h_prev: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The layer's logits over a whole sequence from scratch (no pool): position p from the trunk's
        streams h_prev[p] at p - 1 (zeros before the first) and tokens[p]. The reference the tests
        hold drafts and llama.cpp's MTP graph against."""
        positions = np.arange(len(tokens))
        empty = np.zeros((0, self.s.config.head_dim), np.float32)
        streams, _ = self._block(self._input(h_prev, tokens), tokens, positions, empty, positions[:0])
        return self.logits(streams)

    # -- with the pool ----------------------------------------------------------------------------

    def write_rows(self, x: np.ndarray, tokens: np.ndarray, positions: np.ndarray, chunks: list[SeqChunk],
                   spans: list[tuple[int, int]], slots: np.ndarray, rows: np.ndarray) -> None:
        """After the trunk's pass over a step: every new position's h (the trunk's output streams x) and
        this layer's key row (from the h before it: this step's, or the pool's for a chunk's first)."""
        bs, hc, hidden = self.s.block_size, self.s.h.hc_mult, self.s.config.hidden
        rows[slots, self.cols["h"]] = x.reshape(len(x), -1)
        prev = np.empty_like(x)
        prev[1:] = x[:-1]
        for c, (first, _) in zip(chunks, spans, strict=True):
            if c.start == 0:
                prev[first] = 0.0  # nothing before the first position (llama.cpp starts from zeros too)
            else:
                slot = c.block_table[(c.start - 1) // bs] * bs + (c.start - 1) % bs
                prev[first] = rows[slot, self.cols["h"]].reshape(hc, hidden)
        a, _, _ = self._attn_input(self._input(prev, tokens))
        rows[slots, self.cols["kv"]] = self._key(a, positions)

    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]:
        """k greedy guesses after `token` at position `at` (the trunk has computed every position before
        it): each step's output streams are the next step's h, and its key row joins the window's."""
        return self.chain(block_table, token, at, k)[0]

    def chain(self, block_table: list[int], token: int, at: int, k: int) -> tuple[list[int], np.ndarray]:
        """draft's guesses, and the logits [k, vocab] each was the argmax of."""
        s, bs, hc, hidden = self.s, self.s.block_size, self.s.h.hc_mult, self.s.config.hidden
        rows = s.pool.reshape(-1, s.pool.shape[-1])
        table = np.asarray(block_table, np.int64)
        kpos = np.arange(max(0, at - s.h.window + 1), at)
        past = rows[table[kpos // bs] * bs + kpos % bs]
        keys = past[:, self.cols["kv"]]
        h = np.zeros((1, hc, hidden), np.float32)  # nothing before the first position
        if at > 0:
            h[0] = rows[table[(at - 1) // bs] * bs + (at - 1) % bs, self.cols["h"]].reshape(hc, hidden)
        guesses: list[int] = []
        logits = np.zeros((k, len(self.embd)), np.float32)
        for i in range(k):
            tokens, positions = np.array([token], np.int64), np.array([at + i])
            h, kv = self._block(self._input(h, tokens), tokens, positions, keys, kpos)
            keys, kpos = np.concatenate([keys, kv]), np.concatenate([kpos, positions])
            logits[i] = self.logits(h)[0]
            token = int(np.argmax(logits[i]))
            guesses.append(token)
        return guesses, logits
