"""The contract every part of ember shares, written once: exit codes, health states, the CUDA errors
that poison a compute context, log events and the fields they carry, where state, cache and
configuration live, and how settings spell sizes and durations.

The worker, the kernels' CLI, the daemon and ops all import this module, and it imports nothing of
ember (docs/architecture.md, "Import rules"): a value changed here changes on every side at once,
and tests/test_contract.py fails when another module spells one of these values itself. What the
daemon makes of them (patience, crash classes, restart policy) is not here: see daemon/verdicts.py,
daemon/incident.py and daemon/policy.py. A foreign engine (llama.cpp's llama-server, say) speaks
only part of this contract; the daemon also reads raw CUDA error strings (daemon/detect.py).
"""

from __future__ import annotations

import difflib
import enum
import json
import os
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# == exit codes ========================================================================================


class ExitCode(enum.IntEnum):
    """How an ember process ends. A worker exit not listed here, or a death by signal, is a crash."""

    OK = 0  # a clean stop
    FAILURE = 1  # a command that did not do what it was asked
    USAGE = 2  # bad arguments (argparse's own code)
    NOT_RUNNING = 3  # `ember status` with no daemon running (LSB's "program is not running")
    NOT_INSTALLED = 3  # `ember service status` with no autostart installed (the same number)
    PORT_BUSY = 69  # the worker's port is held by another process: retried with backoff (EX_UNAVAILABLE)
    POISONED = 75  # the worker's compute context is poisoned: restart it now (sysexits' EX_TEMPFAIL)
    CONFIG = 78  # a configuration error: restarting cannot help, so nothing restarts it (EX_CONFIG)
    INTERRUPTED = 130  # Ctrl-C at a terminal (128 + SIGINT)


# == health: GET /health/live and /health/ready answer JSON with a `state` field =====================

LIVE_PATH = "/health/live"  # process and event loop fine, compute context not poisoned
READY_PATH = "/health/ready"  # model loaded, can take a request now
PROBE_HEADER = "X-Ember-Probe"  # "1" marks the daemon's own probe request: kept out of session events


class HealthState(enum.StrEnum):
    LOADING = "loading"  # the model is not loaded yet
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: in-flight work finishes, nothing new is admitted
    POISONED = "poisoned"  # the compute context is gone; the process exits with ExitCode.POISONED


# == CUDA's sticky errors: after one, the compute context is poisoned ====================================
#
# CUresult codes after which a CUDA context is unusable: every later call in the process fails the same
# way, and only a new process recovers. The driver API documents each as such, but for two ember counts
# in because no work can follow them in its own process: ECC_UNCORRECTABLE and CONTEXT_IS_DESTROYED
# (ember never destroys its context while it serves). The worker turns one into `engine_poisoned` and
# exit 75 (kernels/errors.py); the daemon also finds them in a foreign engine's raw log, by code and
# name (daemon/detect.py), all but those in RAW_LOG_EXEMPT.

STICKY_CUDA_ERRORS: dict[int, str] = {
    214: "CUDA_ERROR_ECC_UNCORRECTABLE",
    226: "CUDA_ERROR_CONTAINED",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    710: "CUDA_ERROR_ASSERT",
    714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
    715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    716: "CUDA_ERROR_MISALIGNED_ADDRESS",
    717: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    718: "CUDA_ERROR_INVALID_PC",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    721: "CUDA_ERROR_TENSOR_MEMORY_LEAK",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    911: "CUDA_ERROR_EXTERNAL_DEVICE",
}
# Sticky in the worker's own calls, yet no sign of a poisoned context in another engine's raw log: the
# driver documents CONTEXT_IS_DESTROYED as a context its caller destroyed itself or has not initialized
# yet (how it used the API, as in its own teardown), not as a fault of the device.
RAW_LOG_EXEMPT: frozenset[int] = frozenset({709})


# == the log: one JSON object per line on stderr =======================================================

LOG_KEYS = ("ts", "level", "event")  # every line has these; the event's own fields follow
ERROR_LEVELS = ("error", "critical", "fatal")


class Event(enum.StrEnum):
    """The worker's log events another process reads (the daemon, crash bundles, ops)."""

    CONFIG = "config"  # the first line of every incarnation: version, pid, effective config
    CONFIG_ERROR = "config_error"  # a bad setting; the worker exits with ExitCode.CONFIG next
    LAUNCH_ERROR = "launch_error"  # the daemon's launcher could not run the engine (also ExitCode.CONFIG)
    READY = "ready"  # the model is loaded and the worker serves
    LOAD_FAILED = "load_failed"  # loading or starting failed unforeseen (a bug, the device): ExitCode.FAILURE next
    HEALTH_STATE = "health_state"  # the worker's HealthState changed (`state`, and the `previous` one)
    ADMIT = "admit"  # a request got a slot
    COMPLETED = "completed"  # a request's one outcome is one of these four
    FAILED = "failed"
    CANCELED = "canceled"
    REFUSED = "refused"
    PREEMPT = "preempt"  # a running request gave its KV blocks back and waits again
    ENGINE_POISONED = "engine_poisoned"  # a sticky CUDA error: the context is unusable from here on
    THREAD_DIED = "thread_died"  # a guarded worker thread died (also the `error.name` /health/live reports)
    PORT_BUSY = "port_busy"  # the worker could not bind its port (held by another process); exit PORT_BUSY next
    KV_PERSISTENCE = "kv_persistence"  # the KV store's writes to disk changed state (PersistState below)


OUTCOMES = (Event.COMPLETED, Event.FAILED, Event.CANCELED, Event.REFUSED)

# The fields each event must carry besides LOG_KEYS (more may follow). Prompt text is never one.
REQUIRED_FIELDS: dict[Event, tuple[str, ...]] = {
    Event.CONFIG: ("version", "pid", "config"),
    Event.CONFIG_ERROR: ("error",),
    Event.LAUNCH_ERROR: ("error",),
    Event.LOAD_FAILED: ("error", "where"),
    Event.READY: ("model", "fingerprint", "backend"),
    Event.HEALTH_STATE: ("state", "previous"),
    Event.ADMIT: ("request_id", "seq", "cached_tokens", "new_tokens"),
    Event.COMPLETED: ("request_id",),
    Event.FAILED: ("request_id",),
    Event.CANCELED: ("request_id",),
    Event.REFUSED: ("request_id",),
    Event.PREEMPT: ("request_id", "seq"),
    Event.ENGINE_POISONED: ("code", "name", "message"),
    Event.THREAD_DIED: ("thread", "error"),
    Event.PORT_BUSY: ("host", "port", "error"),
    Event.KV_PERSISTENCE: ("state", "reason", "since", "not_persisted"),
}


class MissCause(enum.StrEnum):
    """Why an admitted prompt got less from the prefix cache than it could have: the `admit` line's
    `miss_cause` (worker/engine/misses.py decides it; `ember cache report` sums the tokens it cost)."""

    EVICTED = "evicted"  # cached once and evicted; `evicted_from` names the tier that last held it
    NEVER_PERSISTED = "never_persisted"  # offered to the KV store and dropped before it reached the disk
    RESTORE_DECLINED = "restore_declined"  # the store held it; computing it again was measured faster
    UNREADABLE = "unreadable"  # its block file failed a check (quarantined)
    CHANGED_TEXT = "changed_text"  # the prompt's text differs there from the conversation's previous turn
    TOKENIZATION = "tokenization"  # the same text, other tokens (the previous answer tokenized afresh)
    UNKNOWN = "unknown"  # a recent sequence had the block; what became of it is not known


# The admit line's fields when its prompt missed what the cache could have given it (absent otherwise):
# the cause, the first token the cache could have supplied and did not, the tokens it could have
# supplied, the tier an evicted block left last, that token's offset in the rendered prompt
# (characters) and, for chat-shaped requests, the message it falls in ({index, role}). Never text.
ADMIT_MISS_FIELDS = ("miss_cause", "diverged_at", "could_have_cached", "evicted_from", "diverged_char",
                     "diverged_message")
ADMIT_CLIENT_FIELD = "user_agent"  # the admit line's client, as its User-Agent header named it (when it did)


class PersistState(enum.StrEnum):
    """Whether the worker's KV blocks reach the disk (the `kv_persistence` event, the health bodies,
    /v1/stats, /metrics, `ember status`). A degraded store keeps serving and retries with backoff."""

    PERSISTING = "persisting"
    DEGRADED = "degraded"  # writes fail (the disk is full, the directory is gone...): nothing new persists
    OFF = "off"  # --kv-persist off, or the writer thread died


def iso_utc(t: float | None = None) -> str:
    """A wall-clock time (now by default) as every log line and record writes it: UTC, milliseconds."""
    when = datetime.now(UTC) if t is None else datetime.fromtimestamp(t, UTC)
    return when.isoformat(timespec="milliseconds")


def log_line(event: str, level: str = "info", **fields: Any) -> str:
    """One log record as its JSON line (without the newline): `ts`, `level`, `event`, then the fields."""
    record: dict[str, Any] = {"ts": iso_utc(), "level": level, "event": event}
    record.update(fields)
    return json.dumps(record, default=str, ensure_ascii=False)


def parse_log_line(text: str) -> dict[str, Any] | None:
    """The record a log line holds, or None for a line that is not one (a raw engine or library line)."""
    t = text.strip()
    if not t.startswith("{"):
        return None
    try:
        obj = json.loads(t)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "event" in obj else None


def missing_fields(record: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys a record lacks: LOG_KEYS, plus its event's REQUIRED_FIELDS when it is a contract event."""
    try:
        required = REQUIRED_FIELDS[Event(str(record.get("event")))]
    except (ValueError, KeyError):  # not a contract event: only the common keys are required
        required = ()
    return tuple(k for k in (*LOG_KEYS, *required) if k not in record)


# == where things live ==================================================================================
#
#   state   $EMBER_STATE_DIR, else /var/lib/ember (a system run), else $XDG_DATA_HOME/ember or
#           ~/.local/share/ember: KV files, logs, crash bundles, sockets (daemon/paths.py lays it out)
#   cache   $EMBER_CACHE_DIR, else /var/lib/ember/.cache/ember (a system run: the system unit's HOME is
#           the state dir, its one writable tree), else $XDG_CACHE_HOME/ember or ~/.cache/ember
#   config  $EMBER_CONFIG, else /etc/ember/ember.toml (a system run), else
#           $XDG_CONFIG_HOME/ember/ember.toml or ~/.config/ember/ember.toml
#
# A system run is root with EMBER_SYSTEM=1, or `ember service install --system` (system=True). The
# installed units and the installer pass EMBER_STATE_DIR and EMBER_CONFIG explicitly; the rules here
# are what every process finds without them, the same for the daemon, the worker it starts and ops.

APP = "ember"
CONFIG_NAME = "ember.toml"
SYSTEM_STATE_DIR = Path("/var/lib") / APP
SYSTEM_CONFIG_DIR = Path("/etc") / APP
ENV_STATE_DIR = "EMBER_STATE_DIR"
ENV_CACHE_DIR = "EMBER_CACHE_DIR"
ENV_CONFIG = "EMBER_CONFIG"
ENV_SYSTEM = "EMBER_SYSTEM"

# XDG base directories: (variable, default under $HOME)
_XDG = {"data": ("XDG_DATA_HOME", ".local/share"), "cache": ("XDG_CACHE_HOME", ".cache"),
        "config": ("XDG_CONFIG_HOME", ".config")}


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def xdg_home(kind: str, env: Mapping[str, str] | None = None) -> Path:
    """The user's XDG base directory of `kind` (data, cache or config), e.g. ~/.config."""
    var, default = _XDG[kind]
    return Path(_env(env).get(var) or os.path.expanduser("~/" + default))


def xdg_environment(home: Path) -> dict[str, str]:
    """The XDG base directory variables (data, cache, config) at their defaults under `home`: the environment
    of a child program given a home of its own (the agent CLIs `ember bench agents` drives)."""
    return {var: str(home / default) for var, default in _XDG.values()}


def is_system(env: Mapping[str, str] | None = None) -> bool:
    """A system run: root, told so by EMBER_SYSTEM=1."""
    return os.geteuid() == 0 and _env(env).get(ENV_SYSTEM) == "1"


def _place(env: Mapping[str, str] | None, system: bool | None, variable: str, system_path: Path,
           xdg: str, *under: str) -> Path:
    """$variable, else system_path for a system run, else the user's XDG dir of kind `xdg`, joined with `under`."""
    e = _env(env)
    if e.get(variable):
        return Path(e[variable]).expanduser()
    if is_system(e) if system is None else system:
        return system_path
    return xdg_home(xdg, e).joinpath(*under)


def state_dir(env: Mapping[str, str] | None = None, *, system: bool | None = None) -> Path:
    return _place(env, system, ENV_STATE_DIR, SYSTEM_STATE_DIR, "data", APP)


def cache_dir(env: Mapping[str, str] | None = None, *, system: bool | None = None) -> Path:
    return _place(env, system, ENV_CACHE_DIR, SYSTEM_STATE_DIR / ".cache" / APP, "cache", APP)


def config_file(env: Mapping[str, str] | None = None, *, system: bool | None = None) -> Path:
    return _place(env, system, ENV_CONFIG, SYSTEM_CONFIG_DIR / CONFIG_NAME, "config", APP, CONFIG_NAME)


def worker_log(state: Path | None = None) -> Path:
    """The worker's log where the daemon keeps it: <state>/logs/worker.log, rotated by supervisord to
    worker.log.1 (the newest) ... worker.log.N beside it."""
    return (state or state_dir()) / "logs" / "worker.log"


# ember.toml: the worker's keys at the top level or under [worker] (one or the other for each key), the
# daemon's under [daemon]; nothing else. A key no side knows is refused (exit 78) with the nearest known
# one, so a misspelled setting (`prot`, `api-key`, `[daemn]`) never passes silently.
SECTIONS = ("worker", "daemon")


def did_you_mean(word: str, known: Iterable[str], fmt: str = "{}") -> str:
    """" (did you mean X?)" for the known spelling nearest to `word`, or "" when none is near."""
    close = difflib.get_close_matches(word.lower(), list(known), n=1, cutoff=0.6)
    return f" (did you mean {fmt.format(close[0])}?)" if close else ""


def config_sections(data: Mapping[str, Any], path: str | os.PathLike[str], *,
                    worker_keys: Iterable[str] | None = None, daemon_keys: Iterable[str] | None = None,
                    error: type[ValueError] = ValueError) -> tuple[dict[str, Any], dict[str, Any]]:
    """(worker keys, [daemon] keys) of a parsed ember.toml. A table that is no section, a section that
    is not a table, a key set both at the top level and in [worker], or a key not among a side's known
    keys (each side passes its own: the daemon cannot know the worker's) raises `error` (the caller's
    kind of configuration error) with a one-line message naming it and the nearest known spelling."""
    worker: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise error(f"config file {path}: {key} must be a section ([{key}]), not a value")
            continue
        if isinstance(value, dict):
            raise error(f"config file {path}: [{key}]: unknown section{did_you_mean(key, SECTIONS, '[{}]')}; "
                        f"ember.toml has {' and '.join(f'[{s}]' for s in SECTIONS)}")
        worker[key] = value
    for key, value in data.get("worker", {}).items():
        if key in worker:
            raise error(f"config file {path}: {key} is set both at the top level and in [worker]; keep one")
        worker[key] = value
    daemon = dict(data.get("daemon", {}))
    for section, keys, known in (("worker", worker, worker_keys), ("daemon", daemon, daemon_keys)):
        if known is None:
            continue
        known = set(known)
        for key in keys:
            if key not in known:
                where = f"[{section}] " if section == "daemon" or key in data.get("worker", {}) else ""
                raise error(f"config file {path}: {where}{key}: unknown setting"
                            f"{did_you_mean(key.replace('-', '_'), known)}")
    return worker, daemon


def private_dir(path: Path) -> Path:
    """Make `path` a 0700 directory (state and logs describe the user's sessions). The mode is set
    through a descriptor opened without following a link: a symlink in its place (a kv dir on another
    disk, or one planted by the user that owns the state dir while root runs the CLI) is used as it
    is and its target's mode never changed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # a symlink (ELOOP), or not ours to open
        return path
    try:
        if (os.fstat(fd).st_mode & 0o777) != 0o700:
            os.fchmod(fd, 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)
    return path


# == sizes and durations, as settings write them ========================================================

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_size(value: str | int, name: str = "size", error: type[ValueError] = ValueError) -> int:
    """Bytes from `512MiB`, `4GiB`, `1.5GB`, `64k` or a plain number. A bad value raises `error` (the
    caller's own kind of configuration error) with a one-line message that names the setting."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise error(f"{name}: {value!r} is not a size (examples: 512MiB, 4GiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


def parse_duration(value: str | float, name: str = "duration", error: type[ValueError] = ValueError) -> float:
    """Seconds from `500ms`, `30s`, `10m`, `1h` or a plain number; a bad value raises `error`, as above."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise error(f"{name}: {value!r} is not a duration (examples: 500ms, 30s, 10m)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
