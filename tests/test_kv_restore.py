"""Restored KV blocks reach the pool with no payload copied on the engine thread (issue 37 item 4).

The KV store's reader thread reads each block file straight into the backend's restore buffers
(Backend.restore_buffers), and the engine thread hands those very buffers to load_blocks, which only
queues their copy to the device. Held here:

- on the CPU, the numpy backend through a real engine and store: every payload load_blocks takes,
  on the engine thread, is a buffer the reader thread read its file into (the numpy backend's copy
  to its "device" is the pool write itself);
- on the CPU, the CUDA backend's host side (kv.RestoreSlots, KVTransfer.load, CudaKVBlocks.load_blocks)
  with the real KV store and KV manager, over a host stand-in for the CUDA runtime (pinned buffers,
  streams whose work runs in order when something waits for it, events) and for ember.kernels.ops
  (kv_scatter as its numpy twin): the device gets each block's bytes from the arena slot the reader
  read its file into and from no other host memory, and the arena is read-only to the engine thread.
  A small arena (the reader waits for room), a damaged file (quarantined, never loaded, its slot free
  again) and a dropped restore (its slots back) among them. What the stand-in cannot hold: that the
  driver's copies and the kv_scatter kernel move the bytes, and pinned memory itself;
- on a GPU (marked gpu), the same restore through the real CUDA backend: the bytes in the pool, and
  the copies' sources and threads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ember.kernels import reference
from ember.worker.backends.cuda import kv
from ember.worker.backends.cuda.kv_blocks import CudaKVBlocks
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.kv_blocks import ROOT_HASH, BlockPool, chain_hash, kv_salt
from ember.worker.engine.kv_manager import KVManager, Prefix
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, Finished, GenerationRequest, RequestHandle, Started
from ember.worker.engine.restore_policy import RestoreCosts
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.sequence import KVState
from ember.worker.kvstore import blockfile
from ember.worker.kvstore.store import KVStore
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

BLOCK = 16
PROMPT = ("The lighthouse keeper wrote in his log every evening. The storm had lasted three days, "
          "and the supply boat was late. He counted the candles, checked the lamp, and wound the clock. ") * 2


def _store(root, salt, shape, dtype, **kw) -> KVStore:
    return KVStore(root, salt=salt, model_key="m", block_shape=shape, block_tokens=BLOCK, block_dtype=dtype,
                   chain_hash=chain_hash, persist=kw.pop("persist", "all"), disk_budget=1 << 30,
                   host_budget=64 << 20, **kw)


@pytest.fixture
def reads(monkeypatch):
    """Every block file read into memory: (thread name, address of the buffer it was read into). The
    reader thread's restores, and the scan thread's timed reads of the newest files (into a buffer
    of its own)."""
    seen: list[tuple[str, int]] = []
    real = blockfile.read_into

    def read_into(f, out, **kw):
        seen.append((threading.current_thread().name, out.ctypes.data))
        return real(f, out, **kw)

    monkeypatch.setattr(blockfile, "read_into", read_into)
    return seen


# -- the numpy backend, through a real engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=1024)


class _Loads(NumpyBackend):
    """The numpy backend, recording each load_blocks: (thread name, the payloads' addresses)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.loads: list[tuple[str, list[int]]] = []

    def load_blocks(self, blocks, payloads):
        self.loads.append((threading.current_thread().name, [p.ctypes.data for p in payloads]))
        super().load_blocks(blocks, payloads)


def _generate(runtime, store, backend):
    engine = Engine(runtime.model, backend, EngineLimits(max_seqs=2, context=1024), metrics=Metrics(), store=store)
    engine.start()
    try:
        req = GenerationRequest("r", runtime.model.tokenizer.encode(PROMPT), SamplingParams(temperature=0), 4)

        async def go():
            h = RequestHandle(req, asyncio.get_running_loop())
            engine.submit(h)
            return [e async for e in h.events()]

        events = asyncio.run(go())
    finally:
        engine.shutdown()
    assert isinstance(events[-1], Finished), events[-1]
    started = next(e for e in events if isinstance(e, Started))
    return started.cached_tokens, [t for e in events if isinstance(e, Delta) for t in e.tokens]


def test_numpy_restores_load_the_buffers_the_reader_read_into(runtime, tmp_path, reads):
    def backend():
        return _Loads(runtime.config, runtime.backend.weights, n_blocks=64, block_size=BLOCK)

    first = backend()
    salt = kv_salt(runtime.model.fingerprint, first.kv_layout)
    shape = first.read_block(0).shape
    cold = _store(tmp_path, salt, shape, np.float32)
    _, cold_tokens = _generate(runtime, cold, first)
    assert cold.flush()
    cold.close()
    warm_backend = backend()
    warm = _store(tmp_path, salt, shape, np.float32, buffers=warm_backend.restore_buffers())
    cached, warm_tokens = _generate(runtime, warm, warm_backend)
    warm.close()
    assert cached >= 3 * BLOCK and warm_tokens == cold_tokens
    read_into = {ptr for thread, ptr in reads if thread == "ember-kv-reader"}
    loaded = [ptr for _, ptrs in warm_backend.loads for ptr in ptrs]
    assert {thread for thread, _ in warm_backend.loads} == {"ember-engine"}
    assert len(loaded) == cached // BLOCK and set(loaded) <= read_into  # the reader's buffers, as they are


# -- the CUDA backend's host side, over a stand-in runtime -----------------------------------------------

_DEVICE = threading.RLock()  # the stand-in device runs one stream's work at a time


class _Stream:
    """Work queued in order, run when something waits for it (its synchronize, an event recorded on
    it, another stream's wait), as late as a real device may run it."""

    def __init__(self):
        self.ops: list = []
        self.ran = 0

    def enqueue(self, op) -> None:
        with _DEVICE:
            self.ops.append(op)

    def run_to(self, mark: int) -> None:
        with _DEVICE:
            while self.ran < mark:
                op = self.ops[self.ran]
                self.ran += 1
                op()

    def synchronize(self) -> None:
        with _DEVICE:
            self.run_to(len(self.ops))

    def wait(self, event) -> None:
        stream, mark = event.stream, event.mark
        if stream is not None:
            self.enqueue(lambda: stream.run_to(mark))

    def destroy(self) -> None:
        pass


class _Event:
    def __init__(self):
        self.stream, self.mark = None, 0

    def record(self, stream) -> None:
        with _DEVICE:
            self.stream, self.mark = stream, len(stream.ops)

    def synchronize(self) -> None:
        with _DEVICE:
            if self.stream is not None:
                self.stream.run_to(self.mark)


class _HostBuffer:
    """'Pinned' host memory: a numpy array."""

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), 8)
        self.array = np.zeros(self.nbytes, np.uint8)
        self.ptr = self.array.ctypes.data


class _ReadOnlyTo:
    """A host buffer that one thread cannot write: its view is read-only there."""

    def __init__(self, buf, thread: int):
        self._buf, self._thread = buf, thread
        self.ptr, self.nbytes = buf.ptr, buf.nbytes

    @property
    def array(self) -> np.ndarray:
        a = self._buf.array
        if threading.get_ident() == self._thread:
            a = a.view()
            a.flags.writeable = False
        return a


class _DevArray:
    """Device memory: a numpy array whose bytes the stand-in copies and kernels move on a stream."""

    def __init__(self, dev, data: np.ndarray):
        self.dev, self.data = dev, data
        self.dtype, self.shape, self.nbytes, self.ptr = data.dtype, data.shape, data.nbytes, data.ctypes.data

    @property
    def bytes(self) -> np.ndarray:
        return self.data.reshape(-1).view(np.uint8)

    def view_bytes(self, offset: int, count: int, dtype) -> _DevArray:
        return _DevArray(self.dev, self.bytes[offset : offset + count * np.dtype(dtype).itemsize].view(dtype))

    def upload_from(self, host, nbytes: int, stream, host_offset: int = 0) -> None:
        assert nbytes <= self.nbytes and host_offset + nbytes <= host.nbytes
        self.dev.uploads.append(SimpleNamespace(thread=threading.get_ident(), host=host, src=host.ptr + host_offset,
                                                nbytes=nbytes))

        def copy():
            self.bytes[:nbytes] = host.array[host_offset : host_offset + nbytes]

        stream.enqueue(copy)


class _Device:
    def __init__(self):
        self.uploads: list[SimpleNamespace] = []

    def make_current(self) -> None:
        pass

    def empty(self, shape, dtype) -> _DevArray:
        return _DevArray(self, np.zeros(shape, dtype))


class _Ops:
    """ember.kernels.ops's KV copies as their numpy twins, queued on the stream."""

    @staticmethod
    def kv_scatter(dev, k_pool, v_pool, blocks, staging, *, n, layers, layer_elems, block_elems, stream):
        def scatter():
            nbytes = n * 2 * layers * block_elems * k_pool.dtype.itemsize
            rows = staging.bytes[:nbytes].view(k_pool.dtype).reshape(n, 2, layers, block_elems)
            reference.kv_scatter(k_pool.data, v_pool.data, blocks.data[:n].copy(), rows, layers=layers,
                                 layer_elems=layer_elems, block_elems=block_elems)

        stream.enqueue(scatter)


class _HostCuda(CudaKVBlocks):
    """The CUDA backend's KV block transfers (the real mixin) over the stand-in device."""

    def __init__(self, dev, *, layers=2, kv_heads=2, head_dim=8, n_blocks=32):
        self.dev, self.stream = dev, _Stream()
        self.config = SimpleNamespace(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim,
                                      kv_dim=kv_heads * head_dim)
        self.n_blocks, self.block_size, self.kv_dtype = n_blocks, BLOCK, np.float16
        self._layer_elems = n_blocks * BLOCK * kv_heads * head_dim
        self.k_pool = dev.empty((layers * self._layer_elems,), np.float16)
        self.v_pool = dev.empty((layers * self._layer_elems,), np.float16)
        self._transfer = None

    def pool_block(self, block: int) -> np.ndarray:
        """What the pools hold for `block` once the copy stream's work has run."""
        assert self._transfer is not None
        self._transfer.stream.synchronize()
        cfg = self.config
        got = reference.kv_gather(self.k_pool.data, self.v_pool.data, [block], layers=cfg.n_layers,
                                  layer_elems=self._layer_elems, block_elems=BLOCK * cfg.kv_dim)
        return got[0].reshape(self._block_shape)


@pytest.fixture
def host_cuda(monkeypatch):
    monkeypatch.setattr(kv, "ops", _Ops)
    monkeypatch.setattr(kv, "Event", _Event)
    monkeypatch.setattr(kv, "Stream", _Stream)
    monkeypatch.setattr(kv, "HostBuffer", _HostBuffer)
    return _HostCuda(_Device())


def _chain(n: int, salt: bytes) -> tuple[list[bytes], list[list[int]]]:
    hashes, tokens, parent = [], [], ROOT_HASH
    for i in range(n):
        toks = list(range(i * BLOCK, (i + 1) * BLOCK))
        parent = chain_hash(parent, toks, salt)
        hashes.append(parent)
        tokens.append(toks)
    return hashes, tokens


def _written(root, salt, shape, n: int) -> tuple[list[bytes], np.ndarray]:
    """n blocks of a chain on disk (float16 payloads, as the cuda-f16 layout writes them)."""
    hashes, tokens = _chain(n, salt)
    payloads = np.random.default_rng(3).standard_normal((n, *shape)).astype(np.float16)
    writer = _store(root, salt, shape, np.float16)
    parent = ROOT_HASH
    for h, toks, p in zip(hashes, tokens, payloads, strict=True):
        writer.offer(h, parent, toks, p)
        parent = h
    assert writer.flush()
    writer.close()
    return hashes, payloads


def _restore(km: KVManager, hashes: list[bytes], seconds: float = 30.0) -> SimpleNamespace:
    """A sequence restoring `hashes` from disk, run as the engine runs it until its restore is over."""
    s = SimpleNamespace(kv=KVState(), req=SimpleNamespace(request_id="r"), number=1)
    km.start_restore(s, Prefix([], hashes, ["disk"] * len(hashes)))
    deadline = time.monotonic() + seconds
    while s.kv.restoring is not None:
        assert time.monotonic() < deadline, "the restore never ended"
        list(km.progress_restores([s]))
    return s


def _arena(cuda: _HostCuda, slots: int | None, engine: int) -> kv.RestoreSlots:
    """The backend's restore arena (of `slots` slots), read-only to the engine thread."""
    shape = cuda._block_shape
    nbytes = kv.RESTORE_BYTES if slots is None else slots * int(np.prod(shape)) * 2
    arena = cuda._restore = kv.RestoreSlots(cuda.dev, shape, np.float16, nbytes=nbytes)
    arena.host = _ReadOnlyTo(arena.host, engine)
    return arena


def _manager(cuda, store) -> KVManager:
    return KVManager(BlockPool(cuda.n_blocks, BLOCK), cuda, store, Metrics(), RestoreCosts())


def _check_copies(cuda: _HostCuda, arena: kv.RestoreSlots, reads, engine: int, blocks: int) -> None:
    """Every payload reached the device from the arena slot the reader read its file into, queued by
    the engine thread, once; nothing else of a payload's size went to the device."""
    bb = arena.block_bytes
    filled = {ptr for thread, ptr in reads if arena.host.ptr <= ptr < arena.host.ptr + arena.host.nbytes}
    assert {thread for thread, ptr in reads if ptr in filled} == {"ember-kv-reader"}
    from_arena = [u for u in cuda.dev.uploads if u.host is arena.host]
    assert from_arena and {u.thread for u in from_arena} == {engine}
    sources = [u.src + k * bb for u in from_arena for k in range(u.nbytes // bb)]
    assert all(u.nbytes % bb == 0 for u in from_arena) and len(sources) == blocks and set(sources) <= filled
    ids_bytes = 4 * cuda._kv_transfer().per_slab
    assert all(u.nbytes <= ids_bytes for u in cuda.dev.uploads if u.host is not arena.host)  # block ids only


def test_cuda_restores_copy_from_the_slots_the_reader_read_into(host_cuda, tmp_path, reads):
    cuda, engine = host_cuda, threading.get_ident()
    shape = cuda._block_shape
    salt = kv_salt("m", "cuda-f16")
    hashes, payloads = _written(tmp_path, salt, shape, 12)
    arena = _arena(cuda, None, engine)
    store = _store(tmp_path, salt, shape, np.float16, buffers=cuda.restore_buffers())
    s = _restore(_manager(cuda, store), hashes)
    store.close()
    assert len(s.kv.blocks) == 12 and store.stats.restore_hits == 12
    for block, want in zip(s.kv.blocks, payloads, strict=True):
        assert np.array_equal(cuda.pool_block(block), want)
    _check_copies(cuda, arena, reads, engine, 12)


def test_a_full_arena_holds_the_reader_until_the_engine_loads(host_cuda, tmp_path, reads):
    """Four slots for ten blocks: the reader waits for room and wakes the engine, which loads what was
    read; the copies free the slots, and the whole chain comes back."""
    cuda, engine = host_cuda, threading.get_ident()
    shape = cuda._block_shape
    salt = kv_salt("m", "cuda-f16")
    hashes, payloads = _written(tmp_path, salt, shape, 10)
    arena = _arena(cuda, 4, engine)
    store = _store(tmp_path, salt, shape, np.float16, buffers=cuda.restore_buffers())
    s = _restore(_manager(cuda, store), hashes)
    store.close()
    assert len(s.kv.blocks) == 10
    for block, want in zip(s.kv.blocks, payloads, strict=True):
        assert np.array_equal(cuda.pool_block(block), want)
    _check_copies(cuda, arena, reads, engine, 10)
    assert len({u.src for u in cuda.dev.uploads if u.host is arena.host}) <= 4  # the four slots, reused


def test_a_damaged_file_is_quarantined_never_loaded_and_its_slot_comes_back(host_cuda, tmp_path, reads):
    cuda, engine = host_cuda, threading.get_ident()
    shape = cuda._block_shape
    salt = kv_salt("m", "cuda-f16")
    hashes, payloads = _written(tmp_path, salt, shape, 10)
    arena = _arena(cuda, 4, engine)
    store = _store(tmp_path, salt, shape, np.float16, buffers=cuda.restore_buffers())
    path = store.path_for(hashes[6])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # one payload bit: the header still passes, the checksum does not
    path.write_bytes(bytes(data))
    s = _restore(_manager(cuda, store), hashes)
    store.close()
    assert len(s.kv.blocks) == 6 and store.stats.quarantined == 1  # the chain stops at the damaged block
    assert not path.exists() and list((tmp_path / "quarantine").iterdir())
    for block, want in zip(s.kv.blocks, payloads[:6], strict=True):
        assert np.array_equal(cuda.pool_block(block), want)
    _check_copies(cuda, arena, reads, engine, 6)  # its bytes never went to the device
    assert all(arena.take(1.0) is not None for _ in range(4))  # every slot free again


def test_a_dropped_restore_gives_its_slots_back(host_cuda, tmp_path, reads):
    """A sequence that ends while its restore waits for room (every slot read, none loaded): its
    slots go back, the reader stops it, and the next restore gets the whole arena."""
    cuda, engine = host_cuda, threading.get_ident()
    shape = cuda._block_shape
    salt = kv_salt("m", "cuda-f16")
    hashes, payloads = _written(tmp_path, salt, shape, 10)
    _arena(cuda, 4, engine)
    store = _store(tmp_path, salt, shape, np.float16, buffers=cuda.restore_buffers())
    km = _manager(cuda, store)
    gone = SimpleNamespace(kv=KVState(), req=SimpleNamespace(request_id="gone"), number=1)
    km.start_restore(gone, Prefix([], hashes, ["disk"] * 10))
    job = gone.kv.restoring
    assert job.wake.wait(10) and len(job.results) == 4 and not job.done.is_set()  # the reader waits for room
    km.free(gone)
    assert job.done.wait(10) and len(job.results) == 4 and gone.kv.restoring is None
    s = _restore(km, hashes)
    store.close()
    assert len(s.kv.blocks) == 10
    for block, want in zip(s.kv.blocks, payloads, strict=True):
        assert np.array_equal(cuda.pool_block(block), want)


def test_load_takes_only_the_arenas_buffers(host_cuda):
    """A payload anywhere else would need a copy on the engine thread: refused before anything is queued."""
    cuda = host_cuda
    arena = cuda.restore_buffers()
    with pytest.raises(ValueError, match="restore slots"):
        cuda.load_blocks([0], [np.zeros(cuda._block_shape, np.float16)])
    assert cuda.dev.uploads == [] and arena.take(0) is not None


# -- the CUDA backend on a GPU ------------------------------------------------------------------------------




@pytest.mark.gpu
def test_gpu_restores_through_the_pinned_arena(dev, tmp_path, reads, monkeypatch):
    """Blocks restored from disk through the real CUDA backend: the pool holds each file's payload,
    and every copy to the device was queued on the engine thread from the pinned slot the reader
    thread read the file into (four slots for twenty blocks: the reader waits for the copies)."""
    from ember.kernels.cuda_runtime import DeviceArray
    from ember.worker.backends.cuda.backend import CudaBackend
    from ember.worker.bench.synth import make_model
    from ember.worker.model.loader import open_model

    model = open_model(make_model("llama", "tiny", tmp_path / "llama.gguf", seed=1))
    cud = CudaBackend(model.config, model.gguf, n_blocks=48, block_size=BLOCK, device=dev, max_rows=256, max_seqs=8)
    shape = cud.read_block(0).shape
    engine = threading.get_ident()
    salt = kv_salt(model.fingerprint, cud.kv_layout)
    hashes, payloads = _written(tmp_path / "kv", salt, shape, 20)
    arena = cud._restore = kv.RestoreSlots(dev, shape, cud.kv_dtype, nbytes=4 * cud.read_block(0).size * 2)
    uploads: list[SimpleNamespace] = []
    real_upload = DeviceArray.upload_from

    def upload_from(self, host, nbytes, stream, host_offset=0):
        uploads.append(SimpleNamespace(thread=threading.get_ident(), host=host, src=host.ptr + host_offset,
                                       nbytes=nbytes))
        return real_upload(self, host, nbytes, stream, host_offset)

    monkeypatch.setattr(DeviceArray, "upload_from", upload_from)
    store = _store(tmp_path / "kv", salt, shape, cud.block_dtype, buffers=cud.restore_buffers())
    assert store.buffers is arena and cud.block_dtype == np.float16  # the cuda-f16 layout
    s = _restore(_manager(cud, store), hashes)
    store.close()
    assert len(s.kv.blocks) == 20
    for block, want in zip(s.kv.blocks, payloads, strict=True):
        assert np.array_equal(cud.read_block(block).astype(np.float16), want), f"block {block}"
    bb = arena.block_bytes
    filled = {ptr for thread, ptr in reads if arena.host.ptr <= ptr < arena.host.ptr + arena.host.nbytes}
    assert {thread for thread, ptr in reads if ptr in filled} == {"ember-kv-reader"}
    from_arena = [u for u in uploads if u.host is arena.host]
    assert {u.thread for u in from_arena} == {engine}
    sources = [u.src + k * bb for u in from_arena for k in range(u.nbytes // bb)]
    assert len(sources) == 20 and set(sources) <= filled
    assert all(u.nbytes <= 4 * cud._kv_transfer().per_slab for u in uploads if u.host is not arena.host)


def test_a_bad_file_two_threads_find_is_quarantined_once(host_cuda, tmp_path, capsys):
    """The reader and the scan's timed reads can both find one damaged file (seen in CI): it is moved,
    counted and logged once."""
    salt = kv_salt("m", "cuda-f16")
    hashes, _ = _written(tmp_path, salt, host_cuda._block_shape, 2)
    store = _store(tmp_path, salt, host_cuda._block_shape, np.float16, buffers=host_cuda.restore_buffers())
    path = store.path_for(hashes[1])
    store.scan_done.wait(30)
    store._quarantine(path, "payload checksum mismatch")
    store._quarantine(path, "payload checksum mismatch")
    store.close()
    assert store.stats.quarantined == 1 and not path.exists()
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert capsys.readouterr().err.count('"kv_quarantined"') == 1
