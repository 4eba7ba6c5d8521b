"""The daemon's verbs of the `ember` command: daemon run, start, stop, restart, status, logs.

`ember crashes` lives in ember.ops (reading the archive needs nothing of the daemon).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ember.ops import contract
from ember.ops.contract import ExitCode, PersistState

from . import control, supctl
from .paths import Layout, layout, read_json
from .phases import Status
from .procs import alive
from .settings import Settings, SettingsError, load

EX_OK, EX_FAIL, EX_NOT_RUNNING, EX_CONFIG = ExitCode.OK, ExitCode.FAILURE, ExitCode.NOT_RUNNING, ExitCode.CONFIG


# -- ember daemon run ---------------------------------------------------------------------------------

def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help=f"ember.toml (default {contract.config_file()}, or ${contract.ENV_CONFIG})")
    p.add_argument("--command", metavar="CMD", help="run this engine instead of the ember worker (quoted command line)")
    p.add_argument("--health-url", metavar="URL", help="the engine's liveness URL (with --command)")
    p.add_argument("--ready-url", metavar="URL", help="the engine's readiness URL (default: --health-url)")
    p.add_argument("--completions-url", metavar="URL", help="one-token generation probe URL ('' turns it off)")
    p.add_argument("--log-file", metavar="FILE", help="a log file the engine writes itself (watched too)")
    p.add_argument("--also-listens", metavar="HOST:PORT", action="append",
                   help="another address the engine binds (its metrics port, say): checked free before each start")
    p.add_argument("--host", help="where the worker listens (default 127.0.0.1)")
    p.add_argument("--port", help="the worker's port (default 8080)")


def _flags(args: argparse.Namespace | None) -> dict[str, Any]:
    return {k: getattr(args, k, None) for k in ("command", "health_url", "ready_url", "completions_url", "log_file",
                                                "also_listens", "host", "port")}


def _settings(args: argparse.Namespace | None = None) -> Settings:
    """The daemon's settings as every verb reads them: --config first (made absolute, so a daemon the
    verb starts reads the same file), then the engine flags over ember.toml. Raises SettingsError."""
    path = getattr(args, "config", None)
    if path:
        os.environ[contract.ENV_CONFIG] = os.path.abspath(os.path.expanduser(path))
    return load(_flags(args))


def _setting(read: Callable[[Settings], float], fallback: float) -> float:
    """What the settings make of a verb's default (a wait), or `fallback` where ember.toml does not
    load: stopping or restarting must not depend on a file a person is editing."""
    try:
        return read(_settings())
    except SettingsError:
        return fallback


def _refuse(prog: str, e: Exception | str) -> int:
    print(f"{prog}: {e}", file=sys.stderr)
    return EX_CONFIG


def _worker_config_error(settings: Settings) -> str | None:
    """The ember worker's own verdict on ember.toml (its loader, in a subprocess: the daemon never
    imports the worker), so that `ember start` refuses a misspelled worker key before anything
    starts; None when it loads (or a foreign engine runs, which reads no worker keys)."""
    if settings.foreign:
        return None
    from .config_show import worker_config

    return worker_config(dict(os.environ)).get("error")


def cmd_daemon(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember daemon", description="the supervising daemon (what the service runs)")
    sub = p.add_subparsers(dest="sub", required=True)
    r = sub.add_parser("run", help="run the daemon in the foreground: supervise the worker until stopped")
    _add_engine_flags(r)
    r.add_argument("--mode", choices=("foreground", "background"), default="foreground", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        settings = _settings(args)
    except SettingsError as e:
        return _refuse("ember daemon", e)
    from .shell import DaemonError

    try:
        if settings.fleet:  # replicas: a daemon of member daemons (fleet.py)
            from .fleet import Fleet, check_router_installed

            check_router_installed()
            return Fleet(settings, layout(), mode=args.mode).run()
        from .core import Daemon

        return Daemon(settings, layout(), mode=args.mode, flags=_flags(args)).run()
    except SettingsError as e:
        return _refuse("ember daemon", e)
    except DaemonError as e:  # another daemon holds the state dir, supervisord answers nonsense...
        print(f"ember daemon: {e}", file=sys.stderr)
        return EX_FAIL
    except KeyboardInterrupt:
        return EX_OK


# -- talking to a running daemon ------------------------------------------------------------------------

def _status(lay: Layout) -> dict[str, Any] | None:
    resp = control.request(lay.control_sock, "status")
    return resp.get("status") if resp and resp.get("ok") else None


def _systemd_unit() -> list[str] | None:
    """systemctl argv prefix when an installed, running systemd manages ember.service."""
    if not Path("/run/systemd/system").is_dir() or not shutil.which("systemctl"):
        return None
    if os.geteuid() == 0 and Path("/etc/systemd/system/ember.service").exists():
        return ["systemctl"]
    user = contract.xdg_home("config") / "systemd/user/ember.service"
    if user.exists():
        return ["systemctl", "--user"]
    return None


def _print_ready(st: dict[str, Any]) -> None:
    ep = st.get("endpoint")
    w = st.get("worker") or {}
    print(f"ember is ready: {ep}/v1 (OpenAI), {ep} (Anthropic)"
          + (f"  model {w.get('model')}" if w.get("model") else ""))


def _poll(done: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Call done() every `interval` seconds until it returns true (-> True) or `timeout` passes (-> False)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def _wait_ready(lay: Layout, timeout: float, proc: subprocess.Popen[bytes] | None = None,
                after_incarnation: int | None = None, quiet: bool = False) -> int:
    deadline = time.monotonic() + timeout
    last = None
    told_port = False
    while time.monotonic() < deadline:
        st = _status(lay)
        if st:
            last = st
            if st.get("port_conflict") and not told_port and not quiet:  # said once; the daemon keeps trying
                told_port = True
                print(f"ember: {_port_line(st['port_conflict'])}; waiting for it", file=sys.stderr)
            inc = (st.get("worker") or {}).get("incarnation") or 0
            fresh = after_incarnation is None or inc > after_incarnation
            if st.get("state") == Status.READY and fresh:
                if not quiet:
                    _print_ready(st)
                return EX_OK
            if st.get("state") == Status.FAILED and fresh:
                print(f"ember: the worker failed: {st.get('failed_reason')}", file=sys.stderr)
                return EX_FAIL
        if proc is not None and proc.poll() is not None:
            tail = ""
            with contextlib.suppress(OSError):
                tail = lay.daemon_out.read_text()[-2000:]
            print(f"ember: the daemon exited with {proc.returncode}\n{tail}", file=sys.stderr)
            return EX_FAIL
        time.sleep(0.2)
    why = (last or {}).get("not_ready_reason") or "no answer from the daemon"
    print(f"ember: not ready after {timeout:g}s: {why}", file=sys.stderr)
    return EX_FAIL


def cmd_start(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember start",
                                description="start ember (the daemon and its worker) and wait until ready")
    _add_engine_flags(p)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for ready (default: startup_timeout + 30)")
    p.add_argument("--no-wait", action="store_true", help="return once the daemon runs")
    args = p.parse_args(argv)
    try:
        settings = _settings(args)
    except SettingsError as e:
        return _refuse("ember", e)
    bad = _worker_config_error(settings)
    if bad:
        return _refuse("ember", bad)
    lay = layout().ensure()
    timeout = args.timeout or settings.startup_timeout + 30
    st = _status(lay)
    proc = None
    if st is not None:
        if st.get("state") in (Status.STOPPED, Status.FAILED):
            control.request(lay.control_sock, "start")
            time.sleep(0.3)
        elif st.get("state") == Status.READY:
            _print_ready(st)
            return EX_OK
    else:
        unit = _systemd_unit() if settings.service != "none" else None
        if unit:
            r = subprocess.run([*unit, "start", "ember.service"])
            if r.returncode != 0:
                return EX_FAIL
        else:
            argv_d = [sys.executable, "-m", "ember.daemon.cli_main", "daemon", "run", "--mode", "background"]
            for k, v in _flags(args).items():
                if v is not None:
                    argv_d += ["--" + k.replace("_", "-"), str(v)]
            out = os.open(lay.daemon_out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                proc = subprocess.Popen(argv_d, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, close_fds=True)
            finally:
                os.close(out)
    if args.no_wait:
        _poll(lambda: _status(lay) is not None or (proc is not None and proc.poll() is not None), 30)
        return EX_OK if _status(lay) is not None else EX_FAIL
    return _wait_ready(lay, timeout, proc)


def cmd_stop(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember stop", description="drain and stop the worker, then the daemon")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait (default: drain time + 30)")
    args = p.parse_args(argv)
    lay = layout()
    timeout = args.timeout or _setting(lambda s: s.effective_stop_timeout + 30, 65.0)
    st = _status(lay)
    if st is None:
        if supctl.alive(lay.supervisor_sock):  # a daemon died and left supervisord serving
            return _stop_orphan(lay, timeout)
        print("ember is not running")
        return EX_OK
    pids = {"daemon": st["daemon"]["pid"], "supervisord": st["daemon"].get("supervisor_pid"),
            "worker": (st.get("worker") or {}).get("pid")}
    resp = control.request(lay.control_sock, "stop")
    if not (resp and resp.get("ok")) and alive(pids["daemon"]):
        os.kill(pids["daemon"], signal.SIGTERM)  # no acknowledgement: the same stop, by its signal handler
    _poll(lambda: not any(alive(p) for p in pids.values()), timeout)
    left = {k: v for k, v in pids.items() if alive(v)}
    if left:
        print(f"ember: still running after {timeout:g}s: {left}", file=sys.stderr)
        return EX_FAIL
    print("ember stopped" + (f" (worker pid {pids['worker']} drained)" if pids["worker"] else ""))
    return EX_OK


def _stop_orphan(lay: Layout, timeout: float) -> int:
    rpc: Any = supctl.rpc(lay.supervisor_sock, timeout=timeout)
    try:
        sup_pid = int(rpc.supervisor.getPID())
        info = supctl.process_info(rpc)
        if info.statename in ("RUNNING", "STARTING"):
            rpc.supervisor.stopProcess(supctl.PROGRAM, True)
        rpc.supervisor.shutdown()
    except Exception as e:
        print(f"ember: could not stop supervisord: {e}", file=sys.stderr)
        return EX_FAIL
    _poll(lambda: not alive(sup_pid), 15)
    print("ember stopped (no daemon was running; its supervisord and worker are stopped)")
    return EX_OK


def cmd_restart(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember restart", description="drain and restart the worker (the daemon stays)")
    p.add_argument("--timeout", type=float, default=None)
    args = p.parse_args(argv)
    lay = layout()
    st = _status(lay)
    if st is None:
        return cmd_start(["--timeout", str(args.timeout)] if args.timeout else [])
    try:  # the daemon re-reads ember.toml for the new worker: refuse a file that would not load
        bad = _worker_config_error(_settings())
    except SettingsError as e:
        bad = str(e)
    if bad:
        return _refuse("ember", bad)
    timeout = args.timeout or _setting(lambda s: s.effective_stop_timeout + s.startup_timeout + 30, 400.0)
    inc = (st.get("worker") or {}).get("incarnation") or 0
    control.request(lay.control_sock, "restart")
    return _wait_ready(lay, timeout, after_incarnation=inc)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _unsupervised(lay: Layout) -> dict[str, Any] | None:
    if not supctl.alive(lay.supervisor_sock):
        return None
    try:
        rpc: Any = supctl.rpc(lay.supervisor_sock, timeout=3)
        info = supctl.process_info(rpc)
        if info.statename in ("RUNNING", "STARTING"):
            return {"pid": info.pid, "supervisor_pid": rpc.supervisor.getPID()}
    except Exception:
        pass
    return None


def _port_line(pc: dict[str, Any]) -> str:
    """Another process holds the worker's port: who, since when, and the daemon's next try."""
    who = f"by pid {pc['pid']} ({pc.get('command')})" if pc.get("pid") else "by another process"
    left = datetime.fromisoformat(pc["retry_at"]).timestamp() - time.time() if pc.get("retry_at") else None
    nxt = f"next try in {_ago(max(0.0, left))}" if left is not None else "trying again"
    return (f"port {pc.get('port')} on {pc.get('host')} held {who} since {str(pc.get('since'))[11:19]} UTC; "
            f"{nxt} (try {pc.get('tries')})")


def _health_lines(st: dict[str, Any]) -> list[str]:
    """The circuit breaker, a port held by another process, failing liveness and a degraded log
    watcher, when there is news."""
    out = []
    if st.get("port_conflict"):
        out.append("  port     " + _port_line(st["port_conflict"]))
    br = st.get("breaker") or {}
    if br.get("state") == "open":
        retry = br.get("retry_at")
        if retry:
            left = datetime.fromisoformat(retry).timestamp() - time.time()
            nxt = f"tries again at {retry[11:19]} UTC (in {_ago(max(0.0, left))})"
        else:
            nxt = "stays down until `ember start` (breaker_cooldown 0)"
        out.append(f"  breaker  open since {str(br.get('opened_at'))[11:19]} UTC: {nxt}")
    elif br.get("state") == "half-open":
        out.append("  breaker  half-open: trying again after the cool-down; one more failure opens it")
    kv = (st.get("worker") or {}).get("kv_persistence") or {}
    if kv.get("state") and kv["state"] != PersistState.PERSISTING:
        since = f" since {str(kv.get('since'))[11:19]} UTC" if kv.get("since") else ""
        lost = f"; {kv['not_persisted']} blocks not persisted" if kv.get("not_persisted") else ""
        retry = "; retrying" if kv["state"] == PersistState.DEGRADED else ""
        out.append(f"  kv cache {kv['state'].upper()}{since}: {kv.get('reason')}{lost}{retry} "
                   "(the worker serves; what it computes meanwhile is not kept across a restart)")
    lv = st.get("liveness")
    if lv:
        out.append(f"  liveness {lv['failures']} failed probes in {lv['failing_seconds']:.0f}s "
                   f"(a silent worker is restarted as unresponsive after {lv['unresponsive_after_seconds']:g}s)")
    lw = st.get("log_watch") or {}
    if lw.get("mode") == "polling":
        out.append(f"  log watch polling the logs: the file watcher failed ({lw.get('error')})")
    return out


def cmd_status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember status", description="daemon and worker state")
    p.add_argument("--json", action="store_true", help="machine-readable")
    args = p.parse_args(argv)
    lay = layout()
    st = _status(lay)
    running = st is not None
    if st is None:
        st = _status_without_daemon(lay)
    else:
        st["daemon"]["running"] = True
    if args.json:
        print(json.dumps(st, indent=2, default=str))
    else:
        _print_status(st, running)
    if not running:
        return EX_NOT_RUNNING
    return EX_OK if st.get("state") == Status.READY else EX_FAIL


def _status_without_daemon(lay: Layout) -> dict[str, Any]:
    """The last status the daemon wrote, as it stands now that no daemon runs."""
    st = read_json(lay.status_file) or {}
    st = {**st, "state": Status.STOPPED if st.get("state") != Status.FAILED else Status.FAILED}
    st["daemon"] = {**(st.get("daemon") or {}), "pid": None, "running": False}
    orphan = _unsupervised(lay)
    if orphan:  # the daemon died and left supervisord and the worker serving
        st["state"] = Status.UNSUPERVISED
        st["not_ready_reason"] = "the daemon is not running; the worker still serves (ember start re-attaches)"
        st["daemon"]["supervisor_pid"] = orphan["supervisor_pid"]
        st["worker"] = {**(st.get("worker") or {}), "pid": orphan["pid"], "state": Status.UNSUPERVISED}
    return st


def _print_status(st: dict[str, Any], running: bool) -> None:
    d, w = st.get("daemon") or {}, st.get("worker") or {}
    print(f"ember: {st.get('state', 'stopped')}" + (f"  {st.get('endpoint')}" if running else ""))
    if running:
        _print_processes(st, d, w)
    else:
        print("  daemon   not running")
        if w.get("state") == Status.UNSUPERVISED:
            print(f"  worker   still serving, unsupervised  pid {w.get('pid')}  "
                  f"(supervisord pid {d.get('supervisor_pid')})")
    if st.get("state") not in (Status.READY, Status.STOPPED, None) and st.get("not_ready_reason"):
        print(f"  why      {st['not_ready_reason']}")
    lc = st.get("last_crash")
    nxt = f"  (next in {st['next_restart_in']}s)" if st.get("next_restart_in") else ""
    print(f"  restarts {st.get('restarts', 0)}{nxt}")
    if lc:
        print(f"  last crash {lc.get('detected_at')}  {lc.get('class')}  {lc.get('id')}  ({lc.get('reason')})")
    if st.get("last_recovery_seconds") is not None:
        print(f"  last recovery {st['last_recovery_seconds']:.1f}s from detection to ready")
    if running:
        for line in _health_lines(st):
            print(line)


def _print_processes(st: dict[str, Any], d: dict[str, Any], w: dict[str, Any]) -> None:
    """A running daemon's processes: itself, the worker (or replicas and router), the worker's KV and memory."""
    print(f"  daemon   pid {d.get('pid')}  up {_ago(d.get('uptime_seconds'))}  ({d.get('mode')})"
          f"  supervisord pid {d.get('supervisor_pid')}")
    print(f"  worker   {w.get('state')}  pid {w.get('pid') or '-'}  up {_ago(w.get('uptime_seconds'))}"
          f"  model {w.get('model') or '-'}" + (f"  ({w.get('engine')})" if w.get("engine") != "ember" else ""))
    for r in [*st.get("replicas", []), *([st["router"]] if st.get("router") else [])]:
        gpu = f"  gpu {r['gpu']}" if r.get("gpu") else ""
        routes = f"  routes to {r['healthy_replicas']} of {r['replicas']}" if "healthy_replicas" in r else ""
        print(f"  {r['name']:<10} {r['state']}  port {r['port']}{gpu}{routes}  pid {r.get('pid') or '-'}"
              f"  restarts {r.get('restarts', 0)}  ({r['state_dir']})")
    if st.get("router"):
        print("  routes   /v1/chat/completions, /v1/completions, /v1/responses through the router; "
              "/v1/messages (Anthropic) only on a replica's own port")
    kv = w.get("kv_persistence") or {}
    if kv.get("state") == PersistState.PERSISTING:
        print(f"  kv cache persisting to {kv.get('dir')}")
    mem = w.get("memory")
    if mem:  # a CUDA worker's division of the device (worker/backends/cuda/memory.py)
        where = "unified memory (shared with the host)" if mem.get("unified_memory") else "GPU memory"
        print(f"  memory   {where} {mem.get('device_total_mb')} MiB: weights {mem.get('weights_mb')}, "
              f"16-bit copy {mem.get('f16_copy_mb')}, KV pool {mem.get('kv_pool_mb')} "
              f"({w.get('kv_tokens')} tokens), host KV tier {mem.get('kv_host_tier_mb')} MiB")


# -- ember logs -----------------------------------------------------------------------------------------

def pretty(line: str) -> str:
    o = contract.parse_log_line(line)
    if o is None:
        return line.rstrip("\n")
    ts = str(o.get("ts", ""))
    ts = ts[11:23] if len(ts) >= 23 else ts
    parts = []
    for k, v in o.items():
        if k in contract.LOG_KEYS:
            continue
        if isinstance(v, str) and v and " " not in v and "=" not in v:
            parts.append(f"{k}={v}")
        else:
            parts.append(f"{k}={json.dumps(v, default=str, ensure_ascii=False)}")
    return f"{ts} {str(o.get('level', '')).upper():<5} {o.get('event'):<16} " + " ".join(parts)


def _tail_lines(path: Path, n: int, upto: int | None = None) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell() if upto is None else min(upto, f.tell())
            block, data = 65536, b""
            while size > 0 and data.count(b"\n") <= n:
                step = min(block, size)
                size -= step
                f.seek(size)
                data = f.read(step) + data
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[-n:] if n else []


def cmd_logs(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember logs", description="the worker's log, pretty-printed")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=100, help="lines from the end to show first (default 100)")
    p.add_argument("--daemon", action="store_true", help="the daemon's own log instead")
    p.add_argument("--raw", action="store_true", help="print the JSON lines as they are")
    args = p.parse_args(argv)
    lay = layout()
    path = lay.daemon_log if args.daemon else lay.worker_log
    fmt = (lambda s: s) if args.raw else pretty
    if not path.exists() and not args.follow:
        print(f"ember: no log yet at {path}", file=sys.stderr)
        return EX_FAIL
    out = sys.stdout
    from .logwatch import TailedFile

    tf = TailedFile(path, "log")
    tf.open_at(None)  # first: a line written while the tail prints is followed, not lost
    try:
        for ln in _tail_lines(path, args.lines, upto=tf.offset if tf.f is not None else None):
            out.write(fmt(ln) + "\n")
        out.flush()
        if not args.follow:
            return EX_OK
        while True:
            for ln in tf.read_new():
                out.write(fmt(ln) + "\n")
            out.flush()
            time.sleep(0.2)
    except (KeyboardInterrupt, BrokenPipeError):
        return EX_OK


VERBS = {
    "daemon": (cmd_daemon, "run the supervising daemon in the foreground (what the service runs)"),
    "start": (cmd_start, "start ember in the background and wait until it serves"),
    "stop": (cmd_stop, "drain and stop the worker and the daemon"),
    "restart": (cmd_restart, "drain and restart the worker"),
    "status": (cmd_status, "daemon and worker state, pids, uptime, model, restarts, last crash"),
    "logs": (cmd_logs, "the worker's log, pretty-printed (-f follows; --daemon for the daemon's)"),
}
