"""`ember cache report [--since DURATION] [--log PATH] [--json]`: what the prefix cache did for the
requests a worker's log recorded (issue 43 item 2). Per protocol and per client (its User-Agent's
product name): requests, how many started warm, prompt tokens and the share the cache supplied. Then
the prompt tokens computed: those re-prefilled after a miss, by cause (the admit line's `miss_cause`,
worker/engine/misses.py), against those no earlier request had; and the most common divergence
points (cause and message), with where in the prompt they fall (median token and character).

It reads the worker's JSON log where the daemon keeps it (contract.worker_log: <state>/logs/worker.log
and its rotated files, oldest first), or --log PATH (a file, or a directory holding worker.log*).
Only `admit` lines count, the daemon's own probes left out; a line that is no JSON record is skipped.
A miss's re-prefilled tokens are `could_have_cached - cached_tokens`. Like every ops tool it imports
nothing of the worker or the daemon: the log's shape is the contract's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .contract import ADMIT_CLIENT_FIELD, Event, ExitCode, parse_duration, parse_log_line, worker_log

TOP_POINTS = 10  # divergence points listed


def log_files(path: Path | None = None) -> list[Path]:
    """The log files to read, oldest first: `path` itself, or a directory's (or the daemon's)
    worker.log with its rotations (worker.log.N ... worker.log.1, then worker.log)."""
    base = worker_log() if path is None else path
    if base.is_dir():
        base = base / "worker.log"
    elif path is not None:
        return [base] if base.exists() else []
    rotated = sorted((p for p in base.parent.glob(base.name + ".*") if p.suffix[1:].isdigit()),
                     key=lambda p: int(p.suffix[1:]), reverse=True)
    return rotated + ([base] if base.exists() else [])


def admits(files: Iterable[Path], since: datetime | None = None) -> Iterator[dict[str, Any]]:
    """The admit records of `files`, the daemon's probes left out, from `since` on."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                rec = parse_log_line(line)
                if rec is None or rec.get("event") != Event.ADMIT or rec.get("probe"):
                    continue
                if since is not None and _when(rec) < since:
                    continue
                yield rec


def _when(rec: dict[str, Any]) -> datetime:
    try:
        t = datetime.fromisoformat(str(rec.get("ts")))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def client_of(user_agent: str | None) -> str:
    """A User-Agent's product name ("claude-cli/1.0.3 (external, cli)" -> claude-cli); "-" for none."""
    ua = (user_agent or "").strip()
    return ua.split()[0].split("/")[0] if ua else "-"


def _int(rec: dict[str, Any], key: str) -> int:
    v = rec.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


@dataclass
class Share:
    requests: int = 0
    warm: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, rec: dict[str, Any]) -> None:
        self.requests += 1
        self.warm += _int(rec, "cached_tokens") > 0
        self.prompt_tokens += _int(rec, "prompt_tokens")
        self.cached_tokens += _int(rec, "cached_tokens")

    def as_dict(self, name: str) -> dict[str, Any]:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"name": name, "requests": self.requests, "warm": self.warm, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "cached_share": round(share, 4)}


@dataclass
class Point:
    admits: int = 0
    tokens: int = 0
    at: list[int] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)


def _cause(rec: dict[str, Any]) -> str:
    cause = str(rec["miss_cause"])
    return f"{cause} ({rec['evicted_from']})" if rec.get("evicted_from") else cause


def _message(rec: dict[str, Any]) -> str:
    m = rec.get("diverged_message")
    if isinstance(m, dict) and "index" in m:
        return f"#{m['index']} {m.get('role') or '?'}"
    return "-"


class Report:
    """Admit records summed as they are read (add), then as one JSON-able object (result)."""

    def __init__(self) -> None:
        self.total = Share()
        self.by_protocol: dict[str, Share] = defaultdict(Share)
        self.by_client: dict[str, Share] = defaultdict(Share)
        self.causes: dict[str, Point] = defaultdict(Point)
        self.points: dict[tuple[str, str], Point] = defaultdict(Point)
        self.new_tokens = 0
        self.first: datetime | None = None
        self.last: datetime | None = None

    def add(self, rec: dict[str, Any]) -> None:
        t = _when(rec)
        self.first = t if self.first is None else min(self.first, t)
        self.last = t if self.last is None else max(self.last, t)
        self.total.add(rec)
        self.by_protocol[str(rec.get("protocol") or "-")].add(rec)
        self.by_client[client_of(rec.get(ADMIT_CLIENT_FIELD))].add(rec)
        self.new_tokens += _int(rec, "new_tokens")
        if rec.get("miss_cause"):
            lost = max(0, _int(rec, "could_have_cached") - _int(rec, "cached_tokens"))
            for p in (self.causes[_cause(rec)], self.points[(_cause(rec), _message(rec))]):
                p.admits, p.tokens = p.admits + 1, p.tokens + lost
                p.at.append(_int(rec, "diverged_at"))
                if isinstance(rec.get("diverged_char"), int):
                    p.chars.append(rec["diverged_char"])

    def result(self) -> dict[str, Any]:
        reprefilled = sum(p.tokens for p in self.causes.values())
        top = sorted(self.points.items(), key=lambda kv: (-kv[1].tokens, -kv[1].admits))[:TOP_POINTS]
        return {
            "from": self.first.isoformat() if self.first else None,
            "to": self.last.isoformat() if self.last else None,
            **self.total.as_dict("all"),
            "by_protocol": _shares(self.by_protocol), "by_client": _shares(self.by_client),
            "new_tokens": self.new_tokens, "reprefilled_tokens": reprefilled,
            "first_seen_tokens": max(0, self.new_tokens - reprefilled),
            "reprefilled_by_cause": [{"cause": k, "admits": p.admits, "tokens": p.tokens}
                                     for k, p in sorted(self.causes.items(), key=lambda kv: -kv[1].tokens)],
            "divergence_points": [{"cause": cause, "message": msg, "admits": p.admits, "tokens": p.tokens,
                                   "median_token": int(statistics.median(p.at)),
                                   "median_char": int(statistics.median(p.chars)) if p.chars else None}
                                  for (cause, msg), p in top],
        }


def _shares(groups: dict[str, Share]) -> list[dict[str, Any]]:
    return [s.as_dict(k) for k, s in sorted(groups.items(), key=lambda kv: -kv[1].requests)]


def report(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The report of admit records, as one JSON-able object."""
    r = Report()
    for rec in records:
        r.add(rec)
    return r.result()


def _n(v: int) -> str:
    return f"{v:,}"


def render(r: dict[str, Any], source: str) -> str:
    span = f"{r['from'][:16].replace('T', ' ')} to {r['to'][:16].replace('T', ' ')} UTC" if r["from"] else ""
    out = [f"ember cache report: {_n(r['requests'])} requests admitted, {span} ({source})", ""]
    head = f"{'':<28}{'requests':>9}{'warm':>7}{'prompt tokens':>15}{'cached':>13}{'share':>8}"
    for title, rows in (("by protocol", r["by_protocol"]), ("by client (user agent)", r["by_client"])):
        out += [head if title == "by protocol" else "", title]
        for s in [*rows, r] if title == "by protocol" else rows:
            name = "all" if s is r else s["name"]
            out.append(f"  {name[:26]:<26}{s['requests']:>9,}{s['warm']:>7,}{s['prompt_tokens']:>15,}"
                       f"{s['cached_tokens']:>13,}{100 * s['cached_share']:>7.1f}%")
    out += ["", f"prompt tokens computed: {_n(r['new_tokens'])} ({_n(r['reprefilled_tokens'])} re-prefilled after "
                f"a miss, {_n(r['first_seen_tokens'])} that no earlier request had)"]
    if r["reprefilled_by_cause"]:
        out.append(f"  {'re-prefilled, by cause':<34}{'admits':>8}{'tokens':>13}")
        out += [f"  {c['cause']:<34}{c['admits']:>8,}{c['tokens']:>13,}" for c in r["reprefilled_by_cause"]]
        out += ["", f"most common divergence points {'':<12}{'admits':>8}{'tokens':>13}{'token':>10}{'char':>10}"]
        for p in r["divergence_points"]:
            char = "-" if p["median_char"] is None else f"{p['median_char']:,}"
            out.append(f"  {p['cause'][:24]:<24}{p['message'][:16]:<16}{p['admits']:>8,}{p['tokens']:>13,}"
                       f"{p['median_token']:>10,}{char:>10}")
        out.append("  (token, char: the median point in the prompt where the cache stopped matching)")
    else:
        out.append("  no misses: every admitted prompt got all the cache could give it")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ember cache", description="what the prefix cache did for the requests "
                                 "in a worker's log")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("report", help="warm share by protocol and client, misses by cause, divergence points")
    rp.add_argument("--since", metavar="DURATION", help="only requests admitted this long ago or later (30m, 24h)")
    rp.add_argument("--log", metavar="PATH", type=Path,
                    help=f"the worker's log file, or a directory holding worker.log* (default: {worker_log()})")
    rp.add_argument("--json", action="store_true", help="the report as one JSON object")
    args = ap.parse_args(argv)
    since = None
    if args.since:
        try:
            seconds = parse_duration(args.since, "--since")
        except ValueError as e:
            print(f"ember cache report: {e}", file=sys.stderr)
            return ExitCode.USAGE
        since = datetime.fromtimestamp(datetime.now(UTC).timestamp() - seconds, UTC)
    files = log_files(args.log)
    if not files:
        print(f"ember cache report: no worker log at {args.log or worker_log()}", file=sys.stderr)
        return ExitCode.FAILURE
    r = report(admits(files, since))
    source = ", ".join(str(f) for f in files) if len(files) <= 2 else f"{files[-1]} and {len(files) - 1} rotated"
    if args.json:
        print(json.dumps({"log": [str(f) for f in files], "since": since.isoformat() if since else None, **r}))
    elif not r["requests"]:
        print(f"ember cache report: no admitted requests in {source}" + (f" since {args.since} ago" if since else ""))
    else:
        print(render(r, source), end="")
    return ExitCode.OK
