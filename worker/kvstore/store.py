"""KV blocks beyond the compute device: a bounded host-RAM tier and content-addressed files.

Full blocks leave the device as soon as they are complete (on CUDA a poisoned context can no
longer be read), in batches: the engine offers a step's blocks with the backend's BlockCopy, and
the writer thread waits for it, writes the files of the batch together (temp files, then the
renames and the ledger under one lock) and, for payloads it may keep (the numpy backend's), puts
them in the host tier; the CUDA backend's payloads are written straight from its pinned slabs.
Nothing here makes the engine wait: a writer that is behind (its backlog past the host budget)
takes no more for now (claim: LATER), and never a block whose parent it does not keep; the engine
offers a live sequence's blocks again, heads first, until the writer has room, and what it gives up
is counted in `write_drops`. The files are not fsynced one by one: a file a power loss truncates or
garbles fails its checksum and is
quarantined, and its block is computed again; a KV block is a cache. A restarted worker finds its
blocks by name: the path is derived from the chain hash, so lookups need no index. The index, built
by a background scan of headers only, orders this store's files for eviction; the scan then reads the
newest files whole, timed, so the first restore-or-recompute choice of a restarted worker goes by this
disk's measured rate. The host tier and the disk evict by the policy every tier shares (eviction.py):
blocks that two or more sequences took (the engine says so: touch) outlive those only one did, and a
chain's leaves go before its head. The block history (history.py) keeps those use counts across restarts,
with the fate of blocks the store lost or never got (dropped, evicted, unreadable), which the engine
reads to explain a miss. The directory itself, the disk budget shared with every other store on the
KV dir, and quarantine are kvdir's; writing the files themselves is files.py's.

Restores go the other way on the reader thread: each block file is read and checked straight into a
buffer of the backend's restore buffers (Backend.restore_buffers: pinned memory on CUDA), which the
engine thread hands to load_blocks as it is, so it only queues the copy to the device and never
copies a payload. The buffers are the bound on what restores hold: while every one is read and not
yet loaded, the reader waits (and wakes the engine to load what it read); a restore the engine drops
gives its unloaded buffers back.

Nothing on disk can hurt the worker: every read is checked (see blockfile), a bad file is moved
to quarantine, logged once, and treated as a miss, and an I/O error is a miss too, so the request
computes instead. Whatever stands at a block's path that is no block file (a directory, say) is
quarantined too. A write that fails (a full disk, a read-only one, a directory deleted under the
store) never stops the engine: its temp files go at once, persistence turns `degraded`
(persistence.py: logged, counted, shown in the health bodies, /v1/stats, /metrics and `ember
status`) and the writer retries with backoff, making the KV directory again when it is gone, until
a write succeeds. The writer, reader and scan threads are guarded (threads.py): one that dies is
reported, and what waited on it is released (restores come back empty, persistence turns off).
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ember.ops.contract import PersistState

from ..backends.base import HostBuffers, Landed, RestoreBuffers
from ..logs import log
from ..threads import ThreadWatch
from . import blockfile
from .eviction import SHARED_SHARE, TwoClassLRU, disk_order, is_shared
from .files import Block, BlockFiles, leftover
from .history import EVICTED, NOT_PERSISTED, UNREADABLE, BlockHistory
from .kvdir import KVDir, layout_key, remove_entry
from .persistence import Persistence

EVICT_SLACK = 256 << 20  # extra room an eviction makes (at most a fiftieth of the budget)
PROBE_BYTES = 16 << 20  # the newest block files a scan reads whole, timed: this disk's restore rate
ROOT = b"\0" * 16  # the parent of a chain's first block (engine.kv_blocks.ROOT_HASH)
TAKE, KNOWN, LATER = "take", "known", "later"  # claim()'s answers for a completed block
MAINTAIN_SECONDS = 1.0  # an idle writer looks after the directory this often (retries, a deleted dir)
ROOM_WAIT_SECONDS = 0.05  # how long the reader waits for a free restore buffer before it looks up again
HISTORY_SECONDS = 5.0  # the block history is written at most this often while it changes (and at close)


@dataclass
class _Batch:
    """Offered blocks whose payloads `copy` brings to the host; `handled` once the writer is done
    with them (written, put in the host tier, or dropped)."""

    entries: list[tuple[bytes, bytes, list[int]]]
    copy: Any
    handled: threading.Event = field(default_factory=threading.Event)


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
    """Blocks being read for one sequence, in chain order. `results[i]` becomes the payload, a buffer
    of the backend's restore buffers, or None (miss or bad file: the chain stops there); a job may
    also end short (a dead reader, or dropped by the engine)."""

    hashes: list[bytes]
    results: list[np.ndarray | None] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    tiers: list[str] = field(default_factory=list)  # where each block was when the restore was chosen
    wake: threading.Event = field(default_factory=threading.Event)  # done, or the reader waits for room
    dropped: bool = False  # the engine loads no more of it (KVStore.drop)

    def wait(self, timeout: float) -> None:
        """(engine thread) Return when the job is done, when the reader waits for buffers that only
        loading what it read will free, or after `timeout` seconds."""
        self.wake.wait(timeout)
        self.wake.clear()

    def finish(self) -> None:
        self.done.set()
        self.wake.set()


class KVStore:
    def __init__(
        self,
        root: Path,
        *,
        salt: bytes,
        model_key: str,
        block_shape: tuple[int, ...],
        block_tokens: int,
        block_dtype=np.float32,
        chain_hash: Callable[[bytes, list[int], bytes], bytes],
        persist: str = "all",
        disk_budget: int,
        host_budget: int,
        watch: ThreadWatch | None = None,
        disk_full: Callable[[], bool] | None = None,
        buffers: RestoreBuffers | None = None,
    ):
        self.kvdir = KVDir(Path(root), layout_key(model_key, salt), salt)
        self.root, self.dir, self.quarantine_dir = self.kvdir.root, self.kvdir.dir, self.kvdir.quarantine_dir
        self.salt, self.block_shape, self.block_tokens = salt, tuple(block_shape), block_tokens
        self.chain_hash = chain_hash
        self.persist = persist
        self.disk_budget, self.host_budget = disk_budget, host_budget
        self.block_dtype = np.dtype(block_dtype)
        self.block_bytes = int(np.prod(block_shape)) * self.block_dtype.itemsize
        # where restored payloads are read into: the backend's (Backend.restore_buffers), else plain arrays
        self.buffers = buffers if buffers is not None else HostBuffers(self.block_shape, self.block_dtype)
        self.stats = StoreStats()
        self.watch = watch if watch is not None else ThreadWatch()
        self.persistence = Persistence(str(self.dir), wanted=persist != "off")
        self.files = BlockFiles(self.kvdir, salt, self.block_bytes, self._quarantine, disk_full)
        self._lock = threading.Lock()  # in-process state; never held while taking the KV dir's lock
        # the host tier, in eviction order (eviction.py)
        self._host: TwoClassLRU[bytes, np.ndarray] = TwoClassLRU(int(host_budget // self.block_bytes * SHARED_SHARE))
        self.history = BlockHistory.load(self.dir)  # use counts and fates (history.py), under _lock
        self._history_saved = time.monotonic()
        self._index: dict[bytes, tuple[int, float]] = {}  # hash -> (file size, last used)
        self._busy: set[bytes] = set()  # being read or written: never evicted
        self._quarantined: set[bytes] = set()  # moved away while the scan may still index the old file
        self._landing: dict[bytes, _Batch] = {}  # offered, not yet handled by the writer
        self._writes: queue.Queue = queue.Queue()
        self._pending_write_bytes = 0
        self._reads: queue.Queue = queue.Queue()
        self._reading: RestoreJob | None = None
        self._reader_dead = self._writer_dead = False
        self._stop = threading.Event()
        self.scan_done = threading.Event()
        # (bytes, seconds) of the scan's timed reads of the newest files, read and checked as a
        # restore reads them: the disk tier's rate before this worker has restored anything
        self._disk_probe: tuple[int, float] | None = None
        if self.writable:
            try:
                self.kvdir.open()
            except OSError as e:
                self.persistence.failed(e)
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
        return self.files.path_for(h)

    def offer(self, h: bytes, parent: bytes, tokens: list[int], payload: np.ndarray) -> None:
        """One completed block whose payload is already on the host."""
        if self.accept([(h, parent)]):
            self.offer_batch([(h, parent, list(tokens))], Landed(payload[None]))

    def accept(self, blocks: list[tuple[bytes, bytes]]) -> list[bytes]:
        """claim() for a caller that will not offer again: the blocks not taken now, and not known
        already, are dropped (counted)."""
        status = self.claim(blocks)
        self.lose([h for (h, _), st in zip(blocks, status, strict=True) if st == LATER])
        return [h for (h, _), st in zip(blocks, status, strict=True) if st == TAKE]

    def claim(self, blocks: list[tuple[bytes, bytes]]) -> list[str]:
        """What to do with each of these completed blocks (hash, parent), in the order given (engine
        thread, never blocks): TAKE (copy it off the device and offer it: reserved until offer_batch),
        KNOWN (stored or on its way already) or LATER (the writer's backlog has no room now, or the
        block's parent is neither kept nor root: a chain is only restored from its root). A LATER block
        may be offered again (the engine does, for its live sequences, heads first) or given up (lose)."""
        with self._lock:
            if self._writer_dead:
                return [LATER] * len(blocks)
            room = max(0, (self.host_budget - self._pending_write_bytes) // self.block_bytes)
            take: set[bytes] = set()
            out = []
            for h, parent in blocks:
                if h in self._busy or h in self._host or (h in self._index and self.writable):
                    out.append(KNOWN)
                    continue
                if h in take:
                    out.append(TAKE)
                    continue
                linked = (parent == ROOT or parent in self._busy or parent in self._host or parent in self._index
                          or parent in take)
                if len(take) < room and linked:
                    take.add(h)
                    out.append(TAKE)
                else:
                    out.append(LATER)
            self._busy.update(take)
            self._pending_write_bytes += len(take) * self.block_bytes
            return out

    def write_room(self) -> int:
        """Blocks the writer's backlog has room for now."""
        with self._lock:
            if self._writer_dead:
                return 0
            return max(0, (self.host_budget - self._pending_write_bytes) // self.block_bytes)

    def lose(self, hashes: list[bytes]) -> None:
        """Blocks that will not be persisted (their sequence is gone before the writer had room): counted
        as dropped, and remembered as never persisted (history.py), which a later miss is explained by."""
        if not hashes:
            return
        with self._lock:
            self.stats.write_drops += len(hashes)
            for h in hashes:
                self.history.lose(h, NOT_PERSISTED)

    def offer_batch(self, entries: list[tuple[bytes, bytes, list[int]]], copy: Any) -> None:
        """Accepted blocks (hash, parent, token ids) whose payloads `copy` brings to the host, in
        order (a BlockCopy; None: the backend had no room, so they are dropped). Never blocks."""
        if not entries:
            return
        with self._lock:
            if copy is None or self._writer_dead:
                self.stats.write_drops += len(entries)
                for h, _, _ in entries:
                    self.history.lose(h, NOT_PERSISTED)
                self._busy.difference_update(h for h, _, _ in entries)
                self._pending_write_bytes -= len(entries) * self.block_bytes
                return
            batch = _Batch(entries, copy)
            for h, _, _ in entries:
                self._landing[h] = batch
            self._writes.put(batch)  # under the lock: see _writer_died

    def available(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the host tier or the disk can supply (an I/O error
        ends the count: those blocks are computed instead)."""
        return len(self.where(hashes))

    def where(self, hashes: list[bytes]) -> list[str]:
        """Where each of the leading `hashes` the store can supply is: "host" (RAM, or still landing
        from the device) or "disk"; the list ends at the first it cannot."""
        if self._reader_dead:
            return []
        out = []
        for h in hashes:
            with self._lock:
                tier = "host" if h in self._host or h in self._landing else "disk" if h in self._index else None
            if tier is None:
                path = self.path_for(h)
                try:
                    if not path.exists():
                        break
                except OSError as e:
                    log("kv_read_error", level="warning", file=str(path), error=str(e))
                    break
                tier = "disk"
            out.append(tier)
        return out

    def persisted(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are in this store's files: what a restart would find
        (a block still in RAM or on its way to disk is not, yet)."""
        n = 0
        for h in hashes:
            with self._lock:
                known = h in self._index
            if not known:
                try:
                    if not self.path_for(h).exists():
                        break
                except OSError:
                    break
            n += 1
        return n

    def restore(self, hashes: list[bytes]) -> RestoreJob:
        job = RestoreJob(list(hashes))
        with self._lock:
            if self._reader_dead:  # nothing would read it: an empty result, computed instead
                job.finish()
                return job
            self._busy.update(hashes)
            self._reads.put(job)
        return job

    def drop(self, job: RestoreJob, used: int) -> None:
        """(engine thread) The engine loads no more of `job` than its first `used` payloads (its
        sequence ended): the reader stops it, and the buffers of the payloads read and not loaded
        go back."""
        with self._lock:
            job.dropped = True
            unloaded = [p for p in job.results[used:] if p is not None]
        for payload in unloaded:
            self.buffers.give_back(payload)

    def touch(self, hashes: list[bytes], *, new_use: bool) -> None:
        """(engine thread) A chain of blocks was used just now, from its head: the blocks this store holds
        count as the most recently used, the deeper ones as a little older (a chain's leaves are evicted
        before its head), and with `new_use` as taken by one more sequence (eviction.py)."""
        now = time.time()
        with self._lock:
            for i, h in enumerate(hashes):
                held = self._index.get(h)
                if held is not None:
                    self._index[h] = (held[0], now - i * 1e-6)
                if new_use and (held is not None or h in self._host or h in self._busy):
                    self.history.used(h)
            for h in reversed(hashes):  # the host tier: the head last, the most recently used
                self._host.touch(h, is_shared(self.history.count(h)))

    def uses_of(self, hashes: list[bytes]) -> list[int]:
        """How many sequences took each block, as far as this store knows (1 when it knows of none more)."""
        with self._lock:
            return [self.history.count(h) for h in hashes]

    def lost(self, h: bytes) -> str | None:
        """What became of block `h`, which the store does not hold: not_persisted, evicted or unreadable
        (history.py), or None when it knows nothing of it."""
        with self._lock:
            return self.history.lost.get(h)

    def take_disk_probe(self) -> tuple[int, float] | None:
        """The scan's timed reads (bytes, seconds), once; None before the scan measured any."""
        with self._lock:
            probe, self._disk_probe = self._disk_probe, None
        return probe

    @property
    def writable(self) -> bool:
        """Blocks are being written to disk (persistence is neither degraded nor off)."""
        return self.persistence.writing

    @property
    def write_queue_depth(self) -> int:
        """Blocks offered and not yet handled by the writer (the persistence backlog)."""
        return self._pending_write_bytes // self.block_bytes

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
        self._save_history(force=True)
        self.kvdir.close()

    # -- threads ---------------------------------------------------------------------------------------------

    def _writer(self) -> None:
        watch = self.watch
        while True:
            try:
                item = self._writes.get(timeout=MAINTAIN_SECONDS)
            except queue.Empty:
                self._maintain()
                self._save_history()
                continue
            try:
                if item is None:
                    return
                entries, copy = item.entries, item.copy
                try:
                    if watch.doomed:
                        watch.checkpoint()
                    payloads = copy.wait()
                    if payloads is not None and copy.owned:  # views of device slabs stay out of RAM
                        self._land(entries, payloads)
                    if payloads is not None:
                        self._persist([(h, parent, tokens, payloads[row])
                                       for row, (h, parent, tokens) in enumerate(entries)
                                       if h not in self._index])
                finally:
                    copy.release()
                    self._settle_entries(entries)
                    item.handled.set()
                self._save_history()
            finally:
                self._writes.task_done()

    def _land(self, entries: list, payloads: list[np.ndarray] | np.ndarray) -> None:
        """The batch is on the host: into the host tier, within the host budget (eviction.py: a chain's
        head the most recently used of its batch, shared blocks kept ahead of the rest)."""
        with self._lock:
            for row in reversed(range(len(entries))):
                h = entries[row][0]
                self._host.put(h, payloads[row], is_shared(self.history.count(h)))
            while len(self._host) * self.block_bytes > self.host_budget and len(self._host):
                self._host.evict()

    def _settle_entries(self, entries: list) -> None:
        with self._lock:
            for h, _, _ in entries:
                self._landing.pop(h, None)
                self._busy.discard(h)
            self._pending_write_bytes -= len(entries) * self.block_bytes

    def _writer_died(self, e: BaseException) -> None:
        """Nothing will be written any more: stop queueing, and release what was queued."""
        with self._lock:
            self._writer_dead = True
        self.persistence.off("the KV writer thread died")
        while True:
            try:
                item = self._writes.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.copy.release()
                self._settle_entries(item.entries)
                item.handled.set()
            self._writes.task_done()

    # -- persisting, and riding out what the disk does ----------------------------------------------------

    def _persist(self, blocks: list[Block]) -> None:
        """Write a batch's files, or count them as not persisted: while degraded, only when a retry is
        due (and a success then ends the episode). A KV directory deleted under the store is made
        again and the batch tried once more."""
        p = self.persistence
        if not blocks or p.state is PersistState.OFF:
            return
        if p.state is PersistState.DEGRADED and not p.due():
            p.skipped(len(blocks))
            self._not_persisted(blocks)
            return
        try:
            try:
                self._ensure_dir()
                doomed = self.files.write_batch(blocks, self._written)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR) or self.dir.is_dir():
                    raise
                self._ensure_dir()  # deleted while the batch was written: once more
                doomed = self.files.write_batch(blocks, self._written)
        except OSError as e:
            p.failed(e, len(blocks))
            self._not_persisted(blocks)
            return
        _remove_dirs(doomed)
        p.recovered()

    def _not_persisted(self, blocks: list[Block]) -> None:
        with self._lock:
            for h, *_ in blocks:
                self.history.lose(h, NOT_PERSISTED)

    def _save_history(self, force: bool = False) -> None:
        """(writer thread, or close) The block history to disk when it changed, at most every
        HISTORY_SECONDS. A failure is not worth a line: it only sharpens eviction and explanations."""
        now = time.monotonic()
        if not self.writable or (not force and now - self._history_saved < HISTORY_SECONDS):
            return
        with self._lock:
            if not self.history.dirty:
                return
            data = self.history.encode()
            self.history.dirty = False
        self._history_saved = now
        with contextlib.suppress(OSError):
            BlockHistory.write(self.dir, data)

    def _written(self, files: list[tuple[bytes, int]]) -> list[Path]:
        """(KV dir locked) A batch's files are in place: index them, then fit the budget."""
        now = time.time()
        with self._lock:
            for h, size in files:
                self._index[h] = (size, now)
                self._quarantined.discard(h)
                self.history.found(h)
                self.stats.writes += 1
                self.stats.write_bytes += size
        return self._fit_budget(written=files[-1][0])

    def _ensure_dir(self) -> None:
        if self.files.ensure_dir():
            with self._lock:
                self._index.clear()  # its files went with the directory

    def _maintain(self) -> None:
        """(writer thread, when idle) A degraded store's retry when due, without waiting for traffic:
        make the directory if it is gone and write one block's worth of bytes; a persisting store
        checks that its directory is still there (an `rm -rf` while serving), every MAINTAIN_SECONDS."""
        p = self.persistence
        if p.state is PersistState.OFF:
            return
        if p.state is PersistState.DEGRADED and not p.due():
            return
        try:
            self._ensure_dir()
            if p.state is PersistState.DEGRADED:
                self.files.probe_room()
        except OSError as e:
            p.failed(e)
            return
        p.recovered()

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
                payload = None if job.dropped else self._read_one(h, job)
                with self._lock:
                    self._busy.discard(h)
                    if job.dropped:  # its sequence is gone: nothing more is read, what was read went back
                        if payload is not None:
                            self.buffers.give_back(payload)
                        self._busy.difference_update(job.hashes[i + 1 :])
                        break
                    job.results.append(payload)
                    if payload is not None:
                        self.stats.restore_hits += 1
                        self.stats.restore_bytes += self.block_bytes
                        self.history.used(h)  # a restore is one more sequence taking it (eviction.py)
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
            job.finish()

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
            job.finish()

    def _read_one(self, h: bytes, job: RestoreJob) -> np.ndarray | None:
        """Block `h` in a restore buffer: from the host tier, else its file (None: a miss, a bad
        file, or the job dropped while the reader waited for a buffer)."""
        with self._lock:
            payload = self._host.get(h)
            landing = self._landing.get(h)
        if payload is None and landing is not None:  # offered moments ago: read it once the writer is done
            landing.handled.wait()
            with self._lock:
                payload = self._host.get(h)
        buf = self._take_buffer(job)
        if buf is None:
            return None
        if payload is not None:
            buf[...] = payload
            return buf
        if self._read_file(h, buf):
            return buf
        self.buffers.give_back(buf)
        return None

    def _take_buffer(self, job: RestoreJob) -> np.ndarray | None:
        """A restore buffer, waiting while every one is held (the reader's backpressure); None when
        the job is dropped or the store stops meanwhile."""
        buf = self.buffers.take(0)
        while buf is None:
            job.wake.set()  # at once: the engine loads what was read, which frees buffers
            if job.dropped or self._stop.is_set():
                return None
            buf = self.buffers.take(ROOM_WAIT_SECONDS)
        return buf

    def _read_file(self, h: bytes, out: np.ndarray) -> bool:
        """Block `h`'s file read into `out` and fully checked (False: a missing, unreadable or bad file)."""
        path = self.path_for(h)
        try:
            with open(path, "rb", buffering=0) as f:
                blockfile.read_into(f, out, salt=self.salt, expect_hash=h, chain_hash=self.chain_hash)
        except FileNotFoundError:
            return False
        except blockfile.BadBlockFile as e:
            self._quarantine(path, str(e))
            return False
        except OSError as e:
            log("kv_read_error", level="warning", file=str(path), error=str(e))
            return False
        return True

    def _probe(self) -> None:
        """Time reading the newest files (up to PROBE_BYTES) as a restore reads them: the rate a
        restarted worker's first warm admits are decided by, measured on this disk (and through
        its page cache, as the restores will be) instead of assumed."""
        with self._lock:  # copied under the lock, sorted outside it: the engine thread takes this lock
            items = list(self._index.items())
        newest = sorted(items, key=lambda kv: kv[1][1], reverse=True)
        picked, total = [], 0
        for h, (size, _) in newest:
            if total >= PROBE_BYTES or self._stop.is_set():
                break
            picked.append((h, size))
            total += size
        if not picked:
            return
        scratch = np.empty(self.block_shape, self.block_dtype)  # read as a restore reads, into memory of its own
        t0 = time.monotonic()
        got = sum(size for h, size in picked if self._read_file(h, scratch))
        seconds = time.monotonic() - t0
        if got and seconds > 0:
            with self._lock:
                self._disk_probe = (got, seconds)
            log("kv_disk_probe", files=len(picked), bytes=got, seconds=round(seconds, 4),
                bytes_per_s=round(got / seconds))

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
                    self.persistence.failed(e)
            files = list(self.dir.glob("??/*.kv")) if self.dir.exists() else []
            for tmp in self.dir.glob("??/.*.tmp") if self.writable and self.dir.exists() else []:
                if leftover(tmp):
                    with contextlib.suppress(OSError):
                        tmp.unlink(missing_ok=True)
            head_len = blockfile.HEADER_SIZE + 4 * self.block_tokens
            for path in files:
                if self._stop.is_set():
                    return
                found = self._scan_header(path, head_len)
                if found is None:
                    continue
                header, st = found
                with self._lock:
                    if header.block_hash not in self._quarantined and header.block_hash not in self._index:
                        self._index[header.block_hash] = (st.st_size, st.st_mtime)
            if self.writable:
                try:
                    with self.kvdir.lock():
                        doomed = self._fit_budget()
                    _remove_dirs(doomed)
                except OSError as e:
                    self.persistence.failed(e)
            self._probe()
        finally:
            self.scan_done.set()

    def _scan_header(self, path: Path, head_len: int) -> tuple[blockfile.BlockHeader, os.stat_result] | None:
        """A block file's header and stat, checked against its name and size; None for one that is gone or
        unreadable, and for a bad one, quarantined."""
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                raise blockfile.BadBlockFile("not a regular file, at a block's path")
            with open(path, "rb") as f:
                head = f.read(head_len)
            header, _ = blockfile.read_header(head, salt=self.salt)
            if header.file_size != st.st_size:
                raise blockfile.BadBlockFile(f"size {st.st_size}, header says {header.file_size}")
            if header.block_hash.hex() + ".kv" != path.name:
                raise blockfile.BadBlockFile("file name does not match the block hash")
        except blockfile.BadBlockFile as e:
            self._quarantine(path, str(e))
            return None
        except OSError:
            return None
        return header, st

    # -- budget, quarantine, degradation -------------------------------------------------------------------

    def _fit_budget(self, written: bytes | None = None) -> list[Path]:
        """(KV dir locked) Bring everything under the KV dir within the disk budget: quarantine
        first, oldest first; then this store's files in eviction.py's order (ordinary blocks least
        recently used first, then shared ones; the block just `written` last of all) and whole
        directories no live store holds, least recently used first. Returns directories to delete
        once the lock is released."""
        u = self.kvdir.usage()
        over = u.total - self.disk_budget
        if over <= 0:  # the common case, after every batch: nothing to sort
            return []
        quarantine = [(size, path) for _, size, path in u.quarantine]
        with self._lock:  # copied under the lock, sorted outside it: the engine thread takes this lock
            items = list(self._index.items())
            busy = set(self._busy)
            uses = dict(self.history.uses)
        last = [(used, size, h) for h, (size, used) in items if h == written]
        own = disk_order(((used, size, h) for h, (size, used) in items if h not in busy and h != written), uses,
                         int(self.disk_budget * SHARED_SHARE)) + last
        others = sorted(u.others, key=lambda o: o.used)
        doomed: list[Path] = []
        evicted: list[bytes] = []
        freed = removed = i = j = 0
        while over > 0 and quarantine:
            size, path = quarantine.pop(0)
            if remove_entry(path):
                over -= size
        # past quarantine, a little more room than needed (budgets of a GiB or more): a store at its budget
        # then evicts once per many batches rather than sorting its whole index after each
        slack = min(self.disk_budget // 50, EVICT_SLACK) if over > 0 and self.disk_budget >= 1 << 30 else 0
        over += slack
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
        self._forget_evicted(evicted, removed)
        if freed:
            self.kvdir.add(-freed)
        self.kvdir.total_bytes = self.disk_budget + over - slack
        return doomed

    def _forget_evicted(self, evicted: list[bytes], removed: int) -> None:
        """Blocks whose files the budget took: out of the index, and where no tier of this store holds
        them any more, their fate in the block history (a miss may name it) and their use count gone."""
        with self._lock:
            for h in evicted:
                self._index.pop(h, None)
                if h not in self._host:
                    self.history.lose(h, EVICTED)
                    self.history.forget_uses(h)
            self.stats.evictions += removed

    def _quarantine(self, path: Path, why: str, locked: bool = False) -> None:
        """Move a bad entry (a file that failed a check, or whatever stands at a block's path) to
        quarantine, and forget its block. `locked`: the caller holds the KV dir's lock."""
        h = None
        with contextlib.suppress(ValueError):
            h = bytes.fromhex(path.stem)
        with self._lock:
            # the reader and the scan's timed reads can both find one bad file: it is counted and said once
            again = h is not None and h in self._quarantined
            if not again:
                self.stats.quarantined += 1
            if h is not None:
                self._index.pop(h, None)
                self._quarantined.add(h)
                self.history.lose(h, UNREADABLE)
        if not again:
            log("kv_quarantined", level="warning", file=path.name, reason=why)
        if not self.writable:  # a store that does not persist changes nothing on disk
            return
        in_dir = path.parent.parent == self.dir and path.suffix == ".kv"
        if locked:
            self.kvdir.quarantine(path, in_dir=in_dir)
            return
        try:
            with self.kvdir.lock():
                self.kvdir.quarantine(path, in_dir=in_dir)
        except OSError as e:
            self.persistence.failed(e)


def _remove_dirs(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
