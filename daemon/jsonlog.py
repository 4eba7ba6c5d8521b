"""The daemon's own log: one JSON object per line (`ts`, `level`, `event`, fields), like the worker's.

It goes to `<state>/logs/daemon.log` (rotated) and to stderr (the journal, under systemd).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

_lock = threading.Lock()


class JsonLog:
    def __init__(self, path: Path | None = None, *, max_bytes: int = 10 << 20, backups: int = 3,
                 stderr: bool = True):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.stderr = stderr
        self._f = None
        if path is not None:
            self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._f = os.fdopen(fd, "a", buffering=1)

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.backups - 1, 0, -1):
            src = Path(f"{self.path}.{i}")
            if src.exists():
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._open()

    def __call__(self, event: str, level: str = "info", **fields) -> None:
        rec = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "level": level,
               "event": event}
        rec.update(fields)
        line = json.dumps(rec, default=str, ensure_ascii=False)
        with _lock:
            if self._f is not None:
                try:
                    self._f.write(line + "\n")
                    if self._f.tell() > self.max_bytes:
                        self._rotate()
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
                try:
                    self._f.close()
                except OSError:
                    pass
                self._f = None
