"""The agent CLIs as `ember bench agents` and the tests drive them: Claude Code (messages), Codex
(Responses) and OpenCode (chat completions), headless, each with a private home and a config that
points it at one URL and keeps it off the network otherwise, for a new conversation or a turn that
continues one by its session id.

Each client says where its binary lies in an npm tree (tests/agents/node_modules: the versions are
pinned there), the environment and config files of a run, the command line of a turn, how to read the
session id and success from its output, and the harmless read-only tool a run may be forced to call.
What a client may do is bounded as in tests/test_agent_clients.py: no shell, no file writes, no
network besides the URL. Not here: the proxy between client and server (agent_proxy.py), the turns
and restarts of a session (agent_session.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ember.ops.contract import xdg_environment

CLIENT_NAMES = ("claude", "codex", "opencode")
MODEL_NAME = "ember"  # what the clients call the model; the servers serve whatever they loaded


def _json_lines(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


@dataclass(frozen=True)
class Run:
    """What a turn needs besides the prompt: where the client lives and whom it calls."""

    home: Path  # its HOME (config, sessions, caches)
    tmp: Path  # its TMPDIR, and where config files go
    url: str  # the server (or the proxy in front of it), without /v1
    api_key: str
    context: int  # the model's context as the client is told
    output: int  # the output tokens the client may ask for
    timeout_s: int  # how long the client waits for one response

    def base_env(self) -> dict[str, str]:
        """Nothing of the caller's environment but PATH: no keys, proxies or config leak in."""
        h = self.home
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(h), "LANG": "C.UTF-8",
                **xdg_environment(h), "XDG_STATE_HOME": str(h / ".local/state"), "TMPDIR": str(self.tmp)}


class AgentClient:
    name: str
    package: str  # the npm package pinned in tests/agents/package.json
    relpath: str  # the binary under node_modules
    protocol_path: str
    tool: str  # the harmless read-only tool a run forces
    # a session's turn (agent_session.py): the tool forced once a turn (None: none) and how the proxy
    # holds the answers (agent_proxy.py). Claude Code's session forces nothing and stops answers with
    # stop sequences, so the very same requests go to llama-server too, whose /v1/messages honours
    # neither a named tool_choice (any tool) nor an output format.
    session_tool: str | None
    session_answer: str

    def binary(self, modules: Path) -> Path:
        return modules / self.relpath

    def env(self, run: Run) -> dict[str, str]:
        """The run's environment; writes the client's config files under run.tmp."""
        raise NotImplementedError

    def argv(self, binary: Path, prompt: str, session: str | None = None) -> list[str]:
        """A new conversation (session None), or a turn of the one with this id."""
        raise NotImplementedError

    def session_id(self, stdout: str) -> str | None:
        raise NotImplementedError

    def failure(self, stdout: str) -> str | None:
        """Why the run's own output says it failed; None when it says it succeeded."""
        raise NotImplementedError


class ClaudeCode(AgentClient):
    """`claude -p` (JSON result), `--resume <id>` to continue; Bash, Edit, Write and NotebookEdit
    disallowed; the nonessential traffic (updates, telemetry, error reports) off."""

    name = "claude"
    package = "@anthropic-ai/claude-code"
    relpath = ".bin/claude"
    protocol_path = "/v1/messages"
    tool = "Read"
    session_tool = None
    session_answer = "stop"
    disallowed = ("Bash", "Edit", "Write", "NotebookEdit")

    def env(self, run: Run) -> dict[str, str]:
        return {**run.base_env(), "ANTHROPIC_BASE_URL": run.url, "ANTHROPIC_API_KEY": run.api_key,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
                "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "API_TIMEOUT_MS": str(run.timeout_s * 1000),
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(run.output)}

    def argv(self, binary: Path, prompt: str, session: str | None = None) -> list[str]:
        resume = ["--resume", session] if session else []
        return [str(binary), "-p", prompt, *resume, "--output-format", "json", "--max-turns", "3",
                "--disallowedTools", *self.disallowed]

    def _result(self, stdout: str) -> dict:
        try:
            doc = json.loads(stdout)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def session_id(self, stdout: str) -> str | None:
        return self._result(stdout).get("session_id")

    def failure(self, stdout: str) -> str | None:
        r = self._result(stdout)
        if r.get("type") == "result" and r.get("subtype") == "success" and not r.get("is_error"):
            return None
        return f"result {r.get('type')}/{r.get('subtype')}, is_error {r.get('is_error')}"


class Codex(AgentClient):
    """`codex exec --json` with a custom provider on the Responses API, `codex exec resume <id>` to
    continue; the shell tool disabled, the sandbox read-only, no retries (a retry would hide a failure)."""

    name = "codex"
    package = "@openai/codex"
    relpath = ".bin/codex"
    protocol_path = "/v1/responses"
    tool = "get_goal"
    session_tool = "get_goal"  # no arguments: a call ends at once on any server
    session_answer = "format"  # Responses has no stop parameter
    flags = ("--skip-git-repo-check", "--disable", "shell_tool", "--json")

    def env(self, run: Run) -> dict[str, str]:
        home = run.tmp / "codex-home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(f'''\
model = "{MODEL_NAME}"
model_provider = "ember"
model_context_window = {run.context}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.ember]
name = "ember"
base_url = "{run.url}/v1"
env_key = "EMBER_AGENT_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {run.timeout_s * 1000}
''')
        return {**run.base_env(), "CODEX_HOME": str(home), "EMBER_AGENT_KEY": run.api_key}

    def argv(self, binary: Path, prompt: str, session: str | None = None) -> list[str]:
        if session:
            return [str(binary), "exec", "resume", *self.flags, session, prompt]
        return [str(binary), "exec", *self.flags, prompt]

    def session_id(self, stdout: str) -> str | None:
        for e in _json_lines(stdout):
            if e.get("type") == "thread.started":
                return e.get("thread_id")
        return None

    def failure(self, stdout: str) -> str | None:
        events = _json_lines(stdout)
        kinds = [e.get("type") for e in events]
        if "turn.completed" not in kinds or "turn.failed" in kinds:
            return f"events {kinds}"
        if not any(e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"
                   for e in events):
            return "no agent_message item"
        return None


class OpenCode(AgentClient):
    """`opencode run --format json` with an @ai-sdk/openai-compatible provider on chat completions,
    `--session <id>` to continue; bash, edit and webfetch denied; a dead npm registry, so nothing is
    fetched at run time (the provider package is bundled in the binary)."""

    name = "opencode"
    package = "opencode-linux-x64"
    relpath = "opencode-linux-x64/bin/opencode"  # not the opencode-ai wrapper: tests/agents/README.md
    protocol_path = "/v1/chat/completions"
    tool = "read"
    session_tool = "read"
    session_answer = "format"

    def env(self, run: Run) -> dict[str, str]:
        config = run.tmp / "opencode.json"
        config.write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "model": f"ember/{MODEL_NAME}",
            "small_model": f"ember/{MODEL_NAME}",
            "autoupdate": False,
            "share": "disabled",
            "permission": {"bash": "deny", "edit": "deny", "webfetch": "deny", "external_directory": "deny"},
            "provider": {"ember": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "ember",
                "options": {"baseURL": f"{run.url}/v1", "apiKey": run.api_key, "timeout": run.timeout_s * 1000},
                "models": {MODEL_NAME: {"name": MODEL_NAME, "limit": {"context": run.context, "output": run.output}}},
            }},
        }, indent=2))
        return {**run.base_env(), "OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_SHARE": "1",
                "OPENCODE_DISABLE_CLAUDE_CODE": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
                "NPM_CONFIG_REGISTRY": "http://127.0.0.1:9/", "BUN_CONFIG_REGISTRY": "http://127.0.0.1:9/"}

    def argv(self, binary: Path, prompt: str, session: str | None = None) -> list[str]:
        resume = ["--session", session] if session else []
        return [str(binary), "run", "--format", "json", "-m", f"ember/{MODEL_NAME}", *resume, prompt]

    def events(self, stdout: str) -> list[dict]:
        return _json_lines(stdout)

    def session_id(self, stdout: str) -> str | None:
        for e in _json_lines(stdout):
            sid = e.get("sessionID") or (e.get("part") or {}).get("sessionID")
            if sid:
                return sid
        return None

    def failure(self, stdout: str) -> str | None:
        finishes = [e["part"].get("reason") for e in _json_lines(stdout) if e.get("type") == "step_finish"]
        errors = [e for e in _json_lines(stdout) if e.get("type") == "error"]
        if errors or not finishes or finishes[-1] != "stop":
            return f"step finishes {finishes}, errors {errors[:2]}"
        return None


CLIENTS: dict[str, AgentClient] = {c.name: c for c in (ClaudeCode(), Codex(), OpenCode())}


def default_modules() -> Path | None:
    """tests/agents/node_modules of the checkout this module runs from (an editable install), if there."""
    here = Path(__file__).resolve().parents[2] / "tests" / "agents" / "node_modules"
    return here if here.is_dir() else None
