"""`ember crashes list | show ID | export ID`: read the crash archive the daemon wrote.

A bundle is `<state>/crashes/<UTC time>-<class>/` with meta.json, worker.log, events.jsonl and
health.jsonl (see ember.daemon.bundle). ID is a bundle name, a unique prefix of one, `latest`, or
a negative index (-1 = the newest). The state dir is the contract's (ember.ops.contract.state_dir),
the one the daemon writes to; this module imports nothing of the daemon or the worker.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

from .contract import ExitCode, state_dir

EX_OK, EX_FAIL = ExitCode.OK, ExitCode.FAILURE


def crash_dir(state: Path | None = None) -> Path:
    return (state or state_dir()) / "crashes"


def bundles(root: Path | None = None) -> list[Path]:
    root = root or crash_dir()
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / "meta.json").exists())


def load_meta(b: Path) -> dict[str, Any]:
    try:
        return json.loads((b / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return {"id": b.name, "error": f"unreadable meta.json: {e}"}


class NotFound(LookupError):
    pass


def resolve(ident: str, root: Path | None = None) -> Path:
    all_ = bundles(root)
    if not all_:
        raise NotFound("the crash archive is empty")
    if ident == "latest":
        return all_[-1]
    if re.fullmatch(r"-\d+", ident):
        i = int(ident)
        if -len(all_) <= i:
            return all_[i]
        raise NotFound(f"only {len(all_)} bundles")
    exact = [b for b in all_ if b.name == ident]
    if exact:
        return exact[0]
    hits = [b for b in all_ if b.name.startswith(ident) or load_meta(b).get("signature") == ident]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise NotFound(f"no crash bundle {ident!r}")
    raise NotFound(f"{ident!r} matches {len(hits)} bundles: " + ", ".join(b.name for b in hits[:5]))


def _dur(v: Any) -> str:
    if v is None:
        return "-"
    s = int(float(v))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def replica_crash_dirs(state: Path | None = None) -> list[tuple[str, Path]]:
    """(name, crash dir) of every replica and the router of `[daemon] replicas` (<state>/replicas/<name>)."""
    root = (state or state_dir()) / "replicas"
    if not root.is_dir():
        return []
    return [(d.name, d / "crashes") for d in sorted(root.iterdir()) if d.is_dir()]


def rows(root: Path | None = None, replica: str | None = None) -> list[dict[str, Any]]:
    out = []
    for b in bundles(root):
        m = load_meta(b)
        cuda = m.get("cuda_error") or {}
        det = m.get("detection") or {}
        killed = bool((m.get("exit") or {}).get("killed_by_daemon"))
        out.append({"id": b.name, "when": m.get("detected_at"), "class": m.get("class"),
                    "signature": m.get("signature"), "uptime_seconds": m.get("uptime_seconds"),
                    "restarts": m.get("restart_count"), "exit_code": m.get("exit_code"), "signal": m.get("signal"),
                    "killed_by_daemon": killed, "cuda": cuda.get("name") or cuda.get("code"),
                    "detected_by": det.get("source"), "reason": det.get("reason"),
                    "replica": replica or (m.get("worker") or {}).get("replica"),
                    "gpu": (m.get("worker") or {}).get("cuda_visible_devices")})
    counts: dict[Any, int] = {}  # by signature (None for a bundle without one)
    for r in out:
        counts[r["signature"]] = counts.get(r["signature"], 0) + 1
    for r in out:
        r["repeats"] = counts[r["signature"]]
    return out


def cmd_list(args: argparse.Namespace) -> int:
    fleet = args.all_replicas
    rs = rows()
    if fleet:  # the fleet's own archive, then every member's, newest last
        for name, d in replica_crash_dirs():
            rs += rows(d, replica=name)
        rs.sort(key=lambda r: r["when"] or "")
    if args.json:
        print(json.dumps(rs, indent=2))
        return EX_OK
    if not rs:
        print(f"no crashes archived (in {crash_dir()}" + (" and the replicas' archives)" if fleet else ")"))
        return EX_OK
    hdr: tuple[str, ...] = ("WHEN (UTC)", "CLASS", "SIGNATURE", "REPEATS", "UPTIME", "RESTARTS", "CAUSE", "ID")
    if fleet:
        hdr = ("REPLICA", "GPU", *hdr)
    table: list[tuple[str, ...]] = [hdr]
    for r in rs:
        if r["cuda"]:
            cause = str(r["cuda"])
        elif r["killed_by_daemon"]:  # the daemon's own kill says nothing: name what it saw
            cause = f"{r['detected_by']}, killed"
        else:
            cause = r["signal"] or (f"exit {r['exit_code']}" if r["exit_code"] is not None else "") or "-"
        when = (r["when"] or "")[:19].replace("T", " ")
        restarts = str(r["restarts"] if r["restarts"] is not None else "-")
        row: tuple[str, ...] = (when, r["class"] or "?", r["signature"] or "-", str(r["repeats"]),
                                _dur(r["uptime_seconds"]), restarts, str(cause), r["id"])
        table.append((r["replica"] or "-", r["gpu"] or "-", *row) if fleet else row)
    widths = [max(len(row[i]) for row in table) for i in range(len(hdr))]
    for line in table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    return EX_OK


def cmd_show(args: argparse.Namespace) -> int:
    b = resolve(args.id)
    m = load_meta(b)
    if args.json:
        print(json.dumps(m, indent=2))
        return EX_OK
    det = m.get("detection") or {}
    print(f"crash {m.get('id', b.name)}")
    print(f"  class       {m.get('class')}   signature {m.get('signature')}  ({m.get('signature_text')})")
    print(f"  detected    {m.get('detected_at')}  by {det.get('source')}: {det.get('reason')}")
    ex = m.get("exit") or {}
    ex_s = ", ".join(f"{k}={v}" for k, v in ex.items() if k != "supervisor") or "-"
    print(f"  exit        {ex_s}")
    if m.get("cuda_error"):
        c = m["cuda_error"]
        print(f"  cuda        {c.get('code')} {c.get('name')}: {c.get('message')}")
    w = m.get("worker") or {}
    print(f"  worker      pid {w.get('pid')}  version {w.get('version')}  model {w.get('model')}  "
          f"fingerprint {w.get('model_fingerprint')}")
    print(f"  uptime      {_dur(m.get('uptime_seconds'))}   restarts before {m.get('restart_count')}   "
          f"decision {json.dumps(m.get('restart'))}")
    host, gpu = m.get("host") or {}, m.get("gpu") or {}
    gpus = ", ".join(g.get("name", "?") for g in gpu.get("gpus", [])) or ("no NVML" if not gpu.get("present") else "-")
    print(f"  host        {host.get('platform')}  python {host.get('python')}  "
          f"driver {gpu.get('driver_version', '-')}  gpus {gpus}")
    lw = m.get("log_window") or {}
    print(f"  affected    requests {lw.get('affected_requests')}  last healthy {lw.get('last_healthy_request')}")
    print(f"  files       {b}/ (meta.json, worker.log {lw.get('lines')} lines, events.jsonl "
          f"{(m.get('events') or {}).get('count')} events, health.jsonl {(m.get('health') or {}).get('count')} probes)")
    if not args.meta_only:
        print("\n--- worker.log (last healthy request to the crash line) ---")
        try:
            text = (b / "worker.log").read_text()
        except OSError as e:
            text = f"(unreadable: {e})\n"
        lines = text.splitlines()
        if args.lines and len(lines) > args.lines:
            print(f"... {len(lines) - args.lines} earlier lines in {b / 'worker.log'}")
            lines = lines[-args.lines:]
        for ln in lines:
            print(ln)
    return EX_OK


_SCRUB = [
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{6,}"), r"\1***"),
    (re.compile(r'(?i)("(?:api[_-]?key|token|secret|password|authorization)"\s*:\s*)"(?!\*\*\*")[^"]*"'), r'\1"***"'),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), "sk-***"),
]


def scrub_for_export(text: str, hostname: str | None) -> str:
    home = os.path.expanduser("~")
    if home and home != "/":
        text = text.replace(home, "~")
    if hostname:
        text = re.sub(r"\b" + re.escape(hostname) + r"\b", "<host>", text)
    for pat, rep in _SCRUB:
        text = pat.sub(rep, text)
    return text


def export(b: Path, out: Path) -> Path:
    """A .tar.gz of the bundle, safe to attach to a bug report: secrets were redacted when it was
    written; the export also replaces the home directory and host name and re-checks for tokens."""
    m = load_meta(b)
    hostname = (m.get("host") or {}).get("hostname")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for f in sorted(b.iterdir()):
            if not f.is_file():
                continue
            data = scrub_for_export(f.read_text(errors="replace"), hostname).encode()
            info = tarfile.TarInfo(f"{b.name}/{f.name}")
            info.size = len(data)
            info.mode = 0o600
            info.mtime = int(f.stat().st_mtime)
            info.uname = info.gname = "ember"
            tar.addfile(info, io.BytesIO(data))
    return out


def cmd_export(args: argparse.Namespace) -> int:
    b = resolve(args.id)
    out = Path(args.output) if args.output else Path.cwd() / f"ember-crash-{b.name}.tar.gz"
    export(b, out)
    print(out)
    return EX_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember crashes", description="the crash archive the daemon keeps")
    sub = p.add_subparsers(dest="sub", required=True)
    ls = sub.add_parser("list", help="a table: when, class, signature, uptime, restarts")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--all-replicas", action="store_true",
                    help="with [daemon] replicas: every replica's and the router's archive too, naming each")
    ls.set_defaults(func=cmd_list)
    sh = sub.add_parser("show", help="meta plus the log window of one crash")
    sh.add_argument("id", help="bundle name, unique prefix, signature, 'latest' or -N")
    sh.add_argument("--json", action="store_true", help="meta.json only, as JSON")
    sh.add_argument("--meta-only", action="store_true")
    sh.add_argument("-n", "--lines", type=int, default=0, help="show only the last N log lines")
    sh.set_defaults(func=cmd_show)
    ex = sub.add_parser("export", help="a .tar.gz safe to attach to a bug report")
    ex.add_argument("id")
    ex.add_argument("-o", "--output", metavar="FILE")
    ex.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NotFound as e:
        print(f"ember crashes: {e}", file=sys.stderr)
        return EX_FAIL
    except BrokenPipeError:
        return EX_OK


if __name__ == "__main__":
    sys.exit(main())
