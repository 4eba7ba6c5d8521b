"""DeepSeek V4's next-token (MTP) layer on the GPU: the numpy twin's MtpHead (backends/numpy/mtp.py) through
ember.kernels.ops, on hyper_step.py's buffers and pool, and what `--spec mtp` drafts with on cuda.

With every step (after the model's head, whose logits are then out of the streams' way) the step writes
what the layer drafts from into the pool, as the twin's write_rows does: each new position's h (the
trunk's output streams) and the layer's key row there, made of the h before it (this step's, or the
pool's for a chunk's first position; zeros before position 0) and the position's token. A draft runs
between steps on the same buffers: k single-row passes of the layer's block, its key rows over the window
gathered from the pool into a scratch of its own and its guesses' rows appended there (never the pool's),
each pass's output streams the next one's h, each guess the argmax of the layer's head on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Device, DeviceArray

from ...model.config import ModelConfig
from ...model.gguf_file import GGUFFile
from .buffers import GrowingBuffers
from .hyper_weights import HyperLayer, HyperWeights, _layer, _Reader

if TYPE_CHECKING:
    from .hyper_step import HyperStep, _Inputs


@dataclass
class MtpWeights:
    layer: HyperLayer  # blk.{n_layers}: a window-only block with a learned router
    eh_proj: ops.QuantMatrix  # [hidden, 2 * hidden]: each stream's [embedding, h] into the block's input
    enorm: DeviceArray
    hnorm: DeviceArray
    embd: ops.QuantMatrix  # the layer's file's token embeddings, or the trunk's
    head_mix: tuple[ops.QuantMatrix, DeviceArray, DeviceArray]  # its hyper-connection head (fn, scale, base)
    head_norm: DeviceArray
    head_out: ops.QuantMatrix

    def matrices(self) -> list[ops.QuantMatrix]:
        return [self.eh_proj, *self.layer.matmuls()]


def upload_mtp_weights(dev: Device, trunk_file: GGUFFile, own_file: GGUFFile | None, config: ModelConfig,
                       trunk: HyperWeights) -> MtpWeights:
    """The layer from the trunk's file, or from its own (--spec mtp:PATH, model/mtp_file.py). Its head and
    embeddings as the twin picks them: the layer's nextn.* where it has them, else its own file's where
    their bytes differ from the trunk's (llama.cpp's MTP graph reads its own model's), else the trunk's."""
    family = config.family
    assert family.hyper is not None
    g = own_file or trunk_file
    rd, li, t = _Reader(dev, g), config.n_layers, family.tensors
    nextn = f"blk.{li}.nextn."

    def own(name: str) -> bool:  # the layer's file has its own copy of a model-level tensor
        return (own_file is not None and name in own_file.tensors
                and not np.array_equal(own_file.raw(name), trunk_file.raw(name)))

    def matrix(layer_name: str, model_name: str, trunk_copy: ops.QuantMatrix) -> ops.QuantMatrix:
        if nextn + layer_name in g.tensors:
            return rd.matrix(nextn + layer_name)
        return rd.matrix(model_name) if own(model_name) else trunk_copy

    norm = (rd.device_vector(nextn + "shared_head_norm.weight") if nextn + "shared_head_norm.weight" in g.tensors
            else rd.device_vector(t.output_norm) if own(t.output_norm) else trunk.output_norm)
    mix_names = [family.hyper.model[r] for r in ("output_mix_fn", "output_mix_scale", "output_mix_base")]
    mix = ((rd.matrix(mix_names[0]), rd.device_vector(mix_names[1]), rd.device_vector(mix_names[2]))
           if any(own(n) for n in mix_names) else trunk.output_mix)
    return MtpWeights(
        layer=_layer(rd, config, li, ratio=0), eh_proj=rd.matrix(nextn + "eh_proj.weight"),
        enorm=rd.device_vector(nextn + "enorm.weight"), hnorm=rd.device_vector(nextn + "hnorm.weight"),
        embd=matrix("embed_tokens.weight", t.token_embd, trunk.token_embd), head_mix=mix, head_norm=norm,
        head_out=matrix("shared_head_head.weight", t.output, trunk.output))


class MtpLayer:
    """The layer on a HyperStep: its rows with every step (write_rows), and drafts (draft, chain)."""

    def __init__(self, step: HyperStep, weights: MtpWeights):
        cfg, h, e = step.config, step.h, step.dev.empty
        self.s, self.w = step, weights
        self.cols = step.columns[cfg.n_layers]
        R, hc, hid = step.max_rows, h.hc_mult, cfg.hidden
        self.hcw = hc * hid
        self.prev = e(((R + 1) * self.hcw,))  # the h before each row; row R a spare the padded writes go to
        self.zero = e((self.hcw,))
        self.zero.zero()
        self.erep = e((R * self.hcw,))  # each row's normed embedding, once a stream
        self.cat = e((R * hc * 2 * hid,))  # each stream's [embedding, h]
        self.iota = step.dev.to_device(np.arange(R * hc, dtype=np.int32))
        self.one = step.dev.to_device(np.zeros(hc, np.int32))  # a draft's one row, once a stream
        self._keys: DeviceArray | None = None  # a draft's key rows: the window's, then its guesses'
        self._draft_in = GrowingBuffers(step.dev)  # a draft's small int32 inputs

    @property
    def block_size(self) -> int:
        return self.s.block_size

    def _input(self, tok: DeviceArray, rep: DeviceArray, n: int) -> None:
        """The layer's input streams into the step's streams (s.x), from the h before each row (self.prev,
        normed in place) and its token (twin: MtpHead._input)."""
        s, m, dev, st = self.s, self.w, self.s.dev, self.s.stream
        hid, hc, eps = s.config.hidden, s.h.hc_mult, s.config.norm_eps
        ops.embed(dev, m.embd, s.a, tok, n=n, stream=st)
        ops.rms_norm(dev, s.a, m.enorm, s.a, eps=eps, rows=n, cols=hid, stream=st)
        ops.gather_rows(dev, s.a, rep, self.erep, n=n * hc, cols=hid, stream=st)
        ops.rms_norm(dev, self.prev, m.hnorm, self.prev, eps=eps, rows=n * hc, cols=hid, stream=st)
        for src, at in ((self.erep, 0), (self.prev, hid)):
            ops.store_rows(dev, src, self.iota, self.cat.view(at, self.cat.size - at), n=n * hc, width=hid, lds=hid,
                           ldd=2 * hid, stream=st)
        s._linear(m.eh_proj, self.cat, s.x, n * hc)

    # -- with every step ------------------------------------------------------------------------------

    def write_rows(self, n: int, inp: _Inputs) -> None:
        """Every new position's h (the trunk's output streams, s.x) and the layer's key row, into the pool
        (twin: MtpHead.write_rows). Runs after the head: it overwrites the streams."""
        s, dev, st, W = self.s, self.s.dev, self.s.stream, self.s.width
        assert inp.prev is not None and inp.firsts is not None
        s._store(s.x, self.cols["h"], inp.slots, n)
        h = self.cols["h"].start
        ops.gather_rows(dev, s.pool.view(h, s.pool.size - h), inp.prev, self.prev, n=n, cols=self.hcw, ldx=W,
                        stream=st)
        firsts, count = inp.firsts
        if count:  # nothing before position 0 (llama.cpp starts from zeros too)
            ops.store_rows(dev, self.zero, firsts, self.prev, n=count, width=self.hcw, lds=0, ldd=self.hcw, stream=st)
        self._input(inp.tok, inp.rep, n)
        s._key_row(self.w.layer, n, inp.pos, s.w.rope_window)  # a window-only layer: no YaRN
        s._store(s.kvr, self.cols["kv"], inp.slots, n)

    # -- drafts ---------------------------------------------------------------------------------------

    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]:
        """k greedy guesses after `token` at position `at` (the trunk has computed every position before it)."""
        return self.chain(block_table, token, at, k)[0]

    def chain(self, block_table: list[int], token: int, at: int, k: int) -> tuple[list[int], np.ndarray]:
        """draft's guesses, and the logits [k, vocab] each was the argmax of (twin: MtpHead.chain)."""
        s, lw, dev, st = self.s, self.w.layer, self.s.dev, self.s.stream
        cfg, window, bs, D, W = s.config, s.h.window, s.block_size, s.config.head_dim, s.width
        st.synchronize()  # the step before is done with the buffers a draft takes over
        table = np.asarray(block_table, np.int64)
        kpos = np.arange(max(0, at - window + 1), at)
        m, ldi = len(kpos), window + k
        if self._keys is None or self._keys.size < ldi * D:
            self._keys = dev.empty((ldi * D,))
        keys = self._keys
        put = self._draft_in.ints
        # every guess's inputs but its token, uploaded before anything is queued: its position, the scratch row
        # of its key, and its key list (the window's rows still in reach, the guesses' rows so far, its own)
        idx = np.full((k, ldi), -1, np.int32)
        cnt = np.zeros(k, np.int32)
        for i in range(k):
            seen = np.concatenate([np.nonzero(kpos > at + i - window)[0], m + np.arange(i + 1)])
            idx[i, : len(seen)], cnt[i] = seen, len(seen)
        pos, slot = put("pos", at + np.arange(k)), put("slot", m + np.arange(k))
        idx_d, cnt_d = put("idx", idx), put("cnt", cnt)
        rows = put("rows", table[kpos // bs] * bs + kpos % bs) if m else None
        prev = put("prev", [table[(at - 1) // bs] * bs + (at - 1) % bs]) if at > 0 else None
        tok = put("tok", [token])
        if rows is not None:
            kv = self.cols["kv"].start
            ops.gather_rows(dev, s.pool.view(kv, s.pool.size - kv), rows, keys, n=m, cols=D, ldx=W, stream=st)
        if prev is not None:
            h = self.cols["h"].start
            ops.gather_rows(dev, s.pool.view(h, s.pool.size - h), prev, self.prev, n=1, cols=self.hcw, ldx=W,
                            stream=st)
        else:
            self.prev.copy_from(self.zero, 4 * self.hcw, st)
        guesses: list[int] = []
        logits = np.zeros((k, cfg.vocab_size), np.float32)
        for i in range(k):
            if i:
                tok.view(0, 1).upload(np.array([token], np.int32))  # the guess before (the stream is idle)
            p = pos.view(i, 1)
            self._input(tok, self.one, 1)
            s._key_row(lw, 1, p, s.w.rope_window)
            ops.store_rows(dev, s.kvr, slot.view(i, 1), keys, n=1, width=D, lds=D, ldd=D, stream=st)
            s._query(lw, 1, p, s.w.rope_window)
            s._attend(lw, 1, p, s.w.rope_window, keys, idx_d.view(i * ldi, ldi), cnt_d.view(i, 1), ldi)
            s._mlp(lw, 1, tok)
            s.logits_of(s.x, 1, self.w.head_mix, self.w.head_norm, self.w.head_out)
            self.prev.copy_from(s.x, 4 * self.hcw, st)  # its output streams: the next guess's h
            st.synchronize()  # (to_host copies on the legacy stream, which does not wait for this one)
            logits[i] = s.logits.view(0, cfg.vocab_size).to_host()
            token = int(np.argmax(logits[i]))
            guesses.append(token)
        return guesses, logits
