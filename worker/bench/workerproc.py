"""Start and stop real worker processes for benchmarks and tests (loopback only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`python -m ember.worker worker` on a free loopback port, with its log in a file."""

    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.args = [sys.executable, "-m", "ember.worker", "worker", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> "WorkerProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"worker not ready after {timeout:.0f} s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()
        return self.proc.returncode if self.proc else None

    def __enter__(self) -> "WorkerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill(signal.SIGTERM)
