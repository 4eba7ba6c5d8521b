"""Replicas behind sglang-router (the data plane of `[daemon] replicas`): two real numpy workers on
loopback ports behind a real `sglang_router.launch_router` (the PyPI package's Rust router, the
cache_aware policy). The OpenAI APIs go through it; Anthropic's /v1/messages is not a route of the
router (docs/operations.md, "Replicas on one host"). A worker killed with SIGKILL under eight streaming
clients loses only its own in-flight requests, and rejoins when it is ready again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from ember.daemon.fleet import ROUTER_HEALTH
from ember.worker.bench.workerproc import WorkerProcess, free_port

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the test extra installs it)")

WORKER_ARGS = ("--max-seqs", "4", "--max-queue", "32", "--ctx", "1024", "--kv-mem", "96MiB", "--drain-seconds", "2")
# greedy: a sampled answer may be the end of the turn at once (an empty reply: seen once in CI)
CHAT = {"model": "ember", "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8,
        "temperature": 0}


class Router:
    """`python -m sglang_router.launch_router` in front of `urls`, with the fleet's health settings."""

    def __init__(self, urls: list[str], log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - the router writes to it until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-port", str(free_port()), "--worker-urls", *urls, "--policy", "cache_aware",
             *ROUTER_HEALTH, "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def healthy(self) -> set[str]:
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["url"] for w in workers if w.get("is_healthy")}

    def wait_healthy(self, urls: list[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the router exited"
            if set(urls) <= self.healthy():
                return
            time.sleep(0.2)
        raise TimeoutError(f"router: {self.healthy()} healthy of {urls}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def replicas(tmp_path, default_model_path):
    from conftest import hermetic_env

    workers = []
    for i in range(2):
        d = tmp_path / f"replica-{i}"
        d.mkdir()
        workers.append(WorkerProcess("--model", str(default_model_path), *WORKER_ARGS, log_path=d / "worker.log",
                                     env=hermetic_env(d), cwd=d, own_session=False))
    router = None
    try:
        for w in workers:
            w.start()
        router = Router([w.url for w in workers], tmp_path / "router.log")
        router.wait_healthy([w.url for w in workers])
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop(timeout=10)


def test_openai_apis_through_the_router(replicas):
    router, _ = replicas
    with httpx.Client(base_url=router.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        r = c.post("/v1/completions", json={"model": "ember", "prompt": "The sky is", "max_tokens": 6,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # the router fills in stream: null and top_k: -1 ("all tokens"); the worker takes both
        r = c.post("/v1/responses", json={"model": "ember", "input": "Say hello.", "max_output_tokens": 6,
                                               "temperature": 0})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"]
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) > 2
        # not a route of sglang-router 0.3: Anthropic clients talk to a worker (docs/operations.md, "Replicas on one
        # host")
        assert c.post("/v1/messages", json={**CHAT, "max_tokens": 4}).status_code == 404


def test_a_killed_replica_loses_only_its_requests_and_rejoins(replicas):
    router, workers = replicas
    outcomes: list[tuple[float, bool]] = []  # (sent at, succeeded)
    lock, stop = threading.Lock(), threading.Event()

    def client() -> None:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            while not stop.is_set():
                sent, ok = time.monotonic(), False
                try:
                    with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
                        ok = s.status_code == 200 and [ln for ln in s.iter_lines() if ln][-1:] == ["data: [DONE]"]
                except httpx.HTTPError:
                    pass
                with lock:
                    outcomes.append((sent, ok))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # the load runs on both replicas before the kill (slow CI: give it time)
    while sum(ok for _, ok in list(outcomes)) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = workers[0]
    assert victim.proc is not None
    victim.proc.kill()  # SIGKILL
    killed = time.monotonic()
    victim.proc.wait()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    before = [ok for sent, ok in outcomes if sent < killed]
    after = [ok for sent, ok in outcomes if sent >= killed]
    assert sum(before) >= 8, outcomes
    print(f"before the kill: {sum(before)} of {len(before)} succeeded; after: {sum(after)} of {len(after)}")
    assert after and all(after), f"{after.count(False)} of {len(after)} requests sent after the kill failed"
    # in flight on the victim at the kill: at most its 4 running and the queue's few, never the other's
    assert before.count(False) <= 8, outcomes

    # the replica comes back on its port and the router puts it back in rotation
    victim.start()  # the same command on the same port
    router.wait_healthy([w.url for w in workers], timeout=30)
    with httpx.Client(base_url=router.url, timeout=60) as c:
        assert all(c.post("/v1/chat/completions", json=CHAT).status_code == 200 for _ in range(4))
