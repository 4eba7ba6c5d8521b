"""DeepSeek V4 (recipe.Stack.HYPER) on the GPU: the device, the weights (hyper_weights.py), the pool and its
blocks; the step itself is hyper_step.py's.

The pool keeps, per position, what the numpy twin (backends/numpy/hyper.py) keeps: each layer's key row (the
single KV head, key and value at once) and, by the layer's compress ratio, its compressor's value and score
rows (and the indexer's) and its piece of the compressed rows, float32, in the twin's column layout
(HyperStack.layout). A block is one contiguous run of block_size rows, so a block file holds the twin's
block; the prefix cache, block files and restores work as for the other families (kv_layout names the
layout). A compressed row is made once, by the step that computes its block's last position.

A chunk that asks for a draw (`sample`) is sampled on the device from the step's logits; the others get
their logits on the host. Decode steps replay as captured graphs of their padded shape, other steps run
eagerly; steps of TC_MIN_ROWS rows or more multiply on the tensor cores (hyper_step.py), reading a 16-bit copy
of those matrices decoded once at start where memory allows (f16_weights, as CudaBackend keeps one). The engine runs
ahead (submit): decode step n + 1 is launched, its tokens fed on the device from step n's draws, while the
host reads step n's. With `mtp`, the model's next-token layer writes its rows with every step and drafts
between steps (hyper_mtp.py), and with `dspark` a DSpark block drafter (hyper_dspark.py); a drafter drafts
from the step's results, so with one the steps do not run ahead. Not yet (docs/models.md): dropping the
per-position rows a sequence no longer reads (the window's keys and the compressors' rows of closed blocks).
"""

from __future__ import annotations

import numpy as np

from ember.kernels.cuda_runtime import Device, DeviceArray
from ember.kernels.errors import StickyCudaError

from ...model.config import ModelConfig
from ...model.dspark_file import DSparkFile
from ...model.gguf_file import GGUFFile, ModelFileError
from ..base import Backend, ContextPoisoned, HostBuffers, Landed, SeqChunk
from ..numpy.hyper import HyperStack
from .hyper_dspark import DSparkLayer, DSparkWeights, upload_dspark_weights
from .hyper_mtp import MtpLayer, MtpWeights, upload_mtp_weights
from .hyper_step import HyperStep, tensor_core_matrices
from .hyper_weights import HyperWeights, upload_hyper_weights
from .layers import check_fits
from .memory import MIN_KV_TOKENS, MemoryPicture, auto_kv_bytes, keep_half_copy
from .step import poison_guard


class CudaHyperBackend(Backend):
    name = "cuda"
    kv_layout = "cuda-hyper-v2"
    block_dtype = np.dtype(np.float32)
    samples_on_device = True  # chunks with `sample` set come back as SampledToken (HyperStep.submit)
    runs_ahead = True  # submit() returns before the step ends and can feed a step from the last one's draws
    # CudaBackend's paths this step does not have yet, as `ember bench speed` reports them
    int8_activations = False
    f16_weights = False  # the tensor-core matrices decoded to 16 bits once, at start (_keep_half_weights)
    pdl = False  # the captured decode steps' kernels chained by PDL: the card's (set once the device is open)

    def __init__(self, config: ModelConfig, gguf_file: GGUFFile, *, n_blocks: int | None, block_size: int = 16,
                 device: Device | None = None, max_rows: int = 512, max_seqs: int = 64, gpu_mem: int | None = None,
                 tensor_cores: bool = True, graphs: bool = True, mtp: bool = False, mtp_gguf: GGUFFile | None = None,
                 dspark: DSparkFile | None = None, f16_weights: str = "auto"):
        """mtp: the model's next-token layer drafts (`--spec mtp`; from mtp_gguf, its own file, where given):
        the pool keeps its rows too and self.mtp drafts (hyper_mtp.py). dspark: a DSpark block drafter's file
        (`--spec dspark:PATH`): likewise its key rows, and self.dspark drafts (hyper_dspark.py). f16_weights
        (auto, on, off): keep the tensor-core matrices' 16-bit copy (_keep_half_weights)."""
        from ember.kernels.cuda_runtime import Stream

        assert config.hyper is not None
        if mtp and not config.hyper.nextn_layers:
            raise ValueError("the model has no next-token (MTP) layer")
        if mtp and dspark is not None:
            raise ValueError("one drafter at a time: the next-token layer or a DSpark drafter")
        if f16_weights not in ("auto", "on", "off"):
            raise ValueError("f16_weights must be auto, on or off")
        self.config, self.gguf, self.h = config, gguf_file, config.hyper
        self.block_size = block_size
        self.max_rows = max(8, max_rows, max_seqs)
        drafter_width = dspark.key_width if dspark is not None else 0
        self.columns = HyperStack.layout(config, block_size, mtp, drafter_width)
        self.width = HyperStack.width(config, block_size, mtp, drafter_width)
        if mtp or dspark is not None:  # its blocks are never read as blocks without the drafter's rows
            self.kv_layout = "cuda-hyper-mtp-v2" if mtp else "cuda-hyper-dspark-v2"
        try:
            self.dev = device if device is not None else Device()
            if gpu_mem is not None:
                self.dev.memory_cap = gpu_mem
            self.dev.make_current()
            self.pdl = bool(self.dev.caps.pdl)  # (HyperStep._capture asks the same)
            check_fits(gguf_file, self.dev.memory_info())
            self.stream = Stream()
            free0 = self.dev.memory_info()[0]
            self.w: HyperWeights = upload_hyper_weights(self.dev, gguf_file, config)
            mtp_w = upload_mtp_weights(self.dev, gguf_file, mtp_gguf, config, self.w) if mtp else None
            dspark_w = upload_dspark_weights(self.dev, dspark, self.w) if dspark is not None else None
            weights = free0 - self.dev.memory_info()[0]
            if n_blocks is not None:  # a pool of the size asked for first; else it takes what is left, last
                self._alloc_pool(n_blocks)
            half = self._keep_half_weights(f16_weights, tensor_cores, mtp_w, dspark_w, kv_sized=n_blocks is not None)
            self.f16_weights = half > 0
            if n_blocks is None:
                self._alloc_pool(self._auto_blocks())
            self.step = HyperStep(self.dev, self.stream, config, self.w, self.pool, n_blocks=self.n_blocks,
                                  block_size=block_size, max_rows=self.max_rows, tensor_cores=tensor_cores,
                                  graphs=graphs, mtp=mtp_w, dspark=dspark_w)
            self.mtp = _Drafts(self, self.step.mtp) if self.step.mtp is not None else None
            self.dspark = _Drafts(self, self.step.dspark) if self.step.dspark is not None else None
            self.tensor_cores = self.step.tensor_cores
            self.runs_ahead = self.mtp is None and self.dspark is None
            total = self.dev.memory_info()[1]
            self.memory = MemoryPicture(total, weights, half, self.pool.nbytes, self.dev.caps.integrated, 0)
        except StickyCudaError as e:
            raise ContextPoisoned(e.code, e.name, e.message) from e

    @property
    def graph_replays(self) -> int:
        return self.step.graph_replays

    @property
    def _graphs(self) -> dict:
        """The captured decode steps as `ember bench speed` reads CudaBackend's: (rows, context in blocks, slot)
        -> (graph, its buffers)."""
        return {(r, c // self.block_size, 0): (g, None) for (r, c), g in self.step._graphs.items()}

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, mtp: bool = False, drafter_width: int = 0) -> int:
        return block_size * HyperStack.width(config, block_size, mtp, drafter_width) * 4

    def _alloc_pool(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        rows = (n_blocks + 1) * self.block_size  # one block past the pool, as the other backends keep
        self.pool = self.dev.empty((rows * self.width,))
        self.pool.zero()

    def _keep_half_weights(self, mode: str, tensor_cores: bool, mtp: MtpWeights | None, dspark: DSparkWeights | None,
                           *, kv_sized: bool) -> int:
        """Decode the tensor-core matrices (the dense projections: attention, compressors, indexer, shared
        expert; never the routed experts, which take their own kernels) to 16 bits once, so that prefill and
        batched decode skip a decode of each per step (ops.linear_tc); where memory.keep_half_copy says, as
        CudaBackend decides it. The bytes kept (0: none)."""
        if not tensor_cores:
            return 0
        mats = [m for m, _ in tensor_core_matrices(self.w, mtp, dspark, hc=self.h.hc_mult)]
        need = sum(2 * m.rows * m.cols for m in mats)
        free, total = self.dev.memory_info()
        if not keep_half_copy(mode, need, free, total, integrated=self.dev.caps.integrated, kv_sized=kv_sized):
            return 0
        kind = self.config.recipe.half_type
        for m in mats:
            m.keep_half(self.dev, kind, stream=self.stream)
        self.stream.synchronize()
        return need

    def _auto_blocks(self) -> int:
        free, total = self.dev.memory_info()
        per_block = self.block_size * self.width * 4
        # the step's buffers come after the pool: leave them a share of what is free
        budget = auto_kv_bytes(free, total, integrated=self.dev.caps.integrated, host_tier=0) * 3 // 4
        blocks = budget // per_block - 1
        need = -(-min(MIN_KV_TOKENS, self.config.context_length) // self.block_size)
        if blocks < need:
            raise ModelFileError(self.gguf.path, f"too little GPU memory left for the KV cache: {max(budget, 0) >> 20} "
                                                 f"MiB after the weights, {need * per_block >> 20} MiB needed for one "
                                                 f"{need * self.block_size}-token sequence")
        return int(blocks)

    def device_memory(self) -> tuple[int, int]:
        free, total = self.dev.memory_info()
        return total - free, total

    @poison_guard
    def forward(self, chunks: list[SeqChunk]) -> list:
        return self.submit(chunks).result()

    @poison_guard
    def submit(self, chunks: list[SeqChunk], feed: list[int | None] | None = None):
        """Launch one step and return at once (HyperStep.submit); feed[i] = j: chunk i's one token is the
        draw of chunk j of the step submitted just before, taken on the device."""
        self.dev.make_current()
        sources = self.step.feed_sources(chunks, feed) if feed is not None else None
        return self.step.submit(chunks, sources)

    # -- KV blocks: block_size contiguous rows of the pool, the twin's block ------------------------

    def _block(self, block: int) -> DeviceArray:
        if not 0 <= block < self.n_blocks:
            raise IndexError(f"block {block} outside the pool of {self.n_blocks}")
        n = self.block_size * self.width
        return self.pool.view(block * n, n)

    @poison_guard
    def read_block(self, block: int) -> np.ndarray:
        self.dev.make_current()
        self.stream.synchronize()  # the step that wrote it is done
        return self._block(block).to_host().reshape(self.block_size, self.width)

    @poison_guard
    def write_block(self, block: int, data: np.ndarray) -> None:
        self.dev.make_current()
        self.stream.synchronize()  # no step still reads the block being replaced
        self._block(block).upload(np.asarray(data, np.float32).reshape(-1))

    def save_blocks(self, blocks: list[int]) -> Landed:
        rows = [self.read_block(b) for b in blocks]
        return Landed(np.stack(rows) if rows else np.zeros((0, self.block_size, self.width), np.float32))

    def load_blocks(self, blocks: list[int], payloads) -> None:
        for b, p in zip(blocks, payloads, strict=True):
            self.write_block(b, p)

    def restore_buffers(self) -> HostBuffers:
        return HostBuffers((self.block_size, self.width), self.block_dtype)


class _Drafts:
    """A drafter layer as the engine's drafters take it (MtpDrafter's DraftHead): drafts between steps, on the
    backend's device, a sticky CUDA error reported as every backend call reports one."""

    def __init__(self, backend: CudaHyperBackend, layer: MtpLayer | DSparkLayer):
        self._backend, self._layer = backend, layer
        self.block_size = layer.block_size

    @poison_guard
    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]:
        self._backend.dev.make_current()
        return self._layer.draft(block_table, token, at, k)

    @poison_guard
    def chain(self, block_table: list[int], token: int, at: int, k: int) -> tuple[list[int], np.ndarray]:
        self._backend.dev.make_current()
        return self._layer.chain(block_table, token, at, k)
