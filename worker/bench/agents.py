"""`ember bench agents`: a real agent CLI's multi-turn session (agent_session.py) against an ember
worker this bench starts, or any server by URL (ember, llama-server), with the server restarted
mid-session (a kill -9, a clean restart); per turn the prompt tokens, the cached tokens and their
share, and over the session the tokens prefilled again (agent_report.py). `--compare A.json B.json`
sets two such reports side by side (issue 43 item 4: ember against llama-server).

The bench's own worker: numpy backend, KV persistence on, its KV dir kept across the restarts; a kill
is SIGKILL and a start on the same dir, a clean restart SIGTERM (the worker drains) and a start;
the counts come from its log (`admit`). A server by URL: the counts come from its responses; a kill is
SIGKILL of the process listening on the URL's port (and its children), then `--start-cmd` (or a
supervisor, such as ember's daemon, brings it back); a clean restart is `--restart-cmd` (`ember
restart`), or SIGTERM and `--start-cmd`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from ember.ops.contract import ExitCode

from .agent_clients import CLIENT_NAMES, CLIENTS, default_modules
from .agent_proxy import ANSWER_MODES, ForcingProxy
from .agent_report import admitted, compare, compare_table, log_records, report, requests_of, table
from .agent_session import AgentSession
from .machine import machine_facts
from .workerproc import WorkerProcess

READY_TIMEOUT = 600.0  # seconds: a restarted server loads its model (and ember its KV index)


def add_agents_parser(bsub) -> None:
    p = bsub.add_parser("agents", help="a real agent CLI's multi-turn session with restarts: cached share per turn",
                        description=__doc__.split("\n\n")[0])
    p.add_argument("--client", choices=CLIENT_NAMES, default="claude", help="the agent CLI (default claude)")
    p.add_argument("--cli", metavar="PATH", help="its binary (default: tests/agents/node_modules of this checkout, "
                   "else on PATH)")
    p.add_argument("--turns", type=int, default=6, metavar="N", help="turns of the conversation (default 6)")
    p.add_argument("--kill-before", type=int, default=3, metavar="TURN",
                   help="SIGKILL the server before this turn (default 3; 0: never)")
    p.add_argument("--restart-before", type=int, default=5, metavar="TURN",
                   help="restart the server cleanly before this turn (default 5; 0: never)")
    p.add_argument("--url", help="a running server (ember, llama-server) instead of a worker this bench starts")
    p.add_argument("--start-cmd", metavar="CMD", help="--url: a shell command that starts the server again after "
                   "a kill (and after the SIGTERM of a clean restart); without it a supervisor must")
    p.add_argument("--restart-cmd", metavar="CMD", help="--url: a shell command for the clean restart (ember restart)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: none)")
    p.add_argument("--model", metavar="PATH", help="the bench's worker: GGUF model (default: the embedded model)")
    p.add_argument("--ctx", type=int, default=65536, help="the bench's worker: context, and what the client is told "
                   "(default 65536)")
    p.add_argument("--kv-mem", default="512MiB", help="the bench's worker: KV budget (default 512MiB)")
    p.add_argument("--force-tool", metavar="NAME", help="the tool forced once a turn ('none': never; default: the "
                   "client's: claude none, codex get_goal, opencode read)")
    p.add_argument("--answer", choices=ANSWER_MODES, help="how answers are held short (default: claude stop, "
                   "codex and opencode format)")
    p.add_argument("--keep-thinking", action="store_true", help="leave the clients' reasoning settings as they are "
                   "(default: off, so a thinking template's tiny model answers at once)")
    p.add_argument("--max-tokens", type=int, default=256, help="output cap on every request (default 256)")
    p.add_argument("--timeout", type=int, default=600, help="seconds for one turn (default 600)")
    p.add_argument("--workdir", metavar="DIR", help="where the session's files go (default: a new temporary dir, "
                   "kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="set two reports side by side, A against "
                   "B (ember against llama-server: A's prefilled tokens after the first request <= 0.5 x B's)")
    p.set_defaults(func=cmd_agents)


def _binary(args: argparse.Namespace) -> Path | None:
    if args.cli:
        return Path(args.cli)
    modules = default_modules()
    if modules is not None and CLIENTS[args.client].binary(modules).exists():
        return CLIENTS[args.client].binary(modules)
    found = shutil.which(args.client)
    return Path(found) if found else None


def _restarts(args: argparse.Namespace) -> dict[int, str]:
    out = {}
    if 2 <= args.kill_before <= args.turns:
        out[args.kill_before] = "kill"
    if 2 <= args.restart_before <= args.turns:
        out[args.restart_before] = "restart"
    return out


class OwnWorker:
    """An ember worker this bench starts, restarted on the same KV dir."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        model = ["--model", args.model] if args.model else []
        self.args = [*model, "--ctx", str(args.ctx), "--kv-mem", args.kv_mem, "--max-seqs", "4",
                     "--prefill-chunk", "2048", "--kv-persist", "all", "--kv-dir", str(workdir / "kv"),
                     "--max-output-tokens", str(args.max_tokens), "--drain-seconds", "5"]
        self.api_key = args.api_key
        self.workdir = workdir
        self.logs: list[Path] = []
        self.worker: WorkerProcess | None = None
        self.port: int | None = None

    def start(self) -> WorkerProcess:
        self.logs.append(self.workdir / f"worker-{len(self.logs) + 1}.log")
        self.worker = WorkerProcess(*self.args, log_path=self.logs[-1], port=self.port,
                                    api_key=self.api_key).start(timeout=READY_TIMEOUT)
        self.port = self.worker.port
        return self.worker

    def restart(self, kind: str) -> None:
        assert self.worker is not None
        if kind == "kill":
            self.worker.kill()
        else:
            self.worker.stop()
        self.start()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def facts(self) -> dict:
        return {"server": "ember", "model": Path(self.args[1]).name if self.args[0] == "--model" else "embedded",
                "backend": "numpy", "ctx": int(self.args[self.args.index("--ctx") + 1])}


class ByUrl:
    """A server someone else started; left running as found (a restarted one too)."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        from .soak_target import READY_PATH, describe

        self.url = args.url.rstrip("/")
        engine, self.server = describe(self.url, args.ctx)
        self.server["model"] = engine.model
        self.ready_path = READY_PATH[engine.server]
        self.port = urlsplit(self.url).port or 80
        self.host = urlsplit(self.url).hostname or "127.0.0.1"
        self.start_cmd, self.restart_cmd = args.start_cmd, args.restart_cmd
        self.workdir = workdir
        self.runs = 0

    def _command(self, cmd: str, what: str) -> subprocess.Popen:
        self.runs += 1
        log = self.workdir / f"{what}-{self.runs}.log"
        with open(log, "ab") as out:
            return subprocess.Popen(cmd, shell=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def restart(self, kind: str) -> None:
        from .soak_target import listener_pid, sigkill, wait_ready

        proc = None
        if kind == "restart" and self.restart_cmd:
            self._command(self.restart_cmd, "restart").wait(READY_TIMEOUT)
        else:
            pid = listener_pid(self.port)
            if pid is None:
                raise RuntimeError(f"no process of this machine listens on port {self.port}")
            p = psutil.Process(pid)
            if kind == "kill":
                sigkill(p, p.children(recursive=True))
            else:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(psutil.TimeoutExpired):
                    p.wait(120)
            if self.start_cmd:
                proc = self._command(self.start_cmd, "start")
        wait_ready(self.url, self.ready_path, READY_TIMEOUT, proc)


def cmd_agents(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args)
    client = CLIENTS[args.client]
    if args.turns < 2:
        print("ember bench agents: --turns must be at least 2", file=sys.stderr)
        return 2
    restarts = _restarts(args)
    if args.url and "restart" in restarts.values() and not (args.restart_cmd or args.start_cmd):
        print("ember bench agents: a clean restart of a server by URL needs --restart-cmd or --start-cmd "
              "(or --restart-before 0)", file=sys.stderr)
        return 2
    binary = _binary(args)
    if binary is None or not binary.exists():
        print(f"ember bench agents: no {client.name} CLI (pass --cli, or `npm ci --prefix tests/agents` in a "
              "checkout)", file=sys.stderr)
        return ExitCode.CONFIG
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"ember-agents-{client.name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"ember bench agents: {client.name} ({binary}), files in {workdir}", file=sys.stderr)

    target: OwnWorker | ByUrl = ByUrl(args, workdir) if args.url else OwnWorker(args, workdir)
    if isinstance(target, OwnWorker):
        target.start()
    tool = args.force_tool if args.force_tool is not None else client.session_tool
    proxy = ForcingProxy(target.port or 0, None if tool in (None, "none") else tool,
                         upstream_host=target.host if isinstance(target, ByUrl) else "127.0.0.1",
                         answer=args.answer or client.session_answer, thinking_off=not args.keep_thinking,
                         max_tokens=args.max_tokens).start()
    try:
        session = AgentSession(client, binary, workdir / "session", proxy, api_key=args.api_key or "none",
                               context=args.ctx, output=args.max_tokens, timeout_s=args.timeout)
        turns = session.run(args.turns, restarts, target.restart, lambda m: print(m, file=sys.stderr))
    finally:
        proxy.stop()
        if isinstance(target, OwnWorker):
            target.stop()
    (workdir / "proxy.jsonl").write_text("".join(
        json.dumps({"turn": e.turn, "path": e.path, "status": e.status, "forced": e.forced, "answer": e.answer,
                    "request_id": e.request_id, "request": e.request, "response": e.response_text()}) + "\n"
        for e in proxy.exchanges))
    if isinstance(target, OwnWorker):
        counts = admitted(log_records(p.read_text(errors="replace") for p in target.logs if p.exists()))
        reqs = requests_of(proxy.exchanges, client.protocol_path, counts)
        rep = report(client.name, target.facts(), reqs, turns, "ember's log")
    else:
        reqs = requests_of(proxy.exchanges, client.protocol_path)
        rep = report(client.name, target.server, reqs, turns, "the responses")
    rep["machine"] = machine_facts()
    rep["workdir"] = str(workdir)
    (workdir / "report.json").write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep) if args.json else table(rep))
    return 0 if all(t.ok for t in turns) and len(turns) == args.turns else 1


def _compare(args: argparse.Namespace) -> int:
    reps = []
    for path in args.compare:
        try:
            rep = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"ember bench agents: {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(rep, dict) or rep.get("kind") != "agent-session":
            print(f"ember bench agents: {path} is no `ember bench agents --json` report", file=sys.stderr)
            return 2
        reps.append(rep)
    c = compare(*reps)
    print(json.dumps(c) if args.json else compare_table(c))
    return 0
