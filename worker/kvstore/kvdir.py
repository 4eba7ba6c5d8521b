"""The KV directory that every store on the machine shares: one subdirectory per (model, KV layout),
one disk budget for all of them, kept under a lock file, and the quarantine.

    <kv dir>/
      .lock                      flock'd (exclusive) around every change to the accounting
      quarantine/                files that failed a check; counts toward the budget, oldest trimmed first
      <fingerprint>-<layout>/    one per (model fingerprint, KV layout salt); `layout` = xxh3-64 of the salt
        layout                   the salt as text: what this directory holds
        usage                    bytes of its block files, rewritten under the lock
        .inuse                   held with a shared flock by every live store on this directory
        ??/<chain hash>.kv       the blocks (see blockfile)
      <fingerprint>/             a directory of an older ember (one per model, any layout): counted,
                                 never read, evicted whole when the budget needs its space

So a numpy and a cuda worker, or two replicas, never see each other's blocks as foreign: they live
in different directories, or in the same one when the layout is the same. Budget decisions read
every directory's `usage` (a few small files), not the files themselves. A directory no live store
holds is evicted whole, least recently used first (its `usage` file's mtime); a live store's
blocks are evicted only by a store of that directory. Nothing here touches an entry ember did not
make: a directory needs a `layout` file, or the old name shape and only block files, to count.

Every method marked (locked) expects the caller to hold `lock()`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

LOCK_FILE, LAYOUT_FILE, USAGE_FILE, INUSE_FILE = ".lock", "layout", "usage", ".inuse"
QUARANTINE = "quarantine"
QUARANTINE_MAX_FILES = 64
EVICTED_PREFIX = ".evicted-"
_LEGACY_NAME = re.compile(r"[0-9a-f]{32}")
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kv|\..*\.tmp")
_evictions = itertools.count()


def layout_key(model_key: str, salt: bytes) -> str:
    return f"{model_key}-{xxhash.xxh3_64_hexdigest(salt)}"


@dataclass
class OtherDir:
    """Another directory of the KV dir: its bytes, when it was last used, whether a store holds it."""

    path: Path
    bytes: int
    used: float
    legacy: bool


@dataclass
class Usage:
    own: int
    quarantine: list[tuple[float, int, Path]]  # (mtime, size, path), oldest first
    others: list[OtherDir]

    @property
    def total(self) -> int:
        return self.own + sum(q[1] for q in self.quarantine) + sum(o.bytes for o in self.others)


class KVDir:
    def __init__(self, root: Path, key: str, salt: bytes):
        self.root = Path(root)
        self.dir = self.root / key
        self.quarantine_dir = self.root / QUARANTINE
        self.salt = salt
        self.dir_bytes = 0  # this directory's block bytes, as of the last ledger read or write
        self.total_bytes = 0  # everything counted against the budget, as of the last usage()
        self._inuse: int | None = None
        self._touched = 0.0

    # -- opening and closing ------------------------------------------------------------------------------

    def open(self) -> None:
        """Create what is missing (directories 0700, files 0600; an existing directory keeps its mode)
        and hold this layout's directory in use until close(). Raises OSError."""
        make_private_dirs(self.root)
        with self.lock():
            if not self.dir.is_dir():
                make_private_dirs(self.dir)
            if not (self.dir / LAYOUT_FILE).exists():
                _write_private(self.dir / LAYOUT_FILE, self.salt.decode("utf-8", "replace") + "\n")
            if _read_usage(self.dir) is None:
                _write_private(self.dir / USAGE_FILE, "0\n")
            fd = os.open(self.dir / INUSE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._inuse = fd

    def close(self) -> None:
        fd, self._inuse = self._inuse, None
        if fd is not None:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self):
        """The KV dir's lock: exclusive across processes and threads (each use opens its own file
        description, so two threads of one process exclude each other too)."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- the ledger -----------------------------------------------------------------------------------------

    def add(self, delta: int) -> None:
        """(locked) Block bytes added to (or, negative, removed from) this directory."""
        known = _read_usage(self.dir)
        if known is None:  # a lost or garbled ledger: the files, already changed, are the answer
            self.reconcile()
            return
        self.dir_bytes = max(0, known + delta)
        _write_usage(self.dir, self.dir_bytes)

    def reconcile(self) -> int:
        """(locked) Set the ledger from the files (a crash between a rename and its ledger update
        leaves it off by a block)."""
        found = _block_bytes(self.dir)
        self.dir_bytes = found[0] if found is not None else 0
        _write_usage(self.dir, self.dir_bytes)
        return self.dir_bytes

    def touch(self) -> None:
        """Mark this directory used (for LRU across directories); at most once a minute, no lock."""
        now = time.monotonic()
        if now - self._touched > 60:
            self._touched = now
            with contextlib.suppress(OSError):
                os.utime(self.dir / USAGE_FILE)

    def usage(self) -> Usage:
        """(locked) Every byte that counts toward the budget, by part."""
        known = _read_usage(self.dir)
        own = known if known is not None else self.reconcile()
        self.dir_bytes = own
        quarantine = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.quarantine_dir):
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    quarantine.append((st.st_mtime, st.st_size, Path(e.path)))
        quarantine.sort()
        others = []
        for e in os.scandir(self.root):
            if e.name.startswith(".") or e.name in (QUARANTINE, self.dir.name):
                continue
            other = _other_dir(Path(e.path))
            if other is not None:
                others.append(other)
        u = Usage(own, quarantine, others)
        self.total_bytes = u.total
        return u

    # -- making room ----------------------------------------------------------------------------------------

    def idle(self, other: OtherDir) -> bool:
        """(locked) No live store holds `other` (a store takes its hold under the lock, so the answer
        stays true until the lock is released)."""
        if other.legacy:
            return True
        try:
            fd = os.open(other.path / INUSE_FILE, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        finally:
            os.close(fd)

    def evict_dir(self, other: OtherDir) -> Path | None:
        """(locked) Take an idle directory out of the accounting at once; the caller deletes the
        returned path after releasing the lock (a large directory takes a while)."""
        gone = self.root / f"{EVICTED_PREFIX}{other.path.name}-{os.getpid()}-{next(_evictions)}"
        try:
            os.rename(other.path, gone)
        except OSError:
            return None
        return gone

    def quarantine(self, path: Path, in_dir: bool) -> None:
        """(locked) Move a bad entry to quarantine (its bytes leave this directory's ledger when it
        was one of its block files), keeping at most QUARANTINE_MAX_FILES there, oldest out first.
        A directory or a link standing where a block belongs goes the same way (never followed)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        try:
            make_private_dirs(self.quarantine_dir)
            dest = self.quarantine_dir / f"{int(time.time() * 1000)}-{path.name}"
            os.rename(path, dest)
            os.utime(dest, follow_symlinks=False)  # its age is the time since it was quarantined
        except OSError:
            remove_entry(path)
        if in_dir and stat.S_ISREG(st.st_mode):
            self.add(-st.st_size)
        with contextlib.suppress(OSError):
            kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.lstat().st_mtime)
            for old in kept[:-QUARANTINE_MAX_FILES]:
                remove_entry(old)

    def remove_evicted_leftovers(self) -> None:
        """Directories an evicting process renamed away and did not finish deleting."""
        with contextlib.suppress(OSError):
            for e in os.scandir(self.root):
                if e.name.startswith(EVICTED_PREFIX):
                    shutil.rmtree(e.path, ignore_errors=True)


# -- files ------------------------------------------------------------------------------------------------------


def remove_entry(path: Path) -> bool:
    """Delete a file, a link or a whole directory (never following a link); False when it was gone."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return False


def make_private_dirs(path: Path) -> None:
    """Create `path` and any missing parent with mode 0700; a directory that exists keeps its mode
    (a user's --kv-dir is theirs)."""
    missing = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made meanwhile by another process: not ours to chmod
        os.chmod(d, 0o700)  # the umask may have taken bits away from 0700, never added them


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read_usage(d: Path) -> int | None:
    try:
        return int((d / USAGE_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _write_usage(d: Path, n: int) -> None:
    _write_private(d / USAGE_FILE, f"{n}\n")


def _block_bytes(d: Path, strict: bool = False) -> tuple[int, float] | None:
    """Bytes of the block files under `d` and the newest one's mtime. Anything else there is skipped,
    or, when `strict` (is this an older ember's directory at all?), answers None."""
    total, newest = 0, 0.0
    try:
        top = list(os.scandir(d))
    except OSError:
        return None
    for e in top:
        if e.name in (LAYOUT_FILE, USAGE_FILE, INUSE_FILE):
            continue
        if len(e.name) != 2 or not e.is_dir(follow_symlinks=False):
            if strict:
                return None
            continue
        try:
            for f in os.scandir(e.path):
                if not _BLOCK_NAME.fullmatch(f.name) or not f.is_file(follow_symlinks=False):
                    if strict:
                        return None
                    continue
                if f.name.endswith(".tmp"):  # a write in flight: counted once it is renamed
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = f.stat(follow_symlinks=False)
                    total, newest = total + st.st_size, max(newest, st.st_mtime)
        except OSError:
            return None
    return total, newest


def _other_dir(d: Path) -> OtherDir | None:
    """(locked) Another KV directory's accounting, or None when `d` is not one of ember's."""
    try:
        if not d.is_dir() or d.is_symlink():
            return None
        legacy = not (d / LAYOUT_FILE).exists()
        if legacy and not _LEGACY_NAME.fullmatch(d.name):
            return None
        size = _read_usage(d)
        if size is None:  # an older ember's directory seen for the first time (or a lost ledger)
            found = _block_bytes(d, strict=legacy)
            if found is None:
                return None
            size, newest = found
            _write_usage(d, size)
            os.utime(d / USAGE_FILE, (newest, newest))  # last used when its newest block was written
        return OtherDir(d, size, (d / USAGE_FILE).stat().st_mtime, legacy)
    except OSError:
        return None
