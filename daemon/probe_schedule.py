"""The probes on a schedule: APScheduler runs liveness, readiness and startup probes in its threads
and queues each ProbeResult for the main loop; a probe run the scheduler skipped, missed or that
raised is queued as ProbeMissed. The jobs only read a snapshot of the target (which worker, in which
phase) and never touch the daemon's state; what a result means is verdicts.py's business, what it
changes is lifecycle.py's.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import probes
from .phases import Phase
from .probes import Probe, ProbeResult
from .settings import Settings


@dataclass(frozen=True)
class Target:
    """What a probe job looks at: the current worker and its phase."""

    incarnation: int
    pid: int | None
    phase: Phase


@dataclass(frozen=True)
class ProbeMissed:
    """The scheduler skipped or missed a probe run, or the probe job raised."""

    result: ProbeResult


class ProbeSchedule:
    def __init__(self, settings: Settings, target: Callable[[], Target], results: queue.Queue[Any]) -> None:
        self.s = settings
        self.target = target
        self.results = results
        self._sched: Any = None

    def start(self) -> None:
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        sched = BackgroundScheduler(executors={"default": ThreadPoolExecutor(4)}, timezone="UTC",
                                    job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30})
        for job, every in self._intervals():
            sched.add_job(getattr(self, f"_job_{job}"), "interval", seconds=every, id=job)
        sched.add_listener(self._on_event, EVENT_JOB_MAX_INSTANCES | EVENT_JOB_ERROR | EVENT_JOB_MISSED)
        sched.start()
        self._sched = sched

    def stop(self) -> None:
        if self._sched is not None:
            with contextlib.suppress(Exception):
                self._sched.shutdown(wait=False)

    def reschedule(self, s: Settings, on_error: Callable[[Exception], None]) -> None:
        self.s = s
        if self._sched is None:
            return
        for job, every in self._intervals():
            try:
                self._sched.reschedule_job(job, trigger="interval", seconds=every)
            except Exception as e:
                on_error(e)

    def _intervals(self) -> list[tuple[str, float]]:
        return [(Probe.LIVE, self.s.live_interval), (Probe.READY, self.s.ready_interval),
                (Probe.STARTUP, self.s.startup_poll)]

    def restart_if_stalled(self, silent: float) -> ProbeResult | None:
        """No liveness result for `silent` seconds while the worker is watched: longer than a probe
        can take means the scheduler is stuck. Restart it and return the record that says so."""
        if self._sched is None or silent <= self.s.live_interval + self.s.live_timeout + 5.0:
            return None
        self.stop()
        self.start()
        return ProbeResult(Probe.LIVE, error=f"no liveness result for {silent:.0f}s: restarting the probe scheduler")

    # -- the jobs (scheduler threads) ---------------------------------------------------------------------

    def _job_live(self) -> None:
        t = self.target()
        if t.phase is not Phase.RUNNING or not self.s.live_url:
            return
        rec = probes.live_probe(self.s.live_url, self.s.live_timeout)
        proc = probes.process_check(t.pid)
        rec.process, rec.cpu = proc.status or proc.error, proc.cpu
        if not proc.ok:
            rec.ok, rec.error = False, f"process: {proc.error}"
        rec.pid, rec.incarnation = t.pid, t.incarnation
        self.results.put(rec)

    def _job_ready(self) -> None:
        t = self.target()
        if t.phase is Phase.RUNNING:
            self._put_ready(Probe.READY, t)

    def _job_startup(self) -> None:
        t = self.target()
        if t.phase is Phase.STARTING:
            self._put_ready(Probe.STARTUP, t)

    def _put_ready(self, probe: Probe, t: Target) -> None:
        rec = probes.ready_probe(self.s.readiness_url, self.s.generation_url, self.s.ready_timeout, self.s.api_key,
                                 model=self.s.probe_model)
        rec.probe, rec.pid, rec.incarnation = probe, t.pid, t.incarnation
        self.results.put(rec)

    def _on_event(self, event: Any) -> None:
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES

        kind = {EVENT_JOB_MAX_INSTANCES: "skipped: the previous run is still going",
                EVENT_JOB_ERROR: f"error: {getattr(event, 'exception', '')!r}"}.get(event.code, "missed its time")
        if event.job_id == Probe.STARTUP and event.code != EVENT_JOB_ERROR:
            return  # the startup probe polls fast: a skipped run is no news
        self.results.put(ProbeMissed(ProbeResult(event.job_id, error=f"probe {kind}")))
