"""The worker's log: one JSON object per line on stderr (`ts`, `level`, `event`, fields).

The daemon reads these lines (DESIGN.md). Prompt text never goes here unless the user opts in.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timezone

_lock = threading.Lock()
_stream = None  # None: whatever sys.stderr is at the time of writing


def set_stream(stream) -> None:
    global _stream
    _stream = stream


def log(event: str, level: str = "info", **fields) -> None:
    record = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "level": level, "event": event}
    record.update(fields)
    line = json.dumps(record, default=str, ensure_ascii=False)
    with _lock:
        try:
            out = _stream or sys.stderr
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):  # a closed stderr must not take the engine down
            pass


def monotonic_ms() -> float:
    return time.monotonic() * 1000
