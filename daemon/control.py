"""The daemon's control socket (`daemon.sock`, 0600 in a 0700 dir): one JSON line in, one out.

Requests: {"cmd": "status"} answers the daemon's live status; "stop", "restart" and "start" are
queued for the main loop and acknowledged at once (the CLI then follows `status`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMANDS = ("status", "stop", "restart", "start", "ping")


class ControlServer:
    def __init__(self, path: Path, status: Callable[[], dict[str, Any]], commands: queue.Queue[str],
                 on_error: Callable[[Exception], None] | None = None):
        self.path = path
        self.status = status
        self.commands = commands
        self.on_error = on_error or (lambda e: None)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(8)
        s.settimeout(0.5)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None, "start() binds the socket first"
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                self._handle(conn)
            except Exception as e:  # one bad client never stops the control socket
                self.on_error(e)
            finally:
                conn.close()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        buf = b""
        while b"\n" not in buf and len(buf) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            buf += chunk
        try:
            req = json.loads(buf.split(b"\n", 1)[0] or b"{}")
            cmd = req.get("cmd")
        except (ValueError, AttributeError):
            cmd = None
        if cmd == "status" or cmd == "ping":
            reply = {"ok": True, "status": self.status()}
        elif cmd in COMMANDS:
            self.commands.put(cmd)
            reply = {"ok": True, "accepted": cmd}
        else:
            reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        conn.sendall(json.dumps(reply, default=str).encode() + b"\n")

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def request(path: Path, cmd: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """Send one command; None when no daemon answers."""
    if not path.exists():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return json.loads(buf.split(b"\n", 1)[0])
    except (OSError, ValueError):
        return None
    finally:
        s.close()
