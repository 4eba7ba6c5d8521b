"""What probe results mean for the worker: which liveness and readiness failures end it, after how
much patience, and as which incident class. Bookkeeping only: the lifecycle (lifecycle.py) feeds it
the ProbeResults probes.py measured and applies the Kill it returns; nothing here touches a process.

Liveness (GET /health/live plus the process itself, psutil), record by record:
- answered and fine: the failure run ends.
- the engine reports a poisoned context: `poisoned-context` at once (after poison_grace).
- the process is gone: nothing here; supervisord reports the exit.
- the process is stopped (state T: SIGSTOP, a job-control stop) or a zombie that stays one (its main
  thread gone while others run on), on a failed probe: `hang` at once. Neither answers again by
  itself, and waiting unresponsive_seconds for it only costs the time (a debugger's tracing stop,
  `t`, is left alone: a person is at work).
- uninterruptible sleep (D state) on every probe for dstate_seconds: `hang`.
- the engine itself reports a stall (503 `stalled`, or 503 while it claims to serve):
  `hang` after live_failures such answers in a row.
- the engine reports a worker thread that died (503 with error `thread_died`): `unhealthy` after
  live_failures such answers, with the thread named in the reason.
- refused, reset, a malformed answer or another 5xx while the process lives: `unhealthy` after
  live_failures in a row.
- no answer within live_timeout while the process lives (in any state but a zombie; D state has its
  own rule above): the event loop is busy or stuck (one huge request, a long tokenization, a swap
  storm, a SIGSTOP). That is an overload until proven otherwise, so it
  gets patience: `unresponsive` only once the probes have failed for unresponsive_seconds in a row
  (and at least live_failures times). The restart policy does not count `unresponsive` toward the
  circuit breaker (policy.py), so repeated overloads cost restarts, never an outage.
Readiness (GET /health/ready, then a one-token generation):
- no generation (a timeout, or a failed generation behind a ready answer) for hang_seconds is a
  `hang` only with evidence that nothing moves: liveness answered meanwhile (while it is silent,
  the liveness rule above decides) and neither the engine's step count nor the request outcomes in
  its log advanced during those seconds (any progress starts the count again).
- a 429 (queue full) is a busy worker, not a hung one: it stops the count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import psutil

from ember.ops.contract import Event, HealthState

from .detect import HANG, POISONED, UNHEALTHY, UNRESPONSIVE
from .probes import ProbeResult


class LiveKind(enum.Enum):
    """What one liveness result says about the worker."""

    OK = "ok"
    POISON = "poison"  # the engine reports a poisoned context
    GONE = "gone"  # the process is gone
    STOPPED = "stopped"  # stopped (T) or a lasting zombie: it will not answer again by itself
    STALLED = "stalled"  # the engine says its loop makes no progress
    THREAD_DIED = "thread_died"
    SILENT = "silent"  # no answer in time
    BROKEN = "broken"  # refused, reset, malformed, another 5xx


@dataclass
class Kill:
    """An incident to open: the main loop kills the worker and archives it as `cls`."""
    cls: str
    reason: str
    source: str  # liveness | process | readiness
    details: dict[str, Any] = field(default_factory=dict)
    minimal: bool = False  # poisoned context: minimum delay, no backoff penalty
    poison_grace: bool = False  # give a poisoned engine poison_grace seconds to exit by itself
    cuda: dict[str, Any] | None = None


def live_kind(rec: ProbeResult) -> LiveKind:
    """One liveness result (probes.live_probe plus the process check) as a LiveKind."""
    if rec.ok:
        return LiveKind.OK
    if rec.state == HealthState.POISONED:
        return LiveKind.POISON
    if rec.process in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
        return LiveKind.STOPPED
    if str(rec.error or "").startswith("process:"):
        return LiveKind.GONE
    if rec.timeout:
        return LiveKind.SILENT
    if isinstance(rec.error, dict) and rec.error.get("name") == Event.THREAD_DIED:
        return LiveKind.THREAD_DIED
    if rec.stalled or (rec.status == 503 and rec.state != HealthState.DRAINING):
        return LiveKind.STALLED
    return LiveKind.BROKEN


class LiveWatch:
    """The liveness rule for one worker incarnation (a new worker gets a new LiveWatch)."""

    def __init__(self) -> None:
        self.fails = 0  # failed probes in a row
        self.since: float | None = None  # monotonic start of the failure run
        self.cpu0: float | None = None  # the process's CPU seconds when the run began
        self.dstate_since: float | None = None
        self.last_answer: float | None = None  # monotonic time the endpoint last answered at all
        self.steps: int | None = None  # the engine's step count, from the last answer that had one

    def status(self, now: float, s: Any) -> dict[str, Any] | None:
        """While probes fail (for `ember status`): how many, how long, and the unresponsive limit."""
        if self.since is None:
            return None
        return {"failures": self.fails, "failing_seconds": round(now - self.since, 1),
                "unresponsive_after_seconds": s.unresponsive_seconds}

    def observe(self, rec: ProbeResult, now: float, s: Any) -> Kill | None:
        """`s` is the daemon's Settings (live_failures, unresponsive_seconds, dstate_seconds)."""
        kind = live_kind(rec)
        if rec.status is not None:
            self.last_answer = now
        if rec.steps is not None:
            self.steps = rec.steps
        stuck = self._disk_sleep(rec, now, s)
        if stuck is not None:
            return stuck
        if kind is LiveKind.OK:
            self.fails, self.since, self.cpu0 = 0, None, None
            return None
        if kind is LiveKind.POISON:
            err = rec.error if isinstance(rec.error, dict) else None
            return Kill(POISONED, "the worker's health endpoint reports a poisoned context", "liveness",
                        minimal=True, poison_grace=True, cuda=err)
        if kind is LiveKind.GONE:
            return None
        if kind is LiveKind.STOPPED:
            what = ("stopped (state T: SIGSTOP or a job-control stop)" if rec.process == psutil.STATUS_STOPPED
                    else "a zombie whose threads run on (its main thread is gone)")
            return Kill(HANG, f"the worker process is {what}: it cannot answer until something else acts",
                        "process", {"process_status": rec.process, "live_failures": self.fails + 1})
        self.fails += 1
        if self.since is None:
            self.since = now - float(rec.ms or 0) / 1000  # the first failed probe began then
            self.cpu0 = rec.cpu
        if self.fails < s.live_failures:
            return None
        return self._failing(kind, rec, now, s)

    def _disk_sleep(self, rec: ProbeResult, now: float, s: Any) -> Kill | None:
        """A process in uninterruptible sleep (D state) for dstate_seconds is hung, whatever its probes say."""
        if rec.process != psutil.STATUS_DISK_SLEEP:
            self.dstate_since = None
            return None
        if self.dstate_since is None:
            self.dstate_since = now
        if now - self.dstate_since >= s.dstate_seconds:
            return Kill(HANG, f"worker stuck in uninterruptible sleep (D state) for "
                              f"{now - self.dstate_since:.0f}s", "process")
        return None

    def _failing(self, kind: LiveKind, rec: ProbeResult, now: float, s: Any) -> Kill | None:
        """The verdict on live_failures failed probes in a row, by the kind of the last."""
        assert self.since is not None
        details: dict[str, Any] = {"live_failures": self.fails}
        if kind is LiveKind.STALLED:
            why = "the engine loop stopped making progress (liveness 503"
            why += f", stalled {rec.last_progress_seconds}s)" if rec.stalled else ")"
            return Kill(HANG, why, "liveness", details)
        if kind is LiveKind.THREAD_DIED:
            message = rec.error.get("message") if isinstance(rec.error, dict) else rec.error
            return Kill(UNHEALTHY, f"a worker thread died ({message})", "liveness", details)
        if kind is LiveKind.BROKEN:
            return Kill(UNHEALTHY, f"liveness failed {self.fails} times in a row while the process lives: "
                                   f"{rec.error}", "liveness", details)
        silent = now - self.since
        if silent < s.unresponsive_seconds:
            return None
        details["unresponsive_seconds"] = round(silent, 3)
        details["process_status"] = rec.process
        if self.cpu0 is not None and rec.cpu is not None:
            details["cpu_seconds_meanwhile"] = round(rec.cpu - self.cpu0, 2)  # busy (high) or idle (0)?
        return Kill(UNRESPONSIVE, f"no liveness answer for {silent:.0f}s ({self.fails} probes timed out) while "
                                  f"the process lives ({rec.process})", "liveness", details)


class ReadyWatch:
    """The readiness hang rule for one worker incarnation."""

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic start of the no-generation run
        self.progress0: tuple[int | None, int] | None = None

    def observe(self, rec: ProbeResult, now: float, s: Any, live: LiveWatch, outcomes: int) -> Kill | None:
        """`outcomes` counts request outcomes the worker has logged so far (progress evidence)."""
        if rec.ok or rec.busy or rec.state == HealthState.DRAINING:
            self.since = None
            return None
        if not (rec.timeout or (rec.status == 200 and "generation" in str(rec.error))):
            return None  # not ready (loading, say): not a hang symptom either way
        progress = (live.steps, outcomes)
        if self.since is None or progress != self.progress0:
            self.since, self.progress0 = now, progress  # a run starts, or starts again after progress
            return None
        if now - self.since < s.hang_seconds:
            return None
        if live.last_answer is None or live.last_answer < self.since:
            return None  # liveness has been silent too: its own (more patient) rule decides
        return Kill(HANG, f"no one-token generation for {now - self.since:.0f}s and no engine progress "
                          f"({rec.error})", "readiness")
