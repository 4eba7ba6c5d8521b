"""One step of DeepSeek V4 (recipe.Stack.HYPER) on the GPU: the numpy twin's pass (backends/numpy/hyper.py,
HyperStack.logits) through ember.kernels.ops, over the per-position pool the backend holds (hyper.py).

Per layer: the hyper-connections' mix (a matmul, then hc_pre), the low-rank query and the one KV head's
row (RoPE on their last n_rot dimensions), the step's rows into the pool (store_rows: the key row, and by
the layer's compress ratio the compressor's and the indexer's value and score rows), then each chunk's
attention over a scratch of key rows: its window's rows gathered from the pool, then the compressed rows
it sees made from the pool's (compress_rows, normed, RoPE at each row's first position); in a CSA layer
the lightning indexer's scores of its candidates and its top k appended to each query's list
(hyper_keys.py plans the lists on the host). The heads' output turns back, goes through the grouped
low-rank projection and merges into the streams; then the MLP's mix, the shared expert and the routed
ones (hash-routed by token id in the first layers), each a clamped SwiGLU. Every matmul is the matvec on
the weights' own blocks (matmul.py, no tensor cores, float activations: closest to the twin).
"""

from __future__ import annotations

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray
from ember.kernels.ops.moe import TILE_ROWS

from ...model.config import ModelConfig
from ..base import SeqChunk, kv_slots
from ..numpy.hyper import CSA, HyperStack
from . import hyper_keys
from .hyper_weights import HyperLayer, HyperWeights
from .matmul import Matmuls


class _Buffers:
    """Device buffers that grow to the largest a step has needed (a step's key lists and candidate rows
    depend on its contexts); eager steps only, so a buffer may move between steps."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._have: dict[str, DeviceArray] = {}

    def get(self, name: str, elems: int, dtype=np.float32) -> DeviceArray:
        a = self._have.get(name)
        if a is None or a.size < elems:
            a = self._have[name] = self.dev.empty((max(elems, 1),), dtype)
        return a

    def put(self, name: str, host: np.ndarray) -> DeviceArray:
        host = np.ascontiguousarray(host)
        a = self.get(name, host.size, host.dtype)
        a.view(0, host.size).upload(host)
        return a


class HyperStep:
    """The step's buffers (allocated once for max_rows rows; the key lists' grow with the contexts) and its
    kernels, over `pool`: (n_blocks + 1) * block_size rows of HyperStack.width(config) floats."""

    def __init__(self, dev: Device, stream, config: ModelConfig, weights: HyperWeights, pool: DeviceArray, *,
                 n_blocks: int, block_size: int, max_rows: int):
        assert config.hyper is not None
        self.dev, self.stream, self.config, self.h, self.w, self.pool = dev, stream, config, config.hyper, weights, pool
        self.n_blocks, self.block_size, self.max_rows = n_blocks, block_size, max_rows
        self.columns, self.width = HyperStack.layout(config), HyperStack.width(config)
        self._alloc(max_rows)

    def _alloc(self, R: int) -> None:
        cfg, h, e = self.config, self.h, self.dev.empty
        hid, hc, H, D = cfg.hidden, h.hc_mult, cfg.n_heads, cfg.head_dim
        mix = (2 + hc) * hc
        ffn = self.w.layers[0].experts.ffn
        ffn_shared = self.w.layers[0].shared_gate.rows
        self.x, self.a, self.hn = e((R * hc * hid,)), e((R * hid,)), e((R * hid,))
        self.raw, self.post, self.comb = e((R * mix,)), e((R * hc,)), e((R * hc * hc,))
        self.qa, self.q, self.kvr = e((R * h.q_lora_rank,)), e((R * H * D,)), e((R * D,))
        self.att, self.grouped = e((R * H * D,)), e((R * H * D,))
        grouped = R * h.o_groups * h.o_lora_rank
        self.oa, self.oa2, self.y = e((grouped,)), e((grouped,)), e((R * hid,))
        self.ckv, self.csc = e((R * 2 * D,)), e((R * 2 * D,))
        di, ih = h.indexer_dim, h.indexer_heads
        self.ikv, self.isc, self.iq, self.iw = e((R * 2 * di,)), e((R * 2 * di,)), e((R * ih * di,)), e((R * ih,))
        self.sg, self.su, self.ysh = e((R * ffn_shared,)), e((R * ffn_shared,)), e((R * hid,))
        self.moe = ops.MoeScratch.alloc(self.dev, R, self.w.layers[0].experts.experts, cfg.n_experts_used, hid, ffn,
                                        apart=True)
        self.logits = e((R * cfg.vocab_size,))
        self.mm = Matmuls(self.dev, self.stream, cfg, self.w.output, int8_activations=False, tensor_cores=False,
                          half_kind=cfg.recipe.half_type, g=self.sg, u=self.su, gu=None)
        self.bufs = _Buffers(self.dev)
        # the compressed rows' positions (row j of a ratio starts at position j * ratio), for their RoPE
        most = (self.n_blocks * self.block_size) // min((r for r in h.compress_ratios if r), default=1) + 1
        self.comp_pos = {r: self.dev.to_device((np.arange(most) * r).astype(np.int32))
                         for r in set(h.compress_ratios) if r}

    def run(self, chunks: list[SeqChunk]) -> list:
        """Each chunk's logits as it asks for them (None for "none"), float32 on the host."""
        cfg, h, dev, st = self.config, self.h, self.dev, self.stream
        n = sum(len(c.tokens) for c in chunks)
        if n > self.max_rows:
            raise ValueError(f"a step of {n} tokens exceeds this backend's {self.max_rows} rows")
        tokens = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            raise ValueError("token id out of range")
        st.synchronize()  # the step before is done with every buffer this one fills
        keys = hyper_keys.plan(chunks, block_size=self.block_size, window=h.window,
                               ratios=set(h.compress_ratios), top_k=h.indexer_top_k)
        b = self.bufs
        tok = b.put("tok", tokens)
        pos = b.put("pos", np.concatenate([np.arange(c.start, c.start + len(c.tokens), dtype=np.int32)
                                           for c in chunks]))
        slots = b.put("slots", kv_slots(chunks, self.block_size, self.n_blocks).astype(np.int32))
        prow = b.put("prow", keys.prow)
        lists = {r: (b.put(f"idx{r}", kl.idx), b.put(f"cnt{r}", kl.cnt), kl.idx.shape[1])
                 for r, kl in keys.lists.items()}
        cand = None
        if keys.crow is not None and keys.ccnt is not None:
            cand = (b.put("crow", keys.crow), b.put("ccnt", keys.ccnt), keys.crow.shape[1])
            b.get("cnt_csa", n, np.int32)
        spans, at = [], 0
        for c in chunks:
            spans.append((at, at + len(c.tokens)))
            at += len(c.tokens)
        rep = b.put("rep", np.repeat(np.arange(n, dtype=np.int32), h.hc_mult))

        # the embeddings, one copy a stream
        ops.embed(dev, self.w.token_embd, self.a, tok, n=n, stream=st)
        ops.gather_rows(dev, self.a, rep, self.x, n=n * h.hc_mult, cols=cfg.hidden, stream=st)
        for li, lw in enumerate(self.w.layers):
            self._attention(li, lw, n, pos, slots, prow, keys, lists, cand, spans)
            self._mlp(lw, n, tok)
        return self._logits(chunks, spans)

    def _mix(self, mix, n: int) -> None:
        """A hyper-connection's input mix of the streams: self.a the sublayer's input; self.post, self.comb."""
        h, cfg = self.h, self.config
        fn, scale, base = mix
        self.mm.linear(fn, self.x, self.raw, n, tc=False)
        ops.hc_pre(self.dev, self.x, self.raw, scale, base, self.a, self.post, self.comb, n=n, hc=h.hc_mult,
                   hidden=cfg.hidden, eps=cfg.norm_eps, hc_eps=h.hc_eps, iters=h.hc_sinkhorn_iters, stream=self.stream)

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

    def _attention(self, li: int, lw: HyperLayer, n: int, pos, slots, prow, keys: hyper_keys.StepKeys, lists, cand,
                   spans) -> None:
        cfg, h, dev, st, mm = self.config, self.h, self.dev, self.stream, self.mm
        eps, H, D, W = cfg.norm_eps, cfg.n_heads, cfg.head_dim, self.width
        ratio, cols = lw.ratio, self.columns[li]
        freqs = self.w.rope_compressed if ratio else self.w.rope_window
        self._mix(lw.attn_mix, n)
        ops.rms_norm(dev, self.a, lw.attn_norm, self.hn, eps=eps, rows=n, cols=cfg.hidden, stream=st)
        # the low-rank query (its normed rank rows the indexer reads too), its heads normed, RoPE on their tails
        mm.linear(lw.q_a, self.hn, self.qa, n, tc=False)
        ops.rms_norm(dev, self.qa, lw.q_a_norm, self.qa, eps=eps, rows=n, cols=h.q_lora_rank, stream=st)
        mm.linear(lw.q_b, self.qa, self.q, n, tc=False)
        ops.rms_norm(dev, self.q, self.w.ones, self.q, eps=eps, rows=n * H, cols=D, heads=H, stream=st)
        self._rope_tail(self.q, pos, freqs, n=n, heads=H, dim=D)
        # the one KV head's row, and the compressors' rows, into the pool
        mm.linear(lw.kv, self.hn, self.kvr, n, tc=False)
        ops.rms_norm(dev, self.kvr, lw.kv_norm, self.kvr, eps=eps, rows=n, cols=D, stream=st)
        self._rope_tail(self.kvr, pos, freqs, n=n, heads=1, dim=D)
        self._store(self.kvr, cols["kv"], slots, n)
        if lw.compressor is not None:
            ckv, cgate, ape, _ = lw.compressor
            mm.linear(ckv, self.hn, self.ckv, n, tc=False)
            self._store(self.ckv, cols["c_kv"], slots, n)
            mm.linear(cgate, self.hn, self.csc, n, tc=False)
            self._store(self.csc, cols["c_score"], slots, n, ape=(ape, pos, ratio))
        if lw.indexer is not None:
            ikv, igate, iape, _ = lw.indexer
            mm.linear(ikv, self.hn, self.ikv, n, tc=False)
            self._store(self.ikv, cols["i_kv"], slots, n)
            mm.linear(igate, self.hn, self.isc, n, tc=False)
            self._store(self.isc, cols["i_score"], slots, n, ape=(iape, pos, ratio))
            assert lw.indexer_q_b is not None and lw.indexer_proj is not None
            mm.linear(lw.indexer_q_b, self.qa, self.iq, n, tc=False)
            self._rope_tail(self.iq, pos, self.w.rope_compressed, n=n, heads=h.indexer_heads, dim=h.indexer_dim)
            mm.linear(lw.indexer_proj, self.hn, self.iw, n, tc=False)

        idx, cnt, ldi = lists[ratio]
        if ratio == CSA and cand is not None:  # the indexer appends to a copy of the window's lists, per layer
            base, cnt = cnt, self.bufs.get("cnt_csa", n, np.int32)
            cnt.copy_from(base, 4 * n, st)
        for ci, (ch, (a, b)) in enumerate(zip(keys.chunks, spans, strict=True)):
            m = b - a
            kscratch = self.bufs.get("keys", keys.scratch_rows * D)
            iscratch = self.bufs.get("ikeys", keys.scratch_rows * h.indexer_dim) if lw.indexer is not None else None
            ops.gather_rows(dev, self.pool.view(cols["kv"].start, self.pool.size - cols["kv"].start),
                            prow.view(ch.prow_at + ch.first, ch.m), kscratch, n=ch.m, cols=D, ldx=W, stream=st)
            if ratio:
                self._compressed(lw, ratio, cols, keys.comp_rows[ratio][ci], ch, prow, kscratch, iscratch)
            if ratio == CSA and cand is not None and iscratch is not None:
                crow, ccnt, ldc = cand
                score = self.bufs.get("score", n * ldc)
                qw = h.indexer_heads * h.indexer_dim
                ih = h.indexer_heads
                ops.indexer_scores(dev, self.iq.view(a * qw, m * qw), self.iw.view(a * ih, m * ih), iscratch,
                                   crow.view(a * ldc, m * ldc), ccnt.view(a, m), score, n=m, heads=h.indexer_heads,
                                   dim=h.indexer_dim, ld=h.indexer_dim, ldc=ldc, stream=st)
                ops.top_k_rows(dev, score, crow.view(a * ldc, m * ldc), ccnt.view(a, m), idx.view(a * ldi, m * ldi),
                               cnt.view(a, m), n=m, k=h.indexer_top_k, ldc=ldc, ldi=ldi, stream=st)
            ops.attend_rows(dev, self.q.view(a * H * D, m * H * D), kscratch, idx.view(a * ldi, m * ldi),
                            cnt.view(a, m), lw.sinks, self.att.view(a * H * D, m * H * D), n=m, heads=H,
                            head_dim=D, ld=D, ldi=ldi, stream=st)
        # the heads' RoPE undone, then the grouped low-rank output: each group of heads through its own matrix
        self._rope_tail(self.att, pos, freqs, n=n, heads=H, dim=D, inverse=True)
        G, rank = h.o_groups, h.o_lora_rank
        gw = H * D // G
        ops.swap_rows(dev, self.att, self.grouped, a=n, b=G, width=gw, stream=st)  # [G, n, gw]
        for g, wg in enumerate(lw.o_a):
            mm.linear(wg, self.grouped.view(g * n * gw, n * gw), self.oa.view(g * n * rank, n * rank), n, tc=False)
        ops.swap_rows(dev, self.oa, self.oa2, a=G, b=n, width=rank, stream=st)  # [n, G * rank]
        mm.linear(lw.o_b, self.oa2, self.y, n, tc=False)
        ops.hc_merge(dev, self.x, self.y, self.post, self.comb, n=n, hc=h.hc_mult, hidden=cfg.hidden, stream=st)

    def _compressed(self, lw: HyperLayer, ratio: int, cols, n_comp: int, ch: hyper_keys.ChunkRows, prow: DeviceArray,
                    kscratch: DeviceArray, iscratch: DeviceArray | None) -> None:
        """A chunk's compressed rows of this layer after its window's in the key scratch (normed, RoPE at each
        row's first position); in a CSA layer the indexer's rows likewise, at the same rows of its scratch."""
        cfg, h, dev, st, W, D = self.config, self.h, self.dev, self.stream, self.width, self.config.head_dim
        if not n_comp:
            return
        rows = prow.view(ch.prow_at, ch.end)

        def make(kv: slice, score: slice, width: int, scratch: DeviceArray, norm: DeviceArray) -> None:
            out = scratch.view(ch.m * width, n_comp * width)
            ops.compress_rows(dev, self.pool.view(kv.start, self.pool.size - kv.start),
                              self.pool.view(score.start, self.pool.size - score.start), rows, out, ld=W, first=0,
                              blocks=n_comp, ratio=ratio, width=width, overlap=ratio == CSA, stream=st)
            ops.rms_norm(dev, out, norm, out, eps=cfg.norm_eps, rows=n_comp, cols=width, stream=st)
            self._rope_tail(out, self.comp_pos[ratio], self.w.rope_compressed, n=n_comp, heads=1, dim=width)

        assert lw.compressor is not None
        make(cols["c_kv"], cols["c_score"], D, kscratch, lw.compressor[3])
        if lw.indexer is not None and iscratch is not None:
            make(cols["i_kv"], cols["i_score"], h.indexer_dim, iscratch, lw.indexer[3])

    def _mlp(self, lw: HyperLayer, n: int, tok: DeviceArray) -> None:
        """The shared expert plus the routed experts (hash-routed by token id, or by their top k with the
        selection bias), each a clamped SwiGLU, merged back into the streams."""
        cfg, h, dev, st, mm, s = self.config, self.h, self.dev, self.stream, self.mm, self.moe
        hid, k = cfg.hidden, cfg.n_experts_used
        self._mix(lw.ffn_mix, n)
        ops.rms_norm(dev, self.a, lw.ffn_norm, self.hn, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
        ffs = lw.shared_gate.rows
        mm.linear(lw.shared_gate, self.hn, self.sg, n, tc=False)
        mm.linear(lw.shared_up, self.hn, self.su, n, tc=False)
        ops.clamped_swiglu(dev, self.sg, self.su, self.sg, n=n, ffn=ffs, limit=lw.clamp_shared, stream=st)
        mm.linear(lw.shared_down, self.sg, self.ysh, n, tc=False)

        ex = lw.experts
        E, ffn, pairs = ex.experts, ex.ffn, n * k
        ops.matvec_rows(dev, ex.router, self.hn, s.logits, n=n, stream=st)
        tile = 1 if n == 1 else TILE_ROWS
        hashed = (lw.token_experts, tok) if lw.token_experts is not None else None
        nt = ops.moe_route_group(dev, s.logits, s, n=n, experts=E, k=k, gating="sqrt-softplus",
                                 norm_topk=h.expert_weights_norm, tile=tile, bias=lw.select_bias,
                                 scale=h.expert_weights_scale, hashed=hashed, stream=st)
        per_pair = n > 1
        xs = s.xs if per_pair else self.hn
        if per_pair:
            ops.moe_gather(dev, self.hn, s, n=n, k=k, hidden=hid, stream=st)
        gu = s.gu
        assert gu is not None
        if ex.gate_up is not None:  # [pairs, gate | up]
            ops.moe_matvec(dev, ex.gate_up, s.tiles, nt, xs, gu, tile=tile, x_per_pair=per_pair, stream=st)
            g, u, ld = gu, gu.view(ffn, gu.size - ffn), 2 * ffn
        else:
            assert ex.gate is not None and ex.up is not None
            ops.moe_matvec(dev, ex.gate, s.tiles, nt, xs, gu, tile=tile, x_per_pair=per_pair, stream=st)
            ops.moe_matvec(dev, ex.up, s.tiles, nt, xs, gu.view(pairs * ffn, pairs * ffn), tile=tile,
                           x_per_pair=per_pair, stream=st)
            g, u, ld = gu, gu.view(pairs * ffn, pairs * ffn), ffn
        ops.clamped_swiglu(dev, g, u, s.hs, n=pairs, ffn=ffn, limit=lw.clamp, ldg=ld, ldu=ld, stream=st)
        ops.moe_matvec(dev, ex.down, s.tiles, nt, s.hs, s.ys, tile=tile, stream=st)
        # the experts' outputs weighed and summed onto the shared expert's
        ops.moe_combine(dev, s, self.y, n=n, k=k, hidden=hid, res=self.ysh, stream=st)
        ops.hc_merge(dev, self.x, self.y, self.post, self.comb, n=n, hc=h.hc_mult, hidden=hid, stream=st)

    def _logits(self, chunks: list[SeqChunk], spans: list[tuple[int, int]]) -> list:
        """Each chunk's logits as it asks (twin: chunk_logits through HyperStack.head)."""
        cfg, h, dev, st, mm = self.config, self.h, self.dev, self.stream, self.mm
        want = []
        for c, (a, b) in zip(chunks, spans, strict=True):
            want.append([] if c.logits == "none" else [b - 1] if c.logits == "last" else list(range(a, b)))
        rows = np.asarray([r for w in want for r in w], np.int32)
        n_out = len(rows)
        if n_out:
            hcw = h.hc_mult * cfg.hidden
            xo = self.bufs.get("x_out", n_out * hcw)
            ops.gather_rows(dev, self.x, self.bufs.put("out_rows", rows), xo, n=n_out, cols=hcw, stream=st)
            fn, scale, base = self.w.output_mix
            mm.linear(fn, xo, self.raw, n_out, tc=False)
            ops.hc_pre(dev, xo, self.raw, scale, base, self.a, None, None, n=n_out, hc=h.hc_mult, hidden=cfg.hidden,
                       eps=cfg.norm_eps, hc_eps=h.hc_eps, iters=h.hc_sinkhorn_iters, stream=st)
            ops.rms_norm(dev, self.a, self.w.output_norm, self.hn, eps=cfg.norm_eps, rows=n_out, cols=cfg.hidden,
                         stream=st)
            mm.linear(self.w.output, self.hn, self.logits, n_out, tc=False)
        st.synchronize()
        host = self.logits.view(0, max(n_out, 1) * cfg.vocab_size).to_host().reshape(-1, cfg.vocab_size)
        out, at = [], 0
        for w in want:
            out.append(host[at : at + len(w)].copy() if w else None)
            at += len(w)
        return out
