"""`ember service install|uninstall|status` and `ember config show`, with real files in a temp HOME.

No systemd runs in CI: the units are rendered, written and checked with `systemd-analyze verify`,
and the @reboot crontab fallback runs against a stand-in `crontab` that keeps its table in a file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD_RUNNING = Path("/run/systemd/system").is_dir()


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "XDG_"))}
    env["HOME"] = str(home)
    env.update(extra)
    return env


def _svc(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.daemon.service", *args], env=_env(home, **env),
                          capture_output=True, text=True, timeout=60)


def _ember_exe() -> Path:
    return Path(sys.prefix) / "bin" / "ember"


def _unit_lines(text: str) -> set[str]:
    return {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}


REQUIRED = {"Type=notify", "WatchdogSec=30", "Restart=on-failure", "RestartSec=5", "KillMode=process",
            "StartLimitIntervalSec=600", "StartLimitBurst=5", "RestartPreventExitStatus=78"}


def test_dry_run_user_unit(tmp_path):
    r = _svc(tmp_path, "install", "--dry-run", "--via", "systemd")
    assert r.returncode == 0, r.stderr
    unit = tmp_path / ".config/systemd/user/ember.service"
    assert f"would write {unit}:" in r.stdout
    lines = _unit_lines(r.stdout)
    assert REQUIRED <= lines
    assert f"ExecStart={_ember_exe()} daemon run" in lines
    assert f"EnvironmentFile=-{tmp_path}/.config/ember/ember.env" in lines
    assert f"Environment=EMBER_CONFIG={tmp_path}/.config/ember/ember.toml" in lines
    assert "WantedBy=default.target" in lines and not any(ln.startswith("User=") for ln in lines)
    assert "would run: systemctl --user daemon-reload" in r.stdout
    assert "would run: systemctl --user enable ember.service" in r.stdout
    assert "loginctl enable-linger" in r.stdout
    assert not unit.exists() and not (tmp_path / ".config").exists()


def test_dry_run_system_unit(tmp_path):
    existed = Path("/etc/systemd/system/ember.service").exists()
    r = _svc(tmp_path, "install", "--system", "--dry-run", "--via", "systemd")
    assert r.returncode == 0, r.stderr
    assert "would write /etc/systemd/system/ember.service:" in r.stdout
    lines = _unit_lines(r.stdout)
    assert REQUIRED <= lines
    assert {"User=ember", "Group=ember", "WantedBy=multi-user.target", "After=network-online.target",
            "Environment=EMBER_CONFIG=/etc/ember/ember.toml", "Environment=EMBER_STATE_DIR=/var/lib/ember",
            "EnvironmentFile=-/etc/ember/ember.env"} <= lines
    assert "would run: systemctl daemon-reload" in r.stdout and "enable-linger" not in r.stdout
    assert Path("/etc/systemd/system/ember.service").exists() == existed


@pytest.mark.skipif(SYSTEMD_RUNNING, reason="systemd runs here: auto picks the unit")
def test_dry_run_auto_without_systemd_says_cron(tmp_path):
    r = _svc(tmp_path, "install", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "systemd is not running here, so an @reboot crontab entry runs `ember start`" in r.stdout
    assert "@reboot " in r.stdout and "# ember-autostart" in r.stdout and "Type=notify" in r.stdout
    assert not (tmp_path / ".config").exists()


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_units_pass_systemd_analyze_verify(tmp_path, monkeypatch, system):
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.skip("systemd-analyze is missing (Debian package systemd; .ci/run installs it)")
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in [k for k in os.environ if k.startswith(("EMBER_", "XDG_"))]:
        monkeypatch.delenv(k)
    from ember.daemon import service

    path = tmp_path / "ember.service"
    path.write_text(service.render_unit(system, _ember_exe()))
    r = subprocess.run([exe, "verify", str(path)], capture_output=True, text=True, timeout=60)
    bad = [ln for ln in (r.stdout + r.stderr).splitlines() if str(path) in ln or "ember.service" in ln]
    assert r.returncode == 0 and not bad, r.stdout + r.stderr


@pytest.mark.skipif(SYSTEMD_RUNNING, reason="would call the real systemctl")
def test_install_status_uninstall_writes_the_user_unit(tmp_path):
    unit = tmp_path / ".config/systemd/user/ember.service"
    assert _svc(tmp_path, "status").returncode == 3
    r = _svc(tmp_path, "install", "--via", "systemd")
    assert r.returncode == 0, r.stderr
    assert f"wrote {unit}" in r.stdout and "Type=notify" in unit.read_text()
    s = _svc(tmp_path, "status")
    assert s.returncode == 0 and f"systemd user unit {unit}" in s.stdout
    u = _svc(tmp_path, "uninstall")
    assert u.returncode == 0 and not unit.exists()


def _fake_crontab(tmp_path: Path) -> tuple[Path, Path]:
    bindir, table = tmp_path / "bin", tmp_path / "crontab.txt"
    bindir.mkdir()
    (bindir / "crontab").write_text(
        "#!/bin/sh\n"
        f'T="{table}"\n'
        'case "$1" in\n'
        '  -l) [ -f "$T" ] || { echo "no crontab for $USER" >&2; exit 1; }; cat "$T" ;;\n'
        '  -) cat > "$T" ;;\n'
        '  *) exit 2 ;;\n'
        "esac\n")
    (bindir / "crontab").chmod(0o755)
    return bindir, table


def test_cron_fallback_install_status_uninstall(tmp_path):
    bindir, table = _fake_crontab(tmp_path)
    table.write_text("0 3 * * * /usr/bin/backup\n")
    path = f"{bindir}:{os.environ['PATH']}"
    r = _svc(tmp_path, "install", "--via", "cron", PATH=path)
    assert r.returncode == 0, r.stderr
    assert "@reboot crontab entry" in r.stdout
    r = _svc(tmp_path, "install", "--via", "cron", PATH=path)  # idempotent
    lines = table.read_text().splitlines()
    assert lines[0] == "0 3 * * * /usr/bin/backup"
    ours = [ln for ln in lines if "# ember-autostart" in ln]
    assert len(ours) == 1
    assert ours[0].startswith("@reboot ") and f"{_ember_exe()} start --no-wait" in ours[0]
    assert f"EMBER_STATE_DIR={tmp_path}/.local/share/ember" in ours[0]
    s = _svc(tmp_path, "status", PATH=path)
    assert s.returncode == 0 and "@reboot crontab entry" in s.stdout
    u = _svc(tmp_path, "uninstall", PATH=path)
    assert u.returncode == 0 and "removed the @reboot crontab entry" in u.stdout
    assert table.read_text() == "0 3 * * * /usr/bin/backup\n"


def test_no_systemd_and_no_crontab_says_so(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _svc(tmp_path, "install", "--via", "cron", PATH=str(empty))
    assert r.returncode == 1
    assert "neither systemd nor crontab is available" in r.stderr and "will NOT start at boot" in r.stderr


# -- ember config show -----------------------------------------------------------------------------

def test_config_show_values_and_sources(tmp_path):
    conf = tmp_path / ".config/ember/ember.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text('port = 9123\napi_key = "sekrit"\n[daemon]\ncrash_keep = 7\nbackoff_max = "2m"\n')
    r = subprocess.run([sys.executable, "-m", "ember.daemon.service", "config", "show", "--json"], capture_output=True,
                       text=True, env=_env(tmp_path, EMBER_MAX_SEQS="3", EMBER_DAEMON_LOG_BACKUPS="2"), timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    w, d = out["worker"], out["daemon"]
    assert w["values"]["port"] == 9123 and w["sources"]["port"] == f"file {conf}"
    assert w["values"]["api_key"] == "***" and "sekrit" not in r.stdout
    assert w["values"]["max_seqs"] == 3 and w["sources"]["max_seqs"] == "env EMBER_MAX_SEQS"
    assert w["sources"]["kv_mem"] == "default"
    assert d["values"]["crash_keep"] == 7 and d["sources"]["crash_keep"] == f"file {conf} [daemon]"
    assert d["values"]["backoff_max"] == 120.0
    assert d["values"]["log_backups"] == 2 and d["sources"]["log_backups"] == "env EMBER_DAEMON_LOG_BACKUPS"
    assert d["sources"]["tick"] == "default"
    txt = subprocess.run([sys.executable, "-m", "ember.daemon.service", "config", "show"], capture_output=True,
                         text=True, env=_env(tmp_path), timeout=60)
    assert txt.returncode == 0 and f"config file: {conf}" in txt.stdout
    assert any(ln.split()[:2] == ["port", "9123"] and "file" in ln for ln in txt.stdout.splitlines())


def test_config_show_reports_a_bad_setting(tmp_path):
    conf = tmp_path / ".config/ember/ember.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text('port = 70000\n[daemon]\nfrobnicate = 1\n')
    r = subprocess.run([sys.executable, "-m", "ember.daemon.service", "config", "show"], capture_output=True,
                       text=True, env=_env(tmp_path), timeout=60)
    assert r.returncode == 1 and "port: 70000 is not a TCP port" in r.stdout and "frobnicate" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_config_show_and_service_do_not_import_the_worker(tmp_path):
    code = ("import sys, io, contextlib\n"
            "from ember.daemon import service, config_show\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    config_show.config_main(['show'])\n"
            "    service.service_main(['install', '--dry-run', '--via', 'systemd'])\n"
            "bad = [m for m in sys.modules if m.startswith(('ember.worker', 'ember.kernels', 'cuda'))]\n"
            "print(bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
