"""Where the daemon keeps things: the fixed paths under the state dir (0700).

    <state>/                  ember.ops.contract.state_dir(): $EMBER_STATE_DIR, the XDG data dir or
                              /var/lib/ember (a system run); the worker and ops find the same one
      run/                    supervisord.conf, supervisord.sock, daemon.sock, status.json, state.json
      logs/                   worker.log (+ .1 .. .N), supervisord.log, daemon.log
      crashes/<id>/           crash bundles (ember crashes list|show|export)
    /tmp/ember-<uid>-<hash>/  the sockets instead, when <state>/run/ is too long a path for one (checked:
                              ours, 0700, not a symlink; removed at the daemon's exit once empty)

Directories are 0700 and files 0600: crash bundles and logs describe the user's sessions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.ops import contract
from ember.ops.contract import private_dir, state_dir

SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


class UnsafeSocketDir(PermissionError):
    """The short socket dir under /tmp is not ours (another owner, open to others); str() is one line."""


def check_socket_dir(path: Path) -> None:
    """Raise UnsafeSocketDir unless `path` is absent, or a real directory of ours with mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise UnsafeSocketDir(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refusing to use "
                              "it for ember's sockets (remove it, or use a shorter EMBER_STATE_DIR)")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDir(f"{path} is not a directory (a symlink or a file): refusing to use it for ember's "
                              "sockets (`ember start` replaces it)")
    if st.st_mode & 0o077:
        raise UnsafeSocketDir(f"{path} has mode {st.st_mode & 0o777:04o}, open to other users: refusing to use it for "
                              "ember's sockets (`ember start` recreates it)")


def secure_socket_dir(path: Path) -> Path:
    """Create the short socket dir under /tmp, or make an existing one safe to use.

    Ours but not a plain private directory (a symlink or a file we left, or a directory someone
    could have written into): the entry itself is removed, never what a link points to, and made
    again. Another user's: UnsafeSocketDir, since a sticky /tmp lets us neither use nor remove it."""
    uid = os.geteuid()
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if st.st_uid != uid:
            check_socket_dir(path)  # raises, naming the owner
        if stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            if st.st_mode & 0o022:
                shutil.rmtree(path)  # ours, but others could write into it: start from an empty dir
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                opened = os.fstat(fd)  # the directory itself, whatever the name points to by now
                if opened.st_uid != uid:
                    raise UnsafeSocketDir(f"{path} changed owner while ember checked it: refusing to use it")
                if opened.st_mode & 0o077:
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            return path
        os.unlink(path)  # our own symlink or file: the entry goes, not its target
    raise UnsafeSocketDir(f"{path} keeps changing under ember: refusing to use it for ember's sockets")


@dataclass(frozen=True)
class Layout:
    state: Path

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def crashes(self) -> Path:
        return self.state / "crashes"

    def socket_dir_path(self) -> Path:
        """Where the unix sockets go (run/, or the short /tmp dir), without checking that dir."""
        if len(str(self.run / "supervisord.sock")) <= SOCKET_PATH_MAX:
            return self.run
        digest = hashlib.sha256(str(self.state.resolve()).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"ember-{os.geteuid()}-{digest}"

    @property
    def sockets(self) -> Path:
        """Unix sockets live in run/, or in a short private /tmp dir when that path is too long.

        The /tmp dir has a predictable name in a world-writable place, so it is used only while it
        is ours: a real directory (not a symlink), owned by this user, closed to everyone else.
        Anything else raises UnsafeSocketDir instead of talking to sockets someone else placed."""
        path = self.socket_dir_path()
        if path != self.run:
            check_socket_dir(path)
        return path

    @property
    def supervisor_sock(self) -> Path:
        return self.sockets / "supervisord.sock"

    @property
    def control_sock(self) -> Path:
        return self.sockets / "daemon.sock"

    @property
    def supervisor_conf(self) -> Path:
        return self.run / "supervisord.conf"

    @property
    def supervisor_pidfile(self) -> Path:
        return self.run / "supervisord.pid"

    @property
    def launch_file(self) -> Path:
        return self.run / "worker-launch.json"

    @property
    def status_file(self) -> Path:
        return self.run / "status.json"

    @property
    def persist_file(self) -> Path:
        return self.run / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.run / "daemon.lock"

    @property
    def worker_log(self) -> Path:
        return contract.worker_log(self.state)  # where ops (ember cache report) reads it too

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisord.log"

    @property
    def daemon_log(self) -> Path:
        return self.logs / "daemon.log"

    @property
    def daemon_out(self) -> Path:
        return self.logs / "daemon.out"

    def ensure(self) -> Layout:
        for d in (self.state, self.run, self.logs, self.crashes):
            private_dir(d)
        path = self.socket_dir_path()
        if path != self.run:
            secure_socket_dir(path)
        return self

    def release_socket_dir(self) -> None:
        """The short /tmp socket dir removed once nothing is left in it (the daemon's exit, after its
        socket and supervisord's are gone), so that stopped daemons leave nothing in /tmp. Only an empty
        directory goes (rmdir); a symlink or a dir still holding a socket (a supervisord left serving) stays."""
        path = self.socket_dir_path()
        if path != self.run:
            with contextlib.suppress(OSError):
                os.rmdir(path)


def layout() -> Layout:
    return Layout(state_dir())


class LockHeld(Exception):
    """Another process holds the lock; `holder` is the pid it wrote there ('?' when unreadable)."""

    def __init__(self, holder: str):
        super().__init__(f"held by pid {holder}")
        self.holder = holder


def lock_exclusive(path: Path) -> int:
    """Take the daemon's lock file (flock, never waiting) and write our pid into it; the fd stays open
    for the process's lifetime (the lock goes with it). Raises LockHeld naming the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.read(fd, 32).decode().strip() or "?"
        except OSError:
            holder = "?"
        os.close(fd)
        raise LockHeld(holder) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def write_private(path: Path, data: bytes | str) -> None:
    """Write a 0600 file atomically (temp file in the same dir, fsync, rename). Running as root, the
    directory must not be a symlink: another user owning the state dir could point it anywhere."""
    if isinstance(data, str):
        data = data.encode()
    if os.geteuid() == 0 and path.parent.is_symlink():
        raise PermissionError(f"{path.parent} is a symbolic link; as root, ember does not write through links "
                              "in its state directories")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
