#!/usr/bin/env bash
# shellcheck disable=SC2015  # `a && b || die` is meant as "die unless both succeed" throughout
# ember installer: from a bare machine to a serving, supervised ember.
#
#   curl -fsSL https://<release host>/install.sh | bash -s -- --start --source <checkout|sdist|wheel|git URL>
#   bash installer/install.sh --start --source .          # from a checkout
#
# The whole body is one function called on the last line, so a partial download runs nothing.
# Run with --help for the options. Re-running upgrades in place (config, KV files and the crash
# archive are kept); --uninstall removes the service, the venv and the CLI link (data stays unless
# --purge). A JSON receipt records what was installed and is read by upgrade and uninstall.

ember_install() {
    # pipefail: a pipeline fails when any stage fails (a tar that could not read the checkout, say),
    # not only when its last one does
    set -euo pipefail

    # -- constants -----------------------------------------------------------------------------------
    local INSTALLER_VERSION="1"
    # The project's release. No release index is published yet: this is a placeholder, and an
    # install without --source (or EMBER_SOURCE) stops with a clear message instead of guessing.
    local RELEASE_SOURCE="${EMBER_RELEASE_SOURCE:-}"
    local MIN_FREE_MB="${EMBER_MIN_FREE_MB:-2048}"
    local START_TIMEOUT="${EMBER_START_TIMEOUT:-300}"
    local UNIT_NAME="ember.service"
    local CRON_MARK="# ember-autostart"

    # -- output --------------------------------------------------------------------------------------
    local STEP=0 WAS_RUNNING=0
    say() { printf '%s\n' "ember-install: $*"; }
    step() { STEP=$((STEP + 1)); printf '\n%s\n' "[$STEP] $*"; }
    warn() { printf '%s\n' "ember-install: warning: $*" >&2; }
    die() { printf '%s\n' "ember-install: error: $*" >&2; exit 1; }

    usage() {
        cat <<'EOF'
usage: install.sh [options]

  --start             start ember after installing and wait until it serves
  --no-service        do not install the boot service (systemd unit or @reboot crontab)
  --system            system-wide install (root): user "ember", /opt/ember, /var/lib/ember, /etc/ember
  --source SRC        what to install: a checkout dir, an sdist, a wheel, or a git/https URL
                      (default: $EMBER_SOURCE, else the project's release)
  --version VER       the release version to install (with the default source)
  --model PATH        GGUF model to serve (default: the embedded Gemma 3 270M)
  --port PORT         the port ember listens on, written into the config (default: the config's
                      port, 8080 in a new one; it wins over EMBER_PORT, which wins over the config)
  --cpu               do not install the cuda extra even if an NVIDIA GPU is present
  --uninstall         remove the service, the venv and the CLI link (config and data stay)
  --purge             with --uninstall: remove config, KV files, logs and crash archive too, that
                      is ember's own directories as the receipt records them; anything else (say
                      EMBER_STATE_DIR=~/.local/share) is refused and nothing is removed
  -h, --help          this help

environment: EMBER_SOURCE, EMBER_PYTHON (interpreter to use), EMBER_MIN_FREE_MB (default 2048),
EMBER_START_TIMEOUT (seconds, default 300), EMBER_PIP_ARGS (extra pip arguments), EMBER_STATE_DIR
(the data directory of a user install), and ember's own EMBER_* settings (EMBER_PORT, EMBER_HOST...)
for the ember this run starts
EOF
    }

    # -- helpers that use the paths below (bash scoping: called after they are set) ---------------
    write_config() {
        cat <<'EOF'
# ember.toml: the configuration of ember (the daemon and its worker).
#
# Every worker key can also be set with an EMBER_<KEY> environment variable (EMBER_PORT=9000) or a
# flag of `ember worker` (--port 9000); precedence: flag, environment, this file, the default.
# `ember config show` prints the effective configuration and where each value came from.
# After editing: ember restart

# -- the worker (top level, or under [worker]) ----------------------------------------------------

# GGUF model file to serve. Default: the embedded Gemma 3 270M (assembled on first start).
# model = "/path/to/model.gguf"

# Where the HTTP APIs listen. 127.0.0.1 serves this machine only; 0.0.0.0 serves the LAN
# (then set api_key).
host = "127.0.0.1"
port = 8080

# Require this key from clients (Authorization: Bearer <key>, or x-api-key: <key>).
# api_key = "change-me"

# Sequences decoded together, and the context limit in tokens (0 = the model's, within the KV budget).
# max_seqs = 8
# ctx = 0

# KV cache: device budget, host RAM tier, and the on-disk store that makes restarts warm.
# kv_mem = "auto"                        # cuda: what is free after the weights; numpy: 1GiB
# kv_host_mem = "512MiB"
# kv_dir = "~/.local/share/ember/kv"      # default: <state dir>/kv
# kv_disk_budget = "auto"                 # bytes like "20GiB"; auto = 1/4 of free space, at most 50GiB
# kv_persist = "all"                      # all, finished or off

# On stop or restart, how long in-flight requests may finish.
# drain_seconds = 30

# -- the daemon (supervision, restart policy, crash archive) --------------------------------------
[daemon]
# Crash archive: bundles kept, and their total size.
# crash_keep = 50
# crash_max_bytes = "256MiB"

# Restart policy: backoff between restarts, and the circuit breaker (this many crashes within the
# window stop the restarts; after the cool-down it tries once more, 0 = not until `ember start`;
# `ember start` or `ember restart` starts the worker at once).
# backoff_base = "1s"
# backoff_max = "60s"
# backoff_reset = "10m"
# breaker_crashes = 5
# breaker_window = "10m"
# breaker_cooldown = "10m"

# Health: a worker that does not answer /health/live this many times in a row is restarted; model
# loading may take up to startup_timeout.
# live_interval = "5s"
# live_failures = 3
# startup_timeout = "5m"
# hang_seconds = "2m"

# Logs: size before rotation, and rotated files kept.
# log_max_bytes = "50MiB"
# log_backups = 5

# How `ember start` runs the daemon: auto (the systemd unit when installed), none (always directly).
# service = "auto"
EOF
    }

    start_ember() {
        step "Starting ember"
        local how=""
        # EMBER_INSTALL_START=nohup forces the unsupervised fallback (for tests, and for a broken daemon)
        if [ "${EMBER_INSTALL_START:-}" != nohup ] && [ "$VIA_UNIT" = 1 ] && [ "$MODE" = system ]; then
            # root starts the system unit itself, rather than running `ember start` as root
            how="systemd"
            say "running: systemctl start $UNIT_NAME"
            systemctl start "$UNIT_NAME" || die "systemctl start $UNIT_NAME failed; see: journalctl -u ember, ember status"
        elif [ "${EMBER_INSTALL_START:-}" != nohup ] && ember_has_verb start; then
            how="ember start"
            say "running: ember start"
            ember_cli start --timeout "$START_TIMEOUT" ${PORT_FLAG[@]+"${PORT_FLAG[@]}"} ||
                die "ember start failed; see: ember logs, ember logs --daemon, ember status"
        else
            how="nohup"
            say "this ember has no 'start' command yet: starting the worker directly in the background with nohup"
            say "(not supervised; pid file $FALLBACK_PID, log $LOG_DIR/worker.log; stop it with: kill \$(cat $FALLBACK_PID))"
            # the log and the pid file are opened by the service user's shell, not by root
            # shellcheck disable=SC2016  # expanded by that shell
            as_run_user env EMBER_CONFIG="$CONF" EMBER_STATE_DIR="$STATE" sh -c '
                log=$1 pidfile=$2; shift 2
                rm -f "$pidfile" || exit
                nohup "$@" >>"$log" 2>&1 </dev/null &
                echo "$!" >"$pidfile"' sh "$LOG_DIR/worker.log" "$FALLBACK_PID" \
                "$VENV/bin/ember" worker --config "$CONF" ${PORT_FLAG[@]+"${PORT_FLAG[@]}"} ||
                die "could not start the worker"
        fi
        local waited=0 code="" pid=""
        [ "$how" != nohup ] || pid="$(fallback_pid)"
        say "waiting for $URL/health/ready (up to ${START_TIMEOUT}s; the first start loads the model)"
        while :; do
            code="$("$VENV/bin/python" -c 'if 1:
    import sys, urllib.request, urllib.error
    try:
        print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
    except urllib.error.HTTPError as e:
        print(e.code)
    except Exception:
        print(0)' "$URL/health/ready")"
            [ "$code" = 200 ] && break
            if [ "$how" = nohup ] && ! run_user_alive "$pid"; then
                as_run_user tail -n 20 "$LOG_DIR/worker.log" >&2 || true
                die "the worker exited before it was ready (log: $LOG_DIR/worker.log)"
            fi
            [ "$waited" -lt "$START_TIMEOUT" ] || die "ember was not ready at $URL after ${START_TIMEOUT}s (last /health/ready: $code); see: ember logs"
            sleep 1
            waited=$((waited + 1))
        done
        local model keyhdr=""
        model="$(EMBER_URL="$URL" "$VENV/bin/python" -c 'if 1:
    import json, os, sys, urllib.request
    try:
        print(json.load(urllib.request.urlopen(os.environ["EMBER_URL"] + "/v1/models", timeout=5))["data"][0]["id"])
    except Exception:
        print("ember")' 2>/dev/null || echo ember)"
        if "$VENV/bin/python" -c 'if 1:
    import os, sys, tomllib
    d = tomllib.load(open(sys.argv[1], "rb")); w = d.get("worker", d)
    sys.exit(0 if (w.get("api_key") or os.environ.get("EMBER_API_KEY")) else 1)' "$CONF" 2>/dev/null; then
            # shellcheck disable=SC2016  # printed for the user's shell to expand
            keyhdr=' -H "Authorization: Bearer $EMBER_API_KEY"'
        fi
        say "ember is serving at $URL  (OpenAI: $URL/v1, Anthropic: $URL)"
        cat <<EOF

Try it:
  curl -s $URL/v1/chat/completions -H 'Content-Type: application/json'$keyhdr \\
    -d '{"model": "$model", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32}'

  ember status     ember logs -f     ember stop
EOF
    }

    # -- options -------------------------------------------------------------------------------------
    local OPT_START=0 OPT_NO_SERVICE=0 OPT_SYSTEM=0 OPT_UNINSTALL=0 OPT_PURGE=0 OPT_CPU=0
    local OPT_SOURCE="${EMBER_SOURCE:-}" OPT_VERSION="" OPT_MODEL="" OPT_PORT=""
    need_arg() { [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --start) OPT_START=1 ;;
            --no-service) OPT_NO_SERVICE=1 ;;
            --system) OPT_SYSTEM=1 ;;
            --uninstall) OPT_UNINSTALL=1 ;;
            --purge) OPT_PURGE=1 ;;
            --cpu) OPT_CPU=1 ;;
            --source) need_arg "$@"; OPT_SOURCE="$2"; shift ;;
            --source=*) OPT_SOURCE="${1#*=}" ;;
            --version) need_arg "$@"; OPT_VERSION="$2"; shift ;;
            --version=*) OPT_VERSION="${1#*=}" ;;
            --model) need_arg "$@"; OPT_MODEL="$2"; shift ;;
            --model=*) OPT_MODEL="${1#*=}" ;;
            --port) need_arg "$@"; OPT_PORT="$2"; shift ;;
            --port=*) OPT_PORT="${1#*=}" ;;
            -h | --help) usage; return 0 ;;
            *) die "unknown option: $1 (see --help)" ;;
        esac
        shift
    done
    if [ "$OPT_PURGE" = 1 ] && [ "$OPT_UNINSTALL" = 0 ]; then
        die "--purge only goes with --uninstall"
    fi
    if [ -n "$OPT_PORT" ]; then
        case "$OPT_PORT" in
            *[!0-9]*) die "--port: '$OPT_PORT' is not a number" ;;
        esac
        [ "$OPT_PORT" -ge 1 ] && [ "$OPT_PORT" -le 65535 ] || die "--port: $OPT_PORT is not a TCP port"
    fi

    # -- paths ---------------------------------------------------------------------------------------
    local MODE HOME_DIR="" PREFIX VENV BIN_LINK CONF_DIR CONF ENV_FILE STATE KV_DIR CRASH_DIR LOG_DIR RUN_DIR
    local RECEIPT UNIT_FILE RUN_USER CACHE_DIR FALLBACK_PID
    if [ "$OPT_SYSTEM" = 1 ]; then
        [ "$(id -u)" = 0 ] || die "--system needs root (run it with sudo), or leave --system out for a per-user install"
        command -v runuser >/dev/null 2>&1 || die "--system needs runuser (util-linux) to act as the service user"
        MODE=system
        umask 022  # the program files must be readable by the service user
        RUN_USER=ember
        PREFIX=/opt/ember
        BIN_LINK=/usr/local/bin/ember
        CONF_DIR=/etc/ember
        STATE=/var/lib/ember
        UNIT_FILE=/etc/systemd/system/$UNIT_NAME
    else
        MODE=user
        RUN_USER="$(id -un)"
        HOME_DIR="${HOME:?HOME is not set}"
        PREFIX="${XDG_DATA_HOME:-$HOME_DIR/.local/share}/ember"
        BIN_LINK="$HOME_DIR/.local/bin/ember"
        CONF_DIR="${XDG_CONFIG_HOME:-$HOME_DIR/.config}/ember"
        STATE="${EMBER_STATE_DIR:-$PREFIX}"
        UNIT_FILE="${XDG_CONFIG_HOME:-$HOME_DIR/.config}/systemd/user/$UNIT_NAME"
    fi
    VENV="$PREFIX/venv"
    RECEIPT="$PREFIX/install-receipt.json"
    CONF="$CONF_DIR/ember.toml"
    ENV_FILE="$CONF_DIR/ember.env"
    state_paths() {  # the fixed paths under the state dir
        KV_DIR="$STATE/kv"
        CRASH_DIR="$STATE/crashes"
        LOG_DIR="$STATE/logs"
        RUN_DIR="$STATE/run"
        FALLBACK_PID="$RUN_DIR/worker-nohup.pid"
        # the worker's cache: ~/.cache/ember, with HOME the state dir for the service user
        if [ "$MODE" = system ]; then CACHE_DIR="$STATE/.cache/ember"; else CACHE_DIR="${XDG_CACHE_HOME:-$HOME_DIR/.cache}/ember"; fi
    }
    state_paths

    # -- acting as the service user ------------------------------------------------------------------
    # In a system install the state dir belongs to the user ember. Root runs ember's programs, and
    # reads or writes anything under that dir, as that user: a symlink the user planted there then
    # leads only where the user could go anyway. In a user install this is just the command.
    as_run_user() {
        if [ "$MODE" = system ] && [ "$(id -u)" = 0 ]; then
            runuser -u "$RUN_USER" -- env HOME="$STATE" "$@"
        else
            "$@"
        fi
    }
    # the environment every `ember` call of this script runs with (the installed paths, not the caller's)
    ember_cli() {
        as_run_user env EMBER_CONFIG="$CONF" EMBER_STATE_DIR="$STATE" "$VENV/bin/ember" "$@"
    }
    ember_has_verb() {  # does this ember's CLI have the command $1? (the whole help read: no SIGPIPE)
        local help
        help="$(ember_cli --help 2>/dev/null)" || return 1
        case "$help" in *$'\n'"  $1 "*) return 0 ;; esac
        return 1
    }
    # the pid in the nohup fallback's pid file (a file the service user writes): digits, or nothing
    fallback_pid() {
        local pid
        pid="$(as_run_user cat "$FALLBACK_PID" 2>/dev/null || true)"
        case "$pid" in '' | *[!0-9]*) pid="" ;; esac
        printf '%s\n' "$pid"
    }
    # a live process of the service user's (so a pid from that user's file never makes root signal
    # anyone else's)
    run_user_alive() {
        [ -n "$1" ] && [ -d "/proc/$1" ] && [ "$(stat -c %u "/proc/$1" 2>/dev/null || true)" = "$(id -u "$RUN_USER" 2>/dev/null || echo none)" ]
    }
    systemd_running() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; }
    systemctl_scope() {
        if [ "$MODE" = system ]; then systemctl "$@"; else systemctl --user "$@"; fi
    }
    crontab_scope() {
        if [ "$MODE" = system ]; then crontab -u "$RUN_USER" "$@"; else crontab "$@"; fi
    }

    # -- stopping a running ember (upgrade and uninstall) --------------------------------------------
    stop_running() {
        local stopped=0
        if [ -f "$UNIT_FILE" ] && systemd_running; then
            if systemctl_scope is-active --quiet "$UNIT_NAME" 2>/dev/null; then
                say "stopping the $UNIT_NAME service"
                systemctl_scope stop "$UNIT_NAME" || warn "systemctl stop $UNIT_NAME failed"
                stopped=1
            fi
        fi
        if [ -x "$VENV/bin/ember" ] && ember_has_verb stop; then
            local out
            out="$(ember_cli stop 2>&1)" || warn "ember stop failed: $out"
            case "$out" in
                *"ember stopped"*) say "stopped ember (ember stop): $out"; stopped=1 ;;
            esac
        fi
        local pid
        pid="$(fallback_pid)"
        if run_user_alive "$pid"; then
            say "stopping the background worker (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            local i=0
            while run_user_alive "$pid" && [ "$i" -lt 400 ]; do sleep 0.1; i=$((i + 1)); done
            if run_user_alive "$pid"; then
                warn "pid $pid did not stop after 40s; killing it"
                kill -KILL "$pid" 2>/dev/null || true
            fi
            stopped=1
        fi
        as_run_user rm -f "$FALLBACK_PID" 2>/dev/null || true
        if [ "$stopped" = 1 ]; then WAS_RUNNING=1; else say "ember was not running"; fi
        return 0
    }

    remove_service() {
        if [ -f "$UNIT_FILE" ]; then
            if systemd_running; then
                systemctl_scope disable --now "$UNIT_NAME" >/dev/null 2>&1 || true
            fi
            rm -f "$UNIT_FILE"
            if systemd_running; then systemctl_scope daemon-reload >/dev/null 2>&1 || true; fi
            say "removed the systemd unit $UNIT_FILE"
        fi
        if command -v crontab >/dev/null 2>&1; then
            local cur
            cur="$(crontab_scope -l 2>/dev/null || true)"
            case "$cur" in
                *"$CRON_MARK"*)
                    # grep -v finds no line when ours was the only one: that is an empty crontab, not an error
                    printf '%s\n' "$cur" | { grep -vF "$CRON_MARK" || true; } | crontab_scope - || warn "could not rewrite the crontab"
                    say "removed the @reboot crontab entry"
                    ;;
            esac
        fi
    }

    # -- --purge: what may go ------------------------------------------------------------------------
    # The rule: the state dir and the config dir are taken from the receipt (this run's paths when
    # there is none) and must be real directories (not symlinks), not / and not $HOME or above it,
    # and ember's own: the receipt records that the installer created them or, where it keeps no such
    # record, they are named "ember". A dir the installer created goes whole; one that was there
    # before loses only ember's entries in it (kv, crashes, logs, run that the installer made; the
    # receipt; ember.toml, ember.env) and goes only if that leaves it empty. Anything else is refused
    # before the uninstall touches anything. Removal never follows a symlink (a link goes, not its target).
    purge() {  # purge check|apply (python: $RPY)
        "$RPY" - "$1" "$RECEIPT" "$STATE" "$CONF_DIR" "$CACHE_DIR" "$HOME_DIR" <<'PYEOF'
import json, os, shutil, stat, sys

action, receipt, state, conf_dir, cache, home = sys.argv[1:7]
DIRS = ("kv", "crashes", "logs", "run")
OWN = {"state": DIRS + ("install-receipt.json", "install-receipt.json.tmp"),
       "config": ("ember.toml", "ember.toml.tmp", "ember.env")}
try:
    with open(receipt) as f:
        r = json.load(f)
except (OSError, ValueError):
    r = {}
paths = r.get("paths") or {}
state = paths.get("state") or state
conf_dir = os.path.dirname(paths["config"]) if paths.get("config") else conf_dir
created = r.get("created")  # None: no receipt, or one from before the installer kept this record
created = None if created is None else {os.path.normpath(p) for p in created}
home = os.path.normpath(home) if home else ""


def refuse(path, why):
    print(f"ember-install: error: refusing to purge {path}: {why}; nothing was removed", file=sys.stderr)
    sys.exit(3)


plan = []  # (path, remove it whole, else these entries in it)
for kind, path in (("state", state), ("config", conf_dir)):
    if not os.path.isabs(path):
        refuse(path, "not an absolute path")
    path = os.path.normpath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        continue
    if stat.S_ISLNK(st.st_mode):
        refuse(path, "it is a symlink (remove the link by hand)")
    if not stat.S_ISDIR(st.st_mode):
        refuse(path, "it is not a directory")
    if path == "/" or (home and (home == path or home.startswith(path + "/"))):
        refuse(path, "it is / or your home directory or above it")
    made = created is not None and path in created
    if not made and os.path.basename(path) != "ember":
        refuse(path, "it is not ember's own directory (the receipt does not record it as made by the installer, "
                     "and it is not named 'ember')")
    entries = [e for e in OWN[kind] if e not in DIRS or created is None or os.path.join(path, e) in created]
    if not any(p == path or path.startswith(p + "/") for p, whole, _ in plan if whole):
        plan.append((path, made, entries))
if os.path.basename(cache) == "ember" and os.path.lexists(cache):
    if not any(cache.startswith(p + "/") for p, whole, _ in plan if whole):
        plan.append((cache, True, []))  # the worker's cache: ~/.cache/ember, ember's by name

if action == "check":
    for path, whole, entries in plan:
        print(f"ember-install: will remove {path}" if whole else
              f"ember-install: will remove from {path}: {', '.join(entries)} (and the dir if that empties it)")
    sys.exit(0)


def remove(path):
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # fd-based: never follows a symlink inside
    else:
        os.unlink(path)  # a file, or a symlink itself


for path, whole, entries in plan:
    if whole:
        remove(path)
        print(f"ember-install: removed {path}")
        continue
    for e in entries:
        if os.path.lexists(os.path.join(path, e)):
            remove(os.path.join(path, e))
    try:
        os.rmdir(path)
        print(f"ember-install: removed ember's files and then {path}")
    except OSError:
        left = sorted(os.listdir(path))
        print(f"ember-install: removed ember's files from {path}; kept the dir, which holds files that are not "
              f"ember's: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
PYEOF
    }

    # -- uninstall -----------------------------------------------------------------------------------
    if [ "$OPT_UNINSTALL" = 1 ]; then
        step "Uninstalling ember ($MODE install under $PREFIX)"
        # a python to read the receipt with (the venv's, else the system's)
        local RPY="" cand
        for cand in "$VENV/bin/python" ${EMBER_PYTHON:-} python3 /usr/bin/python3; do
            if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import json' >/dev/null 2>&1; then RPY="$cand"; break; fi
        done
        if [ ! -f "$RECEIPT" ] && [ ! -d "$VENV" ]; then
            say "no ember install found at $PREFIX (no receipt, no venv)"
        elif [ -f "$RECEIPT" ] && [ -n "$RPY" ]; then
            # what was installed, not what this shell's environment says now
            local r_state
            r_state="$("$RPY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("paths", {}).get("state", ""))' "$RECEIPT" 2>/dev/null || true)"
            if [ -n "$r_state" ] && [ "$r_state" != "$STATE" ]; then
                say "the data directory is $r_state (from the receipt)"
                STATE="$r_state"
                state_paths
            fi
        fi
        if [ "$OPT_PURGE" = 1 ]; then
            [ -n "$RPY" ] || die "--purge needs a python3 to read the receipt $RECEIPT"
            purge check || exit 1
        fi
        step "Stopping ember"
        stop_running
        step "Removing the boot service"
        remove_service
        if [ "$OPT_PURGE" = 1 ]; then
            step "Purging config and data"
            purge apply || die "the purge stopped half way (see above)"
        fi
        step "Removing the venv and the CLI link"
        if [ -L "$BIN_LINK" ] || [ -f "$BIN_LINK" ]; then
            case "$(readlink "$BIN_LINK" 2>/dev/null || true)$(head -c 200 "$BIN_LINK" 2>/dev/null | tr -d '\0' || true)" in
                *"$VENV"*) rm -f "$BIN_LINK"; say "removed $BIN_LINK" ;;
                *) warn "$BIN_LINK is not ember's; left it" ;;
            esac
        fi
        if [ "$OPT_PURGE" = 0 ] && [ -f "$RECEIPT" ] && [ -n "$RPY" ]; then
            # the receipt stays with the data: a later --uninstall --purge reads what is ember's from it
            "$RPY" - "$RECEIPT" <<'PYEOF' || warn "could not update the receipt $RECEIPT"
import datetime, json, os, sys
r = json.load(open(sys.argv[1]))
r["uninstalled_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(r, f, indent=2)
    f.write("\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PYEOF
        fi
        rm -rf "$VENV"
        [ "$OPT_PURGE" = 0 ] || rm -f "$RECEIPT"
        [ "$MODE" = system ] || rmdir "$(dirname "$BIN_LINK")" 2>/dev/null || true
        say "removed $VENV"
        rmdir "$PREFIX" 2>/dev/null || true
        if [ "$OPT_PURGE" = 1 ]; then
            if [ "$MODE" = system ] && id "$RUN_USER" >/dev/null 2>&1; then
                userdel "$RUN_USER" 2>/dev/null && say "removed the system user $RUN_USER" || warn "could not remove the user $RUN_USER"
            fi
        else
            say "kept: config $CONF_DIR, data $STATE (KV files, logs, crash archive) and the receipt; --uninstall --purge removes them"
        fi
        say "ember is uninstalled"
        return 0
    fi

    # -- checks --------------------------------------------------------------------------------------
    step "Checking this machine"
    local PY="" cand
    for cand in ${EMBER_PYTHON:-} python3.13 python3.12 python3.11 python3 /usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3; do
        if command -v "$cand" >/dev/null 2>&1 &&
            "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1; then
            PY="$("$cand" -c "import sys; print(sys.executable)")"
            if [ "$MODE" = system ]; then
                # the service user must be able to run it: not an interpreter under root's home (pyenv and the like)
                case "$PY" in /root/* | "${HOME:-/root}"/*) PY=""; continue ;; esac
                "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || { PY=""; continue; }
            fi
            break
        fi
    done
    [ -n "$PY" ] || die "Python >= 3.11 is required and none was found (install python3.11 or newer, or set EMBER_PYTHON)"
    "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 ||
        die "$PY has no working venv module (on Debian/Ubuntu: apt-get install python3-venv)"
    say "python: $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"

    local probe="$PREFIX" free_mb
    while [ ! -d "$probe" ]; do probe="$(dirname "$probe")"; done
    free_mb="$(df -Pk "$probe" | awk 'NR == 2 { print int($4 / 1024) }')" && [ -n "$free_mb" ] ||
        die "could not read the free disk space of $probe"
    [ "$free_mb" -ge "$MIN_FREE_MB" ] ||
        die "only ${free_mb} MiB free on $probe; ember needs at least ${MIN_FREE_MB} MiB (EMBER_MIN_FREE_MB)"
    say "disk: ${free_mb} MiB free on $probe"

    local EXTRAS="" GPU="none"
    if [ "$OPT_CPU" = 0 ] && command -v nvidia-smi >/dev/null 2>&1; then
        # all of nvidia-smi's answer, then its first line (`| head -n 1` could cut it off mid-write)
        if GPU="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)" && [ -n "$GPU" ]; then
            GPU="${GPU%%$'\n'*}"
            EXTRAS="[cuda]"
            say "gpu: $GPU (the cuda extra will be installed)"
        else
            GPU="none"
            warn "nvidia-smi is installed but does not answer (driver not loaded?); installing without the cuda extra"
        fi
    else
        say "gpu: no NVIDIA GPU/driver found (or --cpu); installing the CPU build"
    fi

    # -- the source ----------------------------------------------------------------------------------
    local SRC="$OPT_SOURCE" SRC_KIND SPEC
    if [ -z "$SRC" ]; then
        SRC="${RELEASE_SOURCE//\{version\}/${OPT_VERSION:-latest}}"
        [ -n "$SRC" ] || die "no ember release is published yet, so there is no default source: pass --source PATH|URL (a checkout, an sdist, a wheel or a git URL) or set EMBER_SOURCE"
    fi
    case "$SRC" in
        git+* | *.git | *.git@*) SRC_KIND=git ;;
        http://* | https://*) SRC_KIND=url ;;
        file://*) SRC="${SRC#file://}"; SRC_KIND=path ;;
        *) SRC_KIND=path ;;
    esac
    if [ "$SRC_KIND" = path ]; then
        [ -e "$SRC" ] || die "--source $SRC: no such file or directory"
        SRC="$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")"
        SRC="${SRC%/.}"
        if [ -d "$SRC" ]; then
            [ -f "$SRC/pyproject.toml" ] || die "--source $SRC: not an ember checkout (no pyproject.toml)"
            SRC_KIND=checkout
        else
            case "$SRC" in
                *.whl) SRC_KIND=wheel ;;
                *.tar.gz | *.zip) SRC_KIND=sdist ;;
                *) die "--source $SRC: not a checkout, sdist (.tar.gz/.zip) or wheel (.whl)" ;;
            esac
        fi
    fi
    [ -z "$OPT_VERSION" ] || [ -z "$OPT_SOURCE" ] || warn "--version $OPT_VERSION is ignored with --source (the source decides the version)"
    say "source: $SRC ($SRC_KIND)"

    # -- upgrade or fresh install --------------------------------------------------------------------
    local UPGRADE=0 OLD_VERSION=""
    if [ -x "$VENV/bin/python" ]; then
        UPGRADE=1
        OLD_VERSION="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("ember"))' 2>/dev/null || true)"
        step "Upgrading the install in place (installed: ${OLD_VERSION:-unknown}); config, KV files and crash archive are kept"
        stop_running
    fi

    # -- the system user and directories -------------------------------------------------------------
    step "Preparing directories"
    if [ "$MODE" = system ]; then
        if ! id "$RUN_USER" >/dev/null 2>&1; then
            useradd --system --home-dir "$STATE" --no-create-home --shell /usr/sbin/nologin "$RUN_USER" ||
                die "could not create the system user $RUN_USER"
            say "created the system user $RUN_USER"
        fi
    fi
    # what this run creates goes into the receipt: --purge removes only what the installer made
    local CREATED="" d
    for d in "$PREFIX" "$CONF_DIR" "$STATE" "$KV_DIR" "$CRASH_DIR" "$LOG_DIR" "$RUN_DIR"; do
        [ -e "$d" ] || [ -L "$d" ] || CREATED="$CREATED$d"$'\n'
    done
    mkdir -p "$PREFIX" "$CONF_DIR" "$(dirname "$BIN_LINK")" || die "could not create $PREFIX, $CONF_DIR or $(dirname "$BIN_LINK")"
    if [ "$MODE" = system ]; then
        # Root makes the state dir itself (in root's /var/lib) and hands it over; everything inside is
        # made by the service user, so no chmod or chown of root's follows a link that user planted.
        [ ! -L "$STATE" ] || die "$STATE is a symlink; a system install needs a real directory there"
        mkdir -p "$STATE" && chown -h "$RUN_USER:" "$STATE" && chmod 700 "$STATE" || die "could not create $STATE"
        # what root left inside on an earlier run goes to the service user: find -P follows no link,
        # -execdir acts from the directory it opened, and a file with other hard links stays as it is
        env PATH=/usr/sbin:/usr/bin:/sbin:/bin find -P "$STATE" -xdev ! -user "$RUN_USER" \( -type d -o -type l -o -links 1 \) \
            -execdir chown -h "$RUN_USER:" {} + || die "could not give the files in $STATE to $RUN_USER"
        as_run_user mkdir -p "$KV_DIR" "$CRASH_DIR" "$LOG_DIR" "$RUN_DIR" &&
            as_run_user chmod 700 "$KV_DIR" "$CRASH_DIR" "$LOG_DIR" "$RUN_DIR" ||
            die "$RUN_USER could not make $KV_DIR, $CRASH_DIR, $LOG_DIR and $RUN_DIR private directories (a symlink among them must lead to a directory $RUN_USER owns)"
    else
        for d in "$STATE" "$KV_DIR" "$CRASH_DIR" "$LOG_DIR" "$RUN_DIR"; do
            mkdir -p "$d" && chmod 700 "$d" || die "could not create $d"
        done
    fi
    say "program: $PREFIX   config: $CONF_DIR   data: $STATE"

    # -- the venv and the package --------------------------------------------------------------------
    step "Installing ember into $VENV (a few minutes on a fresh machine)"
    if [ "$UPGRADE" = 0 ]; then
        "$PY" -m venv "$VENV" || die "could not create the venv $VENV"
    fi
    local -a PIP_ARGS=()
    read -r -a PIP_ARGS <<<"${EMBER_PIP_ARGS:-}"
    local TMP
    TMP="$(mktemp -d "${TMPDIR:-/tmp}/ember-install.XXXXXX")" || die "could not create a temporary directory"
    # shellcheck disable=SC2064  # expand $TMP now: the trap runs after this function's locals are gone
    trap "rm -rf '$TMP'" EXIT
    "$VENV/bin/python" -m pip install -q --upgrade pip ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} >/dev/null 2>&1 || warn "could not upgrade pip; going on with the venv's"
    local WHEEL=""
    case "$SRC_KIND" in
        wheel) WHEEL="$SRC" ;;
        checkout)
            # build from a copy: a build never writes into the user's checkout
            say "building a wheel from the checkout"
            # (tar's status 1 is "a file changed while it was read": an editor saving; the copy is whole.
            # Any other failure of either side fails the pipeline, and the install.)
            (cd "$SRC" && { tar --exclude=.git --exclude=.venv --exclude=./venv --exclude=./build --exclude=./dist \
                --exclude=./.whl --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache \
                --exclude=./tests -cf - . || [ "$?" = 1 ]; }) | (mkdir -p "$TMP/src" && cd "$TMP/src" && tar -xf -) ||
                die "could not copy the checkout $SRC"
            "$VENV/bin/python" -m pip wheel -q --no-deps -w "$TMP/wheels" "$TMP/src" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} >"$TMP/pip.log" 2>&1 || { tail -n 40 "$TMP/pip.log" >&2; false; } ||
                die "building ember from $SRC failed (see pip's output above)"
            ;;
        sdist | url)
            say "building a wheel from $SRC"
            "$VENV/bin/python" -m pip wheel -q --no-deps -w "$TMP/wheels" "$SRC" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} >"$TMP/pip.log" 2>&1 || { tail -n 40 "$TMP/pip.log" >&2; false; } ||
                die "building ember from $SRC failed (see pip's output above)"
            ;;
        git)
            say "building a wheel from the git repository $SRC"
            case "$SRC" in git+*) ;; *) SRC="git+$SRC" ;; esac
            "$VENV/bin/python" -m pip wheel -q --no-deps -w "$TMP/wheels" "$SRC" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} >"$TMP/pip.log" 2>&1 || { tail -n 40 "$TMP/pip.log" >&2; false; } ||
                die "building ember from $SRC failed (is git installed? see pip's output above)"
            ;;
    esac
    if [ -z "$WHEEL" ]; then
        local w
        for w in "$TMP"/wheels/ember-*.whl; do
            [ -f "$w" ] && WHEEL="$w" && break
        done
        [ -n "$WHEEL" ] || die "the build produced no ember wheel"
    fi
    SPEC="ember$EXTRAS @ file://$WHEEL"
    say "installing $(basename "$WHEEL")$EXTRAS and its dependencies"
    "$VENV/bin/python" -m pip install -q "$SPEC" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} >"$TMP/pip.log" 2>&1 ||
        { tail -n 40 "$TMP/pip.log" >&2; die "pip could not install $SPEC (see above)"; }
    if [ "$UPGRADE" = 1 ]; then
        # the same version number from a newer checkout: replace the package files regardless
        "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} ||
            die "pip could not reinstall $WHEEL"
    fi
    local VERSION
    VERSION="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("ember"))')" ||
        die "ember is not importable in $VENV after the install"
    "$VENV/bin/ember" --version >/dev/null || die "$VENV/bin/ember does not run"
    if [ "$MODE" = system ] && command -v runuser >/dev/null 2>&1; then
        runuser -u "$RUN_USER" -- "$VENV/bin/python" -c 'import ember.daemon' >/dev/null 2>&1 ||
            die "the user $RUN_USER cannot run $VENV/bin/python (is $PY readable by all users?); set EMBER_PYTHON to a system interpreter"
    fi
    say "installed ember $VERSION"

    # -- the CLI link --------------------------------------------------------------------------------
    step "Linking the ember command"
    if [ "$MODE" = system ]; then
        # a wrapper, so that `ember status` as root finds the system install's state and config
        printf '#!/bin/sh\n# ember system install (%s)\nEMBER_STATE_DIR=%s EMBER_CONFIG=%s exec %s "$@"\n' \
            "$VENV" "$STATE" "$CONF" "$VENV/bin/ember" >"$BIN_LINK.tmp" && chmod 755 "$BIN_LINK.tmp" &&
            mv -f "$BIN_LINK.tmp" "$BIN_LINK" || die "could not write $BIN_LINK"
    else
        ln -sfn "$VENV/bin/ember" "$BIN_LINK" || die "could not link $BIN_LINK"
    fi
    say "$BIN_LINK -> $VENV/bin/ember"
    case ":${PATH:-}:" in
        *":$(dirname "$BIN_LINK"):"*) ;;
        *) warn "$(dirname "$BIN_LINK") is not on your PATH; add it (e.g. in ~/.profile: export PATH=\"$(dirname "$BIN_LINK"):\$PATH\")" ;;
    esac

    # -- the config ----------------------------------------------------------------------------------
    step "Config"
    if [ -f "$CONF" ]; then
        say "kept the existing config $CONF"
    else
        write_config >"$CONF.tmp" && mv -f "$CONF.tmp" "$CONF" || die "could not write $CONF"
        say "wrote $CONF (commented; edit it and run: ember restart)"
    fi
    if [ -n "$OPT_PORT" ]; then
        "$VENV/bin/python" - "$CONF" "port" "$OPT_PORT" <<'PYEOF' || die "could not set port in $CONF"
import re, sys
path, key, value = sys.argv[1], sys.argv[2], sys.argv[3]
text = open(path).read()
line = f"{key} = {value}" if value.isdigit() else f"{key} = {value!r}".replace("'", '"')
pat = re.compile(rf"^{key}\s*=.*$", re.M)
head, sep, tail = text.partition("\n[")
if pat.search(head):
    head = pat.sub(line.replace("\\", "\\\\"), head, count=1)
else:
    head = head.rstrip("\n") + "\n" + line + "\n"
open(path, "w").write(head + sep + tail)
PYEOF
    fi
    if [ -n "$OPT_MODEL" ]; then
        [ -f "$OPT_MODEL" ] || die "--model $OPT_MODEL: no such file"
        OPT_MODEL="$(cd "$(dirname "$OPT_MODEL")" && pwd)/$(basename "$OPT_MODEL")"
        "$VENV/bin/python" - "$CONF" "$OPT_MODEL" <<'PYEOF' || die "could not set model in $CONF"
import json, re, sys
path, model = sys.argv[1], sys.argv[2]
text = open(path).read()
line = "model = " + json.dumps(model)
pat = re.compile(r"^model\s*=.*$", re.M)
head, sep, tail = text.partition("\n[")
head = pat.sub(lambda m: line, head, count=1) if pat.search(head) else head.rstrip("\n") + "\n" + line + "\n"
open(path, "w").write(head + sep + tail)
PYEOF
        say "model: $OPT_MODEL"
    fi
    "$VENV/bin/python" -c 'import sys, tomllib; tomllib.load(open(sys.argv[1], "rb"))' "$CONF" ||
        die "$CONF is not valid TOML; fix it and run the installer again"
    if [ ! -f "$ENV_FILE" ]; then
        printf '%s\n' "# Environment for the ember service (EMBER_* variables override ember.toml)." \
            "EMBER_CONFIG=$CONF" "EMBER_STATE_DIR=$STATE" >"$ENV_FILE" || die "could not write $ENV_FILE"
        say "wrote $ENV_FILE"
    fi
    chmod 600 "$CONF" "$ENV_FILE" || true
    if [ "$MODE" = system ]; then
        chown "root:$RUN_USER" "$CONF" "$ENV_FILE" && chmod 640 "$CONF" "$ENV_FILE" || die "could not set the owner of $CONF"
    fi
    # -- the boot service ----------------------------------------------------------------------------
    local SERVICE="none"
    if [ "$OPT_NO_SERVICE" = 1 ]; then
        step "Boot service: skipped (--no-service); start ember by hand with: ember start"
        remove_service
    else
        step "Installing the boot service"
        local sflag="" svc_rc=0
        [ "$MODE" = system ] && sflag="--system"
        # shellcheck disable=SC2086
        EMBER_CONFIG="$CONF" EMBER_STATE_DIR="$STATE" EMBER_SERVICE_UNIT_FILE="$UNIT_FILE" EMBER_SERVICE_ENV_FILE="$ENV_FILE" \
            "$VENV/bin/python" -m ember.daemon.service install $sflag && svc_rc=0 || svc_rc=$?
        if [ "$svc_rc" != 0 ]; then
            warn "no boot service was installed (see above): ember will not start at boot; start it with: ember start"
        elif [ -f "$UNIT_FILE" ]; then SERVICE="systemd"; else SERVICE="cron"; fi
    fi

    # -- where ember will listen ---------------------------------------------------------------------
    # Derived by ember's own settings loader, as the daemon derives the port it passes the worker
    # (--port, then EMBER_PORT, then ember.toml, then 8080; the same for the host), in the environment
    # the started ember will actually have: this script's for `ember start` and the nohup fallback
    # (with --port passed on as the flag), the unit's for systemd (its Environment= lines and ember.env;
    # no flag reaches it). VIA_UNIT: whether a start goes through the unit.
    local VIA_UNIT=0 URL PORT where
    local -a PORT_FLAG=()
    [ -z "$OPT_PORT" ] || PORT_FLAG=(--port "$OPT_PORT")
    if [ "$SERVICE" = systemd ] && systemd_running; then VIA_UNIT=1; fi
    where="$("$VENV/bin/python" - "$CONF" "$STATE" "$ENV_FILE" "$OPT_PORT" "$VIA_UNIT" <<'PYEOF'
import os, sys

conf, state, env_file, port_flag, via_unit = sys.argv[1:6]
here = {**os.environ, "EMBER_CONFIG": conf, "EMBER_STATE_DIR": state}
try:
    from ember.daemon.settings import SettingsError, load
except ImportError:  # an ember from before the daemon: the worker's order, read by hand
    import tomllib
    w = tomllib.load(open(conf, "rb"))
    w = w.get("worker", w)
    port = port_flag or here.get("EMBER_PORT") or w.get("port", 8080)
    print(f"http://127.0.0.1:{port} {port} 0")
    sys.exit(0)


def unit_env():
    # systemd's environment for the unit: its Environment= lines, then the EnvironmentFile
    env = {"EMBER_CONFIG": conf, "EMBER_STATE_DIR": state}
    try:
        lines = open(env_file).read().splitlines()
    except OSError:
        lines = []
    for ln in lines:
        ln = ln.strip()
        if not ln or ln[0] in "#;" or "=" not in ln:
            continue
        k, v = ln.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        env[k.strip()] = v
    return env


try:
    s = load({"port": port_flag or None}, env=here)
    if via_unit == "1" and s.service != "none":
        s = load({}, env=unit_env())
        for var, got in (("EMBER_PORT", str(s.port)), ("EMBER_HOST", s.host)):
            if here.get(var) and here[var] != got and unit_env().get(var) != here[var]:
                print(f"ember-install: warning: {var}={here[var]} in this shell does not reach the systemd service "
                      f"(it reads {conf} and {env_file}); ember will listen on {s.endpoint}", file=sys.stderr)
        if port_flag and str(s.port) != port_flag:
            print(f"ember-install: warning: EMBER_PORT in {env_file} overrides --port {port_flag}: ember will listen "
                  f"on port {s.port}", file=sys.stderr)
    else:
        via_unit = "0"
        if here.get("EMBER_PORT") and not port_flag:
            boot = load({}, env={"EMBER_CONFIG": conf, "EMBER_STATE_DIR": state})
            if boot.port != s.port:
                print(f"ember-install: warning: EMBER_PORT={here['EMBER_PORT']} applies to the ember this run "
                      f"starts; started from {conf} alone (ember start, at boot) it listens on port {boot.port}: "
                      f"make it stick with --port {s.port}", file=sys.stderr)
except SettingsError as e:
    print(f"ember-install: error: {e}", file=sys.stderr)
    sys.exit(1)
print(s.endpoint, s.port, via_unit)
PYEOF
)" || die "could not work out where ember will listen (see above)"
    read -r URL PORT VIA_UNIT <<<"$where"

    # -- the receipt ---------------------------------------------------------------------------------
    step "Writing the install receipt"
    R_VERSION="$VERSION" R_OLD="$OLD_VERSION" R_SOURCE="$SRC" R_KIND="$SRC_KIND" R_MODE="$MODE" R_PREFIX="$PREFIX" \
        R_VENV="$VENV" R_BIN="$BIN_LINK" R_CONF="$CONF" R_ENV="$ENV_FILE" R_STATE="$STATE" R_KV="$KV_DIR" \
        R_CRASH="$CRASH_DIR" R_LOGS="$LOG_DIR" R_UNIT="$UNIT_FILE" R_SERVICE="$SERVICE" R_START="$OPT_START" \
        R_MODEL="$OPT_MODEL" R_EXTRAS="$EXTRAS" R_GPU="$GPU" R_PY="$PY" R_PORT="$PORT" R_USER="$RUN_USER" \
        R_INST="$INSTALLER_VERSION" R_NOSVC="$OPT_NO_SERVICE" R_CREATED="$CREATED" \
        "$VENV/bin/python" - "$RECEIPT" <<'PYEOF' || die "could not write the receipt $RECEIPT"
import datetime, json, os, sys
e = os.environ
prev = {}
try:
    prev = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    pass
now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
if prev.get("uninstalled_at"):  # a receipt kept by --uninstall: this is a new install on old data
    prev["installed_at"] = now
created = set(prev.get("created") or []) | {p for p in e["R_CREATED"].split("\n") if p}
r = {
    "installer_version": int(e["R_INST"]),
    "version": e["R_VERSION"],
    "previous_version": e["R_OLD"] or None,
    "source": e["R_SOURCE"],
    "source_kind": e["R_KIND"],
    "mode": e["R_MODE"],
    "user": e["R_USER"],
    "installed_at": prev.get("installed_at", now),
    "updated_at": now,
    "python": e["R_PY"],
    "extras": e["R_EXTRAS"].strip("[]") or None,
    "gpu": e["R_GPU"],
    "service": e["R_SERVICE"],
    "port": int(e["R_PORT"]),
    "paths": {"prefix": e["R_PREFIX"], "venv": e["R_VENV"], "bin": e["R_BIN"], "config": e["R_CONF"],
              "env_file": e["R_ENV"], "state": e["R_STATE"], "kv_dir": e["R_KV"], "crashes": e["R_CRASH"],
              "logs": e["R_LOGS"], "unit": e["R_UNIT"]},
    "options": {"start": e["R_START"] == "1", "no_service": e["R_NOSVC"] == "1", "model": e["R_MODEL"] or None},
    # the directories this installer made (and so --purge may remove)
    "created": sorted(created),
}
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    json.dump(r, f, indent=2)
    f.write("\n")
os.replace(tmp, sys.argv[1])
PYEOF
    say "wrote $RECEIPT"

    # -- start ---------------------------------------------------------------------------------------
    local started=0
    if [ "$OPT_START" = 1 ] || [ "$WAS_RUNNING" = 1 ]; then
        [ "$OPT_START" = 1 ] || say "ember was running before the upgrade: starting it again"
        start_ember
        started=1
    fi

    step "Done"
    if [ "$UPGRADE" = 1 ]; then say "upgraded ember ${OLD_VERSION:-?} -> $VERSION"; else say "installed ember $VERSION"; fi
    cat <<EOF
  command   $BIN_LINK
  config    $CONF  (see: ember config show)
  data      $STATE  (kv/ KV files, crashes/ crash archive, logs/ logs)
  service   $SERVICE
  receipt   $RECEIPT
EOF
    if [ "$started" = 0 ]; then
        say "start it with: ember start     (then: ember status, ember logs -f, ember stop)"
    fi
    return 0
}

ember_install "$@"
