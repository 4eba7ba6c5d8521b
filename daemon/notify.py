"""systemd's notify protocol, spoken directly: datagrams to $NOTIFY_SOCKET (no extra dependency).

`Type=notify`: READY=1 once the daemon runs (supervisord up, worker spawned or re-attached),
STATUS=... as the worker's state changes, WATCHDOG=1 from the main loop at half of
$WATCHDOG_USEC (so a wedged main loop gets the daemon restarted by systemd), STOPPING=1 on stop.
Pings and statuses never wait: when the manager's queue is full they are dropped (the next one
follows a tick later). READY=1 and STOPPING=1 wait up to a second for room, so a slow manager
does not miss the start (it would time the service out) or the stop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET") or ""
        if addr.startswith("@"):
            addr = "\0" + addr[1:]  # abstract namespace
        self.addr: str | None = addr or None
        self.watchdog_interval: float | None = None
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        if usec and (not wpid or wpid == str(os.getpid())):
            with contextlib.suppress(ValueError):
                self.watchdog_interval = max(0.05, int(usec) / 2e6)
        self._last_ping = 0.0
        self._last_status: str | None = None
        self._sock: socket.socket | None = None
        if self.addr:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # a full queue drops a ping; it never stalls the main loop
            except OSError:
                self._sock = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str, wait: float = 0.0) -> bool:
        if self._sock is None or self.addr is None:
            return False
        data = "\n".join(fields).encode()
        deadline = time.monotonic() + wait
        while True:
            try:
                self._sock.sendto(data, self.addr)
                return True
            except BlockingIOError:  # the manager's queue is full
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)
            except OSError:
                return False

    def ready(self, status: str = "") -> None:
        self.send("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []), wait=1.0)

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def ping(self, now: float | None = None) -> None:
        """Call every main-loop tick; sends WATCHDOG=1 at the requested pace."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1", wait=1.0)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def under_systemd(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("NOTIFY_SOCKET") or env.get("INVOCATION_ID"))
