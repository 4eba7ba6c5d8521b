"""One store's block files on disk: a batch written (temp files, then the renames and the ledger under
the KV dir's lock), the layout's directory made again when it was deleted under the store, a probe for
room, and whatever stands at a block's path cleared away first.

What to write and when is the store's (store.py); what a failure means is persistence.py's. Every
method here raises OSError as the file system raised it, and a batch that fails leaves none of its
temp files behind: a short write is continued, so a full disk surfaces as ENOSPC, not as a length
mismatch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..logs import log
from . import blockfile
from .kvdir import LAYOUT_FILE, KVDir

TMP_STALE_SECONDS = 60  # a temp file this old, or whose writer is gone, is a crashed write's leftover

Block = tuple[bytes, bytes, list[int], np.ndarray]  # (hash, parent hash, token ids, payload)


class BlockFiles:
    def __init__(self, kvdir: KVDir, salt: bytes, block_bytes: int,
                 quarantine: Callable[[Path, str, bool], None], disk_full: Callable[[], bool] | None = None):
        self.kvdir, self.dir, self.salt, self.block_bytes = kvdir, kvdir.dir, salt, block_bytes
        self.quarantine = quarantine  # the store's: (path, why, KV dir locked?)
        self.disk_full = disk_full  # fault injection (--fault disk-full): a full disk without a small one

    def path_for(self, h: bytes) -> Path:
        x = h.hex()
        return self.dir / x[:2] / f"{x}.kv"

    def ensure_dir(self) -> bool:
        """This layout's directory as KVDir.open() makes it; True when it had been deleted and is made
        again (its ledger then starts from the files, none: the caller forgets its index)."""
        if (self.dir / LAYOUT_FILE).exists():
            return False
        gone = not self.dir.is_dir()
        self.kvdir.close()
        self.kvdir.open()
        if gone:
            with self.kvdir.lock():
                self.kvdir.reconcile()
                self.kvdir.usage()
            log("kv_dir_recreated", level="warning", dir=str(self.dir),
                reason="the KV directory was deleted while the worker ran")
        return gone

    def probe_room(self) -> None:
        """Write and remove one block's worth of bytes (OSError: no room yet)."""
        tmp = self.dir / f".probe.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                write_all(fd, [bytes(min(self.block_bytes, 64 << 20))], self.disk_full)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def write_batch(self, blocks: list[Block],
                    settle: Callable[[list[tuple[bytes, int]]], list[Path]]) -> list[Path]:
        """Files for a batch of blocks: each to a temp file, then all renamed into place and counted in
        the ledger under one hold of the KV dir's lock, where `settle` (the store's index and budget)
        takes the written (hash, size) and returns directories to delete once the lock is released."""
        tmps: list[Path] = []
        staged = []
        try:
            for h, parent, tokens, payload in blocks:
                parts = blockfile.encode_parts(h, parent, self.salt, tokens, payload)
                path = self.path_for(h)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                self._make_parent(path.parent)
                tmps.append(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    size = write_all(fd, parts, self.disk_full)
                finally:
                    os.close(fd)
                staged.append((h, path, tmp, size))
            with self.kvdir.lock():  # the renames and the ledger change together, for every process
                added = 0
                for _, path, tmp, size in staged:
                    existed = self._clear_path(path)
                    os.replace(tmp, path)
                    added += 0 if existed else size
                if added:
                    self.kvdir.add(added)
                return settle([(h, size) for h, _, _, size in staged])
        except OSError:
            for tmp in tmps:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            raise

    def _make_parent(self, d: Path) -> None:
        """A block's `??` directory; something else standing there (a file) goes to quarantine first."""
        try:
            d.mkdir(mode=0o700, exist_ok=True)
        except FileExistsError:
            self.quarantine(d, "not a directory, where a block directory belongs", False)
            d.mkdir(mode=0o700, exist_ok=True)

    def _clear_path(self, path: Path) -> bool:
        """(KV dir locked) Whether a block file is at `path` already; anything else standing there (a
        directory, a link, a fifo) is quarantined, so the rename can put the block in its place."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode):
            return True
        self.quarantine(path, "not a regular file, at a block's path", True)
        return False


def write_all(fd: int, parts: list | tuple, disk_full: Callable[[], bool] | None = None) -> int:
    """Write `parts` as one file and return its size. A short write is continued, so that what cut it
    short (a full disk: ENOSPC) is raised as itself; a write that makes no progress is ENOSPC.
    disk_full: the fault injection's stand-in for a full disk (half the file, then ENOSPC)."""
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    if disk_full is not None and disk_full():
        os.write(fd, b"".join(bytes(p) for p in parts)[: size // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected: --fault disk-full)")
    done = os.writev(fd, parts)
    if done < size:
        rest = memoryview(b"".join(bytes(p) for p in parts))
        while done < size:
            n = os.write(fd, rest[done:])
            if n <= 0:
                raise OSError(errno.ENOSPC, "a write made no progress (no room left on the disk)")
            done += n
    return size


def leftover(tmp: Path) -> bool:
    """A temp file no live write owns: its writer's process is gone (the name carries its pid), or it
    is older than TMP_STALE_SECONDS."""
    parts = tmp.name.split(".")
    with contextlib.suppress(ValueError, IndexError):
        pid = int(parts[-3])
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
    try:
        return time.time() - tmp.stat().st_mtime > TMP_STALE_SECONDS
    except OSError:
        return False
