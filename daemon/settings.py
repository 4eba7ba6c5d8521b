"""The daemon's settings: `[daemon]` in ember.toml, `EMBER_DAEMON_*` variables, `ember daemon run` flags.

Precedence: flag, then environment, then file, then the default. Durations and sizes are spelled
as ember.ops.contract parses them (`500ms`, `30s`, `10m`, `1h`; `512MiB`, `4GiB`). The defaults are
the production policy (issue 4); tests shrink the timing knobs through the same keys.

The engine is the ember worker unless `command` names another one (for example llama.cpp's
llama-server), in which case `health_url` (liveness), and optionally `ready_url`,
`completions_url` ("" turns the one-token generation probe off) and `log_file` say how to watch it;
`engine = "llama-server" | "vllm" | "sglang" | "ds4"` fills those in from a profile (daemon/engines.py)
and adds that engine's fatal-line signatures to the log watch.
The worker's own settings stay in `[worker]` (or at the top level): the worker reads them itself;
the daemon only reads `host`, `port` and `api_key` there, to know where to probe and with what key.
"""

from __future__ import annotations

import os
import shlex
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ember.ops import contract


class SettingsError(ValueError):
    """A bad daemon setting (one line). `ember daemon run` exits with ExitCode.CONFIG on it."""


@dataclass
class Settings:
    # the engine
    command: list[str] | None = None  # foreign engine; None = the ember worker
    engine: str = ""  # a named foreign engine's profile (daemon/engines.py: llama-server, vllm, sglang, ds4)
    probe_model: str | None = None  # the model name the generation probe sends (vLLM checks it)
    health_url: str | None = None
    ready_url: str | None = None
    completions_url: str | None = None
    log_file: str | None = None
    also_listens: list[str] = field(default_factory=list)  # "host:port" the engine binds besides its own
    worker_args: list[str] = field(default_factory=list)  # extra flags for the ember worker
    host: str = "127.0.0.1"  # where the worker listens (from [worker] / EMBER_HOST)
    port: int = 8080
    api_key: str | None = None
    drain_seconds: float = 30.0  # the worker's drain time (from [worker] / EMBER_DRAIN_SECONDS)
    # the main loop and the probes
    tick: float = 0.2
    live_interval: float = 5.0
    live_timeout: float = 5.0
    live_failures: int = 3
    unresponsive_seconds: float = 60.0  # liveness silent this long (process alive) = unresponsive: kill
    ready_interval: float = 30.0
    ready_timeout: float = 30.0
    startup_poll: float = 0.25
    startup_timeout: float = 300.0
    hang_seconds: float = 120.0
    dstate_seconds: float = 30.0
    poison_grace: float = 5.0
    kill_grace: float = 1.0
    dump_signal: str = "USR1"  # sent to an ember worker before a hang kill (thread stacks), "" = none
    stop_timeout: float = 0.0  # 0 = drain_seconds + 5
    # the restart policy
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    backoff_reset: float = 600.0
    breaker_crashes: int = 5
    breaker_window: float = 600.0
    breaker_cooldown: float = 600.0  # an open breaker tries once more after this; 0 = until `ember start`
    # the archive and the logs
    crash_keep: int = 50
    crash_max_bytes: int = 256 << 20
    events_seconds: float = 300.0
    window_context: int = 20
    health_records: int = 100
    log_max_bytes: int = 50 << 20
    log_backups: int = 5
    ring_lines: int = 50000
    # replicas (daemon/fleet.py): N workers behind sglang-router, or one per GPU ("all" | "0,1")
    replicas: int = 1
    gpus: str = ""
    router_policy: str = "cache_aware"  # sglang-router's --policy
    # how `ember start` runs the daemon: auto (systemd unit if installed), none
    service: str = "auto"
    config_path: str | None = None  # the file these came from (informational)

    @property
    def foreign(self) -> bool:
        return self.command is not None

    @property
    def fleet(self) -> bool:
        """Whether this daemon runs replicas behind a router (a member daemon never does: load())."""
        return self.replicas > 1 or bool(self.gpus)

    @property
    def engine_label(self) -> str:
        """What runs: "ember", a profile's name, or "command" (a foreign engine without a profile)."""
        return "ember" if not self.foreign else (self.engine or "command")

    @property
    def signatures(self) -> tuple:
        """The engine profile's fatal-line signatures (none for ember and for a bare command)."""
        from .engines import profile

        return profile(self.engine).signatures if self.engine else ()

    @property
    def probe_host(self) -> str:
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    def _base(self) -> str:
        h = self.probe_host
        return f"http://[{h}]:{self.port}" if ":" in h else f"http://{h}:{self.port}"

    @property
    def endpoint(self) -> str:
        return self._base()

    @property
    def listen_addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) the engine binds: where it serves, then `also_listens` (a foreign engine's
        metrics port, say); each must be free before a start (lifecycle's port check)."""
        if self.foreign:
            u = urlsplit(self.live_url)
            own = (u.hostname or "127.0.0.1", u.port or 80)
        else:
            own = (self.host, self.port)
        return [own, *(_address(a) for a in self.also_listens)]

    @property
    def live_url(self) -> str:
        if self.foreign:
            return self.health_url or ""
        return self._base() + contract.LIVE_PATH

    @property
    def readiness_url(self) -> str:
        if self.foreign:
            return self.ready_url or self.health_url or ""
        return self._base() + contract.READY_PATH

    @property
    def generation_url(self) -> str:
        if self.completions_url is not None:
            return self.completions_url
        if self.foreign:
            u = urlsplit(self.health_url or "")
            return f"{u.scheme}://{u.netloc}/v1/completions" if u.netloc else ""
        return self._base() + "/v1/completions"

    @property
    def effective_stop_timeout(self) -> float:
        return self.stop_timeout or (self.drain_seconds + 5.0)

    def redacted(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out.get("api_key"):
            out["api_key"] = "***"
        if out.get("command"):
            out["command"] = redact_argv(out["command"])
        out["worker_args"] = redact_argv(out["worker_args"])
        return out


_SECRET_FLAGS = ("--api-key", "--api_key", "--key", "--token", "--hf-token", "--password")


def redact_argv(argv: list[str]) -> list[str]:
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
            continue
        flag, eq, _ = a.partition("=")
        if flag.lower() in _SECRET_FLAGS:
            if eq:
                out.append(flag + "=***")
            else:
                out.append(a)
                hide = True
            continue
        out.append(a)
    return out


_SIZES = {"crash_max_bytes", "log_max_bytes"}


def parse_duration(v: Any, name: str) -> float:
    return contract.parse_duration(v, name, SettingsError)


def parse_size(v: Any, name: str) -> int:
    return contract.parse_size(v, name, SettingsError)


def _convert(name: str, kind: Any, value: Any) -> Any:
    t = str(kind)
    try:
        if name in _SIZES:
            return parse_size(value, name)
        if t == "float":
            return parse_duration(value, name)
        if t == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if t.startswith("list"):
            if isinstance(value, str):
                value = shlex.split(value)
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ValueError
            return list(value)
        if value is None:
            return None
        return str(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name}: {value!r} is not valid") from None


def load(flags: dict[str, Any] | None = None, env: Mapping[str, str] | None = None,
         path: str | os.PathLike[str] | None = None) -> Settings:
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    cfg_path = Path(path) if path else contract.config_file(env)
    data: dict[str, Any] = {}
    if cfg_path.exists():
        try:
            data = tomllib.loads(cfg_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise SettingsError(f"config file {cfg_path}: {e}") from None
    elif path or env.get(contract.ENV_CONFIG):
        raise SettingsError(f"config file {cfg_path} does not exist")
    known = {f.name: f.type for f in fields(Settings)}
    # the worker's keys are the worker's to check (it refuses an unknown one with exit 78 too)
    worker_sec, daemon_sec = contract.config_sections(data, cfg_path, daemon_keys=set(known) - {"config_path"},
                                                      error=SettingsError)
    raw: dict[str, Any] = {}
    for key in ("host", "port", "api_key", "drain_seconds"):  # the worker's, read for probing
        if key in worker_sec:
            raw[key] = worker_sec[key]
        var = "EMBER_" + key.upper()
        if env.get(var):
            raw[key] = env[var]
    raw.update(daemon_sec)
    for key in known:
        var = "EMBER_DAEMON_" + key.upper()
        if env.get(var):
            raw[key] = env[var]
    raw.update(flags)
    s = Settings(config_path=str(cfg_path) if cfg_path.exists() else None)
    for key, value in raw.items():
        setattr(s, key, _convert(key, known[key], value))
    if env.get("EMBER_REPLICA"):  # a member of a fleet (daemon/fleet.py) runs one worker or the router
        s.replicas, s.gpus = 1, ""
    validate(s)
    return s


def _address(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); SettingsError when it is neither."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"also_listens: {text!r} is not host:port")
    return host, int(port)


def validate(s: Settings) -> None:
    """Raise SettingsError for the first setting that is wrong: the port, the engine, the timings, the fleet."""
    if not 0 < s.port < 65536:
        raise SettingsError(f"port: {s.port} is not a TCP port")
    for a in s.also_listens:
        _address(a)
    _check_engine(s)
    _check_timings(s)
    _check_choices(s)


def _check_engine(s: Settings) -> None:
    """A named engine profile (applied here) or a foreign engine's command, with what each needs."""
    if s.engine:
        from .engines import PROFILES

        if s.engine not in PROFILES:
            raise SettingsError(f"engine: {s.engine!r} is not a known profile (known: {', '.join(PROFILES)})")
        if s.command is None:
            raise SettingsError(f"engine: {s.engine} needs command (how to start it)")
        _apply_profile(s)
    if s.command is not None:
        if not s.command:
            raise SettingsError("command: empty")
        if not s.health_url:
            raise SettingsError("command: a foreign engine needs health_url (its liveness URL), or engine = a profile")


def _check_timings(s: Settings) -> None:
    for name in ("tick", "live_interval", "live_timeout", "ready_interval", "ready_timeout", "startup_poll",
                 "startup_timeout", "backoff_base", "backoff_max"):
        if getattr(s, name) <= 0:
            raise SettingsError(f"{name}: must be positive")
    if s.backoff_max < s.backoff_base:
        raise SettingsError("backoff_max: must not be below backoff_base")
    if s.live_failures < 1 or s.breaker_crashes < 1:
        raise SettingsError("live_failures and breaker_crashes: at least 1")
    for name in ("unresponsive_seconds", "breaker_cooldown", "breaker_window", "backoff_reset", "hang_seconds",
                 "dstate_seconds", "poison_grace", "kill_grace", "stop_timeout"):
        if getattr(s, name) < 0:
            raise SettingsError(f"{name}: must not be negative")


def _check_choices(s: Settings) -> None:
    if not 1 <= s.replicas <= 64:
        raise SettingsError(f"replicas: {s.replicas} (1 to 64)")
    if s.fleet and s.command is not None:
        raise SettingsError("replicas and gpus run ember workers; a foreign engine (command) runs alone")
    if s.router_policy not in ("cache_aware", "round_robin", "random", "power_of_two"):
        raise SettingsError(f"router_policy: {s.router_policy!r} (cache_aware, round_robin, random, power_of_two)")
    if s.service not in ("auto", "none", "systemd"):
        raise SettingsError(f"service: {s.service!r} (auto, none or systemd)")
    if s.dump_signal and s.dump_signal.upper().removeprefix("SIG") not in ("USR1", "USR2", "QUIT", "ABRT"):
        raise SettingsError(f"dump_signal: {s.dump_signal!r} (USR1, USR2, QUIT, ABRT or empty)")


def _apply_profile(s: Settings) -> None:
    """A named engine's URLs where [daemon] does not set them (on host and port, as for the worker)."""
    from .engines import profile

    p = profile(s.engine)
    base = s.endpoint
    s.health_url = s.health_url or base + p.health_path
    s.ready_url = s.ready_url or base + p.ready_path
    if s.completions_url is None:
        s.completions_url = "" if not p.completions_path or (p.needs_model and not s.probe_model) \
            else base + p.completions_path


def worker_command(s: Settings) -> list[str]:
    """The argv supervisord runs."""
    if s.command is not None:
        return list(s.command)
    argv = [sys.executable, "-m", "ember.worker", "worker", "--host", s.host, "--port", str(s.port)]
    if s.config_path:
        argv += ["--config", s.config_path]
    return argv + list(s.worker_args)
