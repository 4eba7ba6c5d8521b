"""KV blocks beyond the compute device: a bounded host-RAM tier and content-addressed files.

Full blocks reach the host tier as soon as they are complete (on CUDA a poisoned context can no
longer be read, so this is where they must already be), and a background writer persists them
atomically (temp file, fsync, rename). A restarted worker finds its blocks by name: the path is
derived from the chain hash, so lookups need no index. The index, built by a background scan of
headers only, orders this store's files for eviction (LRU, leaves of a chain first). The
directory itself, the disk budget shared with every other store on the KV dir, and quarantine
are kvdir's.

Nothing on disk can hurt the worker: every read is checked (see blockfile), a bad file is moved
to quarantine, logged once, and treated as a miss, and an I/O error is a miss too, so the request
computes instead. The writer, reader and scan threads are guarded (threads.py): one that dies is
reported, and what waited on it is released (restores come back empty, persistence turns off).
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..logs import log
from . import blockfile
from .kvdir import KVDir, layout_key
from ..threads import ThreadWatch


@dataclass
class StoreStats:
    writes: int = 0
    write_bytes: int = 0
    write_drops: int = 0
    restore_hits: int = 0
    restore_misses: int = 0
    quarantined: int = 0
    evictions: int = 0
    dir_evictions: int = 0
    restore_seconds: float = 0.0
    restore_bytes: int = 0


@dataclass
class RestoreJob:
    """Blocks being read for one sequence, in chain order. `results[i]` becomes the payload or
    None (miss or bad file: the chain stops there); a job may also end short (a dead reader)."""

    hashes: list[bytes]
    results: list[np.ndarray | None] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)


class KVStore:
    def __init__(
        self,
        root: Path,
        *,
        salt: bytes,
        model_key: str,
        block_shape: tuple[int, ...],
        block_tokens: int,
        chain_hash: Callable[[bytes, list[int], bytes], bytes],
        persist: str = "all",
        disk_budget: int,
        host_budget: int,
        watch: ThreadWatch | None = None,
    ):
        self.kvdir = KVDir(Path(root), layout_key(model_key, salt), salt)
        self.root, self.dir, self.quarantine_dir = self.kvdir.root, self.kvdir.dir, self.kvdir.quarantine_dir
        self.salt, self.block_shape, self.block_tokens = salt, tuple(block_shape), block_tokens
        self.chain_hash = chain_hash
        self.persist = persist
        self.disk_budget, self.host_budget = disk_budget, host_budget
        self.block_bytes = int(np.prod(block_shape)) * 4
        self.stats = StoreStats()
        self.watch = watch if watch is not None else ThreadWatch()
        self.writable = persist != "off"
        self._lock = threading.Lock()  # in-process state; never held while taking the KV dir's lock
        self._host: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._index: dict[bytes, tuple[int, float]] = {}  # hash -> (file size, last used)
        self._busy: set[bytes] = set()  # being read or written: never evicted
        self._writes: queue.Queue = queue.Queue()
        self._pending_write_bytes = 0
        self._reads: queue.Queue = queue.Queue()
        self._reading: RestoreJob | None = None
        self._reader_dead = self._writer_dead = False
        self._stop = threading.Event()
        self.scan_done = threading.Event()
        if self.writable:
            try:
                self.kvdir.open()
            except OSError as e:
                self._degrade(e)
        stopping = self._stop.is_set
        self._threads = [
            self.watch.thread("ember-kv-writer", self._writer, on_death=self._writer_died, stopping=stopping),
            self.watch.thread("ember-kv-reader", self._reader, on_death=self._reader_died, stopping=stopping),
            self.watch.thread("ember-kv-scan", self._scan, stopping=stopping),
        ]
        for t in self._threads:
            t.start()

    # -- engine side -----------------------------------------------------------------------------------

    def path_for(self, h: bytes) -> Path:
        x = h.hex()
        return self.dir / x[:2] / f"{x}.kv"

    def offer(self, h: bytes, parent: bytes, tokens: list[int], payload: np.ndarray) -> None:
        """A completed block (payload already copied off the device). Never blocks."""
        with self._lock:
            self._host[h] = payload
            self._host.move_to_end(h)
            while len(self._host) * self.block_bytes > self.host_budget and self._host:
                self._host.popitem(last=False)
            if not self.writable or h in self._index or h in self._busy:
                return
            if self._pending_write_bytes + self.block_bytes > self.host_budget:
                self.stats.write_drops += 1  # the disk is behind: skip rather than stall the engine
                return
            self._busy.add(h)
            self._pending_write_bytes += self.block_bytes
            self._writes.put((h, parent, list(tokens), payload))  # under the lock: see _writer_died

    def available(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the host tier or the disk can supply (an I/O error
        ends the count: those blocks are computed instead)."""
        if self._reader_dead:
            return 0
        n = 0
        for h in hashes:
            with self._lock:
                hit = h in self._host or h in self._index
            if not hit:
                path = self.path_for(h)
                try:
                    if not path.exists():
                        break
                except OSError as e:
                    log("kv_read_error", level="warning", file=str(path), error=str(e))
                    break
            n += 1
        return n

    def restore(self, hashes: list[bytes]) -> RestoreJob:
        job = RestoreJob(list(hashes))
        with self._lock:
            if self._reader_dead:  # nothing would read it: an empty result, computed instead
                job.done.set()
                return job
            self._busy.update(hashes)
            self._reads.put(job)
        return job

    @property
    def write_queue_depth(self) -> int:
        return self._writes.qsize()

    @property
    def disk_bytes(self) -> int:
        """This layout's block files (every store on its directory), as last seen."""
        return self.kvdir.dir_bytes

    @property
    def dir_bytes(self) -> int:
        """Everything counted against the disk budget (every layout and quarantine), as last seen."""
        return self.kvdir.total_bytes

    @property
    def disk_blocks(self) -> int:
        return len(self._index)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are on disk (used at clean shutdown and in tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._writes.unfinished_tasks == 0:
                return True
            if self._writer_dead:
                return False
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Flush pending writes and stop the threads; once it returns the store touches no file (a
        scan still running could otherwise quarantine a file another store is writing)."""
        self.flush(timeout)
        self._stop.set()
        self._writes.put(None)
        self._reads.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        self.kvdir.close()

    # -- threads ---------------------------------------------------------------------------------------------

    def _writer(self) -> None:
        watch = self.watch
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                h, parent, tokens, payload = item
                try:
                    if watch.doomed:
                        watch.checkpoint()
                    if self.writable:
                        self._write(h, parent, tokens, payload)
                finally:
                    with self._lock:
                        self._busy.discard(h)
                        self._pending_write_bytes -= self.block_bytes
            finally:
                self._writes.task_done()

    def _writer_died(self, e: BaseException) -> None:
        """Nothing will be written any more: stop queueing, and release what was queued."""
        with self._lock:
            was, self.writable, self._writer_dead = self.writable, False, True
        if was:
            log("kv_persistence_off", level="warning", dir=str(self.dir), reason="the KV writer thread died")
        while True:
            try:
                item = self._writes.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with self._lock:
                    self._busy.discard(item[0])
                    self._pending_write_bytes -= self.block_bytes
            self._writes.task_done()

    def _write(self, h: bytes, parent: bytes, tokens: list[int], payload: np.ndarray) -> None:
        data = blockfile.encode(h, parent, self.salt, tokens, payload)
        path = self.path_for(h)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            with self.kvdir.lock():  # the rename and the ledger change together, for every process
                existed = path.exists()
                os.replace(tmp, path)
                if not existed:
                    self.kvdir.add(len(data))
                with self._lock:
                    self._index[h] = (len(data), time.time())
                    self.stats.writes += 1
                    self.stats.write_bytes += len(data)
                doomed = self._fit_budget(written=h)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._degrade(e)
            return
        _remove_dirs(doomed)

    def _reader(self) -> None:
        watch = self.watch
        while True:
            job = self._reads.get()
            if job is None:
                return
            self._reading = job
            if watch.doomed:
                watch.checkpoint()
            t0 = time.monotonic()
            now = time.time()
            for i, h in enumerate(job.hashes):
                payload = self._read_one(h)
                job.results.append(payload)
                with self._lock:
                    self._busy.discard(h)
                    if payload is not None:
                        self.stats.restore_hits += 1
                        self.stats.restore_bytes += self.block_bytes
                        if h in self._index:  # deeper blocks look older: leaves are evicted first
                            self._index[h] = (self._index[h][0], now - i * 1e-6)
                    else:
                        self.stats.restore_misses += 1
                if payload is None:
                    with self._lock:
                        self._busy.difference_update(job.hashes[i + 1 :])
                    break
            self.stats.restore_seconds += time.monotonic() - t0
            if self.writable and job.results and job.results[0] is not None:
                self.kvdir.touch()
            self._reading = None
            job.done.set()

    def _reader_died(self, e: BaseException) -> None:
        """Nothing will be read any more: every job ends now with what it has (the rest computes)."""
        with self._lock:
            self._reader_dead = True
            jobs = [self._reading] if self._reading is not None else []
            while True:
                try:
                    job = self._reads.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs.append(job)
            for job in jobs:
                self._busy.difference_update(job.hashes)
        for job in jobs:
            job.done.set()

    def _read_one(self, h: bytes) -> np.ndarray | None:
        with self._lock:
            payload = self._host.get(h)
        if payload is not None:
            return payload
        path = self.path_for(h)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log("kv_read_error", level="warning", file=str(path), error=str(e))
            return None
        try:
            return blockfile.decode(data, salt=self.salt, expect_hash=h, shape=self.block_shape,
                                    chain_hash=self.chain_hash)
        except blockfile.BadBlockFile as e:
            self._quarantine(path, str(e))
            return None

    def _scan(self) -> None:
        """Index the directory from headers only; quarantine what fails; then fit the budget."""
        try:
            if self.watch.doomed:
                self.watch.checkpoint()
            if self.writable:
                self.kvdir.remove_evicted_leftovers()
                try:
                    with self.kvdir.lock():
                        self.kvdir.reconcile()
                except OSError as e:
                    self._degrade(e)
            files = list(self.dir.glob("??/*.kv")) if self.dir.exists() else []
            for tmp in self.dir.glob("??/.*.tmp") if self.writable and self.dir.exists() else []:
                try:
                    if time.time() - tmp.stat().st_mtime > 60:  # a crashed writer's leftover
                        tmp.unlink(missing_ok=True)
                except OSError:
                    pass
            head_len = blockfile.HEADER_SIZE + 4 * self.block_tokens
            for path in files:
                if self._stop.is_set():
                    return
                try:
                    st = path.stat()
                    with open(path, "rb") as f:
                        head = f.read(head_len)
                    header, _ = blockfile.read_header(head, salt=self.salt)
                    if header.file_size != st.st_size:
                        raise blockfile.BadBlockFile(f"size {st.st_size}, header says {header.file_size}")
                    if header.block_hash.hex() + ".kv" != path.name:
                        raise blockfile.BadBlockFile("file name does not match the block hash")
                except blockfile.BadBlockFile as e:
                    self._quarantine(path, str(e))
                    continue
                except OSError:
                    continue
                with self._lock:
                    self._index[header.block_hash] = (st.st_size, st.st_mtime)
            if self.writable:
                try:
                    with self.kvdir.lock():
                        doomed = self._fit_budget()
                    _remove_dirs(doomed)
                except OSError as e:
                    self._degrade(e)
        finally:
            self.scan_done.set()

    # -- budget, quarantine, degradation -------------------------------------------------------------------

    def _fit_budget(self, written: bytes | None = None) -> list[Path]:
        """(KV dir locked) Bring everything under the KV dir within the disk budget: quarantine
        first, oldest first; then least recently used first among this store's files (the block just
        `written` last of all) and whole directories no live store holds. Returns directories to
        delete once the lock is released."""
        u = self.kvdir.usage()
        over = u.total - self.disk_budget
        quarantine = [(size, path) for _, size, path in u.quarantine]
        with self._lock:
            own = sorted((used, size, h) for h, (size, used) in self._index.items()
                         if h not in self._busy or h == written)
        others = sorted(u.others, key=lambda o: o.used)
        doomed: list[Path] = []
        evicted: list[bytes] = []
        freed = removed = i = j = 0
        while over > 0 and quarantine:
            size, path = quarantine.pop(0)
            try:
                path.unlink()
                over -= size
            except FileNotFoundError:
                pass
        while over > 0 and (i < len(own) or j < len(others)):
            if j < len(others) and (i >= len(own) or others[j].used < own[i][0]):
                o = others[j]
                j += 1
                gone = self.kvdir.evict_dir(o) if self.kvdir.idle(o) else None
                if gone is not None:
                    doomed.append(gone)
                    over -= o.bytes
                    self.stats.dir_evictions += 1
                    log("kv_dir_evicted", dir=o.path.name, bytes=o.bytes, legacy=o.legacy)
                continue
            _, size, h = own[i]
            i += 1
            evicted.append(h)
            try:
                self.path_for(h).unlink()
                freed, removed, over = freed + size, removed + 1, over - size
            except FileNotFoundError:  # another store of this directory evicted it already
                pass
        if evicted:
            with self._lock:
                for h in evicted:
                    self._index.pop(h, None)
                self.stats.evictions += removed
        if freed:
            self.kvdir.add(-freed)
        self.kvdir.total_bytes = self.disk_budget + over
        return doomed

    def _quarantine(self, path: Path, why: str) -> None:
        h = None
        try:
            h = bytes.fromhex(path.stem)
        except ValueError:
            pass
        with self._lock:
            self.stats.quarantined += 1
            if h is not None:
                self._index.pop(h, None)
        log("kv_quarantined", level="warning", file=path.name, reason=why)
        if not self.writable:  # a store that does not persist changes nothing on disk
            return
        try:
            with self.kvdir.lock():
                self.kvdir.quarantine(path, in_dir=path.parent.parent == self.dir)
        except OSError as e:
            self._degrade(e)

    def _degrade(self, e: OSError) -> None:
        if not self.writable:
            return
        self.writable = False
        reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                  errno.EACCES: "permission denied"}.get(e.errno, str(e))
        log("kv_persistence_off", level="warning", dir=str(self.dir), reason=reason)


def _remove_dirs(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
