"""The real agent CLIs against a real worker: Claude Code (messages), Codex (Responses) and OpenCode
(chat completions), each headless for one task with one tool call (issue 19 item 8).

The pinned CLIs come from tests/agents/package.json (`npm ci --prefix tests/agents`, which .ci/run
does); a CLI that is not installed skips with what is missing, one that is installed must work.
Each client runs as worker/bench/agent_clients.py sets it up (its own home and config, pointed at one URL)
and goes CLI -> worker/bench/agent_proxy.py -> worker, all on loopback. The proxy forces one call of
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
from agent_support import need_cli

from ember.worker.bench import agent_clients
from ember.worker.bench.agent_clients import CLIENTS
from ember.worker.bench.agent_proxy import Exchange, ForcingProxy
from ember.worker.bench.workerproc import WorkerProcess

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 600  # seconds for one CLI run, and what each CLI may wait for one response
CTX = 32768
PROMPT = "Read the file notes.txt and tell me what it says."
OUTCOMES = ("completed", "failed", "canceled", "refused")


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
                "--ctx", str(CTX), "--kv-mem", "1536MiB", "--max-seqs", "4", "--prefill-chunk", "2048",
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

    def env(self, client: agent_clients.AgentClient) -> dict[str, str]:
        """The client's environment and config (worker/bench/agent_clients.py), pointed at the proxy."""
        return client.env(agent_clients.Run(self.home, self.tmp, self.proxy.url, self.worker.api_key or "none", CTX,
                                            256, RUN_TIMEOUT))

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
    client = CLIENTS["claude"]
    binary = need_cli(client, tmp_path / "version")
    run = run_factory(client.tool)
    run.run(client.argv(binary, PROMPT), run.env(client))
    forced = run.check(client.protocol_path)
    result = json.loads(run.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], run.report()
    assert result["num_turns"] >= 2, run.report()  # the tool call, then the answer
    assert "Bash" not in forced.tools and "Read" in forced.tools
    run.check_all_tools_forceable(forced, client.protocol_path)


def test_codex(run_factory, tmp_path):
    """`codex exec` with a custom provider on the Responses API; get_goal is forced (the shell tool
    is disabled, the sandbox read-only)."""
    client = CLIENTS["codex"]
    binary = need_cli(client, tmp_path / "version")
    run = run_factory(client.tool)
    run.run(client.argv(binary, PROMPT), run.env(client))
    forced = run.check(client.protocol_path)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, run.report()
    assert any(e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"
               for e in events), run.report()
    assert "exec_command" not in forced.tools and "get_goal" in forced.tools
    run.check_all_tools_forceable(forced, client.protocol_path)


def test_opencode(run_factory, tmp_path):
    """`opencode run` with an @ai-sdk/openai-compatible provider on chat completions; read is
    forced (bash, edit and webfetch denied; a dead npm registry proves nothing is fetched)."""
    client = CLIENTS["opencode"]
    binary = need_cli(client, tmp_path / "version")
    run = run_factory(client.tool)
    run.run(client.argv(binary, PROMPT), run.env(client))
    forced = run.check(client.protocol_path)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert [t.get("tool") for t in tools] == ["read"], run.report()
    assert tools[0]["state"]["status"] in ("completed", "error"), run.report()  # ran, or refused a path
    finishes = [e["part"].get("reason") for e in events if e.get("type") == "step_finish"]
    assert finishes[:1] == ["tool-calls"] and finishes[-1] == "stop", run.report()
    assert "bash" not in forced.tools and "read" in forced.tools
    run.check_all_tools_forceable(forced, client.protocol_path)
