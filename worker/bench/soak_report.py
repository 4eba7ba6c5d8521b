"""The soak's report: figures by phase and request class, the checks, the comparisons, the tables.

Pure functions over what the soak's clients recorded (soak_load.Record) and the workers' JSON logs;
nothing here talks to a server. The checks decide the exit status; the figures and the issue's
targets are only recorded. A server the soak did not start (reached by URL) gets the client's
figures and checks alone: what its log would say is not the soak's to read, and the report names
the checks that did not apply.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

from ..metrics import OUTCOMES
from .greedy_drift import Answer
from .greedy_drift import compare as compare_answers
from .machine import gpu_names, machine_facts
from .serve_load import _pct
from .soak_load import (
    ABANDONED,
    CLASSES,
    COMPLETED,
    DECODE,
    ERROR,
    LOST,
    Record,
    Window,
)

KILL_CHECKS = ("kill_ends_only_in_flight", "restart_restores", "long_identical_warm_and_cold")
KILL_GRACE_S = 3.0  # an abandon this close before the kill may be canceled by no one (a step or two)
STAT_COUNTERS = {"writes": "ember_kv_writes_total", "drops": "ember_kv_write_drops_total",
                 "restore_hits": "ember_kv_restore_hits_total"}


@dataclass
class Phase:
    name: str
    flags: list[str]  # the worker flags under test
    windows: list[Window] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    setup: list[list[Record]] = field(default_factory=list)  # per server: greedy, priming, long requests
    greedy_before: list[Answer] = field(default_factory=list)
    greedy_after: list[Answer] = field(default_factory=list)
    kill: dict = field(default_factory=dict)


def rnd(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def read_events(paths: list[Path]) -> list[dict]:
    """The JSON lines of worker logs (other lines skipped)."""
    out = []
    for p in paths:
        for line in p.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and "event" in e:
                out.append(e)
    return out


OUTCOME_CHECKS = ("one_outcome_per_request", "abandons_canceled", "no_failures")


def check_outcomes(events: list[dict], records: list[Record], unsettled: frozenset[str] = frozenset()
                   ) -> dict[str, list[str]]:
    """Problems with one worker's log against what its clients saw, by check: a request id with
    other than exactly one outcome; an abandoned request not logged `canceled`; a failure, an error
    or lost connection at the client, or a completed request not logged `completed`. Ids in
    `unsettled` (in flight at a kill) are judged by the log alone: at most one outcome, never `failed`."""
    outcomes: dict[str, list[str]] = {}
    admitted: set[str] = set()
    for e in events:
        rid = str(e.get("request_id"))
        if e["event"] == "admit":
            admitted.add(rid)
        elif e["event"] in OUTCOMES:
            outcomes.setdefault(rid, []).append(e["event"])
    one = [f"{rid}: {len(o)} outcomes ({', '.join(o)})" for rid, o in outcomes.items() if len(o) > 1]
    one += [f"{rid}: admitted, no outcome" for rid in sorted(admitted - outcomes.keys() - unsettled)]
    fail = [f"{rid}: failed" for rid, o in outcomes.items() if "failed" in o]
    abandon = []
    for r in records:
        got = outcomes.get(r.rid or "", [])
        if r.rid in unsettled:
            continue  # cut by the kill: the log may say nothing, or `completed` for a body the kill cut short
        if r.outcome in (ERROR, LOST):
            fail.append(f"{r.rid}: the {r.cls} request ended {r.outcome} at the client: {r.error}")
        elif r.outcome == ABANDONED and got != ["canceled"]:
            abandon.append(f"{r.rid}: abandoned in {r.abandon_phase}; the log says {got or 'nothing'}")
        elif r.outcome == COMPLETED and got != ["completed"]:
            (one if len(got) != 1 else fail).append(f"{r.rid}: the client saw {r.cls} complete; the log says "
                                                    f"{got or 'nothing'}")
    return dict(zip(OUTCOME_CHECKS, (one, abandon, fail), strict=True))


def _stats_delta(windows: list[Window], key: str) -> float:
    return sum(w.stats_last.get(key, 0) - w.stats_first.get(key, 0) for w in windows)


def client_errors(recs: list[Record]) -> dict[str, int]:
    """What went wrong as the client saw it: error statuses, errors inside a 200 stream, and connections
    that died without [DONE] (a kill's in-flight requests among them)."""
    err = [r for r in recs if r.outcome == ERROR]
    return {"http_5xx": sum(r.status is not None and r.status >= 500 for r in err),
            "http_4xx": sum(r.status is not None and 400 <= r.status < 500 for r in err),
            "stream_errors": sum(r.status == 200 for r in err),
            "lost": sum(r.outcome == LOST for r in recs)}


def client_figures(ph: Phase) -> dict:
    """One phase's figures from its measured windows, as its clients saw them: nothing from a server's
    log or metrics, so they mean the same for any server."""
    recs = [r for w in ph.windows for r in w.records]
    wall = sum(w.wall_s for w in ph.windows)
    done = [r for r in recs if r.outcome == COMPLETED]
    classes = {}
    for cls in CLASSES:
        mine = [r for r in recs if r.cls == cls]
        ok = [r for r in mine if r.outcome == COMPLETED]
        if not mine:
            continue
        ttft = [r.ttft for r in ok if r.ttft is not None]
        gaps = [g for r in ok for g in r.gaps]
        latency = [r.t_done - r.t0 for r in ok]
        prompt = sum(r.prompt_tokens for r in ok)
        classes[cls] = {"started": len(mine), "completed": len(ok),
                        "abandoned": sum(r.outcome == ABANDONED for r in mine),
                        "requests_per_s": rnd(len(ok) / wall if wall else None),
                        "ttft_p50_s": rnd(_pct(ttft, 50)), "ttft_p99_s": rnd(_pct(ttft, 99)),
                        "itl_p50_s": rnd(_pct(gaps, 50)), "itl_p99_s": rnd(_pct(gaps, 99)),
                        "latency_p50_s": rnd(_pct(latency, 50)), "latency_p99_s": rnd(_pct(latency, 99)),
                        "cached_token_share": rnd(sum(r.cached for r in ok) / prompt if prompt else None, 3)}
    per_stream: dict[str, tuple[int, float]] = {}
    for r in done:
        if r.cls == DECODE and r.tokens > 1:
            t, s = per_stream.get(r.client, (0, 0.0))
            per_stream[r.client] = (t + r.tokens - 1, s + r.decode_s)
    abandoned = [r for r in recs if r.outcome == ABANDONED]
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "wall_s": round(wall, 1),
        "requests_completed": len(done),
        "requests_per_s": rnd(len(done) / wall if wall else None),
        "classes": classes,
        "decode_tok_s_per_stream": {c: round(t / s, 2) for c, (t, s) in sorted(per_stream.items()) if s > 0},
        "cached_token_share": rnd(sum(r.cached for r in done) / prompt if prompt else None, 3),
        "abandoned": len(abandoned),
        # where the client closed it: before its first token (mid-prefill, as meant) or after
        "abandoned_in": {w: sum(r.abandon_phase == w for r in abandoned) for w in ("prefill", "decode")},
        "errors": client_errors(recs),
        # equal, or parted only at near-ties (greedy_drift); the ties themselves are in the checks' evidence
        "greedy_identical": not compare_answers(ph.greedy_before, ph.greedy_after, ph.name).drifts,
        "greedy_outputs": [a.text for a in ph.greedy_before],
        # whether the server sent each greedy token's alternatives, so that a parting can be judged a tie
        "greedy_logprobs": bool(ph.greedy_before) and all(
            len(a.top) == len(a.tokens) and all(len(t) >= 2 for t in a.top) for a in ph.greedy_before),
    }


def summarize(ph: Phase, events: list[dict]) -> dict:
    """One phase's figures: the clients' (client_figures), and from the workers' logs (`outcomes`: every
    request in them) and /v1/stats."""
    recs = [r for w in ph.windows for r in w.records]
    window_ids = {r.rid for r in recs}
    canceled = [e for e in events if e["event"] == "canceled" and e.get("request_id") in window_ids]
    phases: dict[str, int] = {}
    for e in canceled:
        phases[e.get("phase", "?")] = phases.get(e.get("phase", "?"), 0) + 1
    return {
        "worker_flags": ph.flags,
        **client_figures(ph),
        "cancels": len(canceled),
        "cancel_phases": phases,
        "outcomes": {o: sum(e["event"] == o for e in events) for o in OUTCOMES},
        "persistence": {"backlog_max": max((w.backlog_max for w in ph.windows if w.backlog_max is not None),
                                           default=None),
                        "backlog_end": ph.windows[-1].stats_last.get("ember_kv_write_queue_depth"),
                        **{k: _stats_delta(ph.windows, key) for k, key in STAT_COUNTERS.items()}},
    }


def _client_problems(ph: Phase) -> list[str]:
    """A server reached by URL: requests that ended in an error, or lost outside a kill (a kill's are
    judged by kill_ends_only_in_flight)."""
    out = []
    for setup, w in zip(ph.setup, ph.windows, strict=False):
        for r in setup + w.records:
            if r.outcome == ERROR or (r.outcome == LOST and w.killed_at is None):
                out.append(f"{ph.name}: {r.rid or 'a request'}: the {r.cls} request ended {r.outcome}: {r.error}")
    return out


def find_problems(phases: list[Phase], logs: bool = True) -> dict[str, list[str]]:
    """Each check's problems (none: it passed). Without `logs` (a server the soak did not start) the
    checks that read the workers' logs make way for the client's half of them, `no_client_errors`."""
    checks: dict[str, list[str]] = {"greedy_identical": [], "greedy_identical_across_phases": [],
                                    **{c: [] for c in (OUTCOME_CHECKS if logs else ("no_client_errors",))}}
    first = phases[0]
    for ph in phases:
        checks["greedy_identical"] += compare_answers(ph.greedy_before, ph.greedy_after, ph.name).drifts
        if ph is not first:
            checks["greedy_identical_across_phases"] += compare_answers(
                first.greedy_before, ph.greedy_before, f"{ph.name} vs {first.name}").drifts
        if not logs:
            checks["no_client_errors"] += _client_problems(ph)
            continue
        for log, setup, w in zip(ph.logs, ph.setup, ph.windows, strict=False):
            unsettled: frozenset[str] = frozenset()
            if w.killed_at is not None:
                unsettled = frozenset(r.rid for r in w.records if r.rid and (r.outcome == LOST or (
                    r.outcome == ABANDONED and r.t_done >= w.killed_at - KILL_GRACE_S)))
            # a request the kill cut before its response began never learned its id: in flight too
            records = [r for r in w.records if not (w.killed_at is not None and r.rid is None and r.outcome == LOST)]
            for check, problems in check_outcomes(read_events([log]), records + setup, unsettled).items():
                checks[check] += [f"{ph.name}: {p}" for p in problems]
    kill = next((ph for ph in phases if ph.kill), None)
    if kill is not None:
        k, w = kill.kill, kill.windows[0]
        killed_at = w.killed_at or 0.0
        checks["kill_ends_only_in_flight"] = [
            f"{r.rid}: the connection died {killed_at - r.t_done:.2f} s before the kill"
            for r in w.records if r.outcome == LOST and r.t_done < killed_at]
        if k["killed_exit"] != -signal.SIGKILL:
            checks["kill_ends_only_in_flight"].append(f"the server was not alive at the kill (exit {k['killed_exit']})")
        if logs:
            checks["restart_restores"] = [
                f"{r['client']}: a {r['prompt_tokens']}-token conversation resumed with no cached tokens"
                for r in k["resumed"] if r["cached"] == 0 and r["restore_choice"] != "recompute"]
            if not k["resumed"]:
                checks["restart_restores"].append("no conversation was resumed after the restart")
        parting = k.get("long_parting")
        checks["long_identical_warm_and_cold"] = [] if parting is None or parting["tie"] else [
            "the long conversation's warm answer after the restart differs from its cold answer at token "
            f"{parting['at']} ({parting['a']!r} vs {parting['b']!r}, gaps {parting['gap_a']}/{parting['gap_b']} nats)"]
    return checks


def greedy_ties(phases: list[Phase]) -> list[dict]:
    """Where the greedy answers parted at a near-tie (not a failure; greedy_drift says why), with the gaps
    and the rounding noise of the tokens before: the evidence the report carries."""
    first = phases[0] if phases else None
    ties = []
    for ph in phases:
        ties += compare_answers(ph.greedy_before, ph.greedy_after, ph.name).ties
        if first is not None and ph is not first:
            ties += compare_answers(first.greedy_before, ph.greedy_before, f"{ph.name} vs {first.name}").ties
    return ties


def _long_answer(k: dict) -> str:
    p = k.get("long_parting")
    if p is None:
        return "identical"
    return f"{'near-tie' if p['tie'] else 'DIFFERENT'} (token {p['at']}, gaps {p['gap_a']}/{p['gap_b']} nats)"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _decode_itl_p99(phase: dict) -> float | None:
    return (phase["classes"].get(DECODE) or {}).get("itl_p99_s")


def build_report(phases: list[Phase], settings: dict, notes: list[str]) -> dict:
    """Every phase's figures, the checks, the comparisons and the issue's targets: one JSON-able object."""
    report_phases = {}
    for ph in phases:
        report_phases[ph.name] = summarize(ph, read_events(ph.logs))
        if ph.kill:
            report_phases[ph.name]["kill"] = ph.kill
    checks = find_problems(phases)
    off, on, base = report_phases["persist_off"], report_phases["persist_on"], report_phases["baseline"]
    compare = {
        "completed_on_over_off": _ratio(on["requests_completed"], off["requests_completed"]),
        "decode_itl_p99_on_over_off": _ratio(_decode_itl_p99(on), _decode_itl_p99(off)),
        "decode_itl_p99_on_over_baseline": _ratio(_decode_itl_p99(on), _decode_itl_p99(base)),
    }
    kill = report_phases.get("kill_restart", {}).get("kill", {})
    itl = _decode_itl_p99(on)
    targets = {  # the H200 targets, evaluated on whatever machine this ran on; never the exit status
        "completed_within_10pct_of_off": None if compare["completed_on_over_off"] is None
        else compare["completed_on_over_off"] >= 0.9,
        "decode_itl_p99_within_10pct_of_off": None if compare["decode_itl_p99_on_over_off"] is None
        else compare["decode_itl_p99_on_over_off"] <= 1.1,
        "decode_itl_p99_at_most_50ms": None if itl is None else itl <= 0.05,
        # or the worker recomputed it because that measured faster, and said so
        "warm_long_5x_faster_than_cold": None if kill.get("long_speedup") is None
        else kill["long_speedup"] >= 5 or kill["long_restore_choice"] == "recompute",
        # every conversation resumed with all it had completed before the kill, or the worker chose to recompute
        "kill_loses_only_in_flight": None if not kill else all(checks[c] == [] for c in KILL_CHECKS) and all(
            r["cached"] >= r["expected_cached"] or r["restore_choice"] == "recompute" for r in kill["resumed"]),
    }
    return {
        "ok": not any(checks.values()),
        "checks": {k: not v for k, v in checks.items()},
        "problems": {k: v for k, v in checks.items() if v},
        "greedy_ties": greedy_ties(phases),
        "settings": settings,
        "notes": notes,
        "phases": report_phases,
        "compare": compare,
        "targets": targets,
        "machine": machine_facts() | {"gpus": gpu_names()},
    }


# the checks a server reached by URL does not get, and why
NOT_APPLIED = {
    "one_outcome_per_request": "reads the server's own log (ember's JSON request events)",
    "abandons_canceled": "reads the server's own log (ember's `canceled` events)",
    "no_failures": "reads the server's own log; its client half is no_client_errors",
    "restart_restores": "reads ember's restore decisions (kv_restore_choice) in its log; each resumed "
                        "conversation's cached tokens are reported instead",
}


def build_url_report(phases: list[Phase], settings: dict, notes: list[str]) -> dict:
    """The report for a server the soak did not start: the client's figures and checks alone."""
    report_phases = {ph.name: {**client_figures(ph), **({"kill": ph.kill} if ph.kill else {})} for ph in phases}
    checks = find_problems(phases, logs=False)
    base, churn = report_phases.get("baseline", {}), report_phases.get("churn", {})
    itl = _decode_itl_p99(churn) if churn else None
    return {
        "ok": not any(checks.values()),
        "checks": {k: not v for k, v in checks.items()},
        "problems": {k: v for k, v in checks.items() if v},
        "not_applied": NOT_APPLIED,
        "settings": settings,
        "notes": notes,
        "phases": report_phases,
        "compare": {"decode_itl_p99_churn_over_baseline": _ratio(itl, _decode_itl_p99(base) if base else None)},
        # the absolute target; those against another server: `ember bench soak --compare`
        "targets": {"decode_itl_p99_at_most_50ms": None if itl is None else itl <= 0.05},
        "machine": machine_facts() | {"gpus": gpu_names()},
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _phase_rows(report: dict) -> list[str]:
    """The phase table: a worker's persistence beside what its clients saw, or for a server reached by
    URL what went wrong at the client."""
    ours = "not_applied" not in report
    head = (f"{'canceled (where)':>22} {'backlog':>7} {'writes':>7} {'drops':>5} {'restored':>8}" if ours
            else f"{'5xx':>4} {'4xx':>4} {'stream err':>10} {'lost':>4}")
    out = [f"\n{'phase':13} {'done':>5} {'req/s':>6} {'cached':>6} {'abandon (prefill/decode)':>24} {head}  "
           "decode tok/s per stream"]
    for name, p in report["phases"].items():
        a = p.get("abandoned_in", {})
        abandon = f"{p['abandoned']} ({a.get('prefill', '-')}/{a.get('decode', '-')})"
        if ours:
            per = p["persistence"]
            where = ", ".join(f"{k} {v}" for k, v in p["cancel_phases"].items())
            canceled = f"{p['cancels']} ({where})" if where else str(p["cancels"])
            tail = (f"{canceled:>22} {_num(per['backlog_max']):>7} {per['writes']:>7g} {per['drops']:>5g} "
                    f"{per['restore_hits']:>8g}")
        else:
            e = p["errors"]
            tail = f"{e['http_5xx']:>4} {e['http_4xx']:>4} {e['stream_errors']:>10} {e['lost']:>4}"
        out.append(f"{name:13} {p['requests_completed']:>5} {p['requests_per_s'] or 0:>6.2f} "
                   f"{_share(p['cached_token_share']):>6} {abandon:>24} {tail}  "
                   + ", ".join(f"{x:g}" for x in p["decode_tok_s_per_stream"].values()))
    return out


def _kill_rows(k: dict) -> list[str]:
    restart = k.get("restart") or {}
    pid = f" (pid {k['killed_pid']})" if k.get("killed_pid") else ""
    out = [f"\nkill -9 mid-churn{pid}: {k['in_flight_lost']} in flight lost, {k['completed_before_kill']} "
           "completed before it"
           + (f", backlog {k['backlog_at_kill']}" if k.get("backlog_at_kill") is not None else "")
           + (f"; ready again {restart['kill_to_ready_s']} s after the kill" if restart else "")]
    if k.get("on_disk_at_kill"):
        out.append("on disk at the kill (tokens of the conversation): " + ", ".join(
            f"{f['client']} {f['on_disk_tokens']}/{f['tokens']}" for f in k["on_disk_at_kill"]))
    out.append("resumed (cached/tokens, TTFT): " + ", ".join(
        f"{r['cached']}/{r['prompt_tokens']} (expected {r['expected_cached']}), {_ms(r.get('ttft_s'))}"
        for r in k["resumed"]))
    chose = f", worker chose {k['long_restore_choice']}" if k.get("long_restore_choice") else ""
    out.append(f"long conversation ({k['long_tokens']} tokens): cold {_ms(k['long_cold_ttft_s'])}, warm after the "
               f"restart {_ms(k['long_warm_ttft_s'])} ({k['long_speedup']}x, {k['long_warm_cached_tokens']} "
               f"cached{chose}), {_long_answer(k)} answer")
    return out


def render(report: dict) -> str:
    s = report["settings"]
    where = f"{s['server']} at {s['url']}" if s.get("url") else f"{s['backend']} backend"
    where += f", context {s['context']}"
    out = [(f"model {s['model']} ({where}); {s['churners']} churners, "
            f"{s['decoders']} decoders, {s['duration_s']:g} s a phase; suffixes {s['suffix'][0]}-{s['suffix'][1]}, "
            f"conversation {s['conversation']}, abandon {s['abandon']:g}")]
    out += [f"note: {n}" for n in report["notes"]]
    out += _phase_rows(report)
    out.append(f"\n{'class':9} {'phase':13} {'sent':>5} {'done':>5} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
               f"{'ITL p50':>8} {'ITL p99':>8} {'cached':>6}")
    for cls in CLASSES:
        for name, p in report["phases"].items():
            c = p["classes"].get(cls)
            if c:
                out.append(f"{cls:9} {name:13} {c['started']:>5} {c['completed']:>5} {c['requests_per_s'] or 0:>6.3f} "
                           f"{_ms(c['ttft_p50_s']):>9} {_ms(c['ttft_p99_s']):>9} {_ms(c['itl_p50_s']):>8} "
                           f"{_ms(c['itl_p99_s']):>8} {_share(c['cached_token_share']):>6}")
    k = report["phases"].get("kill_restart", {}).get("kill")
    if k:
        out += _kill_rows(k)
    out.append("\ncompare   " + ", ".join(f"{k} {v}" for k, v in report["compare"].items()))
    out.append("targets   (the issue's, for the H200; recorded, never the exit status) "
               + ", ".join(f"{k} {v}" for k, v in report["targets"].items()))
    out.append("checks    " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in report["checks"].items()))
    for check, problems in report["problems"].items():
        out += [f"  {check}: {p}" for p in problems[:10]]
    for t in report.get("greedy_ties", []):
        noise = "" if t["noise"] is None else f"; the tokens before moved up to {t['noise']} nats"
        out.append(f"  near-tie, not drift: {t['where']}: prompt {t['prompt']} parted at token {t['at']} "
                   f"({t['a']!r} vs {t['b']!r}, top-2 gaps {t['gap_a']}/{t['gap_b']} nats{noise})")
    if "not_applied" in report:
        out.append("not applied (a server the soak did not start): " + ", ".join(report["not_applied"]))
    m = report["machine"]
    gpus = f", {', '.join(m['gpus'])}" if m.get("gpus") else ""
    out.append(f"machine   {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['blas']}{gpus}")
    return "\n".join(out)
