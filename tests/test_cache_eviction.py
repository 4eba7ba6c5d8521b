"""Eviction that keeps what agents share (issue 43 item 3): three live sessions share a long head, a
burst of one-off long prompts overflows the device pool, the host tier and the disk budget, and each
session's next turn still starts from the head: from the device, and after a restart from the disk.

Real components: the engine over the numpy backend on a tiny synthetic qwen2, and a KV store on a
directory of the test's own; prompts are token ids, so nothing depends on a tokenizer's merges. The
same runs on the CUDA backend where a GPU is (marked gpu): there the KV store keeps no host copy of
the blocks (they go from the pinned slabs straight to disk), so its host tier holds nothing to keep
and the disk is checked in its place. Then the policy's own rules (kvstore/eviction.py) one tier at a
time, and the block history that carries the use counts over a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model
from ember.worker.engine.kv_blocks import ROOT_HASH, BlockPool, chain_hash, kv_salt
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, Finished, GenerationRequest, RequestHandle, Started
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.step_costs import PrefillCost
from ember.worker.kvstore import blockfile
from ember.worker.kvstore.eviction import TwoClassLRU, disk_order
from ember.worker.kvstore.history import BlockHistory
from ember.worker.kvstore.store import KVStore
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

BS = 16
HEAD = 8 * BS  # the shared head: eight full blocks
POOL = 24  # device blocks: the head (8) beside one burst prompt (14), not beside the burst
BURST = [200] * 4  # one-off prompts, 13 blocks each: 52 blocks in all, past the pool, host tier and disk budget
HOST_BLOCKS = 18  # the host tier: shared blocks may fill half (9), the head needs 8
DISK_FILES = 20  # the disk budget, in block files (shared: 10 at most)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "qwen2.gguf", seed=1)
    return Runtime.load(str(path), kv_tokens=2048)


@pytest.fixture(params=["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, runtime):
    """A factory of fresh backends (an empty device pool of POOL blocks) of one kind."""
    if request.param == "numpy":
        return lambda: NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=POOL, block_size=BS)
    try:
        from ember.kernels.cuda_runtime import try_device
    except ImportError as e:
        pytest.skip(f"no cuda-python: {e}")
    dev, why = try_device()
    if dev is None:
        pytest.skip(f"no CUDA device: {why}")
    from ember.worker.backends.cuda.backend import CudaBackend

    model = runtime.model
    return lambda: CudaBackend(model.config, model.gguf, n_blocks=POOL, block_size=BS, device=dev, max_rows=256,
                               max_seqs=2)


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def _engine(runtime, backend, store_root: Path | None = None) -> Engine:
    """An engine on a fresh backend; with store_root, a KV store there that reads restored blocks into
    that backend's restore buffers, as the worker's does (engine.store)."""
    be = backend()
    store = None if store_root is None else _store(runtime, store_root, be)
    e = Engine(runtime.model, be, EngineLimits(max_seqs=1, context=2048), metrics=Metrics(), store=store)
    # the restore policy is not under test: computing looks slow, so what a tier holds is read back
    e.restore_costs.prefill = PrefillCost(1.0, 1.0)
    e.start()
    return e


def _run(engine: Engine, prompt: list[int], rid: str, n: int = 4) -> tuple[Started, list[int]]:
    req = GenerationRequest(rid, list(prompt), SamplingParams(temperature=0), n)

    async def go():
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        return [e async for e in h.events()]

    events = asyncio.run(go())
    assert isinstance(events[-1], Finished), events[-1]
    started = next(e for e in events if isinstance(e, Started))
    return started, [t for e in events if isinstance(e, Delta) for t in e.tokens]


def _store(runtime, root, be) -> KVStore:
    shape = be.read_block(0).shape
    block_bytes = int(np.prod(shape)) * be.block_dtype.itemsize
    file_bytes = blockfile.HEADER_SIZE + 4 * BS + block_bytes
    return KVStore(root, salt=kv_salt(runtime.model.fingerprint, be.kv_layout), model_key=runtime.model.fingerprint,
                   block_shape=shape, block_tokens=BS, block_dtype=be.block_dtype, chain_hash=chain_hash,
                   disk_budget=DISK_FILES * file_bytes, host_budget=HOST_BLOCKS * block_bytes,
                   buffers=be.restore_buffers())


def _hashes(engine: Engine, tokens: list[int]) -> list[bytes]:
    salt = engine.pool.salt
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS], salt)
        out.append(parent)
    return out


class Sessions:
    """Three agent sessions on one system prompt (the head), then a burst of one-off work."""

    def __init__(self, runtime):
        vocab = runtime.config.vocab_size
        self.head = _ids(1, HEAD, vocab)
        self.firsts = [self.head + _ids(10 + i, 24, vocab) for i in range(3)]
        self.burst = [_ids(100 + i, n, vocab) for i, n in enumerate(BURST)]
        self.vocab = vocab
        self.nexts: list[list[int]] = []

    def first_turns(self, engine: Engine) -> None:
        for i, prompt in enumerate(self.firsts):
            started, out = _run(engine, prompt, f"s{i}-1")
            assert started.cached_tokens == (HEAD if i else 0)  # the later sessions start from the head
            self.nexts.append(prompt + out + _ids(20 + i, 20, self.vocab))

    def run_burst(self, engine: Engine) -> None:
        for i, prompt in enumerate(self.burst):
            started, _ = _run(engine, prompt, f"burst-{i}")
            assert started.cached_tokens == 0

    def next_turns(self, engine: Engine) -> list[int]:
        return [_run(engine, prompt, f"s{i}-2")[0].cached_tokens for i, prompt in enumerate(self.nexts)]


def test_a_burst_of_one_off_prompts_keeps_the_shared_head_on_the_device(runtime, backend):
    engine = _engine(runtime, backend)
    try:
        sessions = Sessions(runtime)
        sessions.first_turns(engine)
        sessions.run_burst(engine)
        assert engine.pool.evictions >= sum(BURST) // BS - POOL  # the burst overflowed the pool
        assert all(cached >= HEAD for cached in sessions.next_turns(engine))
        # while the burst's own blocks, used once, went: its first prompt again starts cold
        assert _run(engine, sessions.burst[0], "burst-again")[0].cached_tokens == 0
    finally:
        engine.shutdown()


def test_a_burst_keeps_the_shared_head_in_the_host_tier_and_on_disk_across_a_restart(runtime, backend, tmp_path):
    engine = _engine(runtime, backend, tmp_path)
    store = engine.store
    host_copies = engine.backend.name == "numpy"  # CUDA's blocks go to disk from pinned slabs, never kept in RAM
    sessions = Sessions(runtime)
    head = _hashes(engine, sessions.head)
    try:
        sessions.first_turns(engine)
        sessions.run_burst(engine)
        assert store.flush()
    finally:
        engine.shutdown()
    try:
        assert store.stats.evictions > 0 and store.stats.writes > DISK_FILES  # the burst overflowed the disk
        burst_heads = [_hashes(engine, p)[0] for p in sessions.burst]
        assert [store.where([h]) for h in burst_heads[:2]] == [[], []]  # the first one-offs left every tier
        assert store.where(head) == ["host" if host_copies else "disk"] * len(head)  # the head stayed in RAM...
        assert all(store.path_for(h).exists() for h in head)  # ...and on disk
        assert min(store.uses_of(head)) >= 3  # three sessions took it
    finally:
        store.close()
    engine = _engine(runtime, backend, tmp_path)  # a restarted worker: files and the block history only
    store = engine.store
    try:
        store.scan_done.wait(10)
        assert min(store.uses_of(head)) >= 3  # the block history carried the use counts over
        assert store.where(head) == ["disk"] * len(head)
        cached = sessions.next_turns(engine)
        assert all(c >= HEAD for c in cached), cached
        assert store.stats.restore_hits >= len(head)
    finally:
        engine.shutdown()
        store.close()


# -- the policy, one tier at a time -----------------------------------------------------------------------


def test_the_pool_evicts_leaves_and_ordinary_blocks_before_a_shared_head():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.register(b, bytes([i]) * 16)
    pool.release(a)  # one sequence's chain: its tail goes first
    pool.allocate(5)  # the free blocks
    assert [pool.allocate(1)[0] for _ in range(3)] == [a[2], a[1], a[0]]
    assert pool.was_evicted(bytes([2]) * 16) and pool.was_evicted(bytes([0]) * 16)

    pool = BlockPool(8, 4)
    head, tail = pool.allocate(2), pool.allocate(2)
    for i, b in enumerate(head + tail):
        pool.register(b, bytes([i]) * 16)
    pool.release(head + tail)
    for b in head:  # a second sequence takes the head
        pool.retain(b)
    pool.used_by_another(head)
    pool.release(head)
    taken = pool.allocate(6)  # the four free blocks, then the ordinary tail; the shared head stays
    assert not set(head) & set(taken) and set(tail) <= set(taken)
    assert pool.allocate(2) == [head[1], head[0]]  # when nothing else is left, the head goes too, leaf first


def test_two_class_lru_caps_the_shared_class():
    lru: TwoClassLRU[str, int] = TwoClassLRU(shared_cap=2)
    for k in "abc":
        lru.put(k, 0, shared=True)  # a is the least recently used shared entry: back to ordinary
    lru.put("x", 0, shared=False)
    assert list(lru.ordinary) == ["a", "x"] and list(lru.shared) == ["b", "c"]
    assert [lru.evict()[0] for _ in range(4)] == ["a", "x", "b", "c"]


def test_disk_order_puts_shared_files_last_within_their_share():
    entries = [(1.0, 10, b"old-shared"), (2.0, 10, b"ordinary"), (3.0, 10, b"new-shared"), (0.5, 10, b"oldest")]
    uses = {b"old-shared": 3, b"new-shared": 2}
    order = [h for _, _, h in disk_order(entries, uses, shared_cap_bytes=20)]
    assert order == [b"oldest", b"ordinary", b"old-shared", b"new-shared"]
    order = [h for _, _, h in disk_order(entries, uses, shared_cap_bytes=10)]  # one shared file fits its share
    assert order == [b"oldest", b"old-shared", b"ordinary", b"new-shared"]


def test_the_block_history_round_trips_and_a_bad_one_reads_empty(tmp_path):
    led = BlockHistory()
    led.used(b"h" * 16)
    led.used(b"h" * 16)
    led.lose(b"l" * 16, "not_persisted")
    led.lose(b"e" * 16, "evicted")
    BlockHistory.write(tmp_path, led.encode())
    back = BlockHistory.load(tmp_path)
    assert back.uses == {b"h" * 16: 3} and list(back.lost.items()) == [(b"l" * 16, "not_persisted"),
                                                                       (b"e" * 16, "evicted")]
    (tmp_path / "history").write_bytes(b"EMBERBH1" + b"\0" * 7)  # short: not a whole record
    assert BlockHistory.load(tmp_path).uses == {} and BlockHistory.load(tmp_path / "none").lost == {}
