"""KV blocks beyond the compute device: a bounded host-RAM tier and content-addressed files.

Full blocks reach the host tier as soon as they are complete (on CUDA a poisoned context can no
longer be read, so this is where they must already be), and a background writer persists them
atomically (temp file, fsync, rename). A restarted worker finds its blocks by name: the path is
derived from the chain hash, so lookups need no index. The index, built by a background scan of
headers only, serves the disk budget (LRU eviction, leaves of a chain first) and quarantine.

Nothing on disk can hurt the worker: every read is checked (see blockfile), and a bad file is
moved to quarantine, logged once, and treated as a miss, so the request computes instead.
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

QUARANTINE_MAX_FILES = 64


@dataclass
class StoreStats:
    writes: int = 0
    write_bytes: int = 0
    write_drops: int = 0
    restore_hits: int = 0
    restore_misses: int = 0
    quarantined: int = 0
    evictions: int = 0
    restore_seconds: float = 0.0
    restore_bytes: int = 0


@dataclass
class RestoreJob:
    """Blocks being read for one sequence, in chain order. `results[i]` becomes the payload or
    None (miss or bad file: the chain stops there)."""

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
    ):
        self.root = Path(root)
        self.dir = self.root / model_key
        self.quarantine_dir = self.root / "quarantine"
        self.salt, self.block_shape, self.block_tokens = salt, tuple(block_shape), block_tokens
        self.chain_hash = chain_hash
        self.persist = persist
        self.disk_budget, self.host_budget = disk_budget, host_budget
        self.block_bytes = int(np.prod(block_shape)) * 4
        self.stats = StoreStats()
        self.writable = persist != "off"
        self._lock = threading.Lock()
        self._host: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._index: dict[bytes, tuple[int, float]] = {}  # hash -> (file size, last used)
        self._disk_bytes = 0
        self._busy: set[bytes] = set()  # being read or written: never evicted
        self._writes: queue.Queue = queue.Queue()
        self._pending_write_bytes = 0
        self._reads: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.scan_done = threading.Event()
        if self.writable:
            try:
                self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self.root, 0o700)
            except OSError as e:
                self._degrade(e)
        self._threads = [
            threading.Thread(target=self._writer, name="ember-kv-writer", daemon=True),
            threading.Thread(target=self._reader, name="ember-kv-reader", daemon=True),
            threading.Thread(target=self._scan, name="ember-kv-scan", daemon=True),
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
        self._writes.put((h, parent, list(tokens), payload))

    def available(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the host tier or the disk can supply."""
        n = 0
        for h in hashes:
            with self._lock:
                hit = h in self._host or h in self._index
            if not hit and not self.path_for(h).exists():
                break
            n += 1
        return n

    def restore(self, hashes: list[bytes]) -> RestoreJob:
        job = RestoreJob(list(hashes))
        with self._lock:
            self._busy.update(hashes)
        self._reads.put(job)
        return job

    @property
    def write_queue_depth(self) -> int:
        return self._writes.qsize()

    @property
    def disk_bytes(self) -> int:
        return self._disk_bytes

    @property
    def disk_blocks(self) -> int:
        return len(self._index)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are on disk (used at clean shutdown and in tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._writes.unfinished_tasks == 0:
                return True
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

    # -- threads ---------------------------------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                h, parent, tokens, payload = item
                try:
                    if self.writable:
                        self._write(h, parent, tokens, payload)
                finally:
                    with self._lock:
                        self._busy.discard(h)
                        self._pending_write_bytes -= self.block_bytes
            finally:
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
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._degrade(e)
            return
        now = time.time()
        with self._lock:
            if h not in self._index:
                self._disk_bytes += len(data)
            self._index[h] = (len(data), now)
            self.stats.writes += 1
            self.stats.write_bytes += len(data)
        self._enforce_budget()

    def _reader(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
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
            files = list(self.dir.glob("??/*.kv")) if self.dir.exists() else []
            for tmp in self.dir.glob("??/.*.tmp") if self.dir.exists() else []:
                if time.time() - tmp.stat().st_mtime > 60:  # a crashed writer's leftover
                    tmp.unlink(missing_ok=True)
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
                    if header.block_hash not in self._index:
                        self._disk_bytes += st.st_size
                    self._index[header.block_hash] = (st.st_size, st.st_mtime)
            self._enforce_budget()
        finally:
            self.scan_done.set()

    # -- budget, quarantine, degradation -------------------------------------------------------------------

    def _enforce_budget(self) -> None:
        with self._lock:
            if self._disk_bytes <= self.disk_budget:
                return
            victims = sorted((used, h) for h, (size, used) in self._index.items() if h not in self._busy)
            chosen = []
            total = self._disk_bytes
            for _, h in victims:
                if total <= self.disk_budget:
                    break
                size, _ = self._index.pop(h)
                total -= size
                chosen.append(h)
            self._disk_bytes = total
            self.stats.evictions += len(chosen)
        for h in chosen:
            try:
                self.path_for(h).unlink(missing_ok=True)
            except OSError:
                pass

    def _quarantine(self, path: Path, why: str) -> None:
        with self._lock:
            self.stats.quarantined += 1
            h = None
            try:
                h = bytes.fromhex(path.stem)
            except ValueError:
                pass
            if h is not None and h in self._index:
                self._disk_bytes -= self._index.pop(h)[0]
        log("kv_quarantined", level="warning", file=path.name, reason=why)
        try:
            self.quarantine_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.move(str(path), self.quarantine_dir / f"{int(time.time() * 1000)}-{path.name}")
            kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in kept[:-QUARANTINE_MAX_FILES]:
                old.unlink(missing_ok=True)
        except OSError:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def _degrade(self, e: OSError) -> None:
        if not self.writable:
            return
        self.writable = False
        reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                  errno.EACCES: "permission denied"}.get(e.errno, str(e))
        log("kv_persistence_off", level="warning", dir=str(self.dir), reason=reason)
