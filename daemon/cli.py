"""The `ember` command.

The daemon never imports the worker (see DESIGN.md), so worker verbs are handed to
`python -m ember.worker` by exec: same process id, same terminal, no import of the data plane here.
"""

from __future__ import annotations

import os
import sys

WORKER_VERBS = {
    "worker": "run the inference worker in the foreground (HTTP APIs on 127.0.0.1:8080)",
    "generate": "generate text from a prompt on this machine",
    "bench": "benchmarks and synthetic models (bench speed, bench make-model)",
}

USAGE = """usage: ember <command> [options]

commands:
{verbs}

Run `ember <command> --help` for a command's options.
"""


def _usage() -> str:
    verbs = "\n".join(f"  {name:<10} {text}" for name, text in WORKER_VERBS.items())
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
    print(f"ember: unknown command {verb!r}\n\n{_usage()}", end="", file=sys.stderr)
    return 2
