"""The daemon's state machine and incident classes on their own: the phase table, the one setter that
logs, the state `ember status` shows for each phase, and classify() (pure: evidence in, class out).
The same transitions with real processes: test_daemon_supervision.py."""

from __future__ import annotations

import pytest

from ember.daemon import detect
from ember.daemon.incident import ExitInfo, Incident, classify, exit_incident
from ember.daemon.phases import ALLOWED, IllegalTransition, Phase, PhaseMachine, Status, status_of

P = Phase


def _machine() -> tuple[PhaseMachine, list[dict]]:
    events: list[dict] = []
    return PhaseMachine(lambda event, **fields: events.append({"event": event, **fields})), events


def test_every_transition_is_logged_with_from_to_and_why():
    m, events = _machine()
    for to, why in ((P.STARTING, "ember start"), (P.RUNNING, "ready"), (P.KILLING, "hang"), (P.BACKOFF, "archived")):
        m.to(to, why)
    assert m.phase is P.BACKOFF
    assert events == [{"event": "phase", "from": "stopped", "to": "starting", "why": "ember start"},
                      {"event": "phase", "from": "starting", "to": "running", "why": "ready"},
                      {"event": "phase", "from": "running", "to": "killing", "why": "hang"},
                      {"event": "phase", "from": "killing", "to": "backoff", "why": "archived"}]


@pytest.mark.parametrize("start,to", [(P.STOPPED, P.RUNNING), (P.BACKOFF, P.RUNNING), (P.FAILED, P.KILLING),
                                      (P.STOPPED, P.STOPPED), (P.RUNNING, P.STOPPED), (P.KILLING, P.RUNNING)])
def test_a_transition_the_table_lacks_raises_and_changes_nothing(start, to):
    m, events = _machine()
    m.phase = start
    with pytest.raises(IllegalTransition, match=f"{start} -> {to}"):
        m.to(to, "a bug")
    assert m.phase is start and events == []


def test_the_table_reads_as_the_lifecycle():
    assert set(ALLOWED) == set(Phase)
    only_from = {to: {f for f, tos in ALLOWED.items() if to in tos} for to in Phase}
    assert only_from[P.RUNNING] == {P.STARTING}  # ready only after a ready probe while starting
    assert only_from[P.STOPPED] == {P.STOPPING}  # stopped only by way of a drain
    assert only_from[P.KILLING] == {P.STOPPED, P.STARTING, P.RUNNING}  # stopped: re-attached to a dead worker
    assert all(P.FAILED in tos and P.STOPPING in tos for tos in ALLOWED.values())  # stop and failure: from anywhere
    # a start that finds the port taken backs off, wherever a start was due (lifecycle.spawn)
    assert only_from[P.BACKOFF] == set(Phase)


def test_status_of_each_phase_is_what_ember_status_always_showed():
    shown = {p: status_of(p, ready=True) for p in Phase}
    assert shown == {P.STOPPED: "stopped", P.STARTING: "starting", P.RUNNING: "ready", P.KILLING: "restarting",
                     P.BACKOFF: "backoff", P.STOPPING: "stopping", P.FAILED: "failed"}
    assert status_of(P.RUNNING, ready=False) is Status.NOT_READY and Status.NOT_READY == "not-ready"


# -- classify: the crash class from what was detected and the evidence ------------------------------------------


def _incident(cls: str, exit_info: ExitInfo | None = None, **evidence) -> Incident:
    inc = Incident(cls, "why", "exit", 0.0, 0.0, 42, exit=exit_info or ExitInfo())
    for k, v in evidence.items():
        setattr(inc, k, v)
    return inc


POISON = {"code": 700, "name": "CUDA_ERROR_ILLEGAL_ADDRESS"}


@pytest.mark.parametrize("detected,exit_info,evidence,cls", [
    (detect.CRASH_EXIT, ExitInfo(code=1), {}, detect.CRASH_EXIT),
    (detect.POISONED, ExitInfo(code=75), {}, detect.POISONED),
    (detect.HANG, ExitInfo(code=75), {}, detect.POISONED),  # it said so on the way out
    (detect.CRASH_EXIT, ExitInfo(code=1), {"poison": POISON}, detect.POISONED),  # the log knew better
    (detect.CRASH_SIGNAL, ExitInfo(signal="SIGABRT"), {"poison": POISON}, detect.POISONED),
    (detect.HANG, ExitInfo(signal="SIGKILL", killed_by_daemon=True), {"poison": POISON}, detect.HANG),
    (detect.CRASH_SIGNAL, ExitInfo(signal="SIGKILL"), {"oom": True}, detect.OOM),
    (detect.CRASH_EXIT, ExitInfo(code=1), {"oom": True, "poison": POISON}, detect.POISONED),
    (detect.UNRESPONSIVE, ExitInfo(signal="SIGKILL", killed_by_daemon=True), {"oom": True}, detect.UNRESPONSIVE),
])
def test_classify(detected, exit_info, evidence, cls):
    assert classify(_incident(detected, exit_info, **evidence)) == cls


def test_an_exit_nobody_asked_for_names_its_cause():
    assert exit_incident(ExitInfo(code=75)) == (detect.POISONED, "exit 75: poisoned compute context")
    assert exit_incident(ExitInfo(signal="SIGSEGV", core_dumped=True)) == (detect.CRASH_SIGNAL,
                                                                          "killed by SIGSEGV (core dumped)")
    assert exit_incident(ExitInfo(code=3)) == (detect.CRASH_EXIT, "exit 3")


def test_exit_info_keeps_what_the_incident_recorded_over_a_later_reading():
    later = ExitInfo(signal="SIGKILL", signal_number=9, core_dumped=False, supervisor="terminated by SIGKILL")
    recorded = ExitInfo(killed_by_daemon=True, note="the process did not die after SIGKILL")
    assert later.overlay(recorded).as_dict() == {
        "signal": "SIGKILL", "signal_number": 9, "core_dumped": False, "supervisor": "terminated by SIGKILL",
        "killed_by_daemon": True, "note": "the process did not die after SIGKILL"}
    assert ExitInfo(code=0).as_dict() == {"code": 0}
