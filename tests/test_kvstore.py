"""KV blocks on disk: a new engine comes back warm, and no file on disk can hurt it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import time

import numpy as np
import pytest

from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.kv_blocks import chain_hash, kv_salt
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, Finished, GenerationRequest, RequestHandle, Started
from ember.worker.engine.sampling import SamplingParams
from ember.worker.kvstore import blockfile
from ember.worker.kvstore.store import KVStore
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

PROMPT = ("The lighthouse keeper wrote in his log every evening. The storm had lasted three days, "
          "and the supply boat was late. He counted the candles, checked the lamp, and wound the clock. ") * 2


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=1024)


def _store(runtime, root, **kw):
    be = runtime.backend
    return KVStore(root, salt=kv_salt(runtime.model.fingerprint, be.kv_layout), model_key=runtime.model.fingerprint,
                   block_shape=be.read_block(0).shape, block_tokens=be.block_size, chain_hash=chain_hash,
                   persist=kw.pop("persist", "all"), disk_budget=kw.pop("disk_budget", 1 << 30),
                   host_budget=kw.pop("host_budget", 64 << 20), **kw)


def _run(runtime, store, prompt=PROMPT, n=8):
    """A fresh backend (empty device cache) and engine over `store`; returns (Started, tokens)."""
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=runtime.backend.block_size)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024), metrics=Metrics(), store=store)
    engine.start()
    try:
        req = GenerationRequest("r", runtime.model.tokenizer.encode(prompt), SamplingParams(temperature=0), n)

        async def go():
            h = RequestHandle(req, asyncio.get_running_loop())
            engine.submit(h)
            return [e async for e in h.events()]

        events = asyncio.run(go())
    finally:
        engine.shutdown()
    assert isinstance(events[-1], Finished), events[-1]
    started = next(e for e in events if isinstance(e, Started))
    return started, [t for e in events if isinstance(e, Delta) for t in e.tokens], len(req.prompt)


def _files(root):
    return sorted(p for p in root.rglob("*.kv") if "quarantine" not in p.parts)


def test_restart_comes_back_warm_and_identical(runtime, tmp_path):
    s1 = _store(runtime, tmp_path)
    cold, toks_cold, n_prompt = _run(runtime, s1)
    assert s1.flush() and cold.cached_tokens == 0
    s1.close()
    assert len(_files(tmp_path)) >= n_prompt // 16
    for p in _files(tmp_path):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert p.parent.parent == s1.dir  # <kv dir>/<fingerprint>-<layout>/??/<hash>.kv
    assert stat.S_IMODE(s1.dir.stat().st_mode) == 0o700
    s2 = _store(runtime, tmp_path)  # a new process would see exactly this: files only
    warm, toks_warm, _ = _run(runtime, s2)
    assert warm.cached_tokens == (n_prompt - 1) // 16 * 16
    assert toks_warm == toks_cold
    assert s2.stats.restore_hits >= warm.cached_tokens // 16 and s2.stats.quarantined == 0
    s2.close()


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "payload-bit":
        data[-7] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "header-bit":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "version":
        data[8] = 9
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "tokens":
        data[blockfile.HEADER_SIZE] ^= 0x01  # a different token id: the chain hash no longer fits
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "empty", "payload-bit", "header-bit", "version", "garbage", "tokens"])
def test_damaged_files_are_quarantined_and_recomputed(runtime, tmp_path, how):
    s1 = _store(runtime, tmp_path)
    _, ref, n_prompt = _run(runtime, s1)
    s1.close()
    files = _files(tmp_path)
    # damage the third block of the prompt's chain: the first two still restore
    s_probe = _store(runtime, tmp_path, persist="off")
    ids = runtime.model.tokenizer.encode(PROMPT)
    h, parent = None, b"\0" * 16
    for i in range(3):
        h = chain_hash(parent, ids[i * 16 : (i + 1) * 16], s_probe.salt)
        parent = h
    target = s_probe.path_for(h)
    s_probe.close()
    assert target in files
    _damage(target, how)
    s2 = _store(runtime, tmp_path)
    warm, toks, _ = _run(runtime, s2)
    assert toks == ref  # never wrong tokens
    assert warm.cached_tokens == 2 * 16  # the chain stops at the damaged block
    assert s2.stats.quarantined >= 1 and list((tmp_path / "quarantine").iterdir())
    s2.close()
    # the recomputed block was persisted again, whole and valid
    header, _ = blockfile.read_header(target.read_bytes(), salt=s2.salt)
    assert header.file_size == target.stat().st_size


def test_a_foreign_file_in_this_layouts_directory_is_quarantined(runtime, tmp_path):
    """Another layout's blocks live in its own directory and are never touched; a block of another
    layout found in this one's directory (copied there by hand) is foreign, and quarantined."""
    s1 = _store(runtime, tmp_path)
    _run(runtime, s1)
    s1.close()
    other = KVStore(tmp_path, salt=b"another-model:numpy:kv1", model_key=runtime.model.fingerprint,
                    block_shape=runtime.backend.read_block(0).shape, block_tokens=16, chain_hash=chain_hash,
                    disk_budget=1 << 30, host_budget=1 << 20)
    other.scan_done.wait(10)
    assert other.dir != s1.dir and other.stats.quarantined == 0 and not (tmp_path / "quarantine").exists()
    stray = _files(tmp_path)[0]
    (other.dir / stray.parent.name).mkdir(exist_ok=True)
    copied = other.dir / stray.parent.name / stray.name
    copied.write_bytes(stray.read_bytes())
    other.close()
    again = KVStore(tmp_path, salt=b"another-model:numpy:kv1", model_key=runtime.model.fingerprint,
                    block_shape=runtime.backend.read_block(0).shape, block_tokens=16, chain_hash=chain_hash,
                    disk_budget=1 << 30, host_budget=1 << 20)
    again.scan_done.wait(10)
    assert again.stats.quarantined == 1 and not copied.exists() and stray.exists()
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "quarantine").iterdir()] == [stray.name]
    again.close()


def test_disk_budget_is_kept(runtime, tmp_path):
    block_file = blockfile.HEADER_SIZE + 16 * 4 + runtime.backend.read_block(0).nbytes
    budget = 3 * block_file + block_file // 2
    s = _store(runtime, tmp_path, disk_budget=budget)
    _run(runtime, s)
    s.flush()
    total = sum(p.stat().st_size for p in _files(tmp_path))
    assert total <= budget * 1.01 and s.stats.evictions > 0
    s.close()


def test_unwritable_directory_degrades_to_no_persistence(runtime, tmp_path, capfd):
    root = tmp_path / "kv"
    if os.geteuid() == 0:
        # root ignores permissions: make the path unusable instead (a file where the dir should be)
        root.write_bytes(b"not a directory")
    else:
        root.mkdir(mode=0o500)
    s = _store(runtime, root)
    _, toks, _ = _run(runtime, s)
    s.flush()
    assert len(toks) > 0 and not s.writable and s.persistence.state == "degraded"
    assert s.persistence.not_persisted > 0  # counted, not silently lost
    s.close()
    lines = [ln for ln in capfd.readouterr().err.splitlines() if '"kv_persistence"' in ln]
    assert len(lines) == 1 and '"state": "degraded"' in lines[0]  # retried, logged once per reason


def test_two_stores_on_one_directory(runtime, tmp_path):
    a, b = _store(runtime, tmp_path), _store(runtime, tmp_path)
    _run(runtime, a)
    _run(runtime, b)
    a.close()
    b.close()
    c = _store(runtime, tmp_path)
    warm, _, n_prompt = _run(runtime, c)
    assert warm.cached_tokens == (n_prompt - 1) // 16 * 16 and c.stats.quarantined == 0
    c.close()


def test_blockfile_round_trip_and_checks():
    salt = b"m:numpy:kv1"
    payload = np.arange(2 * 3 * 4 * 1 * 8, dtype=np.float32).reshape(2, 3, 4, 1, 8)
    toks = [5, 6, 7, 8]
    h = chain_hash(b"\0" * 16, toks, salt)
    data = blockfile.encode(h, b"\0" * 16, salt, toks, payload)
    got = blockfile.decode(data, salt=salt, expect_hash=h, shape=payload.shape, chain_hash=chain_hash)
    np.testing.assert_array_equal(got, payload)
    with pytest.raises(blockfile.BadBlockFile, match="another model"):
        blockfile.decode(data, salt=b"x", expect_hash=h, shape=payload.shape)
    with pytest.raises(blockfile.BadBlockFile, match="name"):
        blockfile.decode(data, salt=salt, expect_hash=b"\1" * 16, shape=payload.shape)
    with pytest.raises(blockfile.BadBlockFile, match="shape"):
        blockfile.decode(data, salt=salt, expect_hash=h, shape=(2, 3, 4, 2, 4))


# -- the store failing during admission: the request computes, and no block is left retained -------------------

def _engine_over(runtime, store):
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=runtime.backend.block_size)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024), metrics=Metrics(), store=store)
    engine.start()
    return engine


def _generate(engine, runtime, prompt, n=4):
    req = GenerationRequest("r", runtime.model.tokenizer.encode(prompt), SamplingParams(temperature=0), n)

    async def go():
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        return [e async for e in h.events()]

    return asyncio.run(go())


def _prefix_then_longer(runtime, store, during_second):
    """Run PROMPT (its blocks stay cached on the device), then PROMPT plus more with `during_second`
    in effect: admission matches PROMPT's blocks on the device and asks the store for the rest."""
    engine = _engine_over(runtime, store)
    try:
        _generate(engine, runtime, PROMPT)
        assert store.flush()
        with during_second():
            events = _generate(engine, runtime, PROMPT + "The keeper climbed the stairs once more. " * 4)
        for _ in range(200):  # the engine thread settles before it pushes the last event; gauges follow
            if engine.pool.in_use == 0:
                break
            time.sleep(0.01)
        return events, engine.pool.in_use
    finally:
        engine.shutdown()


def test_an_io_error_during_admission_computes_and_releases_blocks(runtime, tmp_path, capfd):
    store = _store(runtime, tmp_path)
    store.scan_done.wait(10)
    real_stat = os.stat

    def failing_stat(path, *a, **kw):  # the disk under the store answers EIO to every lookup
        if str(path).startswith(str(store.dir)) and str(path).endswith(".kv"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_stat(path, *a, **kw)

    @contextlib.contextmanager
    def eio():
        os.stat = failing_stat
        try:
            yield
        finally:
            os.stat = real_stat

    events, in_use = _prefix_then_longer(runtime, store, eio)
    store.close()
    assert in_use == 0  # the device blocks admission retained before asking the store went back
    assert isinstance(events[-1], Finished), events[-1]  # and the request computed what the store could not give
    assert next(e for e in events if isinstance(e, Started)).cached_tokens >= 16
    err = capfd.readouterr().err
    assert "kv_read_error" in err and "Input/output error" in err and "engine_error" not in err


def test_a_failing_store_lookup_computes_and_releases_blocks(runtime, tmp_path, capfd):
    store = _store(runtime, tmp_path)

    def broken(hashes):
        raise RuntimeError("the store's index is corrupt")

    @contextlib.contextmanager
    def lookup_fails():
        store.where = broken
        try:
            yield
        finally:
            del store.where

    events, in_use = _prefix_then_longer(runtime, store, lookup_fails)
    store.close()
    assert in_use == 0
    assert isinstance(events[-1], Finished), events[-1]
    assert next(e for e in events if isinstance(e, Started)).cached_tokens >= 16
    err = capfd.readouterr().err
    assert "kv_lookup_error" in err and "index is corrupt" in err and "engine_error" not in err


class _CountingBackend(NumpyBackend):
    """The numpy backend, recording each save_blocks batch."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.saves: list[list[int]] = []

    def save_blocks(self, blocks):
        self.saves.append(list(blocks))
        return super().save_blocks(blocks)


def test_a_steps_full_blocks_leave_the_device_in_one_batch(runtime, tmp_path):
    store = _store(runtime, tmp_path)
    be = _CountingBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=runtime.backend.block_size)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024, prefill_chunk=64, max_step_tokens=64),
                    metrics=Metrics(), store=store)
    engine.start()
    try:
        events = _generate(engine, runtime, PROMPT)
    finally:
        engine.shutdown()
    assert isinstance(events[-1], Finished)
    computed = len(runtime.model.tokenizer.encode(PROMPT)) + 4 - 1  # the last token drawn is never fed back
    assert be.saves and sum(len(s) for s in be.saves) == computed // 16  # every full block once
    assert be.saves[0] == [0, 1, 2, 3]  # the first 64-token chunk's four blocks together
    assert store.flush()
    assert len(_files(tmp_path)) == computed // 16 and store.stats.writes == computed // 16
    store.close()


def test_a_writer_that_is_behind_drops_blocks_and_never_waits(runtime, tmp_path):
    store = _store(runtime, tmp_path, host_budget=3 * _store_block_bytes(runtime))
    hashes = [bytes([i + 1]) * 16 for i in range(5)]
    chain = list(zip(hashes, [b"\0" * 16] + hashes[:-1], strict=True))  # each block's parent is the one before it
    taken = store.accept(chain)
    assert taken == hashes[:3] and store.stats.write_drops == 2
    assert store.accept(chain) == []  # the three are on their way; the writer has no more room
    assert store.stats.write_drops == 4
    store.offer_batch([(h, p, [1] * 16) for h, p in chain[:3]], None)  # the backend had no room either
    assert store.stats.write_drops == 7 and store.write_queue_depth == 0
    assert store.accept(chain[3:4]) == []  # its parent was dropped: no use writing it
    assert store.accept(chain[:1]) == hashes[:1]  # the backlog is free again
    store.close()


class _StubStore:
    """The store as flush_offers sees it: `room` blocks a flush, every claim and offer recorded."""

    persist = "all"

    def __init__(self, room):
        self.room, self.claims, self.offered, self.lost, self.known = room, [], [], [], set()

    def write_room(self):
        return self.room

    def claim(self, blocks):
        self.claims.append([h for h, _ in blocks])
        out, taken = [], 0
        for h, parent in blocks:
            if h in self.known:
                out.append("known")
            elif taken < self.room and (parent == b"\0" * 16 or parent in self.known):
                taken += 1
                self.known.add(h)
                out.append("take")
            else:
                out.append("later")
        return out

    def offer_batch(self, entries, copy):
        self.offered.append([h for h, _, _ in entries])

    def lose(self, hashes):
        self.lost += hashes


def test_a_writer_that_is_behind_gets_the_heads_of_live_chains_first_and_the_rest_later():
    """flush_offers under a writer with room for few blocks: every live sequence's owed blocks are offered
    again at each flush, nearer their chain's head first (older sequences first among equals), so each
    chain is persisted from its root; a sequence that ends gives up what the writer did not take."""
    from types import SimpleNamespace

    from ember.worker.engine.kv_manager import KVManager
    from ember.worker.engine.sequence import KVState

    store = _StubStore(room=4)
    backend = SimpleNamespace(block_size=2, save_blocks=lambda blocks: list(blocks))
    kv = KVManager(pool=None, backend=backend, store=store, metrics=None, costs=None)

    def seq(number, name, blocks):
        hashes = [f"{name}{i}".encode().ljust(16, b".") for i in range(blocks)]
        return SimpleNamespace(number=number, tokens=list(range(2 * blocks)),
                               kv=KVState(blocks=list(range(blocks)), hashes=hashes, n_registered=blocks))

    a, b = seq(1, "a", 6), seq(2, "b", 3)
    kv._offer(a)
    kv._offer(b)
    kv.flush_offers()
    assert [h.rstrip(b".") for h in store.offered[-1]] == [b"a0", b"b0", b"a1", b"b1"]
    assert (a.kv.n_offered, b.kv.n_offered) == (2, 2)
    kv.flush_offers()  # the writer has room again: the next heads, b's last before a's deeper ones
    assert [h.rstrip(b".") for h in store.offered[-1]] == [b"a2", b"b2", b"a3", b"a4"]
    assert (a.kv.n_offered, b.kv.n_offered) == (5, 3) and list(kv._owing) == [1]
    store.room = 0
    kv.flush_offers(last=a)  # a ends with its last block not taken: given up, counted
    assert [h.rstrip(b".") for h in store.lost] == [b"a5"] and not kv._owing
    kv.flush_offers()  # nothing owed: nothing asked
    assert len(store.claims) == 3


def test_a_writer_that_is_behind_catches_up_on_a_live_sequence(runtime, tmp_path):
    """A prompt of 12 full blocks prefilled in one step with room for 2 at a time: the engine offers the
    rest again at each step while the sequence decodes, so its whole prompt is persisted from the root
    (before, the 10 blocks the writer had no room for were dropped, and the chain ended at block 2)."""
    bs = runtime.backend.block_size
    store = _store(runtime, tmp_path, host_budget=2 * _store_block_bytes(runtime))
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=bs)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024, prefill_chunk=256, max_step_tokens=256),
                    metrics=Metrics(), store=store)
    engine.start()
    ids = runtime.model.tokenizer.encode(PROMPT * 5)[: 12 * bs + 1]
    assert len(ids) == 12 * bs + 1
    req = GenerationRequest("r", ids, SamplingParams(temperature=0), 16)

    async def go():
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        return [e async for e in h.events()]

    try:
        events = asyncio.run(go())
    finally:
        engine.shutdown()
    assert isinstance(events[-1], Finished)
    assert store.flush()
    hashes, parent = [], b"\0" * 16
    for i in range(12):
        parent = chain_hash(parent, ids[i * bs : (i + 1) * bs], store_salt(runtime))
        hashes.append(parent)
    assert store.available(hashes) == 12  # the whole prompt, from its root
    assert store.stats.write_drops == 0
    store.close()


def store_salt(runtime):
    return kv_salt(runtime.model.fingerprint, runtime.backend.kv_layout)


def _store_block_bytes(runtime):
    return int(np.prod(runtime.backend.read_block(0).shape)) * 4


def test_a_restarted_store_times_its_disk_before_the_first_restore(runtime, tmp_path, capfd):
    """The scan reads the newest files whole, checked as a restore reads them, and times it: the
    disk tier's rate for a restarted worker's first warm admit, instead of a prior."""
    empty = _store(runtime, tmp_path / "empty")
    assert empty.scan_done.wait(10) and empty.take_disk_probe() is None  # nothing on disk: nothing measured
    empty.close()
    s1 = _store(runtime, tmp_path)
    _run(runtime, s1)
    assert s1.flush()
    s1.close()
    files = _files(tmp_path)
    assert files
    s2 = _store(runtime, tmp_path)
    try:
        assert s2.scan_done.wait(10)
        probe = s2.take_disk_probe()
        assert probe is not None
        nbytes, seconds = probe
        assert nbytes == sum(f.stat().st_size for f in files) and seconds > 0  # every file: far under PROBE_BYTES
        assert s2.take_disk_probe() is None  # taken once
        assert s2.stats.quarantined == 0
    finally:
        s2.close()
    assert '"kv_disk_probe"' in capfd.readouterr().err


def test_restore_or_recompute_whichever_measured_faster(runtime, tmp_path, capfd):
    from ember.worker.engine.restore_policy import RestoreCosts

    costs = RestoreCosts()
    assert costs.choose(4096, 0, 1 << 30).restore  # nothing measured yet: restore (and so measure it)
    costs.observe_prefill(8192, 0.05)  # an H200 on a small model: 164k tok/s
    costs.observe_restore("disk", 1 << 30, 1.0)
    assert costs.prefill.seconds(4096) == pytest.approx(0.025)
    assert not costs.choose(4096, 0, 256 << 20).restore  # 0.25 s from disk against 0.025 s of prefill
    assert costs.choose(4096, 64 << 20, 0).restore  # 0.01 s from RAM at 8 GB/s: restore
    spark = RestoreCosts()
    spark.observe_prefill(900, 1.0)  # a Spark-class prefill: restoring wins by far
    spark.observe_restore("disk", 1 << 30, 1.0)
    assert spark.choose(4096, 0, 256 << 20).restore
    costs.save(tmp_path / "rates.json")  # what a restarted worker decides by
    again = RestoreCosts()
    again.load(tmp_path / "rates.json")
    assert again.prefill.model == pytest.approx(costs.prefill.model) and again.bandwidth == costs.bandwidth
    (tmp_path / "rates.json").write_text("{broken")
    again.load(tmp_path / "rates.json")  # an unreadable file changes nothing
    assert again.prefill.model == pytest.approx(costs.prefill.model)

    s1 = _store(runtime, tmp_path)
    _, cold, n_prompt = _run(runtime, s1)
    assert s1.flush()
    s1.close()
    s2 = _store(runtime, tmp_path)
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=runtime.backend.block_size)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024), metrics=Metrics(), store=s2)
    for _ in range(3):  # steps enough to outweigh the rates the first worker left: computing is faster here
        engine.restore_costs.observe_prefill(10_000, 0.001)
    engine.start()
    try:
        events = _generate(engine, runtime, PROMPT, n=8)
    finally:
        engine.shutdown()
        s2.close()
    started = next(e for e in events if isinstance(e, Started))
    assert started.cached_tokens == 0 and [t for e in events if isinstance(e, Delta) for t in e.tokens] == cold
    err = capfd.readouterr().err
    assert '"kv_restore_choice"' in err and '"choice": "recompute"' in err and '"kv_restore"' not in err
