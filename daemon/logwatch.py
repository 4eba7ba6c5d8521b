"""Follow the worker's log with the watchdog library; keep recent lines; report poisoned contexts.

- Rotation (supervisord renames worker.log to worker.log.1 and opens a new one) is noticed by the
  inode changing: the rest of the old file is read, then the new one from its start.
- Truncation (size below our offset) restarts reading at 0.
- A handler exception is caught and logged: it never kills the observer thread. The daemon's main
  loop also calls poll() every tick (inotify can miss events) and ensure_running() restarts a dead
  observer, or one whose directory watch ended (the watched directory was deleted).
- The watcher never raises into its caller: the main loop also carries `ember stop`. An observer
  that cannot start (inotify instance or watch limit reached, a directory that cannot be made) or
  keeps dying leaves the watcher in `polling` mode: the main loop's per-tick poll() reads the files
  alone, and the observer is tried again every RETRY_SECONDS. A file that cannot be read is
  reported once and reopened on the next poll.
- Every line lands in a ring (bounded by count) with a sequence number, arrival time and, for JSON
  lines, the parsed object: crash bundles cut their log window and events from it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from ember.ops.contract import parse_log_line

from .detect import poison_in_line

MAX_LINE = 64 * 1024
RETRY_SECONDS = 10.0  # how often a watcher in polling mode tries to start its observer again


@dataclass
class Line:
    seq: int
    t: float  # wall time when read
    source: str
    text: str
    obj: dict[str, Any] | None


class TailedFile:
    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name
        self.f: IO[bytes] | None = None
        self.ino: int | None = None
        self.offset = 0
        self.partial = b""

    def open_at(self, offset: int | None) -> None:
        """Open the file; offset None = its end."""
        self.close()
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (kept open: this is the tail being followed)
        except OSError:
            return
        st = os.fstat(f.fileno())
        self.f, self.ino = f, st.st_ino
        self.offset = st.st_size if offset is None else min(offset, st.st_size)
        f.seek(self.offset)
        self.partial = b""

    def close(self) -> None:
        if self.f is not None:
            with contextlib.suppress(OSError):
                self.f.close()
        self.f = None

    def _drain(self) -> list[str]:
        return [p.decode("utf-8", errors="replace") for p in self._drain_raw()]

    def _drain_raw(self) -> list[bytes]:
        out: list[bytes] = []
        if self.f is None:
            return out
        while True:
            chunk = self.f.read(1 << 20)
            if not chunk:
                break
            self.offset += len(chunk)
            data = self.partial + chunk
            parts = data.split(b"\n")
            self.partial = parts.pop()
            if len(self.partial) > MAX_LINE:  # a runaway line without a newline: emit it cut
                parts.append(self.partial[:MAX_LINE])
                self.partial = b""
            out.extend(parts)
        return out

    def read_new(self) -> list[str]:
        lines: list[str] = []
        if self.f is None:
            self.open_at(0)
            if self.f is None:
                return lines
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_ino != self.ino:  # rotated: finish the old file, then the new one
            lines += self._drain()
            if self.partial:
                lines.append(self.partial.decode("utf-8", errors="replace"))
                self.partial = b""
            self.open_at(0)
        elif st is not None and st.st_size < self.offset and self.f is not None:  # truncated
            self.f.seek(0)
            self.offset = 0
            self.partial = b""
        lines += self._drain()
        return lines


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: LogWatcher):
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        try:
            paths = {os.fsdecode(event.src_path), os.fsdecode(getattr(event, "dest_path", "") or "")}
            if paths & self.watcher.watched_paths:
                self.watcher.poll()
        except Exception as e:  # never let a handler kill the observer
            self.watcher.errors += 1
            self.watcher.on_error(e)


class LogWatcher:
    def __init__(self, files: list[tuple[Path, str]], *, ring_lines: int = 50000,
                 on_poison: Callable[[Line, dict[str, Any]], None] | None = None,
                 on_error: Callable[[Exception], None] | None = None, signatures: tuple = ()):
        """signatures: a foreign engine profile's fatal lines (daemon/engines.py), checked besides ember's
        own event and the raw CUDA errors."""
        self.files = [TailedFile(p, name) for p, name in files]
        self.signatures = signatures
        self.watched_paths = {str(p) for p, _ in files}
        self.ring: collections.deque[Line] = collections.deque(maxlen=ring_lines)
        self.seq = 0
        self.on_poison = on_poison or (lambda line, info: None)
        self.on_error = on_error or (lambda e: None)
        self.errors = 0
        self._lock = threading.RLock()
        self._observer: BaseObserver | None = None
        self.armed = True  # poison reports on; the daemon disarms while the worker is down
        self.mode = "stopped"  # inotify (the observer runs) | polling (it could not) | stopped
        self.failure: str | None = None  # why the observer is not running, in polling mode
        self._retry_at = 0.0
        self._read_errors: dict[str, str] = {}  # path -> the read error last reported

    # -- reading ---------------------------------------------------------------------------------

    def prime(self, max_bytes: int = 4 << 20, seen: dict[str, list[int]] | None = None) -> None:
        """Load the tail of each file into the ring (context for a re-attached daemon), then follow
        from the end. Lines past `seen` ({path: [inode, offset]}, what an earlier daemon had read)
        were never looked at, so they are reported like new ones; the rest are not."""
        with self._lock:
            for tf in self.files:
                try:
                    self._prime_one(tf, max_bytes, seen)
                except OSError as e:  # unreadable now: poll() tries it again
                    self._report_read_error(tf, e)
                    tf.close()

    def _prime_one(self, tf: TailedFile, max_bytes: int, seen: dict[str, list[int]] | None) -> None:
        try:
            st = tf.path.stat()
        except OSError:
            tf.open_at(0)
            return
        start = max(0, st.st_size - max_bytes)
        mark = (seen or {}).get(str(tf.path))
        unseen_from = mark[1] if mark and mark[0] == st.st_ino and mark[1] <= st.st_size else None
        tf.open_at(start)
        pos = start
        first = True
        for raw in tf._drain_raw():
            line_start, pos = pos, pos + len(raw) + 1
            if first and start > 0:  # the first line is probably cut
                first = False
                continue
            first = False
            report = unseen_from is not None and line_start >= unseen_from
            self._add(tf.name, raw.decode("utf-8", errors="replace"), report=report)

    def positions(self) -> dict[str, list[int]]:
        """{path: [inode, offset]} read so far (persisted, for prime(seen=...) after a re-attach)."""
        with self._lock:
            return {str(tf.path): [tf.ino, tf.offset - len(tf.partial)] for tf in self.files
                    if tf.f is not None and tf.ino is not None}

    def follow_from_end(self) -> None:
        with self._lock:
            for tf in self.files:
                tf.open_at(None)

    def poll(self) -> int:
        """Read what is new in every file; the number of lines. Never raises."""
        n = 0
        with self._lock:
            for tf in self.files:
                try:
                    lines = tf.read_new()
                except OSError as e:  # EIO, a vanished mount...: report once, reopen on the next poll
                    self._report_read_error(tf, e)
                    tf.close()
                    continue
                self._read_errors.pop(str(tf.path), None)
                for text in lines:
                    self._add(tf.name, text, report=True)
                    n += 1
        return n

    def _report_read_error(self, tf: TailedFile, e: OSError) -> None:
        msg = f"{tf.path}: {type(e).__name__}: {e}"
        if self._read_errors.get(str(tf.path)) != msg:
            self._read_errors[str(tf.path)] = msg
            self.errors += 1
            self.on_error(OSError(msg))

    def _add(self, source: str, text: str, report: bool) -> None:
        text = text.rstrip("\r")
        obj = parse_log_line(text)
        self.seq += 1
        line = Line(self.seq, time.time(), source, text, obj)
        self.ring.append(line)
        if report and self.armed:
            try:
                info = poison_in_line(text, obj, self.signatures)
            except Exception as e:
                self.on_error(e)
                info = None
            if info is not None:
                try:
                    self.on_poison(line, info)
                except Exception as e:
                    self.errors += 1
                    self.on_error(e)

    def lines_since(self, seq: int) -> list[Line]:
        """Lines after `seq`, oldest first (walks from the newest end: cheap for the few new ones)."""
        with self._lock:
            out = []
            for ln in reversed(self.ring):
                if ln.seq <= seq:
                    break
                out.append(ln)
            out.reverse()
            return out

    def snapshot(self) -> list[Line]:
        with self._lock:
            return list(self.ring)

    # -- the observer ----------------------------------------------------------------------------

    def start(self) -> bool:
        """Start the observer; True when it runs. On failure (inotify limits, a directory that
        cannot be made) the watcher is in polling mode and `failure` says why. Never raises."""
        obs = None
        try:
            obs = Observer()
            handler = _Handler(self)
            for d in self._dirs():
                os.makedirs(d, exist_ok=True)
                obs.schedule(handler, d, recursive=False)
            obs.daemon = True
            obs.start()
        except Exception as e:
            if obs is not None:
                with contextlib.suppress(Exception):  # end the watches that did start (each holds an inotify instance)
                    obs.unschedule_all()
            self._observer = None
            self.mode = "polling"
            self.failure = f"{type(e).__name__}: {e}"
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return False
        self._observer = obs
        self.mode = "inotify"
        self.failure = None
        return True

    def _dirs(self) -> list[str]:
        return sorted({str(tf.path.parent) for tf in self.files})

    def healthy(self) -> bool:
        """The observer thread runs and so does each directory's watch (a watch ends by itself,
        silently, when its directory is deleted; the observer thread lives on)."""
        obs = self._observer
        if obs is None or not obs.is_alive():
            return False
        try:
            emitters = list(obs.emitters)
        except RuntimeError:  # the set changed while copied: look again next tick
            return True
        return len(emitters) == len(self._dirs()) and all(e.is_alive() for e in emitters)

    def ensure_running(self) -> str | None:
        """Called every tick: restart a dead observer (in polling mode at most every RETRY_SECONDS)
        and say what changed: "restarted", "degraded" (now polling), "recovered" (inotify again)
        or None. Never raises."""
        if self.healthy():
            return None
        was = self.mode
        if was == "polling" and time.monotonic() < self._retry_at:
            return None
        self.stop()
        if self.start():
            return "recovered" if was == "polling" else "restarted"
        return None if was == "polling" else "degraded"

    def stop(self) -> None:
        obs, self._observer = self._observer, None
        if self.mode == "inotify":
            self.mode = "stopped"
        if obs is not None:
            try:
                obs.stop()
                obs.join(timeout=2)
            except Exception:
                pass

    def close(self) -> None:
        self.stop()
        for tf in self.files:
            tf.close()
