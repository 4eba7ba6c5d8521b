"""DeepSeek V4's DSpark block drafter on the GPU: the numpy twin's DSparkHead (backends/numpy/dspark.py) through
ember.kernels.ops, and what `--spec dspark:PATH` drafts with on cuda.

With every step of the trunk (hyper_step.py) the drafter's key rows go into the pool's extra columns, as the
twin writes them: the mean of the trunk's streams entering each target layer (and after the last), side by
side, through `fc` and its norm, then each stage's KV projection, norm and RoPE, rounded to float16. A draft
runs between steps on a step of the stages' own (their config, buffers for one block, no pool): the block
[last token, mask...] through the stages, each slot attending to the block's rows and to the context's
rows in its window (gathered from the pool); then each slot's logits from the stages' head and the trunk's
output matrix, biased by the Markov head's row of the token before it and drawn greedily on the device,
slot after slot, so a draft reads back only its tokens. The confidence head's cut (p_min) is the numpy
backend's alone: no flag sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray

from ...model.dspark_file import MARKOV_IN, MARKOV_OUT, DSparkFile
from ..numpy.hyper import HyperStack, rope_frequencies
from .buffers import GrowingBuffers
from .hyper_weights import HyperWeights, _layer, _Reader

if TYPE_CHECKING:
    from .hyper_step import HyperStep, _Inputs


@dataclass
class DSparkWeights:
    file: DSparkFile
    stages: HyperWeights  # its stages as a stack of their own: the trunk's embeddings and output matrix
    fc: ops.QuantMatrix  # [hidden, targets * hidden]: the trunk's features into the stages' input
    enc_norm: DeviceArray
    markov_in: ops.QuantMatrix  # [vocab, rank]: the row of the token before a slot
    markov_out: ops.QuantMatrix  # [vocab, rank]: that row's bias on the slot's logits

    def key_rows(self) -> list[ops.QuantMatrix]:
        """What each trunk step multiplies: fc, then each stage's KV projection."""
        return [self.fc, *(lw.kv for lw in self.stages.layers)]


def upload_dspark_weights(dev: Device, file: DSparkFile, trunk: HyperWeights) -> DSparkWeights:
    cfg = file.config
    assert cfg.hyper is not None and cfg.family.hyper is not None
    rd, t, model = _Reader(dev, file.gguf), cfg.family.tensors, cfg.family.hyper.model
    rope = dev.to_device(rope_frequencies(cfg.rope_base, cfg.hyper.n_rot).astype(np.float32))
    stages = HyperWeights(
        token_embd=trunk.token_embd, output=trunk.output, output_norm=rd.device_vector(t.output_norm),
        output_mix=(rd.matrix(model["output_mix_fn"]), rd.device_vector(model["output_mix_scale"]),
                    rd.device_vector(model["output_mix_base"])),
        layers=[_layer(rd, cfg, li, ratio=0) for li in range(cfg.n_layers)], rope_window=rope, rope_compressed=rope,
        ones=dev.to_device(np.ones(cfg.head_dim, np.float32)))
    return DSparkWeights(file, stages, rd.matrix("fc.weight"), rd.device_vector("enc.output_norm.weight"),
                         rd.matrix(MARKOV_IN), rd.matrix(MARKOV_OUT))


class DSparkLayer:
    """The drafter on a HyperStep: its key rows with every step (tap, write_rows), and drafts (draft, chain)."""

    def __init__(self, step: HyperStep, weights: DSparkWeights):
        from .hyper_step import HyperStep

        self.s, self.w, f = step, weights, weights.file
        self.file, self.p_min = f, 0.0
        self.taps = f.target_layers
        self.cols = step.columns[-1]["drafter"]
        cfg, e, R = f.config, step.dev.empty, step.max_rows
        self.hd, hidden = cfg.head_dim, step.config.hidden
        self.features = e((R * len(self.taps) * hidden,))
        self.g, self.krow = e((R * hidden,)), e((R * self.hd,))
        bs = f.block_size
        # the stages' own step: a block's buffers, the matvec (a block is a few rows), no pool but one block
        self.stages = HyperStep(step.dev, step.stream, cfg, weights.stages, e((bs * HyperStack.width(cfg, bs),)),
                                n_blocks=0, block_size=bs, max_rows=bs, tensor_cores=False, graphs=False)
        V = step.config.vocab_size
        self.u, self.biased = e((weights.markov_in.cols,)), e((bs * V,))
        greedy = np.zeros(ops.SampleParams.nbytes(1), np.uint8)
        ops.SampleParams.pack(greedy, 1, temperature=[0.0], top_k=[0], top_p=[1.0], min_p=[0.0], seed=[0], step=[0])
        self.greedy = step.dev.to_device(greedy)
        self._keys: DeviceArray | None = None
        self._draft_in = GrowingBuffers(step.dev)  # a draft's small int32 inputs

    @property
    def block_size(self) -> int:
        """The pool's block size (what the speculation's drafter checks block tables against)."""
        return self.s.block_size

    # -- with every step ------------------------------------------------------------------------------

    def tap(self, li: int, n: int) -> None:
        """The mean of the trunk's streams (s.x) entering layer li (n_layers: after the last), if a target."""
        if li in self.taps:
            s, hidden = self.s, self.s.config.hidden
            at = self.taps.index(li) * hidden
            ops.mean_streams(s.dev, s.x, self.features.view(at, self.features.size - at), n=n, hc=s.h.hc_mult,
                             hidden=hidden, ldo=len(self.taps) * hidden, stream=s.stream)

    def write_rows(self, n: int, inp: _Inputs) -> None:
        """Every new position's key row a stage, from the features the taps took, into the pool (twin:
        DSparkHead.key_rows)."""
        s, dev, st, cfg, hd = self.s, self.s.dev, self.s.stream, self.file.config, self.hd
        s._linear(self.w.fc, self.features, self.g, n)
        ops.rms_norm(dev, self.g, self.w.enc_norm, self.g, eps=cfg.norm_eps, rows=n, cols=s.config.hidden, stream=st)
        for li, lw in enumerate(self.w.stages.layers):
            s._linear(lw.kv, self.g, self.krow, n)
            ops.rms_norm(dev, self.krow, lw.kv_norm, self.krow, eps=cfg.norm_eps, rows=n, cols=hd, stream=st)
            self.stages._rope_tail(self.krow, inp.pos, self.w.stages.rope_window, n=n, heads=1, dim=hd)
            ops.round_half(dev, self.krow, n=n * hd, stream=st)  # llama.cpp's drafter cache is float16
            at = self.cols.start + li * hd
            ops.store_rows(dev, self.krow, inp.slots, s.pool.view(at, s.pool.size - at), n=n, width=hd, lds=hd,
                           ldd=s.width, stream=st)

    # -- drafts ---------------------------------------------------------------------------------------

    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]:
        """Up to k guesses after `token` at position `at` (every position before it is in the pool): a block of
        min(k, the file's block size) slots."""
        n = min(k, self.file.block_size)
        return self.chain(block_table, token, at, n)[0] if n >= 1 else []

    def chain(self, block_table: list[int], token: int, at: int, n: int) -> tuple[list[int], np.ndarray]:
        """The Markov head's chain over a block of n slots: (each slot's argmax, its biased logits [n, vocab])
        (twin: DSparkHead.chain)."""
        s, st, dev, stream = self.s, self.stages, self.s.dev, self.s.stream
        cfg, hd, W, bs, V = self.file.config, self.hd, s.width, s.block_size, s.config.vocab_size
        assert cfg.hyper is not None
        window, hc = cfg.hyper.window, cfg.hyper.hc_mult
        stream.synchronize()  # the trunk's step is done with the pool rows a draft reads
        table = np.asarray(block_table, np.int64)
        kpos = np.arange(max(0, at - window + 1), at)
        m, ldi = len(kpos), window + n
        if self._keys is None or self._keys.size < ldi * hd:
            self._keys = dev.empty((ldi * hd,))
        put = self._draft_in.ints
        keys, positions = self._keys, np.arange(at, at + n)
        tok = put("tok", [token] + [self.file.mask_token] * (n - 1))
        pos = put("pos", positions)
        # slot i: the context's rows in its window, and every row of the block (it is not causal)
        idx = np.full((n, ldi), -1, np.int32)
        cnt = np.zeros(n, np.int32)
        for i, p in enumerate(positions):
            seen = np.concatenate([np.nonzero(kpos > p - window)[0], m + np.arange(n)])
            idx[i, : len(seen)], cnt[i] = seen, len(seen)
        # every input uploaded before anything is queued (an upload does not wait for the stream)
        idx_d, cnt_d, own = put("idx", idx), put("cnt", cnt), put("own", m + np.arange(n))
        rows = put("rows", table[kpos // bs] * bs + kpos % bs) if m else None
        rep, drawn = put("rep", np.repeat(np.arange(n), hc)), put("drawn", np.zeros(n, np.int32))
        ops.embed(dev, st.w.token_embd, st.a, tok, n=n, stream=stream)
        ops.gather_rows(dev, st.a, rep, st.x, n=n * hc, cols=st.config.hidden, stream=stream)
        for li, lw in enumerate(st.w.layers):
            if rows is not None:  # this stage's context rows, then the block's own after them
                col = self.cols.start + li * hd
                ops.gather_rows(dev, s.pool.view(col, s.pool.size - col), rows, keys, n=m, cols=hd, ldx=W,
                                stream=stream)
            st._key_row(lw, n, pos, st.w.rope_window)
            ops.round_half(dev, st.kvr, n=n * hd, stream=stream)
            ops.store_rows(dev, st.kvr, own, keys, n=n, width=hd, lds=hd, ldd=hd, stream=stream)
            st._query(lw, n, pos, st.w.rope_window)
            st._attend(lw, n, pos, st.w.rope_window, keys, idx_d, cnt_d, ldi)
            st._mlp(lw, n, tok)
        st.logits_of(st.x, n, st.w.output_mix, st.w.output_norm, st.w.output)
        # each slot's logits biased by the Markov head's row of the token before it (the last token for the
        # first), then its argmax: the token before the next slot
        for i in range(n):
            ops.embed(dev, self.w.markov_in, self.u, tok if i == 0 else drawn.view(i - 1, 1), n=1, stream=stream)
            st.mm.linear(self.w.markov_out, self.u, self.biased.view(i * V, V), 1, res=st.logits.view(i * V, V),
                         tc=False)
            ops.sample(dev, self.biased.view(i * V, V), self.greedy, drawn.view(i, 1), rows=1, vocab=V, stream=stream)
        stream.synchronize()  # (to_host copies on the legacy stream, which does not wait for this one)
        guesses = [int(t) for t in drawn.view(0, n).to_host()]
        return guesses, self.biased.view(0, n * V).to_host().reshape(n, V)
