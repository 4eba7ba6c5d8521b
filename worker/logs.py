"""The worker's log: one JSON object per line on stderr, in the contract's format (`ts`, `level`,
`event`, fields: ember.ops.contract.log_line); the contract also names the events the daemon reads.

The daemon reads these lines (docs/architecture.md, "The contracts"). Prompt text never goes here
unless the user opts in.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from ember.ops.contract import log_line

_lock = threading.Lock()
_stream: TextIO | None = None  # None: whatever sys.stderr is at the time of writing


def set_stream(stream: TextIO | None) -> None:
    global _stream
    _stream = stream


def log(event: str, level: str = "info", **fields: Any) -> None:
    line = log_line(event, level, **fields)
    with _lock:
        try:
            out = _stream or sys.stderr
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):  # a closed stderr must not take the engine down
            pass


def monotonic_ms() -> float:
    return time.monotonic() * 1000
