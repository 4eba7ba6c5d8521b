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
    assert lines >= REQUIRED
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
    assert lines >= REQUIRED
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
    assert r.returncode == 78 and "port: 70000 is not a TCP port" in r.stdout and "frobnicate" in r.stdout
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


# -- the system unit's sandbox ---------------------------------------------------------------------

HARDENING = {"ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "ProtectKernelTunables=yes",
             "ProtectKernelModules=yes", "ProtectControlGroups=yes", "RestrictSUIDSGID=yes", "LockPersonality=yes",
             "UMask=0077", "NoNewPrivileges=yes", "ReadWritePaths=/var/lib/ember", "Environment=HOME=/var/lib/ember"}


def _system_unit(tmp_path: Path, monkeypatch, conf_text: str | None = None, state: Path | None = None) -> str:
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in [k for k in os.environ if k.startswith(("EMBER_", "XDG_"))]:
        monkeypatch.delenv(k)
    if conf_text is not None:
        conf = tmp_path / "ember.toml"
        conf.write_text(conf_text)
        monkeypatch.setenv("EMBER_CONFIG", str(conf))
    if state is not None:
        monkeypatch.setenv("EMBER_STATE_DIR", str(state))
    from ember.daemon import service

    return service.render_unit(True, _ember_exe())


def _analyze(unit: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.skip("systemd-analyze is missing (Debian package systemd; .ci/run installs it)")
    return subprocess.run([exe, *args, str(unit)], capture_output=True, text=True, timeout=60)


def test_system_unit_is_sandboxed_and_keeps_the_gpu(tmp_path, monkeypatch):
    text = _system_unit(tmp_path, monkeypatch)
    lines = _unit_lines(text)
    assert lines >= HARDENING, HARDENING - lines
    # the GPU stays reachable: no private /dev, no device allow-list (ProtectClock= implies one on older systemd)
    for key in ("PrivateDevices=", "DevicePolicy=", "DeviceAllow=", "ProtectClock="):
        assert not any(ln.startswith(key) for ln in lines), key
    path = tmp_path / "ember.service"
    path.write_text(text)
    r = _analyze(path, "verify")
    bad = [ln for ln in (r.stdout + r.stderr).splitlines() if str(path) in ln or "ember.service" in ln]
    assert r.returncode == 0 and not bad, r.stdout + r.stderr


def test_user_unit_is_not_sandboxed(tmp_path, monkeypatch):
    """User units cannot set most of these (no mount namespace without user namespaces): none is written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in [k for k in os.environ if k.startswith(("EMBER_", "XDG_"))]:
        monkeypatch.delenv(k)
    from ember.daemon import service

    lines = _unit_lines(service.render_unit(False, _ember_exe()))
    assert not any(ln.startswith(("ProtectSystem=", "ReadWritePaths=", "PrivateTmp=", "User=")) for ln in lines)


def test_system_unit_security_exposure(tmp_path, monkeypatch):
    path = tmp_path / "ember.service"
    path.write_text(_system_unit(tmp_path, monkeypatch))
    r = _analyze(path, "security", "--offline=yes", "--no-pager")
    if "--offline" in r.stderr and "unrecognized" in r.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    verdict = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln]
    assert verdict, r.stdout[-2000:] + r.stderr
    score = float(verdict[0].split(":", 1)[1].split()[0])
    # 9.0 before the sandbox; docs/operations.md's Security section quotes the figure
    assert score <= 3.0, verdict[0]


def test_system_unit_makes_configured_paths_reachable(tmp_path, monkeypatch):
    """A kv_dir outside the state dir is writable ("-": it may not exist yet); a model in a home makes
    /home read-only rather than hidden."""
    text = _system_unit(tmp_path, monkeypatch, 'model = "/home/alice/models/m.gguf"\nkv_dir = "/data/ember kv"\n')
    lines = _unit_lines(text)
    assert 'ReadWritePaths=/var/lib/ember "-/data/ember kv"' in lines
    assert "ProtectHome=read-only" in lines and "ProtectHome=yes" not in lines
    path = tmp_path / "ember.service"
    path.write_text(text)
    r = _analyze(path, "verify")
    assert r.returncode == 0, r.stdout + r.stderr
    # a kv_dir inside the state dir needs nothing more
    lines = _unit_lines(_system_unit(tmp_path, monkeypatch, 'kv_dir = "/var/lib/ember/kv2"\n'))
    assert "ReadWritePaths=/var/lib/ember" in lines and "ProtectHome=yes" in lines


def test_system_unit_with_sockets_in_tmp_shares_tmp(tmp_path, monkeypatch):
    """A state path too long for a unix socket puts the sockets in /tmp/ember-*, which the CLI outside
    the service must reach: no private /tmp then, and /tmp writable."""
    import tempfile

    state = tmp_path / ("s" * 100)
    lines = _unit_lines(_system_unit(tmp_path, monkeypatch, state=state))
    assert "PrivateTmp=yes" not in lines
    assert f"ReadWritePaths={tempfile.gettempdir()}" in lines and f"ReadWritePaths={state}" in lines
