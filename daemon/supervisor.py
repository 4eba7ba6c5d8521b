"""The supervisord this daemon drives: its process (spawned, found again after a daemon restart,
replaced when lost, shut down by `ember stop`) and typed calls about the worker program over its
XML-RPC socket. supctl.py holds the wire (socket transport, the config file, its exit lines); the
lifecycle decides when to call what.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import xmlrpc.client
from collections.abc import Callable
from typing import Any

import psutil

from . import supctl
from .incident import ExitInfo
from .paths import Layout, write_private
from .procs import ctime, kill_tree
from .settings import Settings
from .supctl import ProcessInfo

RpcError = (OSError, xmlrpc.client.Error)  # supervisord gone, slow, or answering with a fault


class Supervisor:
    def __init__(self, lay: Layout, log: Callable[..., Any]) -> None:
        self.lay = lay
        self.log = log
        self._rpc: Any = supctl.rpc(lay.supervisor_sock, timeout=5.0)
        self.proc: subprocess.Popen[bytes] | None = None  # set when this daemon spawned it
        self.pid: int | None = None
        self.ctime: float | None = None
        self.conf_dirty = False  # supervisord.conf changed since supervisord read it
        self._slow_since: float | None = None

    # -- its process -------------------------------------------------------------------------------

    def running(self) -> bool:
        return supctl.alive(self.lay.supervisor_sock)

    def is_ours(self) -> bool:
        """The recorded supervisord still runs (the same process, not a reused pid)."""
        return bool(self.pid) and ctime(self.pid) == self.ctime

    def spawn(self) -> None:
        self.proc = supctl.spawn(self.lay)
        self.pid, self.ctime = self.proc.pid, ctime(self.proc.pid)
        self.conf_dirty = False
        self.log("supervisor_start", pid=self.pid)

    def attach(self) -> ProcessInfo:
        """The running supervisord (started by an earlier daemon) and the worker's state in it."""
        self.pid = int(self._rpc.supervisor.getPID())
        self.ctime = ctime(self.pid)
        return self.info()

    def write_conf(self, s: Settings) -> None:
        changed = supctl.write_conf(self.lay, log_max_bytes=s.log_max_bytes, log_backups=s.log_backups,
                                    stop_timeout=s.effective_stop_timeout)
        self.conf_dirty = self.conf_dirty or changed

    def slow(self, e: Exception, patience: float) -> bool:
        """A supervisord that is alive but answers late (a starved or swapping box) gets `patience`
        seconds before it counts as lost: replacing it kills a worker that may be fine."""
        if not isinstance(e, TimeoutError) or not self.is_ours():
            return False
        now_m = time.monotonic()
        if self._slow_since is None:
            self._slow_since = now_m
            self.log("supervisor_slow", level="warning", error=f"{type(e).__name__}: {e}",
                     lost_after_seconds=patience)
        return now_m - self._slow_since < patience

    def replace(self) -> None:
        """supervisord died or stopped answering: end it (if it is still ours) and start a new one."""
        if self.is_ours():
            assert self.pid is not None
            kill_tree(self.pid, group=False)
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)
        self.spawn()

    def shutdown(self) -> None:
        """Stop supervisord (it stops the worker first) and wait for it to go."""
        with contextlib.suppress(*RpcError):
            self._rpc.supervisor.shutdown()
        deadline = time.monotonic() + 10
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        elif self.pid:
            try:
                p = psutil.Process(self.pid)
                if p.create_time() == self.ctime:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                kill_tree(self.pid, group=False)
            except psutil.Error:
                pass
        self.log("supervisor_stopped", pid=self.pid)

    # -- the worker program ------------------------------------------------------------------------

    def write_launch(self, argv: list[str]) -> None:
        """What the worker program execs next (launch.py reads it): the argv, the daemon's environment
        without systemd's and the daemon's own variables, and the state dir as the working directory."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_", "EMBER_DAEMON_"))}
        env.setdefault("PYTHONUNBUFFERED", "1")
        write_private(self.lay.launch_file, json.dumps({"argv": argv, "env": env, "cwd": str(self.lay.state)}))

    def info(self) -> ProcessInfo:
        """The worker's state in supervisord; raises one of RpcError when supervisord does not answer."""
        info = supctl.process_info(self._rpc)
        self._slow_since = None
        return info

    def start_worker(self) -> str | None:
        """Start the worker program; None, or why supervisord refused (the command cannot run)."""
        if self.conf_dirty:
            self._reconfigure()
        try:
            self._rpc.supervisor.startProcess(supctl.PROGRAM, False)
        except xmlrpc.client.Fault as e:
            if e.faultCode != supctl.ALREADY_STARTED:
                return str(e.faultString)
        return None

    def stop_worker(self, pid: int | None, pid_ctime: float | None) -> None:
        """Ask for the drain (SIGTERM through supervisord; sent directly when supervisord is slow or gone)."""
        try:
            self._rpc.supervisor.stopProcess(supctl.PROGRAM, False)
        except xmlrpc.client.Fault as e:
            self.log("stop_error", level="warning", error=e.faultString)
        except OSError as e:
            self.log("stop_error", level="warning", error=f"{type(e).__name__}: {e}", note="sending SIGTERM")
            if pid and ctime(pid) == pid_ctime:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)

    def _reconfigure(self) -> None:
        try:
            added, changed, removed = self._rpc.supervisor.reloadConfig()[0]
            if supctl.PROGRAM in changed:
                self._rpc.supervisor.removeProcessGroup(supctl.PROGRAM)
                self._rpc.supervisor.addProcessGroup(supctl.PROGRAM)
            self.log("supervisor_reconfigured", changed=changed)
        except RpcError as e:
            self.log("supervisor_reconfigure_error", level="warning", error=str(e))
        self.conf_dirty = False

    def exit_info(self, info: ProcessInfo) -> ExitInfo:
        """How the worker ended: XML-RPC gives an exit status (or -1 for a signal); supervisord's log
        line names the signal and a core dump."""
        sup = supctl.last_exit(self.lay)
        ex = ExitInfo(supervisor=sup.get("text") or None)
        if sup.get("signal"):
            ex.signal = sup["signal"]
            ex.signal_number = supctl.signum(sup["signal"])
            ex.core_dumped = bool(sup.get("core"))
        elif info.exitstatus is not None and info.exitstatus >= 0 and info.statename == "EXITED":
            ex.code = info.exitstatus
        elif "code" in sup:
            ex.code = sup["code"]
        if info.spawnerr and info.statename in ("FATAL", "BACKOFF"):
            ex.spawn_error = info.spawnerr
        return ex
