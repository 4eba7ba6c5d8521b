"""Shared helpers for the daemon tests (no tests here): `Ember` runs the real CLI, real daemon and real
supervisord against a private EMBER_STATE_DIR and a free loopback port; conftest's `ember` fixture wraps it
and fails the test if any process it started outlives `ember stop`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "test_daemon_standin.py"

FAST = {  # timing knobs shrunk so incidents resolve in about a second
    "tick": "0.1s", "live_interval": "0.3s", "live_timeout": "1s", "live_failures": 2, "ready_interval": "0.5s",
    "ready_timeout": "2s", "startup_poll": "0.1s", "startup_timeout": "60s", "poison_grace": "2s",
    "kill_grace": "0.3s", "backoff_base": "0.2s", "backoff_max": "2s", "hang_seconds": "1.5s", "stop_timeout": "10s",
    "unresponsive_seconds": "1.5s",
}


def _ephemeral_floor() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 4) -> int:
    """A port P with P .. P + span - 1 free on loopback, below the kernel's ephemeral range: a fleet
    binds P + 1 .. P + N + 1 too, and any outgoing connection may hold an ephemeral port (a router's
    metrics port taken that way crash-looped it in CI)."""
    rng = random.Random()
    top = max(_ephemeral_floor(), 12000) - span
    for _ in range(500):
        p = rng.randrange(10000, top)
        try:
            with contextlib.ExitStack() as stack:
                for q in range(p, p + span):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no free block of loopback ports below the ephemeral range")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    out = []
    for name, kv in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in kv.items() if v is not None]
        out.append("")
    return "\n".join(out)


class Ember:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.state = tmp / "state"
        self.config = tmp / "ember.toml"
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("EMBER_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        self.env.update(EMBER_STATE_DIR=str(self.state), EMBER_CONFIG=str(self.config))
        self.pids: set[int] = set()

    # -- configuration ------------------------------------------------------------------------------

    def standin(self, *args: str) -> list[str]:
        return [sys.executable, str(STANDIN), "--port", str(self.port), *args]

    def configure(self, *, command: list[str] | None = None, worker: dict | None = None, fast: bool = True,
                  **daemon: Any) -> None:
        d = dict(FAST) if fast else {}
        if command is not None:
            d.update(command=command, health_url=f"{self.url}/health/live", ready_url=f"{self.url}/health/ready")
        d.update(daemon)
        w = {"port": self.port, **(worker or {})}
        self.config.write_text(to_toml({"worker": w, "daemon": d}))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- running things -----------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", *args], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def start(self, timeout: float = 60) -> subprocess.CompletedProcess:
        r = self.run("start", "--timeout", str(timeout), timeout=timeout + 10)
        self._note_pids()
        return r

    def status(self) -> dict:
        r = self.run("status", "--json", timeout=20)
        st = json.loads(r.stdout)
        st["_rc"] = r.returncode
        self._note_pids(st)
        return st

    def _note_pids(self, st: dict | None = None) -> None:
        if st is None:
            try:
                st = json.loads(self.run("status", "--json", timeout=20).stdout)
            except ValueError:
                return
        for pid in ((st.get("daemon") or {}).get("pid"), (st.get("daemon") or {}).get("supervisor_pid"),
                    (st.get("worker") or {}).get("pid")):
            if pid:
                self.pids.add(pid)

    def wait(self, pred: Callable[[dict], bool], timeout: float = 20, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout
        st: dict = {}
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(st, indent=1)[:3000]}")

    def wait_ready(self, after_restarts: int = 0, timeout: float = 30) -> dict:
        return self.wait(lambda s: s.get("state") == "ready" and s.get("restarts", 0) >= after_restarts, timeout,
                         f"ready after {after_restarts} restarts")

    def complete(self, prompt: str = "hello", timeout: float = 30, headers: dict | None = None,
                 max_tokens: int = 2) -> tuple[int, dict]:
        import urllib.error
        import urllib.request

        body = json.dumps({"model": "x", "prompt": prompt, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {}
        except OSError as e:  # refused, reset or timed out: status 0, and why
            return 0, {"error": f"{type(e).__name__}: {e}"}

    def daemon_events(self, name: str | None = None) -> list[dict]:
        out = []
        for p in sorted(self.state.glob("logs/daemon.log*"), reverse=True):
            for ln in p.read_text().splitlines():
                try:
                    o = json.loads(ln)
                except ValueError:
                    continue
                if name is None or o.get("event") == name:
                    out.append(o)
        return out

    # -- the archive ---------------------------------------------------------------------------------

    def bundles(self) -> list[Path]:
        d = self.state / "crashes"
        return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else []

    def bundle(self, path: Path) -> dict[str, Any]:
        meta = json.loads((path / "meta.json").read_text())
        return {"meta": meta, "log": (path / "worker.log").read_text(),
                "events": [json.loads(x) for x in (path / "events.jsonl").read_text().splitlines()],
                "health": [json.loads(x) for x in (path / "health.jsonl").read_text().splitlines()]}

    def check_private(self, path: Path) -> None:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for f in path.iterdir():
            mode = stat.S_IMODE(f.stat().st_mode)
            assert mode == (0o700 if f.is_dir() else 0o600), (f, oct(mode))

    # -- cleanup ---------------------------------------------------------------------------------------

    def ours(self) -> list[psutil.Process]:
        """Processes this test started: they carry our EMBER_STATE_DIR, or pids we saw."""
        out = []
        me = os.getpid()
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid == me:
                continue
            try:
                if p.pid in self.pids and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
                    continue
                state = p.environ().get("EMBER_STATE_DIR", "")  # a fleet's members: state/replicas/<name>
                if (state == str(self.state) or state.startswith(f"{self.state}/")) and \
                        p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def stop_and_check(self) -> list[str]:
        r = self.run("stop", timeout=60)
        left = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = self.ours()
            if not left:
                break
            time.sleep(0.1)
        names = [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in left if p.is_running()]
        for p in left:  # clean up what we started, by pid, before failing
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=5)
        assert r.returncode == 0, r.stderr
        return names


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)
