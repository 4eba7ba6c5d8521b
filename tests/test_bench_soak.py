"""`ember bench soak` at CI scale: the agent-shaped churn against real worker processes on the numpy
backend (baseline, persistence off, persistence on, kill -9 and restart), checked through the
command's JSON report and again against the workers' own logs. Speed figures are only recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ember.worker.bench.greedy_drift import Answer
from ember.worker.bench.soak_load import ABANDONED, COMPLETED, LOST, Record
from ember.worker.bench.soak_report import (
    Phase,
    check_outcomes,
    find_problems,
    read_events,
)

PHASES = ("baseline", "persist_off", "persist_on", "kill_restart")
PHASE_FIELDS = ("requests_completed", "requests_per_s", "classes", "decode_tok_s_per_stream", "cached_token_share",
                "cancels", "abandoned", "outcomes", "persistence", "greedy_identical", "greedy_outputs")
CLASS_FIELDS = ("started", "completed", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                "cached_token_share")
OUTCOMES = ("completed", "failed", "canceled", "refused")


def _ours(root: Path) -> list[psutil.Process]:
    """Worker processes started for this test (their KV dir lies under `root`)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(root) in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env["OMP_NUM_THREADS"] = "1"  # the client and the worker share two cores
    argv = [sys.executable, "-m", "ember.worker", "bench", "soak", "--scale", "small", "--json", "--workdir", str(work)]
    try:
        out = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=400)
    finally:
        left = _ours(work)
        for p in left:  # only if the command failed to clean up; the test below then fails
            p.kill()
    assert not left, f"the soak left workers running: {[p.pid for p in left]}"
    assert out.stdout.strip(), out.stderr[-3000:]
    report = json.loads(out.stdout)
    report["_returncode"], report["_stderr"], report["_work"] = out.returncode, out.stderr, work
    return report


def test_the_soak_passes_its_checks(soak):
    assert soak["checks"] and all(soak["checks"].values()), soak["problems"]
    assert soak["ok"] and soak["_returncode"] == 0, soak["_stderr"][-3000:]
    for name in ("greedy_identical", "greedy_identical_across_phases", "one_outcome_per_request",
                 "abandons_canceled", "no_failures", "kill_ends_only_in_flight", "restart_restores",
                 "long_identical_warm_and_cold"):
        assert soak["checks"][name] is True, name


def test_every_phase_reports_the_issue_figures(soak):
    assert tuple(soak["phases"]) == PHASES
    for name, phase in soak["phases"].items():
        for f in PHASE_FIELDS:
            assert f in phase, (name, f)
        assert phase["requests_completed"] > 0 and phase["requests_per_s"] > 0, name
        assert set(phase["persistence"]) >= {"backlog_max", "backlog_end", "writes", "drops", "restore_hits"}
        assert set(phase["outcomes"]) == set(OUTCOMES) and phase["outcomes"]["failed"] == 0
        assert list(phase["decode_tok_s_per_stream"]) == ["decode-0"]  # the small scale's one decoder
        assert phase["decode_tok_s_per_stream"]["decode-0"] > 0
        assert phase["classes"]["decode"]["itl_p99_s"] is not None
        for cls, c in phase["classes"].items():
            for f in CLASS_FIELDS:
                assert f in c, (name, cls, f)
        # greedy outputs: real text, identical before and after the churn and across phases
        assert phase["greedy_identical"] and phase["greedy_outputs"] and phase["greedy_logprobs"]
        assert phase["greedy_outputs"] == soak["phases"]["baseline"]["greedy_outputs"]
    assert soak["phases"]["persist_off"]["persistence"]["writes"] == 0
    assert soak["phases"]["persist_on"]["persistence"]["writes"] > 0
    churn = [soak["phases"][n] for n in PHASES[1:]]
    assert {"warm", "truncate", "abandon", "decode"} <= {c for p in churn for c in p["classes"]}
    for p in churn:  # warm admits reuse their conversation
        assert p["classes"]["warm"]["completed"] >= 1 and p["classes"]["warm"]["cached_token_share"] > 0.5
    assert set(soak["compare"]) == {"completed_on_over_off", "decode_itl_p99_on_over_off",
                                    "decode_itl_p99_on_over_baseline"}
    assert soak["compare"]["completed_on_over_off"] > 0
    assert {"cpu", "cores", "memory_gb"} <= set(soak["machine"])


def test_abandons_are_canceled_and_kill_loses_only_in_flight(soak):
    churn = [soak["phases"][n] for n in PHASES[1:]]
    assert sum(p["abandoned"] for p in churn) >= 3  # the first churner opens each phase with one
    for p in churn[:2]:
        assert p["cancels"] == p["abandoned"], p
    # an abandon just before the kill may be canceled by no one: the check allows for exactly that
    assert churn[2]["cancels"] <= churn[2]["abandoned"] and soak["checks"]["abandons_canceled"]
    k = soak["phases"]["kill_restart"]["kill"]
    assert k["killed_exit"] == -9 and k["in_flight_lost"] >= 1
    assert k["resumed"] and all(r["cached"] > 0 for r in k["resumed"])
    assert k["long_identical"] and k["long_warm_cached_tokens"] > 0 and k["long_warm_ttft_s"] > 0
    # what a restart would find, asked of the worker just before the kill (/v1/kv/lookup)
    found = k["on_disk_at_kill"]
    assert found and all(f["client"].startswith("churn-") and 0 <= f["on_disk_tokens"] <= f["tokens"] for f in found)
    assert any(f["on_disk_tokens"] > 0 for f in found), found
    assert all("on_disk_at_kill" in r for r in k["resumed"])


def test_the_worker_logs_show_one_outcome_per_request(soak):
    """Read the logs the soak kept, independently of its own check: every request id that has an
    outcome has exactly one, every admitted request has one (except on the worker killed with
    SIGKILL, where only what was in flight may lack one)."""
    logs = sorted(Path(soak["_work"]).glob("*/worker-*.log"))
    assert len(logs) == 5
    killed = Path(soak["_work"]) / "kill_restart" / "worker-1.log"
    lost = soak["phases"]["kill_restart"]["kill"]["in_flight_lost"]
    for log in logs:
        events = read_events([log])
        outcomes: dict[str, int] = {}
        for e in events:
            if e["event"] in OUTCOMES:
                outcomes[e["request_id"]] = outcomes.get(e["request_id"], 0) + 1
        admitted = {e["request_id"] for e in events if e["event"] == "admit"}
        assert admitted and all(n == 1 for n in outcomes.values()), log
        # on the killed worker: what was in flight, and abandons it had no step left to cancel
        allowed = lost + soak["settings"]["churners"] if log == killed else 0
        assert len(admitted - outcomes.keys()) <= allowed, (log, admitted - outcomes.keys())
        assert not [e for e in events if e["event"] == "failed"], log


# -- the checks themselves fail when they should (pure functions over logs and records) ------------------------


def _rec(rid: str, outcome: str, cls: str = "warm") -> Record:
    return Record(cls, "churn-0", 0.0, rid=rid, outcome=outcome)


def test_check_outcomes_finds_each_kind_of_problem():
    events = [{"event": "admit", "request_id": "a"}, {"event": "completed", "request_id": "a"},
              {"event": "admit", "request_id": "b"}, {"event": "completed", "request_id": "b"},
              {"event": "canceled", "request_id": "b"},
              {"event": "admit", "request_id": "c"}, {"event": "completed", "request_id": "c"},
              {"event": "admit", "request_id": "d"},
              {"event": "admit", "request_id": "e"}, {"event": "failed", "request_id": "e"},
              {"event": "admit", "request_id": "f"}]
    records = [_rec("a", COMPLETED), _rec("c", ABANDONED, "abandon"), _rec("f", LOST)]
    got = check_outcomes(events, records)
    assert any(p.startswith("b: 2 outcomes") for p in got["one_outcome_per_request"])
    assert any(p.startswith("d: admitted, no outcome") for p in got["one_outcome_per_request"])
    assert any(p.startswith("c: abandoned") for p in got["abandons_canceled"])
    assert "e: failed" in got["no_failures"] and any(p.startswith("f: the warm request ended lost")
                                                     for p in got["no_failures"])
    clean = check_outcomes(events[:2], [_rec("a", COMPLETED)])
    assert not any(clean.values())
    # in flight at a kill: no outcome is allowed for exactly those ids
    killed = check_outcomes(events[-1:], [_rec("f", LOST)], unsettled=frozenset({"f"}))
    assert not any(killed.values())
    # ... or the worker logged it completed and the kill cut the body's last bytes (seen in CI)
    cut = check_outcomes([*events[:2], {"event": "admit", "request_id": "g"}, {"event": "failed", "request_id": "g"}],
                         [_rec("a", LOST), _rec("g", LOST)], unsettled=frozenset({"a", "g"}))
    assert cut["no_failures"] == ["g: failed"] and not cut["one_outcome_per_request"]


def test_greedy_mismatches_fail_thefind_problems():
    x, y, z, q = (Answer((t,)) for t in "xyzq")  # answers without logprobs: any parting is drift
    a = Phase("baseline", [], greedy_before=[x, y], greedy_after=[x, y])
    b = Phase("persist_on", [], greedy_before=[x, y], greedy_after=[x, z])
    c = Phase("persist_off", [], greedy_before=[x, q], greedy_after=[x, q])
    checks = find_problems([a, b, c])
    assert checks["greedy_identical"] == ["persist_on: prompt 1: token 0: 'y' vs 'z' (no logprobs)"]
    assert checks["greedy_identical_across_phases"] == ["persist_off vs baseline: prompt 1: token 0: 'y' vs 'q' "
                                                        "(no logprobs)"]
    assert not find_problems([a, a])["greedy_identical"]
