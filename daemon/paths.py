"""Where the daemon keeps things: the state dir (0700) and the fixed paths under it.

    <state>/                  $EMBER_STATE_DIR, ~/.local/share/ember, or /var/lib/ember (system)
      run/                    supervisord.conf, supervisord.sock, daemon.sock, status.json, state.json
      logs/                   worker.log (+ .1 .. .N), supervisord.log, daemon.log
      crashes/<id>/           crash bundles (ember crashes list|show|export)

Directories are 0700 and files 0600: crash bundles and logs describe the user's sessions.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


def state_dir() -> Path:
    env = os.environ.get("EMBER_STATE_DIR")
    if env:
        return Path(env).expanduser()
    if os.geteuid() == 0 and os.environ.get("EMBER_SYSTEM") == "1":
        return Path("/var/lib/ember")
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "ember"


def config_file(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("EMBER_CONFIG"):
        return Path(env["EMBER_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "ember" / "ember.toml"


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if (path.stat().st_mode & 0o777) != 0o700:
            path.chmod(0o700)
    except OSError:
        pass
    return path


@dataclass(frozen=True)
class Layout:
    state: Path

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def crashes(self) -> Path:
        return self.state / "crashes"

    @property
    def sockets(self) -> Path:
        """Unix sockets live in run/, or in a short private /tmp dir when that path is too long."""
        if len(str(self.run / "supervisord.sock")) <= SOCKET_PATH_MAX:
            return self.run
        digest = hashlib.sha256(str(self.state.resolve()).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"ember-{os.geteuid()}-{digest}"

    @property
    def supervisor_sock(self) -> Path:
        return self.sockets / "supervisord.sock"

    @property
    def control_sock(self) -> Path:
        return self.sockets / "daemon.sock"

    @property
    def supervisor_conf(self) -> Path:
        return self.run / "supervisord.conf"

    @property
    def supervisor_pidfile(self) -> Path:
        return self.run / "supervisord.pid"

    @property
    def launch_file(self) -> Path:
        return self.run / "worker-launch.json"

    @property
    def status_file(self) -> Path:
        return self.run / "status.json"

    @property
    def persist_file(self) -> Path:
        return self.run / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.run / "daemon.lock"

    @property
    def worker_log(self) -> Path:
        return self.logs / "worker.log"

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisord.log"

    @property
    def daemon_log(self) -> Path:
        return self.logs / "daemon.log"

    @property
    def daemon_out(self) -> Path:
        return self.logs / "daemon.out"

    def ensure(self) -> "Layout":
        for d in (self.state, self.run, self.logs, self.crashes, self.sockets):
            private_dir(d)
        return self


def layout() -> Layout:
    return Layout(state_dir())


def write_private(path: Path, data: bytes | str) -> None:
    """Write a 0600 file atomically (temp file in the same dir, fsync, rename)."""
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: Path, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
