"""The `ember` command.

The daemon never imports the worker (docs/architecture.md, "Import rules"), so worker verbs are
handed to `python -m ember.worker` by exec: same process id, same terminal, no import of the data
plane here.
"""

from __future__ import annotations

import os
import sys

WORKER_VERBS = {
    "worker": "run the inference worker in the foreground (HTTP APIs on 127.0.0.1:8080)",
    "generate": "generate text from a prompt on this machine",
    "bench": "benchmarks and synthetic models (speed, serve, soak, resume, replay, grammar, trace, make-model)",
    "kernels": "CUDA kernels: kernels build --arch sm_90 (NVRTC; no GPU needed), kernels list",
}

USAGE = """usage: ember <command> [options]

commands:
{verbs}

Run `ember <command> --help` for a command's options.
"""


# control-plane verbs (ember.daemon.commands), the crash archive (ember.ops.crashes) and the cache report
# (ember.ops.cache_report), imported on use
DAEMON_VERBS = {
    "start": "start ember in the background and wait until it serves",
    "stop": "drain and stop the worker, then the daemon",
    "restart": "drain and restart the worker",
    "status": "daemon and worker state, pids, uptime, model, restarts, last crash (--json)",
    "logs": "the worker's log, pretty-printed (-f follows; --daemon for the daemon's)",
    "crashes": "the crash archive: crashes list | show ID | export ID",
    "cache": "the prefix cache: cache report [--since 24h] (warm share, misses by cause, divergence points)",
    "daemon": "daemon run: the supervising daemon in the foreground (what the service runs)",
    "service": "start at boot: service install|uninstall|status [--system] [--dry-run]",
    "config": "config show: the effective settings and where each came from",
}


def _usage() -> str:
    verbs = "\n".join(f"  {name:<10} {text}" for name, text in {**WORKER_VERBS, **DAEMON_VERBS}.items())
    return USAGE.format(verbs=verbs)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(), end="")
        return 0
    if args[0] in ("-V", "--version", "version"):
        from importlib.metadata import version

        print(f"ember {version('ember')}")
        return 0
    verb = args[0]
    if verb in WORKER_VERBS:
        os.execv(sys.executable, [sys.executable, "-m", "ember.worker", *args])
    if verb == "crashes":
        from ember.ops.crashes import main as crashes_main

        return crashes_main(args[1:])
    if verb == "cache":
        from ember.ops.cache_report import main as cache_main

        return cache_main(args[1:])
    if verb in ("service", "config"):
        from .service import VERBS as SERVICE_VERBS

        return SERVICE_VERBS[verb](args[1:])
    if verb in DAEMON_VERBS:
        from .commands import VERBS

        try:
            return VERBS[verb][0](args[1:])
        except PermissionError as e:  # an unsafe socket dir, a symlink root will not follow: one line, no traceback
            print(f"ember {verb}: {e}", file=sys.stderr)
            return 1
    print(f"ember: unknown command {verb!r}\n\n{_usage()}", end="", file=sys.stderr)
    return 2
