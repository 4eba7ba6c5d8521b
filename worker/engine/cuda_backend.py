"""The CUDA backend: the numpy backend's forward pass on the GPU, through ember.kernels.ops.

Weights stay in their GGUF block formats on the device (QuantMatrix). Decode-sized steps use the
quantized matvec (weights read once per launch of up to 4-8 rows; Q4_K/Q5_K with x quantized to
int8, as llama.cpp does); prefill-sized steps multiply on the tensor cores (ops.linear_tc) with a
16-bit copy of each matrix, decoded once at start when it fits (f16_weights) or else per step. Activations are float32; the KV pool
(float16 by default) lives on the device with the numpy backend's block semantics. read_block /
write_block copy one block to / from the host in the numpy layout [2, layers, block_size, kv_heads,
head_dim] (float32), so the prefix cache and KV persistence work unchanged.

Every buffer a step touches is allocated once, up front, and a step's inputs travel in one copy
from pinned memory. Steps alternate between two slots, each with its own input buffers (host and
device) and drawn-token buffers; the copies run on two copy streams (inputs up, tokens down), so
while step n runs, step n + 1's inputs are already on their way and step n - 1's tokens on theirs:
the compute stream only waits for an event between two steps. A decode step (one token per
sequence) is captured once per (batch bucket, context bucket, slot) as a CUDA graph and then replayed
with one launch, so the host does not bound small models. Chunks that ask for it (`SeqChunk.sample`) are sampled on the device and come back as
`SampledToken`; the rest come back as logits. submit() launches a step and returns at once (two
steps may be in flight, each with its own pinned buffers); a step's tokens may be the previous
step's draws, copied on the device (`feed`), so the scheduler launches decode step n + 1 before it
reads step n's tokens and the host's work overlaps the GPU's.

A sticky CUDA error (StickyCudaError: the context is poisoned) surfaces as ContextPoisoned, the
worker's contract (engine_poisoned, exit 75). Head sizes the attention kernel lacks (it has 64, 128
and 256) fall back to the numpy twin on the host (tiny test models only; never captured).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.kernels import ops, quants, reference
from ember.kernels.cuda_runtime import pdl_launches
from ember.kernels.errors import StickyCudaError

from ..model.config import ModelConfig
from ..model.gguf_file import GGUFFile, ModelFileError
from .backend import ContextPoisoned, SampledToken, SeqChunk, kv_slots

_LAYER = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Matrices that read the same input are stacked into one (when their types agree): one launch, and
# one pass over the input, instead of three (q, k, v) or two (gate, up). In order of preference: a
# Q4_K_M file's v is Q6_K in some layers, which then stack only q and k.
_STACKS = {"wqkv": ("wq", "wk", "wv"), "wqk": ("wq", "wk"), "w_gu": ("w_gate", "w_up")}
_ALL_MATRICES = _MATRICES + tuple(_STACKS)
ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_GROUPS = (1, 2, 4, 8)
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# From this many rows a matmul decodes its weights to 16 bits and runs on the tensor cores (3
# launches) instead of the matvec (one launch, and one read of the weights, per 8 rows). Measured on
# the H200 at 64 rows: the 8B output projection took 6.5 ms as 8 matvec launches (Q6_K, 128256 x 4096).
TC_MIN_ROWS = 16
# Below this many output rows a single-row matvec takes the staged kernel (float x, one 16-byte load
# pass, weights loaded before the PDL wait) rather than the int8 one, whose per-warp x quantization
# does not pay off on so few rows. Measured on the H200 in PDL graphs (2026-12-03), Gemma 3 270M:
# Q4_K 640 x 1024 staged 2.28 us against int8 4.07-5.73 us; Q4_K / Q6_K 640 x 2048 3.20 against 3.64-5.38.
INT8_MIN_ROWS = 1024
# From this many columns such a row is shared by a block's warps (ops.matvec split): by `ember bench
# trace` on the H200 (2026-12-03), one warp's decode of a 2048-column row took about 1.6 us of the
# 270M's down projection after its input arrived.
SPLIT_MIN_COLS = 1024
# A single row through a Q8_0 matrix of at least this many rows (a tied output projection) streams it
# with int8 x (ops.matvec_stream_q8_0): the staged matvec is bound by instructions there (2.28 TB/s
# on the H200 for Gemma 3 270M's 262144 x 640).
STREAM_MIN_ROWS = 32768
# A stack of mixed legacy types is upcast to Q8_0 when that adds at most this many bytes to a step
# (about a quarter of a microsecond of the H200's bandwidth, against a launch of 2-4 us it saves).
STACK_UPCAST_MAX_BYTES = 1 << 20


def _poison_guard(fn):
    """Turn a sticky CUDA error into the worker's ContextPoisoned."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e

    return wrapper


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class _Layout:
    """Offsets (bytes) of a step's inputs in the pinned staging buffer and its device twin."""

    rows: int  # row capacity (tokens per step)
    seqs: int  # sequence capacity (chunks per step)
    table_cap: int  # int32 entries for all block tables

    def __post_init__(self):
        r, s = self.rows, self.seqs
        self.tok, self.pos, self.slots, self.seq = 0, 4 * r, 8 * r, 12 * r
        self.out_rows = 16 * r  # the rows whose logits are wanted (r at most)
        self.feed = 20 * r  # per row: the previous step's draw that is its token (run-ahead), or -1
        self.sample = 24 * r  # SampleParams for up to r rows (8-byte aligned: r is a multiple of 8)
        self.tiles = self.sample + ops.SampleParams.nbytes(r)  # flash attention's (row, count) pairs
        self.tile_cap = r // ops.FLASH_ROWS + s + 1
        self.tables = self.tiles + 8 * self.tile_cap
        self.nbytes = self.tables + 4 * self.table_cap


@dataclass
class _StepInputs:
    """One slot's step inputs on the device: views of its buffer at the layout's offsets."""

    tok: object
    pos: object
    slots: object
    seq: object
    out_rows: object
    feed: object
    tiles: object
    tables: object
    sample: object

    @classmethod
    def of(cls, buf, lay: _Layout) -> "_StepInputs":
        def ints(off: int, n: int):
            return buf.view_bytes(off, n, np.int32)

        r = lay.rows
        return cls(ints(lay.tok, r), ints(lay.pos, r), ints(lay.slots, r), ints(lay.seq, r), ints(lay.out_rows, r),
                   ints(lay.feed, r), ints(lay.tiles, 2 * lay.tile_cap), ints(lay.tables, lay.table_cap),
                   buf.view_bytes(lay.sample, ops.SampleParams.nbytes(r), np.uint8))


class CudaBackend:
    name = "cuda"
    samples_on_device = True  # chunks with `sample` set come back as SampledToken
    runs_ahead = True  # submit() returns before the step ends, and can feed a step from the last one's draws

    def __init__(self, config: ModelConfig, gguf_file: GGUFFile, *, n_blocks: int, block_size: int = 16,
                 device=None, max_rows: int = 512, max_seqs: int = 64, kv_dtype: str = "f16",
                 tensor_cores: bool = True, graphs: bool = True, int8_activations: bool = True,
                 f16_weights: str = "auto", pdl: bool = True):
        from ember.kernels.cuda_runtime import Device, Event, HostBuffer, Stream

        if kv_dtype not in ("f16", "f32"):
            raise ValueError("kv_dtype must be f16 or f32")
        if f16_weights not in ("auto", "on", "off"):
            raise ValueError("f16_weights must be auto, on or off")
        if config.hidden > ops.NORM_MAX_COLS:
            raise ModelFileError(gguf_file.path, f"hidden size {config.hidden} exceeds the CUDA backend's "
                                                 f"{ops.NORM_MAX_COLS} (its norm kernels)")
        try:
            self.dev = device if device is not None else Device()
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        self.config, self.gguf = config, gguf_file
        self.block_size, self.n_blocks = block_size, n_blocks
        self.kv_dtype = np.float16 if kv_dtype == "f16" else np.float32
        self.block_dtype = np.dtype(self.kv_dtype)  # blocks go to the KV store as they are on the device
        # float16 blocks on disk since KV layout 2 of the store (cuda_kv.py); float32 files stay apart
        self.kv_layout = "cuda" if kv_dtype == "f32" else f"cuda-{kv_dtype}"
        self._transfer = None  # KVTransfer, made on the first save or load (pinned slabs)
        self.max_rows = max(8, -(-max(max_rows, max_seqs) // 8) * 8)
        self.max_seqs = max_seqs
        self.graphs_enabled = graphs
        # small batches of Q4_K/Q5_K rows: x quantized to int8 in the matvec (dp4a), as llama.cpp does
        self.int8_activations = int8_activations
        # captured decode steps launch each kernel early (programmatic dependent launch, sm_90+)
        self.pdl = pdl and self.dev.cc[0] >= 9
        # Gemma's activations can exceed float16's range; bf16 keeps float32's exponent
        self.half_kind = "bf16" if config.arch.startswith("gemma") else "f16"
        cfg = config
        self._device_attention = (cfg.head_dim in ATTN_HEAD_DIMS and cfg.n_heads % cfg.n_kv_heads == 0
                                  and cfg.n_heads // cfg.n_kv_heads in ATTN_GROUPS)
        # prefill steps: flash attention on the tensor cores (float16 KV; the exact mode keeps float32)
        self._flash = (self._device_attention and kv_dtype == "f16" and tensor_cores
                       and cfg.head_dim in ops.FLASH_HEAD_DIMS)
        try:
            self.dev.make_current()
            self.stream = Stream()
            self._upload_weights()
            self.tensor_cores = tensor_cores and all(
                lw[w].cols % 32 == 0 for lw in self.layers for w in _ALL_MATRICES if w in lw)
            self._alloc_kv()
            self.f16_weights = self._keep_half_weights(f16_weights)
            self._alloc_step_buffers(HostBuffer, Event, Stream)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        self._graphs: dict[tuple[int, int, int], tuple[object, dict]] = {}  # (rows, stride, slot)
        self._seen: set[tuple[int, int]] = set()
        self.graph_replays = 0

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str = "f16") -> int:
        return 2 * config.n_layers * block_size * config.kv_dim * (2 if kv_dtype == "f16" else 4)

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

    def _stackable(self, layer: int, parts: tuple[str, ...]) -> bool:
        infos = [self.gguf.tensors.get(f"blk.{layer}.{_LAYER[p]}") for p in parts]
        if not self._device_attention or any(t is None for t in infos) or len({t.shape[0] for t in infos}) > 1:
            return False
        types = {t.ggml_type for t in infos}
        if len(types) == 1:
            return True
        # mixed legacy types (Gemma 3 270M: q, k Q5_0, v Q8_0) stack as Q8_0, which holds them exactly,
        # where the extra bytes cost less than the launch they save
        if not types <= set(quants.Q8_0_EXACT):
            return False
        cols = int(infos[0].shape[0])
        extra = sum(int(t.shape[1]) * (quants.row_nbytes(GGMLQuantizationType.Q8_0, cols)
                                       - quants.row_nbytes(t.ggml_type, cols)) for t in infos)
        return extra <= STACK_UPCAST_MAX_BYTES

    def _stacked(self, layer: int, parts: tuple[str, ...]) -> ops.QuantMatrix:
        infos = [self.gguf.tensors[f"blk.{layer}.{_LAYER[p]}"] for p in parts]
        same = len({t.ggml_type for t in infos}) == 1
        raw = np.concatenate([np.asarray(self.gguf.raw(t.name)).view(np.uint8).reshape(-1) if same
                              else quants.to_q8_0(self.gguf.raw(t.name), t.ggml_type) for t in infos])
        return ops.QuantMatrix.upload(self.dev, raw, infos[0].ggml_type if same else GGMLQuantizationType.Q8_0,
                                      sum(int(t.shape[1]) for t in infos), int(infos[0].shape[0]))

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
                if ours not in _MATRICES:
                    lw[ours] = self._vector(full)[0]
            plan: dict[str, str] = {}  # matrix -> the stack it joins
            for stack, parts in _STACKS.items():
                if not any(p in plan for p in parts) and self._stackable(i, parts):
                    plan.update(dict.fromkeys(parts, stack))
            for ours in _MATRICES:  # uploaded after the stacking decision, so nothing is held twice
                stack = plan.get(ours)
                if stack is None:
                    if f"blk.{i}.{_LAYER[ours]}" in g.tensors:
                        lw[ours] = self._matrix(f"blk.{i}.{_LAYER[ours]}")
                elif stack not in lw:
                    lw[stack] = self._stacked(i, _STACKS[stack])
            self.layers.append(lw)
        half = cfg.head_dim // 2
        exponents = np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim
        freqs = 1.0
        if "rope_freqs.weight" in g.tensors:
            freqs = np.asarray(self._vector("rope_freqs.weight")[1], np.float64)
        inv_global = cfg.rope_scale / (cfg.rope_base**exponents) / freqs
        inv_local = 1.0 / (cfg.rope_base_local**exponents)
        self.inv_freq_global = self.dev.to_device(inv_global.astype(np.float32))
        self.inv_freq_local = self.dev.to_device(inv_local.astype(np.float32))

    def _alloc_kv(self) -> None:
        cfg = self.config
        # one block past the pool: the padded rows of a captured decode step write there
        self.trash_block = self.n_blocks
        self._layer_elems = (self.n_blocks + 1) * self.block_size * cfg.kv_dim
        self.k_pool = self.dev.empty((cfg.n_layers * self._layer_elems,), self.kv_dtype)
        self.v_pool = self.dev.empty((cfg.n_layers * self._layer_elems,), self.kv_dtype)
        self.k_pool.zero()
        self.v_pool.zero()

    def _tc_matrices(self) -> list[ops.QuantMatrix]:
        mats = [lw[w] for lw in self.layers for w in _ALL_MATRICES if w in lw]
        return mats + ([self.output] if self.output not in mats else [])

    def _keep_half_weights(self, mode: str) -> bool:
        """Decode the tensor-core matmuls' weights to 16 bits once, after the KV pool has its memory:
        prefill and batched decode then skip a decode of every matrix per step (on the 8B at 64
        streams, 5.3 ms of a step). "auto" keeps them when they fit with a tenth of the device free."""
        if mode == "off" or not self.tensor_cores:
            return False
        mats = self._tc_matrices()
        need = sum(2 * m.rows * m.cols for m in mats)
        free, total = self.dev.memory_info()
        if mode == "auto" and need + total // 10 > free:
            return False
        for m in mats:
            m.keep_half(self.dev, self.half_kind, stream=self.stream)
        self.stream.synchronize()
        return True

    def _alloc_step_buffers(self, HostBuffer, Event, Stream) -> None:
        cfg, R = self.config, self.max_rows
        blocks = -(-max(cfg.context_length, 1) // self.block_size)
        table_len = 1 << (blocks - 1).bit_length()  # decode steps bucket their table width to a power of 2
        self.layout = _Layout(R, self.max_seqs, (self.max_seqs + 1) * table_len)
        # two of each: a step is packed, its inputs sent and it is launched while the one before still runs
        self._h_in = [HostBuffer(self.layout.nbytes) for _ in range(2)]
        self._d_in = [self.dev.empty((self.layout.nbytes,), np.uint8) for _ in range(2)]
        self.inputs = [_StepInputs.of(d, self.layout) for d in self._d_in]
        # each slot's draws: step n + 1 may read step n's (run-ahead feed) while step n's go to the host
        self.d_tokens_out = [self.dev.empty((R,), np.int32) for _ in range(2)]
        self.up_stream, self.down_stream = Stream(), Stream()
        self._uploaded = [Event(), Event()]  # a slot's inputs are on the device
        self._ran = [Event(), Event()]  # a slot's step (and its logits copy) is done on the compute stream
        e = self.dev.empty
        hid, qd, kvd, ffn = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn
        self.x, self.h, self.o2 = e((R * hid,)), e((R * hid,)), e((R * hid,))
        self.q, self.att = e((R * qd,)), e((R * qd,))
        self.k, self.v = e((R * kvd,)), e((R * kvd,))
        self.g, self.u = e((R * ffn,)), e((R * ffn,))
        self.qkv = e((R * (qd + 2 * kvd),)) if any("wqkv" in lw or "wqk" in lw for lw in self.layers) else None
        self.gu = e((R * 2 * ffn,)) if any("w_gu" in lw for lw in self.layers) else None
        self.hn = e((R * hid,))
        # the residual's second buffer, for post-norms done inside the next matvec (_PostNorms)
        self.x_alt = e((hid,)) if cfg.post_norms and hid <= ops.XPRO_COLS else None
        self.logits = e((R * cfg.vocab_size,))
        # the sampler's per-row counters (kept at zero by the kernel) and per-block partial results
        self.d_sample_work = (e((R,), np.int32), e((2 * R * ops.sample_parts(cfg.vocab_size),), np.int32))
        self.d_sample_work[0].zero()
        self.d_argmax = ops.RowArgmax.alloc(self.dev)
        self._h_tokens = [HostBuffer(4 * R) for _ in range(2)]
        self._h_logits: list[HostBuffer | None] = [None, None]
        self._done = [Event(), Event()]  # recorded after each slot's step and its tokens' copy back
        self._inflight: list[_Pending | None] = [None, None]
        self._slot = 0
        self._last: _Pending | None = None  # the step submitted last: the one a run-ahead step feeds on
        if self.tensor_cores:  # the prefill matmul's 16-bit scratch, at its largest, once
            biggest = max(lw[w].rows * lw[w].cols for lw in self.layers for w in _ALL_MATRICES if w in lw)
            widest = max(lw[w].cols for lw in self.layers for w in _ALL_MATRICES if w in lw)
            if not self.f16_weights:
                self.dev.scratch("gemm_w", 2 * biggest)
            self.dev.scratch("gemm_x", 2 * R * widest)
            self.dev.scratch("gemm_splitk", ops.gemm_splitk_bytes(self.dev))
            if _bucket(min(self.max_seqs, GRAPH_BATCHES[-1]), GRAPH_BATCHES) >= TC_MIN_ROWS:  # graphs use it too
                if not self.f16_weights:
                    self.dev.scratch("gemm_out_w", 2 * self.output.rows * self.output.cols)
                self.dev.scratch("gemm_out_x", 2 * R * self.output.cols)

    def device_memory(self) -> tuple[int, int]:
        """(used, total) bytes on the device (all processes)."""
        free, total = self.dev.memory_info()
        return total - free, total

    # -- one step ---------------------------------------------------------------------------------

    @_poison_guard
    def inject_illegal_address(self) -> None:
        """--fault cuda-illegal-address: a kernel really writes out of bounds (sticky error 700)."""
        self.dev.make_current()
        ops.fault_illegal_address(self.dev)

    def forward(self, chunks: list[SeqChunk]) -> list:
        return self.submit(chunks).result()

    @_poison_guard
    def submit(self, chunks: list[SeqChunk], feed: list[int | None] | None = None) -> "_Pending":
        """Launch one step and return at once; its result() waits for the device. feed[i] = j: chunk i's
        one token is the draw of chunk j of the step submitted just before (still running, perhaps),
        copied on the device; its `tokens` value is ignored. At most two steps are in flight: a third
        submit first collects the oldest."""
        dev, cfg, bs = self.dev, self.config, self.block_size
        dev.make_current()
        n = sum(len(c.tokens) for c in chunks)
        if n > self.max_rows or len(chunks) > self.max_rows:
            raise ValueError(f"a step of {n} tokens exceeds this backend's {self.max_rows} rows")
        sources = self._feed_sources(chunks, feed) if feed is not None else None
        decode = all(len(c.tokens) == 1 and c.logits == "last" for c in chunks)
        graph_rows = _bucket(len(chunks), GRAPH_BATCHES) if decode and len(chunks) <= min(self.max_seqs, GRAPH_BATCHES[-1]) else 0
        rows = max(graph_rows, n)
        max_len = max(c.start + len(c.tokens) for c in chunks)
        stride = max(1, -(-max_len // bs))
        if graph_rows:
            stride = 1 << (stride - 1).bit_length()  # bucket the context so graphs are reused
        if (len(chunks) + 1) * stride > self.layout.table_cap:
            raise ValueError("the step's block tables exceed the staging buffer")
        slot = self._slot
        older = self._inflight[slot]
        if older is not None:  # its host buffers are this step's: wait for it (its error is its own)
            try:
                older.result()
            except ContextPoisoned:
                raise
            except Exception:
                pass

        # the step's inputs, packed into pinned memory and sent in one copy
        lay, hb = self.layout, self._h_in[slot].array
        tok = _host(hb, lay.tok, rows, np.int32)
        pos = _host(hb, lay.pos, rows, np.int32)
        slots = _host(hb, lay.slots, rows, np.int32)
        seq = _host(hb, lay.seq, rows, np.int32)
        tables = _host(hb, lay.tables, (len(chunks) + (1 if graph_rows else 0)) * stride, np.int32)
        tok[:n] = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        if sources is not None:
            tok[:n][sources >= 0] = 0
        if graph_rows:  # a captured step feeds its own tokens (its first kernel): -1 keeps the host's
            fed = _host(hb, lay.feed, rows, np.int32)
            fed[:] = -1
            if sources is not None:
                fed[:n] = sources
        elif sources is not None:
            _host(hb, lay.feed, n, np.int32)[:] = sources
        if tok[:n].size and (tok[:n].min() < 0 or tok[:n].max() >= cfg.vocab_size):
            raise ValueError("token id out of range")
        pos[:n] = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        slots[:n] = kv_slots(chunks, bs, self.n_blocks)
        spans, at = [], 0
        tables = tables.reshape(-1, stride)  # a view: writes land in the host buffer
        tables[:] = self.trash_block
        for si, c in enumerate(chunks):
            m = len(c.tokens)
            spans.append((at, at + m))
            seq[at : at + m] = si
            used = min(len(c.block_table), stride)
            tables[si, :used] = c.block_table[:used]
            at += m
        if graph_rows:  # padded rows: token 0 at position 0 of the trash block
            tok[n:rows], pos[n:rows], seq[n:rows] = 0, 0, len(chunks)
            slots[n:rows] = self.trash_block * bs
        # which rows need logits, and which of those are drawn on the device
        want: list[tuple[int, int, int]] = []  # (chunk, first row, row count)
        for si, (c, (a, b)) in enumerate(zip(chunks, spans)):
            if c.logits == "last":
                want.append((si, b - 1, 1))
            elif c.logits == "all":
                want.append((si, a, b - a))
        out_rows = _host(hb, lay.out_rows, rows, np.int32)
        n_out = 0
        for _, r0, cnt in want:
            out_rows[n_out : n_out + cnt] = np.arange(r0, r0 + cnt)
            n_out += cnt
        sampled = [si for si, _, cnt in want if cnt == 1 and chunks[si].sample is not None]
        if graph_rows:
            out_rows[:rows] = np.arange(rows)
            n_out = rows
        self._pack_sampling(hb, chunks, want, n_out)
        n_tiles = 0
        if not graph_rows and self._flash and n > len(chunks):  # prefill rows: flash attention
            tiles = ops.flash_tiles(spans)
            if len(tiles) <= lay.tile_cap:
                n_tiles = len(tiles)
                _host(hb, lay.tiles, 2 * n_tiles, np.int32)[:] = tiles.reshape(-1)
        end = lay.tables + tables.nbytes
        # the slot's device inputs are free: the step that last read them (two submits ago) was collected
        self._d_in[slot].view(0, end).upload_from(self._h_in[slot], end, self.up_stream)
        self._uploaded[slot].record(self.up_stream)
        self.stream.wait(self._uploaded[slot])

        max_keys = stride * bs if graph_rows else max_len
        if graph_rows:
            key, gkey = (graph_rows, stride), (graph_rows, stride, slot)  # a shape; its graph for this slot
            if gkey in self._graphs:
                self._graphs[gkey][0].launch()
                self.graph_replays += 1
            elif key in self._seen and self.graphs_enabled and self._device_attention:
                self._graphs[gkey] = self._capture(rows, stride, max_keys, n_out, slot)
                self._graphs[gkey][0].launch()
            else:  # the first time: run eagerly (loads modules, warms up), capture next time
                self._seen.add(key)
                self._launch(rows, stride, max_keys, n_out, slot, chunks, spans, pos, feed=True)
        else:
            # feed: the previous step's draws, still on the device, become tokens
            self._launch(n, stride, max_keys, n_out, slot, chunks, spans, pos, sample=bool(sampled),
                         n_tiles=n_tiles, feed=sources is not None)
        pending = _Pending(self, slot, chunks, want, sampled, n_out)
        self._copy_back(pending)
        self._inflight[slot] = self._last = pending
        self._slot ^= 1  # only after a launch: a fed step's source is always the other slot's last step
        return pending

    def _feed_sources(self, chunks, feed) -> np.ndarray:
        """Per row, the row of the previous step's draws (d_tokens_out) that is its token, or -1."""
        prev = self._last
        if len(feed) != len(chunks):
            raise ValueError("feed needs one entry per chunk")
        sources = np.full(sum(len(c.tokens) for c in chunks), -1, np.int32)
        at = 0
        for c, j in zip(chunks, feed):
            if j is not None:
                if prev is None or j not in prev.drawn_rows:
                    raise ValueError(f"feed {j}: the previous step drew no token for that chunk")
                if len(c.tokens) != 1:
                    raise ValueError("a fed chunk has exactly one token")
                sources[at] = prev.drawn_rows[j]
            at += len(c.tokens)
        return sources

    def _pack_sampling(self, hb, chunks, want, n_out) -> None:
        """SampleParams for the logits rows, in out_rows order (rows not drawn: greedy, ignored)."""
        temp = np.zeros(n_out, np.float32)
        top_k = np.zeros(n_out, np.int32)
        top_p = np.ones(n_out, np.float32)
        min_p = np.zeros(n_out, np.float32)
        seed = np.zeros(n_out, np.uint64)
        step = np.zeros(n_out, np.uint32)
        at = 0
        for si, _, cnt in want:
            s = chunks[si].sample
            if s is not None and cnt == 1:
                temp[at], top_k[at], top_p[at], min_p[at] = s.temperature, s.top_k, s.top_p, s.min_p
                seed[at], step[at] = s.seed & (2**64 - 1), s.step & (2**32 - 1)
            at += cnt
        buf = hb[self.layout.sample : self.layout.sample + ops.SampleParams.nbytes(n_out)]
        ops.SampleParams.pack(buf, n_out, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                              step=step)

    def _copy_back(self, p: "_Pending") -> None:
        """Queue the copies of what the scheduler needs into the step's host buffers: logits for the rows
        not drawn on the device (the compute stream: the next step overwrites them), then the drawn
        tokens (the download stream, off the compute stream's path: each slot has its own), and mark
        where they are done."""
        st, V = self.stream, self.config.vocab_size
        if p.host_rows:
            total = sum(cnt for _, _, cnt in p.host_rows) * V * 4
            buf = self._h_logits[p.slot]
            if buf is None or buf.nbytes < total:
                from ember.kernels.cuda_runtime import HostBuffer

                if buf is not None:
                    buf.free()  # nothing still copies into it: the step that used this slot was collected
                buf = self._h_logits[p.slot] = HostBuffer(max(total, 4 * V * 8))
            at = 0
            for _, r, cnt in p.host_rows:
                self.logits.view(r * V, cnt * V).download_into(buf, cnt * V * 4, st, host_offset=at)
                at += cnt * V * 4
        self._ran[p.slot].record(st)
        self.down_stream.wait(self._ran[p.slot])
        if p.sampled:
            self.d_tokens_out[p.slot].view(0, p.n_out).download_into(self._h_tokens[p.slot], 4 * p.n_out,
                                                                     self.down_stream)
        self._done[p.slot].record(self.down_stream)

    @_poison_guard
    def _collect(self, p: "_Pending") -> list:
        self.dev.make_current()
        self._done[p.slot].synchronize()
        out: list = [None] * len(p.chunks)
        if p.sampled:
            toks = _host(self._h_tokens[p.slot].array, 0, p.n_out, np.int32)
            for si, row in p.drawn_rows.items():
                out[si] = SampledToken(int(toks[row]))
        at, V = 0, self.config.vocab_size
        for si, _, cnt in p.host_rows:
            out[si] = _host(self._h_logits[p.slot].array, at, cnt * V, np.float32).reshape(cnt, V).copy()
            at += cnt * V * 4
        return out

    def _capture(self, rows, stride, max_keys, n_out, slot):
        """Record one decode step of `rows` sequences over at most `max_keys` keys, reading the inputs of
        `slot`, as a CUDA graph with split-K buffers of its own (scratch that later grows must not move
        under a graph)."""
        from ember.kernels.cuda_runtime import Graph

        cfg = self.config
        S = 1
        for li in range(cfg.n_layers):
            window = cfg.sliding_window if cfg.is_local_layer(li) else 0
            keys = min(max_keys, window) if window else max_keys
            S = max(S, ops.attention_parts(self.dev, rows, cfg.n_heads, cfg.n_kv_heads, keys, cfg.head_dim,
                                           decode=True, kv_bytes=self.kv_dtype().itemsize))
        bufs = (self.dev.empty((rows * cfg.n_heads * S * cfg.head_dim,)), self.dev.empty((rows * cfg.n_heads * S * 2,)))
        self.stream.synchronize()
        with Graph.capture(self.stream) as g, pdl_launches(self.pdl):
            self._launch(rows, stride, max_keys, n_out, slot, None, None, None, partials=bufs, feed=True)
        return g, bufs

    def _int8(self, w: ops.QuantMatrix, n: int, tc: bool = True) -> bool:
        """Whether a matmul of n rows runs as the int8 matvec (which can fuse the gated activation)."""
        return (self.int8_activations and n <= ops.KQ8_MAX_ROWS and ops.kq8_supported(w)
                and not (n == 1 and w.rows < INT8_MIN_ROWS)
                and not (tc and self.tensor_cores and n >= TC_MIN_ROWS))

    def _staged(self, w: ops.QuantMatrix, n: int, tc: bool = True) -> bool:
        """Whether _linear runs one row through the staged matvec (matvec.cu qmv)."""
        return (n == 1 and not (tc and self.tensor_cores and n >= TC_MIN_ROWS) and not self._int8(w, n, tc)
                and (w.rows < INT8_MIN_ROWS or not ops.kv2_supported(w)))

    def _takes_post_norm(self, w: ops.QuantMatrix, n: int, tc: bool, gated: bool) -> bool:
        """Whether the matvec of w (gated: the stacked gate|up one) can compute its input itself
        (ops.matvec_post_norm), saving the rms_norm_add_norm launch."""
        if n != 1 or not ops.post_norm_supported(w):
            return False
        if gated:
            return not self._int8(w, n, tc) and w.type not in ops.KV2_TYPES and ops.matvec_gated_supported(w)
        return self._staged(w, n, tc)

    def _streamed(self, w: ops.QuantMatrix, n: int) -> bool:
        """Whether _linear streams one row through a tall Q8_0 matrix (ops.matvec_stream_q8_0)."""
        return n == 1 and self.int8_activations and w.rows >= STREAM_MIN_ROWS and ops.stream_q8_0_supported(w)

    def _linear(self, w: ops.QuantMatrix, x, y, n: int, res=None, tc: bool = True, argmax=None) -> None:
        out = w is self.output
        if isinstance(x, ops.PostNorm):  # one row, normalised by the matvec itself (_PostNorms)
            ops.matvec_post_norm(self.dev, w, x, y, stream=self.stream)
        elif self._streamed(w, n):
            ops.matvec_stream_q8_0(self.dev, w, x, y, res=res, argmax=argmax, stream=self.stream)
        elif tc and self.tensor_cores and n >= TC_MIN_ROWS:
            # the output projection has scratch of its own: growing the layers' would move it under graphs
            ops.linear_tc(self.dev, w, x, y, n=n, res=res, kind=self.half_kind, scratch="gemm_out" if out else "gemm",
                          stream=self.stream)
        elif self._int8(w, n, tc):
            ops.matvec_q8(self.dev, w, x, y, n=n, res=res, stream=self.stream)
        else:
            small = n == 1 and w.rows < INT8_MIN_ROWS  # staged beats kv2 there too (Q4_K 640 x 1024: 2.28 vs 3.62 us)
            split = small and w.cols >= SPLIT_MIN_COLS and w.row_bytes % 16 == 0 and w.data.ptr % 16 == 0
            ops.matvec(self.dev, w, x, y, n=n, res=res, variant="staged" if small else "auto", split=split,
                       stream=self.stream)

    def _gate_up(self, lw: dict, h, n: int, tc: bool = True) -> bool:
        """The MLP's gate and up projections. True: a matvec took the stacked matrix and wrote
        act(gate) * up to self.g (the activation in its epilogue: the int8 one for K-quants, the staged
        one for the other types); else self.gu (or self.g, self.u) holds them apart."""
        cfg = self.config
        if "w_gu" not in lw:
            self._linear(lw["w_gate"], h, self.g, n, tc=tc)
            self._linear(lw["w_up"], h, self.u, n, tc=tc)
            return False
        w = lw["w_gu"]
        if isinstance(h, ops.PostNorm):  # the staged gated matvec, normalising its input itself
            ops.matvec_post_norm(self.dev, w, h, self.g, act=cfg.act, stream=self.stream)
            return True
        if self._int8(w, n, tc):
            ops.matvec_q8(self.dev, w, h, self.g, n=n, act=cfg.act, gated=True, stream=self.stream)
            return True
        matmul = tc and self.tensor_cores and n >= TC_MIN_ROWS
        if not matmul and w.type not in ops.KV2_TYPES and ops.matvec_gated_supported(w):
            ops.matvec_gated(self.dev, w, h, self.g, n=n, act=cfg.act, stream=self.stream)
            return True
        self._linear(w, h, self.gu, n, tc=tc)
        return False

    def _down(self, lw: dict, y, n: int, res=None, tc: bool = True, gated: bool = False) -> None:
        """The MLP's down projection of act(gate) * up: already in self.g when `gated`; else the
        activation runs inside the int8 matvec when that takes the step, or as a kernel of its own."""
        cfg, w = self.config, lw["w_down"]
        if gated:
            self._linear(w, self.g, y, n, res=res, tc=tc)
            return
        if "w_gu" in lw and self._int8(w, n, tc):
            ops.matvec_q8(self.dev, w, self.gu, y, n=n, res=res, ldx=2 * cfg.ffn, act=cfg.act, up_offset=cfg.ffn,
                          stream=self.stream)
            return
        if "w_gu" in lw:
            ops.gated_act(self.dev, self.gu, self.gu.view(cfg.ffn, self.gu.size - cfg.ffn), self.g, n=n,
                          ffn=cfg.ffn, act=cfg.act, ldg=2 * cfg.ffn, ldu=2 * cfg.ffn, ldo=cfg.ffn, stream=self.stream)
        else:
            ops.gated_act(self.dev, self.g, self.u, self.g, n=n, ffn=cfg.ffn, act=cfg.act, stream=self.stream)
        self._linear(w, self.g, y, n, res=res, tc=tc)

    def _launch(self, n, stride, max_keys, n_out, slot, chunks, spans, positions, *, partials=None, sample=True,
                tc=True, n_tiles=0, feed=False) -> None:
        """Every kernel of one step, on self.stream, reading only device buffers (so it can be
        captured: the tensor-core path's scratch is sized at start for every layer matrix and never
        moves): the inputs of `slot`, the draws of the other slot (the step before) when fed, its own
        draws into its slot's; chunks/spans/positions are needed only by the host attention fallback."""
        dev, cfg, st = self.dev, self.config, self.stream
        inp = self.inputs[slot]
        H, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        hid, qd, kvd = cfg.hidden, cfg.q_dim, cfg.kv_dim
        x, h, o2, q, k, v, att = self.x, self.h, self.o2, self.q, self.k, self.v, self.att
        with pdl_launches(False):  # the step's first kernel follows the input copy, not a kernel
            # feed: the rows fed from the previous step's draws (d_feed: -1 for the others); the first
            # layer's attn_norm into h
            ops.embed(dev, self.token_embd, x, inp.tok, n=n, scale=float(np.float32(cfg.embed_scale)),
                      feed=(self.d_tokens_out[slot ^ 1], inp.feed) if feed else None,
                      norm=(self.layers[0]["attn_norm"], cfg.norm_eps, h), stream=st)
        h_ready = True  # h (or post.pending) holds this layer's attn_norm (embed, or the previous layer's end)
        # one row per sequence (a captured step's padded rows too): attention takes the prologue in
        decode = not n_tiles and (chunks is None or all(len(c.tokens) == 1 for c in chunks))
        post = _PostNorms(self, n, tc)  # Gemma's post-norms; post.x is the residual (x until one is fused)
        final = None  # the output rows' final-normed hidden state, once a fused norm has made it
        for li, lw in enumerate(self.layers):
            local = cfg.is_local_layer(li)
            if not h_ready:
                ops.rms_norm(dev, post.x, lw["attn_norm"], h, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
            if "wqkv" in lw:  # one matmul; q, k and v are column slices of its rows
                ld = qd + 2 * kvd
                (hq_,) = post.inputs([lw["wqkv"]])
                self._linear(lw["wqkv"], hq_, self.qkv, n, tc=tc)
                q_, k_, v_ = (self.qkv.view(off, self.qkv.size - off) for off in (0, qd, qd + kvd))
                ldq = ldk = ldv = ld
            elif "wqk" in lw:  # q and k stacked, v (another type) on its own
                hq_, hv_ = post.inputs([lw["wqk"], lw["wv"]])
                self._linear(lw["wqk"], hq_, self.qkv, n, tc=tc)
                self._linear(lw["wv"], hv_, v, n, tc=tc)
                q_, k_, v_ = self.qkv, self.qkv.view(qd, self.qkv.size - qd), v
                ldq = ldk = qd + kvd
                ldv = kvd
            else:
                ins = post.inputs([lw[w] for w in ("wq", "wk", "wv")])
                for wname, out, hin in zip(("wq", "wk", "wv"), (q, k, v), ins):
                    self._linear(lw[wname], hin, out, n, tc=tc)
                q_, k_, v_, ldq, ldk, ldv = q, k, v, qd, kvd, kvd
            for bname, out, cols, ldo in (("bq", q_, qd, ldq), ("bk", k_, kvd, ldk), ("bv", v_, kvd, ldv)):
                if bname in lw:
                    ops.add_bias(dev, out, lw[bname], n=n, cols=cols, ldy=ldo, stream=st)
            inv = self.inv_freq_local if local else self.inv_freq_global
            kc = self.k_pool.view(li * self._layer_elems, self._layer_elems)
            vc = self.v_pool.view(li * self._layer_elems, self._layer_elems)
            window = cfg.sliding_window if local else 0
            keys = min(max_keys, window) if window else max_keys
            if self._device_attention and decode:  # the prologue fused into decode attention: one launch
                pro = ops.DecodePrologue(k_, v_, inp.slots, inv, cfg.rope_neox, ldk, ldv, lw.get("q_norm"),
                                         lw.get("k_norm"), cfg.norm_eps)
                ops.attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, att, rows=n, heads=H,
                              kv_heads=Hk, head_dim=D, block_size=self.block_size, max_blocks=stride,
                              max_keys=keys, window=window, scale=cfg.attn_scale, partials=partials, ldq=ldq,
                              prologue=pro, stream=st)
            elif self._device_attention:  # q/k norms, RoPE and the KV write in one launch
                ops.qk_rope_kv(dev, q_, k_, v_, kc, vc, inp.slots, inp.pos, inv, n=n, heads=H, kv_heads=Hk,
                               head_dim=D, neox=cfg.rope_neox, q_norm=lw.get("q_norm"), k_norm=lw.get("k_norm"),
                               eps=cfg.norm_eps, ldq=ldq, ldk=ldk, ldv=ldv, stream=st)
                if n_tiles:  # prefill: tiles of query rows on the tensor cores
                    ops.flash_attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, inp.tiles, att,
                                        n_tiles=n_tiles, heads=H, kv_heads=Hk, head_dim=D,
                                        block_size=self.block_size, max_blocks=stride, window=window,
                                        scale=cfg.attn_scale, ldq=ldq, stream=st)
                else:
                    ops.attention(dev, q_, kc, vc, inp.tables, inp.seq, inp.pos, att, rows=n, heads=H,
                                  kv_heads=Hk, head_dim=D, block_size=self.block_size, max_blocks=stride,
                                  max_keys=keys, window=window, scale=cfg.attn_scale, partials=partials, ldq=ldq,
                                  stream=st)
            else:
                if cfg.qk_norm:
                    ops.rms_norm(dev, q_, lw["q_norm"], q_, eps=cfg.norm_eps, rows=n * H, cols=D, heads=H, ldx=ldq,
                                 ldy=ldq, stream=st)
                    ops.rms_norm(dev, k_, lw["k_norm"], k_, eps=cfg.norm_eps, rows=n * Hk, cols=D, heads=Hk,
                                 ldx=ldk, ldy=ldk, stream=st)
                ops.rope(dev, q_, k_, inp.pos, inv, n=n, hq=H, hk=Hk, head_dim=D, neox=cfg.rope_neox, ldq=ldq,
                         ldk=ldk, stream=st)
                ops.kv_write(dev, k_, v_, kc, vc, inp.slots, n=n, kv_heads=Hk, head_dim=D, ldk=ldk, ldv=ldv,
                             stream=st)
                self._host_attention(li, chunks, spans, positions, q, att, window)
            if cfg.post_norms:  # Gemma: post-norm into the residual and the MLP's pre-norm (one launch, or none)
                self._linear(lw["wo"], att, o2, n, tc=tc)
                post.defer(o2, lw["post_attn_norm"], lw["ffn_norm"])
                (h_mlp,) = post.inputs([lw["w_gu"]] if "w_gu" in lw else [], gated=True) or [h]
            else:
                self._linear(lw["wo"], att, x, n, res=x, tc=tc)
                ops.rms_norm(dev, x, lw["ffn_norm"], h, eps=cfg.norm_eps, rows=n, cols=hid, stream=st)
                h_mlp = h
            gated = self._gate_up(lw, h_mlp, n, tc=tc)  # gate and up: one stacked matmul where their types agree
            h_ready = False
            if cfg.post_norms:
                self._down(lw, o2, n, tc=tc, gated=gated)
                if li + 1 < len(self.layers):  # and the next layer's attention pre-norm
                    post.defer(o2, lw["post_ffn_norm"], self.layers[li + 1]["attn_norm"])
                    h_ready = True
                elif n_out == n:  # every row is an output row, in order: the final norm joins the post-norm
                    post.defer(o2, lw["post_ffn_norm"], self.output_norm)
                    post.inputs([])
                    final = h
                else:
                    ops.rms_norm_add(dev, o2, lw["post_ffn_norm"], post.x, eps=cfg.norm_eps, rows=n, cols=hid,
                                     stream=st)
            else:
                self._down(lw, x, n, res=x, tc=tc, gated=gated)
        if n_out:
            if final is None:
                src = post.x
                if n_out != n:  # the output rows are a subset (out_rows lists them in order)
                    ops.gather_rows(dev, post.x, inp.out_rows, o2, n=n_out, cols=hid, stream=st)
                    src = o2
                ops.rms_norm(dev, src, self.output_norm, self.hn, eps=cfg.norm_eps, rows=n_out, cols=hid, stream=st)
                final = self.hn
            # one row streamed through a tall Q8_0 output projection: its greedy token found on the way
            argmax = self.d_argmax if sample and self._streamed(self.output, n_out) else None
            self._linear(self.output, final, self.logits, n_out, tc=tc, argmax=argmax)
            if sample:
                params = inp.sample.view(0, ops.SampleParams.nbytes(n_out))
                ops.sample(dev, self.logits, params, self.d_tokens_out[slot], rows=n_out, vocab=cfg.vocab_size,
                           work=self.d_sample_work, greedy=argmax, stream=st)

    def _host_attention(self, li, chunks, spans, positions, q, att, window) -> None:
        """Fallback for head sizes without a device kernel: the numpy twin over this layer's blocks."""
        cfg, bs = self.config, self.block_size
        n = spans[-1][1]
        self.stream.synchronize()
        qh = q.view(0, (n, cfg.n_heads, cfg.head_dim)).to_host()
        shape = (self.n_blocks + 1, bs, cfg.n_kv_heads, cfg.head_dim)
        kc = self.k_pool.view(li * self._layer_elems, shape).to_host().astype(np.float32)
        vc = self.v_pool.view(li * self._layer_elems, shape).to_host().astype(np.float32)
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

    def _block_copy(self, block: int, host: np.ndarray, to_host: bool) -> None:
        """K and V of one block for every layer <-> host [2, layers, block_size * kv_dim] (KV dtype):
        two strided copies (a block's rows sit a layer's pool apart)."""
        from ember.kernels.cuda_runtime import copy_2d

        if not 0 <= block < self.n_blocks:
            raise IndexError(f"block {block} outside the pool of {self.n_blocks}")
        item = np.dtype(self.kv_dtype).itemsize
        width = self.block_size * self.config.kv_dim * item
        pitch = self._layer_elems * item
        for half, pool in enumerate((self.k_pool, self.v_pool)):
            dev_ptr = pool.ptr + block * width
            host_ptr = host[half].ctypes.data
            if to_host:
                copy_2d(dst=host_ptr, dst_pitch=width, src=dev_ptr, src_pitch=pitch, width=width,
                        height=self.config.n_layers, to_host=True)
            else:
                copy_2d(dst=dev_ptr, dst_pitch=pitch, src=host_ptr, src_pitch=width, width=width,
                        height=self.config.n_layers, to_host=False)

    @_poison_guard
    def read_block(self, block: int) -> np.ndarray:
        self.dev.make_current()
        self.stream.synchronize()  # the step that wrote it is done
        cfg = self.config
        raw = np.empty((2, cfg.n_layers, self.block_size * cfg.kv_dim), dtype=self.kv_dtype)
        self._block_copy(block, raw, to_host=True)
        return raw.astype(np.float32, copy=False).reshape(2, cfg.n_layers, self.block_size, cfg.n_kv_heads,
                                                          cfg.head_dim)

    def _kv_transfer(self):
        if self._transfer is None:
            from .cuda_kv import KVTransfer

            cfg = self.config
            self._transfer = KVTransfer(self.dev, self.k_pool, self.v_pool, self.stream, layers=cfg.n_layers,
                                        layer_elems=self._layer_elems, block_elems=self.block_size * cfg.kv_dim,
                                        block_shape=(2, cfg.n_layers, self.block_size, cfg.n_kv_heads, cfg.head_dim),
                                        dtype=self.kv_dtype)
        return self._transfer

    @_poison_guard
    def save_blocks(self, blocks: list[int]):
        """KV blocks off the device on a copy stream of their own (cuda_kv.py): no host wait, and the
        compute stream waits only for the gather before its next step."""
        if any(not 0 <= b < self.n_blocks for b in blocks):
            raise IndexError(f"a block outside the pool of {self.n_blocks}")
        self.dev.make_current()
        return self._kv_transfer().save(list(blocks))

    @_poison_guard
    def load_blocks(self, blocks: list[int], payloads) -> None:
        if any(not 0 <= b < self.n_blocks for b in blocks):
            raise IndexError(f"a block outside the pool of {self.n_blocks}")
        self.dev.make_current()
        self._kv_transfer().load(list(blocks), payloads)

    @_poison_guard
    def write_block(self, block: int, data: np.ndarray) -> None:
        self.dev.make_current()
        self.stream.synchronize()  # no step still reads the block being replaced
        cfg = self.config
        raw = np.ascontiguousarray(np.asarray(data).reshape(2, cfg.n_layers, -1).astype(self.kv_dtype))
        self._block_copy(block, raw, to_host=False)
        # a copy from pageable memory may return before its DMA lands, and the backend's stream does
        # not wait for the legacy stream it runs on: the next step must see the block
        self.dev.synchronize()


class _Pending:
    """A launched step. result() waits for the device and returns what forward() would have."""

    def __init__(self, backend: CudaBackend, slot: int, chunks, want, sampled, n_out):
        self.backend, self.slot, self.chunks, self.n_out = backend, slot, chunks, n_out
        starts = _row_starts(want)
        self.sampled = sampled
        first = {si: r for r, (si, _, _) in zip(starts, want)}
        self.drawn_rows = {si: first[si] for si in sampled}  # chunk -> its row of d_tokens_out
        self.host_rows = [(si, r, cnt) for r, (si, _, cnt) in zip(starts, want) if si not in self.drawn_rows]
        self._outputs: list | None = None
        self._error: Exception | None = None

    def result(self) -> list:
        if self._error is not None:
            raise self._error
        if self._outputs is None:
            try:
                self._outputs = self.backend._collect(self)
            except Exception as e:  # raised once more to whoever asks again, not to the next step
                self._error = e
                raise
        return self._outputs


class _PostNorms:
    """One step's Gemma post-norms (rms_norm_add_norm: the residual += rms_norm(o) * w1, h =
    rms_norm(residual) * w2): each is held back (defer) until the matvecs that read h are known
    (inputs); when every one of them can compute h itself (one row, ops.matvec_post_norm) they do, the
    first writing the new residual to the other of two buffers (the rest of its grid still reads the
    old one), which saves a launch per post-norm; otherwise rms_norm_add_norm runs in place first."""

    def __init__(self, backend: CudaBackend, n: int, tc: bool):
        self.b, self.n, self.tc = backend, n, tc
        self.x, self.spare = backend.x, backend.x_alt  # the residual now, and the other buffer (or None)
        self.pending: tuple | None = None

    def defer(self, o, w1, w2) -> None:
        self.pending = (o, w1, w2)

    def inputs(self, mats: list, gated: bool = False) -> list:
        """What each matrix in mats reads as h: a PostNorm each, or the h buffer (after the launch)."""
        b = self.b
        if self.pending is None:
            return [b.h] * len(mats)
        (o, w1, w2), self.pending = self.pending, None
        if mats and self.spare is not None and all(b._takes_post_norm(w, self.n, self.tc, gated) for w in mats):
            out = [ops.PostNorm(o, self.x, self.spare if i == 0 else None, w1, w2, b.config.norm_eps)
                   for i in range(len(mats))]
            self.x, self.spare = self.spare, self.x
            return out
        ops.rms_norm_add_norm(b.dev, o, w1, self.x, w2, b.h, eps=b.config.norm_eps, rows=self.n,
                              cols=b.config.hidden, stream=b.stream)
        return [b.h] * len(mats)


def _row_starts(want) -> list[int]:
    starts, at = [], 0
    for _, _, cnt in want:
        starts.append(at)
        at += cnt
    return starts


def _host(buf: np.ndarray, offset: int, count: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    return buf[offset : offset + count * dt.itemsize].view(dt)

