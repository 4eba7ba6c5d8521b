"""The CUDA backend: the numpy backend's forward pass on the GPU, through ember.kernels.ops.

The layer is the family's recipe (model/arch/recipe.py), turned once at load into the forward pass's
switches (forward.py: rope flavour, post-norms, half type) and explicit variants per layer
(layers.py); the step never looks at the family's name nor probes which weights a layer has. This
file holds the device's memory, the step's inputs and outputs and their streams. Weights stay in their
GGUF block formats on the device (QuantMatrix). Decode-sized steps use the quantized matvec (weights
read once per launch of up to 4-8 rows; Q4_K/Q5_K with x quantized to int8, as llama.cpp does; the
choice of kernel: matmul.py); prefill-sized steps multiply on the tensor cores (ops.linear_tc)
with a 16-bit copy of each matrix, decoded once at start when it fits (f16_weights) or else per
step. Activations are float32; the KV pool (float16 by default) lives on the device with the numpy
backend's block semantics; blocks travel to and from the host through kv_blocks.py (the numpy
layout, or batches on a copy stream), so the prefix cache and KV persistence work unchanged.

Every buffer a step touches is allocated once, up front, and a step's inputs travel in one copy
from pinned memory. Steps alternate between two slots, each with its own input buffers (host and
device) and drawn-token buffers; the copies run on two copy streams (inputs up, tokens down), so
while step n runs, step n + 1's inputs are already on their way and step n - 1's tokens on theirs:
the compute stream only waits for an event between two steps. A decode step (one token per
sequence) is captured once per (batch bucket, context bucket, slot) as a CUDA graph and then replayed
with one launch, so the host does not bound small models. Chunks that ask for it (`SeqChunk.sample`)
are sampled on the device and come back as `SampledToken`; the rest come back as logits. submit()
launches a step and returns at once (two steps may be in flight, each with its own pinned buffers;
step.py holds their plumbing); a step's tokens may be the previous step's draws, copied on the
device (`feed`), so the scheduler launches decode step n + 1 before it reads step n's tokens and
the host's work overlaps the GPU's.

A sticky CUDA error (StickyCudaError: the context is poisoned) surfaces as ContextPoisoned, the
worker's contract (engine_poisoned, exit 75). Head sizes the attention kernel lacks (it has 64, 128
and 256) fall back to the numpy twin on the host (tiny test models only; never captured).
"""

from __future__ import annotations

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Graph, pdl_launches
from ember.kernels.errors import StickyCudaError

from ...model.config import ModelConfig
from ...model.gguf_file import GGUFFile, ModelFileError
from ..base import Backend, ContextPoisoned, SeqChunk, attempt, kv_slots
from .forward import Activations, Forward, KVPools
from .kv_blocks import CudaKVBlocks
from .layers import check_fits, check_runs, upload_weights
from .matmul import TC_MIN_ROWS, Matmuls
from .memory import MIN_KV_TOKENS, MemoryPicture, auto_kv_bytes, check_unified_budget, keep_half_copy
from .step import Landing, PendingStep, StepInputs, StepLayout, feed_sources, host_view, poison_guard

ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_GROUPS = (1, 2, 4, 8)
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bucket(n: int, buckets) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class CudaBackend(CudaKVBlocks, Backend):
    name = "cuda"
    fault_kinds = ("cuda-illegal-address",)  # inject_fault: a kernel really writes out of bounds
    samples_on_device = True  # chunks with `sample` set come back as SampledToken
    runs_ahead = True  # submit() returns before the step ends, and can feed a step from the last one's draws

    def __init__(self, config: ModelConfig, gguf_file: GGUFFile, *, n_blocks: int | None, block_size: int = 16,
                 device=None, max_rows: int = 512, max_seqs: int = 64, kv_dtype: str = "f16",
                 tensor_cores: bool = True, graphs: bool = True, int8_activations: bool = True,
                 f16_weights: str = "auto", pdl: bool = True, host_tier_bytes: int = 0, gpu_mem: int | None = None):
        """n_blocks None: the KV pool takes what is free once everything else has its memory (--kv-mem
        auto; memory.py); host_tier_bytes: the host KV tier's budget, which on an integrated GPU
        comes out of the same memory; gpu_mem: bytes of the device this process counts as the device's
        (--gpu-mem: a card shared, or a smaller card's budget), else all of it."""
        from ember.kernels.cuda_runtime import Device, Event, HostBuffer, Stream

        if kv_dtype not in ("f16", "f32"):
            raise ValueError("kv_dtype must be f16 or f32")
        if f16_weights not in ("auto", "on", "off"):
            raise ValueError("f16_weights must be auto, on or off")
        check_runs(gguf_file, config)
        if config.hidden > ops.NORM_MAX_COLS:
            raise ModelFileError(gguf_file.path, f"hidden size {config.hidden} exceeds the CUDA backend's "
                                                 f"{ops.NORM_MAX_COLS} (its norm kernels)")
        try:
            self.dev = device if device is not None else Device()
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        if gpu_mem is not None:
            self.dev.memory_cap = gpu_mem
        self.config, self.gguf = config, gguf_file
        self.block_size, self.n_blocks = block_size, n_blocks or 0
        self.kv_dtype = np.float16 if kv_dtype == "f16" else np.float32
        self._kv_name = kv_dtype
        self.block_dtype = np.dtype(self.kv_dtype)  # blocks go to the KV store as they are on the device
        # float16 blocks on disk since KV layout 2 of the store (kv.py); float32 files stay apart
        self.kv_layout = "cuda" if kv_dtype == "f32" else f"cuda-{kv_dtype}"
        self._transfer = None  # KVTransfer, made on the first save or load (pinned slabs)
        self.max_rows = max(8, -(-max(max_rows, max_seqs) // 8) * 8)
        self.max_seqs = max_seqs
        self.graphs_enabled = graphs
        # small batches of Q4_K/Q5_K rows: x quantized to int8 in the matvec (dp4a), as llama.cpp does
        self.int8_activations = int8_activations
        # captured decode steps launch each kernel early (programmatic dependent launch, sm_90+)
        self.pdl = pdl and self.dev.caps.pdl
        # the forward pass as the family's recipe has it, decided once (forward.py; the layers' variants: layers.py)
        self.half_kind = config.recipe.half_type  # tensor-core matmuls round to bf16 where activations outgrow f16
        cfg = config
        self._device_attention = (cfg.head_dim in ATTN_HEAD_DIMS and cfg.n_heads % cfg.n_kv_heads == 0
                                  and cfg.n_heads // cfg.n_kv_heads in ATTN_GROUPS)
        # prefill steps: flash attention on the tensor cores (float16 KV; the exact mode keeps float32)
        # (where its tiles fit the shared memory a block may have: head_dim 256 needs 99 KiB)
        self._flash = (self._device_attention and kv_dtype == "f16" and tensor_cores
                       and cfg.head_dim in ops.FLASH_HEAD_DIMS
                       and ops.flash_smem_bytes(cfg.head_dim) <= self.dev.caps.smem_optin)
        try:
            self.dev.make_current()
            check_fits(gguf_file, self.dev.memory_info())
            self.stream = Stream()
            free0 = self.dev.memory_info()[0]
            self._upload_weights()
            weights = free0 - self.dev.memory_info()[0]
            self.tensor_cores = tensor_cores and all(m.cols % 32 == 0 for lw in self.layers for m in lw.matrices())
            if n_blocks is not None:  # a pool of the size asked for first; else it takes what is left, last
                self._check_unified(n_blocks, host_tier_bytes)
                self._alloc_kv()
            self.f16_weights = self._keep_half_weights(f16_weights, kv_sized=n_blocks is not None)
            self._alloc_step_buffers(HostBuffer, Event, Stream)
            if n_blocks is None:
                self.n_blocks = self._auto_blocks(host_tier_bytes)
                self._alloc_kv()
            total = self.dev.memory_info()[1]
            kv = 2 * self._layer_elems * cfg.n_layers * np.dtype(self.kv_dtype).itemsize
            half = sum(2 * m.rows * m.cols for m in self._tc_matrices()) if self.f16_weights else 0
            self.memory = MemoryPicture(total, weights, half, kv, self.dev.caps.integrated, host_tier_bytes)
            self.fwd = Forward(self.dev, self.stream, cfg, self.weights, self.act, self.mm,
                               KVPools(self.k_pool, self.v_pool, self._layer_elems, self.n_blocks, block_size),
                               device_attention=self._device_attention, tensor_cores=self.tensor_cores,
                               half_kind=self.half_kind)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e
        self._graphs: dict[tuple[int, int, int], tuple[Graph, dict]] = {}  # (rows, stride, slot)
        self._seen: set[tuple[int, int]] = set()
        self.graph_replays = 0

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str = "f16") -> int:
        return 2 * config.n_layers * block_size * config.kv_dim * (2 if kv_dtype == "f16" else 4)

    # -- set-up -----------------------------------------------------------------------------------

    def _upload_weights(self) -> None:
        self.weights = w = upload_weights(self.dev, self.gguf, self.config, stack=self._device_attention)
        self.output, self.layers = w.output, w.layers

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
        mats = [m for lw in self.layers for m in lw.matrices()]
        return mats + ([self.output] if self.output not in mats else [])

    def _keep_half_weights(self, mode: str, kv_sized: bool) -> bool:
        """Decode the tensor-core matmuls' weights to 16 bits once: prefill and batched decode then skip a
        decode of every matrix per step (on the 8B at 64 streams, 5.3 ms of a step). "auto" keeps them
        where memory.keep_half_copy says (never the experts: they are not tensor-core matrices)."""
        if not self.tensor_cores:
            return False
        mats = self._tc_matrices()
        need = sum(2 * m.rows * m.cols for m in mats)
        free, total = self.dev.memory_info()
        if not keep_half_copy(mode, need, free, total, integrated=self.dev.caps.integrated, kv_sized=kv_sized):
            return False
        for m in mats:
            m.keep_half(self.dev, self.half_kind, stream=self.stream)
        self.stream.synchronize()
        return True

    def _auto_blocks(self, host_tier: int) -> int:
        """--kv-mem auto: the blocks that what is free now holds (memory.auto_kv_bytes), at least one
        MIN_KV_TOKENS-token sequence's, else a one-line ModelFileError."""
        free, total = self.dev.memory_info()
        per_block = self.kv_bytes_per_block(self.config, self.block_size, self._kv_name)
        budget = auto_kv_bytes(free, total, integrated=self.dev.caps.integrated, host_tier=host_tier)
        blocks = budget // per_block - 1  # one more is the trash block
        need = -(-min(MIN_KV_TOKENS, self.config.context_length) // self.block_size)
        if blocks < need:
            raise ModelFileError(self.gguf.path, f"too little GPU memory left for the KV cache: {max(budget, 0) >> 20} "
                                                 f"MiB after the weights and buffers ({free >> 20} MiB free of "
                                                 f"{total >> 20} MiB), {need * per_block >> 20} MiB needed for one "
                                                 f"{need * self.block_size}-token sequence")
        return int(blocks)

    def _check_unified(self, n_blocks: int, host_tier: int) -> None:
        if not self.dev.caps.integrated:
            return
        free, total = self.dev.memory_info()
        kv = (n_blocks + 1) * self.kv_bytes_per_block(self.config, self.block_size, self._kv_name)
        problem = check_unified_budget(kv, host_tier, free, total)
        if problem:
            raise ModelFileError(self.gguf.path, problem)

    def _alloc_step_buffers(self, HostBuffer, Event, Stream) -> None:
        cfg, R = self.config, self.max_rows
        blocks = -(-max(cfg.context_length, 1) // self.block_size)
        table_len = 1 << (blocks - 1).bit_length()  # decode steps bucket their table width to a power of 2
        self.layout = StepLayout(R, self.max_seqs, (self.max_seqs + 1) * table_len)
        # two of each: a step is packed, its inputs sent and it is launched while the one before still runs
        self._h_in = [HostBuffer(self.layout.nbytes) for _ in range(2)]
        self._d_in = [self.dev.empty((self.layout.nbytes,), np.uint8) for _ in range(2)]
        self.inputs = [StepInputs.of(d, self.layout) for d in self._d_in]
        # every buffer the step's kernels write (each slot's draws first), in the order they were always made
        self.act = act = Activations.alloc(self.dev, cfg, R, self.layers, cfg.recipe.post_norms)
        self.mm = Matmuls(self.dev, self.stream, cfg, self.output, int8_activations=self.int8_activations,
                          tensor_cores=self.tensor_cores, half_kind=self.half_kind, g=act.g, u=act.u, gu=act.gu)
        self.up_stream, self.down_stream = Stream(), Stream()
        self._uploaded = [Event(), Event()]  # a slot's inputs are on the device
        self._ran = [Event(), Event()]  # a slot's step (and its logits copy) is done on the compute stream
        self._h_tokens = [HostBuffer(4 * R) for _ in range(2)]
        self._h_logits: list[HostBuffer | None] = [None, None]
        self._done = [Event(), Event()]  # recorded after each slot's step and its tokens' copy back
        self._inflight: list[PendingStep | None] = [None, None]
        self._slot = 0
        self._last: PendingStep | None = None  # the step submitted last: the one a run-ahead step feeds on
        if self.tensor_cores:  # the prefill matmul's 16-bit scratch, at its largest, once
            biggest = max(m.rows * m.cols for lw in self.layers for m in lw.matrices())
            widest = max(m.cols for lw in self.layers for m in lw.matrices())
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

    @poison_guard
    def inject_illegal_address(self) -> None:
        """--fault cuda-illegal-address: a kernel really writes out of bounds (sticky error 700)."""
        self.dev.make_current()
        ops.fault_illegal_address(self.dev)

    def inject_fault(self, kind: str) -> None:
        self.inject_illegal_address()

    def forward(self, chunks: list[SeqChunk]) -> list:
        return self.submit(chunks).result()

    @poison_guard
    def submit(self, chunks: list[SeqChunk], feed: list[int | None] | None = None) -> PendingStep:
        """Launch one step and return at once; its result() waits for the device. feed[i] = j: chunk i's
        one token is the draw of chunk j of the step submitted just before (still running, perhaps),
        copied on the device; its `tokens` value is ignored. At most two steps are in flight: a third
        submit first collects the oldest."""
        dev, bs = self.dev, self.block_size
        dev.make_current()
        n = sum(len(c.tokens) for c in chunks)
        if n > self.max_rows or len(chunks) > self.max_rows:
            raise ValueError(f"a step of {n} tokens exceeds this backend's {self.max_rows} rows")
        sources = feed_sources(chunks, feed, self._last) if feed is not None else None
        decode = all(len(c.tokens) == 1 and c.logits == "last" for c in chunks)
        graphed = decode and len(chunks) <= min(self.max_seqs, GRAPH_BATCHES[-1])
        graph_rows = _bucket(len(chunks), GRAPH_BATCHES) if graphed else 0
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
            attempt(older.result)

        # the step's inputs, packed into pinned memory and sent in one copy
        lay, hb = self.layout, self._h_in[slot].array
        spans, pos, tables = self._pack_inputs(hb, chunks, sources, n, rows, stride, graph_rows)
        want, sampled, n_out = self._pack_outputs(hb, chunks, spans, rows, graph_rows)
        n_tiles = 0
        if not graph_rows and self._flash and n > len(chunks):  # prefill rows: flash attention
            tiles = ops.flash_tiles(spans)
            if len(tiles) <= lay.tile_cap:
                n_tiles = len(tiles)
                host_view(hb, lay.tiles, 2 * n_tiles, np.int32)[:] = tiles.reshape(-1)
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
                self._run_step(slot, rows, stride, max_keys, n_out, chunks, spans, pos, feed=True)
        else:
            # feed: the previous step's draws, still on the device, become tokens
            self._run_step(slot, n, stride, max_keys, n_out, chunks, spans, pos, sample=bool(sampled),
                           n_tiles=n_tiles, feed=sources is not None)
        pending = PendingStep(slot, chunks, want, sampled, n_out)
        self._copy_back(pending)
        self._inflight[slot] = self._last = pending
        self._slot ^= 1  # only after a launch: a fed step's source is always the other slot's last step
        return pending

    def _pack_inputs(self, hb: np.ndarray, chunks: list[SeqChunk], sources: np.ndarray | None, n: int, rows: int,
                     stride: int, graph_rows: int) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """The step's token ids (and the rows fed from the step before), positions, KV slots, sequences and
        block tables into the slot's pinned input buffer `hb`: (each chunk's rows, the positions, the tables)."""
        lay, cfg, bs = self.layout, self.config, self.block_size
        tok = host_view(hb, lay.tok, rows, np.int32)
        pos = host_view(hb, lay.pos, rows, np.int32)
        slots = host_view(hb, lay.slots, rows, np.int32)
        seq = host_view(hb, lay.seq, rows, np.int32)
        tables = host_view(hb, lay.tables, (len(chunks) + (1 if graph_rows else 0)) * stride, np.int32)
        tok[:n] = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        if sources is not None:
            tok[:n][sources >= 0] = 0
        if graph_rows:  # a captured step feeds its own tokens (its first kernel): -1 keeps the host's
            fed = host_view(hb, lay.feed, rows, np.int32)
            fed[:] = -1
            if sources is not None:
                fed[:n] = sources
        elif sources is not None:
            host_view(hb, lay.feed, n, np.int32)[:] = sources
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
        return spans, pos, tables

    def _pack_outputs(self, hb: np.ndarray, chunks: list[SeqChunk], spans: list[tuple[int, int]], rows: int,
                      graph_rows: int) -> tuple[list[tuple[int, int, int]], list[int], int]:
        """Which rows need logits, and which of those are drawn on the device (with their sampling
        parameters), into `hb`: (want: (chunk, first row, row count) each, the chunks drawn, the logits rows)."""
        lay = self.layout
        want: list[tuple[int, int, int]] = []  # (chunk, first row, row count)
        for si, (c, (a, b)) in enumerate(zip(chunks, spans, strict=True)):
            if c.logits == "last":
                want.append((si, b - 1, 1))
            elif c.logits == "all":
                want.append((si, a, b - a))
        out_rows = host_view(hb, lay.out_rows, rows, np.int32)
        n_out = 0
        for _, r0, cnt in want:
            out_rows[n_out : n_out + cnt] = np.arange(r0, r0 + cnt)
            n_out += cnt
        sampled = [si for si, _, cnt in want if cnt == 1 and chunks[si].sample is not None]
        if graph_rows:
            out_rows[:rows] = np.arange(rows)
            n_out = rows
        self._pack_sampling(hb, chunks, want, n_out)
        return want, sampled, n_out

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

    def _copy_back(self, p: PendingStep) -> None:
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
                self.act.logits.view(r * V, cnt * V).download_into(buf, cnt * V * 4, st, host_offset=at)
                at += cnt * V * 4
        self._ran[p.slot].record(st)
        self.down_stream.wait(self._ran[p.slot])
        if p.sampled:
            self.act.tokens_out[p.slot].view(0, p.n_out).download_into(self._h_tokens[p.slot], 4 * p.n_out,
                                                                       self.down_stream)
        self._done[p.slot].record(self.down_stream)
        p.landing = Landing(self.dev, self._done[p.slot], self._h_tokens[p.slot], self._h_logits[p.slot], V)

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
            self._run_step(slot, rows, stride, max_keys, n_out, None, None, None, partials=bufs, feed=True)
        return g, bufs

    def _run_step(self, slot, n, stride, max_keys, n_out, chunks, spans, positions, *, partials=None, sample=True,
                  tc=True, n_tiles=0, feed=False) -> None:
        """The forward pass over the inputs of `slot`, drawing into its draws; fed: the other slot's draws
        (the step before) are tokens of this one (forward.py)."""
        out = self.act.tokens_out
        self.fwd.run(self.inputs[slot], out[slot], out[slot ^ 1] if feed else None, n, stride, max_keys, n_out,
                     chunks, spans, positions, partials=partials, sample=sample, tc=tc, n_tiles=n_tiles)
