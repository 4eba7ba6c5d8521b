"""The daemon's own log, in the contract's line format (`ts`, `level`, `event`, fields: one JSON
object per line, ember.ops.contract.log_line), like the worker's.

It goes to `<state>/logs/daemon.log` (rotated here, by size) and to stderr (the journal, under systemd).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

from ember.ops.contract import log_line

_lock = threading.Lock()


class JsonLog:
    def __init__(self, path: Path | None = None, *, max_bytes: int = 10 << 20, backups: int = 3,
                 stderr: bool = True):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.stderr = stderr
        self._f: IO[str] | None = None
        if path is not None:
            self._f = self._open(path)

    @staticmethod
    def _open(path: Path) -> IO[str]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "a", buffering=1)

    def _rotate(self, f: IO[str], path: Path) -> None:
        f.close()
        for i in range(self.backups - 1, 0, -1):
            src = Path(f"{path}.{i}")
            if src.exists():
                os.replace(src, f"{path}.{i + 1}")
        os.replace(path, f"{path}.1")
        self._f = self._open(path)

    def __call__(self, event: str, level: str = "info", **fields: Any) -> None:
        line = log_line(event, level, **fields)
        with _lock:
            f = self._f
            if f is not None and self.path is not None:
                try:
                    f.write(line + "\n")
                    if f.tell() > self.max_bytes:
                        self._rotate(f, self.path)
                except (OSError, ValueError):
                    pass
            if self.stderr:
                try:
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with _lock:
            if self._f is not None:
                with contextlib.suppress(OSError):
                    self._f.close()
                self._f = None
