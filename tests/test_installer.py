"""installer/install.sh, run from the checkout into a temporary HOME as a user would.

One real install per module (pip into a fresh venv takes most of a minute); the tests then build on
it in order: fresh install, --start with a request answered, --start with EMBER_PORT (waits on that
port), the nohup fallback (--port beating EMBER_PORT), re-run as an upgrade while running (data
kept, restarted), --uninstall leaving only data and the receipt, --purge of what the receipt names.
Every process started is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "installer" / "install.sh"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMBER_", "XDG_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["HOME"] = str(home)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _install(home: Path, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=_env(home, **env), capture_output=True, text=True,
                          timeout=timeout, cwd=home)


def _ours(home: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(p.info.get("cmdline") or [])
        except Exception:
            continue
        if str(home) in cmd:
            out.append(p)
    return out


def _kill_ours(home: Path) -> list[str]:
    left = _ours(home)
    names = [" ".join(p.cmdline()[:4]) for p in left if p.is_running()]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=10)
    return names


class Install:
    def __init__(self, home: Path, port: int, model: Path):
        self.home, self.port, self.model = home, port, model
        self.prefix = home / ".local/share/ember"
        self.venv = self.prefix / "venv"
        self.link = home / ".local/bin/ember"
        self.conf = home / ".config/ember/ember.toml"
        self.receipt = self.prefix / "install-receipt.json"
        self.url = f"http://127.0.0.1:{port}"

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return _install(self.home, *args, **env)

    def piped(self, *args: str) -> subprocess.CompletedProcess:
        """As a user runs it: `curl ... | bash -s -- ARGS` (the script on bash's stdin)."""
        return subprocess.run(["bash", "-s", "--", *args], input=SCRIPT.read_text(), env=_env(self.home),
                              capture_output=True, text=True, timeout=600, cwd=self.home)

    def ember(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.link), *args], env=_env(self.home), capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture(scope="module")
def inst(tmp_path_factory, default_model_path):
    home = tmp_path_factory.mktemp("home")
    i = Install(home, _free_port(), default_model_path)
    r = i.run("--no-service", "--source", str(ROOT), "--model", str(default_model_path), "--port", str(i.port))
    i.first = r
    yield i
    if i.link.exists():
        i.ember("stop", timeout=90)
    left = _kill_ours(home)
    assert not left, f"processes left running: {left}"


def test_fresh_install(inst):
    r = inst.first
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for step in ("Checking this machine", "Installing ember", "Linking the ember command", "Config", "Done"):
        assert step in out
    assert "Boot service: skipped (--no-service)" in out
    assert os.path.realpath(inst.link) == str(inst.venv / "bin" / "ember")
    rec = json.loads(inst.receipt.read_text())
    assert rec["version"] == "0.1.0" and rec["source"] == str(ROOT) and rec["source_kind"] == "checkout"
    assert rec["mode"] == "user" and rec["service"] == "none" and rec["port"] == inst.port
    assert rec["paths"]["venv"] == str(inst.venv) and rec["paths"]["config"] == str(inst.conf)
    assert rec["options"]["model"] == str(inst.model)
    # what the installer made, so that --purge removes only that
    assert {str(inst.prefix), str(inst.conf.parent), str(inst.prefix / "kv"),
            str(inst.prefix / "logs")} <= set(rec["created"])
    text = inst.conf.read_text()
    assert "[daemon]" in text and f"port = {inst.port}" in text and f'model = "{inst.model}"' in text
    # the installed ember is a copy, not the checkout: the source tree got no build output
    v = inst.ember("--version")
    assert v.returncode == 0 and v.stdout.startswith("ember 0.1.0")
    import_path = subprocess.run([str(inst.venv / "bin/python"), "-c", "import ember.daemon as d; print(d.__file__)"],
                                 capture_output=True, text=True, env=_env(inst.home)).stdout
    assert import_path.startswith(str(inst.venv))
    # config show: values and where they came from, no import of the worker in the daemon process
    cs = subprocess.run([str(inst.venv / "bin/python"), "-m", "ember.daemon.service", "config", "show", "--json"],
                        capture_output=True, text=True, env=_env(inst.home))
    assert cs.returncode == 0, cs.stderr
    shown = json.loads(cs.stdout)
    assert shown["worker"]["values"]["port"] == inst.port
    assert shown["worker"]["sources"]["port"] == f"file {inst.conf}"
    assert shown["worker"]["sources"]["max_seqs"] == "default"
    assert shown["daemon"]["sources"]["crash_keep"] == "default"


def test_start_serves_a_request_then_stops(inst):
    (inst.prefix / "kv" / "keep.blk").write_bytes(b"kv")
    r = inst.run("--no-service", "--start", "--source", str(ROOT))
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"ember is serving at {inst.url}" in r.stdout
        assert "curl -s " + inst.url + "/v1/chat/completions" in r.stdout
        # the printed curl example, run as printed
        cmd = r.stdout.split("Try it:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
        c = subprocess.run(["bash", "-c", cmd.strip().replace("curl -s", "curl -s -m 120", 1)],
                           capture_output=True, text=True, timeout=150) if shutil.which("curl") else None
        if c is not None:
            assert c.returncode == 0 and '"chat.completion"' in c.stdout, c.stdout + c.stderr
        resp = httpx.post(inst.url + "/v1/chat/completions", timeout=120, json={
            "model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] is not None
        st = inst.ember("status")
        assert st.returncode == 0 and "ready" in st.stdout
    finally:
        s = inst.ember("stop", timeout=90)
    assert s.returncode == 0 and "stopped" in s.stdout, s.stdout + s.stderr
    assert not _ours(inst.home), "ember stop left processes"
    assert (inst.prefix / "kv" / "keep.blk").exists()


def _serves(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def test_start_waits_on_the_port_from_ember_port(inst):
    """EMBER_PORT beats the config's port for the ember the installer starts, and the installer waits
    on that port (it used to wait on the config's, for EMBER_START_TIMEOUT, and fail)."""
    other = _free_port()
    r = inst.run("--no-service", "--start", "--source", str(ROOT), EMBER_PORT=str(other), EMBER_START_TIMEOUT="150")
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"waiting for http://127.0.0.1:{other}/health/ready" in r.stdout
        assert f"ember is serving at http://127.0.0.1:{other}" in r.stdout
        assert _serves(other) and not _serves(inst.port)
        # said plainly: the variable lasts for this start only, the config keeps its port
        assert f"EMBER_PORT={other} applies to the ember this run starts" in r.stderr
        assert f"port = {inst.port}" in inst.conf.read_text()
        assert json.loads(inst.receipt.read_text())["port"] == other
    finally:
        s = inst.ember("stop", timeout=90)
    assert s.returncode == 0, s.stdout + s.stderr
    assert not _ours(inst.home)


def test_start_fallback_without_ember_start(inst):
    """An ember whose CLI has no `start` yet: the worker runs under nohup with a pid file, and says so.
    --port is a flag and beats EMBER_PORT, as everywhere in ember."""
    other = _free_port()
    r = inst.run("--no-service", "--start", "--source", str(ROOT), "--port", str(inst.port),
                 EMBER_INSTALL_START="nohup", EMBER_PORT=str(other))
    pidfile = inst.prefix / "run" / "worker-nohup.pid"
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "starting the worker directly in the background with nohup" in r.stdout
        assert f"ember is serving at {inst.url}" in r.stdout
        resp = httpx.post(inst.url + "/v1/completions", timeout=120, json={"model": "x", "prompt": "Hi",
                                                                           "max_tokens": 2})
        assert resp.status_code == 200
        assert not _serves(other)
    finally:
        pid = int(pidfile.read_text())
        p = psutil.Process(pid)
        p.terminate()
        p.wait(60)
    assert not _ours(inst.home)


def test_rerun_upgrades_in_place_keeping_data_and_restarting(inst):
    crash = inst.prefix / "crashes" / "20260101T000000Z-crash-test"
    crash.mkdir(parents=True, exist_ok=True)
    (crash / "meta.json").write_text("{}")
    with open(inst.conf, "a") as f:
        f.write("# my own edit\n")
    (inst.prefix / "kv" / "keep.blk").write_bytes(b"kv")
    assert inst.ember("start", timeout=200).returncode == 0
    try:
        before = json.loads(inst.receipt.read_text())
        r = inst.piped("--no-service", "--source", str(ROOT))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "Upgrading the install in place" in r.stdout
        assert "stopped ember" in r.stdout and "starting it again" in r.stdout
        assert "kept the existing config" in r.stdout
        assert httpx.get(inst.url + "/health/ready", timeout=10).status_code == 200
        after = json.loads(inst.receipt.read_text())
        assert after["installed_at"] == before["installed_at"] and after["previous_version"] == "0.1.0"
    finally:
        inst.ember("stop", timeout=90)
    assert "# my own edit" in inst.conf.read_text()
    assert (inst.prefix / "kv" / "keep.blk").read_bytes() == b"kv"
    assert (crash / "meta.json").exists()
    assert not _ours(inst.home)


def test_uninstall_leaves_only_data(inst):
    assert inst.ember("start", timeout=200).returncode == 0  # uninstall stops a running ember too
    r = inst.run("--uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not _ours(inst.home), "uninstall left processes"
    assert not inst.venv.exists() and not inst.link.exists()
    assert inst.conf.exists() and (inst.prefix / "kv" / "keep.blk").exists()
    assert (inst.prefix / "crashes" / "20260101T000000Z-crash-test" / "meta.json").exists()
    left = {p.name for p in inst.prefix.iterdir()}
    assert left <= {"kv", "crashes", "logs", "run", "install-receipt.json"}, left
    assert "kept: config" in r.stdout
    # the receipt stays with the data: a later --purge reads from it what is ember's
    rec = json.loads(inst.receipt.read_text())
    assert rec["uninstalled_at"] and str(inst.prefix) in rec["created"]


def test_purge_removes_data(inst):
    """--purge removes the dirs the receipt names as the installer's, whatever this shell's
    EMBER_STATE_DIR says; other programs' data next to them stays."""
    share = inst.home / ".local" / "share"
    for d in ("other-app", "logs"):
        (share / d).mkdir(parents=True, exist_ok=True)
        (share / d / "keep.txt").write_text("not ember's\n")
    r = inst.run("--uninstall", "--purge", EMBER_STATE_DIR=str(share))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"the data directory is {inst.prefix} (from the receipt)" in r.stdout
    assert not inst.prefix.exists() and not inst.conf.parent.exists()
    assert not (inst.home / ".cache" / "ember").exists()
    assert (share / "other-app" / "keep.txt").exists() and (share / "logs" / "keep.txt").exists()


# -- no install needed -----------------------------------------------------------------------------

def test_no_source_fails_with_the_reason(tmp_path):
    r = _install(tmp_path, "--no-service", timeout=60)
    assert r.returncode != 0
    assert "no ember release is published yet" in r.stderr and "--source" in r.stderr
    assert not (tmp_path / ".local" / "share" / "ember" / "venv").exists()


def test_bad_options_fail_with_the_reason(tmp_path):
    r = _install(tmp_path, "--frobnicate", timeout=30)
    assert r.returncode == 1 and "unknown option: --frobnicate" in r.stderr
    r = _install(tmp_path, "--source", str(tmp_path / "nope"), timeout=60)
    assert r.returncode == 1 and "no such file or directory" in r.stderr
    r = _install(tmp_path, "--purge", timeout=30)
    assert r.returncode == 1 and "--purge only goes with --uninstall" in r.stderr
    r = _install(tmp_path, "--no-service", "--source", str(ROOT), timeout=60, EMBER_MIN_FREE_MB="999999999")
    assert r.returncode == 1 and "ember needs at least" in r.stderr
    assert not (tmp_path / ".local").exists()


def test_piped_through_bash_and_partial_download_runs_nothing(tmp_path):
    text = SCRIPT.read_bytes()
    r = subprocess.run(["bash", "-s", "--", "--help"], input=text, env=_env(tmp_path), capture_output=True, timeout=30)
    assert r.returncode == 0 and b"--start" in r.stdout
    for cut in (len(text) // 3, len(text) // 2, len(text) - 30):
        r = subprocess.run(["bash", "-s", "--", "--no-service", "--source", str(ROOT)], input=text[:cut],
                           env=_env(tmp_path), capture_output=True, timeout=30)
        assert r.returncode != 0
        assert b"Checking this machine" not in r.stdout
    assert not (tmp_path / ".local").exists() and not (tmp_path / ".config").exists()


def test_script_shape():
    text = SCRIPT.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines[-1] == 'ember_install "$@"'
    assert "    set -eu" in text
    # nothing but comments and the one function at the top level
    body = text.split("\nember_install() {", 1)[0]
    assert all(ln.startswith("#") or not ln.strip() for ln in body.splitlines())


def test_shellcheck_clean():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (.ci/run installs it: apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", "--shell=bash", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_example_config_matches_what_the_installer_writes():
    text = SCRIPT.read_text()
    embedded = text.split("write_config() {\n        cat <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0] + "\n"
    assert (ROOT / "installer" / "ember.toml.example").read_text() == embedded
    import tomllib

    data = tomllib.loads(embedded)
    assert data["port"] == 8080 and data["host"] == "127.0.0.1" and "daemon" in data


def test_gpu_check_picks_the_cuda_extra(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.65.06'\n")
    smi.chmod(0o755)
    path = f"{bindir}:{os.environ['PATH']}"
    r = _install(tmp_path, "--no-service", "--source", str(tmp_path / "nope"), timeout=60, PATH=path)
    assert "gpu: NVIDIA H200, 580.65.06 (the cuda extra will be installed)" in r.stdout
    assert r.returncode == 1 and "no such file or directory" in r.stderr  # stops at the source, after the checks
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    r = _install(tmp_path, "--no-service", "--source", str(tmp_path / "nope"), timeout=60, PATH=path)
    assert "nvidia-smi is installed but does not answer" in r.stderr
    r = _install(tmp_path, "--cpu", "--no-service", "--source", str(tmp_path / "nope"), timeout=60, PATH=path)
    assert "installing the CPU build" in r.stdout
