"""KV blocks off and onto the GPU without holding up the compute stream: the CUDA backend's half of
KV persistence and restores.

save(blocks) gathers the blocks into a slab's device staging area with one launch and copies that
into the slab's pinned host half with one copy, on copy streams of their own that wait (an event,
never the host) for the compute work queued so far. The compute stream waits for the gathers alone
before its next step, so a block that is reused later is never overwritten before it was read; the
gathers take microseconds, and the copies to the host (milliseconds for tens of MB) overlap the
next steps on a second copy stream (each slab has its own staging area, reused only after release).
The BlockCopy that save() returns is waited for on the KV writer's thread, which writes the
payloads from the slab and frees it. When every slab is taken, save() returns None and the caller
drops those blocks from persistence rather than wait: the device's prefix cache still holds them,
and a worker that persists less is better than one that stalls. The slabs (host and device halves,
SLABS x SLAB_BYTES each) are made on the first save.

load(blocks, payloads) is the reverse, from the restore arena (RestoreSlots): the KV store's reader
thread reads each restored block file straight into a pinned slot of it, and load, on the engine
thread, only queues the copies of those slots into the device staging area (one a run of adjacent
slots) and one scatter into the pools, on the same copy stream; the compute stream waits for it
before its next step. No payload is copied on the host. A slot comes free once the copy that read it
has landed, which the reader waits for when every slot is taken (the arena, RESTORE_BYTES, is the
bound on restored KV on the host); the engine thread waits only to reuse the block ids of the load
before the last.

The payload layout is the KV store's: [n, 2 (K, V), layers, block_size, kv_heads, head_dim] in the
KV dtype (float16 by default, half the bytes of the numpy backend's float32).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ember.kernels import ops
from ember.kernels.cuda_runtime import Event, HostBuffer, Stream
from ember.kernels.errors import StickyCudaError

SLAB_BYTES = 32 << 20  # one slab moves at most this much (more blocks: several slabs)
SLABS = 8  # pinned slabs for saves: the bound on KV in flight between the device and the KV writer
LOAD_IDS = 2  # pinned block-id lists for loads, used in turn (a load waits only for the load before the last)
RESTORE_BYTES = 2 * SLAB_BYTES  # the pinned arena restored blocks are read into
RESTORE_MIN_SLOTS = 4  # however large a block


class _Slab:
    def __init__(self, nbytes: int, ids: int, dev):
        self.host = HostBuffer(nbytes)
        self.ids = HostBuffer(ids * 4)
        self.staging = dev.empty((nbytes,), np.uint8)  # the device half
        self.done = Event()


class _LoadIds:
    """A load group's block ids in pinned memory, reused once the copy that read them has landed."""

    def __init__(self, ids: int):
        self.host = HostBuffer(ids * 4)
        self.done = Event()


class RestoreSlots:
    """The pinned arena the KV store's reader thread reads restored blocks into, a block a slot (the
    CUDA backend's base.RestoreBuffers). A slot is taken by the reader, handed to the engine in the
    restore's results, copied to the device by KVTransfer.load straight from here, and free again once
    that copy has landed (or at once when given back unloaded). When every slot is taken, take()
    waits for the oldest copy in flight, else for up to its timeout."""

    def __init__(self, dev, block_shape: tuple[int, ...], dtype, nbytes: int = RESTORE_BYTES):
        self.dev = dev
        self.block_shape, self.dtype = tuple(block_shape), np.dtype(dtype)
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.slots = max(RESTORE_MIN_SLOTS, nbytes // self.block_bytes)
        dev.make_current()
        self.host = HostBuffer(self.slots * self.block_bytes)
        self._free = collections.deque(range(self.slots))
        self._flight: collections.deque[tuple[Event, list[int]]] = collections.deque()  # oldest first
        self._events: list[Event] = []  # recorded once, ready for another load
        self._cond = threading.Condition()

    def take(self, timeout: float) -> np.ndarray | None:
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if self._free:
                    return self._view(self._free.popleft())
                landing = self._flight.popleft() if self._flight else None
                if landing is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
                    continue
            event, slots = landing
            try:
                self.dev.make_current()
                event.synchronize()  # the copy from these slots has landed (the host waits, on the reader's thread)
            except StickyCudaError:
                return None  # the device failed: the engine reports a poisoned context on its own
            with self._cond:
                self._free.extend(slots)
                self._events.append(event)

    def give_back(self, payload: np.ndarray) -> None:
        slot = self.slot_of(payload)
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def slot_of(self, payload: np.ndarray) -> int:
        """The slot a payload of take() is; ValueError for any other array."""
        offset = payload.__array_interface__["data"][0] - self.host.ptr
        if (payload.shape != self.block_shape or payload.dtype != self.dtype or not payload.flags.c_contiguous
                or not 0 <= offset < self.slots * self.block_bytes or offset % self.block_bytes):
            raise ValueError("a payload outside the restore slots (restore_buffers().take() gives them)")
        return offset // self.block_bytes

    def loaded(self, slots: list[int], stream: Stream) -> None:
        """(engine thread) Copies from `slots` are queued on `stream`: free once they land."""
        with self._cond:
            event = self._events.pop() if self._events else None
        if event is None:
            event = Event()
        event.record(stream)
        with self._cond:
            self._flight.append((event, slots))
            self._cond.notify()

    def _view(self, slot: int) -> np.ndarray:
        start = slot * self.block_bytes
        return self.host.array[start : start + self.block_bytes].view(self.dtype).reshape(self.block_shape)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first position, first slot, count) of each run of adjacent slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for j, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, slot, 1))
    return runs


class BlockCopy:
    """Blocks on their way to the host. wait() (any thread) returns one view a block into the
    pinned slabs, valid until release(), or None when the device failed meanwhile (the engine
    reports a poisoned context on its own). Nothing is copied again on the host: the KV writer
    writes the files straight from the slabs (a copy of tens of MB would hold the GIL, and so the
    engine thread, for milliseconds)."""

    owned = False  # the payloads are views: the store keeps no reference past release()

    def __init__(self, transfer: KVTransfer, parts: list[tuple[_Slab, int]]):
        self._transfer, self._parts = transfer, parts
        self._views: list[np.ndarray] | None = None
        self._waited = False
        self._lock = threading.Lock()

    def wait(self) -> list[np.ndarray] | None:
        with self._lock:
            if not self._waited:
                self._waited = True
                t, views = self._transfer, []
                try:
                    t.dev.make_current()
                    for slab, n in self._parts:
                        slab.done.synchronize()
                        views.extend(slab.host.array[: n * t.block_bytes].view(t.dtype).reshape(n, *t.block_shape))
                    self._views = views
                except StickyCudaError:
                    self.release()
            return self._views

    def release(self) -> None:
        """Give the slabs back (the payloads from wait() are gone after this)."""
        with self._lock:
            self._views = None
            for slab, _ in self._parts:
                self._transfer.release(slab)
            self._parts = []


class KVTransfer:
    def __init__(self, dev, k_pool, v_pool, compute: Stream, *, layers: int, layer_elems: int, block_elems: int,
                 block_shape: tuple[int, ...], dtype, restore: RestoreSlots, slab_bytes: int = SLAB_BYTES,
                 slabs: int = SLABS):
        self.dev, self.k_pool, self.v_pool, self.compute = dev, k_pool, v_pool, compute
        self.layers, self.layer_elems, self.block_elems = layers, layer_elems, block_elems
        self.dtype = np.dtype(dtype)
        self.block_shape = tuple(block_shape)  # one block's payload: [2, layers, block_size, kv_heads, head_dim]
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.per_slab = max(1, slab_bytes // self.block_bytes)
        self.stream = Stream()  # gathers, scatters and loads' copies
        self._down = Stream()  # saves' copies to the host: a gather never queues behind one
        self._staging = dev.empty((self.per_slab * self.block_bytes,), np.uint8)  # loads'
        self._ids = dev.empty((self.per_slab,), np.int32)  # one group's block ids (the stream orders the reuse)
        self._queued = Event()  # the compute work so far (recorded before each save or load)
        self._moved = Event()  # the copy stream's last gather or scatter
        self._lock = threading.Lock()
        self._free = [_Slab(self.per_slab * self.block_bytes, self.per_slab, dev) for _ in range(slabs)]
        self.restore = restore  # where load's payloads are (the reader reads them there)
        self._loads = [_LoadIds(self.per_slab) for _ in range(LOAD_IDS)]
        self._next_load = 0

    # -- slabs ----------------------------------------------------------------------------------------------

    def _take(self) -> _Slab | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slab: _Slab) -> None:
        with self._lock:
            self._free.append(slab)

    @property
    def free_slabs(self) -> int:
        return len(self._free)

    # -- the two directions ----------------------------------------------------------------------------------

    def save(self, blocks: list[int]) -> BlockCopy | None:
        """Start copying `blocks` to the host (engine thread); None when no slab is free for them."""
        groups = [blocks[i:i + self.per_slab] for i in range(0, len(blocks), self.per_slab)]
        slabs: list[_Slab] = []
        for _ in groups:
            slab = self._take()
            if slab is None:
                for s in slabs:
                    self.release(s)
                return None
            slabs.append(slab)
        self._queued.record(self.compute)
        self.stream.wait(self._queued)
        parts = []
        for group, slab in zip(groups, slabs, strict=True):
            n = len(group)
            slab.ids.array[: 4 * n] = np.asarray(group, dtype=np.int32).view(np.uint8)
            self._ids.upload_from(slab.ids, 4 * n, self.stream)
            ops.kv_gather(self.dev, self.k_pool, self.v_pool, self._ids, slab.staging, n=n, layers=self.layers,
                          layer_elems=self.layer_elems, block_elems=self.block_elems, stream=self.stream)
            parts.append((slab, n))
        self._moved.record(self.stream)
        self.compute.wait(self._moved)  # the blocks are read before a later step may write them
        self._down.wait(self._moved)
        for slab, n in parts:  # overlapping the next steps
            slab.staging.download_into(slab.host, n * self.block_bytes, self._down)
            slab.done.record(self._down)
        return BlockCopy(self, parts)

    def load(self, blocks: list[int], payloads) -> None:
        """Fill `blocks` from `payloads`, buffers of the restore arena (one [*block_shape] slot a
        block), before the compute stream's next step (engine thread). Nothing is copied on the host:
        the slots are copied to the device where the reader read them, and come free once those
        copies land."""
        if len(payloads) != len(blocks):
            raise ValueError(f"{len(payloads)} payloads for {len(blocks)} blocks")
        slots = [self.restore.slot_of(p) for p in payloads]  # before anything is queued
        self._queued.record(self.compute)  # no step still reads the blocks being replaced
        self.stream.wait(self._queued)
        bb = self.block_bytes
        for i in range(0, len(blocks), self.per_slab):
            group, held = blocks[i:i + self.per_slab], slots[i:i + self.per_slab]
            n = len(group)
            ids = self._loads[self._next_load]
            self._next_load = (self._next_load + 1) % len(self._loads)
            ids.done.synchronize()  # the copy that last read it has landed
            ids.host.array[: 4 * n] = np.asarray(group, dtype=np.int32).view(np.uint8)
            self._ids.upload_from(ids.host, 4 * n, self.stream)
            for j, slot, k in _runs(held):  # the slots into the staging area, in the group's order
                self._staging.view_bytes(j * bb, k * bb, np.uint8).upload_from(self.restore.host, k * bb, self.stream,
                                                                             host_offset=slot * bb)
            self.restore.loaded(held, self.stream)
            ops.kv_scatter(self.dev, self.k_pool, self.v_pool, self._ids, self._staging, n=n, layers=self.layers,
                           layer_elems=self.layer_elems, block_elems=self.block_elems, stream=self.stream)
            ids.done.record(self.stream)
        self._moved.record(self.stream)
        self.compute.wait(self._moved)

    def close(self) -> None:
        try:
            self.stream.synchronize()
            self._down.synchronize()
        finally:
            self.stream.destroy()
            self._down.destroy()
