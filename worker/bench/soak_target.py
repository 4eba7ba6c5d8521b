"""The server a soak drives: what it is, when it is ready and idle, and how it is killed and
brought back.

Two kinds of target. `Workers`: ember workers the soak starts itself, a fresh one per phase with the
phase's flags on the phase's own KV dir (a restart keeps the dir). `Running`: a server someone else
started, reached by URL: ember, llama-server, or another server that takes token-id prompts on
/v1/completions and offers llama-server's /tokenize. The soak learns a running server's model and
context from the server itself (ember's /v1/stats, llama-server's /props), kills it with SIGKILL
(the process listening on the URL's port on this machine, or a pid it is given, and that process's
children), runs a shell command to start it again, and waits until its health endpoint says ready.
Not here: the traffic (soak_load.py), the phases (soak.py), the report (soak_report.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import psutil

from .replay import _wait_writes
from .soak_load import EMBER, LLAMA_SERVER, OTHER, Engine
from .soak_report import Phase
from .workerproc import LOG_TAIL, WorkerProcess

# where each kind says it can take a request (ember's /health is the same answer as /health/ready)
READY_PATH = {EMBER: "/health/ready", LLAMA_SERVER: "/health", OTHER: "/health"}


def _json(url: str) -> dict | list | None:
    """GET `url` as JSON; None when it does not answer 200 with JSON."""
    try:
        r = httpx.get(url, timeout=10)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def describe(url: str, ctx: int | None = None) -> tuple[Engine, dict]:
    """The running server at `url` as the clients need it (its context capped at `ctx`), and the facts
    the report records about it. Raises RuntimeError for a server that says neither its context nor
    takes `ctx`."""
    stats = _json(f"{url}/v1/stats")
    if isinstance(stats, dict) and isinstance(stats.get("engine"), dict):
        e = stats["engine"]
        engine = Engine(stats["model"], e["backend"], e["context"], None, e["block_size"], EMBER)
        facts = {"slots": e.get("max_seqs")}
    elif isinstance(props := _json(f"{url}/props"), dict) and "default_generation_settings" in props:
        # llama-server: a slot's context (-c over -np, capped by the model's); its prefix cache is per token
        engine = Engine(Path(props.get("model_path") or "?").name, "llama.cpp", props["default_generation_settings"]
                        ["n_ctx"], None, 1, LLAMA_SERVER)
        facts = {"slots": props.get("total_slots"), "build": props.get("build_info")}
    else:
        models = _json(f"{url}/v1/models")
        data = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
        # vLLM says max_model_len; anything else must be told
        n = data.get("max_model_len") or (data.get("meta") or {}).get("n_ctx") or ctx
        if not n:
            raise RuntimeError(f"the server at {url} says no context length (ember's /v1/stats, llama-server's "
                               "/props, /v1/models); pass --ctx")
        engine = Engine(str(data.get("id", "?")), "?", int(n), None, 1, OTHER)
        facts = {}
    if ctx is not None and ctx < engine.context:
        engine = Engine(engine.model, engine.backend, ctx, None, engine.block_size, engine.server)
    return engine, {"server": engine.server, "url": url, **{k: v for k, v in facts.items() if v is not None}}


def wait_ready(url: str, path: str, timeout: float, proc: subprocess.Popen | None = None,
               log: Path | None = None) -> None:
    """Until GET url+path answers 200. With `proc` (what a restart command started), a nonzero exit
    before that is an error carrying the end of `log`; an exit 0 is a launcher that left the server
    running, and the wait goes on."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        tail = log.read_text(errors="replace")[-LOG_TAIL:] if log and log.exists() else ""
        if proc is not None and proc.poll() not in (None, 0):
            raise RuntimeError(f"the restart command exited with {proc.returncode} before {url}{path} was ready"
                               f"\n{tail}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url}{path} not ready after {timeout:.0f} s\n{tail}")
        time.sleep(0.2)


def wait_idle(engine: Engine, url: str, timeout: float = 120) -> None:
    """Until the server runs and holds nothing, so abandoned requests are settled: ember's /v1/stats
    says nothing runs or waits, llama-server's /slots that no slot is processing; a server that says
    neither gets a second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.server == EMBER:
            stats = _json(f"{url}/v1/stats")
            e = stats.get("engine", {}) if isinstance(stats, dict) else {}
            idle = e.get("running") == 0 and e.get("waiting") == 0
        elif engine.server == LLAMA_SERVER and isinstance(slots := _json(f"{url}/slots"), list):
            idle = not any(s.get("is_processing") for s in slots)
        else:
            time.sleep(1.0)
            return
        if idle:
            return
        time.sleep(0.05)


def wait_writes(engine: Engine, url: str) -> None:
    """ember: until its KV writer's queue is empty (the primed conversations are on disk)."""
    if engine.server == EMBER:
        _wait_writes(url)


def listener_pid(port: int) -> int | None:
    """The process of this machine that listens on TCP `port`, if any (and if this user may see it)."""
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    return None


def sigkill(proc: psutil.Process, children: list[psutil.Process], timeout: float = 30) -> bool:
    """SIGKILL `proc` at once, then its `children` as they were seen before (a killed server's children
    would hold its GPU memory); True when all are gone (or zombies: their parent reaps them) within
    `timeout`, False when `proc` was gone already."""
    try:
        proc.kill()  # psutil checks the pid is still this process (pids are reused)
    except psutil.NoSuchProcess:
        return False
    procs = [proc, *children]
    for q in children:
        with contextlib.suppress(psutil.Error):
            q.kill()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for q in procs:
            with contextlib.suppress(psutil.Error):
                if q.status() != psutil.STATUS_ZOMBIE:
                    alive.append(q)
        if not alive:
            return True
        time.sleep(0.05)
    return False


class Target(Protocol):
    """Where a phase's server comes from."""

    foreign: bool  # the soak did not start it: its logs are not the soak's to read

    def up(self, phase: Phase) -> str:
        """A ready server for `phase` (again after a kill), by URL."""

    def kill(self) -> int | None:
        """SIGKILL the server now; the exit status seen (-9 when the kill found it alive)."""

    def down(self, phase: Phase) -> None:
        """The phase is over."""


class Workers:
    """ember workers the soak starts: a fresh one per phase with the phase's flags on its own KV dir,
    which a restart within the phase keeps and the phase's end removes (its logs stay)."""

    foreign = False

    def __init__(self, worker_args: list[str], workdir: Path):
        self.worker_args, self.workdir = worker_args, workdir
        self.worker: WorkerProcess | None = None

    def up(self, phase: Phase) -> str:
        log = self.workdir / phase.name / f"worker-{len(phase.logs) + 1}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        phase.logs.append(log)
        self.worker = WorkerProcess(*self.worker_args, "--kv-dir", str(self.workdir / phase.name / "kv"), *phase.flags,
                                    log_path=log).start()
        return self.worker.url

    def kill(self) -> int | None:
        return self.worker.kill() if self.worker else None

    def down(self, phase: Phase) -> None:
        if self.worker:
            self.worker.kill(signal.SIGTERM)
        # the phases share one disk, and a large model's blocks would crowd the next phase's KV budget
        shutil.rmtree(self.workdir / phase.name / "kv", ignore_errors=True)


class Running:
    """A server the soak did not start, at `url`. It is left as found: running (a restarted one too,
    in a session of its own, its output in `workdir`/restart-N.log). A kill takes `pid`, else the
    process listening on the URL's port: the server itself, whatever shell or launcher started it. The
    process is found when the server comes up, so the kill itself is one signal, sent while the
    requests it is meant to cut are in flight."""

    foreign = True

    def __init__(self, url: str, engine: Engine, restart_cmd: str | None, pid: int | None, workdir: Path,
                 ready_timeout: float):
        self.url, self.engine, self.restart_cmd, self.pid = url, engine, restart_cmd, pid
        self.workdir, self.ready_timeout = workdir, ready_timeout
        self.ready_path = READY_PATH[engine.server]
        self.port = urlsplit(url).port or (443 if url.startswith("https:") else 80)
        self.killed: dict | None = None  # a kill not yet followed by a restart: pid, and when
        self.last_kill: dict | None = None
        self.restarts: list[dict] = []
        self.proc: psutil.Process | None = None  # what a kill takes, with its children
        self.children: list[psutil.Process] = []

    def _find(self) -> None:
        pid = self.pid if self.pid and not self.restarts else listener_pid(self.port)
        self.proc, self.children = None, []
        with contextlib.suppress(psutil.Error):
            if pid is not None:
                self.proc = psutil.Process(pid)
                self.children = self.proc.children(recursive=True)

    def up(self, phase: Phase) -> str:
        if self.killed is None:
            wait_ready(self.url, self.ready_path, self.ready_timeout)
            if self.restart_cmd:
                self._find()
                if self.proc is None:
                    raise RuntimeError(f"no process of this machine listens on port {self.port} (or this user may "
                                       "not see it); pass --server-pid")
            return self.url
        assert self.restart_cmd, "a kill without a restart command"
        log = self.workdir / f"restart-{len(self.restarts) + 1}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.restart_cmd, shell=True, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
        wait_ready(self.url, self.ready_path, self.ready_timeout, proc, log)
        ready = time.monotonic()
        self.restarts.append({"command": self.restart_cmd, "pid": listener_pid(self.port) or proc.pid,
                              "kill_to_ready_s": round(ready - self.killed["at"], 2), "log": str(log)})
        self.killed = None
        self._find()
        return self.url

    def kill(self) -> int | None:
        if self.proc is None:
            raise RuntimeError(f"no process of this machine listens on port {self.port}; pass --server-pid")
        gone = sigkill(self.proc, self.children)
        self.killed = self.last_kill = {"pid": self.proc.pid, "at": time.monotonic()}
        return -signal.SIGKILL if gone else None

    def down(self, phase: Phase) -> None:
        pass
