"""One conversation of a real agent CLI, turn after turn, as a user has it: each turn continues the
same conversation by its session id; between turns a file of the working directory is edited and a
git commit is made (what an agent's own edits do to the workspace); before chosen turns the server
is restarted (`restart_before`: turn -> "kill" or "restart", done by a hook the caller gives).

The CLI talks to a ForcingProxy (agent_proxy.py) in front of the server, which labels every exchange
with its turn. Not here: which server, how it is restarted (the caller's hook: tests/ under the
daemon, `ember bench agents` for its own worker or a URL), and the accounting (agent_report.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .agent_clients import AgentClient, Run
from .agent_proxy import ForcingProxy

PROMPT = "Turn {turn}: read notes.txt and tell me what it says."
GIT_ID = {"GIT_AUTHOR_NAME": "ember bench", "GIT_AUTHOR_EMAIL": "bench@ember.invalid",
          "GIT_COMMITTER_NAME": "ember bench", "GIT_COMMITTER_EMAIL": "bench@ember.invalid"}


@dataclass
class TurnResult:
    turn: int
    restart: str | None  # what was done to the server before this turn: "kill", "restart" or nothing
    rc: int | None = None
    seconds: float = 0.0
    session_id: str | None = None
    failure: str | None = None  # the client's own output said it failed (None: it succeeded)
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.failure is None


@dataclass
class AgentSession:
    """One CLI's conversation through `proxy`, in a git working dir under `root`."""

    client: AgentClient
    binary: Path
    root: Path
    proxy: ForcingProxy
    api_key: str = "none"
    context: int = 65536
    output: int = 256
    timeout_s: int = 600  # one turn, and what the client waits for one response
    turns: list[TurnResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.home = self.root / "home"
        self.work = self.root / "work"
        self.tmp = self.root / "tmp"
        for d in (self.home, self.work, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        run = Run(self.home, self.tmp, self.proxy.url, self.api_key, self.context, self.output, self.timeout_s)
        self.env = self.client.env(run)
        (self.work / "notes.txt").write_text("The meeting moved to Thursday.\n")
        self._git("init", "-q")
        self._git("add", ".")
        self._git("commit", "-q", "-m", "notes")

    @property
    def session_id(self) -> str | None:
        return self.turns[0].session_id if self.turns else None

    def _git(self, *args: str) -> None:
        subprocess.run(["git", *args], cwd=self.work, check=True, capture_output=True, timeout=60,
                       env={**self.env, **GIT_ID})

    def edit_and_commit(self, turn: int) -> None:
        """What the agent's work leaves between turns: a changed file and a commit."""
        notes = self.work / "notes.txt"
        notes.write_text(notes.read_text() + f"Turn {turn}: the agenda changed again.\n")
        self._git("commit", "-q", "-a", "-m", f"notes after turn {turn}")

    def turn(self, number: int, restart: str | None = None) -> TurnResult:
        """Run the CLI for one turn (the first starts the conversation, later ones resume it)."""
        self.proxy.reset(number)
        argv = self.client.argv(self.binary, PROMPT.format(turn=number), self.session_id)
        t = TurnResult(number, restart)
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            t.stdout, t.stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            t.stdout, t.stderr = _kill_group(proc)
            t.failure = f"no answer in {self.timeout_s} s"
        finally:
            _kill_group(proc)  # whatever it left in its process group
            t.seconds = time.monotonic() - t0
        t.rc = proc.returncode
        t.session_id = self.client.session_id(t.stdout)
        if t.failure is None:
            t.failure = self.client.failure(t.stdout)
        if t.failure is None and t.session_id is None:
            t.failure = "no session id in its output"
        if t.failure is None and self.turns and t.session_id != self.session_id:
            t.failure = f"continued session {t.session_id}, not {self.session_id}"
        self.turns.append(t)
        return t

    def run(self, turns: int, restart_before: dict[int, str], restart: Callable[[str], None],
            progress: Callable[[str], None] = lambda _: None) -> list[TurnResult]:
        """Turns 1..`turns`, a restart before those `restart_before` names, an edit and a commit
        after each; stops at the first turn that fails (its result is the last one)."""
        for n in range(1, turns + 1):
            kind = restart_before.get(n)
            if kind:
                t0 = time.monotonic()
                restart(kind)
                progress(f"{kind} before turn {n}: ready after {time.monotonic() - t0:.1f} s")
            t = self.turn(n, kind)
            progress(f"turn {n}: {self.client.name} exit {t.rc} after {t.seconds:.1f} s"
                     + (f" ({t.failure})" if t.failure else ""))
            if not t.ok:
                break
            self.edit_and_commit(n)
        return self.turns


def _kill_group(proc: subprocess.Popen) -> tuple[str, str]:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        return "", ""
