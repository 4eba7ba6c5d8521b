"""The daemon with real supervisord, real processes and real signals, around the stand-in engine
(tests/test_daemon_standin.py, which starts in a fraction of a second and speaks the worker
contract). The real worker's own versions of these live in test_daemon_worker.py."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import threading
import time

import psutil
import pytest
from test_daemon_support import FAST, Ember, kill, to_toml

SECRET_PROMPT = "my-private-prompt-words"
API_KEY = "sekrit-key-0123456789"


def _checks_common(e: Ember, b: dict, cls: str) -> None:
    m = b["meta"]
    assert m["schema"] == 1 and m["class"] == cls
    assert len(m["signature"]) == 12
    assert m["detected_at"].endswith("+00:00")
    assert m["uptime_seconds"] is not None and m["uptime_seconds"] >= 0
    assert m["worker"]["version"] == "standin-1" and m["worker"]["model_fingerprint"] == "f00dfeed"
    assert m["host"]["python"] and "gpu" in m
    assert isinstance(m["restart"], dict)
    assert b["health"], "health.jsonl holds the last probes"
    assert all("probe" in h for h in b["health"])


def test_poisoned_context_from_log_restarts_and_archives(ember: Ember):
    e = ember
    e.configure(command=e.standin("--fault", "poison:requests=3", "--once", str(e.tmp / "once"), "--log-prompts",
                                  "--api-key", API_KEY), worker={"api_key": API_KEY})
    r = e.start()
    assert r.returncode == 0, r.stderr
    assert f"http://127.0.0.1:{e.port}/v1" in r.stdout
    st = e.status()
    assert st["state"] == "ready" and st["_rc"] == 0 and st["restarts"] == 0
    first_pid = st["worker"]["pid"]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert e.complete(SECRET_PROMPT, headers=auth)[0] == 200  # cmpl-1
    assert e.complete(SECRET_PROMPT, headers=auth)[0] == 200  # cmpl-2
    assert e.complete(SECRET_PROMPT, headers=auth)[0] == 503  # cmpl-3 poisons the context
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != first_pid
    assert st["last_crash"]["class"] == "poisoned-context"
    phases = e.daemon_events("phase")  # every transition logged, with its reason
    assert [(p["from"], p["to"]) for p in phases] == [
        ("stopped", "starting"), ("starting", "running"), ("running", "killing"), ("killing", "backoff"),
        ("backoff", "starting"), ("starting", "running")]
    assert all(p["why"] for p in phases) and "poisoned" in phases[2]["why"]
    assert 0 < st["last_recovery_seconds"] < 10
    [path] = e.bundles()
    assert path.name.endswith("-poisoned-context") and path.name == st["last_crash"]["id"]
    e.check_private(path)
    for p in [e.state, *e.state.rglob("*")]:  # the whole state tree: dirs 0700, files 0600
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir():
            assert mode == 0o700, (p, oct(mode))
        elif p.is_file():
            assert mode == 0o600, (p, oct(mode))
        else:  # unix sockets
            assert mode & 0o077 == 0, (p, oct(mode))
    b = e.bundle(path)
    _checks_common(e, b, "poisoned-context")
    m = b["meta"]
    assert m["cuda_error"]["code"] == 700 and m["cuda_error"]["name"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert m["exit_code"] == 75
    assert m["detection"]["source"] == "log"
    assert m["restart"] == {"restart": True, "delay": 0.2,
                            "reason": "poisoned-context: restart after the minimum delay"}
    assert m["log_window"]["affected_requests"] == ["cmpl-3"]
    # cmpl-2, unless the daemon's readiness probe (a real request, probe-N) answered after it
    last = m["log_window"]["last_healthy_request"]
    assert last == "cmpl-2" or last.startswith("probe-"), last
    # the window runs from the last healthy request to the crash line and the exit
    log = b["log"]
    assert f'"event": "completed", "request_id": "{last}"' in log
    assert "engine_poisoned" in log and '"code": 75' in log
    # session shape without prompt text (the stand-in logged prompts: --log-prompts)
    assert SECRET_PROMPT in (e.state / "logs" / "worker.log").read_text()
    events = b["events"]
    assert [x["event"] for x in events if x.get("request_id") == "cmpl-3"] == ["admit", "failed"]
    assert {x["event"] for x in events} >= {"admit", "completed", "engine_poisoned", "failed"}
    assert all(x.get("prompt_tokens") is not None for x in events if x["event"] == "admit")
    for name in ("events.jsonl", "meta.json", "health.jsonl"):
        text = (path / name).read_text()
        assert SECRET_PROMPT not in text, name
        assert API_KEY not in text, name
    assert API_KEY not in log
    # ops
    out = e.run("crashes", "list")
    assert out.returncode == 0 and "poisoned-context" in out.stdout and m["signature"] in out.stdout
    rows = json.loads(e.run("crashes", "list", "--json").stdout)
    assert rows[0]["id"] == path.name and rows[0]["cuda"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    show = e.run("crashes", "show", "latest")
    assert show.returncode == 0 and "engine_poisoned" in show.stdout and "CUDA_ERROR_ILLEGAL_ADDRESS" in show.stdout
    tgz = e.tmp / "bug.tar.gz"
    ex = e.run("crashes", "export", path.name[:15], "-o", str(tgz))
    assert ex.returncode == 0, ex.stderr
    with tarfile.open(tgz) as t:
        names = sorted(x.name.split("/")[-1] for x in t.getmembers())
        assert names == ["events.jsonl", "health.jsonl", "meta.json", "worker.log"]
        assert all(x.mode == 0o600 for x in t.getmembers())
        meta = json.loads(t.extractfile(f"{path.name}/meta.json").read())
        assert meta["host"]["hostname"] == "<host>"
    # logs, pretty
    lg = e.run("logs", "-n", "200")
    assert lg.returncode == 0 and not lg.stdout.lstrip().startswith("{")
    assert "ERROR engine_poisoned" in lg.stdout and "code=700" in lg.stdout


def test_sigkill_and_sigsegv_are_crash_signals_with_backoff(ember: Ember):
    e = ember
    e.configure(command=e.standin())
    assert e.start().returncode == 0
    pid1 = e.status()["worker"]["pid"]
    assert e.complete()[0] == 200
    kill(pid1, signal.SIGKILL)
    st = e.wait_ready(after_restarts=1)
    pid2 = st["worker"]["pid"]
    assert pid2 != pid1
    kill(pid2, signal.SIGSEGV)
    st = e.wait_ready(after_restarts=2)
    b1, b2 = (e.bundle(p) for p in e.bundles())
    for b, sig, pid in ((b1, "SIGKILL", pid1), (b2, "SIGSEGV", pid2)):
        _checks_common(e, b, "crash-signal")
        m = b["meta"]
        assert m["signal"] == sig and m["exit"]["signal_number"] == getattr(signal, sig)
        assert m["worker"]["pid"] == pid and m["detection"]["source"] == "exit"
        assert m["exit"].get("killed_by_daemon") is None
        assert '"event": "completed"' in b["log"] or '"event": "ready"' in b["log"]
    assert b1["meta"]["signature"] != b2["meta"]["signature"]
    delays = [x["delay"] for x in e.daemon_events("restart_scheduled")]
    assert delays == [0.2, 0.4]  # backoff doubles from the base
    assert b2["meta"]["restart_count"] == 1


def test_foreign_engine_illegal_access_while_answering(ember: Ember):
    e = ember
    cmd = e.standin("--raw", "--fault", "illegal:after=0.5", "--once", str(e.tmp / "once"))
    e.configure(command=cmd, health_url=f"{e.url}/health", ready_url=f"{e.url}/health", poison_grace="0.5s")
    assert e.start().returncode == 0
    pid1 = e.status()["worker"]["pid"]
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != pid1
    [path] = e.bundles()
    b = e.bundle(path)
    m = b["meta"]
    assert m["class"] == "poisoned-context" and m["worker"]["engine"] == "command"
    assert m["cuda_error"]["code"] == 700 and "illegal memory access" in m["cuda_error"]["message"]
    assert m["exit"]["killed_by_daemon"] is True and m["exit"]["signal"] == "SIGKILL"
    assert "an illegal memory access was encountered" in b["log"]
    assert m["log_window"]["crash_line"].startswith("CUDA error 700")


def test_a_named_engine_profile_watches_its_own_fatal_lines(ember: Ember):
    """engine = "vllm": URLs from the profile, and its EngineDeadError (the API server still answering
    200) is a poisoned engine: killed, archived naming the profile, restarted."""

    e = ember
    cmd = e.standin("--raw", "--fault", "engine-dead:after=0.5", "--once", str(e.tmp / "once"))
    e.config.write_text(to_toml({"worker": {"port": e.port},
                                 "daemon": {**FAST, "command": cmd, "engine": "vllm", "poison_grace": "0.5s"}}))
    assert e.start().returncode == 0
    pid1 = e.status()["worker"]["pid"]
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != pid1 and st["worker"]["engine"] == "vllm"
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "poisoned-context" and m["worker"]["engine"] == "vllm"
    assert m["cuda_error"]["name"] == "vllm-engine-core-died"
    assert "EngineCore encountered a fatal error" in m["log_window"]["crash_line"]


@pytest.mark.parametrize("stall", [True, False], ids=["live-503-stalled", "no-progress-readiness"])
def test_hang_with_port_open(ember: Ember, stall: bool):
    e = ember
    fault = "hang:requests=3" + (":stall=0.3" if stall else "")
    e.configure(command=e.standin("--fault", fault, "--once", str(e.tmp / "once")))
    assert e.start().returncode == 0
    pid1 = e.status()["worker"]["pid"]
    assert e.complete()[0] == 200
    assert e.complete()[0] == 200
    assert e.complete(timeout=1)[0] == 0  # cmpl-3 hangs
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != pid1
    [path] = e.bundles()
    b = e.bundle(path)
    m = b["meta"]
    assert m["class"] == "hang"
    assert m["detection"]["source"] == ("liveness" if stall else "readiness")
    assert m["exit"]["killed_by_daemon"] is True
    assert "cmpl-3" in m["log_window"]["affected_requests"]  # (with the daemon's own hung probes)
    if not stall:
        assert any(h.get("timeout") for h in b["health"] if h["probe"] == "ready")
        # a probe still running when its next turn comes is recorded, not silently skipped
        assert any("skipped" in str(h.get("error")) for h in b["health"] if h["probe"] == "ready")


def test_exit_78_is_not_restarted(ember: Ember):
    e = ember
    e.configure(command=e.standin("--fault", "config"))
    r = e.start(timeout=20)
    assert r.returncode == 1 and "configuration error" in r.stderr and "injected configuration error" in r.stderr
    time.sleep(1.0)
    st = e.status()
    assert st["state"] == "failed" and st["restarts"] == 0 and st["_rc"] == 1
    assert "exit 78" in st["failed_reason"]
    assert len(e.daemon_events("worker_spawn")) == 1
    assert e.bundles() == []
    human = e.run("status")
    assert "failed" in human.stdout and "injected configuration error" in human.stdout
    # an engine command that cannot run at all is a configuration error too
    e.configure(command=[str(e.tmp / "no-such-engine"), "--port", str(e.port)])
    r = e.run("restart", "--timeout", "20")
    assert r.returncode == 1 and "cannot run" in r.stderr and "no-such-engine" in r.stderr
    assert e.status()["restarts"] == 0 and e.bundles() == []


def test_crash_storm_opens_the_breaker(ember: Ember):
    e = ember
    e.configure(command=e.standin("--fault", "exit:code=3:after=0.05"), breaker_crashes=3, breaker_window="60s",
                backoff_base="0.05s")
    e.run("start", "--no-wait")
    st = e.wait(lambda s: s.get("state") == "failed", 30, "breaker")
    assert "circuit breaker open: 3 failures" in st["failed_reason"]
    paths = e.bundles()
    assert len(paths) == 3
    metas = [e.bundle(p)["meta"] for p in paths]
    assert {m["class"] for m in metas} == {"crash-exit"} and {m["exit_code"] for m in metas} == {3}
    assert len({m["signature"] for m in metas}) == 1  # repeats group under one signature
    assert metas[-1]["restart"]["restart"] is False
    time.sleep(0.5)
    assert len(e.daemon_events("worker_spawn")) == 3
    rows = json.loads(e.run("crashes", "list", "--json").stdout)
    assert [r["repeats"] for r in rows] == [3, 3, 3]
    # a person fixes the engine's configuration and asks again: settings re-read, breaker closed
    e.configure(command=e.standin(), breaker_crashes=3)
    r = e.run("restart", "--timeout", "20")
    assert r.returncode == 0, r.stderr
    st = e.status()
    assert st["state"] == "ready" and st["failed_reason"] is None


def test_oom_is_classified(ember: Ember):
    e = ember
    e.configure(command=e.standin("--fault", "oom:after=0.2", "--once", str(e.tmp / "once")))
    assert e.start().returncode == 0
    e.wait_ready(after_restarts=1)
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "oom" and m["exit_code"] == 1


def test_daemon_kill_leaves_worker_serving_and_reattaches(ember: Ember):
    e = ember
    e.configure(command=e.standin())
    assert e.start().returncode == 0
    st = e.status()
    dpid, spid, wpid = st["daemon"]["pid"], st["daemon"]["supervisor_pid"], st["worker"]["pid"]
    kill(dpid, signal.SIGKILL)
    psutil.Process(dpid).wait(5) if psutil.pid_exists(dpid) else None
    assert e.complete()[0] == 200  # still serving without a daemon
    gone = e.status()
    assert gone["_rc"] == 3 and gone["daemon"]["running"] is False
    assert gone["state"] == "unsupervised" and gone["worker"]["pid"] == wpid
    assert psutil.pid_exists(spid) and psutil.pid_exists(wpid)
    assert e.start().returncode == 0
    st = e.status()
    assert st["daemon"]["attached"] is True and st["daemon"]["pid"] != dpid
    assert st["worker"]["pid"] == wpid and st["daemon"]["supervisor_pid"] == spid and st["restarts"] == 0
    # the re-attached daemon still watches: a crash now is archived and restarted
    kill(wpid, signal.SIGKILL)
    st = e.wait_ready(after_restarts=1)
    [path] = e.bundles()
    assert e.bundle(path)["meta"]["signal"] == "SIGKILL"
    # the daemon and the worker both die; a new daemon archives what happened while no one watched
    st = e.status()
    kill(st["daemon"]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    kill(st["worker"]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    assert e.start().returncode == 0
    st = e.wait_ready(after_restarts=2)
    paths = e.bundles()
    assert len(paths) == 2
    m = e.bundle(paths[-1])["meta"]
    assert m["detection"]["source"] == "attach" and m["signal"] == "SIGKILL"


def test_systemd_notify_and_watchdog(ember: Ember):
    e = ember
    e.configure(command=e.standin())
    sock_path = str(e.tmp / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.settimeout(0.2)
    msgs: list[str] = []
    done = threading.Event()

    def read() -> None:  # as systemd does: all along (a full queue would drop the daemon's datagrams)
        while not done.is_set():
            try:
                msgs.extend(s.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue
            except OSError:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    env = {**e.env, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "200000"}
    proc = subprocess.Popen([sys.executable, "-m", "ember.daemon.cli_main", "daemon", "run"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    e.pids.add(proc.pid)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and sum(m == "WATCHDOG=1" for m in msgs) < 3:
            time.sleep(0.05)
        assert "READY=1" in msgs and f"MAINPID={proc.pid}" in msgs
        assert sum(m == "WATCHDOG=1" for m in msgs) >= 3
        e.wait_ready()
        proc.send_signal(signal.SIGHUP)  # systemctl reload: re-read ember.toml, keep running
        time.sleep(0.5)
        assert proc.poll() is None and [x["command"] for x in e.daemon_events("command")] == ["reload"]
        proc.send_signal(signal.SIGTERM)  # systemctl stop
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "STOPPING=1" not in msgs:
            time.sleep(0.05)
        assert "STOPPING=1" in msgs
        assert any(m.startswith("STATUS=worker ready") for m in msgs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        done.set()
        reader.join(2)
        s.close()


def test_manual_restart_drains_without_a_bundle(ember: Ember):
    e = ember
    e.configure(command=e.standin())
    assert e.start().returncode == 0
    st = e.status()
    pid = st["worker"]["pid"]
    r = e.run("restart", "--timeout", "30")
    assert r.returncode == 0, r.stderr
    st = e.status()
    assert st["worker"]["pid"] != pid and st["restarts"] == 0 and e.bundles() == []
    assert '"event": "draining"' in (e.state / "logs" / "worker.log").read_text()
    assert e.run("stop").returncode == 0
    assert e.ours() == []
    # a busy port is retried, not a failure: tests/test_daemon_faults.py


def test_poison_printed_while_no_daemon_watched_is_caught_on_reattach(ember: Ember):
    e = ember
    cmd = e.standin("--raw", "--fault", "illegal:requests=1", "--once", str(e.tmp / "once"))
    e.configure(command=cmd, health_url=f"{e.url}/health", ready_url=f"{e.url}/health", poison_grace="0.5s")
    assert e.start().returncode == 0
    st = e.status()
    time.sleep(2.5)  # the daemon records how far it has read every 2 s
    kill(st["daemon"]["pid"], signal.SIGKILL)
    assert e.complete()[0] == 200  # the engine prints the sticky error and keeps answering
    time.sleep(0.3)
    assert e.start().returncode == 0
    st = e.wait_ready(after_restarts=1)
    assert st["daemon"]["attached"] is True
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "poisoned-context" and m["detection"]["source"] == "log" and m["cuda_error"]["code"] == 700


def test_a_stopped_worker_is_restarted_at_the_first_failed_probe(ember: Ember):
    """SIGSTOP: the port accepts connections and nothing answers, and the daemon sees the process state T at
    its first failed probe: a hang at once, not unresponsive_seconds of patience (an overload gets that:
    tests/test_daemon_overload.py). The real worker's own: tests/test_daemon_faults.py."""
    e = ember
    e.configure(command=e.standin(), unresponsive_seconds="60s")
    assert e.start().returncode == 0
    pid = e.status()["worker"]["pid"]
    t0 = time.monotonic()
    kill(pid, signal.SIGSTOP)
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != pid and time.monotonic() - t0 < 10  # live_interval and live_timeout, not 60 s
    [path] = e.bundles()
    b = e.bundle(path)
    m = b["meta"]
    assert m["class"] == "hang" and m["detection"]["source"] == "process"
    assert m["detection"]["process_status"] == "stopped" and "stopped (state T" in m["detection"]["reason"]
    assert m["exit"]["killed_by_daemon"] is True and m["restart"]["restart"] is True
    fails = [h for h in b["health"] if h["probe"] == "live" and h.get("ok") is False]
    assert len(fails) == 1 and fails[0]["process"] == "stopped"


def test_a_zombie_worker_is_restarted_at_once(ember: Ember):
    """The worker's main thread is gone while its server threads answer on: psutil says zombie, supervisord
    sees no exit, and it would never restart by itself."""
    e = ember
    e.configure(command=e.standin("--fault", "zombie:after=0.5", "--once", str(e.tmp / "once")))
    assert e.start().returncode == 0
    st = e.wait_ready(after_restarts=1, timeout=20)
    pid = e.daemon_events("worker_spawn")[0]["pid"]  # (the restart may come before `ember start` returns)
    assert st["worker"]["pid"] != pid and not psutil.pid_exists(pid)  # killed, and reaped by supervisord
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "hang" and m["detection"]["source"] == "process"
    assert m["detection"]["process_status"] == "zombie" and "zombie" in m["detection"]["reason"]


def test_a_stopped_daemon_leaves_nothing_in_tmp(tmp_path):
    """A state dir too long a path for a unix socket puts the sockets in /tmp/ember-<uid>-<hash>/; `ember stop`
    (daemon, supervisord and worker gone) removes that dir too, so stopped daemons leave nothing in /tmp."""
    from ember.daemon.paths import Layout

    e = Ember(tmp_path / ("d" * 90))
    e.tmp.mkdir()
    lay = Layout(e.state)
    sock_dir = lay.socket_dir_path()
    assert sock_dir != lay.run and not sock_dir.exists()
    try:
        e.configure(command=e.standin())
        assert e.start().returncode == 0
        e.wait_ready()
        assert (sock_dir / "daemon.sock").exists() and (sock_dir / "supervisord.sock").exists()
    finally:
        left = e.stop_and_check()
        remains = sorted(p.name for p in sock_dir.iterdir()) if sock_dir.is_dir() else None
        if remains is not None:
            shutil.rmtree(sock_dir)  # a failed run's dir is not left in /tmp either
    assert not left, f"processes left behind after ember stop: {left}"
    assert remains is None, remains
