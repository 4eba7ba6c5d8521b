"""Crash bundles: `crashes/<UTC time>-<class>/`, written atomically (a hidden temp dir renamed into
place), dir 0700 and files 0600, before the daemon asks for the restart.

    meta.json     schema, class, signature, exit code or signal, CUDA error, detection, uptime,
                  restarts, worker version and effective config (secrets redacted), model
                  fingerprint, host/Python/driver/GPU facts, the restart decision
    worker.log    from the last healthy request before the affected one(s) to the crash line,
                  plus context
    events.jsonl  admit/outcome lines of the last five minutes (sizes, cached and new tokens,
                  outcomes and disconnects; never prompt text): the session shape, for replay
    health.jsonl  the last probes
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ember.ops.contract import ERROR_LEVELS, OUTCOMES, Event, private_dir

from .detect import CRASH_EXIT, OOM, normalize
from .logwatch import Line

SCHEMA = 1
# the worker's events that make up a session's shape (events.jsonl): admissions, outcomes, preemptions
EVENT_NAMES = frozenset({Event.ADMIT, *OUTCOMES, Event.PREEMPT, Event.ENGINE_POISONED})
# the only fields an events.jsonl record may carry: shapes and outcomes, never text (every field the
# contract requires of those events among them: tests/test_contract.py)
EVENT_FIELDS = ("ts", "event", "request_id", "seq", "protocol", "prompt_tokens", "cached_tokens", "new_tokens",
                "completion_tokens", "seconds", "finish_reason", "phase", "error", "status", "tokens", "code",
                "name", "message", "step", "running")
_SECRET_KEYS = re.compile(r"(?i)api[_-]?key|secret|password|authorization|credential|(?:^|_)token$")


def bundle_id(t: float, cls: str) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + cls


# -- redaction ----------------------------------------------------------------------------------------

def redact_obj(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("***" if _SECRET_KEYS.search(str(k)) and v not in (None, "", False) else redact_obj(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    return obj


class Scrubber:
    """Text redaction for everything a bundle stores: known secret values, bearer tokens, keyed fields."""

    _PATTERNS = [
        (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{6,}"), r"\1***"),
        (re.compile(r"(?i)(x-api-key\s*[:=]\s*)\S+"), r"\1***"),
        (re.compile(r'(?i)("(?:api[_-]?key|token|secret|password|authorization)"\s*:\s*)"[^"]*"'), r'\1"***"'),
        (re.compile(r"(?i)(--(?:api-key|token|hf-token|password)[= ])\S+"), r"\1***"),
        (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), "sk-***"),
    ]

    def __init__(self, secrets: Iterable[str | None] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        for pat, rep in self._PATTERNS:
            text = pat.sub(rep, text)
        return text


# -- the log window -------------------------------------------------------------------------------

def crash_index(lines: list[Line], crash_seq: int | None, until: float | None = None) -> int:
    """The crash line's index; without one, the last line read by `until` (the incident's detection)."""
    if crash_seq is not None:
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].seq == crash_seq:
                return i
    if until is not None:
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].t <= until:
                return i
    return len(lines) - 1


def log_window(lines: list[Line], crash_seq: int | None, *, context: int = 20, after: int = 50,
               max_lines: int = 5000, until: float | None = None) -> tuple[list[Line], dict[str, Any]]:
    """The lines from the last healthy request before the affected request(s) to the crash line,
    with `context` lines before and up to `after` lines after (the exit, the failed outcomes).
    The affected requests are those in flight at the crash line, or, without one (a hang, a kill
    by the probes), at `until`, the detection: admitted and without an outcome by then."""
    info: dict[str, Any] = {}
    if not lines:
        return [], {"lines": 0}
    ci = crash_index(lines, crash_seq, until)
    crash_line = crash_seq is not None and lines[ci].seq == crash_seq  # its own outcome may follow it
    admits: dict[str, int] = {}
    open_reqs: dict[str, int] = {}
    seq_of: dict[str, Any] = {}
    for i in range(ci + 1):
        o = lines[i].obj
        if not o:
            continue
        ev, rid = o.get("event"), o.get("request_id")
        if ev == Event.ADMIT and rid is not None:
            admits[str(rid)] = i
            open_reqs[str(rid)] = i
            seq_of[str(rid)] = o.get("seq")
        elif ev in OUTCOMES and rid is not None and (i < ci or not crash_line):
            open_reqs.pop(str(rid), None)
    crash_obj = lines[ci].obj or {}
    running = crash_obj.get("running") if isinstance(crash_obj.get("running"), list) else None
    affected = [str(r) for r in running] if running else list(open_reqs)
    idxs = [admits[r] for r in affected if r in admits]
    anchor = min(idxs) if idxs else ci
    healthy = None
    for i in range(anchor - 1, -1, -1):
        o = lines[i].obj
        if o and o.get("event") == Event.COMPLETED:
            healthy = i
            break
    if healthy is not None:
        start = healthy
    elif idxs:
        start = anchor
    else:  # no request structure (a foreign engine's raw log): the tail before the crash
        start = max(0, ci - 5 * context)
    start = max(0, start - context)
    end = min(len(lines), ci + 1 + after)
    if end - start > max_lines:
        start = end - max_lines
    info.update(lines=end - start, first_seq=lines[start].seq, last_seq=lines[end - 1].seq,
                crash_line_seq=lines[ci].seq, crash_line=lines[ci].text[:500],
                affected_requests=affected,
                affected_seqs=[seq_of.get(r) for r in affected if r in seq_of],
                last_healthy_request=(lines[healthy].obj or {}).get("request_id") if healthy is not None else None)
    return lines[start:end], info


def session_events(lines: list[Line], since: float) -> list[dict[str, Any]]:
    out = []
    for ln in lines:
        o = ln.obj
        if not o or o.get("event") not in EVENT_NAMES or ln.t < since or o.get("probe"):
            continue  # (a worker that marks the daemon's own probe requests keeps them out)
        rec = {k: o[k] for k in EVENT_FIELDS if k in o}
        for k in ("error", "message"):
            if isinstance(rec.get(k), str):
                rec[k] = rec[k][:300]
        out.append(rec)
    return out


def signature(cls: str, cuda: dict[str, Any] | None, exit_info: dict[str, Any], detail: str = "") -> tuple[str, str]:
    parts = [cls]
    if cuda:
        parts.append(str(cuda.get("name") or cuda.get("code")))
    if exit_info.get("signal") and not exit_info.get("killed_by_daemon"):
        parts.append(exit_info["signal"])
    if cls in (CRASH_EXIT, OOM) and exit_info.get("code") is not None:
        parts.append(f"exit {exit_info['code']}")
    if detail:
        parts.append(normalize(detail))
    text = " | ".join(parts)
    return hashlib.sha256(text.encode()).hexdigest()[:12], text


def last_error_line(lines: list[Line]) -> str:
    """The last line that looks like an error (for signatures of exits without a CUDA error)."""
    for ln in reversed(lines):
        o = ln.obj
        if o is not None:
            if o.get("level") in ERROR_LEVELS and o.get("event") not in OUTCOMES:
                return f"{o.get('event')}: {o.get('error') or o.get('message') or ''}"
        elif re.search(r"(?i)error|exception|fatal|abort|segmentation|assert", ln.text):
            return ln.text
    return ""


# -- writing ------------------------------------------------------------------------------------------

def _write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_bundle(crash_dir: Path, meta: dict[str, Any], window: list[Line], events: list[dict[str, Any]],
                 health: list[dict[str, Any]], scrub: Scrubber) -> Path:
    private_dir(crash_dir)
    base = meta["id"]
    final = crash_dir / base
    n = 2
    while final.exists():
        final = crash_dir / f"{base}-{n}"
        n += 1
    meta["id"] = final.name
    tmp = crash_dir / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)
    try:
        _write(tmp / "meta.json", scrub(json.dumps(redact_obj(meta), indent=2, sort_keys=True, default=str)) + "\n")
        _write(tmp / "worker.log", "".join(scrub(ln.text) + "\n" for ln in window))
        _write(tmp / "events.jsonl", "".join(scrub(json.dumps(e, default=str)) + "\n" for e in events))
        _write(tmp / "health.jsonl", "".join(scrub(json.dumps(h, default=str)) + "\n" for h in health))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # the rename, made durable
        dfd = os.open(crash_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return final


def _size(p: Path) -> int:
    total = 0
    for f in p.rglob("*"):
        with contextlib.suppress(OSError):
            total += f.stat().st_size if f.is_file() else 0
    return total


def enforce_retention(crash_dir: Path, keep: int, max_bytes: int, protect: str | None = None) -> list[str]:
    """Delete the oldest bundles beyond `keep` or `max_bytes` in all (never `protect`); stale temp dirs go too."""
    removed: list[str] = []
    if not crash_dir.is_dir():
        return removed
    now = time.time()
    for d in crash_dir.iterdir():
        if d.name.startswith(".tmp-") and now - d.stat().st_mtime > 3600:
            shutil.rmtree(d, ignore_errors=True)
    bundles = sorted(d for d in crash_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    sizes = {d.name: _size(d) for d in bundles}
    total = sum(sizes.values())
    while bundles and (len(bundles) > keep or total > max_bytes):
        victim = bundles[0] if bundles[0].name != protect else (bundles[1] if len(bundles) > 1 else None)
        if victim is None:
            break
        shutil.rmtree(victim, ignore_errors=True)
        bundles.remove(victim)
        total -= sizes[victim.name]
        removed.append(victim.name)
    return removed
