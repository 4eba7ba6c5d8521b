"""Launchers of kv_copy.cu: whole KV blocks between the paged pools and a packed staging area, one launch
a batch (the KV store's path in and out of the device). Twins: reference.kv_gather, reference.kv_scatter."""

from __future__ import annotations

import numpy as np

from ..cuda_runtime import I64, Device, DeviceArray
from .args import need


def _kv_block_words(pool: DeviceArray, block_elems: int) -> int:
    nbytes = block_elems * np.dtype(pool.dtype).itemsize
    if nbytes % 16:
        raise ValueError(f"a block's row of {nbytes} bytes is not a whole number of 16-byte words")
    return nbytes // 16


def kv_gather(dev: Device, k_pool: DeviceArray, v_pool: DeviceArray, blocks: DeviceArray, staging: DeviceArray, *,
              n: int, layers: int, layer_elems: int, block_elems: int, stream=None) -> None:
    """staging[j] = (K, V) of pool block blocks[j], every layer: [n, 2, layers, block_elems] in the
    pools' dtype. Twin: reference.kv_gather."""
    words = _kv_block_words(k_pool, block_elems)
    need(blocks, np.int32, n, "blocks")
    if staging.nbytes < n * 2 * layers * words * 16:
        raise ValueError("the staging area is smaller than the blocks")
    dev.kernel("kv_copy", "kv_gather").launch((n * 2 * layers,), (min(256, -(-words // 32) * 32),), k_pool, v_pool,
                                              blocks, layers, I64(layer_elems * k_pool.dtype.itemsize // 16),
                                              words, staging, stream=stream)


def kv_scatter(dev: Device, k_pool: DeviceArray, v_pool: DeviceArray, blocks: DeviceArray, staging: DeviceArray, *,
               n: int, layers: int, layer_elems: int, block_elems: int, stream=None) -> None:
    """The reverse of kv_gather: pool block blocks[j] = staging[j]. Twin: reference.kv_scatter."""
    words = _kv_block_words(k_pool, block_elems)
    need(blocks, np.int32, n, "blocks")
    if staging.nbytes < n * 2 * layers * words * 16:
        raise ValueError("the staging area is smaller than the blocks")
    dev.kernel("kv_copy", "kv_scatter").launch((n * 2 * layers,), (min(256, -(-words // 32) * 32),), k_pool,
                                               v_pool, blocks, layers, I64(layer_elems * k_pool.dtype.itemsize // 16),
                                               words, staging, stream=stream)
