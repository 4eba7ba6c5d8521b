"""Faults an always-on host must ride out, on the daemon's side (issue 38), with the real CLI, daemon and
supervisord around the stand-in engine (tests/test_daemon_standin.py): a port another process takes for a
while, before the daemon starts or after a crash."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_daemon_support import Ember, kill


@contextlib.contextmanager
def holding(port: int, timeout: float = 10.0):
    """Listen on 127.0.0.1:`port` (as soon as it is free, within `timeout`) until the block ends."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                s.close()
                raise
            time.sleep(0.005)
    s.listen(1)
    try:
        yield s
    finally:
        s.close()


def test_a_port_taken_after_a_crash_is_retried_with_backoff_and_named(ember: Ember):
    """SIGKILL, then another process binds the worker's port for a few seconds: the daemon backs off
    (not `failed`, no bundle for the conflict, the breaker untouched), `ember status` names the holder and
    the next try, and the worker serves again within one backoff step of the port coming free."""
    e = ember
    e.configure(command=e.standin(), backoff_base="0.5s", backoff_max="1s", breaker_crashes=2)
    assert e.start().returncode == 0
    pid = e.status()["worker"]["pid"]
    kill(pid, signal.SIGKILL)
    with holding(e.port):
        st = e.wait(lambda s: (s.get("port_conflict") or {}).get("tries", 0) >= 3, 20, "three tries on a busy port")
        assert st["state"] == "backoff" and st["failed_reason"] is None and st["next_restart_in"] is not None
        pc = st["port_conflict"]
        assert pc["pid"] == os.getpid() and pc["port"] == e.port and pc["retry_at"] and pc["since"]
        assert f"port {e.port}" in st["not_ready_reason"] and f"pid {os.getpid()}" in st["not_ready_reason"]
        assert st["breaker"]["state"] == "closed"  # more conflicts than breaker_crashes, never counted
        human = e.run("status")
        assert f"held by pid {os.getpid()}" in human.stdout and "next try in" in human.stdout, human.stdout
        freed = time.monotonic()
    st = e.wait_ready(after_restarts=1, timeout=20)
    waited = time.monotonic() - freed
    assert waited < 1.0 + 3.0, waited  # backoff_max, and the stand-in's start
    assert st["port_conflict"] is None and st["worker"]["pid"] != pid
    assert len(e.bundles()) == 1  # the SIGKILL; the conflict itself is no crash
    busy = e.daemon_events("port_busy")
    assert len(busy) >= 3 and busy[0]["pid"] == os.getpid() and busy[0]["level"] == "warning"
    assert e.daemon_events("port_free")
    assert e.daemon_events("worker_failed") == []


@pytest.mark.parametrize("which", ["own", "also_listens"])
def test_a_port_taken_before_the_daemon_starts_waits_and_serves(ember: Ember, which: str):
    """`ember start` while someone else listens on the port, or on another address the engine binds
    (`also_listens`: sglang-router's metrics port panics it when taken, a crash each try): it says who,
    keeps waiting while the daemon retries, and returns ready once the port is free."""
    e = ember
    taken = e.port if which == "own" else e.port + 3
    e.configure(command=e.standin(), backoff_base="0.3s", backoff_max="1s",
                also_listens=[f"127.0.0.1:{taken}"] if which == "also_listens" else None)
    with holding(taken):
        proc = subprocess.Popen([sys.executable, "-m", "ember.daemon.cli_main", "start", "--timeout", "40"],
                                env=e.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            st = e.wait(lambda s: s.get("port_conflict") is not None, 20, "the port conflict")
            assert st["state"] == "backoff" and st["_rc"] == 1
            time.sleep(2.0)  # a few tries while the port stays taken: still waiting, not failed
            assert proc.poll() is None and e.status()["state"] == "backoff"
        except BaseException:
            proc.kill()
            raise
    out, err = proc.communicate(timeout=40)
    assert proc.returncode == 0, err
    assert f"port {taken}" in err and "held by pid" in err and "waiting for it" in err
    assert "ember is ready" in out
    st = e.status()
    assert st["state"] == "ready" and st["port_conflict"] is None and e.bundles() == []


def test_a_worker_that_exits_port_busy_is_retried_not_failed(ember: Ember):
    """The worker's own exit code for a port it could not bind (ExitCode.PORT_BUSY: the port was taken
    between the daemon's check and the worker's bind) backs off and retries, without a crash bundle."""
    from ember.ops.contract import ExitCode

    e = ember
    e.configure(command=e.standin("--fault", f"exit:code={int(ExitCode.PORT_BUSY)}:after=0", "--once",
                                  str(e.tmp / "once")))
    e.run("start", "--no-wait")
    st = e.wait_ready(timeout=30)
    assert e.bundles() == [] and st["state"] == "ready"
    exits = e.daemon_events("worker_exit")
    assert [x["code"] for x in exits] == [int(ExitCode.PORT_BUSY)]
    assert e.daemon_events("port_busy") and e.daemon_events("worker_failed") == []
    assert [p["to"] for p in e.daemon_events("phase")][-3:] == ["backoff", "starting", "running"]


def test_a_misspelled_setting_is_refused_by_every_verb(ember: Ember):
    """`[worker] prot`, a top-level typo, `[daemn]`: `ember config show` and `ember start` exit 78 naming the
    key and the nearest known one, before any process starts; `ember daemon run` refuses a section it does
    not know. (`[daemon] bogus` was refused already.)"""
    from ember.ops.contract import ExitCode

    e = ember
    cases = [("[worker]\nprot = 8081\n", "[worker] prot: unknown setting (did you mean port?)"),
             (f"port = {e.port}\nmax_seq = 2\n", "max_seq: unknown setting (did you mean max_seqs?)"),
             (f"port = {e.port}\n[daemn]\nbackoff_max = '2s'\n", "[daemn]: unknown section (did you mean [daemon]?)"),
             (f"port = {e.port}\n[daemon]\nbackof_max = '2s'\n", "[daemon] backof_max: unknown setting (did you mean "
                                                                  "backoff_max?)")]
    for text, needle in cases:
        e.config.write_text(text)
        show = e.run("config", "show")
        assert show.returncode == ExitCode.CONFIG and needle in show.stdout, (text, show.stdout)
        start = e.run("start", "--timeout", "20")
        assert start.returncode == ExitCode.CONFIG and needle in start.stderr, (text, start.stderr)
        assert start.stderr.count("\n") == 1  # one line
    assert not (e.state / "logs" / "worker.log").exists() and e.ours() == []  # nothing ever started
    e.config.write_text(f"port = {e.port}\n[daemn]\nbackoff_max = '2s'\n")
    run = e.run("daemon", "run", timeout=20)
    assert run.returncode == ExitCode.CONFIG and "[daemn]: unknown section" in run.stderr
    e.config.write_text(f"port = {e.port}\n")
    assert e.run("config", "show").returncode == 0


def test_kv_persistence_degrading_shows_in_ember_status_and_the_daemons_log(ember: Ember, default_model_path):
    """The real worker, its KV disk full (the disk-full stand-in: tests/test_kv_persistence.py fills a real
    tmpfs too): `ember status` says persistence is degraded, why and since when, the daemon's log says when
    it changes, both ways, and the worker is never restarted for it."""
    e = ember
    flag = e.tmp / "disk-is-full"
    e.configure(worker={"model": str(default_model_path), "drain_seconds": 2, "max_seqs": 2, "ctx": 1024,
                        "kv_mem": "64MiB", "kv_dir": str(e.tmp / "kv")},
                worker_args=["--fault", f"disk-full:while={flag}"], ready_interval="30s", ready_timeout="10s",
                live_interval="0.5s", live_timeout="2s", startup_timeout="90s")
    assert e.start(timeout=90).returncode == 0
    st = e.status()
    assert st["worker"]["kv_persistence"]["state"] == "persisting"
    assert "kv cache persisting" in e.run("status").stdout
    flag.touch()
    prompt = "The lighthouse keeper counted the candles and wound the clock while the storm lasted. " * 3
    assert e.complete(prompt, timeout=60)[0] == 200
    st = e.wait(lambda s: (s["worker"].get("kv_persistence") or {}).get("state") == "degraded", 30, "degraded")
    kv = st["worker"]["kv_persistence"]
    assert "disk full" in kv["reason"] and kv["since"] and st["state"] == "ready"
    human = e.run("status").stdout
    assert "kv cache DEGRADED since" in human and "disk full" in human, human
    [news] = e.daemon_events("kv_persistence")
    assert news["state"] == "degraded" and "disk full" in news["reason"] and news["level"] == "warning"
    flag.unlink()
    e.wait(lambda s: (s["worker"].get("kv_persistence") or {}).get("state") == "persisting", 60, "persisting")
    assert [x["state"] for x in e.daemon_events("kv_persistence")] == ["degraded", "persisting"]
    assert e.status()["restarts"] == 0 and e.bundles() == []


def test_a_stopped_real_worker_is_restarted_at_once_and_its_bundle_names_the_stuck_chat(ember: Ember,
                                                                                        default_model_path):
    """SIGSTOP while a chat streams: restarted within seconds (it took 70 s), and the bundle's affected
    requests are the chat in flight, not a probe that had finished."""
    import threading

    import httpx

    e = ember
    e.configure(worker={"model": str(default_model_path), "drain_seconds": 2, "max_seqs": 2},
                worker_args=["--fault", "slow:ms=100"], ready_interval="1s", ready_timeout="10s",
                live_interval="0.5s", live_timeout="2s", startup_timeout="90s", unresponsive_seconds="60s")
    assert e.start(timeout=90).returncode == 0
    pid = e.status()["worker"]["pid"]
    outcome: dict = {}

    def chat() -> None:
        try:
            httpx.post(f"{e.url}/v1/chat/completions", timeout=60, json={
                "model": "m", "max_tokens": 300, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story"}]})
        except httpx.HTTPError as x:
            outcome["error"] = type(x).__name__

    t = threading.Thread(target=chat, daemon=True)
    t.start()
    admitted = e.state / "logs" / "worker.log"
    deadline = time.monotonic() + 30
    while '"protocol": "chat"' not in admitted.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # a probe or two come and go while it streams
    t0 = time.monotonic()
    kill(pid, signal.SIGSTOP)
    st = e.wait_ready(after_restarts=1, timeout=60)
    assert time.monotonic() - t0 < 20 and st["worker"]["pid"] != pid
    t.join(30)
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "hang" and m["detection"]["process_status"] == "stopped"
    affected = m["log_window"]["affected_requests"]
    chats = [r for r in affected if r.startswith("chatcmpl-")]
    assert len(chats) == 1, affected
    log = e.bundle(path)["log"]
    finished = {json.loads(x)["request_id"] for x in log.splitlines()
                if x.startswith("{") and json.loads(x).get("event") == "completed"}
    assert not finished & set(affected), (finished, affected)  # no request that had finished
