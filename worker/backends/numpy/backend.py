"""The reference backend: a batched forward pass in float32 numpy over a paged KV cache.

Readable first, then fast where it is free: all chunks of a step are stacked into one matrix for
the weight products (the part that costs), and attention runs per sequence over its own blocks.
The layer is the family's recipe (model/arch/recipe.py: norm placement, q/k norms, biases, rope
flavour, activation, scaled embeddings, sliding windows), computed as llama.cpp's graph computes
it, since llama.cpp is the oracle the tests compare against. It never looks at the family's name.
"""

from __future__ import annotations

import numpy as np

from ember.kernels import reference as ops

from ...model.arch.recipe import Rope
from ...model.config import ModelConfig
from ...model.dspark_file import DSparkFile
from ...model.rope import inv_frequencies
from ...model.weights import ModelWeights
from ..base import Backend, Done, HostBuffers, Landed, SampledToken, SeqChunk, chunk_logits, present, step_rows
from .dspark import DSparkHead
from .hyper import HyperStack
from .mtp import MtpHead


class NumpyBackend(Backend):
    name = kv_layout = "numpy"
    block_dtype = np.dtype(np.float32)

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, n_blocks: int, block_size: int = 16,
                 draws: bool = False, mtp: bool = False, dspark: tuple[DSparkFile, ModelWeights] | None = None):
        # draws: chunks with `sample` set come back as SampledToken, drawn by the CUDA sampler's twin,
        # and submit() feeds a step from the previous one's draws: the CUDA backend's contract on the
        # CPU, so the scheduler's run-ahead path is tested without a GPU
        self.samples_on_device = self.runs_ahead = draws
        self._drawn: dict[int, int] = {}  # the last step's draws, by chunk
        self.config, self.weights = config, weights
        self.block_size, self.n_blocks = block_size, n_blocks
        # a HYPER stack (DeepSeek V4) is hyper.py's: its own layer and pool of per-position rows. mtp: the
        # pool also keeps what its next-token layer drafts from (mtp.py; --spec mtp). dspark: a DSpark block
        # drafter's file and weights, whose key rows the pool keeps too (dspark.py; --spec dspark:PATH)
        if mtp and (config.hyper is None or not config.hyper.nextn_layers):
            raise ValueError("the model has no next-token (MTP) layer")
        if dspark is not None and mtp:
            raise ValueError("one drafter at a time: the next-token layer or a DSpark drafter")
        if dspark is not None and config.hyper is None:
            raise ValueError("a DSpark drafter needs a DeepSeek V4 model")
        self.hyper = (HyperStack(config, weights, n_blocks=n_blocks, block_size=block_size, mtp=mtp,
                                 drafter_width=dspark[0].key_width if dspark else 0)
                      if config.hyper else None)
        self.mtp: MtpHead | None = None  # the next-token layer, where it drafts
        self.dspark: DSparkHead | None = None  # the block drafter, where it drafts
        if self.hyper is not None:
            # the pool's layout by name: blocks of one are never read as blocks of another
            self.kv_layout = ("numpy-hyper-dspark-v2" if dspark else "numpy-hyper-mtp-v2" if mtp
                              else "numpy-hyper-v2")
            if mtp:
                self.mtp = self.hyper.mtp = MtpHead(self.hyper)
            if dspark is not None:
                self.dspark = self.hyper.dspark = DSparkHead(self.hyper, *dspark)
        shape = (0, 0, 0, 0, 0) if self.hyper else (config.n_layers, n_blocks, block_size, config.n_kv_heads,
                                                    config.head_dim)
        self.k_pool = np.zeros(shape, dtype=np.float32)
        self.v_pool = np.zeros(shape, dtype=np.float32)
        self._inv_freq_global, self._inv_freq_local, self._rope_mscale = inv_frequencies(config, weights.rope_freqs)

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, mtp: bool = False, drafter_width: int = 0) -> int:
        if config.hyper is not None:
            return block_size * HyperStack.width(config, block_size, mtp, drafter_width) * 4
        return 2 * config.n_layers * block_size * config.kv_dim * 4

    # -- one step ---------------------------------------------------------------------------------

    def submit(self, chunks: list[SeqChunk], feed: list[int | None] | None = None) -> Done:
        if feed is not None:
            if len(feed) != len(chunks):
                raise ValueError("feed needs one entry per chunk")
            for c, j in zip(chunks, feed, strict=True):
                if j is not None and (j not in self._drawn or len(c.tokens) != 1):
                    raise ValueError(f"feed {j}: the previous step drew no token for that chunk")
            chunks = [c if j is None else SeqChunk(np.array([self._drawn[j]], np.int32), c.start, c.block_table,
                                                   c.logits, c.sample) for c, j in zip(chunks, feed, strict=True)]
        return Done(self.forward(chunks))

    def forward(self, chunks: list[SeqChunk]) -> list:
        logits_rows = self._logits(chunks)
        out: list[np.ndarray | SampledToken | None] = list(logits_rows)
        self._drawn = {}
        if self.samples_on_device:
            for i, (c, logits) in enumerate(zip(chunks, logits_rows, strict=True)):
                if c.sample is not None and c.logits == "last" and logits is not None:
                    s = c.sample
                    tokens, _ = ops.sample_rows(logits[-1:], [s.temperature], [s.top_k], [s.top_p], [s.min_p],
                                                [s.seed & (2**64 - 1)], [s.step & (2**32 - 1)])
                    out[i] = SampledToken(int(tokens[0]))
                    self._drawn[i] = int(tokens[0])
        return out

    def _logits(self, chunks: list[SeqChunk]) -> list[np.ndarray | None]:
        if self.hyper is not None:
            return self.hyper.logits(chunks)
        cfg, w, recipe = self.config, self.weights, self.config.recipe
        tokens, positions, spans, slots = step_rows(chunks, self.block_size, self.n_blocks)

        x = np.asarray(w.token_embd[tokens], dtype=np.float32)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        rope_global = ops.rope_tables(positions, self._inv_freq_global, self._rope_mscale)
        rope_local = (ops.rope_tables(positions, self._inv_freq_local, self._rope_mscale) if cfg.sliding_window
                      else rope_global)
        neox = recipe.rope is Rope.NEOX

        for li, lw in enumerate(w.layers):
            local = cfg.is_local_layer(li)
            h = ops.rms_norm(x, lw.attn_norm, cfg.norm_eps)
            qkv = ops.linear(h, lw.wqkv, lw.bqkv)  # q, k and v stacked by rows (bqkv: None without biases)
            q = qkv[:, : cfg.q_dim].reshape(-1, cfg.n_heads, cfg.head_dim)
            k = qkv[:, cfg.q_dim : cfg.q_dim + cfg.kv_dim].reshape(-1, cfg.n_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_dim + cfg.kv_dim :].reshape(-1, cfg.n_kv_heads, cfg.head_dim)
            if recipe.qk_norm:
                q = ops.rms_norm(q, present(lw.q_norm), cfg.norm_eps)
                k = ops.rms_norm(k, present(lw.k_norm), cfg.norm_eps)
            cos, sin = rope_local if local else rope_global
            q = ops.rope(q, cos, sin, neox=neox)
            k = ops.rope(k, cos, sin, neox=neox)
            self.k_pool[li].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[slots] = k
            self.v_pool[li].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[slots] = v

            window = cfg.sliding_window if local else 0
            attn = np.empty((len(tokens), cfg.q_dim), dtype=np.float32)
            for c, (a, b) in zip(chunks, spans, strict=True):
                first = max(0, c.start - window + 1) if window else 0  # older keys: outside the window
                keys, values, offset = self._gather(li, c.block_table, first, c.start + len(c.tokens))
                attn[a:b] = ops.attention(
                    q[a:b], keys, values, positions[a:b], window=window, scale=cfg.attn_scale, key_offset=offset,
                    sinks=lw.sinks,
                ).reshape(b - a, cfg.q_dim)
            o = ops.linear(attn, lw.wo, lw.bo)
            if recipe.post_norms:
                o = ops.rms_norm(o, present(lw.post_attn_norm), cfg.norm_eps)
            x = x + o

            h = ops.rms_norm(x, lw.ffn_norm, cfg.norm_eps)
            if recipe.moe is not None:
                biases = ((present(lw.router_b), present(lw.gate_exps_b), present(lw.up_exps_b),
                           present(lw.down_exps_b)) if recipe.moe.biases else None)
                m = ops.moe_mlp(h, present(lw.router), present(lw.gate_exps), present(lw.up_exps),
                                present(lw.down_exps), k=cfg.n_experts_used, act=recipe.act,
                                gating=recipe.moe.gating.value, norm_topk=recipe.moe.norm_topk, biases=biases)
            else:
                m = ops.gated_mlp_stacked(h, present(lw.w_gate_up), present(lw.w_down), act=recipe.act)
            if recipe.post_norms:
                m = ops.rms_norm(m, present(lw.post_ffn_norm), cfg.norm_eps)
            x = x + m

        return chunk_logits(chunks, spans, x, lambda rows: ops.linear(ops.rms_norm(rows, w.output_norm, cfg.norm_eps),
                                                                      w.output))

    def _gather(self, layer: int, block_table: list[int], first: int,
                length: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Keys and values of positions [first rounded down to a block, length), and that start."""
        bs, cfg = self.block_size, self.config
        b0, b1 = first // bs, -(-length // bs)
        blocks = block_table[b0:b1]
        n = length - b0 * bs
        if blocks and blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
            # consecutive blocks (the usual case): a view, no copy
            sel: slice | np.ndarray = slice(blocks[0], blocks[-1] + 1)
        else:
            sel = np.asarray(blocks, dtype=np.int64)
        keys = self.k_pool[layer, sel].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:n]
        values = self.v_pool[layer, sel].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:n]
        return keys, values, b0 * bs

    # -- KV block transfer ------------------------------------------------------------------------

    def read_block(self, block: int) -> np.ndarray:
        if self.hyper is not None:  # [block_size, row width]
            return self.hyper.pool[block].copy()
        return np.stack([self.k_pool[:, block], self.v_pool[:, block]])

    def write_block(self, block: int, data: np.ndarray) -> None:
        if self.hyper is not None:
            self.hyper.pool[block] = data
            return
        self.k_pool[:, block] = data[0]
        self.v_pool[:, block] = data[1]

    def save_blocks(self, blocks: list[int]) -> Landed:
        return Landed(np.stack([self.read_block(b) for b in blocks]) if blocks else
                      np.zeros((0, *self.read_block(0).shape), np.float32))

    def load_blocks(self, blocks: list[int], payloads) -> None:
        for b, p in zip(blocks, payloads, strict=True):
            self.write_block(b, p)

    def restore_buffers(self) -> HostBuffers:
        return HostBuffers(self.read_block(0).shape, self.block_dtype)  # the pools are host memory already
