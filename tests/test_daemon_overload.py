"""One overload must not cascade into an outage (issue 19, item 4), with real supervisord, real
processes and real signals around the stand-in engine (tests/test_daemon_standin.py):

- a worker whose event loop stalls past the probe timeout gets patience, and when it does get killed
  (as `unresponsive`) that never opens the circuit breaker: ember comes back without a person;
- an open breaker cools down and tries again by itself (but a configuration error never does);
- a log watcher that fails falls back to polling, and `ember stop` still stops everything;
- a supervisord that answers late is waited for, not replaced along with a worker that is fine.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

from test_daemon_support import Ember


def _complete_in_background(e: Ember, timeout: float) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(e.complete("a huge request", timeout=timeout)), daemon=True)
    t.start()
    return t, out


def test_event_loop_stalls_shorter_than_the_patience_restart_nothing(ember: Ember):
    e = ember
    # each request holds the loop 3.5 s: the 1 s liveness probes time out 2-3 times in a row, which
    # used to be a kill (live_failures = 2); the readiness probe times out too (hang_seconds 1.5 s)
    e.configure(command=e.standin("--fault", "freeze:secs=3.5"), unresponsive_seconds="8s", breaker_crashes=2)
    assert e.start().returncode == 0
    pid = e.status()["worker"]["pid"]
    most_failures = 0
    for _ in range(3):
        t, out = _complete_in_background(e, timeout=20)
        while t.is_alive():
            lv = e.status().get("liveness") or {}
            most_failures = max(most_failures, lv.get("failures", 0))
        assert out[0][0] == 200, out  # the big request itself is served
        # the overload is over once the worker answers again (the probes queued behind it)
        e.wait(lambda s: s.get("state") == "ready" and not s.get("liveness"), what="liveness answering again")
    st = e.status()
    assert st["worker"]["pid"] == pid and st["restarts"] == 0 and e.bundles() == []
    assert st["breaker"]["state"] == "closed" and st["breaker"]["failures"] == 0
    assert most_failures >= 2  # `ember status` showed the silence while it lasted
    failing, recovered = e.daemon_events("liveness_failing"), e.daemon_events("liveness_recovered")
    assert 1 <= len(failing) == len(recovered) <= 3  # each silence seen (most are: probes land in it) ended
    assert all("no answer within 1s" in f["error"] and f["unresponsive_after_seconds"] == 8 for f in failing)
    assert all(1.5 <= r["seconds"] < 8 for r in recovered)
    assert e.daemon_events("incident") == []


def test_repeated_overload_kills_never_open_the_breaker(ember: Ember):
    e = ember
    # a stall longer than the patience, more times than the breaker allows crashes in its window
    e.configure(command=e.standin("--fault", "freeze:secs=60"), unresponsive_seconds="2s", breaker_crashes=2,
                breaker_window="10m")
    assert e.start().returncode == 0
    pids = [e.status()["worker"]["pid"]]
    for i in range(3):
        t, out = _complete_in_background(e, timeout=30)
        st = e.wait_ready(after_restarts=i + 1, timeout=40)
        t.join(10)
        assert out and out[0][0] == 0  # the frozen worker was killed under the request
        assert st["worker"]["pid"] not in pids and st["failed_reason"] is None
        pids.append(st["worker"]["pid"])
    st = e.status()
    assert st["state"] == "ready" and st["restarts"] == 3
    assert (st["breaker"]["state"], st["breaker"]["failures"], st["breaker"]["opened_at"]) == ("closed", 0, None)
    assert st["last_crash"]["class"] == "unresponsive"
    metas = [e.bundle(p)["meta"] for p in e.bundles()]
    assert [m["class"] for m in metas] == ["unresponsive"] * 3
    for m in metas:
        d = m["detection"]
        assert d["source"] == "liveness" and d["unresponsive_seconds"] >= 2 and d["live_failures"] >= 2
        assert d["process_status"] in ("sleeping", "running")  # alive, not stopped, not a zombie
        assert m["restart"]["restart"] is True and "not counted toward the circuit breaker" in m["restart"]["reason"]
    health = e.bundle(e.bundles()[-1])["health"]
    assert any(h["probe"] == "live" and h.get("timeout") for h in health)
    delays = [x["delay"] for x in e.daemon_events("restart_scheduled")]
    assert delays == [0.2, 0.4, 0.8]  # backoff still applies
    assert e.daemon_events("worker_failed") == []


def test_an_open_breaker_cools_down_and_tries_again_without_a_person(ember: Ember):
    e = ember
    # an engine that exits 3 before it ever serves (so the half-open try cannot reach ready either)
    crash = [sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(3)"]
    e.configure(command=crash, breaker_crashes=2, breaker_window="60s", backoff_base="0.05s", breaker_cooldown="3s")
    e.run("start", "--no-wait")
    st = e.wait(lambda s: s.get("state") == "failed", 30, "the breaker to open")
    assert "circuit breaker open: 2 failures" in st["failed_reason"] and "trying again in 3s" in st["failed_reason"]
    assert st["breaker"]["state"] == "open" and st["breaker"]["retry_at"] > st["breaker"]["opened_at"]
    human = e.run("status")
    assert "breaker  open since" in human.stdout and "tries again at" in human.stdout
    # the try after the cool-down crashes too: open again at once, another cool-down
    st = e.wait(lambda s: "open again" in str(s.get("failed_reason")), 30, "the half-open try to fail")
    assert st["state"] == "failed" and st["breaker"]["state"] == "open"
    assert len(e.daemon_events("breaker_half_open")) == 1
    # the engine gets fixed (ember.toml); nobody runs `ember start`: the next try re-reads it and serves
    e.configure(command=e.standin(), breaker_crashes=2, breaker_window="60s", breaker_cooldown="3s")
    st = e.wait(lambda s: s.get("state") == "ready", 30, "the next try to serve")
    assert st["breaker"]["state"] == "closed" and st["failed_reason"] is None
    assert len(e.daemon_events("breaker_half_open")) == 2
    assert len(e.daemon_events("worker_spawn")) == 4  # 2 crashes, a failed try, the good one


def test_a_configuration_error_is_never_retried_by_the_cool_down(ember: Ember):
    e = ember
    e.configure(command=e.standin("--fault", "config"), breaker_cooldown="0.5s")
    r = e.start(timeout=20)
    assert r.returncode == 1 and "configuration error" in r.stderr
    time.sleep(2.5)  # five cool-downs
    st = e.status()
    assert st["state"] == "failed" and "exit 78" in st["failed_reason"] and st["breaker"]["state"] == "closed"
    assert len(e.daemon_events("worker_spawn")) == 1 and e.daemon_events("breaker_half_open") == []


def test_a_failing_log_watcher_degrades_to_polling_and_stop_still_works(ember: Ember):
    e = ember
    engine_logs = e.tmp / "engine-logs"  # a second watched directory (a foreign engine's own log file)
    cmd = e.standin("--raw", "--fault", "illegal:requests=1", "--once", str(e.tmp / "once"))
    e.configure(command=cmd, health_url=f"{e.url}/health", ready_url=f"{e.url}/health", poison_grace="0.5s",
                log_file=str(engine_logs / "engine.log"))
    assert e.start().returncode == 0
    st = e.status()
    assert st["log_watch"] == {"mode": "inotify", "error": None}
    # the watched directory is deleted and a file takes its name: the watch ends, and cannot be made again
    shutil.rmtree(engine_logs)
    engine_logs.write_text("not a directory\n")
    st = e.wait(lambda s: (s.get("log_watch") or {}).get("mode") == "polling", 20, "the watcher to degrade")
    assert "engine-logs" in st["log_watch"]["error"]
    [ev] = e.daemon_events("logwatch_degraded")
    assert ev["level"] == "error" and "polling" in ev["note"]
    assert "log watch polling the logs" in e.run("status").stdout
    # detection still works, by polling: the engine prints a sticky CUDA error and keeps answering
    pid = st["worker"]["pid"]
    assert e.complete()[0] == 200
    st = e.wait_ready(after_restarts=1)
    assert st["worker"]["pid"] != pid and st["last_crash"]["class"] == "poisoned-context"
    # `ember stop` goes through the same main loop: it works, and leaves nothing behind
    r = e.run("stop", timeout=60)
    assert r.returncode == 0 and "ember stopped" in r.stdout, r.stderr
    assert e.ours() == []
    # a daemon whose watcher cannot start at all still starts (polling), serves and stops
    assert e.start().returncode == 0
    st = e.status()
    assert st["state"] == "ready" and st["log_watch"]["mode"] == "polling"
    assert e.complete()[0] == 200
    r = e.run("stop", timeout=60)
    assert r.returncode == 0, r.stderr
    assert e.ours() == []
    assert e.daemon_events("tick_error") == [] and e.daemon_events("setup_error") == []


def test_a_slow_supervisord_is_waited_for_not_replaced(ember: Ember):
    e = ember
    e.configure(command=e.standin(), unresponsive_seconds="20s")
    assert e.start().returncode == 0
    st = e.status()
    spid, wpid = st["daemon"]["supervisor_pid"], st["worker"]["pid"]
    os.kill(spid, signal.SIGSTOP)  # supervisord starved: its XML-RPC answers late (the daemon waits 5 s a call)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not e.daemon_events("supervisor_slow"):
            time.sleep(0.2)
        time.sleep(2)
    finally:
        os.kill(spid, signal.SIGCONT)
    [ev] = e.daemon_events("supervisor_slow")
    assert "timed out" in ev["error"] and ev["lost_after_seconds"] == 20
    st = e.wait_ready()
    assert st["daemon"]["supervisor_pid"] == spid and st["worker"]["pid"] == wpid and st["restarts"] == 0
    assert e.daemon_events("supervisor_lost") == [] and e.bundles() == []
