"""`python -m ember.daemon.launch FILE`: exec the engine described by a 0600 JSON file.

supervisord runs this; the JSON (written by the daemon before each start) holds `argv`, `env` and
`cwd`. exec keeps the process id, so supervisord, the daemon and `kill` all see the engine itself.
Imports nothing heavy: it runs on every (re)start.
"""

import contextlib
import json
import os
import sys

from ember.ops.contract import Event, ExitCode, log_line


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m ember.daemon.launch FILE", file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG)
    try:
        with open(sys.argv[1]) as f:
            spec = json.load(f)
        argv = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec.get("env", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(log_line(Event.LAUNCH_ERROR, "error", error=f"{sys.argv[1]}: {e}"), file=sys.stderr)
        raise SystemExit(ExitCode.CONFIG) from None
    if spec.get("cwd"):
        with contextlib.suppress(OSError):
            os.chdir(spec["cwd"])
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(log_line(Event.LAUNCH_ERROR, "error", error=f"cannot run {argv[0]}: {e}"), file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.CONFIG) from None


if __name__ == "__main__":
    main()
