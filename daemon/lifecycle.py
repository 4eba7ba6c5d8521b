"""The supervised worker's lifecycle: every change of phase happens here, through PhaseMachine.to()
(phases.py lists the phases and the allowed transitions).

Two kinds of input move the worker:
- events, handled as they arrive from the main loop (core.py): a command (`ember start|stop|restart`,
  SIGHUP), a queued detection or probe result (handle()), supervisord lost;
- time, in transition(): called once per tick with supervisord's view of the worker, it holds every
  time-driven change, each commented with its `FROM -> TO`, like supervisord's own transition().

What a probe result means is verdicts.py's answer (a Kill, or nothing), what a failure costs is
policy.py's (a Decision), what an incident is archived as is incident.classify(); this module
applies their answers and owns the worker's bookkeeping (incarnation, restarts, last crash).
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.ops.contract import Event, ExitCode, HealthState, PersistState, iso_utc

from . import detect
from .archive import Archived, archive
from .detect import HANG, POISONED, UNHEALTHY, UNRESPONSIVE
from .incarnation import PERSISTENCE_FIELDS, Incarnation
from .incident import Incident, classify, cuda_fields, exit_incident
from .logwatch import Line, LogWatcher
from .notify import Notifier
from .paths import Layout
from .phases import WORKER_UP, Phase, PhaseMachine, Status, status_of
from .policy import PORT_BUSY, Decision, RestartPolicy
from .probe_schedule import ProbeMissed, Target
from .probes import Probe, ProbeResult
from .procs import PortHeld, ctime, kill_tree, oom_count, port_holder, port_owner
from .settings import Settings, redact_argv, worker_command
from .supctl import ProcessInfo
from .supervisor import Supervisor
from .verdicts import Kill

P = Phase
STUCK = (HANG, UNRESPONSIVE, UNHEALTHY)  # incidents of a live process: ask it for its stacks before the kill
KILL_WAIT = 15.0  # seconds a SIGKILLed worker gets to be reaped before the incident is archived anyway


@dataclass(frozen=True)
class PoisonSeen:
    """The log watcher found a sticky CUDA error in a log line."""

    line: Line
    info: dict[str, Any]


class Lifecycle:
    def __init__(self, settings: Settings, lay: Layout, log: Callable[..., Any], sup: Supervisor,
                 watcher: LogWatcher, policy: RestartPolicy, notifier: Notifier, *,
                 persist: Callable[[], None], reload: Callable[[], None]) -> None:
        self.s = settings  # replaced by the daemon when ember.toml is re-read
        self.lay, self.log, self.sup, self.watcher = lay, log, sup, watcher
        self.policy, self.notifier = policy, notifier
        self.persist = persist  # writes run/state.json (the daemon's)
        self.reload = reload  # re-reads ember.toml (the daemon's)
        self.machine = PhaseMachine(log)
        self.worker = Incarnation()
        self.incident: Incident | None = None
        self.pending: str | None = None  # exit | restart: a command waiting for the incident's archive
        self.after_stop: str | None = None  # exit | restart: what follows the drain
        self.failed_reason: str | None = None
        self.not_ready_reason: str | None = None
        self.restarts = 0
        self.incarnation = 0  # how many workers this state dir has started
        self.last_crash: dict[str, Any] | None = None
        self.last_recovery_seconds: float | None = None
        self.recovering: tuple[str | None, float] | None = None  # (crash id, monotonic detection) until ready
        self.port_conflict: dict[str, Any] | None = None  # another process holds the port: who, since, next try
        self.backoff_until = 0.0
        self.stop_deadline = 0.0
        self.last_live_m = time.monotonic()  # when a liveness result last arrived (the scheduler's pulse)
        self.health: deque[ProbeResult] = deque(maxlen=max(10, settings.health_records))
        self.done = False  # `ember stop` has finished: the daemon exits

    @property
    def phase(self) -> Phase:
        return self.machine.phase

    def state(self) -> Status:
        return status_of(self.phase, self.worker.ready)

    def status_line(self) -> str:
        st = self.state()
        if st is Status.FAILED:
            return f"failed: {self.failed_reason}"
        return f"worker {st}" + (f" (pid {self.worker.pid})" if self.worker.pid else "")

    def target(self) -> Target:
        """What the probe jobs look at (read from their threads)."""
        return Target(self.incarnation, self.worker.pid, self.phase)

    # == time: one call per tick =============================================================================

    def transition(self, info: ProcessInfo) -> None:
        now_m = time.monotonic()
        phase = self.phase
        if phase in WORKER_UP:
            if not info.alive:  # STARTING|RUNNING -> KILLING|BACKOFF|FAILED
                self.on_exit(info, source="exit")
            elif phase is P.STARTING and now_m - self.worker.spawn_m > self.s.startup_timeout:  # STARTING -> KILLING
                self.open_incident(HANG, f"not ready {self.s.startup_timeout:g}s after start "
                                         f"({self.not_ready_reason})", "startup")
        elif phase is P.KILLING:
            inc = self._incident()
            if not info.alive:  # KILLING -> BACKOFF|FAILED|STARTING|STOPPING
                self.finalize(info)
            elif not inc.killed and now_m >= inc.kill_at:
                self._kill(inc)
            elif inc.killed and now_m > inc.kill_deadline:  # KILLING -> (as above), the process unreaped
                self.log("kill_timeout", level="error", pid=inc.pid)
                inc.exit.note = "the process did not die after SIGKILL"
                self.finalize(info)
        elif phase is P.BACKOFF:
            if now_m >= self.backoff_until:  # BACKOFF -> STARTING
                self.spawn("the restart delay is over")
        elif phase is P.STOPPING:
            if not info.alive:  # STOPPING -> STOPPED|STARTING
                self.after_stopped()
            elif now_m > self.stop_deadline and self.worker.pid:
                self.log("stop_timeout", level="error", pid=self.worker.pid)
                kill_tree(self.worker.pid, group=True)
        elif phase is P.FAILED and self.policy.due(time.time()):  # FAILED -> STARTING (half-open)
            self.log("breaker_half_open", cooldown=self.policy.cooldown, failed_reason=self.failed_reason)
            self.policy.half_open()
            self.reload()
            self.spawn("the breaker's cool-down is over: one more try")

    # == commands =============================================================================================

    def command(self, cmd: str) -> None:
        self.log("command", command=cmd, phase=self.phase)
        if cmd in ("start", "restart", "reload"):
            self.reload()  # applies from the next worker start on
        phase = self.phase
        if cmd == "stop":
            if phase is P.KILLING:
                self.pending = "exit"
            else:
                self.begin_stop("exit")
        elif cmd == "restart":
            self.policy.clear()
            self.failed_reason = None
            if phase is P.KILLING:
                self.pending = "restart"
            elif phase in (P.STOPPED, P.FAILED, P.BACKOFF):
                self.spawn("`ember restart`")
            elif phase is not P.STOPPING:
                self.begin_stop("restart")
        elif cmd == "start":
            if phase in (P.STOPPED, P.FAILED):
                self.policy.clear()
                self.failed_reason = None
                self.spawn("`ember start`")
            elif phase is P.BACKOFF:
                self.spawn("`ember start`: the restart delay is cut short")

    def begin_stop(self, then: str) -> None:
        why = {"exit": "`ember stop`", "restart": "`ember restart`"}[then]
        self.after_stop = then
        self.port_conflict = None
        self.watcher.armed = False
        self.worker.ready = False
        if self.phase in WORKER_UP and self.worker.pid:
            self.sup.stop_worker(self.worker.pid, self.worker.ctime)
            self.machine.to(P.STOPPING, f"{why}: draining the worker")
            self.stop_deadline = time.monotonic() + self.s.effective_stop_timeout + 10
            self.log("worker_stop", pid=self.worker.pid, drain_seconds=self.s.drain_seconds)
        else:
            self.machine.to(P.STOPPING, f"{why}: no worker to drain")
            self.after_stopped()

    def after_stopped(self) -> None:
        then, self.after_stop = self.after_stop, None
        if self.worker.pid:
            self.log("worker_stopped", pid=self.worker.pid)
        self.worker.pid = None
        if then == "restart":
            self.spawn("`ember restart`: the old worker is gone")
        elif then == "exit":
            self.machine.to(P.STOPPED, "`ember stop`: the worker is gone")
            self.notifier.stopping()
            self.sup.shutdown()
            self.done = True
        else:
            self.machine.to(P.STOPPED, "the worker is gone")
        self.persist()

    # == queued detections and probe results ==================================================================

    def handle(self, item: PoisonSeen | ProbeMissed | ProbeResult) -> None:
        if isinstance(item, PoisonSeen):
            if self.phase in WORKER_UP and item.line.seq > self.worker.spawn_seq:
                reason = f"poisoned compute context in the log: {item.info.get('name') or item.info.get('code')}"
                self.open_incident(POISONED, reason, "log", crash_seq=item.line.seq, cuda=cuda_fields(item.info),
                                   grace=self.s.poison_grace, minimal=True,
                                   details={"log_line": item.line.text[:2000]})
            return
        if isinstance(item, ProbeMissed):
            self.health.append(item.result)
            self.log("probe_scheduler", level="warning", **item.result.record())
            return
        if item.incarnation != self.incarnation:
            return  # a result about an earlier worker
        if item.probe == Probe.STARTUP:
            self._on_startup_probe(item)
        elif item.probe == Probe.LIVE:
            self.last_live_m = time.monotonic()
            self.health.append(item)
            self._note_persistence(item)
            if self.phase is P.RUNNING:
                self._on_live(item)
        elif item.probe == Probe.READY:
            self.health.append(item)
            self._note_persistence(item)
            if self.phase is P.RUNNING:
                self._on_ready_probe(item)

    def _on_startup_probe(self, rec: ProbeResult) -> None:
        if self.phase is not P.STARTING:
            return
        if rec.state == HealthState.POISONED:
            self.health.append(rec)
            self.open_incident(POISONED, "the worker reports a poisoned context while starting", "startup",
                               grace=self.s.poison_grace, minimal=True)
            return
        if not rec.ok:
            self.not_ready_reason = f"starting: {rec.error}"
            return
        self.health.append(rec)
        now_m = time.monotonic()
        self.machine.to(P.RUNNING, "the first ready probe passed")  # STARTING -> RUNNING
        w = self.worker
        w.ready, w.ready_at = True, time.time()
        self.not_ready_reason = None
        self.policy.on_ready(time.time())
        self.last_live_m = now_m
        fields: dict[str, Any] = {"pid": w.pid, "startup_seconds": round(now_m - w.spawn_m, 3),
                                  "model": w.facts.get("model"), "endpoint": self.s.endpoint}
        if self.recovering:
            crash_id, m_detect = self.recovering
            secs = round(now_m - m_detect, 3)
            self.last_recovery_seconds = secs
            fields.update(crash_id=crash_id, detection_to_ready_seconds=secs)
            self.recovering = None
        self.log("worker_ready", **fields)
        self.persist()

    def _on_live(self, rec: ProbeResult) -> None:
        now_m = time.monotonic()
        live = self.worker.live
        was = live.status(now_m, self.s)
        kill = live.observe(rec, now_m, self.s)
        if kill is not None:
            self._kill_for(kill)
        elif live.fails == self.s.live_failures:  # patience begins: say so once, with the limit
            self.log("liveness_failing", level="warning", failures=live.fails, error=rec.error,
                     process=rec.process, unresponsive_after_seconds=self.s.unresponsive_seconds)
        elif was and was["failures"] >= self.s.live_failures and live.fails == 0:
            self.log("liveness_recovered", failures=was["failures"], seconds=was["failing_seconds"])

    def _on_ready_probe(self, rec: ProbeResult) -> None:
        w = self.worker
        if rec.ok:
            if not w.ready:
                self.log("worker_ready_again", pid=w.pid)
            w.ready = True
            self.not_ready_reason = None
            self.policy.on_ready(time.time())
        elif rec.busy:  # answering, queue full: neither ready nor hung, nothing to change
            if not w.ready:
                self.not_ready_reason = _text(rec.error)
        else:
            if w.ready:
                self.log("worker_not_ready", level="warning", error=rec.error)
            w.ready = False
            self.not_ready_reason = _text(rec.error)
            self.policy.on_not_ready()
        kill = w.readiness.observe(rec, time.monotonic(), self.s, w.live, w.outcomes)
        if kill is not None:
            self._kill_for(kill)

    def _kill_for(self, k: Kill) -> None:
        self.open_incident(k.cls, k.reason, k.source, cuda=cuda_fields(k.cuda), minimal=k.minimal, details=k.details,
                           grace=self.s.poison_grace if k.poison_grace else 0.0)

    # == the worker's start ===================================================================================

    def spawn(self, why: str) -> None:
        """-> STARTING; -> BACKOFF while another process holds the port; -> FAILED when the engine
        cannot start at all."""
        held = self._port_owner(wait=0.0 if self.port_conflict else 3.0)
        if held is not None:
            self._new_worker()
            self._port_busy(held)
            return
        if self.port_conflict:
            self.log("port_free", port=self.port_conflict["port"], since=self.port_conflict["since"])
            self.port_conflict = None
        argv = worker_command(self.s)
        self.sup.write_launch(argv)
        self.watcher.poll()
        self._new_worker()
        w = self.worker
        w.spawn_seq = w.scan_seq = self.watcher.seq
        self.incarnation += 1
        refused = self.sup.start_worker()
        if refused is not None:
            self.policy.close_breaker()  # the command itself cannot run: configuration, never retried
            self.fail(f"could not start the engine: {refused}")
            return
        info = self.sup.info()
        w.pid = info.pid
        w.ctime = ctime(w.pid)
        w.started = w.ctime or info.start or time.time()
        w.spawn_m = time.monotonic()
        self.machine.to(P.STARTING, why)
        self.not_ready_reason = "starting"
        self.failed_reason = None
        self.watcher.armed = True
        w.oom = oom_count(w.pid)
        self.log("worker_spawn", pid=w.pid, incarnation=self.incarnation, command=redact_argv(argv),
                 restarts=self.restarts)
        self.persist()

    def _new_worker(self) -> None:
        self.worker = Incarnation()
        self.not_ready_reason = None

    def _port_owner(self, wait: float) -> PortHeld | None:
        """Someone else already listens where the worker should (a server started by hand, a worker
        of another daemon), on its port or on one of `also_listens`: wait up to `wait` seconds for it
        to go, then say who it is."""
        deadline = time.monotonic() + wait
        for host, port in self.s.listen_addresses:
            held = port_owner(host, port, wait=max(0.0, deadline - time.monotonic()), tick=self.notifier.ping)
            if held is not None:
                return held
        return None

    def _port_busy(self, held: PortHeld) -> None:
        """-> BACKOFF: the port is taken. Not a configuration error (the holder may let go at any
        time) and not the worker's fault: the next try comes after the policy's backoff, which the
        breaker does not count, and `ember status` names the holder and the next try."""
        now = time.time()
        decision = self.policy.on_failure(now, PORT_BUSY)
        first = self.port_conflict is None
        self.port_conflict = {**held.as_dict(), "since": (self.port_conflict or {}).get("since") or iso_utc(now),
                              "tries": (self.port_conflict or {}).get("tries", 0) + 1,
                              "retry_at": iso_utc(now + decision.delay)}
        self.machine.to(P.BACKOFF, f"{held}; trying again in {decision.delay:g}s")
        self.backoff_until = time.monotonic() + decision.delay
        self.failed_reason = None
        self.not_ready_reason = f"{held}; trying again in {decision.delay:g}s"
        self.log(Event.PORT_BUSY, level="warning" if first else "info", **held.as_dict(), delay=decision.delay,
                 tries=self.port_conflict["tries"])
        self.notifier.status(self.status_line())
        self.persist()

    def fail(self, reason: str) -> None:
        """-> FAILED: no restart until `ember start` (or the breaker's cool-down)."""
        self.machine.to(P.FAILED, reason)
        self.failed_reason = reason
        self.port_conflict = None
        self.worker.ready = False
        self.not_ready_reason = reason
        self.watcher.armed = False
        self.log("worker_failed", level="error", reason=reason)
        self.persist()

    # == incidents ============================================================================================

    def open_incident(self, cls: str, reason: str, source: str, *, crash_seq: int | None = None,
                      cuda: dict[str, Any] | None = None, grace: float = 0.0, minimal: bool = False,
                      details: dict[str, Any] | None = None) -> None:
        """STARTING|RUNNING -> KILLING: the kill is due after `grace` (a poisoned engine may exit by itself)."""
        if self.phase not in WORKER_UP:
            return
        now_m = time.monotonic()
        w = self.worker
        inc = Incident(cls, reason, source, time.time(), now_m, w.pid, crash_seq=crash_seq, cuda=cuda,
                       minimal=minimal, details=details or {})
        self.incident = inc
        self.machine.to(P.KILLING, reason)
        w.ready = False
        self.not_ready_reason = f"restarting: {reason}"
        self.watcher.armed = False
        self.policy.on_not_ready()
        self.log("incident", level="error", incident=cls, reason=reason, source=source, pid=w.pid)
        inc.kill_at = now_m + grace
        if cls in STUCK and not self.s.foreign and self.s.dump_signal and inc.pid:
            sig = signal.Signals["SIG" + self.s.dump_signal.upper().removeprefix("SIG")]
            try:
                if ctime(inc.pid) == w.ctime:
                    os.kill(inc.pid, sig)  # thread stacks into the log, if the engine dumps on it
                    inc.details["dump_signal"] = sig.name
                    inc.exit.killed_by_daemon = True
            except OSError:
                pass
            inc.kill_at = now_m + self.s.kill_grace
        self.notifier.status(self.status_line())

    def _incident(self) -> Incident:
        assert self.incident is not None, "phase killing without an incident"
        return self.incident

    def _kill(self, inc: Incident) -> None:
        inc.killed = True
        inc.kill_deadline = time.monotonic() + KILL_WAIT
        inc.exit.killed_by_daemon = True
        if inc.pid and ctime(inc.pid) == self.worker.ctime:
            self.log("worker_kill", pid=inc.pid, signal="SIGKILL", incident=inc.cls)
            kill_tree(inc.pid, group=True)

    def on_exit(self, info: ProcessInfo, source: str) -> None:
        """The worker exited without being asked (or died while no daemon watched)."""
        self.watcher.poll()
        self.scan_log()
        ex = self.sup.exit_info(info)
        w = self.worker
        if info.statename == "FATAL" or ex.code == ExitCode.CONFIG:  # -> FAILED, and never retried
            why = (w.facts.get("config_error") or self._last_launch_error() or ex.spawn_error
                   or f"exit {ExitCode.CONFIG}")
            self.log("worker_exit", level="error", pid=w.pid, **ex.as_dict())
            self.policy.close_breaker()  # a configuration error is never retried by a cool-down
            self.fail(f"configuration error (exit {ExitCode.CONFIG}, not restarting): {why}")
            w.pid = None
            return
        if ex.code == ExitCode.PORT_BUSY:  # -> BACKOFF: the port was taken between the check and the bind
            self.log("worker_exit", level="warning", pid=w.pid, **ex.as_dict())
            w.pid = None
            host, port = self.s.listen_addresses[0]
            self._port_busy(self._port_owner(wait=0.0) or port_holder(host, port))
            return
        if ex.code == ExitCode.OK:  # -> BACKOFF (or FAILED: the breaker)
            self.log("worker_exit", level="warning", pid=w.pid, code=ExitCode.OK,
                     note="the worker stopped cleanly without being asked; restarting it")
            decision = self.policy.on_failure(time.time(), "clean exit")
            w.pid = None
            self._apply_decision(decision)
            return
        cls, reason = exit_incident(ex)  # -> KILLING, archived at once: the process is gone
        self.incident = Incident(cls, reason, source, time.time(), time.monotonic(), w.pid,
                                 minimal=ex.code == ExitCode.POISONED, exit=ex)
        self.machine.to(P.KILLING, reason)
        self.log("incident", level="error", incident=cls, reason=reason, source=source, pid=w.pid)
        self.finalize(info)

    def _last_launch_error(self) -> str | None:
        for ln in reversed(self.watcher.lines_since(self.worker.spawn_seq)):
            if ln.obj and ln.obj.get("event") in (Event.LAUNCH_ERROR, Event.CONFIG_ERROR):
                return ln.obj.get("error")
        return None

    def finalize(self, info: ProcessInfo) -> None:
        """The worker is gone: gather the evidence, classify, archive, decide."""
        inc = self._incident()
        self.watcher.poll()
        self.scan_log()
        inc.exit = self.sup.exit_info(info).overlay(inc.exit)
        lines = self.watcher.lines_since(self.worker.spawn_seq)
        for ln in lines:
            found = detect.poison_in_line(ln.text, ln.obj, self.watcher.signatures)
            if found:
                inc.poison, inc.poison_seq = found, ln.seq
                break
        inc.oom = self._oom_evidence(inc, lines)
        inc.cls = classify(inc)
        if inc.cls == POISONED:
            inc.minimal = True
            if inc.poison is not None:
                inc.crash_seq = inc.crash_seq or inc.poison_seq
                inc.cuda = inc.cuda or cuda_fields(inc.poison)
        decision = self.policy.on_failure(inc.t_detect, inc.cls, minimal=inc.minimal)
        if self.pending in ("exit", "restart"):
            decision = Decision(False, 0.0, f"{self.pending} requested")
        archived = self._archive(inc, lines, decision)
        crash_id = archived.id if archived else None
        self.last_crash = {"id": crash_id, "class": inc.cls, "detected_at": iso_utc(inc.t_detect),
                           "reason": inc.reason, "signature": archived.signature if archived else None}
        self.recovering = (crash_id, inc.m_detect)
        self.incident = None
        self.worker.pid = None
        pending, self.pending = self.pending, None
        if pending == "exit":  # KILLING -> STOPPING -> STOPPED
            self.machine.to(P.STOPPING, "archived; `ember stop` came meanwhile")
            self.after_stop = "exit"
            self.after_stopped()
        elif pending == "restart":  # KILLING -> STARTING
            self.policy.clear()
            self.spawn("archived; `ember restart` came meanwhile")
        else:  # KILLING -> BACKOFF|FAILED
            self._apply_decision(decision, since=inc.m_detect)

    def _oom_evidence(self, inc: Incident, lines: list[Line]) -> bool:
        ex = inc.exit
        if ex.signal == "SIGKILL" and not ex.killed_by_daemon and self.worker.oom.rose():
            return True
        return any(detect.oom_in_text(ln.text, ln.obj) for ln in lines[-50:])

    def _archive(self, inc: Incident, lines: list[Line], decision: Decision) -> Archived | None:
        try:
            return archive(self.lay.crashes, inc, self.worker, lines, decision, settings=self.s, health=self.health,
                           restarts=self.restarts, backoff_level=self.policy.level,
                           secrets=[self.s.api_key, os.environ.get("EMBER_API_KEY")], log=self.log)
        except Exception as e:  # the restart must not wait on a bundle that cannot be written
            self.log("bundle_error", level="error", error=f"{type(e).__name__}: {e}")
            return None

    def _apply_decision(self, decision: Decision, since: float | None = None) -> None:
        """Restart `decision.delay` seconds after the failure was seen (archiving counts as waiting)."""
        if not decision.restart:
            self.fail(decision.reason)
            return
        self.restarts += 1
        self.machine.to(P.BACKOFF, decision.reason)
        self.backoff_until = (time.monotonic() if since is None else since) + decision.delay
        self.not_ready_reason = f"restarting in {decision.delay:g}s"
        self.log("restart_scheduled", delay=decision.delay, reason=decision.reason, restarts=self.restarts)
        self.persist()

    # == a daemon that starts again, and a supervisord that went away =========================================

    def attach(self, info: ProcessInfo, p: dict[str, Any]) -> None:
        """A fresh daemon found supervisord still running (an earlier daemon's): carry on from there."""
        self.restore(p)
        w = self.worker
        w.spawn_seq = w.scan_seq = self._incarnation_start_seq()
        if info.alive:  # STOPPED -> STARTING: check readiness again before calling it ready
            w.pid = info.pid
            w.ctime = ctime(w.pid)
            w.started = w.ctime or info.start or time.time()
            w.spawn_m = time.monotonic()
            self.machine.to(P.STARTING, "re-attached to a running worker")
            w.oom = oom_count(w.pid)
            self.watcher.armed = True
        elif p.get("phase") in WORKER_UP | {P.KILLING} and info.statename in ("EXITED", "FATAL", "BACKOFF"):
            # STOPPED -> KILLING|BACKOFF|FAILED: it died while no daemon watched; archive it, then the policy
            w.pid = p.get("worker_pid")
            w.started = p.get("worker_started")
            self.on_exit(info, source="attach")
        elif self.failed_reason:  # STOPPED -> FAILED: it had failed, and stays so until `ember start`
            self.machine.to(P.FAILED, f"re-attached: {self.failed_reason}")
        else:
            self.spawn("re-attached; no worker was running")

    def _incarnation_start_seq(self) -> int:
        """The ring position just before the current worker's first line (its `config` line)."""
        lines = self.watcher.snapshot()
        for ln in reversed(lines):
            if ln.obj and ln.obj.get("event") == Event.CONFIG:
                return ln.seq - 1
        return lines[0].seq - 1 if lines else 0

    def restore(self, p: dict[str, Any], counters_only: bool = False) -> None:
        """The bookkeeping an earlier daemon persisted (persisted() wrote it)."""
        self.restarts = int(p.get("restarts", 0))
        self.policy.load(p.get("policy"))
        self.last_crash = p.get("last_crash")
        self.last_recovery_seconds = p.get("last_recovery_seconds")
        self.incarnation = int(p.get("incarnation", 0))
        if not counters_only and p.get("phase") == P.FAILED:
            self.failed_reason = p.get("failed_reason")

    def persisted(self) -> dict[str, Any]:
        w = self.worker
        return {"phase": self.phase, "failed_reason": self.failed_reason, "restarts": self.restarts,
                "policy": self.policy.dump(), "last_crash": self.last_crash,
                "last_recovery_seconds": self.last_recovery_seconds, "incarnation": self.incarnation,
                "worker_pid": w.pid, "worker_ctime": w.ctime, "worker_started": w.started}

    def kill_orphan(self) -> None:
        """supervisord is lost and about to be replaced: end the worker it would leave behind."""
        w = self.worker
        if w.pid and ctime(w.pid) == w.ctime:
            kill_tree(w.pid, group=True)

    def after_supervisor_lost(self) -> None:
        if self.phase in (P.STARTING, P.RUNNING, P.KILLING):  # -> STARTING: a new worker under the new one
            self.incident = None
            self.spawn("supervisord was lost: a new one, and a new worker")

    def scan_log(self) -> None:
        was = self._persistence()
        self.worker.scan(self.watcher.lines_since(self.worker.scan_seq))
        self._persistence_news(was)

    # == the worker's KV persistence (its log's `kv_persistence` events and the health bodies) ===============

    def _persistence(self) -> str | None:
        return (self.worker.facts.get("kv_persistence") or {}).get("state")

    def _note_persistence(self, rec: ProbeResult) -> None:
        """A health body's persistence state (it carries the counts the log's changes do not)."""
        if not isinstance(rec.kv_persistence, dict):
            return
        known = self.worker.facts.get("kv_persistence") or {}
        if str(rec.kv_persistence.get("since") or "") < str(known.get("since") or ""):
            return  # answered before a change the log has already told (the probe ran meanwhile)
        was = self._persistence()
        self.worker.facts["kv_persistence"] = {k: rec.kv_persistence[k] for k in PERSISTENCE_FIELDS
                                               if rec.kv_persistence.get(k) is not None}
        self._persistence_news(was)

    def _persistence_news(self, was: str | None) -> None:
        """Say in the daemon's log when the worker's KV blocks stop or start reaching the disk."""
        now = self._persistence()
        if now is None or now == was or (was is None and now == PersistState.PERSISTING):
            return
        kv = self.worker.facts["kv_persistence"]
        self.log(Event.KV_PERSISTENCE, level="warning" if now == PersistState.DEGRADED else "info",
                 pid=self.worker.pid, **{k: kv.get(k) for k in ("state", "reason", "since", "not_persisted")})


def _text(error: str | dict[str, Any] | None) -> str | None:
    return None if error is None else str(error)
