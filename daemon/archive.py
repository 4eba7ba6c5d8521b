"""Archive one classified incident as a crash bundle: cut the log window and the session events,
assemble meta.json, write the bundle (bundle.py) and apply the retention limits. Called by the
lifecycle after classify() and before the restart; it decides nothing about the worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.ops.contract import iso_utc

from . import bundle
from .detect import CRASH_EXIT, OOM
from .incarnation import Incarnation
from .incident import Incident
from .logwatch import Line
from .policy import Decision
from .probes import ProbeResult
from .settings import Settings, redact_argv, worker_command
from .sysfacts import ember_version, gpu_facts, host_facts


@dataclass(frozen=True)
class Archived:
    id: str  # the bundle's directory name under crashes/
    signature: str


def archive(crashes: Path, inc: Incident, worker: Incarnation, lines: list[Line], decision: Decision, *,
            settings: Settings, health: Iterable[ProbeResult], restarts: int, backoff_level: int,
            secrets: Iterable[str | None], log: Callable[..., Any]) -> Archived:
    s = settings
    window, winfo = bundle.log_window(lines, inc.crash_seq, context=s.window_context, until=inc.t_detect)
    events = bundle.session_events(lines, inc.t_detect - s.events_seconds)
    records = [h.record() for h in health][-s.health_records:]
    detail = bundle.last_error_line(lines[-200:]) if inc.cls in (CRASH_EXIT, OOM) else ""
    exit_info = inc.exit.as_dict()
    sig, sig_text = bundle.signature(inc.cls, inc.cuda, exit_info, detail)
    uptime = (inc.t_detect - worker.started) if worker.started else None
    engine = s.engine_label
    meta = {
        "schema": bundle.SCHEMA,
        "id": bundle.bundle_id(inc.t_detect, inc.cls),
        "class": inc.cls,
        "signature": sig,
        "signature_text": sig_text,
        "detected_at": iso_utc(inc.t_detect),
        "detection": {"source": inc.source, "reason": inc.reason, **inc.details},
        "exit": exit_info,
        "exit_code": inc.exit.code,
        "signal": inc.exit.signal,
        "cuda_error": inc.cuda,
        "uptime_seconds": round(uptime, 3) if uptime is not None else None,
        "restart_count": restarts,
        "backoff_level": backoff_level,
        "restart": decision.as_dict(),
        "worker": {
            "engine": engine,
            "pid": inc.pid,
            "started_at": iso_utc(worker.started) if worker.started else None,
            "version": worker.facts.get("version"),
            "command": redact_argv(worker_command(s)),
            "config": worker.facts.get("config"),
            "model": worker.facts.get("model"),
            "model_fingerprint": worker.facts.get("fingerprint"),
            "backend": worker.facts.get("backend"),
            "endpoint": s.endpoint,
            # a member of `replicas` (daemon/fleet.py): which one, on which GPU (CUDA_VISIBLE_DEVICES)
            "replica": os.environ.get("EMBER_REPLICA"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "log_window": winfo,
        "events": {"count": len(events), "seconds": s.events_seconds},
        "health": {"count": len(records)},
        "daemon": {"version": ember_version(), "pid": os.getpid(), "settings": s.redacted()},
        "host": host_facts(),
        "gpu": gpu_facts(),
    }
    path = bundle.write_bundle(crashes, meta, window, events, records, bundle.Scrubber(secrets))
    removed = bundle.enforce_retention(crashes, s.crash_keep, s.crash_max_bytes, protect=path.name)
    log("crash_bundle", id=path.name, incident=inc.cls, signature=sig, path=str(path),
        window_lines=len(window), events=len(events), removed=removed or None)
    return Archived(path.name, sig)
