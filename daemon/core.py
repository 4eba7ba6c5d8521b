"""`ember daemon run`: the daemon process around the worker's lifecycle.

    systemd (Type=notify) or `ember start`  ->  this loop  ->  supervisord (XML-RPC)  ->  worker
                                                 |  probes (APScheduler), log watch (watchdog), psutil
                                                 '-> crash bundles, status, restart policy

One thread decides. Each tick the main loop pings systemd's watchdog, reads the logs (the watcher
queues the poisoned contexts it sees), hands the control socket's commands and the queued
detections and probe results to the lifecycle, then gives the lifecycle supervisord's view of the
worker for its time-driven transitions (lifecycle.py; the phases and transitions: phases.py), and
publishes status.json. The log watcher and the probes never block the loop: `ember stop` is a
command it drains every tick.

This module owns the process, not the worker: the lock, the daemon's log, the control socket and
the signals (opened and closed as every daemon does: shell.py), supervisord (spawned, re-attached,
replaced when lost) and the probe scheduler.
Killing the daemon leaves supervisord and the worker serving; the next daemon re-attaches to them
(what it needs is persisted in run/state.json). SIGTERM, SIGINT or `ember stop` drain the worker,
stop supervisord and exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ember.ops.contract import iso_utc

from .lifecycle import Lifecycle, PoisonSeen
from .logwatch import LogWatcher
from .paths import Layout, read_json, write_json, write_private
from .phases import Phase, Status
from .policy import RestartPolicy
from .probe_schedule import ProbeMissed, ProbeSchedule
from .probes import ProbeResult
from .procs import ctime, kill_tree
from .settings import Settings, SettingsError, load
from .shell import DaemonError, DaemonShell
from .status import build_status
from .supctl import ProcessInfo
from .supervisor import RpcError, Supervisor
from .sysfacts import ember_version

LOG_POS_EVERY = 2.0  # seconds between saving how far the logs were read (for a re-attach)
STATUS_EVERY = 5.0  # status.json is rewritten at least this often, and at once when something changes


class Daemon:
    def __init__(self, settings: Settings, layout: Layout, *, mode: str = "foreground",
                 flags: dict[str, Any] | None = None):
        self.s = settings
        self.flags = flags  # the command-line settings, kept when ember.toml is re-read
        self.lay = layout
        self.shell = DaemonShell(layout, mode)
        self.mode, self.notifier, self.log = self.shell.mode, self.shell.notifier, self.shell.log
        self.inbox: queue.Queue[PoisonSeen | ProbeMissed | ProbeResult] = queue.Queue()
        self.commands: queue.Queue[str] = queue.Queue()
        self.sup = Supervisor(layout, self.log)
        files = [(layout.worker_log, "worker")]
        if settings.log_file:
            files.append((Path(os.path.abspath(os.path.expanduser(settings.log_file))), "engine"))
        self.watcher = LogWatcher(files, ring_lines=settings.ring_lines,
                                  on_poison=lambda line, info: self.inbox.put(PoisonSeen(line, info)),
                                  on_error=lambda e: self.log_error("logwatch_error", e),
                                  signatures=settings.signatures)
        policy = RestartPolicy(settings.backoff_base, settings.backoff_max, settings.backoff_reset,
                               settings.breaker_crashes, settings.breaker_window, settings.breaker_cooldown)
        self.life = Lifecycle(settings, layout, self.log, self.sup, self.watcher, policy, self.notifier,
                              persist=self._persist, reload=self._reload_settings)
        self.schedule = ProbeSchedule(settings, self.life.target, self.inbox)
        self.started_at = self.shell.started_at
        self.attached = False
        self._status: dict[str, Any] = {}
        self._status_lock = threading.Lock()
        self._status_written = ("", 0.0)
        self._persisted = ""
        self._log_pos: dict[str, list[int]] = {}
        self._log_pos_at = 0.0
        self._last_watch_error = ""

    def log_error(self, event: str, e: Exception) -> None:
        self.log(event, level="error", error=f"{type(e).__name__}: {e}")

    # == setup and teardown ================================================================================

    def setup(self) -> None:
        self.shell.open(engine=self.s.engine_label, settings=self.s.redacted())
        persisted = read_json(self.lay.persist_file) or {}
        found = self.sup.running()
        self.watcher.prime(seen=persisted.get("log_pos") if found else None)
        if not self.watcher.start():
            self._log_watch_change("degraded")
        self.sup.write_conf(self.s)
        if found:
            self._attach(persisted)
        else:
            self._cleanup_stale(persisted)
            self.sup.spawn()
            self.life.restore(persisted, counters_only=True)
            self.life.policy.close_breaker()  # this daemon starts the worker anyway: no cool-down pending
            self.life.spawn("the daemon started")
        self.schedule.start()
        self.life.last_live_m = time.monotonic()
        self.shell.serve(self.status_snapshot, self.commands, reload=True)  # SIGHUP: re-read ember.toml
        self._publish(force=True)
        self.notifier.ready(self.life.status_line())

    def _attach(self, persisted: dict[str, Any]) -> None:
        self.attached = True
        try:
            info = self.sup.attach()
        except RpcError as e:
            raise DaemonError(f"supervisord answers but not sensibly: {e}") from None
        self.log("attach", supervisor_pid=self.sup.pid, worker_state=info.statename, worker_pid=info.pid)
        self.life.attach(info, persisted)

    def _cleanup_stale(self, p: dict[str, Any]) -> None:
        """A supervisord that no longer answers, or a worker orphaned by a killed supervisord: end
        them (only the exact processes recorded, checked by creation time) before starting anew."""
        for key in ("worker", "supervisor"):
            pid, created = p.get(f"{key}_pid"), p.get(f"{key}_ctime")
            if pid and created and ctime(pid) == created:
                self.log("stale_process", level="warning", what=key, pid=pid)
                kill_tree(pid, group=(key == "worker"))

    def teardown(self) -> None:
        self.schedule.stop()
        self.watcher.close()
        self.shell.close()

    # == the main loop =======================================================================================

    def run(self) -> int:
        try:
            self.setup()
        except DaemonError:
            self.teardown()
            raise
        except Exception as e:
            self.log_error("setup_error", e)
            self.teardown()
            raise DaemonError(f"could not start: {type(e).__name__}: {e}") from e
        try:
            while not self.life.done:
                try:
                    self.tick()
                except Exception as e:  # the loop itself must survive anything one tick runs into
                    self.log_error("tick_error", e)
                    time.sleep(min(1.0, self.s.tick * 5))
                if not self.life.done:
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
            self.life.command(cmd)
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            try:
                self.life.handle(item)
            except Exception as e:
                self.log_error("handler_error", e)
        info = self._supervisor_view()
        if info is not None:
            self.life.transition(info)
        if self.life.policy.tick(time.time()):
            self.log("backoff_reset", healthy_seconds=self.s.backoff_reset)
        self._check_probes(now_m)
        self._publish()

    def _watch_logs(self) -> None:
        """Keep the log watcher going and read what is new. A failure here is logged (once per
        distinct error) and never stops the tick: commands and probes come after it."""
        try:
            self._log_watch_change(self.watcher.ensure_running())
            self.watcher.poll()
            self.life.scan_log()
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            if msg != self._last_watch_error:
                self._last_watch_error = msg
                self.log_error("logwatch_error", e)

    def _log_watch_change(self, change: str | None) -> None:
        if change == "degraded":
            self.log("logwatch_degraded", level="error", error=self.watcher.failure,
                     note="the file watcher failed: reading the logs by polling every tick, trying it again")
        elif change == "recovered":
            self.log("logwatch_recovered")
        elif change == "restarted":
            self.log("logwatch_restarted", level="warning")

    def _supervisor_view(self) -> ProcessInfo | None:
        """supervisord's view of the worker; None when it does not answer (then maybe replace it)."""
        try:
            return self.sup.info()
        except RpcError as e:
            if self.life.done:
                return None
            if not self.sup.slow(e, self.s.unresponsive_seconds):
                self._supervisor_lost(e)
            return None

    def _supervisor_lost(self, e: Exception) -> None:
        """supervisord died or stopped answering: end its orphaned worker, start a new one, go on."""
        self.log("supervisor_lost", level="error", error=f"{type(e).__name__}: {e}")
        self.life.kill_orphan()
        self.sup.replace()
        self.life.after_supervisor_lost()

    def _check_probes(self, now_m: float) -> None:
        """A probe scheduler that stopped delivering liveness results is restarted."""
        life = self.life
        if life.phase is not Phase.RUNNING:
            life.last_live_m = now_m
            return
        stalled = self.schedule.restart_if_stalled(now_m - life.last_live_m)
        if stalled is not None:
            life.last_live_m = time.monotonic()
            life.health.append(stalled)
            self.log("probe_stalled", level="error", **stalled.record())

    def _reload_settings(self) -> None:
        """`ember start`/`ember restart`/SIGHUP re-read ember.toml, so a fixed configuration applies."""
        if self.flags is None:
            return
        try:
            s = load(self.flags)
        except SettingsError as e:
            self.log("settings_error", level="error", error=str(e), note="keeping the previous settings")
            return
        self.s = self.life.s = s
        p = self.life.policy
        p.base, p.max, p.reset, p.crashes, p.window, p.cooldown = (
            s.backoff_base, s.backoff_max, s.backoff_reset, s.breaker_crashes, s.breaker_window, s.breaker_cooldown)
        self.schedule.reschedule(s, on_error=lambda e: self.log_error("reschedule_error", e))
        self.sup.write_conf(s)

    # == status ==============================================================================================

    def status_snapshot(self) -> dict[str, Any]:
        with self._status_lock:
            return dict(self._status)

    def _daemon_facts(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "started_at": iso_utc(self.started_at),
                "uptime_seconds": round(time.time() - self.started_at, 1), "mode": self.mode,
                "version": ember_version(), "attached": self.attached, "state_dir": str(self.lay.state),
                "supervisor_pid": self.sup.pid}

    def _publish(self, force: bool = False) -> None:
        w = self.watcher
        st = build_status(self.life, daemon=self._daemon_facts(), log_watch={"mode": w.mode, "error": w.failure})
        with self._status_lock:
            self._status = st
        volatile = ("updated_at", "daemon", "worker", "probes", "liveness")
        key = repr({k: v for k, v in st.items() if k not in volatile}) + repr(
            {k: st["worker"][k] for k in ("pid", "state", "model")})
        if force or key != self._status_written[0] or time.monotonic() - self._status_written[1] > STATUS_EVERY:
            if self.life.done:
                st = {**st, "state": Status.STOPPED, "daemon": {**st["daemon"], "pid": None}}
            with contextlib.suppress(OSError):
                write_json(self.lay.status_file, st)
            self._status_written = (key, time.monotonic())
            self.notifier.status(self.life.status_line())
        self._persist()

    def _persist(self) -> None:
        p = {**self.life.persisted(), "supervisor_pid": self.sup.pid, "supervisor_ctime": self.sup.ctime,
             "daemon_pid": os.getpid()}
        now_m = time.monotonic()
        if now_m - self._log_pos_at >= LOG_POS_EVERY:  # what was read, for a re-attach
            self._log_pos = self.watcher.positions()
            self._log_pos_at = now_m
        p["log_pos"] = self._log_pos
        text = json.dumps(p, sort_keys=True)
        if text != self._persisted:
            try:
                write_private(self.lay.persist_file, text + "\n")
                self._persisted = text
            except OSError:
                pass
