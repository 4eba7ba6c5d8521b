"""The supervised worker's phases, the transitions allowed between them, and the state `ember status`
shows for each: data and one guarded setter that logs. What moves the worker from phase to phase is
lifecycle.py: its event handlers (commands, probe verdicts, exits) and its transition() (time).

    phase     what is happening                                          `ember status` state
    stopped   nothing runs: before the first start, after `ember stop`   stopped
    starting  spawned; no ready probe has passed yet                     starting
    running   a ready probe passed; liveness and readiness are watched   ready | not-ready
    killing   an incident: the worker is killed, then archived           restarting
    backoff   archived; the restart delay runs                           backoff
    stopping  draining on request (`ember stop`, `ember restart`)        stopping
    failed    no restart: a configuration error, or the breaker is open  failed

Transitions (from -> to: why); the loop logs each one as a `phase` event with `from`, `to`, `why`:

    stopped  -> starting  `ember start`; a fresh daemon's first worker; re-attached to a live worker
    stopped  -> killing   re-attached: the worker died while no daemon watched (archive it)
    stopped  -> backoff   re-attached: the worker exited 0 while no daemon watched (restart it)
    starting -> running   the first ready probe passed
    starting -> killing   an incident: poison, no ready probe within startup_timeout, an exit nobody asked for
    running  -> killing   an incident: a probe verdict, poison in the log, an exit nobody asked for
    starting -> backoff   the worker exited 0 without being asked (restarted like a failure), or 69 (its
                          port was taken: ExitCode.PORT_BUSY)
    running  -> backoff   (the same)
    killing  -> backoff   archived; the policy restarts after a delay
    killing  -> starting  archived, and `ember restart` came meanwhile
    killing  -> stopping  archived, and `ember stop` came meanwhile
    backoff  -> starting  the delay is over, or `ember start` / `ember restart`
    any start -> backoff  another process holds the port: tried again after the backoff (from
                          stopped, backoff, failed, stopping or killing, wherever a start was due)
    stopping -> stopped   the worker is gone (for `ember stop` the daemon exits next)
    stopping -> starting  the worker is gone and `ember restart` wants a new one
    failed   -> starting  `ember start` / `ember restart`, or the breaker's cool-down is over (half-open)
    starting, running, killing -> starting   supervisord was lost: a new one, and a new worker
    any      -> stopping  `ember stop` (and `ember restart` from starting or running)
    any      -> failed    exit 78, an engine command that cannot run, the breaker open

Anything else raises IllegalTransition: a bug in the loop, never a state of the worker.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any


class Phase(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    KILLING = "killing"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FAILED = "failed"


P = Phase
ALLOWED: dict[Phase, frozenset[Phase]] = {
    P.STOPPED: frozenset({P.STARTING, P.KILLING, P.BACKOFF, P.STOPPING, P.FAILED}),
    P.STARTING: frozenset({P.STARTING, P.RUNNING, P.KILLING, P.BACKOFF, P.STOPPING, P.FAILED}),
    P.RUNNING: frozenset({P.STARTING, P.KILLING, P.BACKOFF, P.STOPPING, P.FAILED}),
    P.KILLING: frozenset({P.STARTING, P.BACKOFF, P.STOPPING, P.FAILED}),
    P.BACKOFF: frozenset({P.STARTING, P.BACKOFF, P.STOPPING, P.FAILED}),
    P.STOPPING: frozenset({P.STARTING, P.BACKOFF, P.STOPPING, P.STOPPED, P.FAILED}),
    P.FAILED: frozenset({P.STARTING, P.BACKOFF, P.STOPPING, P.FAILED}),
}
WORKER_UP = frozenset({P.STARTING, P.RUNNING})  # a worker runs and is watched (incidents apply)


class Status(enum.StrEnum):
    """The worker's state in status.json and `ember status` (also read by the installer and tests)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    NOT_READY = "not-ready"
    RESTARTING = "restarting"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FAILED = "failed"
    UNSUPERVISED = "unsupervised"  # `ember status` only: no daemon, but supervisord and the worker serve


def status_of(phase: Phase, ready: bool) -> Status:
    if phase is Phase.RUNNING:
        return Status.READY if ready else Status.NOT_READY
    if phase is Phase.KILLING:
        return Status.RESTARTING
    return Status(phase.value)


class IllegalTransition(RuntimeError):
    """A transition ALLOWED does not list: the main loop has a bug."""


class PhaseMachine:
    """The current phase and the one setter that changes it (checked against ALLOWED, then logged)."""

    def __init__(self, log: Callable[..., Any], phase: Phase = Phase.STOPPED) -> None:
        self.log = log
        self.phase = phase

    def to(self, new: Phase, why: str) -> None:
        old = self.phase
        if new not in ALLOWED[old]:
            raise IllegalTransition(f"{old} -> {new} is not a transition of the worker's lifecycle ({why})")
        self.phase = new
        self.log("phase", **{"from": old.value, "to": new.value, "why": why})

    def __repr__(self) -> str:
        return f"PhaseMachine({self.phase.value})"
