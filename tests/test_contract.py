"""ember.ops.contract is the one home of the values the worker, kernels, daemon and ops share (exit
codes, health states, log events, state/cache/config paths, size and duration parsing).

Two kinds of check: every side resolves the same values through the contract (the same state dir
for a system run, the same parser), and no other module spells a contract value itself. The second
scans the source of ember's packages; its rules are tried on planted examples first, so a scanner
that stopped finding anything would fail here too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ember.ops import contract
from ember.ops.contract import OUTCOMES, REQUIRED_FIELDS, Event, ExitCode, HealthState

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "ops" / "contract.py"
PACKAGES = ("daemon", "worker", "kernels", "ops")

# -- what only the contract may spell ----------------------------------------------------------------

EXIT_VALUES = {ExitCode.POISONED.value, ExitCode.CONFIG.value, ExitCode.PORT_BUSY.value}  # 0-3 are everyone's
EXIT_TEXT = re.compile(r"(?i)exit(?:\s*(?:code|status))?\s*[=:(]?\s*(?:" + "|".join(map(str, EXIT_VALUES)) + r")\b")
EXIT_CALLS = {"exit", "_exit", "SystemExit"}
EXIT_KEYWORDS = {"code", "exit_code", "exitcode", "returncode"}
EXIT_NAMES = re.compile(r"(?i)^ex_|exit|code|status|^rc$")
HEALTH_ONLY = {HealthState.LOADING.value, HealthState.DRAINING.value, HealthState.POISONED.value}
HEALTH_ALL = {s.value for s in HealthState}  # "ready" also names a log event, a probe and a status
PATH_FRAGMENTS = (str(contract.SYSTEM_STATE_DIR), str(contract.SYSTEM_CONFIG_DIR), ".local/share", "~/.cache",
                  "~/.config", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
PATH_VARIABLES = {contract.ENV_STATE_DIR, contract.ENV_CACHE_DIR, contract.ENV_CONFIG, contract.ENV_SYSTEM}
SIZE_SUFFIXES = {"kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib"}
UNIT_PATTERNS = re.compile(r"\[kmgt\]|ms\|s\|m\|h", re.IGNORECASE)  # a size or a duration regex


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _targets(node: ast.Assign | ast.AnnAssign) -> list[str]:
    out: list[str] = []
    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
        out += [_name(e) for e in t.elts] if isinstance(t, ast.Tuple) else [_name(t)]
    return out


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _mentions_exit(expr: ast.AST) -> bool:
    """`code`, `ex.get("code")`, `proc.returncode`, `info.exitstatus`: an expression about an exit."""
    for n in ast.walk(expr):
        word = n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else _name(n)
        if word and EXIT_NAMES.search(word):
            return True
    return False


def _is_exit_use(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    p = parents.get(node)
    if isinstance(p, ast.Tuple):  # EX_OK, EX_CONFIG = 0, 78
        p = parents.get(p)
    if isinstance(p, ast.Return):
        return True
    if isinstance(p, ast.Compare):
        return any(_mentions_exit(side) for side in (p.left, *p.comparators) if side is not node)
    if isinstance(p, ast.Call):
        return _name(p.func) in EXIT_CALLS
    if isinstance(p, ast.keyword):
        return p.arg in EXIT_KEYWORDS
    if isinstance(p, ast.Assign | ast.AnnAssign):
        return any(EXIT_NAMES.search(n) for n in _targets(p))
    return False


def _excused_health_word(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """`getattr(engine, "poisoned")` names an attribute, `log("draining")` an event, `__all__` a function."""
    p = parents.get(node)
    if isinstance(p, ast.Call):
        fn = _name(p.func)
        attribute = fn in ("getattr", "hasattr", "setattr") and p.args[1:2] == [node]
        return attribute or (fn == "log" and p.args[:1] == [node])
    if isinstance(p, ast.List | ast.Tuple):
        owner = parents.get(p)
        return isinstance(owner, ast.Assign) and "__all__" in _targets(owner)
    return False


def spelled_contract_values(source: str, filename: str) -> list[str]:
    """Every place in `source` that spells a contract value instead of naming it."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            spelled = [] if id(node) in docs else _spelled_constant(node, parents)
        else:
            spelled = _spelled_construct(node)
        found += [f"{filename}:{getattr(node, 'lineno', '?')}: {what}" for what in spelled]
    return found


def _spelled_constant(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> list[str]:
    """What a literal spells: an exit code, a health state, a path, a unit pattern."""
    v = node.value
    spelled = []
    if isinstance(v, int) and not isinstance(v, bool) and v in EXIT_VALUES and _is_exit_use(node, parents):
        spelled.append(f"exit code {v} (use ExitCode)")
    if not isinstance(v, str):
        return spelled
    if EXIT_TEXT.search(v):
        spelled.append(f"exit code in text {v!r} (use ExitCode)")
    if v in HEALTH_ONLY and not _excused_health_word(node, parents):
        spelled.append(f"health state {v!r} (use HealthState)")
    if any(f in v for f in PATH_FRAGMENTS) or v in PATH_VARIABLES:
        spelled.append(f"path {v!r} (use contract.state_dir/cache_dir/config_file and ENV_*)")
    if UNIT_PATTERNS.search(v):
        spelled.append(f"unit pattern {v!r} (use contract.parse_size/parse_duration)")
    return spelled


def _spelled_construct(node: ast.AST) -> list[str]:
    """What a dict, a comparison or a call spells: a size-suffix table, a health state compared or set."""
    if isinstance(node, ast.Dict):
        keys = {k.value.lower() for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if len(keys & SIZE_SUFFIXES) >= 2:
            return ["a size-suffix table (use contract.parse_size)"]
    elif isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        words = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in HEALTH_ALL]
        if words and any(_name(s) in ("state", "_state") for s in sides):
            return [f"health state {words[0]!r} compared (use HealthState)"]
    elif isinstance(node, ast.Call) and _name(node.func) in ("set", "ServerState") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and arg.value in HEALTH_ALL:
            return [f"health state {arg.value!r} set (use HealthState)"]
    return []


PLANTED = {
    "sys.exit(78)": "exit code 78",
    "raise SystemExit(75)": "exit code 75",
    "os._exit(75)": "exit code 75",
    "def f():\n    return 78": "exit code 78",
    "EX_OK, EX_CONFIG = 0, 78": "exit code 78",
    "if code == 75:\n    pass": "exit code 75",
    "poisoned = ex.get('code') == 75": "exit code 75",
    "if proc.returncode in (0, 78):\n    pass": "exit code 78",
    "log('exit', code=78)": "exit code 78",
    "unit = 'RestartPreventExitStatus=78'": "exit code in text",
    "why = f'configuration error (exit 78, not restarting): {x}'": "exit code in text",
    "STATES = ('loading', 'ready', 'draining', 'poisoned')": "health state 'loading'",
    "ok = rec.get('state') != 'poisoned'": "health state 'poisoned'",
    "msg = {'draining': 'retry'}": "health state 'draining'",
    "ok = self.state == 'ready'": "health state 'ready' compared",
    "state.set('ready')": "health state 'ready' set",
    "s = ServerState('ready')": "health state 'ready' set",
    "root = Path('/var/lib/ember')": "path '/var/lib/ember'",
    "conf = Path('/etc/ember/ember.toml')": "path '/etc/ember/ember.toml'",
    "base = os.environ.get('XDG_DATA_HOME') or os.path.expanduser('~/.local/share')": "path 'XDG_DATA_HOME'",
    "cache = os.path.expanduser('~/.cache')": "path '~/.cache'",
    "d = os.environ.get('EMBER_STATE_DIR')": "path 'EMBER_STATE_DIR'",
    "_UNITS = {'': 1, 'kib': 1024, 'mib': 1024**2}": "a size-suffix table",
    "_SIZE = re.compile(r'^(\\d+)\\s*([kmgt]i?b?|b)?$')": "unit pattern",
    "_DUR = re.compile(r'^(\\d+)(ms|s|m|h)?$')": "unit pattern",
}


@pytest.mark.parametrize("source", PLANTED)
def test_the_scanner_finds_a_planted_spelling(source):
    found = spelled_contract_values(source, "planted.py")
    assert any(PLANTED[source] in f for f in found), found


@pytest.mark.parametrize("source", [
    '"""Exit codes: 0 clean stop; 75 poisoned; 78 configuration error (do not restart)."""',
    "p = getattr(engine, 'poisoned', None)",
    "log('draining', in_flight=3)",
    "__all__ = ['poisoned', 'check']",
    "n = 1 << 30\nreturn_code = 0",
    "if width > 78 or pct >= 75:\n    pass",
    "if st.get('state') == Status.READY:\n    pass",
    "log(Event.READY, host=h)",
])
def test_the_scanner_leaves_names_and_prose_alone(source):
    assert spelled_contract_values(source, "fine.py") == []


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if p != CONTRACT and "__pycache__" not in p.parts]


def test_no_module_spells_a_contract_value():
    sources = _sources()
    assert len(sources) > 50 and ROOT / "daemon" / "core.py" in sources  # the scan covers the tree
    found = [f for p in sources for f in spelled_contract_values(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


# -- the contract is a leaf ---------------------------------------------------------------------------------


def test_the_contract_imports_only_the_standard_library():
    tree = ast.parse(CONTRACT.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    code = "import sys, ember.ops.contract; print('\\n'.join(sorted(sys.modules)))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [m for m in mods if m.startswith("ember.")] == ["ember.ops", "ember.ops.contract"]


# -- every side finds the same places -------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in (*PATH_VARIABLES, "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def _state_dirs() -> dict[str, Path]:
    from ember.daemon.paths import layout
    from ember.ops.crashes import crash_dir
    from ember.worker import paths as worker_paths

    return {"contract": contract.state_dir(), "daemon": layout().state, "ops": crash_dir().parent,
            "worker": worker_paths.state_dir()}


def test_user_state_cache_and_config_agree(clean_env, tmp_path):
    from ember.daemon.settings import load
    from ember.kernels import build
    from ember.worker import paths as worker_paths

    home = tmp_path / "home"
    assert set(_state_dirs().values()) == {home / ".local/share/ember"}
    assert worker_paths.cache_dir() == home / ".cache/ember" == build.cache_dir().parent
    assert contract.config_file() == home / ".config/ember/ember.toml"
    clean_env.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert set(_state_dirs().values()) == {tmp_path / "data/ember"}
    assert worker_paths.cache_dir() == tmp_path / "cache/ember" == build.cache_dir().parent
    clean_env.setenv(contract.ENV_STATE_DIR, str(tmp_path / "state"))
    assert set(_state_dirs().values()) == {tmp_path / "state"}
    (tmp_path / "cfg.toml").write_text("[daemon]\nlive_timeout = '7s'\n")
    clean_env.setenv(contract.ENV_CONFIG, str(tmp_path / "cfg.toml"))
    assert load().live_timeout == 7.0  # the daemon reads the file the contract names


def test_a_system_run_puts_daemon_worker_and_ops_in_the_same_place(clean_env):
    """The bug this contract fixed: EMBER_SYSTEM=1 sent the daemon to /var/lib/ember while the worker
    and ops stayed in the user's ~/.local/share."""
    clean_env.setenv(contract.ENV_SYSTEM, "1")
    clean_env.setattr(contract.os, "geteuid", lambda: 0)
    clean_env.setattr(contract, "private_dir", lambda path: path)  # the worker's mkdir: not on this machine
    assert set(_state_dirs().values()) == {contract.SYSTEM_STATE_DIR}
    assert contract.config_file() == contract.SYSTEM_CONFIG_DIR / "ember.toml"
    from ember.worker import paths as worker_paths

    assert worker_paths.cache_dir() == contract.SYSTEM_STATE_DIR / ".cache/ember"  # inside the unit's writable tree
    clean_env.setattr(contract.os, "geteuid", lambda: 1000)  # EMBER_SYSTEM=1 alone, as a user: the user's dirs
    assert contract.SYSTEM_STATE_DIR not in _state_dirs().values()


def test_the_system_unit_names_the_contracts_places(clean_env):
    from ember.daemon import service

    unit = service.render_unit(True, Path("/opt/ember/venv/bin/ember")).splitlines()
    assert f"Environment={contract.ENV_STATE_DIR}={contract.SYSTEM_STATE_DIR}" in unit
    assert f"Environment={contract.ENV_CONFIG}={contract.SYSTEM_CONFIG_DIR / 'ember.toml'}" in unit
    assert f"RestartPreventExitStatus={int(ExitCode.CONFIG)}" in unit


# -- one parser for sizes and durations -------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [
    ("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1.5GB", 1_500_000_000), ("64k", 64_000), ("2 kib", 2048),
    ("1000000", 1_000_000), (4096, 4096), (" 1tib ", 1 << 40), ("7b", 7),
])
def test_sizes_parse_the_same_everywhere(text, value):
    from ember.daemon import settings
    from ember.worker import config

    assert contract.parse_size(text) == settings.parse_size(text, "x") == config.parse_size(text) == value


@pytest.mark.parametrize("text,value", [("500ms", 0.5), ("30s", 30.0), ("10m", 600.0), ("1h", 3600.0), ("2.5", 2.5),
                                        (3, 3.0)])
def test_durations_parse(text, value):
    from ember.daemon import settings

    assert contract.parse_duration(text) == settings.parse_duration(text, "x") == value


def test_bad_sizes_and_durations_name_the_setting_in_each_sides_error():
    from ember.daemon import settings
    from ember.worker import config

    for bad in ("12 parsecs", "MiB", "-1GiB", True):
        with pytest.raises(ValueError, match="kv_mem: .* is not a size"):
            contract.parse_size(bad, "kv_mem")
        with pytest.raises(config.ConfigError, match="kv_mem"):
            config.parse_size(bad, "kv_mem")
        with pytest.raises(settings.SettingsError, match="log_max_bytes"):
            settings.parse_size(bad, "log_max_bytes")
    with pytest.raises(settings.SettingsError, match="tick: '5 fortnights' is not a duration"):
        settings.parse_duration("5 fortnights", "tick")


@pytest.mark.parametrize("data,message", [
    ({"prot": 1}, "f.toml: prot: unknown setting (did you mean port?)"),
    ({"worker": {"prot": 1}}, "f.toml: [worker] prot: unknown setting (did you mean port?)"),
    ({"worker": {"api-key": "x"}}, "[worker] api-key: unknown setting (did you mean api_key?)"),
    ({"daemn": {"tick": 1}}, "[daemn]: unknown section (did you mean [daemon]?)"),
    ({"daemon": {"tikc": 1}}, "[daemon] tikc: unknown setting (did you mean tick?)"),
    ({"daemon": {"frobnicate": 1}}, "[daemon] frobnicate: unknown setting"),
    ({"worker": 3}, "worker must be a section"),
    ({"port": 1, "worker": {"port": 2}}, "port is set both at the top level and in [worker]"),
])
def test_the_config_files_layout_is_checked_in_one_place(data, message):
    with pytest.raises(ValueError) as e:
        contract.config_sections(data, "f.toml", worker_keys=("port", "api_key", "host"), daemon_keys=("tick",))
    assert message in str(e.value) and str(e.value).startswith("config file f.toml: ")


def test_each_side_checks_only_its_own_keys():
    data = {"port": 1, "worker": {"host": "h"}, "daemon": {"tick": 2}}
    assert contract.config_sections(data, "f") == ({"port": 1, "host": "h"}, {"tick": 2})
    assert contract.config_sections({"unknown_to_the_daemon": 1}, "f", daemon_keys=("tick",)) == (
        {"unknown_to_the_daemon": 1}, {})  # the daemon cannot know the worker's keys; the worker refuses it


# -- exit codes, health states, log events -----------------------------------------------------------------


def test_the_values_design_md_promises():
    assert (ExitCode.OK, ExitCode.POISONED, ExitCode.CONFIG, ExitCode.PORT_BUSY) == (0, 75, 78, 69)
    assert [s.value for s in HealthState] == ["loading", "ready", "draining", "poisoned"]
    assert [e.value for e in OUTCOMES] == ["completed", "failed", "canceled", "refused"]
    assert REQUIRED_FIELDS[Event.ADMIT] == ("request_id", "seq", "cached_tokens", "new_tokens")
    assert REQUIRED_FIELDS[Event.ENGINE_POISONED] == ("code", "name", "message")


def test_the_worker_and_the_daemon_read_one_list_of_sticky_cuda_errors():
    """The worker poisons its context on the contract's sticky errors, and the daemon reads a foreign
    engine's raw log for the same ones, less RAW_LOG_EXEMPT (a context its caller destroyed is no fault
    of the device: the worker's own 709 still poisons it, another engine's line does not)."""
    from ember.daemon import detect
    from ember.kernels import errors

    assert errors.STICKY_CODES is contract.STICKY_CUDA_ERRORS
    assert set(contract.STICKY_CUDA_ERRORS) > contract.RAW_LOG_EXEMPT
    assert set(detect.STICKY) == set(contract.STICKY_CUDA_ERRORS) - contract.RAW_LOG_EXEMPT
    assert all(detect.STICKY[code][0] == contract.STICKY_CUDA_ERRORS[code] for code in detect.STICKY)
    for code in contract.STICKY_CUDA_ERRORS:
        assert isinstance(errors.cuda_error(code, "n", "m"), errors.StickyCudaError), code
        raw = detect.poison_in_line(f"CUDA error {code}", None)
        assert (raw is None) == (code in contract.RAW_LOG_EXEMPT), code
        assert raw is None or raw["code"] == code
    # 912 is CUDA_ERROR_INVALID_CLUSTER_SIZE, a launch's configuration: the context lives on
    assert not isinstance(errors.cuda_error(912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "m"), errors.StickyCudaError)


def test_the_sticky_errors_are_named_as_cuda_names_them():
    """Each code's driver API name (the contract's) and runtime API name (the daemon's) are CUDA's own."""
    from ember.daemon import detect

    driver = pytest.importorskip("cuda.bindings.driver")  # the enums need no driver library
    runtime = pytest.importorskip("cuda.bindings.runtime")
    for code, name in contract.STICKY_CUDA_ERRORS.items():
        assert driver.CUresult(code).name == name, code
    for code, (_, runtime_name, _) in detect.STICKY.items():
        assert runtime.cudaError_t(code).name == runtime_name, code


def test_the_worker_uses_the_contracts_states_and_outcomes():
    from ember.worker import metrics
    from ember.worker.api.state import STATES, ServerState
    from ember.worker.engine.requests import Outcome

    assert tuple(HealthState) == STATES and ServerState().state == HealthState.LOADING
    assert {o.value for o in Outcome} == set(OUTCOMES) and metrics.OUTCOMES is OUTCOMES


def test_crash_bundles_keep_every_required_field_of_the_session_events():
    from ember.daemon import bundle

    assert set(OUTCOMES) | {Event.ADMIT} <= bundle.EVENT_NAMES
    for event in bundle.EVENT_NAMES:
        assert set(REQUIRED_FIELDS[Event(event)]) <= set(bundle.EVENT_FIELDS), event


def test_worker_and_daemon_write_the_same_line_format(tmp_path):
    import io

    from ember.daemon.jsonlog import JsonLog
    from ember.worker import logs

    buf = io.StringIO()
    logs.set_stream(buf)
    try:
        logs.log(Event.ADMIT, request_id="r1", seq=1, cached_tokens=0, new_tokens=5)
    finally:
        logs.set_stream(None)
    JsonLog(tmp_path / "daemon.log", stderr=False)("phase", **{"from": "stopped", "to": "starting", "why": "test"})
    worker_line = contract.parse_log_line(buf.getvalue())
    daemon_line = contract.parse_log_line((tmp_path / "daemon.log").read_text())
    assert worker_line is not None and daemon_line is not None
    assert list(worker_line)[:3] == list(daemon_line)[:3] == list(contract.LOG_KEYS)
    assert contract.missing_fields(worker_line) == () and worker_line["event"] == "admit"
    assert contract.missing_fields({"ts": "t", "level": "info", "event": "admit", "seq": 1}) == (
        "request_id", "cached_tokens", "new_tokens")
    assert contract.missing_fields({"event": "phase"}) == ("ts", "level")
    assert contract.parse_log_line("plain text") is None and contract.parse_log_line('{"no": "event"}') is None



def test_a_child_home_gets_every_xdg_directory_under_it(monkeypatch, tmp_path):
    """The XDG layout a child program is given under a home of its own (the agent CLIs' private homes) is
    where the contract's own lookup puts each directory for that home."""
    monkeypatch.setenv("HOME", str(tmp_path))
    env = contract.xdg_environment(tmp_path)
    assert len(env) == 3
    for kind in ("data", "cache", "config"):
        assert contract.xdg_home(kind, env) == contract.xdg_home(kind, {})
    assert all(Path(v).is_relative_to(tmp_path) and Path(v) != tmp_path for v in env.values())
