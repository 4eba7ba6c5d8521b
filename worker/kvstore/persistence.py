"""Whether a KV store's blocks reach the disk: persisting, degraded (writes fail; the engine serves on,
the writer retries with backoff) or off. One setter logs every change as the contract's `kv_persistence`
event, which the daemon reads; snapshot() is what the health bodies, /v1/stats and /metrics show.

    persisting -> degraded    a write failed (the disk is full, read-only, the directory unusable...)
    degraded   -> degraded    another failure with another reason (the same reason waits longer, unlogged)
    degraded   -> persisting  a retry wrote its file: the disk has room again
    any        -> off         the writer thread died (nothing will write again in this worker)

Retries wait RETRY_BASE seconds, doubling to RETRY_MAX; blocks offered meanwhile are not written and
are counted (`not_persisted`: this episode's, and the counter for /metrics). A full disk is named as
such: ENOSPC and EDQUOT, and a short write, which a full disk is what cuts short. Nothing here touches
a file: the store (store.py) reports what happened and asks when to try again.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

from ember.ops.contract import Event, PersistState, iso_utc

from ..logs import log

RETRY_BASE = 1.0  # seconds before the first retry of a degraded store...
RETRY_MAX = 30.0  # ...doubling up to this: a disk that frees up is used again within half a minute

_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "the KV directory is gone",
    errno.ENOTDIR: "something that is not a directory stands in the KV directory's path",
    errno.EEXIST: "something that is not a directory stands where the KV directory belongs",
    errno.EIO: "an I/O error",
}
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def describe(e: OSError) -> tuple[str, str | None]:
    """(reason, errno name) of a failed write, in one line; a full disk is named as such."""
    name = errno.errorcode.get(e.errno) if e.errno is not None else None
    reason = _REASONS.get(e.errno or 0) or (e.strerror or str(e))
    if e.errno in DISK_FULL:
        reason = f"disk full: {reason}"
    return f"{reason} ({name})" if name else reason, name


class Persistence:
    def __init__(self, directory: str, wanted: bool):
        self.directory = directory
        self.state = PersistState.PERSISTING if wanted else PersistState.OFF
        self.reason: str | None = None if wanted else "kv_persist is off"
        self.errno: str | None = None
        self.since = time.time()
        self.not_persisted = 0  # blocks not written since the store degraded (this episode)
        self.not_persisted_total = 0  # ...and in this worker's life (ember_kv_not_persisted_total)
        self.level = 0
        self.retry_m = 0.0  # monotonic time of the next try, while degraded
        self._lock = threading.Lock()

    # -- what happened ------------------------------------------------------------------------------------

    def failed(self, e: OSError, blocks: int = 0) -> None:
        """A write (or the retry's probe) failed: -> DEGRADED, the next try after the backoff."""
        reason, name = describe(e)
        with self._lock:
            if self.state is PersistState.OFF:
                return
            delay = min(RETRY_BASE * 2 ** self.level, RETRY_MAX)
            self.level = min(self.level + 1, 16)
            self.retry_m = time.monotonic() + delay
            entering = self.state is not PersistState.DEGRADED
            if entering:
                self.not_persisted = 0  # a new episode
            self._count(blocks)
            if entering or reason != self.reason:
                self._to(PersistState.DEGRADED, reason, name, retry_in=delay)

    def skipped(self, blocks: int) -> None:
        """Blocks not written because the store is degraded and its next try is not due yet."""
        with self._lock:
            self._count(blocks)

    def recovered(self) -> None:
        """A write succeeded while degraded: -> PERSISTING."""
        with self._lock:
            if self.state is PersistState.DEGRADED:
                episode = {"degraded_seconds": round(time.time() - self.since, 3),
                           "not_persisted_then": self.not_persisted}
                self.level, self.not_persisted = 0, 0
                self._to(PersistState.PERSISTING, None, None, **episode)

    def off(self, reason: str) -> None:
        with self._lock:
            if self.state is not PersistState.OFF:
                self._to(PersistState.OFF, reason, None)

    # -- what the store asks ---------------------------------------------------------------------------------

    @property
    def writing(self) -> bool:
        return self.state is PersistState.PERSISTING

    def due(self) -> bool:
        """Degraded, and the next try's time has come."""
        return self.state is PersistState.DEGRADED and time.monotonic() >= self.retry_m

    def snapshot(self) -> dict[str, Any]:
        """The state as the health bodies, /v1/stats and `ember status` show it (no lock of the engine's)."""
        with self._lock:
            out: dict[str, Any] = {"state": self.state, "reason": self.reason, "since": iso_utc(self.since),
                                   "not_persisted": self.not_persisted, "dir": self.directory}
            if self.state is PersistState.DEGRADED:
                out["errno"] = self.errno
                out["retry_in"] = round(max(0.0, self.retry_m - time.monotonic()), 1)
            return out

    # -- the one setter ---------------------------------------------------------------------------------------

    def _count(self, blocks: int) -> None:
        self.not_persisted += blocks
        self.not_persisted_total += blocks

    def _to(self, state: PersistState, reason: str | None, name: str | None, **fields: Any) -> None:
        """(locked) Change state and say so in the log, once per change."""
        if state is not self.state:
            self.since = time.time()
        self.state, self.reason, self.errno = state, reason, name
        level = "info" if state is PersistState.PERSISTING else "warning"
        log(Event.KV_PERSISTENCE, level=level, state=state, reason=reason, since=iso_utc(self.since),
            not_persisted=self.not_persisted, dir=self.directory, errno=name, **fields)
