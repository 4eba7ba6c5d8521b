"""`python -m ember.daemon.launch FILE`: exec the engine described by a 0600 JSON file.

supervisord runs this; the JSON (written by the daemon before each start) holds `argv`, `env` and
`cwd`. exec keeps the process id, so supervisord, the daemon and `kill` all see the engine itself.
Imports nothing heavy: it runs on every (re)start.
"""

import json
import os
import sys


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m ember.daemon.launch FILE", file=sys.stderr)
        raise SystemExit(78)
    try:
        with open(sys.argv[1]) as f:
            spec = json.load(f)
        argv = [str(a) for a in spec["argv"]]
        env = {str(k): str(v) for k, v in spec.get("env", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(json.dumps({"event": "launch_error", "level": "error", "error": f"{sys.argv[1]}: {e}"}), file=sys.stderr)
        raise SystemExit(78)
    if spec.get("cwd"):
        try:
            os.chdir(spec["cwd"])
        except OSError:
            pass
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(json.dumps({"event": "launch_error", "level": "error", "error": f"cannot run {argv[0]}: {e}"}),
              file=sys.stderr, flush=True)
        raise SystemExit(78)


if __name__ == "__main__":
    main()
