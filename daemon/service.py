"""`ember service install|uninstall|status [--system] [--dry-run]`: start ember at boot.

Where systemd runs (/run/systemd/system exists), a unit for the daemon: a user unit in
~/.config/systemd/user/ember.service (plus the hint to enable lingering, so it starts at boot
without a login), or with --system a system unit in /etc/systemd/system/ember.service that runs as
the user `ember` in a sandbox (the OS read-only, only the state dir writable, the GPUs reachable;
see `_sandbox`). Where it does not (containers, WSL), an `@reboot` line in the crontab that runs
`ember start`. The command says plainly which one it chose; --dry-run prints what would be written
and run, and changes nothing.

Runnable without the `ember` hook too: `python -m ember.daemon.service install` (the installer
uses that form). EMBER_SERVICE_UNIT_FILE and EMBER_SERVICE_ENV_FILE override the unit and
environment-file paths (the installer passes the ones it chose).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ember.ops import contract
from ember.ops.contract import ExitCode

UNIT_NAME = "ember.service"
CRON_MARK = "# ember-autostart"
SYSTEM_USER = "ember"
EX_OK, EX_FAIL, EX_NOT_INSTALLED = ExitCode.OK, ExitCode.FAILURE, ExitCode.NOT_INSTALLED


# -- where things are ------------------------------------------------------------------------------

def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def ember_executable() -> Path:
    """The `ember` of this installation (the venv's), as an absolute path."""
    cand = Path(sys.prefix) / "bin" / "ember"
    if cand.exists():
        return cand
    found = shutil.which("ember")
    return Path(found).resolve() if found else cand


def unit_path(system: bool) -> Path:
    if os.environ.get("EMBER_SERVICE_UNIT_FILE"):
        return Path(os.environ["EMBER_SERVICE_UNIT_FILE"]).expanduser()
    if system:
        return Path("/etc/systemd/system") / UNIT_NAME
    return contract.xdg_home("config") / "systemd" / "user" / UNIT_NAME


def _config(system: bool) -> Path:
    return contract.config_file(system=system or None)  # --system: /etc/ember unless EMBER_CONFIG says


def _state(system: bool) -> Path:
    return contract.state_dir(system=system or None)  # --system: /var/lib/ember unless EMBER_STATE_DIR says


def env_file_path(system: bool) -> Path:
    if os.environ.get("EMBER_SERVICE_ENV_FILE"):
        return Path(os.environ["EMBER_SERVICE_ENV_FILE"]).expanduser()
    return _config(system).parent / "ember.env"


def _sd_quote(value: str) -> str:
    """A value for a systemd setting line (quoted when it holds spaces or quotes)."""
    if value and all(c not in value for c in ' \t"\'\\'):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _sd_exec(path: Path) -> str:
    s = str(path)
    return _sd_quote(s) if " " in s else s


# -- the unit --------------------------------------------------------------------------------------

def render_unit(system: bool, ember: Path | None = None) -> str:
    ember = ember or ember_executable()
    conf, state, envf = _config(system), _state(system), env_file_path(system)
    lines = [
        "# ember: the supervising daemon and its inference worker (written by `ember service install`).",
        "# Edit ember.toml for settings; `ember service install` rewrites this file.",
        "[Unit]",
        "Description=ember LLM host (daemon supervising the inference worker)",
    ]
    if system:
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += [
        # the circuit breaker of systemd itself: at most 5 starts in 10 minutes (the daemon has its own)
        "StartLimitIntervalSec=600",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={_sd_exec(ember)} daemon run",
        f"Environment={_sd_quote(f'{contract.ENV_CONFIG}={conf}')}",
        f"Environment={_sd_quote(f'{contract.ENV_STATE_DIR}={state}')}",
        "Environment=PYTHONUNBUFFERED=1",
        f"EnvironmentFile=-{envf}",
        "WatchdogSec=30",
        "Restart=on-failure",
        "RestartSec=5",
        # a configuration error; restarting cannot fix it
        f"RestartPreventExitStatus={ExitCode.CONFIG}",
        "TimeoutStartSec=600",
        "TimeoutStopSec=120",
        # SIGTERM to the daemon (it drains and stops the worker), SIGKILL to what is left after the timeout
        # process, not mixed: if the daemon itself dies, supervisord and the worker keep serving and
        # the restarted daemon re-attaches (issue 4); `systemctl stop` still stops everything, since
        # the daemon drains the worker and stops supervisord on SIGTERM
        "KillMode=process",
    ]
    if system:
        lines += [
            f"User={SYSTEM_USER}",
            f"Group={SYSTEM_USER}",
            f"WorkingDirectory={state}",
            # HOME is the state dir, as the installer gives the user: caches (~/.cache/ember, the CUDA
            # driver's ~/.nv) stay inside the one writable tree
            f"Environment={_sd_quote('HOME=' + str(state))}",
            "LimitNOFILE=65536",
            *_sandbox(conf, state),
        ]
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if system else 'default.target'}", ""]
    return "\n".join(lines)


# Under these roots a model or KV dir needs ProtectHome=read-only instead of an unreachable home.
_HOME_ROOTS = ("/home", "/root", "/run/user")


def _configured_paths(conf: Path) -> tuple[list[Path], list[Path]]:
    """(paths the worker reads, paths it writes) named in ember.toml: the model, kv_dir, a log_file."""
    import tomllib

    try:
        data = tomllib.loads(conf.read_text())
    except (OSError, ValueError):
        return [], []
    worker = data.get("worker", data) if isinstance(data.get("worker", data), dict) else {}
    daemon = data.get("daemon", {}) if isinstance(data.get("daemon"), dict) else {}
    reads = [Path(str(v)).expanduser() for v in (worker.get("model"), daemon.get("log_file")) if v]
    writes = [Path(str(worker["kv_dir"])).expanduser()] if worker.get("kv_dir") else []
    return [p for p in reads if p.is_absolute()], [p for p in writes if p.is_absolute()]


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _sandbox(conf: Path, state: Path) -> list[str]:
    """The system unit's sandbox: a read-only OS, one writable tree (the state dir), GPUs kept.

    Device access stays open on purpose: PrivateDevices=, DevicePolicy= and ProtectClock= (which
    implies a device allow-list on older systemd) would cut the worker off /dev/nvidia*, whose
    device numbers (nvidia-uvm is dynamic and appears on first use) a DeviceAllow= list cannot
    name reliably. A kv_dir outside the state dir, named in ember.toml, is made writable too;
    after moving it, run `ember service install --system` again."""
    from .paths import Layout

    reads, writes = _configured_paths(conf)
    rw = [state] + [p for p in writes if not _under(p, state)]
    lines = [
        "# sandbox: the OS read-only, the state dir (and a kv_dir set in ember.toml) writable; GPU devices kept",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        # "-": a kv_dir that does not exist yet does not stop the service from starting
        "ReadWritePaths=" + " ".join(_sd_quote(str(p) if p == state else "-" + str(p)) for p in rw),
    ]
    if any(_under(p, Path(r)) for p in reads + writes for r in _HOME_ROOTS):
        lines.append("ProtectHome=read-only")  # the model or the KV files live in a home directory
    else:
        lines.append("ProtectHome=yes")
    lay = Layout(state)
    if lay.socket_dir_path() == lay.run:
        lines.append("PrivateTmp=yes")
    else:
        # the state path is too long for a unix socket, so the sockets live in /tmp/ember-*, where the
        # `ember` CLI must reach them: the shared /tmp, writable
        lines.append(f"ReadWritePaths={_sd_quote(str(Path(lay.socket_dir_path()).parent))}")
    lines += [
        "PrivateMounts=yes",
        "ProtectProc=invisible",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectHostname=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "LockPersonality=yes",
        "SystemCallArchitectures=native",
        "CapabilityBoundingSet=",
        # only groups an inference server never calls; a blocked call fails with EPERM, nothing is killed
        # (@debug stays allowed: pidfd_getfd and perf_event_open serve GPU IPC and profilers)
        "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap",
        "SystemCallErrorNumber=EPERM",
        "UMask=0077",
    ]
    return lines


# -- the cron fallback -----------------------------------------------------------------------------

def cron_line(system: bool, ember: Path | None = None) -> str:
    ember = ember or ember_executable()
    state = _state(system)
    log = state / "logs" / "boot.log"
    env = (f"{contract.ENV_CONFIG}={shlex.quote(str(_config(system)))} "
           f"{contract.ENV_STATE_DIR}={shlex.quote(str(state))}")
    cmd = f"@reboot {env} {shlex.quote(str(ember))} start --no-wait >> {shlex.quote(str(log))} 2>&1 {CRON_MARK}"
    return cmd.replace("%", "\\%")  # % is a newline to cron


def _crontab_argv(system: bool) -> list[str]:
    return ["crontab", "-u", SYSTEM_USER] if system else ["crontab"]


def _read_crontab(system: bool) -> str | None:
    """The crontab text ('' when there is none); None when crontab is not installed."""
    if not shutil.which("crontab"):
        return None
    r = subprocess.run([*_crontab_argv(system), "-l"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def _write_crontab(system: bool, text: str) -> None:
    r = subprocess.run([*_crontab_argv(system), "-"], input=text, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"crontab - failed: {r.stderr.strip()}")


def _cron_daemon_running() -> bool:
    try:
        import psutil

        for p in psutil.process_iter(["name"]):
            if (p.info.get("name") or "") in ("cron", "crond", "busybox", "cronie"):
                return True
    except Exception:
        pass
    return False


# -- verbs -----------------------------------------------------------------------------------------

def _systemctl(system: bool, *args: str) -> list[str]:
    return ["systemctl", *([] if system else ["--user"]), *args]


def _run(argv: list[str], dry: bool) -> int:
    print(("would run: " if dry else "running: ") + " ".join(shlex.quote(a) for a in argv))
    if dry:
        return 0
    r = subprocess.run(argv)
    return r.returncode


def _choose(via: str) -> str:
    if via != "auto":
        return via
    return "systemd" if systemd_running() else "cron"


def _linger_hint() -> None:
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    enabled = False
    if user and shutil.which("loginctl"):
        r = subprocess.run(["loginctl", "show-user", user, "-p", "Linger", "--value"], capture_output=True, text=True)
        enabled = r.stdout.strip() == "yes"
    if not enabled:
        print("note: a user unit starts at boot only with lingering on; run once:\n"
              f"  loginctl enable-linger {user or '$USER'}")


def cmd_install(args: argparse.Namespace) -> int:
    system, dry = args.system, args.dry_run
    if system and os.geteuid() != 0 and not dry:
        print("ember service: --system needs root (sudo ember service install --system)", file=sys.stderr)
        return EX_FAIL
    via = _choose(args.via)
    ember = ember_executable()
    scope = "system" if system else "user"
    if via == "systemd":
        path, text = unit_path(system), render_unit(system, ember)
        print(f"autostart: systemd {scope} unit {path}"
              + ("" if systemd_running() else " (systemd is not running here)"))
        if dry:
            print(f"would write {path}:\n" + "-" * 60 + f"\n{text}" + "-" * 60)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            print(f"wrote {path}")
        if systemd_running() or dry:
            if _run(_systemctl(system, "daemon-reload"), dry) != 0:
                print("ember service: systemctl daemon-reload failed", file=sys.stderr)
                return EX_FAIL
            if _run(_systemctl(system, "enable", UNIT_NAME), dry) != 0:
                print(f"ember service: systemctl enable {UNIT_NAME} failed", file=sys.stderr)
                return EX_FAIL
        print("ember will start at boot through systemd; now: ember start "
              f"(or systemctl{'' if system else ' --user'} start ember)")
        if not system:
            _linger_hint()
        return EX_OK
    # cron
    line = cron_line(system, ember)
    why = "systemd is not running here" if not systemd_running() else "--via cron"
    print(f"autostart: {why}, so an @reboot crontab entry{' for user ' + SYSTEM_USER if system else ''} "
          "runs `ember start`")
    if dry:
        print(f"would add to the crontab:\n  {line}")
        print("(where systemd runs, this unit would be written instead:)\n" + "-" * 60
              + f"\n{render_unit(system, ember)}" + "-" * 60)
        return EX_OK
    current = _read_crontab(system)
    if current is None:
        print("ember service: neither systemd nor crontab is available on this machine, so ember will NOT start at "
              "boot.\n  Install cron (e.g. apt-get install cron) and run `ember service install` again, or start it "
              "by hand: ember start", file=sys.stderr)
        return EX_FAIL
    kept = [ln for ln in current.splitlines() if CRON_MARK not in ln]
    try:
        _write_crontab(system, "\n".join([*kept, line]) + "\n")
    except RuntimeError as e:
        print(f"ember service: {e}", file=sys.stderr)
        return EX_FAIL
    print(f"added to the crontab: {line}")
    if not _cron_daemon_running():
        print("note: no cron daemon is running right now; the entry takes effect once cron runs at boot")
    return EX_OK


def cmd_uninstall(args: argparse.Namespace) -> int:
    system, dry = args.system, args.dry_run
    did = False
    path = unit_path(system)
    if path.exists():
        did = True
        if systemd_running():
            _run(_systemctl(system, "disable", "--now", UNIT_NAME), dry)
        print(("would remove " if dry else "removed ") + str(path))
        if not dry:
            path.unlink()
            if systemd_running():
                subprocess.run(_systemctl(system, "daemon-reload"))
    current = _read_crontab(system)
    if current and CRON_MARK in current:
        did = True
        kept = [ln for ln in current.splitlines() if CRON_MARK not in ln]
        print(("would remove" if dry else "removed") + " the @reboot crontab entry")
        if not dry:
            _write_crontab(system, ("\n".join(kept) + "\n") if kept else "")
    if not did:
        print("no ember autostart was installed")
    return EX_OK


def cmd_status(args: argparse.Namespace) -> int:
    system = args.system
    path = unit_path(system)
    found = False
    if path.exists():
        found = True
        line = f"autostart: systemd {'system' if system else 'user'} unit {path}"
        if systemd_running():
            en, ac = (subprocess.run(_systemctl(system, verb, UNIT_NAME), capture_output=True, text=True).stdout.strip()
                      for verb in ("is-enabled", "is-active"))
            line += f"  ({en or 'unknown'}, {ac or 'unknown'})"
        else:
            line += "  (systemd is not running here: the unit is inactive)"
        print(line)
    current = _read_crontab(system)
    if current and CRON_MARK in current:
        found = True
        entry = next(ln for ln in current.splitlines() if CRON_MARK in ln)
        print(f"autostart: @reboot crontab entry: {entry}")
    if not found:
        print("autostart: not installed (ember service install)")
        return EX_NOT_INSTALLED
    return EX_OK


def service_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ember service",
                                description="start ember at boot: a systemd unit, or an @reboot crontab entry")
    sub = p.add_subparsers(dest="verb", required=True)
    for name, text in (("install", "install and enable the boot service"), ("uninstall", "disable and remove it"),
                       ("status", "which autostart is installed, and its state")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--system", action="store_true",
                       help="system unit (root; runs as the user ember) instead of a user unit")
        if name != "status":
            s.add_argument("--dry-run", action="store_true", help="print what would be written and run; change nothing")
        if name == "install":
            s.add_argument("--via", choices=("auto", "systemd", "cron"), default="auto",
                           help="auto (default): systemd where it runs, else an @reboot crontab entry")
    args = p.parse_args(argv)
    return {"install": cmd_install, "uninstall": cmd_uninstall, "status": cmd_status}[args.verb](args)


def main(argv: list[str] | None = None) -> int:
    """`ember service ...` and `ember config ...` (argv starts with the verb)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "config":
        from .config_show import config_main

        return config_main(args[1:])
    if args and args[0] == "service":
        args = args[1:]
    return service_main(args)


VERBS = {"service": service_main}


def _config_verb(argv: list[str]) -> int:
    from .config_show import config_main

    return config_main(argv)


VERBS["config"] = _config_verb

if __name__ == "__main__":
    sys.exit(main())
