"""Hardening of the installer and the daemon's paths, each checked by running the real thing.

- `install.sh --uninstall --purge` refuses a state dir that is not ember's own, and removes nothing.
- `set -o pipefail` is in effect: a pipeline whose first stage fails (while its last one succeeds)
  now stops the install.
- The short socket dir under /tmp (used when <state>/run is too long a path for a unix socket) is
  used only while it is ours: a real directory, owned by us, mode 0700.

No install (pip) happens here: each run of install.sh stops before or just after creating its venv.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from ember.daemon.paths import Layout, UnsafeSocketDir

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "installer" / "install.sh"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMBER_", "XDG_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["HOME"] = str(home)
    env.update(extra)
    return env


def _install(home: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=_env(home, **env), capture_output=True, text=True,
                          timeout=timeout, cwd=home)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its content (None for dirs and links): what 'nothing deleted' compares."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


# -- --purge refuses what is not ember's own -------------------------------------------------------

def _populated_home(tmp_path: Path) -> Path:
    """A HOME whose ~/.local/share holds other programs' data, including dirs named like ember's."""
    home = tmp_path / "home"
    share = home / ".local" / "share"
    for d in ("other-app", "logs", "kv", "run"):
        (share / d).mkdir(parents=True)
        (share / d / "keep.txt").write_text(f"not ember's: {d}\n")
    conf = home / ".config" / "ember"
    conf.mkdir(parents=True)
    (conf / "ember.toml").write_text("port = 8080\n")
    (home / "notes.txt").write_text("mine\n")
    return home


@pytest.mark.parametrize("state", ["share", "home", "link"])
def test_purge_refuses_a_state_dir_that_is_not_embers(tmp_path, state):
    home = _populated_home(tmp_path)
    target = tmp_path / "elsewhere" / "ember"
    target.mkdir(parents=True)
    (target / "keep.txt").write_text("behind a link\n")
    (home / "data").mkdir()
    (home / "data" / "ember").symlink_to(target)
    state_dir = {"share": home / ".local" / "share", "home": home, "link": home / "data" / "ember"}[state]
    before, before_target = _tree(home), _tree(target)

    r = _install(home, "--uninstall", "--purge", EMBER_STATE_DIR=str(state_dir))

    assert r.returncode != 0, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"ember-install: error: refusing to purge {state_dir}: ")
    assert errors[0].endswith("nothing was removed")
    why = {"share": "not ember's own directory", "home": "your home directory", "link": "it is a symlink"}[state]
    assert why in errors[0]
    assert "Stopping ember" not in r.stdout  # refused before the uninstall touched anything
    assert _tree(home) == before and _tree(target) == before_target


def test_purge_refuses_a_config_dir_that_is_a_symlink(tmp_path):
    home = tmp_path / "home"
    real = tmp_path / "dotfiles" / "ember"
    real.mkdir(parents=True)
    (real / "ember.toml").write_text("port = 8080\n")
    (home / ".config").mkdir(parents=True)
    (home / ".config" / "ember").symlink_to(real)
    state = home / ".local" / "share" / "ember"
    (state / "kv").mkdir(parents=True)
    (state / "kv" / "block").write_bytes(b"kv")
    before, before_real = _tree(home), _tree(real)
    r = _install(home, "--uninstall", "--purge")
    assert r.returncode != 0
    assert f"refusing to purge {home / '.config' / 'ember'}: it is a symlink" in r.stderr
    assert _tree(home) == before and _tree(real) == before_real


def test_purge_of_a_dir_named_ember_without_a_receipt_removes_only_embers_entries(tmp_path):
    """No receipt: a dir named ember is purged of ember's entries only, and kept while it holds others."""
    home = tmp_path / "home"
    state = home / "data" / "ember"
    for d in ("kv", "crashes", "logs", "run"):
        (state / d).mkdir(parents=True)
        (state / d / "x").write_text("ember's\n")
    (state / "my-notes.txt").write_text("the user's own\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("never touched\n")
    (state / "logs" / "link-out").symlink_to(outside)
    r = _install(home, "--uninstall", "--purge", EMBER_STATE_DIR=str(state))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in state.iterdir()) == ["my-notes.txt"]
    assert "kept the dir, which holds files that are not ember's: my-notes.txt" in r.stdout
    assert (outside / "precious").read_text() == "never touched\n"


# -- pipefail --------------------------------------------------------------------------------------

def _failing_after(tmp_path: Path, tool: str, when: str) -> str:
    """PATH with a `tool` that does its real work and then exits 2 when its arguments match `when`:
    a first pipeline stage that fails after writing all of its output."""
    real = shutil.which(tool)
    assert real, f"{tool} is not installed"
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / tool
    wrapper.write_text("#!/bin/sh\n"
                       f'"{real}" "$@" || exit $?\n'
                       f'case " $* " in *"{when}"*) echo "{tool}: simulated late failure" >&2; exit 2 ;; esac\n')
    wrapper.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


def test_pipefail_a_failing_df_stops_the_checks(tmp_path):
    """`df | awk`: awk succeeds on df's complete output, so only pipefail sees df's failure."""
    path = _failing_after(tmp_path, "df", "-Pk")
    r = _install(tmp_path, "--no-service", "--source", str(tmp_path / "nope"), timeout=60, PATH=path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "df: simulated late failure" in r.stderr
    assert "ember-install: error: could not read the free disk space of" in r.stderr
    assert "disk:" not in r.stdout and "no such file or directory" not in r.stderr


def test_pipefail_a_checkout_copy_that_fails_stops_the_install(tmp_path):
    """`tar -c | tar -x`: the receiving tar gets a complete archive and succeeds; the sending tar's
    failure alone must stop the install before anything is built from the copy."""
    path = _failing_after(tmp_path, "tar", "-cf - .")
    r = _install(tmp_path, "--no-service", "--cpu", "--source", str(ROOT), timeout=300, PATH=path,
                 EMBER_PIP_ARGS="--no-index")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "tar: simulated late failure" in r.stderr
    assert f"ember-install: error: could not copy the checkout {ROOT}" in r.stderr
    assert "installing ember-" not in r.stdout and "installed ember" not in r.stdout


# -- the socket dir under /tmp ---------------------------------------------------------------------

@pytest.fixture
def long_layout(tmp_path):
    """A Layout whose run/ is too long a path for a unix socket, so its sockets go to /tmp/ember-*."""
    lay = Layout(tmp_path / ("d" * 90))
    sock_dir = lay.socket_dir_path()
    assert sock_dir != lay.run and sock_dir.parent == Path(tempfile.gettempdir())
    yield lay, sock_dir
    if sock_dir.is_symlink() or sock_dir.is_file():
        sock_dir.unlink()
    elif sock_dir.exists():
        shutil.rmtree(sock_dir)


def test_socket_dir_is_made_private(long_layout):
    lay, sock_dir = long_layout
    assert not os.path.lexists(sock_dir)
    assert lay.sockets == sock_dir  # absent: fine to name
    lay.ensure()
    st = os.lstat(sock_dir)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert lay.control_sock.parent == sock_dir


def test_socket_dir_our_symlink_is_replaced_and_its_target_untouched(long_layout, tmp_path):
    lay, sock_dir = long_layout
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    (target / "daemon.sock").write_text("not a socket")
    sock_dir.symlink_to(target)
    with pytest.raises(UnsafeSocketDir, match="not a directory"):
        _ = lay.sockets
    lay.ensure()
    assert not sock_dir.is_symlink() and sock_dir.is_dir()
    assert stat.S_IMODE(os.lstat(sock_dir).st_mode) == 0o700 and list(sock_dir.iterdir()) == []
    assert (target / "daemon.sock").read_text() == "not a socket"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755


def test_socket_dir_open_to_others_is_refused_then_recreated(long_layout):
    lay, sock_dir = long_layout
    sock_dir.mkdir()
    sock_dir.chmod(0o777)
    (sock_dir / "daemon.sock").write_text("planted")
    with pytest.raises(UnsafeSocketDir, match="mode 0777"):
        _ = lay.control_sock
    lay.ensure()
    assert stat.S_IMODE(os.lstat(sock_dir).st_mode) == 0o700 and list(sock_dir.iterdir()) == []
    # readable by others but writable by no one else: kept, and closed
    sock_dir.chmod(0o755)
    (sock_dir / "kept").write_text("ours")
    lay.ensure()
    assert stat.S_IMODE(os.lstat(sock_dir).st_mode) == 0o700 and (sock_dir / "kept").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a dir owned by another user needs root")
@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_socket_dir_of_another_user_is_refused(long_layout, tmp_path, kind):
    lay, sock_dir = long_layout
    other = 65534  # nobody
    if kind == "dir":
        sock_dir.mkdir(mode=0o700)
        os.chown(sock_dir, other, other)
    else:
        sock_dir.symlink_to(tmp_path)
        os.lchown(sock_dir, other, other)
    with pytest.raises(UnsafeSocketDir, match=f"belongs to uid {other}"):
        lay.ensure()
    with pytest.raises(UnsafeSocketDir, match=f"belongs to uid {other}"):
        _ = lay.supervisor_sock
    assert os.lstat(sock_dir).st_uid == other  # left as it was
