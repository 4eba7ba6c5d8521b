"""The CUDA backend's KV blocks to and from the host: one block at a time in the numpy layout
(read_block / write_block, for the prefix cache's tests and tools) and many at once on a copy stream
(save_blocks / load_blocks through kv.KVTransfer, for KV persistence and restores; load_blocks takes
its payloads in the pinned arena of restore_buffers(), where the KV store's reader read them). A
mixin of CudaBackend: it reads the pools and the stream the backend allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .step import poison_guard

if TYPE_CHECKING:
    from ember.kernels.cuda_runtime import Device, DeviceArray, Stream

    from ...model.config import ModelConfig
    from .kv import KVTransfer, RestoreSlots


class CudaKVBlocks:
    """Block transfer between the device's KV pools and the host (mixed into CudaBackend)."""

    # what the mixin reads of the backend
    dev: Device
    stream: Stream
    config: ModelConfig
    n_blocks: int
    block_size: int
    kv_dtype: type[np.floating]
    k_pool: DeviceArray
    v_pool: DeviceArray
    _layer_elems: int  # a layer's share of each pool (elements)
    _transfer: KVTransfer | None  # made on the first save or load (pinned slabs)
    _restore: RestoreSlots | None = None  # the restore arena, made when the KV store asks for it

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

    @poison_guard
    def read_block(self, block: int) -> np.ndarray:
        self.dev.make_current()
        self.stream.synchronize()  # the step that wrote it is done
        cfg = self.config
        raw = np.empty((2, cfg.n_layers, self.block_size * cfg.kv_dim), dtype=self.kv_dtype)
        self._block_copy(block, raw, to_host=True)
        return raw.astype(np.float32, copy=False).reshape(2, cfg.n_layers, self.block_size, cfg.n_kv_heads,
                                                          cfg.head_dim)

    @property
    def _block_shape(self) -> tuple[int, ...]:
        cfg = self.config
        return (2, cfg.n_layers, self.block_size, cfg.n_kv_heads, cfg.head_dim)

    def restore_buffers(self) -> RestoreSlots:
        """The pinned arena restored blocks are read into (kv.RestoreSlots): one, whoever asks."""
        if self._restore is None:
            from .kv import RestoreSlots

            self._restore = RestoreSlots(self.dev, self._block_shape, self.kv_dtype)
        return self._restore

    def _kv_transfer(self) -> KVTransfer:
        if self._transfer is None:
            from .kv import KVTransfer

            cfg = self.config
            self._transfer = KVTransfer(self.dev, self.k_pool, self.v_pool, self.stream, layers=cfg.n_layers,
                                        layer_elems=self._layer_elems, block_elems=self.block_size * cfg.kv_dim,
                                        block_shape=self._block_shape, dtype=self.kv_dtype,
                                        restore=self.restore_buffers())
        return self._transfer

    @poison_guard
    def save_blocks(self, blocks: list[int]):
        """KV blocks off the device on a copy stream of their own (kv.py): no host wait, and the
        compute stream waits only for the gather before its next step."""
        if any(not 0 <= b < self.n_blocks for b in blocks):
            raise IndexError(f"a block outside the pool of {self.n_blocks}")
        self.dev.make_current()
        return self._kv_transfer().save(list(blocks))

    @poison_guard
    def load_blocks(self, blocks: list[int], payloads) -> None:
        """Restored blocks into the pools from the restore arena's slots (restore_buffers()): their
        copies and one scatter queued on the copy stream, no host copy and no host wait."""
        if any(not 0 <= b < self.n_blocks for b in blocks):
            raise IndexError(f"a block outside the pool of {self.n_blocks}")
        self.dev.make_current()
        self._kv_transfer().load(list(blocks), payloads)

    @poison_guard
    def write_block(self, block: int, data: np.ndarray) -> None:
        self.dev.make_current()
        self.stream.synchronize()  # no step still reads the block being replaced
        cfg = self.config
        raw = np.ascontiguousarray(np.asarray(data).reshape(2, cfg.n_layers, -1).astype(self.kv_dtype))
        self._block_copy(block, raw, to_host=False)
        # a copy from pageable memory may return before its DMA lands, and the backend's stream does
        # not wait for the legacy stream it runs on: the next step must see the block
        self.dev.synchronize()
