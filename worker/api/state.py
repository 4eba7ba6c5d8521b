"""The worker's readiness state, read by /health/live and /health/ready without the engine lock.

States (DESIGN.md): `loading` (model not ready yet), `ready`, `draining` (SIGTERM: finishing
in-flight work, no new admissions), `poisoned` (the compute context is gone; the process exits).
Liveness also fails when the engine loop is stalled (it has work but has not made progress for
`stall_seconds`) and when one of the worker's guarded threads died (the engine loop, the KV
store's reader, writer or scan, a grammar mask thread: see worker/threads.py); the body then
names each dead thread, and the daemon restarts the worker.
"""

from __future__ import annotations

import time
from typing import Any

from ember.ops.contract import Event, HealthState, PersistState

STATES = tuple(HealthState)
DEFAULT_STALL_SECONDS = 60.0


class ServerState:
    def __init__(self, state: str = HealthState.LOADING, *, stall_seconds: float = DEFAULT_STALL_SECONDS):
        if state not in STATES:
            raise ValueError(f"unknown state {state!r} (one of {', '.join(STATES)})")
        self._state = state
        self.stall_seconds = stall_seconds
        self.changed_at = time.monotonic()
        self.engine: Any = None  # set by create_app (or attach, when the model loads after the app starts)
        self.model: Any = None
        self.formats: Any = None  # the model's tool-call and reasoning formats (text/formats), resolved at load
        self.store: Any = None  # the KV store (kvstore/store.py), whose persistence state the bodies show

    def attach(self, engine: Any, model: Any, formats: Any = None) -> None:
        self.engine, self.model, self.formats = engine, model, formats

    def set(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r} (one of {', '.join(STATES)})")
        if self._state == HealthState.POISONED:  # there is no way back from a lost compute context
            return
        if state != self._state:
            self._state = state
            self.changed_at = time.monotonic()

    @property
    def state(self) -> str:
        engine = self.engine
        if engine is not None and getattr(engine, "poisoned", None) is not None:
            return HealthState.POISONED
        return self._state

    def stalled_for(self) -> float | None:
        """Seconds since the engine last made progress, if it has work and that exceeds stall_seconds."""
        engine = self.engine
        if engine is None:
            return None
        age = time.monotonic() - engine.last_progress
        if engine.busy and age > self.stall_seconds:
            return age
        return None

    def dead_threads(self) -> dict[str, str]:
        """Guarded threads that died (name -> error), from the engine's ThreadWatch."""
        watch = getattr(self.engine, "watch", None)
        return dict(watch.dead) if watch is not None else {}

    def kv_persistence(self) -> dict[str, Any]:
        """Whether KV blocks reach the disk (the store's own snapshot; never the engine's queues)."""
        if self.store is None:
            why = "kv_persist is off" if self.engine is not None else "the model is still loading"
            return {"state": PersistState.OFF, "reason": why}
        snapshot: dict[str, Any] = self.store.persistence.snapshot()
        return snapshot

    def accepting(self) -> bool:
        return self.state == HealthState.READY and self.engine is not None

    def live_ok(self) -> bool:
        return self.state != HealthState.POISONED and self.stalled_for() is None and not self.dead_threads()

    def ready_ok(self) -> bool:
        return self.state == HealthState.READY and self.live_ok()

    def describe(self) -> dict[str, Any]:
        """Facts for the health bodies: plain attribute reads, never the engine lock."""
        out: dict[str, Any] = {"state": self.state, "state_seconds": round(time.monotonic() - self.changed_at, 3)}
        engine = self.engine
        if engine is not None:
            age = time.monotonic() - engine.last_progress
            out.update(
                running=len(engine.running), waiting=len(engine.waiting), steps=engine.step_count,
                last_progress_seconds=round(age, 3), stalled=self.stalled_for() is not None,
            )
            dead = self.dead_threads()
            if dead:
                out["dead_threads"] = [{"thread": name, "error": error} for name, error in sorted(dead.items())]
                out["error"] = {"code": None, "name": Event.THREAD_DIED,  # what the daemon's probe log keeps
                                "message": "; ".join(f"thread {n} died: {e}" for n, e in sorted(dead.items()))}
            p = getattr(engine, "poisoned", None)
            if p is not None:
                out["error"] = {"code": getattr(p, "code", None), "name": getattr(p, "name", None),
                                "message": getattr(p, "message", str(p))}
        out["kv_persistence"] = self.kv_persistence()
        return out
