"""DeepSeek V4's DSpark block drafter on the numpy backend: the readable reference of llama.cpp's dflash
DeepSeek V4 graph with its Markov head (src/models/dflash.cpp, graph_dsv4 and build_dspark_markov_head),
and what `--spec dspark:PATH` drafts with (engine/spec/dspark_drafter.py).

The drafter reads the trunk through key rows, one a stage for every position the trunk has computed:
the mean of the trunk's streams entering each of its target layers (n_layers: the streams after the
last), side by side, through `fc` and its norm, then each stage's KV projection, norm and RoPE. The
trunk's forward pass writes them into extra pool columns with every position it computes
(HyperStack.columns[-1]["drafter"]), so they are, as every pool row, a function of the prefix alone:
prefix caching and block files carry them, and the rows of a refused guess are written over when its
position is computed for real. They are rounded to float16, as llama.cpp's drafter cache holds them.

A draft is one pass over a block: the last token and mask tokens after it, at the positions that follow
it, embedded with the trunk's token_embd and copied into every stream, through the stages (full DeepSeek
V4 blocks: hyper-connections, a window-only attention with sinks, learned routing and the shared
expert). A slot attends to the block's every row (the block is not causal) and to the context's rows in
its own window (a later slot sees one fewer). The head's mix gives h; the drafter's output norm and the
trunk's output matrix give each slot's logits, and the Markov head biases them by the token before: the
last token for the first slot, the previous slot's argmax after.
The draft is the chain of argmaxes, cut where the confidence head (on h and the Markov embedding) falls
below p_min, when that is set.
"""

from __future__ import annotations

import numpy as np

from ember.kernels import reference as ops

from ...model.dspark_file import CONFIDENCE, MARKOV_IN, MARKOV_OUT, DSparkFile
from ...model.weights import ModelWeights
from .hyper import HyperStack, _norm, _sigmoid, attend, hc_merge, hc_mix


class DSparkHead:
    """The drafter beside a trunk's HyperStack: it writes its key rows into the trunk's pool, and drafts
    from them."""

    def __init__(self, trunk: HyperStack, file: DSparkFile, weights: ModelWeights, *, p_min: float = 0.0):
        """weights: the drafter's (DSparkFile.weights). p_min: the confidence a slot needs to be drafted (0:
        every slot is, as llama.cpp's --spec-draft-p-min 0, its default)."""
        self.trunk, self.file, self.p_min = trunk, file, p_min
        self.target_layers = file.target_layers
        self.cols = trunk.columns[-1]["drafter"]
        # the stages run through the stack's own pieces, as a window-only stack of their own (no pool)
        self.stages = HyperStack(file.config, weights, n_blocks=0, block_size=trunk.block_size)
        w = weights.by_name
        self.fc, self.enc_norm = w["fc.weight"], w["enc.output_norm.weight"]
        self.markov_in, self.markov_out = w[MARKOV_IN], w[MARKOV_OUT]  # [vocab, rank] both: a token's row, the bias
        self.confidence = w[CONFIDENCE][0] if CONFIDENCE in w else None
        self.hd, self.n_stages = file.config.head_dim, file.config.n_layers

    @property
    def block_size(self) -> int:
        """The pool's block size (what the speculation's drafter checks block tables against)."""
        return self.trunk.block_size

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return ops.rms_norm(x, weight, self.file.config.norm_eps)

    def key_rows(self, features: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Each stage's key row [n, stages, head_dim] of the trunk's features [n, targets * hidden] at positions."""
        s = self.stages
        g = self._norm(features @ self.fc.T, self.enc_norm)
        keys = np.stack([s.key(li, g, positions, s.rope_window) for li in range(self.n_stages)], axis=1)
        return keys.astype(np.float16).astype(np.float32)  # llama.cpp's drafter cache is float16

    def write_rows(self, features: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        rows[slots, self.cols] = self.key_rows(features, positions).reshape(len(positions), -1)

    # -- a draft -----------------------------------------------------------------------------------

    def _stage(self, li: int, x: np.ndarray, tokens: np.ndarray, positions: np.ndarray, keys: np.ndarray,
               kpos: np.ndarray) -> np.ndarray:
        """Stage li over the block's streams x at positions, attending to the context's rows `keys` at kpos
        and to the block's own."""
        s, eps, window = self.stages, self.file.config.norm_eps, self.stages.h.window
        a, post, comb = hc_mix(x, s._t(li, "attn_mix_fn"), s._t(li, "attn_mix_scale"), s._t(li, "attn_mix_base"),
                               s.h, eps)
        a = _norm(a, eps, s._t(li, "attn_norm"))
        _, q = s.query(li, a, positions, s.rope_window)
        own = s.key(li, a, positions, s.rope_window).astype(np.float16).astype(np.float32)
        keys, kpos = np.concatenate([keys, own]), np.concatenate([kpos, positions])
        allowed = kpos[None, :] > positions[:, None] - window  # not causal: every slot sees the whole block
        out = attend(q, keys, allowed, s._t(li, "sinks"))
        x = hc_merge(s.output(li, out, positions, s.rope_window), x, post, comb)
        m, post, comb = hc_mix(x, s._t(li, "ffn_mix_fn"), s._t(li, "ffn_mix_scale"), s._t(li, "ffn_mix_base"), s.h, eps)
        return hc_merge(s.mlp(li, _norm(m, eps, s._t(li, "ffn_norm")), tokens), x, post, comb)

    def block(self, block_table: list[int], token: int, at: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The block [token, mask...] of n slots at positions at.. over the sequence's rows before `at`:
        (each slot's logits before the Markov bias [n, vocab], the head's mix h [n, hidden])."""
        s, trunk, bs = self.stages, self.trunk, self.trunk.block_size
        rows = trunk.pool.reshape(-1, trunk.pool.shape[-1])
        table = np.asarray(block_table, np.int64)
        kpos = np.arange(max(0, at - s.h.window + 1), at)
        context = rows[table[kpos // bs] * bs + kpos % bs][:, self.cols].reshape(len(kpos), self.n_stages, self.hd)
        tokens = np.array([token] + [self.file.mask_token] * (n - 1), np.int64)
        positions = np.arange(at, at + n)
        x = np.repeat(np.asarray(s.w[s.tensors.token_embd][tokens], np.float32)[:, None, :], s.h.hc_mult, axis=1)
        for li in range(self.n_stages):
            x = self._stage(li, x, tokens, positions, context[:, li], kpos)
        h = s.head_mix(x)
        base = ops.linear(_norm(h, self.file.config.norm_eps, s.w[s.tensors.output_norm]), s.w[s.tensors.output])
        return base, h

    def chain(self, block_table: list[int], token: int, at: int, n: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The Markov head's chain over a block of n slots: (each slot's argmax, its biased logits [n, vocab],
        its confidence [n] (ones without the head))."""
        base, h = self.block(block_table, token, at, n)
        guesses, logits, conf = [], np.empty_like(base), np.ones(n, np.float32)
        prev = token
        for i in range(n):
            u = self.markov_in[prev]
            logits[i] = base[i] + self.markov_out @ u
            if self.confidence is not None:
                conf[i] = _sigmoid(self.confidence @ np.concatenate([h[i], u]))
            prev = int(np.argmax(logits[i]))  # the first of equal maxima, as ggml_argmax
            guesses.append(prev)
        return guesses, logits, conf

    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]:
        """Up to k guesses after `token` at position `at` (every position before it is in the pool): a block
        of min(k, the file's block size) slots, cut before the first slot less confident than p_min."""
        n = min(k, self.file.block_size)
        if n < 1:
            return []
        guesses, _, conf = self.chain(block_table, token, at, n)
        if self.p_min > 0:
            low = np.nonzero(conf < self.p_min)[0]
            if len(low):
                guesses = guesses[: int(low[0])]
        return guesses
