"""Facts about, and actions on, OS processes: a process's creation time (a pid is only "ours" while
that matches: pids are reused), killing a process tree, the cgroup's OOM kill count, and who holds a
TCP port. psutil and /proc; nothing here knows about phases or incidents.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil


def alive(pid: int | None) -> bool:
    """Whether the process runs: it exists and is no zombie (a child not yet reaped is gone)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.AccessDenied:  # exists, owned by someone else
        return True
    except psutil.Error:
        return False


def ctime(pid: int | None) -> float | None:
    """The process's creation time, or None when there is no such process."""
    if not pid:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def kill_tree(pid: int, group: bool) -> None:
    """SIGKILL a process and its children (and its process group, for the worker: supervisord made it
    a group leader), then wait briefly for them."""
    try:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                k.kill()
        p.kill()
        psutil.wait_procs([p, *kids], timeout=5)
    except (psutil.Error, OSError):
        pass


@dataclass(frozen=True)
class OomCount:
    """The oom_kill count in a cgroup's memory.events (cgroup v2 only), and where it was read."""

    path: str | None = None
    kills: int | None = None

    def rose(self) -> bool:
        """The count is higher now than when this reading was taken."""
        if self.path is None or self.kills is None:
            return False
        now = oom_count(path=self.path).kills
        return now is not None and now > self.kills


def oom_count(pid: int | None = None, path: str | None = None) -> OomCount:
    """The OOM kill count of `pid`'s cgroup (or of the memory.events file at `path`)."""
    try:
        if path is None:
            if not pid:
                return OomCount()
            with open(f"/proc/{pid}/cgroup") as f:
                rel = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
            if rel is None:
                return OomCount()
            path = f"/sys/fs/cgroup{rel}/memory.events"
        with open(path) as f:
            for ln in f:
                k, _, v = ln.partition(" ")
                if k == "oom_kill":
                    return OomCount(path, int(v))
        return OomCount(path)
    except (OSError, ValueError):
        return OomCount(path)


@dataclass(frozen=True)
class PortHeld:
    """Another process listens on the worker's address (pid and command when this user may see them)."""

    host: str
    port: int
    pid: int | None = None
    command: str | None = None

    def __str__(self) -> str:
        who = f" by pid {self.pid} ({self.command})" if self.pid else ""
        return f"port {self.port} on {self.host} is already in use{who}"

    def as_dict(self) -> dict[str, object]:
        return {"host": self.host, "port": self.port, "pid": self.pid, "command": self.command}


def port_owner(host: str, port: int, *, wait: float = 3.0, tick: Callable[[], None] = lambda: None) -> PortHeld | None:
    """None when a server could bind host:port now; else, after waiting up to `wait` seconds for the
    port to come free (calling `tick` meanwhile), who holds it."""
    deadline = time.monotonic() + wait
    while True:
        try:  # bind as the server will (SO_REUSEADDR, like uvicorn): exactly its chance to succeed
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(fam, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
            return None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None  # not ours to judge (an address of another host, say)
        if time.monotonic() >= deadline:
            break
        tick()
        time.sleep(0.2)
    return port_holder(host, port)


def port_holder(host: str, port: int) -> PortHeld:
    """Who listens on `port` (pid and the start of its command line), as far as this user may see."""
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                pid = _socket_maker(c.pid, port)
                return PortHeld(host, port, pid, " ".join(psutil.Process(pid).cmdline()[:4]))
    except (psutil.Error, OSError):
        pass
    return PortHeld(host, port)


def _listens(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections("tcp"))
    except (psutil.Error, OSError):
        return False


def _socket_maker(pid: int, port: int) -> int:
    """A forked child shares its parent's listening socket (for good, or for the instant between fork
    and exec) and psutil names whichever of them it scanned last: walk up to the process that made it,
    the one a user knows and would stop."""
    while True:
        try:
            parent = psutil.Process(pid).ppid()
        except psutil.Error:
            return pid
        if parent <= 1 or not _listens(parent, port):
            return pid
        pid = parent
