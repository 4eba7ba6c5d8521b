"""`ember bench soak --compare A.json B.json`: two soak reports side by side, A against B, with the
issue's targets for ember (A) against what users run today (B, llama-server) under the same load.

Pure functions over what `ember bench soak --json` printed, whichever way each soak ran: against a
server by URL (its `churn` phase) or against ember's own workers (`persist_on`, the default
persistence). Every figure is the client's. Nothing here runs a soak; the targets are recorded,
never an exit status (a report that is not a soak's is exit 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHURN_PHASES = ("churn", "persist_on")
# settings that must match for the figures to be comparable (the prompts follow from them and the tokenizer)
SAME = ("seed", "churners", "decoders", "conversation", "suffix", "warm_suffix", "answer", "decode_prompt",
        "decode_tokens", "abandon", "truncate_share", "duration_s", "warmup_s", "context", "long")


def _churn(report: dict) -> dict:
    return next((report["phases"][n] for n in CHURN_PHASES if n in report["phases"]), {})


def _cls(phase: dict, cls: str, key: str) -> float | None:
    return (phase.get("classes", {}).get(cls) or {}).get(key)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    v = sorted(xs)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def figures(report: dict) -> dict:
    """The figures the comparison reads, flat, from one report (None where it has none)."""
    churn, base = _churn(report), report["phases"].get("baseline", {})
    kill = report["phases"].get("kill_restart", {}).get("kill") or {}
    phases = list(report["phases"].values())
    errors = [p.get("errors", {}) for p in phases]
    resumed = kill.get("resumed", [])
    prompt = sum(r["prompt_tokens"] for r in resumed)
    checks = report.get("checks", {})
    return {
        # the churners' work: warm admits and truncations answered in full (abandons are no work done)
        "churn_requests_completed": sum(_cls(churn, c, "completed") or 0 for c in ("warm", "truncate")),
        "churn_all_requests_completed": churn.get("requests_completed"),
        "warm_ttft_p50_s": _cls(churn, "warm", "ttft_p50_s"),
        "warm_ttft_p99_s": _cls(churn, "warm", "ttft_p99_s"),
        "truncate_ttft_p50_s": _cls(churn, "truncate", "ttft_p50_s"),
        "truncate_ttft_p99_s": _cls(churn, "truncate", "ttft_p99_s"),
        "churn_latency_p50_s": _cls(churn, "truncate", "latency_p50_s"),
        "decode_itl_p50_s": _cls(churn, "decode", "itl_p50_s"),
        "decode_itl_p99_s": _cls(churn, "decode", "itl_p99_s"),
        "decode_tok_s_per_stream": _mean(list(churn.get("decode_tok_s_per_stream", {}).values())),
        "decode_tok_s_per_stream_min": min(churn.get("decode_tok_s_per_stream", {}).values(), default=None),
        "baseline_decode_tok_s_per_stream": _mean(list(base.get("decode_tok_s_per_stream", {}).values())),
        "baseline_decode_itl_p99_s": _cls(base, "decode", "itl_p99_s"),
        "warm_cached_share": _cls(churn, "warm", "cached_token_share"),
        "abandoned": churn.get("abandoned"),
        "abandoned_in_prefill": (churn.get("abandoned_in") or {}).get("prefill"),
        "http_5xx": sum(e.get("http_5xx", 0) for e in errors),
        "other_errors": sum(e.get("http_4xx", 0) + e.get("stream_errors", 0) for e in errors),
        # lost outside a kill: a kill's in-flight requests are what a kill -9 costs
        "lost": sum(e.get("lost", 0) for e in errors) - (kill.get("in_flight_lost") or 0),
        "greedy_identical": all(checks.get(c, True) for c in ("greedy_identical", "greedy_identical_across_phases")),
        "restart_ready_s": (kill.get("restart") or {}).get("kill_to_ready_s"),
        "resumed_ttft_p50_s": _pct([r["ttft_s"] for r in resumed if r.get("ttft_s") is not None], 50),
        "resumed_cached_share": round(sum(r["cached"] for r in resumed) / prompt, 3) if prompt else None,
        "long_cold_ttft_s": kill.get("long_cold_ttft_s"),
        "long_warm_ttft_s": kill.get("long_warm_ttft_s"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _at_least(a: float | None, b: float | None, k: float) -> bool | None:
    return None if a is None or b is None else a >= k * b


def targets(a: dict, b: dict) -> dict[str, bool | None]:
    """The issue's targets for A against B (None: a figure is missing on either side)."""
    itl = a["decode_itl_p99_s"]
    return {
        "churn_requests_at_least_2x": _at_least(a["churn_requests_completed"], b["churn_requests_completed"], 2),
        "warm_ttft_p50_at_most_half": _at_least(b["warm_ttft_p50_s"], a["warm_ttft_p50_s"], 2),
        "decode_itl_p99_at_most_50ms_and_b": None if itl is None or b["decode_itl_p99_s"] is None
        else itl <= 0.05 and itl <= b["decode_itl_p99_s"],
        "decode_tok_s_per_stream_at_least_1_5x": _at_least(a["decode_tok_s_per_stream"], b["decode_tok_s_per_stream"],
                                                           1.5),
        "no_5xx_lost_or_greedy_drift": a["http_5xx"] == 0 and a["lost"] == 0 and a["greedy_identical"],
    }


# rows of the table: label, figure, unit ("s", "tok/s", "" or "share"), the target's words
ROWS = (
    ("churn requests completed (warm + truncate)", "churn_requests_completed", "", ">= 2x"),
    ("  all requests completed in the churn", "churn_all_requests_completed", "", ""),
    ("TTFT warm admits p50", "warm_ttft_p50_s", "s", "<= 0.5x"),
    ("TTFT warm admits p99", "warm_ttft_p99_s", "s", ""),
    ("TTFT truncations p50", "truncate_ttft_p50_s", "s", ""),
    ("TTFT truncations p99", "truncate_ttft_p99_s", "s", ""),
    ("truncation latency p50 (request to [DONE])", "churn_latency_p50_s", "s", ""),
    ("decode ITL p50 under churn", "decode_itl_p50_s", "s", ""),
    ("decode ITL p99 under churn", "decode_itl_p99_s", "s", "<= 50 ms, <= B"),
    ("decode tok/s per stream under churn (mean)", "decode_tok_s_per_stream", "tok/s", ">= 1.5x"),
    ("  slowest stream", "decode_tok_s_per_stream_min", "tok/s", ""),
    ("decode tok/s per stream, decoders alone", "baseline_decode_tok_s_per_stream", "tok/s", ""),
    ("decode ITL p99, decoders alone", "baseline_decode_itl_p99_s", "s", ""),
    ("cached share of warm admits' prompts", "warm_cached_share", "share", ""),
    ("abandoned (of them before the first token)", "abandoned", "", ""),
    ("5xx", "http_5xx", "", "0"),
    ("other errors (4xx, in-stream)", "other_errors", "", ""),
    ("lost outside the kill", "lost", "", "0"),
    ("greedy outputs identical (no poisoned context)", "greedy_identical", "", "yes"),
    ("kill -9 to ready again", "restart_ready_s", "s", ""),
    ("resumed conversations' TTFT p50", "resumed_ttft_p50_s", "s", ""),
    ("resumed conversations' cached share", "resumed_cached_share", "share", ""),
    ("long conversation cold TTFT", "long_cold_ttft_s", "s", ""),
    ("long conversation warm after the restart", "long_warm_ttft_s", "s", ""),
)
TARGET_OF = {"churn_requests_completed": "churn_requests_at_least_2x", "warm_ttft_p50_s": "warm_ttft_p50_at_most_half",
             "decode_itl_p99_s": "decode_itl_p99_at_most_50ms_and_b",
             "decode_tok_s_per_stream": "decode_tok_s_per_stream_at_least_1_5x",
             "http_5xx": "no_5xx_lost_or_greedy_drift", "lost": "no_5xx_lost_or_greedy_drift",
             "greedy_identical": "no_5xx_lost_or_greedy_drift"}


def compare(a: dict, b: dict) -> dict:
    """A against B: each side's figures, the ratios, the targets, and the settings that differ."""
    fa, fb = figures(a), figures(b)
    sa, sb = a["settings"], b["settings"]
    return {
        "a": {"label": label(a), "figures": fa}, "b": {"label": label(b), "figures": fb},
        "ratios": {k: _ratio(fa[k], fb[k]) for k in fa if not isinstance(fa[k], bool)},
        "targets": targets(fa, fb),
        "settings_differ": {k: [sa.get(k), sb.get(k)] for k in SAME if sa.get(k) != sb.get(k)},
        "abandoned_in_prefill": [fa["abandoned_in_prefill"], fb["abandoned_in_prefill"]],
    }


def label(report: dict) -> str:
    s = report["settings"]
    who = s.get("server") or f"ember workers ({s.get('backend')})"
    gpus = report.get("machine", {}).get("gpus") or []
    return f"{who}, {s.get('model')}" + (f", {gpus[0]}" if gpus else "")


def _fmt(x, unit: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if unit == "s":
        return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"
    if unit == "share":
        return f"{x:.0%}"
    return f"{x:g}" if isinstance(x, int | float) else str(x)


def render_compare(c: dict) -> str:
    fa, fb = c["a"]["figures"], c["b"]["figures"]
    out = [f"A: {c['a']['label']}", f"B: {c['b']['label']}"]
    out += [f"note: settings differ, the figures are not comparable: {k} {v[0]} (A) vs {v[1]} (B)"
            for k, v in c["settings_differ"].items()]
    out.append(f"\n{'':46} {'A':>11} {'B':>11} {'A/B':>7}  {'target':>14}  met")
    for text, key, unit, target in ROWS:
        a, b = fa[key], fb[key]
        if key == "abandoned":
            a, b = (f"{x} ({p})" if x is not None else None for x, p in ((a, fa["abandoned_in_prefill"]),
                                                                          (b, fb["abandoned_in_prefill"])))
        ratio = c["ratios"].get(key)
        met = c["targets"].get(TARGET_OF.get(key, ""))
        out.append(f"{text:46} {_fmt(a, unit):>11} {_fmt(b, unit):>11} {_fmt(ratio, ''):>7}  {target:>14}  "
                   + ("" if key not in TARGET_OF else "-" if met is None else "yes" if met else "NO"))
    out.append("\ntargets (issue 42; recorded, never the exit status): "
               + ", ".join(f"{k} {v}" for k, v in c["targets"].items()))
    return "\n".join(out)


def cmd_compare(path_a: Path, path_b: Path, as_json: bool) -> int:
    try:
        a, b = (json.loads(p.read_text()) for p in (path_a, path_b))
        c = compare(a, b)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"ember bench soak --compare: want two reports of `ember bench soak --json` ({e})", file=sys.stderr)
        return 2
    print(json.dumps(c) if as_json else render_compare(c))
    return 0
