"""What every daemon process holds while it runs, opened and closed in one order: the private state
dir, the lock that makes it the only daemon there, its JSON log (the `daemon_start` and `daemon_exit`
lines), the control socket, the signals that become commands, and systemd's notifier.

Both daemons go through it: the one that supervises a worker (core.py) and the fleet daemon that
supervises member daemons (fleet.py). What each does in between is its own.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

from .control import ControlServer
from .jsonlog import JsonLog
from .notify import Notifier, under_systemd
from .paths import Layout, LockHeld, lock_exclusive
from .sysfacts import ember_version


class DaemonError(RuntimeError):
    """The daemon cannot run (another holds the state dir, supervisord answers nonsense...): one line."""


class DaemonShell:
    def __init__(self, lay: Layout, mode: str):
        self.lay = lay
        self.mode = "systemd" if under_systemd() else mode
        self.notifier = Notifier()
        self.started_at = time.time()
        self.control: ControlServer | None = None
        self._log: JsonLog | None = None
        self._lock_fd: int | None = None

    def log(self, event: str, level: str = "info", **fields: Any) -> None:
        if self._log is not None:
            self._log(event, level, **fields)

    def open(self, **facts: Any) -> None:
        """umask 077, the state dir, the lock (DaemonError when another daemon holds it), the log and
        its `daemon_start` line with `facts`."""
        os.umask(0o077)
        self.lay.ensure()
        try:
            self._lock_fd = lock_exclusive(self.lay.lock_file)
        except LockHeld as e:
            raise DaemonError(f"another ember daemon is running in this state directory (pid {e.holder})") from None
        self.lay.ensure()  # again, ours now: a daemon exiting as this one started may have removed its socket dir
        self._log = JsonLog(self.lay.daemon_log, stderr=self.mode != "background")
        self.log("daemon_start", pid=os.getpid(), version=ember_version(), mode=self.mode,
                 state_dir=str(self.lay.state), **facts)

    def serve(self, status: Callable[[], dict[str, Any]], commands: queue.Queue[str], *, reload: bool) -> None:
        """The control socket, and SIGTERM and SIGINT as `stop` (SIGHUP as `reload`, where the daemon
        re-reads ember.toml)."""
        self.control = ControlServer(self.lay.control_sock, status, commands,
                                     on_error=lambda e: self.log("control_error", level="error",
                                                                 error=f"{type(e).__name__}: {e}"))
        self.control.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda n, f: commands.put("stop"))
        if reload:
            signal.signal(signal.SIGHUP, lambda n, f: commands.put("reload"))

    def close(self) -> None:
        """The signals back to their defaults, the control socket and the notifier closed, `daemon_exit`
        logged, the short /tmp socket dir removed if empty, the log and the lock released. Safe after a
        failed open()."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if self.control is not None:
            self.control.close()
            self.control = None
        self.notifier.close()
        if self._log is not None:
            self.log("daemon_exit", pid=os.getpid())
            self._log.close()
            self._log = None
        if self._lock_fd is not None:  # (a daemon refused for the lock leaves the running one's socket dir be)
            self.lay.release_socket_dir()
            os.close(self._lock_fd)
            self._lock_fd = None
