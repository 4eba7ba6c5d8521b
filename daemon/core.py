"""`ember daemon run`: the control plane's main loop.

    systemd (Type=notify) or `ember start`  ->  this loop  ->  supervisord (XML-RPC)  ->  worker
                                                 |  probes (APScheduler), log watch (watchdog), psutil
                                                 '-> crash bundles, status, restart policy

One thread decides: the main loop reads supervisord's view of the worker, the detections the log
watcher queued, the probe results the scheduler's threads queued and the control socket's
commands, and moves the worker through its phases:

    stopped -> starting -> running -> killing -> (bundle) -> backoff -> starting ...
                                            '-> failed (exit 78: no restart; breaker open:
                                                        starting again after breaker_cooldown)

What a probe result means (patience, incident class) is decided in verdicts.py, what a failure
costs (backoff, breaker) in policy.py; this loop applies their answers. The log watcher and the
probes never block the loop: `ember stop` is a command it drains every tick.

Killing the daemon leaves supervisord and the worker serving; the next daemon re-attaches to them
(state it needs is persisted in run/state.json). SIGTERM, SIGINT or `ember stop` drain the worker,
stop supervisord and exit 0.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import queue
import signal
import socket
import threading
import time
import xmlrpc.client
from dataclasses import dataclass, field
from typing import Any

import psutil

from . import bundle as bundles
from . import detect, probes, supctl
from .control import ControlServer
from .jsonlog import JsonLog
from .logwatch import Line, LogWatcher
from .notify import Notifier, under_systemd
from .paths import Layout, read_json, write_json, write_private
from .policy import Decision, RestartPolicy
from .settings import Settings, worker_command
from .sysfacts import gpu_facts, host_facts
from .verdicts import OUTCOMES, Kill, LiveWatch, ReadyWatch

ALIVE = {"RUNNING", "STARTING", "STOPPING"}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ember")
    except Exception:
        return "unknown"


@dataclass
class Incident:
    cls: str
    reason: str
    source: str  # log | exit | liveness | readiness | process | startup | attach
    t_detect: float
    m_detect: float
    pid: int | None
    crash_seq: int | None = None
    cuda: dict | None = None
    minimal: bool = False  # poisoned context: minimum delay, no backoff penalty
    details: dict = field(default_factory=dict)
    kill_at: float = 0.0
    killed: bool = False
    kill_deadline: float = 0.0
    exit: dict = field(default_factory=dict)


class DaemonError(RuntimeError):
    pass


class Daemon:
    def __init__(self, settings: Settings, layout: Layout, *, mode: str = "foreground",
                 flags: dict[str, Any] | None = None):
        self.s = settings
        self.flags = flags  # the command-line settings, kept when ember.toml is re-read
        self.lay = layout
        self.mode = "systemd" if under_systemd() else mode
        self.log: JsonLog | None = None
        self.inbox: "queue.Queue[tuple]" = queue.Queue()
        self.commands: "queue.Queue[str]" = queue.Queue()
        self.policy = RestartPolicy(settings.backoff_base, settings.backoff_max, settings.backoff_reset,
                                    settings.breaker_crashes, settings.breaker_window, settings.breaker_cooldown)
        self.notifier = Notifier()
        self.health: collections.deque[dict] = collections.deque(maxlen=max(10, settings.health_records))
        self.phase = "stopped"
        self.exit_now = False
        self.after_stop: str | None = None  # exit | restart | stopped
        self.pending: str | None = None  # a command that waits for the incident to be archived
        self.incident: Incident | None = None
        self.recovering: dict | None = None  # {id, m_detect} until the worker is ready again
        self.failed_reason: str | None = None
        self.restarts = 0
        self.last_crash: dict | None = None
        self.last_recovery_seconds: float | None = None
        self.incarnation = 0
        self.backoff_until = 0.0
        self.stop_deadline = 0.0
        self.sup_proc = None
        self.sup_pid: int | None = None
        self.sup_ctime: float | None = None
        self.conf_dirty = False
        self.started_at = time.time()
        self.attached = False
        self._reset_worker()
        self._status: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        self._status_written = ("", 0.0)
        self._persisted = ""
        self._log_pos: dict = {}
        self._log_pos_at = 0.0
        self._lock_fd: int | None = None
        self.sched = None
        self.watcher: LogWatcher | None = None
        self.control: ControlServer | None = None
        self.rpc = supctl.rpc(layout.supervisor_sock, timeout=5.0)
        self.secrets = [settings.api_key, os.environ.get("EMBER_API_KEY")]
        self._last_live_m = time.monotonic()
        self._last_watch_error = ""
        self._sup_slow_since: float | None = None

    def _reset_worker(self) -> None:
        self.worker_pid: int | None = None
        self.worker_ctime: float | None = None
        self.worker_started: float | None = None
        self.spawn_m = time.monotonic()
        self.spawn_seq = 0
        self.scan_seq = 0
        self.ready = False
        self.not_ready_reason: str | None = None
        self.live = LiveWatch()
        self.readiness = ReadyWatch()
        self.outcomes = 0  # request outcomes this worker logged (progress evidence for readiness)
        self.facts: dict[str, Any] = {}
        self.oom_events: str | None = None
        self.oom_base: int | None = None
        self.ready_at: float | None = None

    # == setup and teardown ===========================================================================

    def _acquire_lock(self) -> None:
        fd = os.open(self.lay.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                other = os.read(fd, 32).decode().strip()
            except OSError:
                other = "?"
            os.close(fd)
            raise DaemonError(f"another ember daemon is running (pid {other or '?'})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def setup(self) -> None:
        os.umask(0o077)
        self.lay.ensure()
        self._acquire_lock()
        self.log = JsonLog(self.lay.daemon_log, stderr=self.mode != "background")
        self.log("daemon_start", pid=os.getpid(), version=_version(), mode=self.mode, state_dir=str(self.lay.state),
                 engine="command" if self.s.foreign else "ember", settings=self.s.redacted())
        files = [(self.lay.worker_log, "worker")]
        if self.s.log_file:
            files.append((os.path.abspath(os.path.expanduser(self.s.log_file)), "engine"))
        from pathlib import Path

        self.watcher = LogWatcher([(Path(p), n) for p, n in files], ring_lines=self.s.ring_lines,
                                  on_poison=lambda line, info: self.inbox.put(("poison", line, info)),
                                  on_error=lambda e: self._log_err("logwatch_error", e))
        persisted = read_json(self.lay.persist_file) or {}
        self.watcher.prime(seen=persisted.get("log_pos") if supctl.alive(self.lay.supervisor_sock) else None)
        if not self.watcher.start():
            self._log_watch_change("degraded")
        self.conf_dirty = supctl.write_conf(self.lay, log_max_bytes=self.s.log_max_bytes,
                                            log_backups=self.s.log_backups,
                                            stop_timeout=self.s.effective_stop_timeout)
        if supctl.alive(self.lay.supervisor_sock):
            self._attach(persisted)
        else:
            self._cleanup_stale(persisted)
            self.sup_proc = supctl.spawn(self.lay)
            self.sup_pid = self.sup_proc.pid
            self.sup_ctime = _ctime(self.sup_pid)
            self.conf_dirty = False
            self._restore(persisted, counters_only=True)
            self.policy.close_breaker()  # this daemon starts the worker anyway: no cool-down pending
            self.log("supervisor_start", pid=self.sup_pid)
            self._spawn()
        self._start_scheduler()
        self.control = ControlServer(self.lay.control_sock, self.status_snapshot, self.commands,
                                     on_error=lambda e: self._log_err("control_error", e))
        self.control.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda n, f: self.commands.put("stop"))
        signal.signal(signal.SIGHUP, lambda n, f: self.commands.put("reload"))  # re-read ember.toml
        self._publish(force=True)
        self.notifier.ready(self._status_line())

    def _log_err(self, event: str, e: Exception) -> None:
        if self.log:
            self.log(event, level="error", error=f"{type(e).__name__}: {e}")

    def _restore(self, p: dict, counters_only: bool = False) -> None:
        self.restarts = int(p.get("restarts", 0))
        self.policy.load(p.get("policy"))
        self.last_crash = p.get("last_crash")
        self.last_recovery_seconds = p.get("last_recovery_seconds")
        self.incarnation = int(p.get("incarnation", 0))
        if not counters_only and p.get("phase") == "failed":
            self.failed_reason = p.get("failed_reason")

    def _cleanup_stale(self, p: dict) -> None:
        """A supervisord that no longer answers, or a worker orphaned by a killed supervisord: end
        them (only the exact processes recorded, checked by creation time) before starting anew."""
        for key in ("worker", "supervisor"):
            pid, ctime = p.get(f"{key}_pid"), p.get(f"{key}_ctime")
            if pid and ctime and _ctime(pid) == ctime:
                self.log("stale_process", level="warning", what=key, pid=pid)
                _kill_tree(pid, group=(key == "worker"))

    def _attach(self, p: dict) -> None:
        self.attached = True
        self._restore(p)
        try:
            self.sup_pid = self.rpc.supervisor.getPID()
            self.sup_ctime = _ctime(self.sup_pid)
            info = self.rpc.supervisor.getProcessInfo(supctl.PROGRAM)
        except (OSError, xmlrpc.client.Error) as e:
            raise DaemonError(f"supervisord answers but not sensibly: {e}") from None
        state = info["statename"]
        self.log("attach", supervisor_pid=self.sup_pid, worker_state=state, worker_pid=info.get("pid") or None)
        self.spawn_seq = self._incarnation_start_seq()
        self.scan_seq = self.spawn_seq
        if state in ALIVE:
            self.worker_pid = info["pid"]
            self.worker_ctime = _ctime(self.worker_pid)
            self.worker_started = self.worker_ctime or float(info.get("start") or time.time())
            self.spawn_m = time.monotonic()
            self.phase = "starting"  # verify readiness again before calling it ready
            self._oom_baseline()
            self.watcher.armed = True
        elif p.get("phase") in ("starting", "running", "killing") and state in ("EXITED", "FATAL", "BACKOFF"):
            # the worker died while no daemon watched: archive it now, then apply the policy
            self.worker_pid = p.get("worker_pid")
            self.worker_started = p.get("worker_started")
            self.phase = "running"
            self._on_exit(info, source="attach")
        elif self.failed_reason:
            self.phase = "failed"
        else:
            self._spawn()

    def _incarnation_start_seq(self) -> int:
        """The ring position just before the current worker's first line (its `config` line)."""
        lines = self.watcher.snapshot()
        for ln in reversed(lines):
            if ln.obj and ln.obj.get("event") == "config":
                return ln.seq - 1
        return lines[0].seq - 1 if lines else 0

    def _start_scheduler(self) -> None:
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        sched = BackgroundScheduler(executors={"default": ThreadPoolExecutor(4)}, timezone="UTC",
                                    job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30})
        sched.add_job(self._job_live, "interval", seconds=self.s.live_interval, id="live")
        sched.add_job(self._job_ready, "interval", seconds=self.s.ready_interval, id="ready")
        sched.add_job(self._job_startup, "interval", seconds=self.s.startup_poll, id="startup")
        sched.add_listener(self._on_sched_event, EVENT_JOB_MAX_INSTANCES | EVENT_JOB_ERROR | EVENT_JOB_MISSED)
        sched.start()
        self.sched = sched
        self._last_live_m = time.monotonic()

    def _on_sched_event(self, event) -> None:
        from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES

        kind = {EVENT_JOB_MAX_INSTANCES: "skipped: the previous run is still going",
                EVENT_JOB_ERROR: f"error: {getattr(event, 'exception', '')!r}"}.get(event.code, "missed its time")
        if event.job_id == "startup" and event.code != EVENT_JOB_ERROR:
            return
        self.inbox.put(("sched", {"ts": bundles.utc_iso(time.time()), "probe": event.job_id, "ok": None,
                                  "error": f"probe {kind}"}))

    def teardown(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if self.sched is not None:
            try:
                self.sched.shutdown(wait=False)
            except Exception:
                pass
        if self.control is not None:
            self.control.close()
        if self.watcher is not None:
            self.watcher.close()
        self.notifier.close()
        if self.log:
            self.log("daemon_exit", pid=os.getpid())
            self.log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # == probes (scheduler threads; they only read a snapshot and queue results) ========================

    def _target(self) -> tuple[int, int | None, str]:
        return self.incarnation, self.worker_pid, self.phase

    def _job_live(self) -> None:
        inc, pid, phase = self._target()
        if phase != "running" or not self.s.live_url:
            return
        rec = probes.live_probe(self.s.live_url, self.s.live_timeout)
        proc = probes.process_check(pid)
        rec["process"] = proc.get("status") or proc.get("error")
        if proc.get("cpu") is not None:
            rec["cpu"] = proc["cpu"]
        if not proc["ok"]:
            rec["ok"] = False
            rec["error"] = f"process: {proc.get('error')}"
        rec.update(pid=pid, incarnation=inc)
        self.inbox.put(("probe", rec))

    def _job_ready(self) -> None:
        inc, pid, phase = self._target()
        if phase != "running":
            return
        rec = probes.ready_probe(self.s.readiness_url, self.s.generation_url, self.s.ready_timeout, self.s.api_key)
        rec.update(pid=pid, incarnation=inc)
        self.inbox.put(("probe", rec))

    def _job_startup(self) -> None:
        inc, pid, phase = self._target()
        if phase != "starting":
            return
        rec = probes.ready_probe(self.s.readiness_url, self.s.generation_url, self.s.ready_timeout, self.s.api_key)
        rec.update(probe="startup", pid=pid, incarnation=inc)
        self.inbox.put(("probe", rec))

    # == the main loop ==================================================================================

    def run(self) -> int:
        try:
            self.setup()
        except DaemonError:
            self.teardown()
            raise
        except Exception as e:
            self._log_err("setup_error", e)
            self.teardown()
            raise DaemonError(f"could not start: {type(e).__name__}: {e}") from e
        try:
            while not self.exit_now:
                try:
                    self.tick()
                except Exception as e:  # the loop itself must survive anything one tick runs into
                    self._log_err("tick_error", e)
                    time.sleep(min(1.0, self.s.tick * 5))
                if not self.exit_now:
                    time.sleep(self.s.tick)
        finally:
            self._publish(force=True)
            self.teardown()
        return 0

    def tick(self) -> None:
        now_m = time.monotonic()
        self.notifier.ping(now_m)
        self._watch_logs()
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            self._command(cmd)
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            try:
                self._handle(item)
            except Exception as e:
                self._log_err("handler_error", e)
        if self.phase == "failed" and self.policy.due(time.time()):
            self._half_open()
        info = self._proc_info()
        if info is not None:
            self._advance(info)
        if self.policy.tick(time.time()):
            self.log("backoff_reset", healthy_seconds=self.s.backoff_reset)
        self._check_probe_freshness(now_m)
        self._publish()

    def _watch_logs(self) -> None:
        """Keep the log watcher going and read what is new. A failure here is logged (once per
        distinct error) and never stops the tick: commands and probes come after it."""
        try:
            self._log_watch_change(self.watcher.ensure_running())
            self.watcher.poll()
            self._scan_facts()
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            if msg != self._last_watch_error:
                self._last_watch_error = msg
                self._log_err("logwatch_error", e)

    def _log_watch_change(self, change: str | None) -> None:
        if change == "degraded":
            self.log("logwatch_degraded", level="error", error=self.watcher.failure,
                     note="the file watcher failed: reading the logs by polling every tick, trying it again")
        elif change == "recovered":
            self.log("logwatch_recovered")
        elif change == "restarted":
            self.log("logwatch_restarted", level="warning")

    def _half_open(self) -> None:
        """The breaker's cool-down is over: re-read ember.toml and try once more."""
        self.log("breaker_half_open", cooldown=self.policy.cooldown, failed_reason=self.failed_reason)
        self.policy.half_open()
        self._reload_settings()
        self._spawn()

    def _proc_info(self) -> dict | None:
        try:
            info = self.rpc.supervisor.getProcessInfo(supctl.PROGRAM)
        except (OSError, xmlrpc.client.Error) as e:
            if self.exit_now:
                return None
            if not self._supervisor_slow(e):
                self._supervisor_lost(e)
            return None
        self._sup_slow_since = None
        return info

    def _supervisor_slow(self, e: Exception) -> bool:
        """A supervisord that is alive but answers late (a starved or swapping box) gets the same
        patience as a silent worker, unresponsive_seconds, before it counts as lost: replacing it
        kills a worker that may be fine."""
        if not isinstance(e, TimeoutError) or not self.sup_pid or _ctime(self.sup_pid) != self.sup_ctime:
            return False
        now_m = time.monotonic()
        if self._sup_slow_since is None:
            self._sup_slow_since = now_m
            self.log("supervisor_slow", level="warning", error=f"{type(e).__name__}: {e}",
                     lost_after_seconds=self.s.unresponsive_seconds)
        return now_m - self._sup_slow_since < self.s.unresponsive_seconds

    def _supervisor_lost(self, e: Exception) -> None:
        """supervisord died or stopped answering: end its orphaned worker, start a new one, go on."""
        self.log("supervisor_lost", level="error", error=f"{type(e).__name__}: {e}")
        if self.worker_pid and _ctime(self.worker_pid) == self.worker_ctime:
            _kill_tree(self.worker_pid, group=True)
        if self.sup_pid and _ctime(self.sup_pid) == self.sup_ctime:
            _kill_tree(self.sup_pid, group=False)
        if self.sup_proc is not None:
            try:
                self.sup_proc.wait(timeout=5)
            except Exception:
                pass
        self.sup_proc = supctl.spawn(self.lay)
        self.sup_pid, self.sup_ctime = self.sup_proc.pid, _ctime(self.sup_proc.pid)
        self.log("supervisor_start", pid=self.sup_pid)
        if self.phase in ("starting", "running", "killing"):
            self.incident = None
            self._spawn()

    # -- facts from the worker's log ----------------------------------------------------------------

    def _scan_facts(self) -> None:
        for ln in self.watcher.lines_since(self.scan_seq):
            self.scan_seq = ln.seq
            if ln.seq <= self.spawn_seq:
                continue
            o = ln.obj
            if not o:
                continue
            ev = o.get("event")
            if ev == "config":
                self.facts.update(version=o.get("version"), config=o.get("config"), worker_pid=o.get("pid"))
            elif ev == "ready":
                for k in ("model", "fingerprint", "backend", "ctx", "max_seqs", "startup_seconds"):
                    if k in o:
                        self.facts[k] = o[k]
            elif ev == "config_error":
                self.facts["config_error"] = o.get("error")
            elif ev in OUTCOMES:
                self.outcomes += 1

    # -- commands ----------------------------------------------------------------------------------------

    def _reload_settings(self) -> None:
        """`ember start`/`ember restart` re-read ember.toml, so a fixed configuration applies."""
        if self.flags is None:
            return
        from .settings import SettingsError, load

        try:
            s = load(self.flags)
        except SettingsError as e:
            self.log("settings_error", level="error", error=str(e), note="keeping the previous settings")
            return
        self.s = s
        p = self.policy
        p.base, p.max, p.reset, p.crashes, p.window, p.cooldown = (
            s.backoff_base, s.backoff_max, s.backoff_reset, s.breaker_crashes, s.breaker_window, s.breaker_cooldown)
        self.secrets = [s.api_key, os.environ.get("EMBER_API_KEY")]
        if self.sched is not None:
            for job, every in (("live", s.live_interval), ("ready", s.ready_interval), ("startup", s.startup_poll)):
                try:
                    self.sched.reschedule_job(job, trigger="interval", seconds=every)
                except Exception as e:
                    self._log_err("reschedule_error", e)
        self.conf_dirty = supctl.write_conf(self.lay, log_max_bytes=s.log_max_bytes, log_backups=s.log_backups,
                                            stop_timeout=s.effective_stop_timeout) or self.conf_dirty

    def _command(self, cmd: str) -> None:
        self.log("command", command=cmd, phase=self.phase)
        if cmd in ("start", "restart", "reload"):
            self._reload_settings()  # applies from the next worker start on
        if cmd == "stop":
            if self.phase == "killing":
                self.pending = "exit"
            else:
                self._begin_stop("exit")
        elif cmd == "restart":
            self.policy.clear()
            self.failed_reason = None
            if self.phase == "killing":
                self.pending = "restart"
            elif self.phase in ("stopped", "failed", "backoff"):
                self._spawn()
            elif self.phase != "stopping":
                self._begin_stop("restart")
        elif cmd == "start":
            if self.phase in ("stopped", "failed"):
                self.policy.clear()
                self.failed_reason = None
                self._spawn()
            elif self.phase == "backoff":
                self._spawn()

    def _begin_stop(self, then: str) -> None:
        self.after_stop = then
        self.watcher.armed = False
        self.ready = False
        if self.phase in ("starting", "running") and self.worker_pid:
            try:
                self.rpc.supervisor.stopProcess(supctl.PROGRAM, False)
            except xmlrpc.client.Fault as e:
                self.log("stop_error", level="warning", error=e.faultString)
            except OSError as e:  # supervisord slow or gone: the same drain signal, sent directly
                self.log("stop_error", level="warning", error=f"{type(e).__name__}: {e}", note="sending SIGTERM")
                if _ctime(self.worker_pid) == self.worker_ctime:
                    try:
                        os.kill(self.worker_pid, signal.SIGTERM)
                    except OSError:
                        pass
            self.phase = "stopping"
            self.stop_deadline = time.monotonic() + self.s.effective_stop_timeout + 10
            self.log("worker_stop", pid=self.worker_pid, drain_seconds=self.s.drain_seconds)
        else:
            self.phase = "stopping"
            self._after_stopped()

    def _after_stopped(self) -> None:
        then, self.after_stop = self.after_stop, None
        if self.worker_pid:
            self.log("worker_stopped", pid=self.worker_pid)
        self.worker_pid = None
        if then == "restart":
            self._spawn()
        elif then == "exit":
            self.phase = "stopped"
            self.notifier.stopping()
            self._shutdown_supervisor()
            self.exit_now = True
        else:
            self.phase = "stopped"
        self._persist()

    def _shutdown_supervisor(self) -> None:
        try:
            self.rpc.supervisor.shutdown()
        except (OSError, xmlrpc.client.Error):
            pass
        deadline = time.monotonic() + 10
        if self.sup_proc is not None:
            try:
                self.sup_proc.wait(timeout=10)
            except Exception:
                self.sup_proc.kill()
                self.sup_proc.wait()
        elif self.sup_pid:
            try:
                p = psutil.Process(self.sup_pid)
                if p.create_time() == self.sup_ctime:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                _kill_tree(self.sup_pid, group=False)
            except psutil.Error:
                pass
        self.log("supervisor_stopped", pid=self.sup_pid)

    # -- queued detections and probe results -------------------------------------------------------------

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "poison":
            line, info = item[1], item[2]
            if self.phase in ("starting", "running") and line.seq > self.spawn_seq:
                reason = f"poisoned compute context in the log: {info.get('name') or info.get('code')}"
                self._incident(detect.POISONED, reason, "log", crash_seq=line.seq, cuda=_cuda(info),
                               grace=self.s.poison_grace, minimal=True, details={"log_line": line.text[:2000]})
            return
        if kind == "sched":
            self.health.append(item[1])
            self.log("probe_scheduler", level="warning", **item[1])
            return
        rec = item[1]
        if rec.get("incarnation") != self.incarnation:
            return  # a result about an earlier worker
        probe = rec["probe"]
        if probe == "startup":
            self._on_startup_probe(rec)
        elif probe == "live":
            self._last_live_m = time.monotonic()
            self.health.append(rec)
            if self.phase == "running":
                self._on_live(rec)
        elif probe == "ready":
            self.health.append(rec)
            if self.phase == "running":
                self._on_ready_probe(rec)

    def _on_startup_probe(self, rec: dict) -> None:
        if self.phase != "starting":
            return
        if rec.get("state") == "poisoned":
            self.health.append(rec)
            self._incident(detect.POISONED, "the worker reports a poisoned context while starting", "startup",
                           grace=self.s.poison_grace, minimal=True)
            return
        if not rec.get("ok"):
            self.not_ready_reason = f"starting: {rec.get('error')}"
            return
        self.health.append(rec)
        now_m = time.monotonic()
        self.phase = "running"
        self.ready = True
        self.ready_at = time.time()
        self.not_ready_reason = None
        self.policy.on_ready(time.time())
        self._last_live_m = now_m
        fields = {"pid": self.worker_pid, "startup_seconds": round(now_m - self.spawn_m, 3),
                  "model": self.facts.get("model"), "endpoint": self.s.endpoint}
        if self.recovering:
            secs = round(now_m - self.recovering["m_detect"], 3)
            self.last_recovery_seconds = secs
            fields.update(crash_id=self.recovering.get("id"), detection_to_ready_seconds=secs)
            self.recovering = None
        self.log("worker_ready", **fields)
        self._persist()

    def _on_live(self, rec: dict) -> None:
        now_m = time.monotonic()
        was = self.live.status(now_m, self.s)
        kill = self.live.observe(rec, now_m, self.s)
        if kill is not None:
            self._kill_for(kill)
        elif self.live.fails == self.s.live_failures:  # patience begins: say so once, with the limit
            self.log("liveness_failing", level="warning", failures=self.live.fails, error=rec.get("error"),
                     process=rec.get("process"), unresponsive_after_seconds=self.s.unresponsive_seconds)
        elif was and was["failures"] >= self.s.live_failures and self.live.fails == 0:
            self.log("liveness_recovered", failures=was["failures"], seconds=was["failing_seconds"])

    def _on_ready_probe(self, rec: dict) -> None:
        if rec.get("ok"):
            if not self.ready:
                self.log("worker_ready_again", pid=self.worker_pid)
            self.ready = True
            self.not_ready_reason = None
            self.policy.on_ready(time.time())
        elif rec.get("busy"):  # answering, queue full: neither ready nor hung, nothing to change
            if not self.ready:
                self.not_ready_reason = rec.get("error")
        else:
            if self.ready:
                self.log("worker_not_ready", level="warning", error=rec.get("error"))
            self.ready = False
            self.not_ready_reason = rec.get("error")
            self.policy.on_not_ready()
        kill = self.readiness.observe(rec, time.monotonic(), self.s, self.live, self.outcomes)
        if kill is not None:
            self._kill_for(kill)

    def _kill_for(self, k: Kill) -> None:
        self._incident(k.cls, k.reason, k.source, cuda=_cuda(k.cuda), minimal=k.minimal, details=k.details,
                       grace=self.s.poison_grace if k.poison_grace else 0.0)

    def _check_probe_freshness(self, now_m: float) -> None:
        if self.phase != "running" or self.sched is None:
            self._last_live_m = now_m
            return
        limit = self.s.live_interval + self.s.live_timeout + 5.0
        if now_m - self._last_live_m > limit:
            rec = {"ts": bundles.utc_iso(time.time()), "probe": "live", "ok": None,
                   "error": f"no liveness result for {now_m - self._last_live_m:.0f}s: restarting the probe scheduler"}
            self.health.append(rec)
            self.log("probe_stalled", level="error", **rec)
            try:
                self.sched.shutdown(wait=False)
            except Exception:
                pass
            self._start_scheduler()

    # -- the worker's lifecycle ------------------------------------------------------------------------

    def _write_launch(self) -> list[str]:
        argv = worker_command(self.s)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_", "EMBER_DAEMON_"))}
        env.setdefault("PYTHONUNBUFFERED", "1")
        import json

        write_private(self.lay.launch_file, json.dumps({"argv": argv, "env": env, "cwd": str(self.lay.state)}))
        return argv

    def _port_owner(self) -> str | None:
        """Someone else already listens where the worker should (a server started by hand, say):
        wait a moment for it to go, then say who it is instead of crash-looping on the bind."""
        from urllib.parse import urlsplit

        if self.s.foreign:
            u = urlsplit(self.s.live_url)
            host, port = u.hostname or "127.0.0.1", u.port or 80
        else:
            host, port = self.s.host, self.s.port
        deadline = time.monotonic() + 3.0
        while True:
            try:  # bind as the server will (SO_REUSEADDR, like uvicorn): exactly its chance to succeed
                fam = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.socket(fam, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind((host, port))
                return None
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    return None  # not ours to judge (an address of another host, say)
            if time.monotonic() >= deadline:
                break
            self.notifier.ping()
            time.sleep(0.2)
        who = ""
        try:
            for c in psutil.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                    p = psutil.Process(c.pid)
                    who = f" by pid {c.pid} ({' '.join(p.cmdline()[:4])})"
                    break
        except (psutil.Error, OSError):
            pass
        return f"port {port} on {host} is already in use{who}; stop that server or choose another port"

    def _spawn(self) -> None:
        if self.conf_dirty:
            self._apply_conf()
        busy = self._port_owner()
        if busy:
            self._reset_worker()
            if self.policy.trial:  # the try after a cool-down: wait another one, do not give up
                self._fail(self.policy.open_now(time.time(), f"the restart after the cool-down could not "
                                                             f"start: {busy}").reason)
            else:
                self._fail(busy)
            return
        argv = self._write_launch()
        self.watcher.poll()
        self._reset_worker()
        self.spawn_seq = self.scan_seq = self.watcher.seq
        self.incarnation += 1
        try:
            self.rpc.supervisor.startProcess(supctl.PROGRAM, False)
        except xmlrpc.client.Fault as e:
            if e.faultCode != 60:  # ALREADY_STARTED is fine
                self.policy.close_breaker()  # the command itself cannot run: configuration, never retried
                self._fail(f"could not start the engine: {e.faultString}")
                return
        info = self.rpc.supervisor.getProcessInfo(supctl.PROGRAM)
        self.worker_pid = info.get("pid") or None
        self.worker_ctime = _ctime(self.worker_pid) if self.worker_pid else None
        self.worker_started = self.worker_ctime or float(info.get("start") or time.time())
        self.spawn_m = time.monotonic()
        self.phase = "starting"
        self.not_ready_reason = "starting"
        self.failed_reason = None
        self.watcher.armed = True
        self._oom_baseline()
        self.log("worker_spawn", pid=self.worker_pid, incarnation=self.incarnation,
                 command=_redact_cmd(argv), restarts=self.restarts)
        self._persist()

    def _apply_conf(self) -> None:
        try:
            added, changed, removed = self.rpc.supervisor.reloadConfig()[0]
            if supctl.PROGRAM in changed:
                self.rpc.supervisor.removeProcessGroup(supctl.PROGRAM)
                self.rpc.supervisor.addProcessGroup(supctl.PROGRAM)
            self.log("supervisor_reconfigured", changed=changed)
        except (OSError, xmlrpc.client.Error) as e:
            self.log("supervisor_reconfigure_error", level="warning", error=str(e))
        self.conf_dirty = False

    def _fail(self, reason: str) -> None:
        self.phase = "failed"
        self.failed_reason = reason
        self.ready = False
        self.not_ready_reason = reason
        self.watcher.armed = False
        self.log("worker_failed", level="error", reason=reason)
        self._persist()

    def _oom_baseline(self) -> None:
        self.oom_events, self.oom_base = _oom_counter(self.worker_pid)

    def _advance(self, info: dict) -> None:
        state = info["statename"]
        alive = state in ALIVE
        now_m = time.monotonic()
        if self.phase in ("starting", "running"):
            if not alive:
                self._on_exit(info, source="exit")
            elif self.phase == "starting" and now_m - self.spawn_m > self.s.startup_timeout:
                self._incident(detect.HANG, f"not ready {self.s.startup_timeout:g}s after start "
                                            f"({self.not_ready_reason})", "startup")
        elif self.phase == "killing":
            inc = self.incident
            if not alive:
                self._finalize(info)
            elif not inc.killed and now_m >= inc.kill_at:
                self._kill(inc)
            elif inc.killed and now_m > inc.kill_deadline:
                self.log("kill_timeout", level="error", pid=inc.pid)
                inc.exit["note"] = "the process did not die after SIGKILL"
                self._finalize(info)
        elif self.phase == "backoff":
            if now_m >= self.backoff_until:
                self._spawn()
        elif self.phase == "stopping":
            if not alive:
                self._after_stopped()
            elif now_m > self.stop_deadline and self.worker_pid:
                self.log("stop_timeout", level="error", pid=self.worker_pid)
                _kill_tree(self.worker_pid, group=True)

    def _kill(self, inc: Incident) -> None:
        inc.killed = True
        inc.kill_deadline = time.monotonic() + 15
        inc.exit["killed_by_daemon"] = True
        if inc.pid and _ctime(inc.pid) == self.worker_ctime:
            self.log("worker_kill", pid=inc.pid, signal="SIGKILL", incident=inc.cls)
            _kill_tree(inc.pid, group=True)

    def _incident(self, cls: str, reason: str, source: str, *, crash_seq: int | None = None, cuda: dict | None = None,
                  grace: float = 0.0, minimal: bool = False, details: dict | None = None) -> None:
        if self.phase not in ("starting", "running"):
            return
        now_m = time.monotonic()
        inc = Incident(cls, reason, source, time.time(), now_m, self.worker_pid, crash_seq=crash_seq, cuda=cuda,
                       minimal=minimal, details=details or {})
        self.incident = inc
        self.phase = "killing"
        self.ready = False
        self.not_ready_reason = f"restarting: {reason}"
        self.watcher.armed = False
        self.policy.on_not_ready()
        self.log("incident", level="error", incident=cls, reason=reason, source=source, pid=self.worker_pid)
        inc.kill_at = now_m + grace
        stuck = cls in (detect.HANG, detect.UNRESPONSIVE, detect.UNHEALTHY)
        if stuck and not self.s.foreign and self.s.dump_signal and inc.pid:
            sig = getattr(signal, "SIG" + self.s.dump_signal.upper().removeprefix("SIG"))
            try:
                if _ctime(inc.pid) == self.worker_ctime:
                    os.kill(inc.pid, sig)  # thread stacks into the log, if the engine dumps on it
                    inc.details["dump_signal"] = sig.name
                    inc.exit["killed_by_daemon"] = True
            except OSError:
                pass
            inc.kill_at = now_m + self.s.kill_grace
        self.notifier.status(self._status_line())

    def _exit_info(self, info: dict) -> dict:
        out: dict[str, Any] = {}
        es = info.get("exitstatus")
        sup = supctl.last_exit(self.lay)
        if sup.get("signal"):
            out["signal"] = sup["signal"]
            out["signal_number"] = supctl.signum(sup["signal"])
            out["core_dumped"] = bool(sup.get("core"))
        elif es is not None and es >= 0 and info["statename"] == "EXITED":
            out["code"] = es
        elif "code" in sup:
            out["code"] = sup["code"]
        if info.get("spawnerr") and info["statename"] in ("FATAL", "BACKOFF"):
            out["spawn_error"] = info["spawnerr"]
        if sup.get("text"):
            out["supervisor"] = sup["text"]
        return out

    def _on_exit(self, info: dict, source: str) -> None:
        """The worker exited without being asked (or died while no daemon watched)."""
        self.watcher.poll()
        self._scan_facts()
        ex = self._exit_info(info)
        code = ex.get("code")
        if info["statename"] == "FATAL" or code == 78:
            why = self.facts.get("config_error") or self._last_launch_error() or ex.get("spawn_error") or "exit 78"
            self.log("worker_exit", level="error", pid=self.worker_pid, **ex)
            self.policy.close_breaker()  # a configuration error is never retried by a cool-down
            self._fail(f"configuration error (exit 78, not restarting): {why}")
            self.worker_pid = None
            return
        if code == 0:
            self.log("worker_exit", level="warning", pid=self.worker_pid, code=0,
                     note="the worker stopped cleanly without being asked; restarting it")
            decision = self.policy.on_failure(time.time(), "clean exit")
            self.worker_pid = None
            self._apply_decision(decision)
            return
        if code == 75:
            cls, reason = detect.POISONED, "exit 75: poisoned compute context"
        elif ex.get("signal"):
            cls, reason = detect.CRASH_SIGNAL, f"killed by {ex['signal']}" + (" (core dumped)" if ex.get("core_dumped") else "")
        else:
            cls, reason = detect.CRASH_EXIT, f"exit {code}"
        now_m = time.monotonic()
        self.incident = Incident(cls, reason, source, time.time(), now_m, self.worker_pid, minimal=(code == 75), exit=ex)
        self.phase = "killing"
        self.log("incident", level="error", incident=cls, reason=reason, source=source, pid=self.worker_pid)
        self._finalize(info)

    def _last_launch_error(self) -> str | None:
        for ln in reversed(self.watcher.lines_since(self.spawn_seq)):
            if ln.obj and ln.obj.get("event") in ("launch_error", "config_error"):
                return ln.obj.get("error")
        return None

    def _finalize(self, info: dict) -> None:
        """The worker is gone: classify, archive, decide."""
        inc = self.incident
        self.watcher.poll()
        self._scan_facts()
        ex = {**self._exit_info(info), **inc.exit}
        inc.exit = ex
        lines = self.watcher.lines_since(self.spawn_seq)
        poison_line, poison_info = None, None
        for ln in lines:
            pi = detect.poison_in_line(ln.text, ln.obj)
            if pi:
                poison_line, poison_info = ln, pi
                break
        if ex.get("code") == 75 or (poison_info and inc.cls in (detect.CRASH_EXIT, detect.CRASH_SIGNAL)):
            inc.cls = detect.POISONED
            inc.minimal = True
        if inc.cls == detect.POISONED and poison_line is not None:
            inc.crash_seq = inc.crash_seq or poison_line.seq
            inc.cuda = inc.cuda or _cuda(poison_info)
        if inc.cls in (detect.CRASH_EXIT, detect.CRASH_SIGNAL) and self._is_oom(ex, lines):
            inc.cls = detect.OOM
        decision = self.policy.on_failure(inc.t_detect, inc.cls, minimal=inc.minimal)
        if self.pending in ("exit", "restart"):
            decision = Decision(False, 0.0, f"{self.pending} requested")
        crash_id = None
        try:
            crash_id = self._write_bundle(inc, lines, decision)
        except Exception as e:
            self._log_err("bundle_error", e)
        self.last_crash = {"id": crash_id, "class": inc.cls, "detected_at": bundles.utc_iso(inc.t_detect),
                           "reason": inc.reason, "signature": getattr(self, "_last_signature", None)}
        self.recovering = {"id": crash_id, "m_detect": inc.m_detect}
        self.incident = None
        self.worker_pid = None
        pending, self.pending = self.pending, None
        if pending == "exit":
            self.phase = "stopping"
            self.after_stop = "exit"
            self._after_stopped()
        elif pending == "restart":
            self.policy.clear()
            self._spawn()
        else:
            self._apply_decision(decision, since=inc.m_detect)

    def _apply_decision(self, decision: Decision, since: float | None = None) -> None:
        """Restart `decision.delay` seconds after the failure was seen (archiving counts as waiting)."""
        if decision.restart:
            self.restarts += 1
            self.phase = "backoff"
            self.backoff_until = (time.monotonic() if since is None else since) + decision.delay
            self.not_ready_reason = f"restarting in {decision.delay:g}s"
            self.log("restart_scheduled", delay=decision.delay, reason=decision.reason, restarts=self.restarts)
            self._persist()
        else:
            self._fail(decision.reason)

    def _is_oom(self, ex: dict, lines: list[Line]) -> bool:
        if ex.get("signal") == "SIGKILL" and not ex.get("killed_by_daemon") and self.oom_events:
            _, now = _oom_counter(None, self.oom_events)
            if now is not None and self.oom_base is not None and now > self.oom_base:
                return True
        return any(detect.oom_in_text(ln.text, ln.obj) for ln in lines[-50:])

    def _write_bundle(self, inc: Incident, lines: list[Line], decision: Decision) -> str:
        s = self.s
        window, winfo = bundles.log_window(lines, inc.crash_seq, context=s.window_context)
        events = bundles.session_events(lines, inc.t_detect - s.events_seconds)
        health = list(self.health)[-s.health_records:]
        detail = ""
        if inc.cls in (detect.CRASH_EXIT, detect.OOM):
            detail = bundles.last_error_line(lines[-200:])
        sig, sig_text = bundles.signature(inc.cls, inc.cuda, inc.exit, detail)
        self._last_signature = sig
        uptime = (inc.t_detect - self.worker_started) if self.worker_started else None
        meta = {
            "schema": bundles.SCHEMA,
            "id": bundles.bundle_id(inc.t_detect, inc.cls),
            "class": inc.cls,
            "signature": sig,
            "signature_text": sig_text,
            "detected_at": bundles.utc_iso(inc.t_detect),
            "detection": {"source": inc.source, "reason": inc.reason, **inc.details},
            "exit": inc.exit,
            "exit_code": inc.exit.get("code"),
            "signal": inc.exit.get("signal"),
            "cuda_error": inc.cuda,
            "uptime_seconds": round(uptime, 3) if uptime is not None else None,
            "restart_count": self.restarts,
            "backoff_level": self.policy.level,
            "restart": decision.as_dict(),
            "worker": {
                "engine": "command" if s.foreign else "ember",
                "pid": inc.pid,
                "started_at": bundles.utc_iso(self.worker_started) if self.worker_started else None,
                "version": self.facts.get("version"),
                "command": _redact_cmd(worker_command(s)),
                "config": self.facts.get("config"),
                "model": self.facts.get("model"),
                "model_fingerprint": self.facts.get("fingerprint"),
                "backend": self.facts.get("backend"),
                "endpoint": s.endpoint,
            },
            "log_window": winfo,
            "events": {"count": len(events), "seconds": s.events_seconds},
            "health": {"count": len(health)},
            "daemon": {"version": _version(), "pid": os.getpid(), "settings": s.redacted()},
            "host": host_facts(),
            "gpu": gpu_facts(),
        }
        scrub = bundles.Scrubber(self.secrets)
        path = bundles.write_bundle(self.lay.crashes, meta, window, events, health, scrub)
        removed = bundles.enforce_retention(self.lay.crashes, s.crash_keep, s.crash_max_bytes, protect=path.name)
        self.log("crash_bundle", id=path.name, incident=inc.cls, signature=sig, path=str(path),
                 window_lines=len(window), events=len(events), removed=removed or None)
        return path.name

    # == status ===========================================================================================

    def _worker_state(self) -> str:
        if self.phase == "running":
            return "ready" if self.ready else "not-ready"
        return {"killing": "restarting"}.get(self.phase, self.phase)

    def _status_line(self) -> str:
        st = self._worker_state()
        if st == "failed":
            return f"failed: {self.failed_reason}"
        return f"worker {st}" + (f" (pid {self.worker_pid})" if self.worker_pid else "")

    def status_snapshot(self) -> dict[str, Any]:
        with self._status_lock:
            return dict(self._status)

    def _build_status(self) -> dict[str, Any]:
        now = time.time()
        st = self._worker_state()
        live = next((h for h in reversed(self.health) if h.get("probe") == "live"), None)
        ready = next((h for h in reversed(self.health) if h.get("probe") in ("ready", "startup")), None)
        return {
            "schema": 1,
            "updated_at": bundles.utc_iso(now),
            "state": st,
            "ready": st == "ready",
            "endpoint": self.s.endpoint,
            "not_ready_reason": None if st == "ready" else (self.failed_reason or self.not_ready_reason or st),
            "failed_reason": self.failed_reason,
            "daemon": {"pid": os.getpid(), "started_at": bundles.utc_iso(self.started_at),
                       "uptime_seconds": round(now - self.started_at, 1), "mode": self.mode,
                       "version": _version(), "attached": self.attached, "state_dir": str(self.lay.state),
                       "supervisor_pid": self.sup_pid},
            "worker": {"pid": self.worker_pid, "state": st, "engine": "command" if self.s.foreign else "ember",
                       "started_at": bundles.utc_iso(self.worker_started) if self.worker_pid and self.worker_started else None,
                       "uptime_seconds": round(now - self.worker_started, 1) if self.worker_pid and self.worker_started else None,
                       "model": self.facts.get("model"), "fingerprint": self.facts.get("fingerprint"),
                       "version": self.facts.get("version"), "incarnation": self.incarnation},
            "restarts": self.restarts,
            "backoff_level": self.policy.level,
            "next_restart_in": round(max(0.0, self.backoff_until - time.monotonic()), 1) if self.phase == "backoff" else None,
            "last_crash": self.last_crash,
            "last_recovery_seconds": self.last_recovery_seconds,
            "breaker": self.policy.status(now),
            "liveness": self.live.status(time.monotonic(), self.s) if self.phase == "running" else None,
            "log_watch": {"mode": self.watcher.mode, "error": self.watcher.failure} if self.watcher else None,
            "probes": {"live": live, "ready": ready},
        }

    def _publish(self, force: bool = False) -> None:
        st = self._build_status()
        with self._status_lock:
            self._status = st
        volatile = ("updated_at", "daemon", "worker", "probes", "liveness")
        key = repr({k: v for k, v in st.items() if k not in volatile}) + repr(
            {k: st["worker"][k] for k in ("pid", "state", "model")})
        if force or key != self._status_written[0] or time.monotonic() - self._status_written[1] > 5:
            if self.exit_now:
                st = {**st, "state": "stopped", "daemon": {**st["daemon"], "pid": None}}
            try:
                write_json(self.lay.status_file, st)
            except OSError:
                pass
            self._status_written = (key, time.monotonic())
            self.notifier.status(self._status_line())
        self._persist()

    def _persist(self) -> None:
        p = {"phase": self.phase, "failed_reason": self.failed_reason, "restarts": self.restarts,
             "policy": self.policy.dump(), "last_crash": self.last_crash,
             "last_recovery_seconds": self.last_recovery_seconds, "incarnation": self.incarnation,
             "worker_pid": self.worker_pid, "worker_ctime": self.worker_ctime, "worker_started": self.worker_started,
             "supervisor_pid": self.sup_pid, "supervisor_ctime": self.sup_ctime, "daemon_pid": os.getpid()}
        now_m = time.monotonic()
        if self.watcher is not None and now_m - self._log_pos_at >= 2.0:  # what was read, for a re-attach
            self._log_pos = self.watcher.positions()
            self._log_pos_at = now_m
        p["log_pos"] = self._log_pos
        import json

        text = json.dumps(p, sort_keys=True)
        if text != self._persisted:
            try:
                write_private(self.lay.persist_file, text + "\n")
                self._persisted = text
            except OSError:
                pass


# == helpers ================================================================================================

def _cuda(info: dict | None) -> dict | None:
    if not info:
        return None
    out = {k: info.get(k) for k in ("code", "name", "message") if info.get(k) is not None}
    if "line" in info:
        out["line"] = info["line"]
    return out or None


def _redact_cmd(argv: list[str]) -> list[str]:
    from .settings import redact_argv

    return redact_argv(argv)


def _ctime(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _kill_tree(pid: int, group: bool) -> None:
    """SIGKILL a process (and its process group, for the worker: supervisord made it a leader)."""
    try:
        if group:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p = psutil.Process(pid)
        kids = p.children(recursive=True)
        for k in kids:
            try:
                k.kill()
            except psutil.Error:
                pass
        p.kill()
        psutil.wait_procs([p, *kids], timeout=5)
    except (psutil.Error, OSError):
        pass


def _oom_counter(pid: int | None, path: str | None = None) -> tuple[str | None, int | None]:
    """(memory.events path of the process's cgroup, its oom_kill count) — cgroup v2 only."""
    try:
        if path is None:
            if not pid:
                return None, None
            with open(f"/proc/{pid}/cgroup") as f:
                rel = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
            if rel is None:
                return None, None
            path = f"/sys/fs/cgroup{rel}/memory.events"
        with open(path) as f:
            for ln in f:
                k, _, v = ln.partition(" ")
                if k == "oom_kill":
                    return path, int(v)
        return path, None
    except (OSError, ValueError):
        return path, None
