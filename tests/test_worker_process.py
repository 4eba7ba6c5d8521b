"""The worker process and its contract with the daemon: exit codes, poison, drain, logs."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ember.worker.bench.workerproc import free_port

KV_MEM = ("--kv-mem", "64MiB")


def _complete(url: str, prompt: str, max_tokens: int, timeout: float = 120, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, **kw}, timeout=timeout)


def test_injected_poison_exits_75_within_5s_and_says_why(start_worker):
    w = start_worker(*KV_MEM, "--fault", "poison:phase=decode", api_key=None)
    try:
        r = _complete(w.url, "Once upon a time", 30)
        assert r.status_code in (500, 503)
        t0 = time.monotonic()
        code = w.proc.wait(10)
        assert code == 75 and time.monotonic() - t0 < 5
    finally:
        w.kill()
    poison = w.events("engine_poisoned")
    assert len(poison) == 1 and poison[0]["code"] == 700 and poison[0]["name"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert w.events("failed")


def test_poisoned_worker_refuses_and_reports_not_live(start_worker):
    w = start_worker(*KV_MEM, "--fault", "poison:step=1", api_key=None)
    try:
        with httpx.Client(base_url=w.url, timeout=5) as client:  # connected before the poison: no handshake later
            assert client.get("/health/live").status_code == 200
            first = client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 5})
            # the request the poison caught: 503 with the code the door gives next (never `overloaded`)
            assert first.status_code == 503 and first.json()["error"]["code"] == "service_unavailable", first.text
            # the poisoned worker stays up POISON_FLUSH_SECONDS to flush streams, then exits 75: these
            # two probes fit well inside that window (a connection error here fails the test)
            live = client.get("/health/live")
            again = client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 2})
        assert live.status_code == 503 and live.json()["state"] == "poisoned"
        assert again.status_code == 503 and again.json()["error"]["code"] == "service_unavailable"
        assert w.proc.wait(10) == 75
    finally:
        w.kill()


def test_sigterm_drains_in_flight_work_then_exits_0(start_worker):
    w = start_worker(*KV_MEM, "--fault", "slow:ms=30", "--drain-seconds", "60", api_key=None)
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
    ev = [e["event"] for e in w.events()]
    assert "draining" in ev and ev[-1] == "exit"


def test_second_sigterm_exits_at_once(start_worker):
    w = start_worker(*KV_MEM, "--fault", "slow:ms=200", "--drain-seconds", "120", api_key=None)

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
def test_configuration_errors_exit_78(worker_env, args, needle):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(port), *args],
                       env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 78
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    err = [e for e in lines if e["event"] == "config_error"]
    assert err and needle in err[0]["error"] and "Traceback" not in p.stderr


def test_an_unforeseen_failure_while_starting_exits_1_saying_where(worker_env):
    """A bug (or the device) failing the engine's start is logged as load_failed, with what and where, and
    the worker exits 1 (a crash: the daemon restarts it with backoff), instead of answering `loading`
    forever from a task whose exception nobody read. The failure is planted in the child's calibration."""
    code = ("import sys\n"
            "from ember.worker.engine import prefill_sizing\n"
            "def broken(self, *a): raise RuntimeError('the calibration broke')\n"
            "prefill_sizing.PrefillSizing.calibrate = broken\n"
            "from ember.worker.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    p = subprocess.run([sys.executable, "-c", code, "worker", "--port", str(free_port()), "--kv-persist", "off"],
                       env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    failed = [e for e in lines if e["event"] == "load_failed"]
    assert failed and failed[0]["error"] == "RuntimeError: the calibration broke", p.stderr[-2000:]
    assert failed[0]["where"].endswith("in broken") and "Traceback" not in p.stderr
    assert [e for e in lines if e["event"] == "exit"][-1]["code"] == 1


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine can run the cuda backend")
def test_cuda_backend_without_a_gpu_is_a_configuration_error(worker_env):
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(free_port()),
                        "--backend", "cuda"], env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 78 and "cuda is not available" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("text,needle", [
    ("[worker]\nprot = 8081\n", "[worker] prot: unknown setting (did you mean port?)"),
    ("prot = 8081\n", ": prot: unknown setting (did you mean port?)"),
    ("[worker]\napikey = 'sekrit-typo'\n", "apikey: unknown setting (did you mean api_key?)"),
    ("[daemn]\nbackoff_max = '5s'\n", "[daemn]: unknown section (did you mean [daemon]?)"),
    ("port = 8081\n[worker]\nport = 8082\n", "port is set both at the top level and in [worker]"),
])
def test_an_unknown_key_or_section_in_the_config_file_exits_78(worker_env, tmp_path, text, needle):
    """A misspelled setting is refused with the nearest known one, never skipped (a misspelled api_key
    would leave a LAN-bound server open); the value itself is never echoed."""
    conf = tmp_path / "ember.toml"
    conf.write_text(text)
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--config", str(conf), "--port",
                        str(free_port())], env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 78, p.stderr[-2000:]
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    [err] = [e for e in lines if e["event"] == "config_error"]
    assert needle in err["error"] and str(conf) in err["error"] and "\n" not in err["error"]
    assert "sekrit-typo" not in p.stderr and "Traceback" not in p.stderr


def test_a_busy_port_exits_port_busy_with_one_json_line(worker_env):
    """Another process listens on the port: the worker says so in its JSON log, before loading the
    model, and exits ExitCode.PORT_BUSY (the daemon retries it), with no traceback and no raw line."""
    from ember.ops.contract import Event, ExitCode, missing_fields, parse_log_line

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--port", str(port)], env=worker_env,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == ExitCode.PORT_BUSY, p.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # no model loaded first
    records = [parse_log_line(x) for x in p.stderr.splitlines()]
    assert None not in records, p.stderr  # every line is JSON
    busy = [r for r in records if r and r["event"] == Event.PORT_BUSY]
    assert len(busy) == 1 and busy[0]["port"] == port and "already in use" in busy[0]["error"]
    assert missing_fields(busy[0]) == () and busy[0]["level"] == "error"
    assert not [r for r in records if r and r["event"] == Event.READY]


def test_an_address_of_another_machine_is_a_configuration_error(worker_env):
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--host", "192.0.2.1", "--port",
                        str(free_port())], env=worker_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 78 and "cannot listen" in p.stderr and "Traceback" not in p.stderr


def test_fault_injection_refused_off_loopback(worker_env):
    p = subprocess.run([sys.executable, "-m", "ember.worker", "worker", "--host", "0.0.0.0", "--port",
                        str(free_port()), "--fault", "hang"], env=worker_env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 78 and "non-loopback" in p.stderr


def test_effective_config_printed_once_without_secrets(start_worker):
    w = start_worker(*KV_MEM, api_key="sekrit-123")
    w.stop()
    text = w.log_text()
    configs = w.events("config")
    assert len(configs) == 1 and configs[0]["config"]["api_key"] == "***"
    assert "sekrit-123" not in text
