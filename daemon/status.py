"""What `ember status` shows and run/status.json holds: one dict built from the lifecycle's state,
the daemon's own facts and the log watcher's mode. Read-only: nothing here changes a phase.
"""

from __future__ import annotations

import time
from collections.abc import Reversible
from typing import TYPE_CHECKING, Any

from ember.ops.contract import iso_utc

from .incarnation import MEMORY_FACTS
from .phases import Phase, Status
from .probes import Probe, ProbeResult

if TYPE_CHECKING:
    from .lifecycle import Lifecycle

SCHEMA = 1


def _last(health: Reversible[ProbeResult], *probes: str) -> dict[str, Any] | None:
    rec = next((h for h in reversed(health) if h.probe in probes), None)
    return rec.record() if rec is not None else None


def build_status(life: Lifecycle, *, daemon: dict[str, Any], log_watch: dict[str, Any] | None) -> dict[str, Any]:
    now, now_m = time.time(), time.monotonic()
    s, w, policy = life.s, life.worker, life.policy
    st = life.state()
    up = bool(w.pid and w.started)
    return {
        "schema": SCHEMA,
        "updated_at": iso_utc(now),
        "state": st,
        "ready": st is Status.READY,
        "endpoint": s.endpoint,
        "not_ready_reason": None if st is Status.READY else (life.failed_reason or life.not_ready_reason or st),
        "failed_reason": life.failed_reason,
        "daemon": daemon,
        "worker": {"pid": w.pid, "state": st, "engine": s.engine_label,
                   "started_at": iso_utc(w.started) if up and w.started else None,
                   "uptime_seconds": round(now - w.started, 1) if up and w.started else None,
                   "model": w.facts.get("model"), "fingerprint": w.facts.get("fingerprint"),
                   "version": w.facts.get("version"), "incarnation": life.incarnation,
                   "backend": w.facts.get("backend"), "ctx": w.facts.get("ctx"), "kv_tokens": w.facts.get("kv_tokens"),
                   "memory": {k: w.facts[k] for k in MEMORY_FACTS if k in w.facts} or None,
                   "kv_persistence": w.facts.get("kv_persistence") if up else None},
        "restarts": life.restarts,
        "backoff_level": policy.level,
        "next_restart_in": (round(max(0.0, life.backoff_until - now_m), 1) if life.phase is Phase.BACKOFF
                            else None),
        "last_crash": life.last_crash,
        "last_recovery_seconds": life.last_recovery_seconds,
        "breaker": policy.status(now),
        "port_conflict": life.port_conflict,
        "liveness": w.live.status(now_m, s) if life.phase is Phase.RUNNING else None,
        "log_watch": log_watch,
        "probes": {"live": _last(life.health, Probe.LIVE), "ready": _last(life.health, Probe.READY, Probe.STARTUP)},
    }
