"""One step of DeepSeek V4 (recipe.Stack.HYPER) on the GPU: the numpy twin's pass (backends/numpy/hyper.py,
HyperStack.logits) through ember.kernels.ops, over the per-position pool the backend holds (hyper.py).

Per layer: the hyper-connections' mix (a matmul, then hc_pre; a decode's few rows: hc_mix), the low-rank
query and the one KV head's row (RoPE on their last n_rot dimensions), the step's rows into the pool
(store_rows: the key row, and by the layer's compress ratio the compressor's and the indexer's value and
score rows); the compressed rows of the blocks the step closes made from the pool's (compress_rows, normed,
RoPE at each row's first position) and stored as pieces in the pool; then each chunk's attention over a
scratch of key rows: its window's rows and the compressed rows it sees, gathered from the pool; in a CSA
layer the lightning indexer's scores of its candidates and its top k appended to each query's list
(hyper_keys.py plans the lists and the blocks on the host). The heads' output turns back, goes through the
grouped low-rank projection and merges into the streams; then the MLP's mix, the shared expert and the
routed ones (hash-routed by token id in the first layers), each a clamped SwiGLU. The mixes' logits stay
in float32, closest to the twin (hc_logits for many tokens, hc_mix's dots for a decode's few: a rounding in
them moves a Sinkhorn's every weight); the other matmuls go through matmul.py (the weights' own blocks, the
tensor cores from its TC_MIN_ROWS rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray
from ember.kernels.ops.matmul import GEMM_TILE_K
from ember.kernels.ops.moe import QGEMM_MIN_ROWS, QGEMM_TILES, TILE_ROWS

from ...model.config import ModelConfig
from ..base import SeqChunk, attempt, kv_slots
from ..numpy.hyper import CSA, HyperStack
from . import hyper_keys
from .buffers import GrowingBuffers
from .hyper_dspark import DSparkLayer, DSparkWeights
from .hyper_mtp import MtpLayer, MtpWeights
from .hyper_weights import HyperLayer, HyperWeights
from .matmul import Matmuls
from .step import Landing, PendingStep, feed_sources

# A decode step (one token a sequence) runs as a captured graph of its padded shape (hyper_keys.Pad): the
# sequences to a power of two, the context to a power of two of at least GRAPH_MIN_CONTEXT, at most
# GRAPH_MAX_POSITIONS rows times context (its key scratch holds every compressed row of that context: about
# 0.5 KB a position at the real model's sizes, CSA's); past that, eagerly.
GRAPH_MIN_CONTEXT = 256
GRAPH_MAX_POSITIONS = 1 << 18
# Up to this many tokens a step's low-bit experts (IQ2_XXS, Q2_K, ...) take a tile a pair through the
# column-resident matvec (ops.moe_matvec: qmoc_b1), which decodes an expert's rows once for each of its
# pairs, rather than tiles of 16 pairs on the tensor cores (qgemm_t16), which decode them once a tile: a
# few tokens' pairs seldom share an expert (16 tokens' 96 pairs fall on about 81 of 256), and qgemm's
# decode to 16 bits in shared memory took 64% of a 16-stream step on the L8 file (17.8 ms, H100).
PAIR_TILE_MAX_ROWS = 32


@dataclass
class _Inputs:
    """A step's host plan on the device (hyper_keys.plan's, and the tokens')."""

    tok: DeviceArray  # int32 [n]
    pos: DeviceArray  # int32 [n] each row's position
    slots: DeviceArray  # int32 [n] each row's pool row
    prow: DeviceArray  # int32: every chunk's positions' pool rows (StepKeys.prow)
    wrows: DeviceArray  # int32: the window rows' pool rows (StepKeys.wrows)
    rep: DeviceArray  # int32 [n * hc]: each stream's token row (the embeddings' copies)
    lists: dict[int, tuple[DeviceArray, DeviceArray, int]]  # by ratio: (idx, cnt, ldi)
    cand: tuple[DeviceArray, DeviceArray, int] | None  # CSA: (crow, ccnt, ldc)
    comp: dict[int, tuple[DeviceArray, int]]  # by ratio: (the compressed rows' pieces, rows)
    closing: dict[int, tuple[DeviceArray, DeviceArray, DeviceArray, int]]  # by ratio: (starts, positions, pieces, n)
    out_rows: DeviceArray | None  # int32 [n_out]: the rows whose logits the head computes
    n_out: int
    # the next-token layer's (hyper_mtp.py): each row's pool row of the position before it, and the rows at
    # position 0 (int32, and how many; a padded step's padded with the spare row)
    prev: DeviceArray | None = None
    firsts: tuple[DeviceArray, int] | None = None
    sample: DeviceArray | None = None  # the packed SampleParams of the rows drawn on the device
    feed: DeviceArray | None = None  # int32 [n]: the row of the step before's draws that is a row's token, or -1


class HyperStep:
    """The step's buffers (allocated once for max_rows rows; the key lists' grow with the contexts) and its
    kernels, over `pool`: (n_blocks + 1) * block_size rows of HyperStack.width(config, block_size) floats."""

    def __init__(self, dev: Device, stream, config: ModelConfig, weights: HyperWeights, pool: DeviceArray, *,
                 n_blocks: int, block_size: int, max_rows: int, tensor_cores: bool = True, graphs: bool = True,
                 mtp: MtpWeights | None = None, dspark: DSparkWeights | None = None):
        """mtp: the next-token layer's weights: the pool keeps its rows too (HyperStack.layout's mtp entry),
        written with every step, and self.mtp drafts (hyper_mtp.MtpLayer). dspark: a DSpark block drafter's:
        likewise its key rows (the layout's drafter entry), and self.dspark drafts (hyper_dspark.DSparkLayer)."""
        assert config.hyper is not None
        self.dev, self.stream, self.config, self.h, self.w, self.pool = dev, stream, config, config.hyper, weights, pool
        self.n_blocks, self.block_size, self.max_rows = n_blocks, block_size, max_rows
        self.tensor_cores, self.graphs = tensor_cores, graphs
        # the low-bit experts' matvec with x in int8 (qmoc8_b1; twin: reference.linear_q8): off until measured
        self.int8_experts = False
        self.expert_tiles = tensor_cores and all(
            ops.qgemm_supported(e) for lw in weights.layers for e in (lw.experts.gate_up, lw.experts.gate,
                                                                      lw.experts.up, lw.experts.down) if e is not None)
        drafter_width = dspark.file.key_width if dspark is not None else 0
        self.columns = HyperStack.layout(config, block_size, mtp is not None, drafter_width)
        self.width = HyperStack.width(config, block_size, mtp is not None, drafter_width)
        self._mtp_weights, self._dspark_weights = mtp, dspark
        self._alloc(max_rows)
        self.mtp = MtpLayer(self, mtp) if mtp is not None else None
        self.dspark = DSparkLayer(self, dspark) if dspark is not None else None

    def _alloc(self, R: int) -> None:
        cfg, h, e = self.config, self.h, self.dev.empty
        hid, hc, H, D = cfg.hidden, h.hc_mult, cfg.n_heads, cfg.head_dim
        mix = (2 + hc) * hc
        ffn = self.w.layers[0].experts.ffn
        ffn_shared = self.w.layers[0].shared_gate.rows
        self.x, self.a, self.hn = e((R * hc * hid,)), e((R * hid,)), e((R * hid,))
        self.raw, self.post, self.comb = e((R * mix,)), e((R * hc,)), e((R * hc * hc,))
        self.mix_work = ops.HcMixWork.make(self.dev, hc=hc, hidden=hid)
        self.qa, self.q, self.kvr = e((R * h.q_lora_rank,)), e((R * H * D,)), e((R * D,))
        self.att, self.grouped = e((R * H * D,)), e((R * H * D,))
        grouped = R * h.o_groups * h.o_lora_rank
        self.oa, self.oa2, self.y = e((grouped,)), e((grouped,)), e((R * hid,))
        self.ckv, self.csc = e((R * 2 * D,)), e((R * 2 * D,))
        di, ih = h.indexer_dim, h.indexer_heads
        self.ikv, self.isc, self.iq, self.iw = e((R * 2 * di,)), e((R * 2 * di,)), e((R * ih * di,)), e((R * ih,))
        self.sg, self.su, self.ysh = e((R * ffn_shared,)), e((R * ffn_shared,)), e((R * hid,))
        self.sgu = e((R * 2 * ffn_shared,))  # [gate | up] a row, where the layer stacks them
        self.moe = ops.MoeScratch.alloc(self.dev, R, self.w.layers[0].experts.experts, cfg.n_experts_used, hid, ffn,
                                        apart=True, pair_tile_rows=PAIR_TILE_MAX_ROWS)
        self.logits = e((R * cfg.vocab_size,))
        self.mm = Matmuls(self.dev, self.stream, cfg, self.w.output, int8_activations=False,
                          tensor_cores=self.tensor_cores,
                          half_kind=cfg.recipe.half_type, g=self.sg, u=self.su, gu=None)
        # a buffer replaced by a larger one is freed: first the step still in flight (run ahead) is let finish
        self.bufs = self._eager_bufs = GrowingBuffers(self.dev, self.stream.synchronize)  # the step's being run
        # the captured shapes' buffers, one set for all (they replay one at a time, each uploading its inputs
        # first), so they take the largest shape's room, not the sum; a buffer that grows (a larger shape's
        # first step) drops every graph, each captured again when its shape next comes
        self._graph_bufs = GrowingBuffers(self.dev, self.stream.synchronize)
        # run-ahead (submit): a step's draws, where the next step's embedding reads its fed tokens; per slot
        # (two steps in flight at most), the pinned memory its inputs go up from and its results come down to
        self.drawn = e((R,), np.int32)
        self._slot = 0
        self._inflight: list[PendingStep | None] = [None, None]
        self._last: PendingStep | None = None  # the step submitted last: the one a fed step reads the draws of
        self._h_in: list[Any] = [None, None]
        self._h_tokens = [self.dev.pinned(4 * R), self.dev.pinned(4 * R)]
        self._h_logits: list[Any] = [None, None]
        self._done = [self.dev.event(), self.dev.event()]
        self._graph_moves = 0  # _graph_bufs.moves when the graphs held were captured
        self._graphs: dict[tuple[int, int], Any] = {}  # cuda_runtime.Graph
        self._seen: set[tuple[int, int]] = set()
        self.graph_replays = 0
        if self.tensor_cores:  # the tensor-core matmuls' 16-bit scratch, at its largest, once: graphs use it
            tc = tensor_core_matrices(self.w, self._mtp_weights, self._dspark_weights, hc=hc)
            decoded = [m for m, _ in tc if m.half is None]  # (a kept 16-bit copy needs no decode: f16_weights)
            if decoded:
                self.dev.scratch("gemm_w", 2 * max(m.rows * m.cols for m in decoded))
            self.dev.scratch("gemm_x", 2 * max(per_row * R * m.cols for m, per_row in tc))

    def run(self, chunks: list[SeqChunk]) -> list:
        """Each chunk's logits as it asks for them (None for "none"), float32 on the host, or its SampledToken."""
        return self.submit(chunks).result()

    def submit(self, chunks: list[SeqChunk], sources: np.ndarray | None = None) -> PendingStep:
        """Launch one step and return at once; its result() waits for the device. sources: per row, the row of
        the step before's draws (still on the device) that is its token, or -1 (run-ahead); a fed row's token
        is ignored. A decode step whose graph is captured waits for nothing: its inputs go up from the slot's
        pinned memory on the stream, behind the step before, and its results come down likewise. Any other
        step first waits for the device. At most two steps are in flight: a slot's pinned memory is reused
        once the step that had it (two submits ago) is collected."""
        cfg, h, st = self.config, self.h, self.stream
        n = sum(len(c.tokens) for c in chunks)
        if n > self.max_rows:
            raise ValueError(f"a step of {n} tokens exceeds this backend's {self.max_rows} rows")
        tokens = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        if sources is not None:
            tokens[sources >= 0] = 0
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            raise ValueError("token id out of range")
        slot = self._slot
        older = self._inflight[slot]
        if older is not None:  # its pinned memory is this step's: wait for it (its error is its own)
            attempt(older.result)
            self._inflight[slot] = None
        pad = self._graph_shape(chunks)
        if pad is None or (pad.rows, pad.context) not in self._graphs:
            st.synchronize()  # run eagerly (or captured): it may grow buffers and copy synchronously
        keys = hyper_keys.plan(chunks, block_size=self.block_size, window=h.window,
                               ratios=set(h.compress_ratios), top_k=h.indexer_top_k, pad=pad)
        want, out_rows = _wanted(chunks, pad)
        # the chunks whose token is drawn on the device: sampled, with the last row's logits
        asks = [i for i, c in enumerate(chunks) if c.sample is not None and c.logits == "last" and len(want[i]) == 1]
        sample = self._sample_params(chunks, want, asks, len(out_rows))
        if pad is None:
            self.bufs = self._eager_bufs
            inp = self._inputs(chunks, tokens, keys, out_rows, sample, sources, slot)
            self._forward(n, inp, keys)
        else:  # a decode step: its shape's graph, captured the second time the shape comes (the first warms up)
            shape = (pad.rows, pad.context)
            self.bufs = self._graph_bufs
            fed = np.full(pad.rows, -1, np.int32)  # a captured step always feeds (-1: the host's token)
            if sources is not None:
                fed[:n] = sources
            inp = self._inputs(chunks, np.concatenate([tokens, np.zeros(pad.rows - n, np.int32)]), keys, out_rows,
                               sample, fed, slot, padded=True)
            self._drop_stale_graphs()
            graph = self._graphs.get(shape)
            if graph is None and shape in self._seen:  # its sizes were had before: the capture allocates nothing
                graph = self._graphs[shape] = self._capture(lambda: self._forward(pad.rows, inp, keys))
            if graph is None:
                self._seen.add(shape)
                self._forward(pad.rows, inp, keys)
                self._drop_stale_graphs()  # the warm-up may have grown a scratch the graphs use
            else:
                graph.launch()
                self.graph_replays += 1
        if inp.sample is not None:  # ops.sample: the host sampler's chain without penalties
            ops.sample(self.dev, self.logits, inp.sample, self.drawn, rows=len(out_rows), vocab=cfg.vocab_size,
                       stream=st)
        rows = [(i, int(w[0]), len(w)) for i, w in enumerate(want) if len(w)]
        pending = PendingStep(slot, chunks, rows, asks, len(out_rows))
        self._copy_back(pending)
        self._inflight[slot] = self._last = pending
        self._slot ^= 1
        return pending

    def feed_sources(self, chunks: list[SeqChunk], feed: list[int | None]) -> np.ndarray:
        """Per row, the row of the step submitted last's draws that is its token, or -1 (step.feed_sources)."""
        return feed_sources(chunks, feed, self._last)

    def _copy_back(self, p: PendingStep) -> None:
        """Queue, on the stream behind the step, the copies of what the host wants into the slot's pinned
        memory (the logits rows not drawn on the device, then the draws), and mark where they are done."""
        st, V, slot = self.stream, self.config.vocab_size, p.slot
        if p.host_rows:
            total = sum(cnt for _, _, cnt in p.host_rows) * V * 4
            buf = self._h_logits[slot]
            if buf is None or buf.nbytes < total:
                if buf is not None:
                    buf.free()  # nothing copies into it still: the step that had this slot was collected
                buf = self._h_logits[slot] = self.dev.pinned(max(total, 4 * V * 8))
            at = 0
            for _, r, cnt in p.host_rows:
                self.logits.view(r * V, cnt * V).download_into(buf, cnt * V * 4, st, host_offset=at)
                at += cnt * V * 4
        if p.sampled:
            self.drawn.view(0, p.n_out).download_into(self._h_tokens[slot], 4 * p.n_out, st)
        self._done[slot].record(st)
        p.landing = Landing(self.dev, self._done[slot], self._h_tokens[slot], self._h_logits[slot], V)

    def _stage(self, slot: int, nbytes: int):
        """The slot's pinned memory for a step's inputs, at least nbytes (its step before was collected)."""
        buf = self._h_in[slot]
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = self._h_in[slot] = self.dev.pinned(max(nbytes, 4096) * 2)
        return buf

    def _sample_params(self, chunks: list[SeqChunk], want: list[np.ndarray], asks: list[int],
                       n_out: int) -> np.ndarray | None:
        """The SampleParams of the step's logits rows, packed (rows not drawn: greedy, ignored), to upload with
        the step's inputs; None where no chunk asks to be sampled."""
        if not asks:
            return None
        temp, top_p = np.zeros(n_out, np.float32), np.ones(n_out, np.float32)  # rows not drawn: greedy, ignored
        top_k, min_p = np.zeros(n_out, np.int32), np.zeros(n_out, np.float32)
        seed, step = np.zeros(n_out, np.uint64), np.zeros(n_out, np.uint32)
        for i in asks:
            r, d = int(want[i][0]), chunks[i].sample
            assert d is not None
            temp[r], top_k[r], top_p[r], min_p[r] = d.temperature, d.top_k, d.top_p, d.min_p
            seed[r], step[r] = d.seed & (2**64 - 1), d.step & (2**32 - 1)
        packed = np.zeros(ops.SampleParams.nbytes(n_out), np.uint8)
        ops.SampleParams.pack(packed, n_out, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              step=step)
        return packed

    def _graph_shape(self, chunks: list[SeqChunk]) -> hyper_keys.Pad | None:
        """The padded shape a decode step (one token a sequence, each asking its logits) is captured at:
        the sequences to a power of two, the context to one of at least GRAPH_MIN_CONTEXT; None (run
        eagerly) for any other step, or one past the largest graphs."""
        if not self.graphs or any(len(c.tokens) != 1 or c.logits != "last" for c in chunks):
            return None
        rows = 1 << (len(chunks) - 1).bit_length()
        context = max(GRAPH_MIN_CONTEXT, 1 << (max(c.start for c in chunks)).bit_length())
        if rows > self.max_rows or rows * context > GRAPH_MAX_POSITIONS:
            return None
        return hyper_keys.Pad(rows, context, trash=self.n_blocks * self.block_size)

    def _drop_stale_graphs(self) -> None:
        """Forget the captured graphs if a buffer they read has moved since they were captured."""
        if self._graph_bufs.moves != self._graph_moves:
            self._graphs.clear()
            self._graph_moves = self._graph_bufs.moves

    def _capture(self, forward):
        """One step's launches as a CUDA graph (their buffers and sizes fixed; its inputs uploaded before
        each replay), its kernels chained by programmatic dependent launch where the card has it (each
        waits in grid_dependency_sync for the one before: `ember bench trace` finds a kernel that does not)."""
        from ember.kernels.cuda_runtime import Graph, pdl_launches

        self.stream.synchronize()
        with Graph.capture(self.stream) as g, pdl_launches(self.dev.caps.pdl):
            forward()
        return g

    def _forward(self, n: int, inp: _Inputs, keys: hyper_keys.StepKeys) -> None:
        """The step's kernels, from the token ids to the logits of the rows inp.out_rows names."""
        cfg, h, dev, st = self.config, self.h, self.dev, self.stream
        # the embeddings, one copy a stream
        ops.embed(dev, self.w.token_embd, self.a, inp.tok, n=n,
                  feed=(self.drawn, inp.feed) if inp.feed is not None else None, stream=st)
        ops.gather_rows(dev, self.a, inp.rep, self.x, n=n * h.hc_mult, cols=cfg.hidden, stream=st)
        for li, lw in enumerate(self.w.layers):
            if self.dspark is not None:  # the streams entering the layer, where the drafter reads them
                self.dspark.tap(li, n)
            self._attention(li, lw, n, inp, keys)
            self._mlp(lw, n, inp.tok)
        if self.dspark is not None:
            self.dspark.tap(len(self.w.layers), n)
        self._head(inp)
        if self.dspark is not None:
            self.dspark.write_rows(n, inp)
        if self.mtp is not None:  # after the head: the layer's rows take the streams over
            self.mtp.write_rows(n, inp)

    def _inputs(self, chunks: list[SeqChunk], tokens: np.ndarray, keys: hyper_keys.StepKeys,
                out_rows: np.ndarray, sample: np.ndarray | None, feed: np.ndarray | None, slot: int,
                padded: bool = False) -> _Inputs:
        """The step's host plan on the device, in one copy from the slot's pinned memory, on the stream
        (padded rows: position 0, the trash block's row); sample: the packed SampleParams of the rows drawn
        on the device, if any; feed: the rows fed from the step before's draws (submit's sources)."""
        n, real = len(tokens), sum(len(c.tokens) for c in chunks)
        pos = np.zeros(n, np.int32)
        pos[:real] = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        slots = np.full(n, self.n_blocks * self.block_size, np.int32)
        slots[:real] = kv_slots(chunks, self.block_size, self.n_blocks)
        host = {"tok": tokens, "pos": pos, "slots": slots, "prow": keys.prow, "wrows": keys.wrows,
                "rep": np.repeat(np.arange(n, dtype=np.int32), self.h.hc_mult)}
        for r, kl in keys.lists.items():
            host[f"idx{r}"], host[f"cnt{r}"] = kl.idx, kl.cnt
        if keys.crow is not None and keys.ccnt is not None:
            host["crow"], host["ccnt"] = keys.crow, keys.ccnt
        for r, comp in keys.comp.items():
            host[f"pieces{r}"] = comp.pieces
        for r, cl in keys.closing.items():
            host[f"starts{r}"], host[f"cpos{r}"], host[f"closed{r}"] = cl.starts, cl.positions, cl.pieces
        if len(out_rows):
            host["out_rows"] = out_rows
        if sample is not None:
            host["sample"] = sample
        if feed is not None:
            host["feed"] = feed
        if self.mtp is not None:
            # the h before each row: the pool's at p - 1 (this step's own rows are stored before they are read);
            # a row at position 0 reads its own row, then takes zeros; a padded row reads the trash row
            before = [hyper_keys.pool_rows(ch.table, np.maximum(np.arange(c.start - 1, c.start + len(c.tokens) - 1), 0),
                                           self.block_size) for c, ch in zip(chunks, keys.chunks, strict=True)]
            prev = slots.copy()
            prev[:real] = np.concatenate(before) if before else prev[:real]
            firsts = np.nonzero(pos[:real] == 0)[0]
            prev[firsts] = slots[firsts]
            if padded:  # a captured step's count is fixed: the rest zero the spare row past the step's
                firsts = np.concatenate([firsts, np.full(n - len(firsts), n)])
            host["prev"], host["firsts"] = prev, firsts.astype(np.int32)
        d = self.bufs.upload(host, lambda nbytes: self._stage(slot, nbytes), self.stream)
        cand = None
        if keys.crow is not None and keys.ccnt is not None:
            cand = (d["crow"], d["ccnt"], keys.crow.shape[1])
            self.bufs.get("cnt_csa", n, np.int32)
        return _Inputs(
            tok=d["tok"], pos=d["pos"], slots=d["slots"], prow=d["prow"], wrows=d["wrows"], rep=d["rep"],
            lists={r: (d[f"idx{r}"], d[f"cnt{r}"], kl.idx.shape[1]) for r, kl in keys.lists.items()},
            cand=cand, comp={r: (d[f"pieces{r}"], c.rows) for r, c in keys.comp.items()},
            closing={r: (d[f"starts{r}"], d[f"cpos{r}"], d[f"closed{r}"], c.blocks) for r, c in keys.closing.items()},
            out_rows=d.get("out_rows"), n_out=len(out_rows), sample=d.get("sample"), feed=d.get("feed"),
            prev=d.get("prev"), firsts=(d["firsts"], len(host["firsts"])) if "firsts" in d else None)

    def _linear(self, w: ops.QuantMatrix, x: DeviceArray, y: DeviceArray, n: int) -> None:
        """y = x @ W^T over n rows: on the tensor cores from TC_MIN_ROWS rows (Matmuls.linear decides)."""
        self.mm.linear(w, x, y, n, tc=self.tensor_cores and w.cols % GEMM_TILE_K == 0)

    def _mix(self, mix, n: int) -> None:
        """A hyper-connection's input mix of the streams self.x: self.a the sublayer's input; self.post, self.comb."""
        self._hc_mix(mix, self.x, n, self.post, self.comb)

    def _hc_mix(self, mix, streams: DeviceArray, n: int, post: DeviceArray | None, comb: DeviceArray | None) -> None:
        """self.a = streams [n, hc, hidden] mixed by (fn, scale, base); post and comb for hc_merge (None: a
        head's mix). A decode's few rows in hc_mix's two launches; more, the mix logits (hc_logits), then hc_pre."""
        h, cfg = self.h, self.config
        fn, scale, base = mix
        hc, hid, eps, hc_eps, iters = h.hc_mult, cfg.hidden, cfg.norm_eps, h.hc_eps, h.hc_sinkhorn_iters
        if ops.hc_mix_supported(fn, n=n, hc=hc, hidden=hid):
            ops.hc_mix(self.dev, streams, fn, scale, base, self.a, post, comb, self.mix_work, n=n, hc=hc, hidden=hid,
                       eps=eps, hc_eps=hc_eps, iters=iters, stream=self.stream)
            return
        if fn.type == "f32":  # float32 throughout (the module docstring), many tokens a block
            ops.hc_logits(self.dev, streams, fn, self.raw, n=n, stream=self.stream)
        else:
            self.mm.linear(fn, streams, self.raw, n, tc=False)
        ops.hc_pre(self.dev, streams, self.raw, scale, base, self.a, post, comb, n=n, hc=hc, hidden=hid, eps=eps,
                   hc_eps=hc_eps, iters=iters, stream=self.stream)

    def _rope_tail(self, x: DeviceArray, pos: DeviceArray, freqs: DeviceArray, *, n: int, heads: int, dim: int,
                   inverse: bool = False) -> None:
        """RoPE on the last n_rot dimensions of each of `heads` heads of `dim` (twin: hyper.rope_tail)."""
        r = self.h.n_rot
        ops.rope(self.dev, x.view(dim - r, x.size - (dim - r)), None, pos, freqs, n=n, hq=heads, hk=0, head_dim=r,
                 neox=False, ldq=heads * dim, head_stride=dim, inverse=inverse, stream=self.stream)

    def _store(self, src: DeviceArray, col: slice, slots: DeviceArray, n: int, ape=None) -> None:
        """A step's rows into the pool's columns `col` at its slots."""
        width = col.stop - col.start
        ops.store_rows(self.dev, src, slots, self.pool.view(col.start, self.pool.size - col.start), n=n, width=width,
                       lds=width, ldd=self.width, ape=ape, stream=self.stream)

    def _key_row(self, lw: HyperLayer, n: int, pos: DeviceArray, freqs: DeviceArray, *, fan: bool = False) -> bool:
        """The attention's input (self.hn, from the streams' mix: self.post, self.comb) and the one KV head's
        row of each position (self.kvr, normed, RoPE on its tail). fan: every projection of self.hn at once
        where _fan_out can (then the query's and the compressors' rows are made too): whether it did."""
        cfg, dev, st, eps, D = self.config, self.dev, self.stream, self.config.norm_eps, self.config.head_dim
        self._mix(lw.attn_mix, n)
        ops.rms_norm(dev, self.a, lw.attn_norm, self.hn, eps=eps, rows=n, cols=cfg.hidden, stream=st)
        fanned = fan and self._fan_out(lw, n)
        if not fanned:
            self._linear(lw.kv, self.hn, self.kvr, n)
        ops.rms_norm(dev, self.kvr, lw.kv_norm, self.kvr, eps=eps, rows=n, cols=D, stream=st)
        self._rope_tail(self.kvr, pos, freqs, n=n, heads=1, dim=D)
        return fanned

    def _fan_out(self, lw: HyperLayer, n: int) -> bool:
        """At batch 1, what reads self.hn in the attention (its key row, its low-rank query, its compressor's and
        indexer's rows: self.kvr, self.qa, self.ckv, self.csc, self.ikv, self.isc) in one launch, where the layer
        stacks them (HyperLayer.attn_in): whether it did."""
        if n != 1 or lw.attn_in is None:
            return False
        mats, outs = [lw.kv, lw.q_a], [self.kvr, self.qa]
        for part, made in ((lw.compressor, (self.ckv, self.csc)), (lw.indexer, (self.ikv, self.isc))):
            if part is not None:
                mats += part[:2]
                outs += made
        rows = [m.rows for m in mats]
        if not ops.matvec_fan_supported(self.dev, lw.attn_in, rows):
            return False
        ops.matvec_fan(self.dev, lw.attn_in, self.hn, outs, rows=rows, stream=self.stream)
        return True

    def _query(self, lw: HyperLayer, n: int, pos: DeviceArray, freqs: DeviceArray, *, fanned: bool = False) -> None:
        """The low-rank query from self.hn (its normed rank rows, self.qa, the indexer reads too; fanned: made by
        _fan_out already), its heads normed, RoPE on their tails: self.q."""
        cfg, h, dev, st, eps = self.config, self.h, self.dev, self.stream, self.config.norm_eps
        H, D = cfg.n_heads, cfg.head_dim
        if not fanned:
            self._linear(lw.q_a, self.hn, self.qa, n)
        ops.rms_norm(dev, self.qa, lw.q_a_norm, self.qa, eps=eps, rows=n, cols=h.q_lora_rank, stream=st)
        self._linear(lw.q_b, self.qa, self.q, n)
        ops.rms_norm(dev, self.q, self.w.ones, self.q, eps=eps, rows=n * H, cols=D, heads=H, stream=st)
        self._rope_tail(self.q, pos, freqs, n=n, heads=H, dim=D)

    def _attend(self, lw: HyperLayer, n: int, pos: DeviceArray, freqs: DeviceArray, keys: DeviceArray,
                idx: DeviceArray, cnt: DeviceArray, ldi: int) -> None:
        """Attention of self.q over the key rows each query's list names, its heads' RoPE undone, through the
        grouped low-rank output, merged into the streams self.x."""
        cfg, h, dev, st, H, D = self.config, self.h, self.dev, self.stream, self.config.n_heads, self.config.head_dim
        ops.attend_rows(dev, self.q, keys, idx, cnt, lw.sinks, self.att, n=n, heads=H, head_dim=D, ld=D, ldi=ldi,
                        stream=st)
        self._rope_tail(self.att, pos, freqs, n=n, heads=H, dim=D, inverse=True)
        # each group of heads through its own matrix
        G, rank = h.o_groups, h.o_lora_rank
        gw = H * D // G
        if n == 1 and ops.matvec_groups_supported(lw.o_a_all, G):  # one token's heads are [G, gw] already
            ops.matvec_groups(dev, lw.o_a_all, self.att, self.oa2, groups=G, stream=st)
        else:
            ops.swap_rows(dev, self.att, self.grouped, a=n, b=G, width=gw, stream=st)  # [G, n, gw]
            for g, wg in enumerate(lw.o_a):
                self._linear(wg, self.grouped.view(g * n * gw, n * gw), self.oa.view(g * n * rank, n * rank), n)
            ops.swap_rows(dev, self.oa, self.oa2, a=G, b=n, width=rank, stream=st)  # [n, G * rank]
        self._linear(lw.o_b, self.oa2, self.y, n)
        ops.hc_merge(dev, self.x, self.y, self.post, self.comb, n=n, hc=h.hc_mult, hidden=cfg.hidden, stream=st)

    def _attention(self, li: int, lw: HyperLayer, n: int, inp: _Inputs, keys: hyper_keys.StepKeys) -> None:
        cfg, h, dev, st = self.config, self.h, self.dev, self.stream
        D, W = cfg.head_dim, self.width
        ratio, cols = lw.ratio, self.columns[li]
        freqs = self.w.rope_compressed if ratio else self.w.rope_window
        fanned = self._key_row(lw, n, inp.pos, freqs, fan=True)
        self._query(lw, n, inp.pos, freqs, fanned=fanned)
        # the key row, and the compressors' rows, into the pool
        self._store(self.kvr, cols["kv"], inp.slots, n)
        if lw.compressor is not None:
            ckv, cgate, ape, _ = lw.compressor
            if not fanned:
                self._linear(ckv, self.hn, self.ckv, n)
                self._linear(cgate, self.hn, self.csc, n)
            self._store(self.ckv, cols["c_kv"], inp.slots, n)
            self._store(self.csc, cols["c_score"], inp.slots, n, ape=(ape, inp.pos, ratio))
        if lw.indexer is not None:
            ikv, igate, iape, _ = lw.indexer
            if not fanned:
                self._linear(ikv, self.hn, self.ikv, n)
                self._linear(igate, self.hn, self.isc, n)
            self._store(self.ikv, cols["i_kv"], inp.slots, n)
            self._store(self.isc, cols["i_score"], inp.slots, n, ape=(iape, inp.pos, ratio))
            assert lw.indexer_q_b is not None and lw.indexer_proj is not None
            self._linear(lw.indexer_q_b, self.qa, self.iq, n)
            self._rope_tail(self.iq, inp.pos, self.w.rope_compressed, n=n, heads=h.indexer_heads, dim=h.indexer_dim)
            self._linear(lw.indexer_proj, self.hn, self.iw, n)

        if ratio:  # the compressed rows of the blocks this step closes, into the pool
            self._close(lw, ratio, cols, inp)
        # one scratch of key rows for the whole step: every chunk's window rows, then the layer's compressed rows
        idx, cnt, ldi = inp.lists[ratio]
        M, rows = keys.window_rows, keys.scratch_rows
        kscratch = self.bufs.get("keys", rows * D)
        iscratch = self.bufs.get("ikeys", rows * h.indexer_dim) if lw.indexer is not None else None
        ops.gather_rows(dev, self.pool.view(cols["kv"].start, self.pool.size - cols["kv"].start), inp.wrows,
                        kscratch, n=M, cols=D, ldx=W, stream=st)
        if ratio:
            self._compressed(lw, ratio, cols, inp, M, kscratch, iscratch)
        if ratio == CSA and inp.cand is not None and iscratch is not None:
            # the indexer appends its picks to a copy of the window's lists (the counts are per layer)
            base, cnt = cnt, self.bufs.get("cnt_csa", n, np.int32)
            cnt.copy_from(base, 4 * n, st)
            crow, ccnt, ldc = inp.cand
            score = self.bufs.get("score", n * ldc)
            ops.indexer_scores(dev, self.iq, self.iw, iscratch, crow, ccnt, score, n=n, heads=h.indexer_heads,
                               dim=h.indexer_dim, ld=h.indexer_dim, ldc=ldc, stream=st)
            ops.top_k_rows(dev, score, crow, ccnt, idx, cnt, n=n, k=h.indexer_top_k, ldc=ldc, ldi=ldi, stream=st)
        self._attend(lw, n, inp.pos, freqs, kscratch, idx, cnt, ldi)

    def _close(self, lw: HyperLayer, ratio: int, cols, inp: _Inputs) -> None:
        """The compressed rows of the blocks whose last position the step computes (normed, RoPE at each row's
        first position), made from their positions' pool rows and stored as their pieces in the pool; in a
        CSA layer the indexer's rows likewise (twin: HyperStack._close_blocks)."""
        cfg, h, dev, st, W, D = self.config, self.h, self.dev, self.stream, self.width, self.config.head_dim
        starts, positions, pieces, blocks = inp.closing[ratio]
        if not blocks:
            return
        s = HyperStack.spread(ratio, self.block_size)

        def make(kv: slice, score: slice, piece: slice, width: int, norm: DeviceArray) -> None:
            out = self.bufs.get("closed", blocks * width)
            ops.compress_rows(dev, self.pool.view(kv.start, self.pool.size - kv.start),
                              self.pool.view(score.start, self.pool.size - score.start), inp.prow, starts, out, ld=W,
                              blocks=blocks, ratio=ratio, width=width, overlap=ratio == CSA, stream=st)
            ops.rms_norm(dev, out, norm, out, eps=cfg.norm_eps, rows=blocks, cols=width, stream=st)
            self._rope_tail(out, positions, self.w.rope_compressed, n=blocks, heads=1, dim=width)
            self._store(out, piece, pieces, blocks * s)

        assert lw.compressor is not None
        make(cols["c_kv"], cols["c_score"], cols["c_row"], D, lw.compressor[3])
        if lw.indexer is not None:
            make(cols["i_kv"], cols["i_score"], cols["i_row"], h.indexer_dim, lw.indexer[3])

    def _compressed(self, lw: HyperLayer, ratio: int, cols, inp: _Inputs, M: int, kscratch: DeviceArray,
                    iscratch: DeviceArray | None) -> None:
        """Every chunk's compressed rows of this layer after the window rows in the key scratch, gathered from
        their pieces in the pool; in a CSA layer the indexer's rows likewise, at the same rows of its scratch."""
        dev, st, W, D = self.dev, self.stream, self.width, self.config.head_dim
        pieces, n_comp = inp.comp[ratio]
        if not n_comp:
            return
        s = HyperStack.spread(ratio, self.block_size)

        def gather(piece: slice, width: int, scratch: DeviceArray) -> None:
            ops.gather_rows(dev, self.pool.view(piece.start, self.pool.size - piece.start), pieces,
                            scratch.view(M * width, n_comp * width), n=n_comp * s, cols=width // s, ldx=W, stream=st)

        gather(cols["c_row"], D, kscratch)
        if lw.indexer is not None and iscratch is not None:
            gather(cols["i_row"], self.h.indexer_dim, iscratch)

    def _mlp(self, lw: HyperLayer, n: int, tok: DeviceArray) -> None:
        """The shared expert plus the routed experts (hash-routed by token id, or by their top k with the
        selection bias), each a clamped SwiGLU, merged back into the streams."""
        cfg, h, dev, st, s = self.config, self.h, self.dev, self.stream, self.moe
        hid, k = cfg.hidden, cfg.n_experts_used
        self._mix(lw.ffn_mix, n)
        ops.rms_norm(dev, self.a, lw.ffn_norm, self.hn, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
        ffs = lw.shared_gate.rows
        if lw.shared_gate_up is not None:  # [gate | up] in one matmul
            self._linear(lw.shared_gate_up, self.hn, self.sgu, n)
            ops.clamped_swiglu(dev, self.sgu, self.sgu.view(ffs, self.sgu.size - ffs), self.sg, n=n, ffn=ffs,
                               limit=lw.clamp_shared, ldg=2 * ffs, ldu=2 * ffs, stream=st)
        else:
            self._linear(lw.shared_gate, self.hn, self.sg, n)
            self._linear(lw.shared_up, self.hn, self.su, n)
            ops.clamped_swiglu(dev, self.sg, self.su, self.sg, n=n, ffn=ffs, limit=lw.clamp_shared, stream=st)
        self._linear(lw.shared_down, self.sg, self.ysh, n)

        ex = lw.experts
        E, ffn, pairs = ex.experts, ex.ffn, n * k
        if n == 1:  # the split matvec, a block a row (matvec_rows' 8-row blocks kept all but 64 SMs idle: 13.9 us)
            self._linear(ex.router, self.hn, s.logits, 1)
        else:
            ops.matvec_rows(dev, ex.router, self.hn, s.logits, n=n, stream=st)
        mats = [m for m in (ex.gate_up, ex.gate, ex.up, ex.down) if m is not None]
        pair_tiles = n <= PAIR_TILE_MAX_ROWS and all(ops.qmoc_supported(m, s.xs) for m in mats)
        tiles = self.expert_tiles and n >= QGEMM_MIN_ROWS and not pair_tiles
        if tiles:  # tiles of 64 pairs where experts average 32 or more (prefill), else of 16
            tile = QGEMM_TILES[1] if 2 * pairs >= QGEMM_TILES[1] * E else QGEMM_TILES[0]
        else:  # the grouped matvec: tiles of one pair (one token, or a few tokens' low-bit experts), else of 8
            tile = 1 if n == 1 or pair_tiles else TILE_ROWS
        hashed = (lw.token_experts, tok) if lw.token_experts is not None else None
        nt = ops.moe_route_group(dev, s.logits, s, n=n, experts=E, k=k, gating="sqrt-softplus",
                                 norm_topk=h.expert_weights_norm, tile=tile, bias=lw.select_bias,
                                 scale=h.expert_weights_scale, hashed=hashed, stream=st)
        gu = s.gu
        assert gu is not None
        # gate | up per pair in grouped order (stacked: [pairs, 2 ffn]; apart: gate's pairs, then up's)
        stacked = ex.gate_up is not None
        parts = [(ex.gate_up, gu)] if stacked else [(ex.gate, gu), (ex.up, gu.view(pairs * ffn, pairs * ffn))]
        if tiles:  # the tokens' rows read in place through the grouped order
            for w, out in parts:
                assert w is not None
                ops.moe_gemm(dev, w, s.tiles, nt, self.hn, out, tile=tile, half=self.mm.half_kind, order=s.order,
                             k=k, stream=st)
        else:
            per_pair = n > 1
            xs = s.xs if per_pair else self.hn
            if per_pair:
                ops.moe_gather(dev, self.hn, s, n=n, k=k, hidden=hid, stream=st)
            for w, out in parts:
                assert w is not None
                int8 = self.int8_experts and tile == 1 and ops.moe.qmoc8_supported(w, xs)
                ops.moe_matvec(dev, w, s.tiles, nt, xs, out, tile=tile, x_per_pair=per_pair, int8=int8, stream=st)
        g, u, ld = (gu, gu.view(ffn, gu.size - ffn), 2 * ffn) if stacked else (gu, parts[1][1], ffn)
        ops.clamped_swiglu(dev, g, u, s.hs, n=pairs, ffn=ffn, limit=lw.clamp, ldg=ld, ldu=ld, stream=st)
        if tiles:
            ops.moe_gemm(dev, ex.down, s.tiles, nt, s.hs, s.ys, tile=tile, half=self.mm.half_kind, stream=st)
        else:
            int8 = self.int8_experts and tile == 1 and ops.moe.qmoc8_supported(ex.down, s.hs)
            ops.moe_matvec(dev, ex.down, s.tiles, nt, s.hs, s.ys, tile=tile, int8=int8, stream=st)
        # the experts' outputs weighed and summed onto the shared expert's
        ops.moe_combine(dev, s, self.y, n=n, k=k, hidden=hid, res=self.ysh, stream=st)
        ops.hc_merge(dev, self.x, self.y, self.post, self.comb, n=n, hc=h.hc_mult, hidden=hid, stream=st)

    def _head(self, inp: _Inputs) -> None:
        """The logits of the rows inp.out_rows names, into self.logits (twin: HyperStack.head)."""
        if inp.out_rows is None:
            return
        hcw = self.h.hc_mult * self.config.hidden
        xo = self.bufs.get("x_out", inp.n_out * hcw)
        ops.gather_rows(self.dev, self.x, inp.out_rows, xo, n=inp.n_out, cols=hcw, stream=self.stream)
        self.logits_of(xo, inp.n_out, self.w.output_mix, self.w.output_norm, self.w.output)

    def logits_of(self, streams: DeviceArray, n: int, mix, norm: DeviceArray, out: ops.QuantMatrix) -> None:
        """Logits [n, vocab] into self.logits from streams [n, hc, hidden]: mixed into one by a head's (fn,
        scale, base), normed, projected (the model's head, or the next-token layer's)."""
        cfg, dev, st, mm = self.config, self.dev, self.stream, self.mm
        self._hc_mix(mix, streams, n, None, None)
        ops.rms_norm(dev, self.a, norm, self.hn, eps=cfg.norm_eps, rows=n, cols=cfg.hidden, stream=st)
        mm.linear(out, self.hn, self.logits, n, tc=False)


def tensor_core_matrices(w: HyperWeights, mtp: MtpWeights | None, dspark: DSparkWeights | None, *,
                         hc: int) -> list[tuple[ops.QuantMatrix, int]]:
    """The matrices a step's _linear may multiply on the tensor cores, each with how many of its input rows a
    step row makes (the next-token layer's input projection: every stream's). Not the embeddings, the heads or
    the mixes' logits (hc_mix, hc_logits, or a matvec with tc=False); not the routers, which reach _linear at
    one row only (more take matvec_rows); of the next-token layer, only what its rows are written with at
    every step (write_rows: the input projection and the key row), for its drafts run a row at a time."""
    never = {id(m) for lw in w.layers for m in (lw.attn_mix[0], lw.ffn_mix[0], lw.experts.router)}
    never.add(id(w.output_mix[0]))
    rows = [(m, 1) for m in w.matrices() if m is not w.output and m is not w.token_embd and id(m) not in never]
    if mtp is not None:
        rows += [(mtp.eh_proj, hc), (mtp.layer.kv, 1)]
    if dspark is not None:
        rows += [(m, 1) for m in dspark.key_rows()]
    return [(m, r) for m, r in rows if m.cols % GEMM_TILE_K == 0]


def _wanted(chunks: list[SeqChunk], pad: hyper_keys.Pad | None) -> tuple[list[np.ndarray], np.ndarray]:
    """Which step rows' logits the head computes (out_rows), and for each chunk the indices of its rows' among
    them (twin: chunk_logits). A padded step computes every row's, chunk t's its row t."""
    rows: list[int] = []
    want, a = [], 0
    for c in chunks:
        b = a + len(c.tokens)
        mine = [] if c.logits == "none" else [b - 1] if c.logits == "last" else list(range(a, b))
        want.append(np.arange(len(rows), len(rows) + len(mine)))
        rows += mine
        a = b
    if pad is not None:
        return [np.array([t]) for t in range(len(chunks))], np.arange(pad.rows, dtype=np.int32)
    return want, np.asarray(rows, np.int32)
