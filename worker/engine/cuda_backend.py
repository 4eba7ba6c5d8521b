"""The CUDA backend: the numpy backend's forward pass on the GPU, through ember.kernels.ops.

Weights stay in their GGUF block formats on the device (QuantMatrix) and every projection is the
quantized matvec (batches of up to 8 tokens per launch; longer chunks loop: prefill is correct, not
fast yet). Activations are float32. The KV pool lives on the device in float32 with the numpy
backend's block semantics; read_block / write_block copy one block to / from the host in the numpy
layout [2, layers, block_size, kv_heads, head_dim], so the prefix cache and KV persistence work
unchanged.

A sticky CUDA error (StickyCudaError: the context is poisoned) surfaces as ContextPoisoned, the
worker's contract (engine_poisoned, exit 75).

Not done yet: CUDA graphs for decode steps, tensor-core prefill, flash-style prefill attention,
fp16 KV, fused kernels, device-side sampling. Head sizes the attention kernel lacks (it has 64, 128
and 256) fall back to the numpy twin on the host (tiny test models only).
"""

from __future__ import annotations

import functools

import numpy as np

from ember.kernels import ops, quants, reference
from ember.kernels.errors import StickyCudaError

from ..model.config import ModelConfig
from ..model.gguf_file import GGUFFile, ModelFileError
from .backend import ContextPoisoned, SeqChunk, kv_slots

_LAYER = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_GROUPS = (1, 2, 4, 8)


def _poison_guard(fn):
    """Turn a sticky CUDA error into the worker's ContextPoisoned."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e

    return wrapper


class CudaBackend:
    name = "cuda"

    def __init__(self, config: ModelConfig, gguf_file: GGUFFile, *, n_blocks: int, block_size: int = 16,
                 device=None):
        from ember.kernels.cuda_runtime import Device

        try:
            self.dev = device if device is not None else Device()
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        self.config, self.gguf = config, gguf_file
        self.block_size, self.n_blocks = block_size, n_blocks
        try:
            self._upload_weights()
            self._alloc_kv()
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        self._bufs: dict[str, object] = {}
        cfg = config
        self._device_attention = (cfg.head_dim in ATTN_HEAD_DIMS and cfg.n_heads % cfg.n_kv_heads == 0
                                  and cfg.n_heads // cfg.n_kv_heads in ATTN_GROUPS)

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
        return 2 * config.n_layers * block_size * config.kv_dim * 4

    # -- set-up -----------------------------------------------------------------------------------

    def _matrix(self, name: str) -> ops.QuantMatrix:
        info = self.gguf.tensors[name]
        if len(info.shape) != 2:
            raise ModelFileError(self.gguf.path, f"tensor {name} is not 2-D")
        cols, rows = int(info.shape[0]), int(info.shape[1])
        return ops.QuantMatrix.upload(self.dev, self.gguf.raw(name), info.ggml_type, rows, cols)

    def _vector(self, name: str):
        info = self.gguf.tensors[name]
        shape = tuple(reversed(info.shape))
        arr = np.asarray(quants.dequantize(self.gguf.raw(name), info.ggml_type, shape), dtype=np.float32)
        return self.dev.to_device(arr.reshape(-1)), arr.reshape(-1)

    def _upload_weights(self) -> None:
        cfg, g = self.config, self.gguf
        self.token_embd = self._matrix("token_embd.weight")
        self.output = self.token_embd if "output.weight" not in g.tensors else self._matrix("output.weight")
        self.output_norm, _ = self._vector("output_norm.weight")
        self.layers: list[dict] = []
        for i in range(cfg.n_layers):
            lw: dict = {}
            for ours, gname in _LAYER.items():
                full = f"blk.{i}.{gname}"
                if full not in g.tensors:
                    continue
                if ours in _MATRICES:
                    lw[ours] = self._matrix(full)
                elif ours in ("bq", "bk", "bv"):
                    lw[ours] = self._vector(full)[1]  # host copy: tiled per step into the residual input
                else:
                    lw[ours] = self._vector(full)[0]
            self.layers.append(lw)
        half = cfg.head_dim // 2
        exponents = np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim
        freqs = 1.0
        if "rope_freqs.weight" in g.tensors:
            freqs = np.asarray(self._vector("rope_freqs.weight")[1], np.float64)
        self._inv_freq_global_host = cfg.rope_scale / (cfg.rope_base**exponents) / freqs
        self._inv_freq_local_host = 1.0 / (cfg.rope_base_local**exponents)
        self.inv_freq_global = self.dev.to_device(self._inv_freq_global_host.astype(np.float32))
        self.inv_freq_local = self.dev.to_device(self._inv_freq_local_host.astype(np.float32))

    def _alloc_kv(self) -> None:
        cfg = self.config
        self._layer_elems = self.n_blocks * self.block_size * cfg.kv_dim
        self.k_pool = self.dev.empty((cfg.n_layers * self._layer_elems,), np.float32)
        self.v_pool = self.dev.empty((cfg.n_layers * self._layer_elems,), np.float32)
        self.k_pool.zero()
        self.v_pool.zero()

    def _buf(self, key: str, elems: int, dtype=np.float32):
        """A reusable device buffer of at least `elems` elements."""
        b = self._bufs.get(key)
        if b is None or b.size < elems or b.dtype != np.dtype(dtype):
            b = self.dev.empty((max(elems, 64),), dtype)
            self._bufs[key] = b
        return b

    # -- one step ---------------------------------------------------------------------------------

    @_poison_guard
    @_poison_guard
    def inject_illegal_address(self) -> None:
        """--fault cuda-illegal-address: a kernel really writes out of bounds (sticky error 700)."""
        self.dev.make_current()
        ops.fault_illegal_address(self.dev)

    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray | None]:
        dev, cfg = self.dev, self.config
        dev.make_current()
        bs = self.block_size
        tokens = np.concatenate([np.asarray(c.tokens, dtype=np.int32) for c in chunks]).astype(np.int32)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
            raise ValueError("token id out of range")
        positions = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks]).astype(np.int32)
        n = int(tokens.size)
        spans, at = [], 0
        row_seq = np.empty(n, dtype=np.int32)
        for si, c in enumerate(chunks):
            spans.append((at, at + len(c.tokens)))
            row_seq[at : at + len(c.tokens)] = si
            at += len(c.tokens)
        slots = kv_slots(chunks, self.block_size, self.n_blocks)
        max_blocks = max(1, max(len(c.block_table) for c in chunks))
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
        for si, c in enumerate(chunks):
            tables[si, : len(c.block_table)] = c.block_table
        max_pos = int(positions.max()) + 1 if n else 1

        H, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qd, kvd, hid, ffn = cfg.q_dim, cfg.kv_dim, cfg.hidden, cfg.ffn
        d_tok = self._buf("tok", n, np.int32)
        d_tok.view(0, n).upload(tokens)
        d_pos = self._buf("pos", n, np.int32)
        d_pos.view(0, n).upload(positions)
        d_slots = self._buf("slots", n, np.int32)
        d_slots.view(0, n).upload(slots.astype(np.int32))
        d_seq = self._buf("seq", n, np.int32)
        d_seq.view(0, n).upload(row_seq)
        d_tab = self._buf("tables", tables.size, np.int32)
        d_tab.view(0, tables.size).upload(tables.reshape(-1))

        x = self._buf("x", n * hid)
        h = self._buf("h", n * hid)
        o2 = self._buf("o2", n * hid)
        q = self._buf("q", n * qd)
        k = self._buf("k", n * kvd)
        v = self._buf("v", n * kvd)
        att = self._buf("att", n * qd)
        g = self._buf("g", n * ffn)
        u = self._buf("u", n * ffn)

        ops.dequant_rows(dev, self.token_embd, x, d_tok, n=n, scale=float(np.float32(cfg.embed_scale)))
        for li, lw in enumerate(self.layers):
            local = cfg.is_local_layer(li)
            ops.rms_norm(dev, x, lw["attn_norm"], h, eps=cfg.norm_eps, rows=n, cols=hid)
            for wname, bname, out in (("wq", "bq", q), ("wk", "bk", k), ("wv", "bv", v)):
                res = None
                if bname in lw:
                    res = self._buf(f"bias_{bname}", n * lw[wname].rows)
                    # a synchronous copy on the legacy stream: ordered after the previous layer's use
                    res.view(0, n * lw[wname].rows).upload(np.tile(lw[bname], (n, 1)).reshape(-1))
                ops.matvec(dev, lw[wname], h, out, n=n, res=res)
            if cfg.qk_norm:
                ops.rms_norm(dev, q, lw["q_norm"], q, eps=cfg.norm_eps, rows=n * H, cols=D, heads=H)
                ops.rms_norm(dev, k, lw["k_norm"], k, eps=cfg.norm_eps, rows=n * Hk, cols=D, heads=Hk)
            inv = self.inv_freq_local if local else self.inv_freq_global
            ops.rope(dev, q, k, d_pos, inv, n=n, hq=H, hk=Hk, head_dim=D, neox=cfg.rope_neox)
            kc = self.k_pool.view(li * self._layer_elems, self._layer_elems)
            vc = self.v_pool.view(li * self._layer_elems, self._layer_elems)
            ops.kv_write(dev, k, v, kc, vc, d_slots, n=n, kv_heads=Hk, head_dim=D)
            window = cfg.sliding_window if local else 0
            max_keys = min(max_pos, window) if window else max_pos
            if self._device_attention:
                ops.attention(dev, q, kc, vc, d_tab, d_seq, d_pos, att, rows=n, heads=H, kv_heads=Hk, head_dim=D,
                              block_size=bs, max_blocks=max_blocks, max_keys=max_keys, window=window,
                              scale=cfg.attn_scale)
            else:
                self._host_attention(li, chunks, spans, positions, q, att, window)

            if cfg.post_norms:
                ops.matvec(dev, lw["wo"], att, o2, n=n)
                ops.rms_norm(dev, o2, lw["post_attn_norm"], o2, eps=cfg.norm_eps, rows=n, cols=hid)
                ops.add(dev, x, o2, x, n * hid)
            else:
                ops.matvec(dev, lw["wo"], att, x, n=n, res=x)
            ops.rms_norm(dev, x, lw["ffn_norm"], h, eps=cfg.norm_eps, rows=n, cols=hid)
            ops.matvec(dev, lw["w_gate"], h, g, n=n)
            ops.matvec(dev, lw["w_up"], h, u, n=n)
            ops.gated_act(dev, g, u, g, n=n, ffn=ffn, act=cfg.act)
            if cfg.post_norms:
                ops.matvec(dev, lw["w_down"], g, o2, n=n)
                ops.rms_norm(dev, o2, lw["post_ffn_norm"], o2, eps=cfg.norm_eps, rows=n, cols=hid)
                ops.add(dev, x, o2, x, n * hid)
            else:
                ops.matvec(dev, lw["w_down"], g, x, n=n, res=x)

        out: list[np.ndarray | None] = []
        for c, (a, b) in zip(chunks, spans):
            if c.logits == "none":
                out.append(None)
                continue
            r0 = b - 1 if c.logits == "last" else a
            rows = b - r0
            xr = x.view(r0 * hid, rows * hid)
            hn = self._buf("hn", rows * hid)
            ops.rms_norm(dev, xr, self.output_norm, hn, eps=cfg.norm_eps, rows=rows, cols=hid)
            lg = self._buf("logits", rows * cfg.vocab_size)
            ops.matvec(dev, self.output, hn, lg, n=rows)
            out.append(lg.view(0, (rows, cfg.vocab_size)).to_host())
        dev.synchronize()
        return out

    def _host_attention(self, li, chunks, spans, positions, q, att, window) -> None:
        """Fallback for head sizes without a device kernel: the numpy twin over this layer's blocks."""
        cfg, bs = self.config, self.block_size
        n = len(positions)
        qh = q.view(0, (n, cfg.n_heads, cfg.head_dim)).to_host()
        kc = self.k_pool.view(li * self._layer_elems, (self.n_blocks, bs, cfg.n_kv_heads, cfg.head_dim)).to_host()
        vc = self.v_pool.view(li * self._layer_elems, (self.n_blocks, bs, cfg.n_kv_heads, cfg.head_dim)).to_host()
        res = np.empty((n, cfg.q_dim), dtype=np.float32)
        for c, (a, b) in zip(chunks, spans):
            length = c.start + len(c.tokens)
            blocks = np.asarray(c.block_table[: -(-length // bs)], dtype=np.int64)
            keys = kc[blocks].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:length]
            values = vc[blocks].reshape(-1, cfg.n_kv_heads, cfg.head_dim)[:length]
            res[a:b] = reference.attention(qh[a:b], keys, values, positions[a:b].astype(np.int64), window=window,
                                           scale=cfg.attn_scale).reshape(b - a, cfg.q_dim)
        att.view(0, n * cfg.q_dim).upload(res.reshape(-1))

    # -- KV block transfer ------------------------------------------------------------------------

    def _block_views(self, block: int):
        if not 0 <= block < self.n_blocks:
            raise IndexError(f"block {block} outside the pool of {self.n_blocks}")
        cfg = self.config
        per = self.block_size * cfg.kv_dim
        shape = (self.block_size, cfg.n_kv_heads, cfg.head_dim)
        for li in range(cfg.n_layers):
            off = li * self._layer_elems + block * per
            yield li, self.k_pool.view(off, shape), self.v_pool.view(off, shape)

    @_poison_guard
    def read_block(self, block: int) -> np.ndarray:
        self.dev.make_current()
        cfg = self.config
        out = np.empty((2, cfg.n_layers, self.block_size, cfg.n_kv_heads, cfg.head_dim), dtype=np.float32)
        for li, kv, vv in self._block_views(block):
            out[0, li] = kv.to_host()
            out[1, li] = vv.to_host()
        return out

    @_poison_guard
    def write_block(self, block: int, data: np.ndarray) -> None:
        self.dev.make_current()
        data = np.asarray(data, dtype=np.float32)
        for li, kv, vv in self._block_views(block):
            kv.upload(data[0, li])
            vv.upload(data[1, li])
