"""Shared fixtures. Tests run real components against the embedded model (assembled once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    override = os.environ.get("EMBER_TEST_MODEL")
    if override:
        return Path(override)
    from ember.worker.model.embedded import default_model_path as embedded

    return embedded(quiet=True)


# -- a real worker process over HTTP (tests/test_api_*.py) ------------------------------------------------------

API_KEY = "test-key"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`python -m ember.worker worker` on a free loopback port, its JSON log in a file."""

    def __init__(self, model_path: Path, workdir: Path, args: list[str], api_key: str | None = API_KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.workdir = workdir
        self.log_path = workdir / "worker.log"
        argv = [os.environ.get("PYTHON", _python()), "-m", "ember.worker", "worker", "--model", str(model_path),
                "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            argv += ["--api-key", api_key]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        env["EMBER_KV_DIR"] = str(workdir / "kv")  # never the user's KV store
        env.setdefault("OMP_NUM_THREADS", "1")
        self._log = open(self.log_path, "wb")
        import subprocess

        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=workdir)

    def wait_ready(self, timeout: float = 240.0) -> "WorkerProcess":
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"worker not ready after {timeout}s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, event: str | None = None, **match) -> list[dict]:
        import json

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
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(event, **match)
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {event} {match} in the worker log within {timeout}s:\n{self.log_text()[-3000:]}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit code."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _python() -> str:
    import sys

    return sys.executable


@pytest.fixture(scope="session")
def start_worker(default_model_path, tmp_path_factory):
    """Start workers with extra flags; every one is stopped at the end of the session."""
    started: list[WorkerProcess] = []

    def start(*args: str, api_key: str | None = API_KEY, wait: bool = True) -> WorkerProcess:
        w = WorkerProcess(default_model_path, tmp_path_factory.mktemp("worker"), list(args), api_key)
        started.append(w)
        return w.wait_ready() if wait else w

    yield start
    for w in started:
        w.stop(timeout=10)


@pytest.fixture(scope="session")
def api_worker(start_worker) -> WorkerProcess:
    """The shared worker of the API tests: small context and KV budget, four sequences."""
    return start_worker("--max-seqs", "4", "--max-queue", "16", "--ctx", "1024", "--kv-mem", "96MiB",
                        "--prefill-chunk", "64", "--drain-seconds", "5")


@pytest.fixture(scope="session")
def openai_client(api_worker):
    import openai

    return openai.OpenAI(base_url=api_worker.url + "/v1", api_key=api_worker.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(api_worker):
    import anthropic

    return anthropic.Anthropic(base_url=api_worker.url, api_key=api_worker.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def openai_factory():
    """An official openai client for any WorkerProcess."""
    import openai

    return lambda w: openai.OpenAI(base_url=w.url + "/v1", api_key=w.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def hardened_worker(start_worker) -> WorkerProcess:
    """The worker the adversarial suites attack (tests/test_api_hardening.py, test_api_fuzz.py): a
    key, the metrics behind it, one allowed web origin, a two-token output cap so that generated
    requests stay quick, and the default bounds otherwise."""
    return start_worker("--max-seqs", "4", "--max-queue", "64", "--ctx", "2048", "--kv-mem", "160MiB",
                        "--prefill-chunk", "128", "--max-output-tokens", "2", "--metrics-auth",
                        "--allowed-origins", "https://ok.example")
