"""The real agent CLIs against a real worker: Claude Code (messages), Codex (Responses) and OpenCode
(chat completions), each headless for one task with one tool call (issue 19 item 8).

The pinned CLIs come from tests/agents/package.json (`npm ci --prefix tests/agents`, which .ci/run
does); a CLI that is not installed skips with what is missing, one that is installed must work.
Each run goes CLI -> tests/agent_proxy.py -> worker, all on loopback. The proxy forces one call of
a harmless read-only tool of that client (the tiny model never calls one by itself) and holds every
later request that carries tools to a short structured answer, so no other tool call can come back;
the CLIs also get no permission to run shell commands or write files. A run passes when the CLI
exits 0 with its own success output, the forced call went out in the client's format and its
result came back with the same call id, every tool the client declared can be forced (the grammar
over all of them compiles), and the worker logged exactly one outcome per request, none failed.

Not here: what the tiny model says (nonsense), and speed (each CLI's first request prefills its
whole system prompt and tool list, thousands of tokens, on the numpy backend).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from agent_proxy import Exchange, ForcingProxy

from ember.worker.bench.workerproc import WorkerProcess

AGENTS = Path(__file__).parent / "agents"
MODULES = AGENTS / "node_modules"
CLAUDE = MODULES / ".bin" / "claude"
CODEX = MODULES / ".bin" / "codex"
OPENCODE = MODULES / "opencode-linux-x64" / "bin" / "opencode"  # not the opencode-ai wrapper: agents/README.md

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 600  # seconds for one CLI run, and what each CLI may wait for one response
PROMPT = "Read the file notes.txt and tell me what it says."
OUTCOMES = ("completed", "failed", "canceled", "refused")


def _pinned(package: str) -> str:
    manifest = json.loads((AGENTS / "package.json").read_text())
    return {**manifest["dependencies"], **manifest.get("optionalDependencies", {})}[package]


def _need(binary: Path, package: str, home: Path) -> None:
    """Skip when the CLI is not installed; when it is, it must run and be the pinned version."""
    if not binary.exists():
        pytest.skip(f"{package}@{_pinned(package)} is not installed in tests/agents/node_modules: run "
                    "`npm ci --prefix tests/agents` (.ci/run does when the npm registry answers)")
    home.mkdir(exist_ok=True)
    r = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60, cwd=home,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)})
    assert r.returncode == 0 and _pinned(package) in r.stdout + r.stderr, \
        f"{binary} --version: exit {r.returncode}\n{r.stdout}\n{r.stderr}"


# -- the worker, shared by the three runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_worker(start_worker):
    """The model's whole 32k context (the CLIs' system prompts and tool lists are long), outputs
    capped at 256 tokens whatever the client asks (the CLIs ask for tens of thousands). Started by
    the first test that has its CLI, so a run without the CLIs skips at once."""
    started: list[WorkerProcess] = []

    def get() -> WorkerProcess:
        if not started:
            started.append(start_worker(
                "--ctx", "32768", "--kv-mem", "1536MiB", "--max-seqs", "4", "--prefill-chunk", "2048",
                "--kv-persist", "off", "--max-output-tokens", "256", "--drain-seconds", "5"))
        return started[0]

    yield get
    for w in started:
        w.stop(timeout=15)


class Run:
    """One CLI run through a forcing proxy: its output, the proxy's record and the worker's log."""

    def __init__(self, worker: WorkerProcess, tool: str, tmp: Path):
        self.worker = worker
        self.tool = tool
        self.tmp = tmp
        self.home = tmp / "home"
        self.work = tmp / "work"
        self.home.mkdir()
        self.work.mkdir()
        (self.work / "notes.txt").write_text("The meeting moved to Thursday.\n")
        self.log_start = len(worker.log_text().splitlines())
        self.proxy = ForcingProxy(worker.port, tool).start()
        self.rc: int | None = None
        self.stdout = self.stderr = ""
        self.seconds = 0.0

    def env(self, **extra: str) -> dict[str, str]:
        """Nothing of the caller's environment but PATH: no keys, proxies or config leak in."""
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8",
                "XDG_CONFIG_HOME": str(self.home / ".config"), "XDG_CACHE_HOME": str(self.home / ".cache"),
                "XDG_DATA_HOME": str(self.home / ".local/share"), "XDG_STATE_HOME": str(self.home / ".local/state"),
                "TMPDIR": str(self.tmp), **extra}

    def run(self, argv: list[str], env: dict[str, str]) -> Run:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            self.stdout, self.stderr = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stdout, self.stderr = _kill(proc)
            raise AssertionError(f"{argv[0]} did not finish in {RUN_TIMEOUT}s\n{self.report()}") from None
        finally:
            _kill(proc)  # whatever it left in its process group
            self.seconds = time.monotonic() - t0
            print(f"{Path(argv[0]).name}: {self.seconds:.1f} s")
        self.rc = proc.returncode
        return self

    def close(self) -> None:
        """Stop the proxy; its record stays in proxy.jsonl beside the run for a post-mortem."""
        self.proxy.stop()
        rows = [{"method": e.method, "path": e.path, "status": e.status, "forced": e.forced, "answer": e.answer,
                 "tools": e.tools, "tool_results": e.tool_results, "request": e.request, "response": e.response_text()}
                for e in self.proxy.exchanges]
        (self.tmp / "proxy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # -- what the assertions read ----------------------------------------------------------------------------

    def report(self) -> str:
        return (f"exit {self.rc} after {self.seconds:.0f}s\n-- stdout\n{self.stdout[-4000:]}\n-- stderr\n"
                f"{self.stderr[-3000:]}\n-- proxy\n{self.proxy.summary()}\n-- worker log\n"
                + "\n".join(self.worker.log_text().splitlines()[self.log_start:][-30:]))

    def worker_records(self) -> list[dict]:
        out = []
        for line in self.worker.log_text().splitlines()[self.log_start:]:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def outcomes(self, timeout: float = 60.0) -> dict[str, list[str]]:
        """request id -> its outcome events, once every admitted request has one (a request the CLI
        dropped when it exited is canceled a moment later)."""
        deadline = time.monotonic() + timeout
        while True:
            recs = self.worker_records()
            by_id: dict[str, list[str]] = {r["request_id"]: [] for r in recs if r.get("event") == "admit"}
            for r in recs:
                if r.get("event") in OUTCOMES and r.get("request_id"):
                    by_id.setdefault(r["request_id"], []).append(r["event"])
            if all(by_id.values()) or time.monotonic() > deadline:
                return by_id
            time.sleep(0.5)

    def check(self, protocol_path: str) -> Exchange:
        """The assertions every client shares; returns the forced exchange."""
        assert self.rc == 0, self.report()
        exchanges = self.proxy.exchanges
        model_calls = [e for e in exchanges if e.method == "POST" and protocol_path in e.path]
        assert model_calls, f"the CLI never called {protocol_path}\n{self.report()}"
        bad = [e for e in exchanges if e.status >= 400]
        assert not bad, f"error statuses: {[(e.path, e.status) for e in bad]}\n{self.report()}"

        forced = [e for e in model_calls if e.forced]
        assert len(forced) == 1 and forced[0].forced == self.tool, \
            f"no request offered the tool {self.tool!r} to force\n{self.report()}"
        calls = forced[0].calls()
        assert [name for name, _ in calls] == [self.tool], f"forced call came back as {calls}\n{self.report()}"
        call_id = calls[0][1]
        later = model_calls[model_calls.index(forced[0]) + 1:]
        answered = [e for e in later if call_id in e.tool_results]
        assert answered and forced[0].status == 200 and answered[0].status == 200, \
            f"the result of call {call_id} never came back to the worker\n{self.report()}"

        outcomes = self.outcomes()
        assert outcomes, f"the worker logged no request\n{self.report()}"
        wrong = {rid: ev for rid, ev in outcomes.items() if len(ev) != 1 or ev[0] in ("failed", "refused")}
        assert not wrong, f"requests without exactly one clean outcome: {wrong}\n{self.report()}"
        assert not [r for r in self.worker_records() if r.get("level") == "error"], self.report()
        return forced[0]

    def check_all_tools_forceable(self, forced: Exchange, protocol_path: str) -> None:
        """The client's own first tool request, resent to the worker with `required` / `any`: the
        grammar over every tool it declared compiles (a schema the worker cannot enforce is a 400)."""
        body = dict(forced.request or {})
        body["stream"] = False
        if protocol_path == "/v1/messages":
            body.update(tool_choice={"type": "any"}, max_tokens=1)
        elif protocol_path == "/v1/responses":
            body.update(tool_choice="required", max_output_tokens=16)
        else:
            body.update(tool_choice="required", max_tokens=1)
            body.pop("stream_options", None)
        r = httpx.post(self.worker.url + protocol_path, json=body, headers=self.worker.headers(), timeout=RUN_TIMEOUT)
        assert r.status_code == 200, f"{len(forced.tools)} tools {forced.tools}: {r.status_code} {r.text[:2000]}"


def _kill(proc: subprocess.Popen) -> tuple[str, str]:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        return "", ""


@pytest.fixture
def run_factory(agent_worker, tmp_path):
    runs: list[Run] = []

    def make(tool: str) -> Run:
        r = Run(agent_worker(), tool, tmp_path)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.close()


# -- the three clients --------------------------------------------------------------------------------------


def test_claude_code(run_factory, tmp_path):
    """`claude -p` on the messages API; Read is forced (Bash, Edit, Write, NotebookEdit disallowed)."""
    _need(CLAUDE, "@anthropic-ai/claude-code", tmp_path / "version")
    run = run_factory("Read")
    env = run.env(ANTHROPIC_BASE_URL=run.proxy.url, ANTHROPIC_API_KEY=run.worker.api_key or "none",
                  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
                  DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1", API_TIMEOUT_MS=str(RUN_TIMEOUT * 1000))
    run.run([str(CLAUDE), "-p", PROMPT, "--output-format", "json", "--max-turns", "3",
             "--disallowedTools", "Bash", "Edit", "Write", "NotebookEdit"], env)
    forced = run.check("/v1/messages")
    result = json.loads(run.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], run.report()
    assert result["num_turns"] >= 2, run.report()  # the tool call, then the answer
    assert "Bash" not in forced.tools and "Read" in forced.tools
    run.check_all_tools_forceable(forced, "/v1/messages")


def test_codex(run_factory, tmp_path):
    """`codex exec` with a custom provider on the Responses API; get_goal is forced (the shell tool
    is disabled, the sandbox read-only)."""
    _need(CODEX, "@openai/codex", tmp_path / "version")
    run = run_factory("get_goal")
    codex_home = run.tmp / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f'''\
model = "ember"
model_provider = "ember"
model_context_window = 32768
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.ember]
name = "ember"
base_url = "{run.proxy.url}/v1"
env_key = "EMBER_AGENT_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {RUN_TIMEOUT * 1000}
''')
    env = run.env(CODEX_HOME=str(codex_home), EMBER_AGENT_KEY=run.worker.api_key or "none")
    run.run([str(CODEX), "exec", "--skip-git-repo-check", "--disable", "shell_tool", "--json", PROMPT], env)
    forced = run.check("/v1/responses")
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, run.report()
    assert any(e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"
               for e in events), run.report()
    assert "exec_command" not in forced.tools and "get_goal" in forced.tools
    run.check_all_tools_forceable(forced, "/v1/responses")


def test_opencode(run_factory, tmp_path):
    """`opencode run` with an @ai-sdk/openai-compatible provider on chat completions; read is
    forced (bash, edit and webfetch denied)."""
    _need(OPENCODE, "opencode-linux-x64", tmp_path / "version")
    run = run_factory("read")
    config = run.tmp / "opencode.json"
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "model": "ember/gemma",
        "small_model": "ember/gemma",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"bash": "deny", "edit": "deny", "webfetch": "deny", "external_directory": "deny"},
        "provider": {"ember": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "ember",
            "options": {"baseURL": f"{run.proxy.url}/v1", "apiKey": run.worker.api_key or "none",
                        "timeout": RUN_TIMEOUT * 1000},
            "models": {"gemma": {"name": "gemma", "limit": {"context": 32768, "output": 256}}},
        }},
    }, indent=2))
    # the openai-compatible provider is bundled in the binary; a dead registry proves nothing is fetched
    env = run.env(OPENCODE_CONFIG=str(config), OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                  OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_SHARE="1",
                  OPENCODE_DISABLE_CLAUDE_CODE="1", OPENCODE_DISABLE_PROJECT_CONFIG="1",
                  NPM_CONFIG_REGISTRY="http://127.0.0.1:9/", BUN_CONFIG_REGISTRY="http://127.0.0.1:9/")
    run.run([str(OPENCODE), "run", "--format", "json", "-m", "ember/gemma", PROMPT], env)
    forced = run.check("/v1/chat/completions")
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert [t.get("tool") for t in tools] == ["read"], run.report()
    assert tools[0]["state"]["status"] in ("completed", "error"), run.report()  # ran, or refused a path
    finishes = [e["part"].get("reason") for e in events if e.get("type") == "step_finish"]
    assert finishes[:1] == ["tool-calls"] and finishes[-1] == "stop", run.report()
    assert "bash" not in forced.tools and "read" in forced.tools
    run.check_all_tools_forceable(forced, "/v1/chat/completions")
