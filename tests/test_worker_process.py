"""The worker process and its contract with the daemon: exit codes, poison, drain, logs."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ember.worker.bench.workerproc import WorkerProcess, free_port


def _events(log_path) -> list[dict]:
    out = []
    for line in log_path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _complete(url: str, prompt: str, max_tokens: int, timeout: float = 120, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, **kw}, timeout=timeout)


@pytest.fixture
def kv_args(tmp_path):
    return ["--kv-dir", str(tmp_path / "kv"), "--kv-mem", "64MiB"]


def test_injected_poison_exits_75_within_5s_and_says_why(tmp_path, kv_args):
    w = WorkerProcess(*kv_args, "--fault", "poison:phase=decode", log_path=tmp_path / "w.log").start()
    try:
        r = _complete(w.url, "Once upon a time", 30)
        assert r.status_code in (500, 503)
        t0 = time.monotonic()
        code = w.proc.wait(10)
        assert code == 75 and time.monotonic() - t0 < 5
    finally:
        w.kill()
    ev = _events(tmp_path / "w.log")
    poison = [e for e in ev if e["event"] == "engine_poisoned"]
    assert len(poison) == 1 and poison[0]["code"] == 700 and poison[0]["name"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert any(e["event"] == "failed" for e in ev)


def test_poisoned_worker_refuses_and_reports_not_live(tmp_path, kv_args):
    w = WorkerProcess(*kv_args, "--fault", "poison:step=1", log_path=tmp_path / "w.log").start()
    try:
        _complete(w.url, "Hello", 5)
        seen = None
        for _ in range(20):  # the worker stays up a moment to flush streams, then exits 75
            try:
                live = httpx.get(f"{w.url}/health/live", timeout=2)
                again = _complete(w.url, "Hello", 2, timeout=5)
                seen = (live.status_code, live.json().get("state"), again.status_code)
                break
            except httpx.HTTPError:
                break
        if seen is not None:
            assert seen[0] == 503 and seen[1] == "poisoned" and seen[2] == 503
        assert w.proc.wait(10) == 75
    finally:
        w.kill()


def test_sigterm_drains_in_flight_work_then_exits_0(tmp_path, kv_args):
    w = WorkerProcess(*kv_args, "--fault", "slow:ms=30", "--drain-seconds", "60", log_path=tmp_path / "w.log").start()
    result = {}

    def long_request():
        result["r"] = _complete(w.url, "The history of tea", 25)

    t = threading.Thread(target=long_request)
    t.start()
    try:
        time.sleep(1.0)
        w.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(f"{w.url}/health/ready", timeout=2)
        assert ready.status_code == 503 and ready.json()["state"] == "draining"
        refused = _complete(w.url, "new work", 2, timeout=5)
        assert refused.status_code == 503 and "retry-after" in {k.lower() for k in refused.headers}
        t.join(120)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 25
        assert w.proc.wait(30) == 0
    finally:
        w.kill()
    ev = [e["event"] for e in _events(tmp_path / "w.log")]
    assert "draining" in ev and ev[-1] == "exit"


def test_second_sigterm_exits_at_once(tmp_path, kv_args):
    w = WorkerProcess(*kv_args, "--fault", "slow:ms=200", "--drain-seconds", "120", log_path=tmp_path / "w.log").start()
    def doomed():
        with contextlib.suppress(httpx.HTTPError):  # the worker goes away mid-request: expected
            _complete(w.url, "Long story", 200, timeout=30)

    threading.Thread(target=doomed, daemon=True).start()
    try:
        time.sleep(1.0)
        w.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(10) == 0 and time.monotonic() - t0 < 5
    finally:
        w.kill()


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--max-seqs", "0"], "max_seqs"),
    (["--kv-persist", "sometimes"], "kv_persist"),
    (["--fault", "explode"], "unknown fault"),
    (["--fault", "cuda-illegal-address"], "needs --backend cuda"),
])
def test_configuration_errors_exit_78(tmp_path, args, needle):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(port), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 78
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    err = [e for e in lines if e["event"] == "config_error"]
    assert err and needle in err[0]["error"] and "Traceback" not in p.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine can run the cuda backend")
def test_cuda_backend_without_a_gpu_is_a_configuration_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(free_port()), "--backend", "cuda",
                        "--kv-dir", str(tmp_path / "kv")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 78 and "cuda is not available" in p.stderr and "Traceback" not in p.stderr


def test_fault_injection_refused_off_loopback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--host", "0.0.0.0", "--port",
                        str(free_port()), "--fault", "hang"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 78 and "non-loopback" in p.stderr


def test_effective_config_printed_once_without_secrets(tmp_path, kv_args):
    w = WorkerProcess(*kv_args, "--api-key", "sekrit-123", log_path=tmp_path / "w.log").start()
    w.kill(signal.SIGTERM)
    text = (tmp_path / "w.log").read_text()
    configs = [e for e in _events(tmp_path / "w.log") if e["event"] == "config"]
    assert len(configs) == 1 and configs[0]["config"]["api_key"] == "***"
    assert "sekrit-123" not in text
