"""ember.daemon: the control plane and the `ember` CLI.

    ember daemon run      core.Daemon: drives supervisord (supctl), probes (probes, APScheduler),
                          watches the log (logwatch, watchdog), applies the policy (policy), writes
                          crash bundles (bundle), speaks sd_notify (notify), answers the CLI (control)
    ember start|stop|restart|status|logs      commands
    ember crashes list|show|export            ember.ops.crashes

Settings: `[daemon]` in ember.toml, `EMBER_DAEMON_*`, or flags (settings.py). State: paths.py.
Never imports ember.worker or ember.kernels: the worker is a command, watched through its contracts.
"""
