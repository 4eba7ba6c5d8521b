"""ember.daemon: the control plane and the `ember` CLI.

    ember daemon run      core.Daemon: the process (lock, log, signals, control socket) around
                          lifecycle.Lifecycle, the worker's state machine (phases.py: the phases and
                          their transitions), which drives supervisord (supervisor, supctl), reads
                          probe results (probes, probe_schedule, verdicts) and the log (logwatch,
                          detect), classifies incidents (incident), archives them (archive, bundle)
                          and applies the restart policy (policy); status.py shows it, notify.py
                          tells systemd
    ember start|stop|restart|status|logs      commands
    ember service|config                      service, config_show
    ember crashes list|show|export            ember.ops.crashes

Settings: `[daemon]` in ember.toml, `EMBER_DAEMON_*`, or flags (settings.py). State: paths.py, under
the contract's state dir. Imports only ember.ops.contract (and ember.ops for CLI verbs), never
ember.worker or ember.kernels: the worker is a command, watched through its contracts.
"""
