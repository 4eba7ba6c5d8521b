"""Shared helpers of the agent CLI tests (tests/test_agent_clients.py, tests/test_agent_sessions.py; no
tests here): where the pinned CLIs are installed, and the skip or failure when one is missing or wrong."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ember.worker.bench.agent_clients import AgentClient

AGENTS = Path(__file__).parent / "agents"
MODULES = AGENTS / "node_modules"


def pinned(package: str) -> str:
    manifest = json.loads((AGENTS / "package.json").read_text())
    return {**manifest["dependencies"], **manifest.get("optionalDependencies", {})}[package]


def need_cli(client: AgentClient, home: Path) -> Path:
    """The client's binary. Skip when the CLI is not installed; when it is, it must run and be the
    pinned version."""
    binary = client.binary(MODULES)
    if not binary.exists():
        pytest.skip(f"{client.package}@{pinned(client.package)} is not installed in tests/agents/node_modules: run "
                    "`npm ci --prefix tests/agents` (.ci/run does when the npm registry answers)")
    home.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60, cwd=home,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)})
    assert r.returncode == 0 and pinned(client.package) in r.stdout + r.stderr, \
        f"{binary} --version: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return binary
