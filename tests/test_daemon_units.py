"""The daemon's parts on their own: detection patterns, restart policy (backoff, breaker, cool-down),
probe verdicts (patience for an overloaded worker), settings, log windows, redaction, the log
watcher (rotation, truncation, a failing handler, a failing observer), probe deadlines, bundle
writing and retention, sd_notify datagrams. No supervisord here; see test_daemon_supervision.py."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ember.daemon import bundle as B
from ember.daemon import detect, logwatch, probes, settings, supctl, verdicts
from ember.daemon.logwatch import Line, LogWatcher
from ember.daemon.notify import Notifier
from ember.daemon.paths import Layout
from ember.daemon.policy import LEVEL_CAP, RestartPolicy
from ember.ops.contract import parse_log_line

# -- detection -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line,code", [
    ("CUDA error: an illegal memory access was encountered", 700),
    ("ggml_cuda_compute_forward: CUDA error 700 at ggml-cuda.cu:2345", 700),
    ("RuntimeError: CUDA error: unspecified launch failure", 719),
    ("cudaErrorMisalignedAddress in matmul", 716),
    ("CUDA_ERROR_LAUNCH_TIMEOUT", 702),
    ("device-side assert triggered", 710),
    ("CUDA error code 714", 714),
    ("cuda error: 715", 715),
    ("CUDA kernel failed with error 717", 717),
    ("CUDA_ERROR_INVALID_PC: invalid program counter", 718),
    ("CUDA error: misaligned address", 716),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", 214),
    ("cudaErrorContained", 226),
    ("CUDA_ERROR_MPS_CLIENT_TERMINATED", 810),
    ("CUDA error 911", 911),
])
def test_raw_sticky_cuda_errors_are_recognised(line, code):
    info = detect.poison_in_line(line, None)
    assert info is not None and info["code"] == code and info["name"].startswith("CUDA_ERROR_")


@pytest.mark.parametrize("line", [
    "served 700 requests",
    "CUDA error: out of memory",  # not sticky: the context survives
    "error 700 in parser",  # no CUDA on the line
    "CUDA error 701 something",
    "CUDA error 912: invalid cluster size",  # a launch's configuration, not sticky
    "CUDA error: context is destroyed (CUDA_ERROR_CONTEXT_IS_DESTROYED)",  # contract.RAW_LOG_EXEMPT
])
def test_other_lines_are_not_poison(line):
    assert detect.poison_in_line(line, None) is None


def test_json_lines_count_only_by_event():
    quoted = json.dumps({"event": "failed", "level": "error", "error": "an illegal memory access was encountered"})
    assert detect.poison_in_line(quoted, parse_log_line(quoted)) is None
    prompt = json.dumps({"event": "admit", "prompt": "why does CUDA say unspecified launch failure?"})
    assert detect.poison_in_line(prompt, parse_log_line(prompt)) is None
    real = json.dumps({"event": "engine_poisoned", "code": 700, "name": "CUDA_ERROR_ILLEGAL_ADDRESS", "step": 3,
                       "running": ["a"]})
    assert detect.poison_in_line(real, parse_log_line(real))["running"] == ["a"]


def test_oom_text():
    assert detect.oom_in_text("MemoryError", None)
    assert detect.oom_in_text("CUDA error: out of memory", None)
    assert not detect.oom_in_text("all good", None)


# -- restart policy ------------------------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_and_resets_after_healthy_minutes():
    p = RestartPolicy(crashes=100)  # the defaults: 1 s doubling to 60 s, reset after 600 s
    assert (p.base, p.max, p.reset) == (1.0, 60.0, 600.0)
    delays = [p.on_failure(1000.0 + i, "crash-exit").delay for i in range(9)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    p.on_ready(2000.0)
    assert not p.tick(2000.0 + 599) and p.level == 9
    assert p.tick(2000.0 + 600) and p.level == 0
    assert p.on_failure(3000.0, "crash-exit").delay == 1


def test_not_ready_interrupts_the_healthy_stretch():
    p = RestartPolicy()
    p.on_failure(0.0, "hang")
    p.on_ready(10.0)
    p.on_not_ready()
    p.on_ready(500.0)
    assert not p.tick(700.0) and p.tick(1100.0)


def test_poison_restarts_after_the_minimum_without_raising_the_level():
    p = RestartPolicy(crashes=100)
    p.on_failure(0.0, "crash-exit")
    d = p.on_failure(1.0, "poisoned-context", minimal=True)
    assert d.restart and d.delay == 1.0 and p.level == 1


def test_breaker_opens_after_k_failures_in_the_window():
    p = RestartPolicy(crashes=5, window=600)
    for t in (0, 100, 200, 300):
        assert p.on_failure(float(t), "crash-signal").restart
    d = p.on_failure(400.0, "crash-signal")
    assert not d.restart and "circuit breaker open: 5 failures" in d.reason and "crash-signal" in d.reason
    q = RestartPolicy(crashes=3, window=60)
    for t in (0, 100, 200, 300):  # spread out: never 3 within a minute
        assert q.on_failure(float(t), "crash-exit").restart
    q.clear()
    assert q.level == 0 and q.times == []


def test_backoff_never_overflows_after_2000_failures():
    p = RestartPolicy(base=0.001, max=3600.0, crashes=10**6)  # a tiny base: the most doublings to the cap
    delays = [p.on_failure(float(i), "crash-exit").delay for i in range(2000)]  # 2 ** 1024 used to raise
    assert delays[:3] == [0.001, 0.002, 0.004] and delays[-1] == 3600.0 and max(delays) == 3600.0
    assert p.level == LEVEL_CAP and "failure 64 in a row" in p.on_failure(2000.0, "crash-exit").reason
    q = RestartPolicy()
    q.load({"level": 5000, "times": []})  # a state file from before the cap
    assert q.level == LEVEL_CAP and q.on_failure(0.0, "hang").delay == 60.0


def test_unresponsive_kills_do_not_count_toward_the_breaker():
    p = RestartPolicy(crashes=3, window=600)
    for t in range(20):  # twenty overload kills in twenty seconds: restarts, with backoff, never an outage
        d = p.on_failure(float(t), detect.UNRESPONSIVE)
        assert d.restart and "not counted toward the circuit breaker" in d.reason
    assert p.times == [] and p.level == 20 and p.state() == "closed"
    assert [p.on_failure(30.0 + t, detect.HANG).restart for t in range(3)] == [True, True, False]  # crashes do


def test_a_busy_port_backs_off_and_never_counts_toward_the_breaker():
    from ember.daemon.policy import PORT_BUSY

    p = RestartPolicy(base=1.0, max=8.0, crashes=2, window=600)
    delays = [p.on_failure(float(t), PORT_BUSY).delay for t in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # the ordinary backoff, capped: one step after the port frees
    assert p.times == [] and p.state() == "closed"
    p.half_open()  # a conflict during the try after a cool-down is not the try failing
    assert p.on_failure(10.0, PORT_BUSY).restart and p.state() == "half-open"


_FORKED_LISTENER = """
import os, socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
child = os.fork()  # no exec: the child keeps the listening socket, as between fork and exec
if child == 0:
    time.sleep(30); os._exit(0)
print(s.getsockname()[1], child, flush=True)
sys.stdin.read()
os.kill(child, 9)
"""


def test_a_port_shared_with_a_forked_child_is_named_by_its_parent():
    """psutil names whichever process holding a socket it scanned last, often a child between fork and
    exec (in CI, the test's own `ember status` subprocess): the holder named is the one that made it."""
    import subprocess
    import sys

    from ember.daemon.procs import port_holder

    proc = subprocess.Popen([sys.executable, "-c", _FORKED_LISTENER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port, child = map(int, proc.stdout.readline().split())
        held = port_holder("127.0.0.1", port)
        assert held.pid == proc.pid, (held.pid, proc.pid, child)
        assert held.command and "python" in held.command
    finally:
        proc.communicate("", timeout=10)


def test_breaker_cools_down_tries_once_and_closes_or_opens_again():
    p = RestartPolicy(crashes=2, window=600, cooldown=300)
    p.on_failure(0.0, "crash-exit")
    d = p.on_failure(1.0, "crash-exit")
    assert not d.restart and "trying again in 5.0 min" in d.reason
    assert p.state() == "open" and p.retry_at() == 301.0 and not p.due(300.0) and p.due(301.0)
    assert p.status(100.0)["state"] == "open" and p.status(100.0)["retry_at"].startswith("1970-01-01T00:05:01")
    p.half_open()
    assert p.state() == "half-open" and not p.due(10**6)
    p.on_failure(400.0, detect.UNRESPONSIVE)  # an overload during the try is not the try failing
    assert p.state() == "half-open"
    d = p.on_failure(401.0, "crash-signal")  # one counted failure during the try: open again at once
    assert not d.restart and "open again" in d.reason and p.opened_at == 401.0
    p.half_open()
    p.on_ready(710.0)  # the try reached ready: closed
    assert p.state() == "closed" and p.retry_at() is None
    # a breaker without a cool-down stays open until a person acts
    q = RestartPolicy(crashes=1, cooldown=0)
    assert "ember start restarts it" in q.on_failure(0.0, "oom").reason and q.retry_at() is None
    assert not q.due(10**9) and q.state() == "open"
    # a configuration error: no try pending, whatever the breaker said before
    r = RestartPolicy(crashes=1, cooldown=5)
    r.on_failure(0.0, "crash-exit")
    r.close_breaker()
    assert not r.due(10**9) and r.state() == "closed"
    # state survives a daemon restart
    s = RestartPolicy(crashes=1, cooldown=5)
    s.on_failure(7.0, "crash-exit")
    t = RestartPolicy(cooldown=5)
    t.load(json.loads(json.dumps(s.dump())))
    assert t.state() == "open" and t.due(12.0)


# -- probe verdicts ----------------------------------------------------------------------------------------

FAST = settings.Settings(live_failures=2, unresponsive_seconds=10.0, dstate_seconds=5.0, hang_seconds=6.0)


def _live(**kw):
    return probes.ProbeResult(**{"probe": "live", "ok": False, "process": "sleeping", "ms": 1000.0, **kw})


TIMEOUT = {"timeout": True, "error": "no answer within 1s"}


def test_liveness_timeouts_of_a_live_process_get_patience_then_are_unresponsive():
    w = verdicts.LiveWatch()
    assert w.observe(_live(ok=True, status=200, steps=5), 0.0, FAST) is None
    for t in (1.0, 3.0, 5.0, 7.0, 9.0):  # silent for 9 s: an overload, not yet a kill
        assert w.observe(_live(cpu=10.0 + t, **TIMEOUT), t, FAST) is None
    assert w.status(9.5, FAST) == {"failures": 5, "failing_seconds": 9.5, "unresponsive_after_seconds": 10.0}
    assert w.observe(_live(ok=True, status=200), 9.8, FAST) is None  # it answered: the run is over
    assert w.status(10.0, FAST) is None and w.fails == 0
    for t in (20.0, 25.0):
        assert w.observe(_live(cpu=30.0 + t, **TIMEOUT), t, FAST) is None
    k = w.observe(_live(cpu=60.0, **TIMEOUT), 30.0, FAST)  # 11 s since the first timed-out probe began
    assert k.cls == detect.UNRESPONSIVE and k.source == "liveness" and "11s" in k.reason
    assert k.details == {"live_failures": 3, "unresponsive_seconds": 11.0, "process_status": "sleeping",
                         "cpu_seconds_meanwhile": 10.0}


def test_liveness_failures_the_engine_reports_are_counted_kills_at_once():
    w = verdicts.LiveWatch()
    assert w.observe(_live(status=503, state="ready", stalled=True, last_progress_seconds=61), 0.0, FAST) is None
    k = w.observe(_live(status=503, state="ready", stalled=True, last_progress_seconds=62), 1.0, FAST)
    assert k.cls == detect.HANG and "stalled 62s" in k.reason  # the engine said so: no extra patience
    w = verdicts.LiveWatch()
    w.observe(_live(**TIMEOUT), 0.0, FAST)
    k = w.observe(_live(error="ConnectionRefusedError: refused", refused=True), 1.0, FAST)
    assert k.cls == detect.UNHEALTHY and k.details["live_failures"] == 2  # alive, port refusing
    k = verdicts.LiveWatch().observe(_live(status=503, state="poisoned", error={"code": 700}), 0.0, FAST)
    assert k.cls == detect.POISONED and k.minimal and k.poison_grace and k.cuda == {"code": 700}
    w = verdicts.LiveWatch()  # gone: supervisord reports the exit, nothing to kill
    assert [w.observe(_live(error="process: process gone"), t, FAST) for t in (0.0, 60.0)] == [None, None]
    for status in ("stopped", "zombie"):  # it will not answer by itself: a hang at the first failed probe
        k = verdicts.LiveWatch().observe(_live(process=status, **TIMEOUT), 0.0, FAST)
        assert k.cls == detect.HANG and k.source == "process" and k.details["process_status"] == status
    assert verdicts.LiveWatch().observe(_live(process="tracing-stop", **TIMEOUT), 0.0, FAST) is None  # a debugger
    w = verdicts.LiveWatch()  # a worker thread died: the worker says which, and the reason names it
    dead = {"code": None, "name": "thread_died", "message": "thread ember-kv-writer died: OSError: [Errno 5]"}
    assert w.observe(_live(status=503, state="ready", error=dead), 0.0, FAST) is None
    k = w.observe(_live(status=503, state="ready", error=dead), 1.0, FAST)
    assert k.cls == detect.UNHEALTHY and "ember-kv-writer died" in k.reason
    w = verdicts.LiveWatch()  # D state on every probe for dstate_seconds: a hang, even while answering
    assert w.observe(_live(ok=True, status=200, process="disk-sleep"), 0.0, FAST) is None
    assert w.observe(_live(ok=True, status=200, process="disk-sleep"), 5.0, FAST).cls == detect.HANG


def test_readiness_hang_needs_evidence_that_nothing_moves():
    live = verdicts.LiveWatch()
    live.observe(_live(ok=True, status=200, steps=10), 0.0, FAST)
    r = verdicts.ReadyWatch()
    timeout = probes.ProbeResult("ready", ok=False, timeout=True, error="no answer within 30s")
    assert r.observe(timeout, 1.0, FAST, live, outcomes=4) is None
    live.observe(_live(ok=True, status=200, steps=12), 4.0, FAST)  # the engine steps: busy, not hung
    assert r.observe(timeout, 8.0, FAST, live, outcomes=4) is None  # progress: the count starts again
    live.observe(_live(ok=True, status=200, steps=12), 12.0, FAST)
    assert r.observe(timeout, 13.0, FAST, live, outcomes=5) is None  # a request finished: progress too
    live.observe(_live(ok=True, status=200, steps=12), 18.0, FAST)
    k = r.observe(timeout, 19.5, FAST, live, outcomes=5)  # 6.5 s, liveness answering, nothing moved
    assert k.cls == detect.HANG and k.source == "readiness"
    # liveness silent as well: the liveness rule (more patient) decides, not this one
    live, r = verdicts.LiveWatch(), verdicts.ReadyWatch()
    live.observe(_live(ok=True, status=200, steps=1), 0.0, FAST)
    assert r.observe(timeout, 1.0, FAST, live, outcomes=0) is None
    live.observe(_live(**TIMEOUT), 2.0, FAST)
    assert r.observe(timeout, 30.0, FAST, live, outcomes=0) is None
    # a 429 answer is a full queue: the count stops
    busy = probes.ProbeResult("ready", ok=False, busy=True, status=200, error="busy: ... HTTP 429")
    assert r.observe(busy, 31.0, FAST, live, outcomes=0) is None and r.since is None


# -- settings -------------------------------------------------------------------------------------------------


def test_settings_defaults_are_the_issues(tmp_path):
    s = settings.load(env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert s.backoff_base == 1.0 and s.backoff_max == 60.0 and s.backoff_reset == 600.0
    assert s.breaker_crashes >= 1 and s.breaker_window > 0
    assert s.startup_timeout == 300.0 and s.live_interval <= 10 and s.ready_interval > s.live_interval
    assert s.poison_grace == 5.0 and s.events_seconds == 300.0
    assert s.unresponsive_seconds == 60.0 and s.breaker_cooldown == 600.0
    with pytest.raises(settings.SettingsError, match="breaker_cooldown"):
        settings.load(env={"XDG_CONFIG_HOME": str(tmp_path), "EMBER_DAEMON_BREAKER_COOLDOWN": "-1"})
    assert not s.foreign and s.live_url == "http://127.0.0.1:8080/health/live"
    assert s.generation_url == "http://127.0.0.1:8080/v1/completions"


def test_settings_file_env_and_flags(tmp_path):
    cfg = tmp_path / "ember.toml"
    cfg.write_text('[worker]\nport = 9001\napi_key = "k-123456"\n[daemon]\nlive_interval = "500ms"\n'
                   'backoff_max = "2m"\ncrash_max_bytes = "1MiB"\n')
    s = settings.load(env={"EMBER_DAEMON_LIVE_TIMEOUT": "7s"}, path=cfg, flags={"port": "9002"})
    assert (s.port, s.api_key, s.live_interval, s.backoff_max, s.crash_max_bytes, s.live_timeout) == (
        9002, "k-123456", 0.5, 120.0, 1 << 20, 7.0)
    assert s.redacted()["api_key"] == "***"
    cfg.write_text("[daemon]\nfrobnicate = 1\n")
    with pytest.raises(settings.SettingsError, match="frobnicate"):
        settings.load(env={}, path=cfg)
    cfg.write_text('[daemon]\ncommand = "llama-server -m x.gguf --api-key hunter22"\n')
    with pytest.raises(settings.SettingsError, match="health_url"):
        settings.load(env={}, path=cfg)
    cfg.write_text('[daemon]\ncommand = "llama-server -m x.gguf --api-key hunter22"\n'
                   'health_url = "http://127.0.0.1:8081/health"\n')
    s = settings.load(env={}, path=cfg)
    assert s.command[0] == "llama-server" and s.generation_url == "http://127.0.0.1:8081/v1/completions"
    assert "hunter22" not in json.dumps(s.redacted())


def test_worker_command_is_the_contract(tmp_path):
    s = settings.load(env={"XDG_CONFIG_HOME": str(tmp_path)})
    argv = settings.worker_command(s)
    assert argv[1:4] == ["-m", "ember.worker", "worker"] and argv[4:8] == ["--host", "127.0.0.1", "--port", "8080"]


# -- the log window and events -------------------------------------------------------------------------------


def _lines(objs) -> list[Line]:
    out = []
    for i, o in enumerate(objs, 1):
        text = o if isinstance(o, str) else json.dumps(o)
        out.append(Line(i, 1000.0 + i, "worker", text, None if isinstance(o, str) else o))
    return out


def test_window_runs_from_the_last_healthy_request_to_the_crash():
    objs = [{"event": "config"}, {"event": "ready"}]
    objs += [{"event": "admit", "request_id": "old", "seq": 1}, {"event": "completed", "request_id": "old", "seq": 1}]
    objs += [{"event": "admit", "request_id": f"f{i}", "seq": 10 + i} for i in range(30)]  # filler, all completed
    objs += [{"event": "completed", "request_id": f"f{i}", "seq": 10 + i} for i in range(30)]
    objs += [{"event": "admit", "request_id": "victim", "seq": 99, "prompt_tokens": 61024}]
    objs += [{"event": "admit", "request_id": "other", "seq": 100}]
    objs += [{"event": "completed", "request_id": "other", "seq": 100}]
    objs += ["some raw line"] * 5
    objs += [{"event": "engine_poisoned", "code": 700, "running": ["victim"]}]
    objs += [{"event": "failed", "request_id": "victim"}, {"event": "exit", "code": 75}]
    lines = _lines(objs)
    crash = next(ln.seq for ln in lines if ln.obj and ln.obj.get("event") == "engine_poisoned")
    win, info = B.log_window(lines, crash, context=3)
    assert info["affected_requests"] == ["victim"] and info["affected_seqs"] == [99]
    assert info["last_healthy_request"] == "f29"
    texts = [ln.text for ln in win]
    assert any('"request_id": "f29"' in t and "completed" in t for t in texts[:4])
    assert texts[-1] == json.dumps({"event": "exit", "code": 75})
    assert len(win) == 3 + 1 + 1 + 2 + 5 + 1 + 2  # context, f29 done, victim, other, raw, crash, failed+exit


def test_without_a_crash_line_the_affected_are_those_in_flight_at_detection():
    """A hang or a kill by the probes has no crash line: a probe that finished last is not affected, the
    chat stuck since its admit is, and what the log says after the detection (a stack dump) is context."""
    objs = [{"event": "ready"}, {"event": "admit", "request_id": "chat", "seq": 1}]
    objs += [{"event": "admit", "request_id": "probe-1", "seq": 2, "probe": True},
             {"event": "completed", "request_id": "probe-1", "seq": 2, "probe": True}]
    objs += ["Thread 0x7f (most recent call first):", '  File "engine.py", line 9 in step']  # after the kill's dump
    lines = _lines(objs)
    detected = lines[3].t  # the probe's outcome was the last line read before the detection
    _, info = B.log_window(lines, None, context=5, until=detected + 0.5)
    assert info["affected_requests"] == ["chat"] and info["crash_line_seq"] == 4
    _, info = B.log_window(lines, None, context=5)  # the last line is no crash line: its outcome counts too
    assert info["affected_requests"] == ["chat"]


def test_window_for_a_raw_foreign_log_is_the_tail():
    lines = _lines([f"line {i}" for i in range(500)])
    win, info = B.log_window(lines, None, context=10)
    assert len(win) == 6 * 10 + 1 and win[-1].text == "line 499"


def test_session_events_keep_shapes_not_text():
    lines = _lines([{"event": "admit", "request_id": "a", "seq": 1, "prompt_tokens": 10, "cached_tokens": 4,
                     "new_tokens": 6, "prompt": "SECRET"},
                    {"event": "canceled", "request_id": "a", "seq": 1, "phase": "prefill", "messages": ["SECRET"]},
                    {"event": "config", "config": {}}])
    ev = B.session_events(lines, since=0)
    assert [e["event"] for e in ev] == ["admit", "canceled"]
    assert "SECRET" not in json.dumps(ev) and ev[0]["new_tokens"] == 6 and ev[1]["phase"] == "prefill"
    assert B.session_events(lines, since=5000) == []


def test_redaction():
    scrub = B.Scrubber(["hunter2-secret"])
    text = ('key hunter2-secret; Authorization: Bearer abcdefghijkl; "api_key": "zzz"; --api-key qqq '
            'sk-abcdefghijklmnopqrstu')
    out = scrub(text)
    for bad in ("hunter2-secret", "abcdefghijkl", "zzz", "qqq", "sk-abcdefghijklmnopqrstu"):
        assert bad not in out
    assert B.redact_obj({"api_key": "x", "hf_token": "y", "prompt_tokens": 5, "nested": [{"password": "p"}]}) == {
        "api_key": "***", "hf_token": "***", "prompt_tokens": 5, "nested": [{"password": "***"}]}


def test_signature_groups_repeats_and_ignores_volatile_parts():
    a = B.signature("crash-exit", None, {"code": 1}, "RuntimeError at 0x7f00ab12 in /tmp/a/b.py:123")
    b = B.signature("crash-exit", None, {"code": 1}, "RuntimeError at 0x7f99cd34 in /tmp/c/d.py:456")
    c = B.signature("crash-exit", None, {"code": 2}, "RuntimeError at 0x7f00ab12 in /tmp/a/b.py:123")
    assert a == b and a[0] != c[0]
    p1 = B.signature("poisoned-context", {"name": "CUDA_ERROR_ILLEGAL_ADDRESS"}, {"code": 75})
    p2 = B.signature("poisoned-context", {"name": "CUDA_ERROR_LAUNCH_FAILED"}, {"code": 75})
    assert p1[0] != p2[0]


def test_bundle_is_private_atomic_and_retained(tmp_path):
    crashes = tmp_path / "crashes"
    lines = _lines([{"event": "ready"}, "boom"])
    ids = []
    for i in range(4):
        meta = {"id": B.bundle_id(1_700_000_000 + i, "crash-exit"), "class": "crash-exit", "pad": "x" * 1000}
        ids.append(B.write_bundle(crashes, meta, lines, [], [{"probe": "live"}], B.Scrubber()).name)
    assert stat.S_IMODE(crashes.stat().st_mode) == 0o700
    for d in crashes.iterdir():
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert sorted(f.name for f in d.iterdir()) == ["events.jsonl", "health.jsonl", "meta.json", "worker.log"]
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in d.iterdir())
    same = B.write_bundle(crashes, {"id": ids[-1], "class": "crash-exit"}, lines, [], [], B.Scrubber())
    assert same.name == ids[-1] + "-2"
    assert not [d for d in crashes.iterdir() if d.name.startswith(".")]
    removed = B.enforce_retention(crashes, keep=3, max_bytes=1 << 30, protect=same.name)
    assert removed == ids[:2]
    removed = B.enforce_retention(crashes, keep=10, max_bytes=1, protect=same.name)
    assert [d.name for d in crashes.iterdir()] == [same.name]


# -- the log watcher ----------------------------------------------------------------------------------------


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_logwatch_follows_rotation_and_truncation_and_survives_a_bad_handler(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text('{"event": "config"}\n')
    seen, errors = [], []
    calls = {"n": 0}

    def on_poison(line, info):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("handler bug")  # must not kill the observer
        seen.append(info.get("code"))

    w = LogWatcher([(log, "worker")], on_poison=on_poison, on_error=errors.append)
    w.prime()
    w.start()
    try:
        with open(log, "a") as f:
            f.write("CUDA error: an illegal memory access was encountered\n")
            f.flush()
            assert _wait(lambda: calls["n"] == 1)
            f.write("CUDA error: unspecified launch failure\n")
            f.flush()
        assert _wait(lambda: seen == [719])
        assert errors and w.healthy()
        os.rename(log, str(log) + ".1")  # rotation, as supervisord does it
        with open(log, "w") as f:
            f.write("CUDA error: misaligned address\n")
        assert _wait(lambda: seen == [719, 716])
        with open(log, "w") as f:  # truncation
            f.write('{"event": "engine_poisoned", "code": 702, "name": "CUDA_ERROR_LAUNCH_TIMEOUT"}\n')
        assert _wait(lambda: seen == [719, 716, 702])
        assert [ln.text for ln in w.snapshot()][0] == '{"event": "config"}'
        w.armed = False
        with open(log, "a") as f:
            f.write("CUDA error: misaligned address\n")
        w.poll()
        assert seen == [719, 716, 702]
    finally:
        w.close()


def test_logwatch_falls_back_to_polling_when_its_observer_cannot_run(tmp_path, monkeypatch):
    log = tmp_path / "logs" / "worker.log"
    log.parent.mkdir()
    log.write_text("")
    blocked = tmp_path / "engine"  # a second watched directory that cannot be made: a file has its name
    blocked.write_text("")
    seen, errors = [], []
    w = LogWatcher([(log, "worker"), (blocked / "engine.log", "engine")],
                   on_poison=lambda line, info: seen.append(info["code"]), on_error=errors.append)
    w.prime()
    monkeypatch.setattr(logwatch, "RETRY_SECONDS", 0.3)
    try:
        assert w.start() is False  # no exception: the watcher is in polling mode
        assert w.mode == "polling" and "FileExistsError" in w.failure and not w.healthy()
        assert w.ensure_running() is None  # not retried before RETRY_SECONDS
        with open(log, "a") as f:
            f.write("CUDA error: an illegal memory access was encountered\n")
        assert w.poll() == 1 and seen == [700]  # the files are still read, by polling
        time.sleep(0.35)
        assert w.ensure_running() is None and w.mode == "polling"  # retried, failed again, nothing new to say
        blocked.unlink()  # fixed: the next try starts the observer
        time.sleep(0.35)
        assert w.ensure_running() == "recovered" and w.mode == "inotify" and w.failure is None and w.healthy()
        # a watched directory deleted under a running observer: its watch ends; it is noticed and rebuilt
        os.rmdir(blocked)
        assert _wait(lambda: not w.healthy())
        assert w.ensure_running() == "restarted" and w.healthy() and blocked.is_dir()
        os.rmdir(blocked)
        blocked.write_text("")  # ... and when it cannot be rebuilt: polling again, said once
        assert _wait(lambda: not w.healthy())
        assert w.ensure_running() == "degraded" and w.mode == "polling"
        assert w.ensure_running() is None
        with open(log, "a") as f:
            f.write("CUDA error: unspecified launch failure\n")
        assert w.poll() == 1 and seen == [700, 719] and errors == []
    finally:
        w.close()


def test_logwatch_keeps_a_partial_line_until_it_ends(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("")
    w = LogWatcher([(log, "worker")])
    w.prime()
    with open(log, "a") as f:
        f.write('{"event": "ad')
        f.flush()
        w.poll()
        assert w.snapshot() == []
        f.write('mit"}\n')
    w.poll()
    assert w.snapshot()[0].obj == {"event": "admit"}
    w.close()


# -- probes -------------------------------------------------------------------------------------------------


class _Drip(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is not
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.1)


def test_probe_deadline_holds_against_a_slow_drip():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        rec = probes.live_probe(f"http://127.0.0.1:{srv.server_port}/health/live", timeout=0.5)
        assert time.monotonic() - t0 < 1.0
        assert rec.ok is False and rec.timeout is True
    finally:
        srv.shutdown()
        srv.server_close()


def test_probe_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = probes.live_probe(f"http://127.0.0.1:{port}/health/live", timeout=1)
    assert rec.ok is False and rec.refused is True


# -- sd_notify and supervisord bits --------------------------------------------------------------------------


def test_notify_datagrams_and_watchdog_pace(tmp_path):
    name = f"@ember-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name[1:])
    s.settimeout(2)
    try:
        n = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000000"})
        assert n.enabled and n.watchdog_interval == 0.5
        n.ready("worker starting")
        assert s.recv(1024).decode().split("\n")[0] == "READY=1"
        n.ping(100.0)
        n.ping(100.2)  # too soon: nothing
        n.ping(100.6)
        assert s.recv(1024) == b"WATCHDOG=1" and s.recv(1024) == b"WATCHDOG=1"
        s.settimeout(0.2)
        with pytest.raises(socket.timeout):
            s.recv(1024)
        n.status("worker ready")
        n.status("worker ready")  # unchanged: not resent
        n.stopping()
        s.settimeout(2)
        assert s.recv(1024) == b"STATUS=worker ready" and s.recv(1024) == b"STOPPING=1"
        assert not Notifier({}).enabled
        t0 = time.monotonic()  # nobody reads: the queue fills, and sending must not block the loop
        for _ in range(200):
            n.send("WATCHDOG=1")
        assert time.monotonic() - t0 < 1.0
        assert Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    finally:
        s.close()


def test_supervisor_exit_lines(tmp_path):
    lay = Layout(tmp_path)
    lay.ensure()
    lay.supervisor_log.write_text(
        "2026-01-01 INFO spawned: 'worker' with pid 5\n"
        "2026-01-01 WARN exited: worker (terminated by SIGSEGV (core dumped); not expected)\n")
    assert supctl.last_exit(lay) == {"signal": "SIGSEGV", "core": True,
                                     "text": "terminated by SIGSEGV (core dumped); not expected"}
    with open(lay.supervisor_log, "a") as f:
        f.write("2026-01-01 WARN exited: worker (exit status 75; not expected)\n")
    assert supctl.last_exit(lay)["code"] == 75
    conf = supctl.render_conf(lay, log_max_bytes=1000, log_backups=2, stop_timeout=3.2)
    assert "autorestart=false" in conf and "stopasgroup=true" in conf and "killasgroup=true" in conf
    assert "chmod=0700" in conf and "stopwaitsecs=4" in conf and "umask=077" in conf


def test_long_state_paths_get_short_socket_paths(tmp_path):
    deep = tmp_path / ("d" * 90)
    lay = Layout(deep)
    assert len(str(lay.supervisor_sock)) <= 100 and lay.supervisor_sock.parent != lay.run
    assert Layout(Path("/s")).supervisor_sock == Path("/s/run/supervisord.sock")


def test_logs_follow_pretty_prints_new_lines(tmp_path):
    import subprocess
    import sys

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker.log").write_text(json.dumps({"ts": "2026-05-09T10:00:00.123+00:00", "level": "info",
                                                 "event": "ready", "model": "m"}) + "\n")
    env = {**os.environ, "EMBER_STATE_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "ember.daemon.cli_main", "logs", "-f", "-n", "5"], env=env,
                         stdout=subprocess.PIPE, text=True)
    guard = threading.Timer(15, p.kill)  # a missed line fails the test instead of hanging it
    guard.start()
    try:
        first = p.stdout.readline()
        assert first.startswith("10:00:00.123 INFO  ready") and "model=m" in first
        with open(logs / "worker.log", "a") as f:
            f.write(json.dumps({"ts": "2026-05-09T10:00:01.000+00:00", "level": "error", "event": "failed",
                                "request_id": "r1", "error": "boom here"}) + "\nplain line\n")
        assert p.stdout.readline().startswith('10:00:01.000 ERROR failed           request_id=r1 error="boom here"')
        assert p.stdout.readline() == "plain line\n"
    finally:
        guard.cancel()
        p.kill()
        p.wait()


def _linked_state(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    link = tmp_path / "state" / "kv"
    link.parent.mkdir()
    link.symlink_to(target)
    return link, target


def test_private_dirs_never_change_a_link_target(tmp_path):
    from ember.daemon.paths import private_dir, write_private

    link, target = _linked_state(tmp_path)
    private_dir(link)  # a kv dir on another disk, or a link planted for root to follow: used as it is
    assert (target.stat().st_mode & 0o777) == 0o755
    plain = private_dir(tmp_path / "state" / "crashes")
    assert (plain.stat().st_mode & 0o777) == 0o700
    write_private(plain / "status.json", "{}")
    assert (plain / "status.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule is root's: run as root to check it")
def test_root_never_writes_through_a_link_in_the_state_dir(tmp_path):
    from ember.daemon.paths import write_private

    link, target = _linked_state(tmp_path)
    with pytest.raises(PermissionError, match="symbolic link"):
        write_private(link / "status.json", "{}")
    assert not list(target.iterdir())
