"""One worker process, from its spawn to its exit: who it is, where its log lines start, what they
said about it, and the probe bookkeeping that belongs to it alone. A new worker gets a new
Incarnation, so nothing one worker did is held against the next. Plain data plus scan(), which
reads the facts the worker logs (its version and config, the model it loaded, request outcomes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ember.ops.contract import OUTCOMES, Event

from .logwatch import Line
from .procs import OomCount
from .verdicts import LiveWatch, ReadyWatch

# the memory picture a CUDA worker reports (worker/backends/cuda/memory.MemoryPicture.as_dict)
MEMORY_FACTS = ("device_total_mb", "weights_mb", "f16_copy_mb", "kv_pool_mb", "unified_memory", "kv_host_tier_mb")
READY_FACTS = ("model", "fingerprint", "backend", "ctx", "max_seqs", "kv_tokens", "startup_seconds", "kv_persistence",
               *MEMORY_FACTS)
# what `ember status` keeps of the worker's KV persistence (the `kv_persistence` event, the health bodies)
PERSISTENCE_FIELDS = ("state", "reason", "since", "not_persisted", "errno", "retry_in", "dir")


@dataclass
class Incarnation:
    pid: int | None = None
    ctime: float | None = None  # its creation time: a pid reused by another process has another one
    started: float | None = None  # wall time
    spawn_m: float = field(default_factory=time.monotonic)
    spawn_seq: int = 0  # the log ring's sequence number just before this worker's first line
    scan_seq: int = 0  # the last line scan() has read
    ready: bool = False
    ready_at: float | None = None
    outcomes: int = 0  # request outcomes it logged (progress evidence for the readiness rule)
    facts: dict[str, Any] = field(default_factory=dict)
    live: LiveWatch = field(default_factory=LiveWatch)
    readiness: ReadyWatch = field(default_factory=ReadyWatch)
    oom: OomCount = field(default_factory=OomCount)  # its cgroup's OOM kill count when it started

    def scan(self, lines: list[Line]) -> None:
        """Read the facts in log lines after scan_seq (only this worker's: after spawn_seq)."""
        for ln in lines:
            self.scan_seq = ln.seq
            o = ln.obj
            if ln.seq <= self.spawn_seq or not o:
                continue
            ev = o.get("event")
            if ev == Event.CONFIG:
                self.facts.update(version=o.get("version"), config=o.get("config"), worker_pid=o.get("pid"))
            elif ev == Event.READY:
                self.facts.update({k: o[k] for k in READY_FACTS if k in o})
            elif ev == Event.CONFIG_ERROR:
                self.facts["config_error"] = o.get("error")
            elif ev == Event.KV_PERSISTENCE:
                self.facts["kv_persistence"] = {k: o.get(k) for k in PERSISTENCE_FIELDS if o.get(k) is not None}
            elif ev in OUTCOMES:
                self.outcomes += 1
