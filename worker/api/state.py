"""The worker's health state, read by /health/live and /health/ready without the engine lock.

States (docs/architecture.md, "The contracts"; ops/contract.HealthState): `loading` (model not ready
yet), `ready`, `draining` (SIGTERM: finishing in-flight work, no new admissions), `poisoned` (the
compute context is gone; the process exits). `set` is the one way to change it, and each change is
logged once (`health_state`, with the state before); there is no way back from `poisoned`.

Liveness also fails when the engine loop is stalled (it has work but has not made progress for
`stall_seconds`) and when one of the worker's guarded threads died (the engine loop, the KV
store's reader, writer or scan, a grammar mask thread: see worker/threads.py); the body then
names each dead thread, and the daemon restarts the worker. What it knows of the engine is the
stats the engine publishes (engine/stats.py) and the worker's record of dead threads, never the
engine's queues.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ember.ops.contract import Event, HealthState, PersistState

from ..logs import log

if TYPE_CHECKING:
    from ..engine.loop import Engine
    from ..kvstore.store import KVStore
    from ..model.loader import Model
    from ..text.formats import ModelFormats

STATES = tuple(HealthState)
DEFAULT_STALL_SECONDS = 60.0


def _checked(state: str) -> HealthState:
    if state not in STATES:
        raise ValueError(f"unknown state {state!r} (one of {', '.join(STATES)})")
    return HealthState(state)


class ServerState:
    def __init__(self, state: HealthState = HealthState.LOADING, *, stall_seconds: float = DEFAULT_STALL_SECONDS):
        self._state = _checked(state)
        self.stall_seconds = stall_seconds
        self.changed_at = time.monotonic()
        self.engine: Engine | None = None  # set by create_app (or attach, when the model loads after the app starts)
        self.model: Model | None = None
        self.formats: ModelFormats | None = None  # the model's tool-call and reasoning formats, resolved at load
        self.store: KVStore | None = None  # the KV store, whose persistence state the bodies show

    def attach(self, engine: Engine | None, model: Model | None, formats: ModelFormats | None = None) -> None:
        self.engine, self.model, self.formats = engine, model, formats

    def set(self, state: HealthState) -> None:
        """Change the state (logged once); a poisoned worker stays poisoned."""
        new = _checked(state)
        if self._state is HealthState.POISONED or new is self._state:
            return
        log(Event.HEALTH_STATE, state=new, previous=self._state)
        self._state = new
        self.changed_at = time.monotonic()

    @property
    def state(self) -> HealthState:
        engine = self.engine
        if engine is not None and engine.stats.poisoned is not None:
            return HealthState.POISONED
        return self._state

    def stalled_for(self) -> float | None:
        """Seconds since the engine last made progress, if it has work and that exceeds stall_seconds."""
        engine = self.engine
        if engine is None:
            return None
        stats = engine.stats
        age = time.monotonic() - stats.last_progress
        if stats.busy and age > self.stall_seconds:
            return age
        return None

    def dead_threads(self) -> dict[str, str]:
        """Guarded threads that died (name -> error), from the worker's ThreadWatch (the engine's)."""
        return dict(self.engine.watch.dead) if self.engine is not None else {}

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
        """Facts for the health bodies, from the engine's published stats: never the engine lock."""
        out: dict[str, Any] = {"state": self.state, "state_seconds": round(time.monotonic() - self.changed_at, 3)}
        engine = self.engine
        if engine is not None:
            stats = engine.stats
            out.update(
                running=stats.running, waiting=stats.waiting, steps=stats.steps,
                last_progress_seconds=round(time.monotonic() - stats.last_progress, 3),
                stalled=self.stalled_for() is not None,
            )
            dead = self.dead_threads()
            if dead:
                out["dead_threads"] = [{"thread": name, "error": error} for name, error in sorted(dead.items())]
                out["error"] = {"code": None, "name": Event.THREAD_DIED,  # what the daemon's probe log keeps
                                "message": "; ".join(f"thread {n} died: {e}" for n, e in sorted(dead.items()))}
            p = stats.poisoned
            if p is not None:
                out["error"] = {"code": p.code, "name": p.name, "message": p.message}
        out["kv_persistence"] = self.kv_persistence()
        return out
