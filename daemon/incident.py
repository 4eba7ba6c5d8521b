"""An incident: something went wrong with one worker, and the crash class it is archived as.

Data and pure functions. The lifecycle opens an Incident when it sees the problem (a probe verdict,
poison in the log, an exit nobody asked for), kills the worker, then fills in the evidence (how the
process ended, what its log holds) and asks classify() for the class; archive.py writes the bundle.
Nothing here touches a process or a file.

classify(), in order:
- exit 75 (ExitCode.POISONED), or a sticky CUDA error in this worker's log behind a crash: the
  context was poisoned, whatever was seen first (`poisoned-context`, restarted after the minimum delay);
- a crash (exit or signal) with evidence of an out-of-memory kill (the cgroup's oom_kill count rose
  while the daemon did not kill, or an out-of-memory line near the end of the log): `oom`;
- otherwise what was detected: `crash-exit`, `crash-signal`, `hang`, `unresponsive`, `unhealthy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ember.ops.contract import ExitCode

from .detect import CRASH_EXIT, CRASH_SIGNAL, OOM, POISONED


@dataclass
class ExitInfo:
    """How the worker process ended, as supervisord reports it (only what is known is set)."""

    code: int | None = None
    signal: str | None = None
    signal_number: int | None = None
    core_dumped: bool | None = None
    spawn_error: str | None = None  # supervisord could not start the command at all
    supervisor: str | None = None  # supervisord's own words about the exit
    killed_by_daemon: bool | None = None  # the daemon sent the signal (its own kill, or the dump signal)
    note: str | None = None

    def overlay(self, other: ExitInfo) -> ExitInfo:
        """This reading, with every field `other` knows taken from `other`."""
        known = {f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        return ExitInfo(**{**self.as_dict(), **known})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class Incident:
    cls: str  # the crash class: what was detected, until classify() has the evidence
    reason: str
    source: str  # log | exit | liveness | readiness | process | startup | attach
    t_detect: float  # wall time
    m_detect: float  # monotonic time
    pid: int | None
    crash_seq: int | None = None  # the log line that shows the crash, when one does
    cuda: dict[str, Any] | None = None
    minimal: bool = False  # poisoned context: minimum delay, no backoff penalty
    details: dict[str, Any] = field(default_factory=dict)
    kill_at: float = 0.0  # monotonic: when the kill is due (after poison or dump grace)
    killed: bool = False
    kill_deadline: float = 0.0
    exit: ExitInfo = field(default_factory=ExitInfo)
    # evidence, once the worker is gone
    poison: dict[str, Any] | None = None  # the first sticky CUDA error in this worker's log
    poison_seq: int | None = None
    oom: bool = False


def exit_incident(ex: ExitInfo) -> tuple[str, str]:
    """(class, reason) of a worker that exited on its own with neither 0 nor a configuration error."""
    if ex.code == ExitCode.POISONED:
        return POISONED, f"exit {ExitCode.POISONED}: poisoned compute context"
    if ex.signal:
        return CRASH_SIGNAL, f"killed by {ex.signal}" + (" (core dumped)" if ex.core_dumped else "")
    return CRASH_EXIT, f"exit {ex.code}"


def classify(inc: Incident) -> str:
    """The crash class an incident is archived as, from what was detected and the evidence."""
    crashed = inc.cls in (CRASH_EXIT, CRASH_SIGNAL)
    if inc.exit.code == ExitCode.POISONED or (inc.poison is not None and crashed):
        return POISONED
    if crashed and inc.oom:
        return OOM
    return inc.cls


def cuda_fields(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """The CUDA error a bundle records (code, name, message, the raw line) from a poison detection."""
    if not info:
        return None
    out = {k: info.get(k) for k in ("code", "name", "message") if info.get(k) is not None}
    if "line" in info:
        out["line"] = info["line"]
    return out or None
