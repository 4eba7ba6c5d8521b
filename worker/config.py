"""The worker's one typed configuration.

Every setting has a CLI flag (`--max-seqs`), an environment variable (`EMBER_MAX_SEQS`) and a
config-file key (`max_seqs`), with the same name. Precedence: flag, then environment, then file,
then the default. `sources()` says where each effective value came from. A key or section of the
file that nothing reads is refused (ConfigError, exit 78) with the nearest known spelling.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from ember.ops import contract


class ConfigError(ValueError):
    """A bad setting; str() is one line naming it. The worker exits with code 78."""


class EngineSettings(msgspec.Struct, kw_only=True):
    """The settings the engine takes as they are configured, declared once: WorkerConfig has them as
    settings (flag, environment, file) and the engine's EngineLimits as limits (engine/limits.py)."""

    # The loop guard ends a generation whose tail is one block of tokens repeated back to back.
    # On by default, and conservative: a 270M model (or a large one at temperature 0) that falls
    # into a loop otherwise burns the whole output cap, often the rest of the context, on a
    # 2-core box that is minutes of a slot. It fires only on exact token-level repetition of at
    # least `loop_guard_repeats` copies spanning at least `loop_guard_min_span` tokens, so a
    # short run ("----", four spaces, a repeated word) never trips it, and it ends with finish
    # reason `length`, which clients already treat as "truncated".
    loop_guard: bool = True
    loop_guard_repeats: int = 8
    loop_guard_min_span: int = 128
    # Speculative decoding (worker/engine/spec/speculation.py): drafts from text the sequence or its session
    # already has, checked by the model in one step; never changes the output (greedy: token for token).
    spec: str = "off"
    spec_k: int = 8
    spec_max_batch: int = 8
    spec_max_context: int = 32768


class WorkerConfig(EngineSettings, kw_only=True):
    model: str | None = None  # GGUF path; none = the embedded Gemma 3 270M
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_seqs: int = 8
    max_queue: int = 64
    ctx: int = 0  # 0 = the model's context length, capped by the KV budget
    kv_mem: str = "auto"
    kv_dir: str | None = None  # default: <state dir>/kv
    kv_disk_budget: str = "auto"  # bytes, or auto = a quarter of the free space, at most 50GiB
    kv_host_mem: str = "512MiB"
    kv_persist: str = "all"
    prefill_chunk: int = 0  # 0 = auto: sized at every step to itl_target_ms, at most AUTO_PREFILL_CHUNK
    itl_target_ms: float = 50.0  # what decoding streams wait at most for a step (0: off, chunks at the ceiling)
    drain_seconds: float = 30.0
    stall_seconds: float = 60.0
    backend: str = "numpy"
    # cuda: a 16-bit copy of the weight matrices for the tensor-core matmuls (prefill, decode batches of
    # 16+), decoded once at start instead of at every such step. auto: kept where it leaves an automatic
    # KV pool (kv_mem auto) at least half of what is free after the weights, or, with a sized kv_mem,
    # a tenth of the device free; never on unified memory (backends/cuda/memory.keep_half_copy).
    f16_weights: str = "auto"
    # cuda: bytes of the GPU this worker counts as the device's; auto: all of it
    gpu_mem: str = "auto"
    # cuda: launch each decode step before reading the previous step's tokens (fed on the device), so
    # the host's per-step work overlaps the GPU's instead of adding to it
    run_ahead: bool = True
    fault: str | None = None
    log_prompts: bool = False
    # Where a thinking model's reasoning starts and ends: "auto" (from the chat template and the
    # vocabulary), "none" (never split reasoning off), a known marker name, or "START,END".
    reasoning_format: str = "auto"
    # -- request bounds: each caps something a client controls that costs memory or time per token ---
    max_output_tokens: int = 0  # every request's output, whatever the client asks; 0 = the context's room
    max_body: str = "auto"  # request body bytes; auto = what the context can use (see api/limits.py)
    max_stop: int = 16  # stop / stop_sequences strings a request may name...
    max_stop_chars: int = 512  # ...and the characters of each
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 256  # tool definitions a request may carry...
    max_tool_schema_bytes: int = 64 * 1024  # ...and the JSON bytes of each one's definition
    max_top_k: int = 1024
    max_json_depth: int = 64  # nesting of the request body's JSON
    # -- who may call: a page in the user's browser must not drive a local API --------------------------
    allowed_origins: str = ""  # comma-separated Origins allowed cross-site besides loopback pages; * = any
    metrics_auth: bool = False  # /metrics and /v1/stats want the API key too
    # -- slow clients: how long a request may take to arrive (readguard.py) -------------------------------
    read_header_seconds: float = 20.0  # the request line and headers, from the first byte (or the connection)
    read_body_seconds: float = 20.0  # the body, plus one second for every read_body_min_rate bytes received
    read_body_min_rate: int = 500
    max_slow_connections: int = 128  # connections mid-request at once; past it the longest at it is closed


HELP = {
    "model": "GGUF model file (default: the embedded Gemma 3 270M)",
    "host": "address to bind (default 127.0.0.1; use 0.0.0.0 to serve the LAN)",
    "port": "TCP port (default 8080)",
    "api_key": "require this key (Authorization: Bearer, or x-api-key)",
    "max_seqs": "sequences decoded together (default 8)",
    "max_queue": "requests that may wait for a slot before 429 (default 64)",
    "ctx": "context limit in tokens (default: the model's, within the KV budget)",
    "kv_mem": "KV cache budget on the compute device, e.g. 512MiB, 4GiB, or auto (the default: on cuda what is "
              "free after the weights and buffers, minus a margin; on numpy 1GiB)",
    "prefill_chunk": "prompt tokens per engine step and sequence (default auto: sized at every step to "
                     "--itl-target-ms at the depth it runs at, at most 2048 on cuda; 256 on numpy)",
    "itl_target_ms": "auto prefill chunks: what a step may take while streams decode, that is their inter-token "
                     "latency under others' prefills; 0 = off (default 50)",
    "kv_dir": "where KV blocks persist across restarts (default: <state dir>/kv)",
    "kv_disk_budget": "disk bytes for everything in the KV dir (every model, layout and worker sharing it, and "
                      "quarantine), e.g. 20GiB (default auto: 1/4 of free space, at most 50GiB)",
    "kv_host_mem": "host RAM tier for KV blocks (default 512MiB)",
    "kv_persist": "all (each full block as soon as complete), finished (when a request ends) or off",
    "drain_seconds": "on SIGTERM, how long in-flight requests may finish (default 30)",
    "stall_seconds": "an engine loop with work and no progress this long fails /health/live (default 60)",
    "backend": "compute backend: numpy (default) or cuda",
    "f16_weights": "cuda: keep a 16-bit copy of the weights for prefill and large batches: "
                   "auto (default: when it fits), on, off",
    "gpu_mem": "cuda: GPU memory this worker may count as the device's, e.g. 24GiB to share a card or to plan for "
               "a smaller one: the weights' fit, the 16-bit copy and an automatic KV pool are decided within it "
               "(default auto: the whole device)",
    "run_ahead": "cuda: launch each decode step before the previous step's tokens are read (default on)",
    "fault": "fault injection for tests, e.g. poison:step=5 (loopback only)",
    "log_prompts": "include prompt text in logs (default: never)",
    "loop_guard": "end a generation that repeats the same block of tokens (finish reason length; default on)",
    "loop_guard_repeats": "back-to-back copies of a block (1-64 tokens) that count as a loop (default 8)",
    "loop_guard_min_span": "and the copies must span at least this many tokens (default 128)",
    "spec": "speculative decoding: off (default), ngram (prompt lookup), suffix (longest match in the sequence "
            "and recent outputs, adaptive length), draft:PATH (a small GGUF with the model's vocabulary), mtp "
            "(the model's own next-token layer, where the GGUF has one: DeepSeek V4's nextn) or mtp:PATH (that "
            "layer from its own GGUF, as llama.cpp's converter writes it with --mtp), dspark:PATH (DeepSeek V4's "
            "DSpark block drafter, llama.cpp's draft-dspark; numpy backend); replay:P is a benchmark's "
            "(what this worker generated before after the same tokens, each token kept with probability P)",
    "spec_k": "the longest draft, in tokens (default 8)",
    "spec_max_batch": "no drafts when more sequences than this decode together (default 8)",
    "spec_max_context": "no drafts past this many tokens of context (default 32768)",
    "reasoning_format": "reasoning markers: auto (default, from the template), none, a marker name, or START,END",
    "max_output_tokens": "cap every request's output at N tokens, whatever the client asks (default 0: no cap "
                         "beyond the context)",
    "max_body": "largest request body, e.g. 16MiB (default auto: what the context can hold)",
    "max_stop": "stop strings a request may name (default 16)",
    "max_stop_chars": "characters of each stop string (default 512)",
    "max_logit_bias": "logit_bias entries a request may carry (default 1024)",
    "max_tools": "tool definitions a request may carry (default 256)",
    "max_tool_schema_bytes": "JSON bytes of each tool definition (default 65536)",
    "max_top_k": "largest top_k a request may ask for (default 1024)",
    "max_json_depth": "deepest nesting of a request body's JSON (default 64)",
    "allowed_origins": "browser Origins allowed to call the API besides loopback pages, comma-separated; * = any "
                       "(default: none)",
    "metrics_auth": "require the API key for /metrics and /v1/stats too (default off)",
    "read_header_seconds": "a request's line and headers must arrive within this many seconds, or 408 and the "
                           "connection is closed (default 20)",
    "read_body_seconds": "and its body within this many seconds plus one per --read-body-min-rate bytes received "
                         "(default 20)",
    "read_body_min_rate": "bytes per second of a body that earn it another second (default 500)",
    "max_slow_connections": "connections still sending a request at once; past it the one at it longest is closed "
                            "(default 128)",
}

_SECRET = {"api_key"}


NUMPY_AUTO_KV_MEM = "1GiB"  # --kv-mem auto on the numpy backend (the CUDA backend sizes its own pool)


def parse_size(text: str | int, name: str = "size") -> int:
    """Bytes, as the contract spells sizes (512MiB, 4GiB, 1000000)."""
    return contract.parse_size(text, name, ConfigError)


def _fields() -> list[tuple[str, Any, Any]]:
    info = msgspec.inspect.type_info(WorkerConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    return [(f.name, f.type, f.default) for f in info.fields]


# Further flags for a setting (the issue that asked for the ITL target called it --itl-target)
ALIASES = {"itl_target_ms": ("--itl-target",)}

# Settings that were replaced: a config file or environment that still sets one is refused, naming what
# took its place (an unknown key would only be told the nearest spelling).
RETIRED = {"prefill_step_ms": "itl_target_ms: what a step may take while streams decode, now held at the depth "
                              "each step runs at (default 50)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (or EMBER_CONFIG)")
    for name, _, default in _fields():
        flags = ("--" + name.replace("_", "-"), *ALIASES.get(name, ()))
        if isinstance(default, bool):
            p.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=HELP[name])
        else:
            p.add_argument(*flags, dest=name, default=None, metavar=name.upper(), help=HELP[name])


def _refuse_retired(keys: Iterable[str], where: str, prefix: str = "") -> None:
    for key in keys:
        if key in RETIRED:
            raise ConfigError(f"{where}{prefix}{key.upper() if prefix else key} was replaced by {RETIRED[key]}")


def load(args: argparse.Namespace | None = None,
         env: Mapping[str, str] | None = None) -> tuple[WorkerConfig, dict[str, str]]:
    """The effective config and, per setting, where it came from (default, file, env, flag)."""
    environ = os.environ if env is None else env
    raw: dict[str, Any] = {}
    source: dict[str, str] = {name: "default" for name, _, _ in _fields()}
    path = (getattr(args, "config", None) if args else None) or environ.get(contract.ENV_CONFIG)
    if path:
        try:
            data = tomllib.loads(Path(path).expanduser().read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"config file {path}: {e}") from None
        worker_section = data.get("worker")
        _refuse_retired([*data, *(worker_section if isinstance(worker_section, dict) else ())], f"config file {path}: ")
        # keys at the top level or under [worker]; an unknown key or section is refused, never skipped
        section, _ = contract.config_sections(data, path, worker_keys=[n for n, _, _ in _fields()],
                                              error=ConfigError)
        for key, value in section.items():
            raw[key], source[key] = value, f"file {path}"
    _refuse_retired([v[6:].lower() for v in environ if v.startswith("EMBER_") and environ[v] != ""], "environment: ",
                    prefix="EMBER_")
    for name, _, _ in _fields():
        var = "EMBER_" + name.upper()
        if var in environ and environ[var] != "":
            raw[name], source[name] = environ[var], f"env {var}"
        value = getattr(args, name, None) if args else None
        if value is not None:
            raw[name], source[name] = value, "flag --" + name.replace("_", "-")
    try:
        cfg = msgspec.convert(raw, WorkerConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"bad setting: {e}") from None
    validate(cfg)
    return cfg, source


def validate(cfg: WorkerConfig) -> None:
    """Raise ConfigError for the first setting that fails its check (in _CHECKS' order)."""
    for check in _CHECKS:
        problem = check(cfg)
        if problem is not None:
            raise ConfigError(problem)


# A check: the config -> the one-line problem with a setting, or None.
_Check = Callable[[WorkerConfig], str | None]


def _fails(bad: Callable[[WorkerConfig], bool], problem: str) -> _Check:
    """A check whose `problem` (a format string of the config `c`) is reported when `bad` holds."""
    return lambda c: problem.format(c=c) if bad(c) else None


def _at_least_1(name: str) -> _Check:
    return _fails(lambda c: getattr(c, name) < 1, name + ": must be at least 1")


def _size(name: str, *, auto: bool = False) -> _Check:
    """A size (or "auto" where `auto`): parse_size names one it cannot read in its own error."""
    def check(c: WorkerConfig) -> None:
        if not (auto and getattr(c, name) == "auto"):
            parse_size(getattr(c, name), name)
    return check


def _spec_problem(c: WorkerConfig) -> str | None:
    if c.spec.startswith("draft:"):
        if not Path(c.spec[6:]).expanduser().is_file():
            return f"spec: the draft model {c.spec[6:]!r} is not a file"
    elif c.spec.startswith("mtp:"):
        if not Path(c.spec[4:]).expanduser().is_file():
            return f"spec: the next-token layer file {c.spec[4:]!r} is not a file"
    elif c.spec.startswith("dspark:"):
        if not Path(c.spec[7:]).expanduser().is_file():
            return f"spec: the DSpark drafter {c.spec[7:]!r} is not a file"
    elif c.spec.startswith("replay:"):
        from .engine.spec.replay import parse_replay

        try:
            parse_replay(c.spec)
        except ValueError as e:
            return str(e)
    elif c.spec not in ("off", "ngram", "suffix", "mtp"):
        return (f"spec: {c.spec!r} is not available (available: off, ngram, suffix, draft:PATH, mtp, mtp:PATH, "
                "dspark:PATH, replay:P)")
    return None


def _reasoning_format_problem(c: WorkerConfig) -> str | None:
    from .text.formats.reasoning import ReasoningConfigError, parse_override

    try:
        parse_override(c.reasoning_format)
    except ReasoningConfigError as e:
        return f"reasoning_format: {e}"
    return None


def _origins_problem(c: WorkerConfig) -> str | None:
    for origin in origins(c):
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            return f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], or *)"
    return None


# Every setting's check, in the order they are made: the first that fails is the error.
_CHECKS: tuple[_Check, ...] = (
    _fails(lambda c: not 0 < c.port < 65536, "port: {c.port} is not a TCP port"),
    _at_least_1("max_seqs"),
    _at_least_1("max_queue"),
    _fails(lambda c: c.prefill_chunk < 0, "prefill_chunk: must be 0 (auto) or a positive number of tokens"),
    _fails(lambda c: not 0 <= c.itl_target_ms <= 10_000, "itl_target_ms: must be between 0 (off) and 10000 ms"),
    _fails(lambda c: c.ctx < 0, "ctx: must be 0 (automatic) or a positive number of tokens"),
    _fails(lambda c: c.kv_mem != "auto" and parse_size(c.kv_mem, "kv_mem") < 1 << 20, "kv_mem: at least 1MiB"),
    _fails(lambda c: c.gpu_mem != "auto" and parse_size(c.gpu_mem, "gpu_mem") < 1 << 30, "gpu_mem: at least 1GiB"),
    _fails(lambda c: c.kv_persist not in ("all", "finished", "off"),
           "kv_persist: {c.kv_persist!r} is not one of all, finished, off"),
    _size("kv_disk_budget", auto=True),
    _size("kv_host_mem"),
    _fails(lambda c: c.stall_seconds <= 0, "stall_seconds: must be positive"),
    _fails(lambda c: c.drain_seconds < 0, "drain_seconds: must not be negative"),
    _fails(lambda c: c.backend not in ("numpy", "cuda"),
           "backend: {c.backend!r} is not available (available: numpy, cuda)"),
    _fails(lambda c: c.f16_weights not in ("auto", "on", "off"),
           "f16_weights: {c.f16_weights!r} is not one of auto, on, off"),
    _fails(lambda c: c.loop_guard_repeats < 2, "loop_guard_repeats: must be at least 2"),
    _spec_problem,
    _fails(lambda c: (c.spec == "mtp" or c.spec.startswith("mtp:")) and c.backend != "numpy",
           "spec: mtp runs on the numpy backend only (the CUDA backend has no next-token layer yet)"),
    _fails(lambda c: c.spec.startswith("dspark:") and c.backend != "numpy",
           "spec: dspark runs on the numpy backend only (the CUDA backend has no block drafter yet)"),
    _fails(lambda c: not 1 <= c.spec_k <= 64, "spec_k: must be between 1 and 64 tokens"),
    _fails(lambda c: c.spec_max_batch < 1 or c.spec_max_context < 1,
           "spec_max_batch and spec_max_context: must be at least 1"),
    _fails(lambda c: c.loop_guard_min_span < 0, "loop_guard_min_span: must not be negative"),
    _reasoning_format_problem,
    *(_at_least_1(name) for name in ("max_stop", "max_stop_chars", "max_tools", "max_tool_schema_bytes",
                                     "max_top_k", "max_json_depth")),
    _fails(lambda c: c.max_output_tokens < 0, "max_output_tokens: must not be negative (0 = no cap)"),
    _fails(lambda c: c.max_logit_bias < 0, "max_logit_bias: must not be negative (0 = refuse logit_bias)"),
    _fails(lambda c: c.max_body != "auto" and parse_size(c.max_body, "max_body") < 1024, "max_body: at least 1KiB"),
    _fails(lambda c: c.read_header_seconds <= 0 or c.read_body_seconds <= 0,
           "read_header_seconds and read_body_seconds: must be positive"),
    _fails(lambda c: c.read_body_min_rate < 1 or c.max_slow_connections < 1,
           "read_body_min_rate and max_slow_connections: must be at least 1"),
    _origins_problem,
    _fails(lambda c: bool(c.fault) and not is_loopback(c.host),
           "fault: fault injection is refused on a non-loopback host ({c.host})"),
)


def origins(cfg: WorkerConfig) -> list[str]:
    """--allowed-origins as a list (lower case, no trailing slash)."""
    return [o.strip().rstrip("/").lower() for o in cfg.allowed_origins.split(",") if o.strip()]


# The most prompt tokens a step takes per sequence where prefill_chunk is auto, by backend: the ceiling
# within which the engine sizes each step's chunks to itl_target_ms (engine/prefill_sizing.py), and the
# rows a step is built for. The numpy backend's steps must stay short on two cores (a stream's
# next token waits for them); a GPU prefills faster in large steps, and the decode streams still get
# their token first in every step.
AUTO_PREFILL_CHUNK = {"numpy": 256, "cuda": 2048}


def prefill_chunk(cfg: WorkerConfig) -> int:
    return cfg.prefill_chunk or AUTO_PREFILL_CHUNK[cfg.backend]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redacted(cfg: WorkerConfig) -> dict[str, Any]:
    out = msgspec.to_builtins(cfg)
    for key in _SECRET:
        if out.get(key):
            out[key] = "***"
    return out


def disk_budget(cfg: WorkerConfig, kv_dir: Path) -> int:
    if cfg.kv_disk_budget != "auto":
        return parse_size(cfg.kv_disk_budget, "kv_disk_budget")
    probe = kv_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return min(free // 4, 50 * 1024**3)
