"""A real worker process on a free loopback port, read only from outside: its health endpoint, its
Prometheus metrics and its JSON log file. The one launcher of `ember bench` and of the tests
(tests/conftest.py adds a hermetic environment and the fixtures); it knows nothing of the engine.
`LlamaServerProcess` starts llama.cpp's llama-server the same way, for the benches that set the two
side by side."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

LOG_TAIL = 3000  # characters of the worker's log that a start failure carries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process (`argv(port)`) on a free loopback port, with its log in a file, ready when
    `ready_path` answers 200.

    `env` is the process's whole environment (default: this process's). With `own_session` (the bench)
    it runs in a session of its own and a stop reaches anything it spawned; without it (the tests) it
    stays in the caller's process group, so whatever ends a test run (Ctrl-C, a timeout) ends it too."""

    what = "server"
    ready_path = "/health"

    def __init__(self, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None, port: int | None = None,
                 cwd: Path | None = None, own_session: bool = True):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = argv
        self.env = dict(os.environ) if env is None else env
        self.cwd = cwd
        self.own_session = own_session
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Spawn the process and wait until its ready path answers 200."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the worker writes to it until `kill` closes it
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=self.own_session)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}; see {self.log_path}\n"
                                   f"{self.log_text()[-LOG_TAIL:]}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"{self.what} not ready after {timeout:.0f} s; see {self.log_path}\n"
                           f"{self.log_text()[-LOG_TAIL:]}")

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int | None:
        """Send `sig` to the process (its session, with `own_session`), SIGKILL it if it has not
        exited after `timeout`; returns the exit code. Safe to call again, or before `start`."""
        if self.proc and self.proc.poll() is None:
            self._signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
        return self.proc.returncode if self.proc else None

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.own_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """A clean stop: SIGTERM (a worker drains), SIGKILL after `timeout`."""
        return self.kill(signal.SIGTERM, timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class LlamaServerProcess(ServerProcess):
    """llama.cpp's `llama-server` (the binary at `binary`) with `args` (the model, its flags) on a free
    loopback port."""

    what = "llama-server"

    def __init__(self, binary: str | Path, *args: str, log_path: Path, port: int | None = None):
        port = port or free_port()
        super().__init__([str(binary), "--host", "127.0.0.1", "--port", str(port), *args], log_path=log_path,
                         port=port)


class WorkerProcess(ServerProcess):
    """`python -m ember.worker worker` on a free loopback port, with its log in a file. `api_key` is
    passed as `--api-key` and sent by `headers()`; the rest as ServerProcess."""

    what = "worker"
    ready_path = "/health/ready"

    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None, port: int | None = None,
                 cwd: Path | None = None, api_key: str | None = None, own_session: bool = True):
        port = port or free_port()
        self.api_key = api_key
        auth = ["--api-key", api_key] if api_key else []
        super().__init__([sys.executable, "-m", "ember.worker", "worker", "--host", "127.0.0.1", "--port", str(port),
                          *args, *auth], log_path=log_path, env=env, port=port, cwd=cwd, own_session=own_session)

    def start(self, timeout: float = 300.0) -> WorkerProcess:
        super().start(timeout)
        return self

    def __enter__(self) -> WorkerProcess:
        return self.start()

    # -- reading it from outside -------------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def events(self, event: str | None = None, **match) -> list[dict]:
        """The log's JSON records, optionally only one event's, whose fields equal `match`."""
        out = []
        for line in self.log_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or (event is not None and rec.get("event") != event):
                continue
            if all(rec.get(k) == v for k, v in match.items()):
                out.append(rec)
        return out

    def wait_event(self, event: str, timeout: float = 60.0, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(event, **match)
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {event} {match} in the worker log within {timeout}s:\n"
                             f"{self.log_text()[-LOG_TAIL:]}")

    def metric_values(self) -> dict[str, float]:
        """Every sample of GET /metrics, keyed `name{label=value}...` with the labels sorted."""
        text = httpx.get(self.url + "/metrics", headers=self.headers()).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
                out[key] = s.value
        return out
