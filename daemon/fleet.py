"""`[daemon] replicas = N` or `gpus = "all" | "0,1"`: one ember worker per GPU behind sglang-router.

    ember daemon run (the fleet) --> ember daemon run  replica-0: supervisord, worker on GPU 0, port P + 1
                                 --> ember daemon run  replica-1: ..., GPU 1, port P + 2
                                 --> ember daemon run  router: sglang-router on the public port P

Every member is an ordinary daemon with a state directory of its own (<state>/replicas/<name>): its
own supervisord, probes, backoff, circuit breaker, crash archive and KV subdirectory, so a replica's
crash is handled, archived and restarted exactly as a single worker's is, and the router stops
sending it requests through its health checks (every second, on /health) until it is ready again.
The router is a foreign engine to its daemon (a command with a health URL and no generation probe).

The fleet daemon spawns the member daemons (each in its own session, re-attached when a fleet daemon
restarts and finds them answering), respawns one whose daemon process dies, answers the control
socket for all of them (status, start, stop, restart) and publishes one status: ready when every
replica is and the router routes to all of them. The router's own /health answers 200 as soon as it
listens, before its first health check of a replica has passed (a request then gets 503, "no available
workers"), so the fleet asks its worker list (GET /workers, each one's is_healthy) before calling it ready.
`ember stop` drains them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.ops import contract

from . import control
from .paths import Layout, write_json
from .phases import Status
from .probes import ProbeTimeout, http_call
from .procs import alive
from .settings import Settings, SettingsError
from .shell import DaemonShell
from .sysfacts import ember_version

ENV_MEMBER = "EMBER_REPLICA"  # set in a member daemon's environment: its name (it is never a fleet itself)
ROUTER = "router"
POLL = 0.5  # seconds between looks at the members
RESPAWN_AFTER = 2.0  # a member daemon gone this long (and not stopped) is spawned again


@dataclass(frozen=True)
class Member:
    name: str  # replica-<i> or router
    port: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES for a replica on a GPU
    layout: Layout

    @property
    def is_router(self) -> bool:
        return self.name == ROUTER


def gpu_ids(spec: str) -> list[str]:
    """`gpus`: "all" (every GPU nvidia-smi lists) or a comma-separated list of indices."""
    if spec.strip() == "all":
        smi = shutil.which("nvidia-smi")
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout if smi else ""
        ids = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
        if not ids:
            raise SettingsError('gpus = "all": nvidia-smi lists no GPU')
        return ids
    ids = [g.strip() for g in spec.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise SettingsError(f'gpus: {spec!r} is not "all" or a list of distinct GPU indices like "0,1"')
    return ids


def plan(s: Settings, lay: Layout) -> list[Member]:
    """The members: the replicas on ports P + 1 .. P + N, then the router on the public port P."""
    gpus: list[str | None] = list(gpu_ids(s.gpus)) if s.gpus else [None] * s.replicas
    if s.port + len(gpus) > 65535:
        raise SettingsError(f"port: {s.port} leaves no room for {len(gpus)} replica ports above it")
    base = lay.state / "replicas"
    members = [Member(f"replica-{i}", s.port + 1 + i, g, Layout(base / f"replica-{i}")) for i, g in enumerate(gpus)]
    return members + [Member(ROUTER, s.port, None, Layout(base / ROUTER))]


# How the router notices a replica gone: its health check every second, one failure enough; and its
# circuit breaker opened by one failed request (for 2 s), so the router's own retries of that request
# go to another replica. Without the breaker, cache_aware retries the replica holding the prompt's
# prefix until they run out, and the first request after a crash fails with 500 (seen in CI).
ROUTER_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1", "--cb-failure-threshold", "1", "--cb-success-threshold", "1",
                 "--cb-timeout-duration-secs", "2")


def router_command(s: Settings, replicas: list[Member], metrics_port: int) -> list[str]:
    urls = [f"http://{s.probe_host}:{m.port}" for m in replicas]
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", s.host, "--port", str(s.port),
            "--policy", s.router_policy, "--worker-urls", *urls, "--health-check-endpoint", "/health",
            *ROUTER_HEALTH, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warn"]


def check_router_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SettingsError("replicas need sglang-router in ember's environment (pip install 'sglang-router==0.3.2')")


def member_argv(s: Settings, m: Member, members: list[Member]) -> list[str]:
    argv = [sys.executable, "-m", "ember.daemon.cli_main", "daemon", "run", "--mode", "background",
            "--host", s.host, "--port", str(m.port)]
    if m.is_router:
        replicas = [r for r in members if not r.is_router]
        metrics = s.port + len(replicas) + 1
        cmd = router_command(s, replicas, metrics)
        # its metrics port checked free before each start like its own: sglang-router panics when it is
        # taken, and each try would count as a crash
        argv += ["--command", shlex.join(cmd), "--health-url", f"{s.endpoint}/health", "--completions-url", "",
                 "--also-listens", f"127.0.0.1:{metrics}"]
    return argv


def configured_kv_dir(s: Settings, env: dict[str, str]) -> str | None:
    """The worker's KV directory as the environment or ember.toml sets it (None: the default)."""
    if env.get("EMBER_KV_DIR"):
        return env["EMBER_KV_DIR"]
    if s.config_path:
        with contextlib.suppress(OSError, ValueError):  # (load() has read and checked the file already)
            sec, _ = contract.config_sections(tomllib.loads(Path(s.config_path).read_text()), s.config_path)
            if isinstance(sec.get("kv_dir"), str):
                return os.path.expanduser(sec["kv_dir"])
    return None


def member_env(s: Settings, m: Member, env: dict[str, str] | None = None) -> dict[str, str]:
    out = dict(os.environ if env is None else env)
    out.pop("NOTIFY_SOCKET", None)  # systemd hears from the fleet daemon alone
    out.pop("WATCHDOG_USEC", None)
    out[contract.ENV_STATE_DIR] = str(m.layout.state)
    out[ENV_MEMBER] = m.name
    if not m.is_router:
        # each replica's KV store apart: a configured directory gets a subdirectory per replica; the
        # default (<state dir>/kv) is already the member's own
        base = configured_kv_dir(s, out)
        if base:
            out["EMBER_KV_DIR"] = str(Path(base) / m.name)
        if m.gpu is not None:
            out["CUDA_VISIBLE_DEVICES"] = m.gpu
    return out


def member_status(m: Member) -> dict[str, Any] | None:
    resp = control.request(m.layout.control_sock, "status", timeout=2.0)
    return resp.get("status") if resp and resp.get("ok") else None


def router_view(s: Settings) -> dict[str, Any]:
    """How many replicas the router routes to now, from its worker list (GET /workers: each worker's
    `is_healthy`, which its own health checks set); {"error": ...} when it does not say."""
    try:
        _, body = http_call("GET", f"http://{s.probe_host}:{s.port}/workers", timeout=2.0)
        workers = json.loads(body)["workers"]
        return {"healthy_replicas": sum(1 for w in workers if w.get("is_healthy") is True), "replicas": len(workers)}
    except (OSError, ProbeTimeout, ValueError, KeyError, TypeError, AttributeError) as e:
        return {"error": str(e) or type(e).__name__}


class Fleet:
    """The fleet daemon's process (see the module docstring)."""

    def __init__(self, settings: Settings, layout: Layout, *, mode: str = "foreground"):
        self.s = settings
        self.lay = layout
        self.shell = DaemonShell(layout, mode)
        self.mode, self.notifier, self.log = self.shell.mode, self.shell.notifier, self.shell.log
        self.members = plan(settings, layout)
        self.commands: queue.Queue[str] = queue.Queue()
        self.started_at = self.shell.started_at
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.gone_since: dict[str, float] = {}
        self.seen: dict[str, dict[str, Any] | None] = {}
        self.routing: dict[str, Any] = {}  # router_view() of the last look while the router was ready
        self._lock = threading.Lock()
        self._stopping = False
        self._ready_told = False

    # -- the members -------------------------------------------------------------------------------------

    def spawn(self, m: Member) -> None:
        m.layout.ensure()
        out = os.open(m.layout.daemon_out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.procs[m.name] = subprocess.Popen(member_argv(self.s, m, self.members), env=member_env(self.s, m),
                                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                                  start_new_session=True, close_fds=True)
        finally:
            os.close(out)
        self.log("member_spawn", member=m.name, port=m.port, gpu=m.gpu, pid=self.procs[m.name].pid)

    def look(self) -> None:
        """Every member's status; a member daemon gone (and not stopped by us) is spawned again."""
        now = time.monotonic()
        for m in self.members:
            st = member_status(m)
            with self._lock:
                self.seen[m.name] = st
            p = self.procs.get(m.name)
            if p is not None and p.poll() is not None:
                self.log("member_exit", level="warning" if not self._stopping else "info", member=m.name,
                         code=p.returncode)
                del self.procs[m.name]
            if st is not None or m.name in self.procs or self._stopping:
                self.gone_since.pop(m.name, None)
                continue
            since = self.gone_since.setdefault(m.name, now)
            if now - since >= RESPAWN_AFTER:
                self.gone_since.pop(m.name, None)
                self.spawn(m)
        router = self.seen.get(ROUTER) or {}
        routing = router_view(self.s) if router.get("state") == Status.READY else {}
        with self._lock:
            self.routing = routing

    def tell(self, cmd: str) -> None:
        for m in self.members:
            control.request(m.layout.control_sock, cmd)

    def stop_all(self) -> None:
        """Drain the replicas, then stop the router, each member daemon to its end."""
        self._stopping = True
        self.notifier.stopping()
        self.log("fleet_stop")
        deadline = time.monotonic() + self.s.effective_stop_timeout + 30
        for group in ([m for m in self.members if not m.is_router], [m for m in self.members if m.is_router]):
            pids = []
            for m in group:
                st = member_status(m)
                if st is not None:
                    pids.append((st.get("daemon") or {}).get("pid"))
                    control.request(m.layout.control_sock, "stop")
            while time.monotonic() < deadline and any(alive(p) for p in pids):
                time.sleep(0.1)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    # -- status ------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            seen, routing = dict(self.seen), dict(self.routing)
        rows = []
        for m in self.members:
            st = seen.get(m.name) or {}
            w = st.get("worker") or {}
            rows.append({"name": m.name, "port": m.port, "gpu": m.gpu, "state": st.get("state", Status.STOPPED),
                         "daemon_pid": (st.get("daemon") or {}).get("pid"), "pid": w.get("pid"),
                         "model": w.get("model"), "restarts": st.get("restarts", 0), "last_crash": st.get("last_crash"),
                         "not_ready_reason": st.get("not_ready_reason"), "state_dir": str(m.layout.state)})
        router = rows[-1]
        router.update(routing)
        if router["state"] == Status.READY and routing.get("healthy_replicas") != len(rows) - 1:
            # listening, but not (yet) sending requests to every replica
            router["state"] = Status.STARTING if not self._ready_told else Status.NOT_READY
            router["not_ready_reason"] = routing.get("error") or (
                f"routes to {routing['healthy_replicas']} of {len(rows) - 1} replicas")
        states = [r["state"] for r in rows]
        if self._stopping:
            state = Status.STOPPING
        elif all(s == Status.READY for s in states):
            state = Status.READY
        elif rows[-1]["state"] == Status.FAILED or all(s == Status.FAILED for s in states[:-1]):
            state = Status.FAILED
        elif any(s in (Status.STARTING, Status.STOPPED) for s in states):
            state = Status.STARTING
        else:
            state = Status.NOT_READY
        waiting = [f"{r['name']} {r['state']}" + (f" ({r['not_ready_reason']})" if r["not_ready_reason"] else "")
                   for r in rows if r["state"] != Status.READY]
        crashes = [r["last_crash"] for r in rows if r["last_crash"]]
        model = next((r["model"] for r in rows if r["model"]), None)
        return {
            "state": state, "endpoint": self.s.endpoint,
            "not_ready_reason": ", ".join(waiting) if waiting else None,
            "failed_reason": "; ".join(f"{r['name']}: {r['not_ready_reason']}" for r in rows
                                      if r["state"] == Status.FAILED) or None,
            "daemon": {"pid": os.getpid(), "mode": self.mode, "uptime_seconds": round(time.time() - self.started_at, 1),
                       "supervisor_pid": None, "version": ember_version()},
            "worker": {"state": state, "engine": "replicas", "model": model, "pid": None},
            "replicas": rows[:-1], "router": rows[-1],
            "restarts": sum(r["restarts"] for r in rows),
            "last_crash": max(crashes, key=lambda c: str(c.get("detected_at"))) if crashes else None,
        }

    # -- the process -------------------------------------------------------------------------------------

    def run(self) -> int:
        self.shell.open(role="fleet", members=[{"name": m.name, "port": m.port, "gpu": m.gpu} for m in self.members])
        try:
            for m in self.members:
                if member_status(m) is None:
                    self.spawn(m)
                else:
                    self.log("member_attach", member=m.name)
            self.shell.serve(self.status, self.commands, reload=False)
            while True:
                self.notifier.ping(time.monotonic())
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    cmd = ""
                if cmd == "stop":
                    self.stop_all()
                    break
                if cmd in ("start", "restart"):
                    self.log("fleet_command", command=cmd)
                    self.tell(cmd)
                self.look()
                st = self.status()
                write_json(self.lay.status_file, st)
                if st["state"] == Status.READY and not self._ready_told:
                    self._ready_told = True
                    self.notifier.ready(f"ready: {len(self.members) - 1} replicas behind the router")
                time.sleep(POLL)
        finally:
            write_json(self.lay.status_file, {**self.status(), "state": Status.STOPPED})
            self.shell.close()
        return 0
