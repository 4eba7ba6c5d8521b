"""`ember config show [--json] [--config FILE]`: the effective configuration and where each value came from.

Daemon keys (`[daemon]`) are resolved here with the daemon's own rules (ember.daemon.settings).
Worker keys (top level or `[worker]`) are resolved by the worker's config module, run in a
subprocess: the daemon process never imports ember.worker (docs/architecture.md, "Import rules").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import fields
from typing import Any

from ember.ops.contract import ENV_CONFIG, ExitCode, config_file, config_sections, state_dir

from .settings import Settings, SettingsError, load

_WORKER_PROBE = r"""
import json, sys
from ember.worker import config
try:
    cfg, src = config.load(None)
except config.ConfigError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
print(json.dumps({"values": config.redacted(cfg), "sources": src}))
"""


def worker_config(env: dict[str, str]) -> dict[str, Any]:
    """{"values": {...}, "sources": {...}} or {"error": "..."} from the worker's own loader."""
    try:
        r = subprocess.run([sys.executable, "-c", _WORKER_PROBE], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"could not run the worker's config loader: {e}"}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"the worker's config loader failed: {(r.stderr or r.stdout).strip()[-400:]}"}


def daemon_config(env: dict[str, str]) -> dict[str, Any]:
    try:
        s = load(env=env)
    except SettingsError as e:
        return {"error": str(e)}
    path = config_file(env)
    data: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
    _, section = config_sections(data, path)  # (load() has checked it)
    values = s.redacted()
    sources: dict[str, str] = {}
    for f in fields(Settings):
        if f.name in ("host", "port", "api_key", "drain_seconds", "config_path"):
            continue  # the worker's keys, shown in the worker's section
        var = "EMBER_DAEMON_" + f.name.upper()
        if env.get(var):
            sources[f.name] = f"env {var}"
        elif f.name in section:
            sources[f.name] = f"file {path} [daemon]"
        else:
            sources[f.name] = "default"
    return {"values": {k: values[k] for k in sources}, "sources": sources}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def config_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember config", description="the effective configuration")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("show", help="print every setting, its value and where it came from")
    s.add_argument("--json", action="store_true", help="machine-readable")
    s.add_argument("--config", metavar="FILE", help=f"ember.toml to read (default {config_file()}, or ${ENV_CONFIG})")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.config:
        env[ENV_CONFIG] = os.path.abspath(os.path.expanduser(args.config))
    path = config_file(env)
    if path.exists():
        env[ENV_CONFIG] = str(path)  # the worker reads the file only when told where it is
    worker = worker_config(env)
    daemon = daemon_config(env)
    out = {"config_file": str(path), "config_file_exists": path.exists(), "state_dir": str(state_dir(env)),
           "worker": worker, "daemon": daemon}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"config file: {path}" + ("" if path.exists() else "  (absent: defaults apply)"))
        print(f"state dir:   {out['state_dir']}")
        for title, sec in (("worker (top level or [worker])", worker), ("daemon ([daemon])", daemon)):
            print(f"\n{title}")
            if "error" in sec:
                print(f"  error: {sec['error']}")
                continue
            width = max(len(k) for k in sec["values"])
            for k, v in sec["values"].items():
                print(f"  {k:<{width}}  {_fmt(v):<24}  {sec['sources'].get(k, 'default')}")
    # a file either side refuses is a configuration error, as `ember start` and the worker would call it
    return ExitCode.CONFIG if ("error" in worker or "error" in daemon) else ExitCode.OK
