"""The CUDA forward pass: every kernel of one step, built from the family's recipe. This is where a
model family lands on the GPU.

The recipe (model/arch/recipe.py) is turned once, at load, into the switches `Forward` holds (rope
flavour and YaRN's scale, post-norms, the tensor cores' half type) and into explicit variants per
layer (layers.py: q|k|v stacked, q|k with v apart, or three; gate|up stacked or apart; which norms,
biases, sinks and experts a layer has); `run` branches on those alone, never on the family's name nor
on which weights a layer happens to have. What of a recipe it runs is declared in support.py's table
(RUNS), which layers.check_runs reads to refuse any other model in one line before anything is
allocated.

`run` reads only device buffers, so a decode step can be captured as a CUDA graph: the weights, the
KV pools, the step inputs of one slot (step.StepInputs), the activations (allocated once at start,
`Activations`; the tensor-core path's scratch is sized at start for every matrix and never moves)
and the draws. The one exception is the host attention fallback for head sizes the kernel lacks
(tiny test models), which is never captured. Choosing a matmul's kernel is matmul.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.kernels import ops, reference
from ember.kernels.cuda_runtime import Device, DeviceArray, Stream, pdl_launches

from ...model.arch.recipe import Rope
from ...model.config import ModelConfig
from ..base import present
from .layers import QKV, CudaLayer, CudaWeights
from .matmul import Matmuls
from .step import PostNorms, StepInputs


@dataclass
class Activations:
    """Every buffer a step's kernels write, allocated once for `rows` rows (the backend's max_rows)."""

    tokens_out: list[DeviceArray]  # each slot's draws: step n + 1 may read step n's (run-ahead feed)
    x: DeviceArray  # the residual
    h: DeviceArray  # the normed rows a layer's matmuls read
    o2: DeviceArray  # a sublayer's output before its post-norm; the output rows gathered
    q: DeviceArray
    att: DeviceArray
    k: DeviceArray
    v: DeviceArray
    g: DeviceArray  # act(gate) * up, or gate alone
    u: DeviceArray  # up, when gate and up are apart
    qkv: DeviceArray | None  # a stacked q|k|v or q|k matmul's output (None: no layer stacks them)
    gu: DeviceArray | None  # a stacked gate|up matmul's output (None: no layer stacks them)
    hn: DeviceArray  # the output rows' final-normed hidden state
    moe_scratch: ops.MoeScratch | None
    x_alt: DeviceArray | None  # the residual's second buffer, for post-norms done inside the next matvec
    logits: DeviceArray
    sample_work: tuple[DeviceArray, DeviceArray]  # the sampler's per-row counters and per-block partials
    argmax: ops.RowArgmax

    @classmethod
    def alloc(cls, dev: Device, cfg: ModelConfig, rows: int, layers: list[CudaLayer], post_norms: bool) -> Activations:
        R, e = rows, dev.empty
        hid, qd, kvd, ffn = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn
        tokens_out = [e((R,), np.int32) for _ in range(2)]
        x, h, o2 = e((R * hid,)), e((R * hid,)), e((R * hid,))
        q, att = e((R * qd,)), e((R * qd,))
        k, v = e((R * kvd,)), e((R * kvd,))
        g, u = e((R * ffn,)), e((R * ffn,))
        qkv = e((R * (qd + 2 * kvd),)) if any(lw.qkv is not QKV.APART for lw in layers) else None
        gu = e((R * 2 * ffn,)) if any(lw.gate_up_stacked for lw in layers) else None
        hn = e((R * hid,))
        moe = next((lw.moe for lw in layers if lw.moe is not None), None)
        moe_scratch = None if moe is None else ops.MoeScratch.alloc(
            dev, R, moe.experts, cfg.n_experts_used, hid, moe.ffn,
            apart=any(lw.moe is not None and lw.moe.gate_up is None for lw in layers))
        x_alt = e((hid,)) if post_norms and hid <= ops.XPRO_COLS else None
        logits = e((R * cfg.vocab_size,))
        # the sampler's per-row counters (kept at zero by the kernel) and per-block partial results
        sample_work = (e((R,), np.int32), e((2 * R * ops.sample_parts(cfg.vocab_size),), np.int32))
        sample_work[0].zero()
        argmax = ops.RowArgmax.alloc(dev)
        return cls(tokens_out, x, h, o2, q, att, k, v, g, u, qkv, gu, hn, moe_scratch, x_alt, logits, sample_work,
                   argmax)


@dataclass
class KVPools:
    """The paged KV pools on the device: each layer's share of each pool, n_blocks + 1 blocks (the last
    is the trash block the padded rows of a captured step write)."""

    k: DeviceArray
    v: DeviceArray
    layer_elems: int
    n_blocks: int
    block_size: int


class Forward:
    """The forward pass of one model on one device (see the module docstring)."""

    def __init__(self, dev: Device, stream: Stream, config: ModelConfig, weights: CudaWeights, act: Activations,
                 mm: Matmuls, kv: KVPools, *, device_attention: bool, tensor_cores: bool, half_kind: str):
        """device_attention: the attention kernels take this head size and grouping (else the host's)."""
        self.dev, self.stream, self.config, self.w, self.act, self.mm, self.kv = (dev, stream, config, weights, act,
                                                                                  mm, kv)
        self.device_attention, self.tensor_cores, self.half_kind = device_attention, tensor_cores, half_kind
        recipe = config.recipe
        self.neox = recipe.rope is Rope.NEOX
        self.post_norms = recipe.post_norms

    def run(self, inp: StepInputs, draws: DeviceArray, fed: DeviceArray | None, n, stride, max_keys, n_out, chunks,
            spans, positions, *, partials=None, sample=True, tc=True, n_tiles=0) -> None:
        """Every kernel of one step, on the stream, reading only device buffers: the step's inputs `inp`,
        `fed` (the draws of the step before, whose rows inp.feed names: a run-ahead step) and its own
        draws into `draws`; chunks/spans/positions are needed only by the host attention fallback."""
        dev, cfg, st, w, act, mm = self.dev, self.config, self.stream, self.w, self.act, self.mm
        H, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        hid = cfg.hidden
        x, h, o2, q, att = act.x, act.h, act.o2, act.q, act.att
        block_size, layer_elems = self.kv.block_size, self.kv.layer_elems
        with pdl_launches(False):  # the step's first kernel follows the input copy, not a kernel
            # feed: the rows fed from the previous step's draws (d_feed: -1 for the others); the first
            # layer's attn_norm into h
            ops.embed(dev, w.token_embd, x, inp.tok, n=n, scale=float(np.float32(cfg.embed_scale)),
                      feed=(fed, inp.feed) if fed is not None else None,
                      norm=(w.layers[0].attn_norm, cfg.norm_eps, h), stream=st)
        h_ready = True  # h (or post.pending) holds this layer's attn_norm (embed, or the previous layer's end)
        # one row per sequence (a captured step's padded rows too): attention takes the prologue in
        decode = not n_tiles and (chunks is None or all(len(c.tokens) == 1 for c in chunks))
        post = PostNorms(mm, n, tc, act.x, act.x_alt, act.h)  # Gemma's post-norms; post.x is the residual
        final = None  # the output rows' final-normed hidden state, once a fused norm has made it
        for li, lw in enumerate(w.layers):
            local = cfg.is_local_layer(li)
            if not h_ready:
                ops.rms_norm(dev, post.x, lw.attn_norm, h, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
            q_, k_, v_, ldq, ldk, ldv = self._project_qkv(lw, post, n, tc)
            inv = w.inv_freq_local if local else w.inv_freq_global
            kc = self.kv.k.view(li * layer_elems, layer_elems)
            vc = self.kv.v.view(li * layer_elems, layer_elems)
            window = cfg.sliding_window if local else 0
            keys = min(max_keys, window) if window else max_keys
            if self.device_attention and decode:  # the prologue fused into decode attention: one launch
                pro = ops.DecodePrologue(k_, v_, inp.slots, inv, self.neox, ldk, ldv, lw.q_norm, lw.k_norm,
                                         cfg.norm_eps, mscale=w.rope_mscale)
                ops.attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, att, rows=n, heads=H,
                              kv_heads=Hk, head_dim=D, block_size=block_size, max_blocks=stride,
                              max_keys=keys, window=window, scale=cfg.attn_scale, partials=partials, ldq=ldq,
                              prologue=pro, sinks=lw.sinks, stream=st)
            elif self.device_attention:  # q/k norms, RoPE and the KV write in one launch
                ops.qk_rope_kv(dev, q_, k_, v_, kc, vc, inp.slots, inp.pos, inv, n=n, heads=H, kv_heads=Hk,
                               head_dim=D, neox=self.neox, q_norm=lw.q_norm, k_norm=lw.k_norm,
                               eps=cfg.norm_eps, ldq=ldq, ldk=ldk, ldv=ldv, mscale=w.rope_mscale, stream=st)
                if n_tiles:  # prefill: tiles of query rows on the tensor cores
                    ops.flash_attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, inp.tiles, att,
                                        n_tiles=n_tiles, heads=H, kv_heads=Hk, head_dim=D,
                                        block_size=block_size, max_blocks=stride, window=window,
                                        scale=cfg.attn_scale, ldq=ldq, sinks=lw.sinks, stream=st)
                else:
                    ops.attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, att, rows=n, heads=H,
                                  kv_heads=Hk, head_dim=D, block_size=block_size, max_blocks=stride,
                                  max_keys=keys, window=window, scale=cfg.attn_scale, partials=partials, ldq=ldq,
                                  sinks=lw.sinks, stream=st)
            else:
                if cfg.recipe.qk_norm:
                    ops.rms_norm(dev, q_, present(lw.q_norm), q_, eps=cfg.norm_eps, rows=n * H, cols=D, heads=H,
                                 ldx=ldq, ldy=ldq, stream=st)
                    ops.rms_norm(dev, k_, present(lw.k_norm), k_, eps=cfg.norm_eps, rows=n * Hk, cols=D, heads=Hk,
                                 ldx=ldk, ldy=ldk, stream=st)
                ops.rope(dev, q_, k_, inp.pos, inv, n=n, hq=H, hk=Hk, head_dim=D, neox=self.neox, ldq=ldq,
                         ldk=ldk, mscale=w.rope_mscale, stream=st)
                ops.kv_write(dev, k_, v_, kc, vc, inp.slots, n=n, kv_heads=Hk, head_dim=D, ldk=ldk, ldv=ldv,
                             stream=st)
                self._host_attention(li, chunks, spans, positions, q, att, window, lw.sinks)
            if self.post_norms:  # post-norm into the residual and the MLP's pre-norm (one launch, or none)
                mm.linear(lw.wo, att, o2, n, tc=tc)
                if lw.bo is not None:  # the output projection's bias, before its post-norm
                    ops.add_bias(dev, o2, lw.bo, n=n, cols=hid, stream=st)
                post.defer(o2, lw.post_attn_norm, lw.ffn_norm)
                (h_mlp,) = post.inputs([lw.w_gu] if lw.gate_up_stacked else [], gated=True) or [h]
            else:
                mm.linear(lw.wo, att, x, n, res=x, tc=tc)
                if lw.bo is not None:  # the output projection's bias (gpt-oss), into the residual
                    ops.add_bias(dev, x, lw.bo, n=n, cols=hid, stream=st)
                ops.rms_norm(dev, x, lw.ffn_norm, h, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
                h_mlp = h
            h_ready = False
            if lw.moe is not None:  # a mixture of experts, its biases with its weights (no post-norms: support.py)
                moe = cfg.recipe.moe
                assert moe is not None and act.moe_scratch is not None and not self.post_norms
                ops.moe_mlp(dev, lw.moe, h_mlp, x, act.moe_scratch, n=n, k=cfg.n_experts_used, act=cfg.recipe.act,
                            gating=moe.gating.value, norm_topk=moe.norm_topk, res=x,
                            half=self.half_kind if self.tensor_cores and tc else None,
                            int8=mm.int8_activations, stream=st)
                continue
            gated = mm.gate_up(lw, h_mlp, n, tc=tc)  # gate and up: one stacked matmul where their types agree
            if self.post_norms:
                mm.down(lw, o2, n, tc=tc, gated=gated)
                h_ready, final = self._post_ffn_norm(li, lw, post, n, n_out, final)
            else:
                mm.down(lw, x, n, res=x, tc=tc, gated=gated)
        self._logits(inp, draws, post.x, final, n, n_out, sample=sample, tc=tc)

    def _host_attention(self, li, chunks, spans, positions, q, att, window, sinks) -> None:
        """Fallback for head sizes without a device kernel: the numpy twin over this layer's blocks."""
        cfg, bs, kv = self.config, self.kv.block_size, self.kv
        n = spans[-1][1]
        self.stream.synchronize()
        host_sinks = sinks.to_host() if sinks is not None else None
        qh = q.view(0, (n, cfg.n_heads, cfg.head_dim)).to_host()
        shape = (kv.n_blocks + 1, bs, cfg.n_kv_heads, cfg.head_dim)
        kc = kv.k.view(li * kv.layer_elems, shape).to_host().astype(np.float32)
        vc = kv.v.view(li * kv.layer_elems, shape).to_host().astype(np.float32)
        res = np.empty((n, cfg.q_dim), dtype=np.float32)
        for c, (a, b) in zip(chunks, spans, strict=True):
            length = c.start + len(c.tokens)
            blocks = np.asarray(c.block_table[: -(-length // bs)], dtype=np.int64)
            keys = kc[blocks].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:length]
            values = vc[blocks].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:length]
            res[a:b] = reference.attention(qh[a:b], keys, values, positions[a:b].astype(np.int64), window=window,
                                           scale=cfg.attn_scale, sinks=host_sinks).reshape(b - a, cfg.q_dim)
        att.view(0, n * cfg.q_dim).upload(res.reshape(-1))

    def _project_qkv(self, lw, post: PostNorms, n: int, tc: bool):
        """One layer's q, k and v projections with their biases: (q, k, v, ldq, ldk, ldv), views of the
        activations with their row strides."""
        dev, cfg, st, act, mm = self.dev, self.config, self.stream, self.act, self.mm
        qd, kvd = cfg.q_dim, cfg.kv_dim
        q, k, v = act.q, act.k, act.v
        if lw.qkv is QKV.STACKED:  # one matmul; q, k and v are column slices of its rows
            ld = qd + 2 * kvd
            wqkv, qkv = present(lw.wqkv), present(act.qkv)
            (hq_,) = post.inputs([wqkv])
            mm.linear(wqkv, hq_, qkv, n, tc=tc)
            q_, k_, v_ = (qkv.view(off, qkv.size - off) for off in (0, qd, qd + kvd))
            ldq = ldk = ldv = ld
        elif lw.qkv is QKV.QK_STACKED:  # q and k stacked, v (another type) on its own
            wqk, wv, qkv = present(lw.wqk), present(lw.wv), present(act.qkv)
            hq_, hv_ = post.inputs([wqk, wv])
            mm.linear(wqk, hq_, qkv, n, tc=tc)
            mm.linear(wv, hv_, v, n, tc=tc)
            q_, k_, v_ = qkv, qkv.view(qd, qkv.size - qd), v
            ldq = ldk = qd + kvd
            ldv = kvd
        else:
            mats = (present(lw.wq), present(lw.wk), present(lw.wv))
            for wm, out, hin in zip(mats, (q, k, v), post.inputs(list(mats)), strict=True):
                mm.linear(wm, hin, out, n, tc=tc)
            q_, k_, v_, ldq, ldk, ldv = q, k, v, qd, kvd, kvd
        if lw.bqkv is not None:  # the recipe's biases, where the file has them: the stacked rows' in one add
            ops.add_bias(dev, q_, lw.bqkv, n=n, cols=qd + 2 * kvd, ldy=ldq, stream=st)
        for bias, out, cols, ldo in ((lw.bq, q_, qd, ldq), (lw.bk, k_, kvd, ldk), (lw.bv, v_, kvd, ldv)):
            if bias is not None:
                ops.add_bias(dev, out, bias, n=n, cols=cols, ldy=ldo, stream=st)
        return q_, k_, v_, ldq, ldk, ldv

    def _logits(self, inp: StepInputs, draws: DeviceArray, x: DeviceArray, final: DeviceArray | None, n: int,
                n_out: int, *, sample: bool, tc: bool) -> None:
        """The output rows' logits (none where n_out is 0) from the residual `x` (`final`: their final-normed
        state where a fused norm made it), and with `sample` their draws."""
        if not n_out:
            return
        dev, cfg, st, w, act, mm = self.dev, self.config, self.stream, self.w, self.act, self.mm
        hid = cfg.hidden
        if final is None:
            src = x
            if n_out != n:  # the output rows are a subset (out_rows lists them in order)
                ops.gather_rows(dev, x, inp.out_rows, act.o2, n=n_out, cols=hid, stream=st)
                src = act.o2
            ops.rms_norm(dev, src, w.output_norm, act.hn, eps=cfg.norm_eps, rows=n_out, cols=hid, stream=st)
            final = act.hn
        # one row streamed through a tall Q8_0 output projection: its greedy token found on the way
        argmax = act.argmax if sample and mm.streamed(w.output, n_out) else None
        mm.linear(w.output, final, act.logits, n_out, tc=tc, argmax=argmax)
        if sample:
            params = inp.sample.view(0, ops.SampleParams.nbytes(n_out))
            ops.sample(dev, act.logits, params, draws, rows=n_out, vocab=cfg.vocab_size,
                       work=act.sample_work, greedy=argmax, stream=st)

    def _post_ffn_norm(self, li: int, lw, post: PostNorms, n: int, n_out: int,
                       final: DeviceArray | None) -> tuple[bool, DeviceArray | None]:
        """Layer li's FFN post-norm into the residual, joined by the next layer's attention pre-norm or, after
        the last layer, by the final norm where every row is an output row: (whether h holds the next
        layer's pre-norm, the final-normed state where that made it)."""
        dev, cfg, st, w, act = self.dev, self.config, self.stream, self.w, self.act
        o2 = act.o2
        if li + 1 < len(w.layers):  # and the next layer's attention pre-norm
            post.defer(o2, lw.post_ffn_norm, w.layers[li + 1].attn_norm)
            return True, final
        if n_out == n:  # every row is an output row, in order: the final norm joins the post-norm
            post.defer(o2, lw.post_ffn_norm, w.output_norm)
            post.inputs([])
            return False, act.h
        ops.rms_norm_add(dev, o2, present(lw.post_ffn_norm), post.x, eps=cfg.norm_eps, rows=n, cols=cfg.hidden,
                         stream=st)
        return False, final
