"""The KV directory shared by every store: one subdirectory per (model, layout), one disk budget for
all of them and for quarantine, kept under a lock file across processes. Real stores on real files
(small synthetic blocks, no model needed), and real processes for the sharing across them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from ember.worker.engine.kv_blocks import ROOT_HASH, chain_hash
from ember.worker.kvstore import blockfile, kvdir
from ember.worker.kvstore.store import KVStore

SHAPE = (2, 2, 16, 8)  # one block's payload: small, so a test writes dozens in a blink
FILE = blockfile.HEADER_SIZE + 16 * 4 + int(np.prod(SHAPE)) * 4  # bytes of one block file
MODEL = "0123456789abcdef0123456789abcdef"


def _store(root, salt=b"m:numpy:kv1", budget=1 << 30, model=MODEL, **kw):
    return KVStore(root, salt=salt, model_key=model, block_shape=SHAPE, block_tokens=16, chain_hash=chain_hash,
                   disk_budget=budget, host_budget=64 << 20, **kw)


def _write(store, n, seed=0):
    """Offer a chain of n blocks and wait until they are on disk; returns (hashes, payloads)."""
    rng = np.random.default_rng(seed)
    parent, hashes, payloads = ROOT_HASH, [], []
    for _ in range(n):
        toks = rng.integers(0, 50_000, 16).tolist()
        h = chain_hash(parent, toks, store.salt)
        payload = rng.standard_normal(SHAPE).astype(np.float32)
        store.offer(h, parent, toks, payload)
        parent = h
        hashes.append(h)
        payloads.append(payload)
    assert store.flush()
    return hashes, payloads


def _blocks(d):
    return sorted(d.glob("??/*.kv"))


def _kv_bytes(root):
    return sum(p.stat().st_size for p in root.rglob("*.kv") if "quarantine" not in p.parts)


def _opened(root, **kw):
    s = _store(root, **kw)
    assert s.scan_done.wait(10)
    return s


def test_two_layouts_share_a_directory_without_touching_each_other(tmp_path):
    # a numpy and a cuda worker of one model (another salt: another KV layout), open at once
    a, b = _opened(tmp_path, salt=b"m:numpy:kv1"), _opened(tmp_path, salt=b"m:cuda:kv1")
    ha, pa = _write(a, 5)
    hb, pb = _write(b, 5, seed=1)
    a.close()
    b.close()
    assert a.dir != b.dir and a.dir.parent == b.dir.parent == tmp_path
    assert len(_blocks(a.dir)) == len(_blocks(b.dir)) == 5
    a2, b2 = _opened(tmp_path, salt=b"m:numpy:kv1"), _opened(tmp_path, salt=b"m:cuda:kv1")
    try:
        assert a2.stats.quarantined == b2.stats.quarantined == 0 and not (tmp_path / "quarantine").exists()
        assert a2.available(ha) == 5 and b2.available(hb) == 5 and a2.available(hb) == 0
        for store, hashes, payloads in ((a2, ha, pa), (b2, hb, pb)):
            job = store.restore(hashes)
            assert job.done.wait(10)
            assert len(job.results) == 5
            assert all(np.array_equal(r, p) for r, p in zip(job.results, payloads, strict=True))
        assert (a2.dir / "layout").read_text().strip() == "m:numpy:kv1"
        assert int((a2.dir / "usage").read_text()) == 5 * FILE == a2.disk_bytes
    finally:
        a2.close()
        b2.close()


def test_a_users_directory_keeps_its_mode_and_ember_makes_its_own_private(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    s = _opened(mine)
    _write(s, 2)
    s.close()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755  # not ember's to change
    assert stat.S_IMODE(s.dir.stat().st_mode) == 0o700
    for p in [mine / ".lock", s.dir / "layout", s.dir / "usage", s.dir / ".inuse", *_blocks(s.dir)]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    fresh = tmp_path / "a" / "b" / "kv"  # nothing of it exists: ember creates every level, private
    s = _opened(fresh)
    _write(s, 1)
    s.close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", fresh, s.dir, *{p.parent for p in _blocks(s.dir)}):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def _garbage(store_dir, n, seed):
    rng = np.random.default_rng(seed)
    paths = []
    for _ in range(n):
        name = rng.bytes(16).hex()
        p = store_dir / name[:2] / f"{name}.kv"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(rng.bytes(FILE))
        paths.append(p)
    return paths


def test_quarantine_is_bounded_in_count_and_by_the_budget(tmp_path):
    s = _opened(tmp_path)
    s.close()
    _garbage(s.dir, kvdir.QUARANTINE_MAX_FILES + 6, seed=1)
    s = _opened(tmp_path)
    s.close()
    q = tmp_path / "quarantine"
    assert s.stats.quarantined == kvdir.QUARANTINE_MAX_FILES + 6
    assert len(list(q.iterdir())) == kvdir.QUARANTINE_MAX_FILES and not _blocks(s.dir)
    assert int((s.dir / "usage").read_text()) == 0  # quarantined bytes left the layout's ledger
    first = set(q.iterdir())
    time.sleep(0.05)
    newer = _garbage(s.dir, 3, seed=2)
    # the budget holds the valid blocks and two quarantined files: the oldest quarantined go first
    s = _opened(tmp_path, budget=4 * FILE + 2 * FILE)
    _write(s, 4)
    s.close()
    left = set(q.iterdir())
    assert len(left) == 2 and not left & first and {p.name.split("-", 1)[1] for p in left} <= {p.name for p in newer}
    assert len(_blocks(s.dir)) == 4 and _kv_bytes(tmp_path) + 2 * FILE <= 6 * FILE


def test_idle_directories_of_other_layouts_are_evicted_least_recently_used_first(tmp_path):
    now = time.time()
    dirs = {}
    for name, age in (("old", 300), ("newer", 100)):
        s = _opened(tmp_path, salt=f"m:{name}:kv1".encode())
        _write(s, 4)
        s.close()
        os.utime(s.dir / "usage", (now - age, now - age))
        dirs[name] = s.dir
    live = _opened(tmp_path, salt=b"m:live:kv1")  # another worker, running: never evicted whole
    try:
        _write(live, 4)
        os.utime(live.dir / "usage", (now - 1000, now - 1000))  # even though it looks the oldest
        s = _opened(tmp_path, salt=b"m:numpy:kv1", budget=13 * FILE)
        _write(s, 2)  # 14 blocks against a budget of 13: one directory must go, the oldest idle one
        s.close()
        assert not dirs["old"].exists() and len(_blocks(dirs["newer"])) == 4
        assert len(_blocks(live.dir)) == 4 and len(_blocks(s.dir)) == 2
        assert s.stats.dir_evictions == 1 and s.stats.evictions == 0
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(kvdir.EVICTED_PREFIX)]
    finally:
        live.close()


def test_an_older_embers_directory_ages_out_and_foreign_entries_are_never_touched(tmp_path):
    s = _opened(tmp_path)
    _write(s, 3)
    s.close()
    legacy = tmp_path / MODEL.replace("0", "f")  # the old layout: <fingerprint>/??/<hash>.kv, any salt
    for p in _blocks(s.dir):
        (legacy / p.parent.name).mkdir(parents=True, exist_ok=True)
        (legacy / p.parent.name / p.name).write_bytes(p.read_bytes())
    old = time.time() - 3600
    for p in legacy.rglob("*.kv"):
        os.utime(p, (old, old))
    photos = tmp_path / "photos"  # a user's things in a user's --kv-dir
    photos.mkdir()
    (photos / "cat.kv").write_bytes(b"x" * (10 * FILE))
    lookalike = tmp_path / ("e" * 32)  # named like an old KV dir, but not one
    (lookalike / "ab").mkdir(parents=True)
    (lookalike / "ab" / "notes.txt").write_bytes(b"y" * (10 * FILE))
    big = _opened(tmp_path)  # a budget with room: the old directory is counted, and left alone
    big.close()
    assert big.stats.quarantined == 0 and len(list(legacy.rglob("*.kv"))) == 3
    assert big.dir_bytes == 6 * FILE  # this layout's 3 and the old directory's 3; the rest is not ember's
    tight = _opened(tmp_path, budget=4 * FILE)
    _write(tight, 1, seed=5)
    tight.close()
    assert not legacy.exists() and tight.stats.dir_evictions == 1
    assert (photos / "cat.kv").stat().st_size == 10 * FILE and (lookalike / "ab" / "notes.txt").exists()
    assert _kv_bytes(s.dir) <= 4 * FILE


_WRITER = r"""
import sys, time
from pathlib import Path
import numpy as np
from ember.worker.engine.kv_blocks import ROOT_HASH, chain_hash
from ember.worker.kvstore.store import KVStore

root, salt, n, budget, seed, go = (sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4]),
                                   int(sys.argv[5]), Path(sys.argv[6]))
store = KVStore(root, salt=salt, model_key="0123456789abcdef0123456789abcdef", block_shape=(2, 2, 16, 8),
                block_tokens=16, chain_hash=chain_hash, disk_budget=budget, host_budget=64 << 20)
store.scan_done.wait(10)
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:  # start together: the writes interleave
    time.sleep(0.005)
rng = np.random.default_rng(seed)
parent = ROOT_HASH
for i in range(n):
    toks = rng.integers(0, 50_000, 16).tolist()
    h = chain_hash(parent, toks, salt)
    store.offer(h, parent, toks, rng.standard_normal((2, 2, 16, 8)).astype(np.float32))
    parent = h
    if i % 4 == 3:
        store.flush()
ok = store.flush(30)
(go.parent / f"done-{seed}").touch()
while len(list(go.parent.glob("done-*"))) < int(sys.argv[7]) and time.monotonic() < deadline:
    time.sleep(0.005)  # both stay live until both are done: neither sees the other's directory idle
store.close()
print("flushed" if ok else "not flushed", store.stats.writes, store.stats.evictions, store.stats.dir_evictions)
"""


def _two_writers(root, go, specs):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), salt, str(n), str(budget), str(seed), str(go),
                               str(len(specs))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for salt, n, budget, seed in specs]
    try:
        time.sleep(0.5)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.startswith("flushed"), err[-2000:]
    return [out.split() for out, _ in outs]


def _ledgers_match_the_files(root):
    for d in root.iterdir():
        if (d / "layout").exists():
            assert int((d / "usage").read_text()) == sum(p.stat().st_size for p in _blocks(d)), d


def test_two_processes_share_one_budget(tmp_path):
    # each alone fits the budget; together they would not: the second to need room evicts its own
    budget = 12 * FILE
    sync = tmp_path / "sync"
    sync.mkdir()
    outs = _two_writers(tmp_path / "kv", sync / "go", [("m:numpy:kv1", 10, budget, 1), ("m:cuda:kv1", 10, budget, 2)])
    assert _kv_bytes(tmp_path / "kv") <= budget
    _ledgers_match_the_files(tmp_path / "kv")
    layouts = [d for d in (tmp_path / "kv").iterdir() if (d / "layout").exists()]
    assert len(layouts) == 2 and sum(len(_blocks(d)) for d in layouts) == 12
    assert sum(int(o[2]) for o in outs) == 8 and all(o[3] == "0" for o in outs)  # own blocks only: both live


def test_two_replicas_keep_one_exact_ledger(tmp_path):
    # two processes writing into the same layout directory at once: the lock makes every
    # read-modify-write of its ledger whole
    sync = tmp_path / "sync"
    sync.mkdir()
    _two_writers(tmp_path / "kv", sync / "go", [("m:numpy:kv1", 40, 1 << 30, 1), ("m:numpy:kv1", 40, 1 << 30, 2)])
    (d,) = [d for d in (tmp_path / "kv").iterdir() if (d / "layout").exists()]
    assert len(_blocks(d)) == 80
    _ledgers_match_the_files(tmp_path / "kv")


@pytest.mark.parametrize("held", [True, False])
def test_a_live_store_holds_its_directory(tmp_path, held):
    s = _opened(tmp_path, salt=b"m:held:kv1")
    _write(s, 1)
    if not held:
        s.close()
    k = kvdir.KVDir(tmp_path, "x" * 8, b"m:other:kv1")
    k.open()
    try:
        with k.lock():
            (other,) = [o for o in k.usage().others if o.path == s.dir]
            assert k.idle(other) is not held
    finally:
        k.close()
        if held:
            s.close()


def test_a_lost_ledger_is_rebuilt_from_the_files(tmp_path):
    s = _opened(tmp_path)
    _write(s, 3)
    s.close()
    (s.dir / "usage").write_text("garbled")
    (s.dir / "ab").mkdir(exist_ok=True)
    (s.dir / "ab" / "README").write_text("a stray file is skipped, not counted")
    s = _opened(tmp_path)
    _write(s, 1, seed=9)
    s.close()
    assert int((s.dir / "usage").read_text()) == 4 * FILE == s.disk_bytes
