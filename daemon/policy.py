"""The restart policy: exponential backoff, a circuit breaker that cools down, and no restart for
configuration errors. It decides from failures it is told about; it never looks at a process.

- Backoff: the n-th consecutive failure waits base * 2**(n-1), capped (1 s doubling to 60 s); the
  count resets once the worker has been ready for `reset` seconds (10 minutes). The level stops
  growing at LEVEL_CAP, so a worker that fails for weeks never overflows the arithmetic.
- A poisoned context (exit 75, ExitCode.POISONED, or one detected in the log or by the health endpoint) restarts after
  the minimum delay and does not raise the backoff level; it still counts for the breaker.
- An `unresponsive` kill (the process was alive but its liveness probe timed out for
  unresponsive_seconds: an overloaded event loop, not a crash) raises the backoff level like any
  failure but never counts toward the breaker: one overload must not turn into an outage.
- Breaker: `crashes` counted failures within `window` seconds open it: no restart, state `failed`
  with the reason. After `cooldown` seconds (0 = never) the daemon tries once more (half-open):
  the breaker closes when that worker becomes ready, and opens again at once if it fails first.
  `ember start` or `ember restart` closes it immediately.
- A port another process holds (PORT_BUSY: found before the spawn, or the worker's exit 69,
  ExitCode.PORT_BUSY) waits the backoff like any failure, so the worker is back within one backoff
  step of the port coming free, and never counts toward the breaker: the holder may let go at any
  time, and nothing about the worker is wrong.
- A configuration error (exit 78, ExitCode.CONFIG) is not a failure of this policy: the daemon stops without
  restarting and no cool-down ever retries it (lifecycle.py calls close_breaker()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.ops.contract import iso_utc

from .detect import UNRESPONSIVE

LEVEL_CAP = 64  # 2**64 times any sane base is past any sane max: more levels change nothing
PORT_BUSY = "port-busy"  # a failure class of the daemon's own (no crash bundle: the worker never ran)
BREAKER_EXEMPT = frozenset({UNRESPONSIVE, PORT_BUSY})  # failure classes the breaker does not count


@dataclass
class Decision:
    restart: bool
    delay: float = 0.0
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"restart": self.restart, "delay": round(self.delay, 3), "reason": self.reason}


@dataclass
class RestartPolicy:
    base: float = 1.0
    max: float = 60.0
    reset: float = 600.0
    crashes: int = 5
    window: float = 600.0
    cooldown: float = 600.0  # seconds an open breaker waits before one more try; 0 = until a person acts
    level: int = 0  # consecutive failures counted for backoff (at most LEVEL_CAP)
    times: list[float] = field(default_factory=list)  # counted failure times (wall clock), for the breaker
    healthy_since: float | None = None
    opened_at: float | None = None  # wall time the breaker opened; None = closed (or half-open)
    trial: bool = False  # half-open: the one restart after a cool-down is running

    def delay(self) -> float:
        """The backoff for the next failure at the current level (never overflows)."""
        return min(self.base * 2.0 ** min(self.level, LEVEL_CAP), self.max)

    def on_failure(self, now: float, cls: str, *, minimal: bool = False) -> Decision:
        self.healthy_since = None
        counted = cls not in BREAKER_EXEMPT
        if counted:
            self.times = [t for t in self.times if now - t < self.window] + [now]
        if counted and self.trial:
            return self._open(now, f"circuit breaker open again: the restart after the cool-down failed ({cls})")
        if counted and len(self.times) >= self.crashes:
            span = now - self.times[0]
            return self._open(now, f"circuit breaker open: {len(self.times)} failures in {_span(span)} "
                                   f"(limit {self.crashes} in {_span(self.window)}); last: {cls}")
        if minimal:
            return Decision(True, self.base, f"{cls}: restart after the minimum delay")
        delay = self.delay()
        self.level = min(self.level + 1, LEVEL_CAP)
        note = "" if counted else " (not counted toward the circuit breaker)"
        return Decision(True, delay, f"{cls}: failure {self.level} in a row, restart in {delay:g}s{note}")

    def _open(self, now: float, reason: str) -> Decision:
        self.opened_at = now
        self.trial = False
        if self.cooldown > 0:
            reason += f"; trying again in {_span(self.cooldown)}"
        else:
            reason += "; ember start restarts it"
        return Decision(False, 0.0, reason)

    # -- the breaker's cool-down ----------------------------------------------------------------------

    def retry_at(self) -> float | None:
        """Wall time of the half-open try, or None (closed, or a person must act)."""
        if self.opened_at is None or self.cooldown <= 0:
            return None
        return self.opened_at + self.cooldown

    def due(self, now: float) -> bool:
        at = self.retry_at()
        return at is not None and now >= at

    def half_open(self) -> None:
        """The cool-down is over: one restart, watched (the next counted failure opens it again)."""
        self.opened_at = None
        self.trial = True

    def open_now(self, now: float, reason: str) -> Decision:
        """Open the breaker for a reason of the daemon's own (a half-open try that could not start)."""
        return self._open(now, reason)

    def close_breaker(self) -> None:
        """No cool-down pending and no try watched, the failure times kept: after a configuration
        error (never retried automatically), or when a fresh daemon starts the worker anyway."""
        self.opened_at = None
        self.trial = False

    def state(self) -> str:
        if self.opened_at is not None:
            return "open"
        return "half-open" if self.trial else "closed"

    def status(self, now: float) -> dict[str, Any]:
        """The breaker, for `ember status` (times as UTC ISO strings)."""
        at = self.retry_at()
        return {"state": self.state(), "failures": sum(1 for t in self.times if now - t < self.window),
                "limit": self.crashes, "window_seconds": self.window, "cooldown_seconds": self.cooldown,
                "opened_at": _iso(self.opened_at), "retry_at": _iso(at)}

    # -- health -----------------------------------------------------------------------------------------

    def on_ready(self, now: float) -> None:
        self.trial = False  # a half-open try that reached ready closes the breaker
        if self.healthy_since is None:
            self.healthy_since = now

    def on_not_ready(self) -> None:
        self.healthy_since = None

    def tick(self, now: float) -> bool:
        """Reset the backoff after `reset` healthy seconds; True when it did."""
        if self.level and self.healthy_since is not None and now - self.healthy_since >= self.reset:
            self.level = 0
            return True
        return False

    def clear(self) -> None:
        """A person asked for a start: close the breaker, forget the backoff."""
        self.level = 0
        self.times = []
        self.opened_at = None
        self.trial = False

    def dump(self) -> dict[str, Any]:
        return {"level": self.level, "times": self.times, "opened_at": self.opened_at, "trial": self.trial}

    def load(self, d: dict[str, Any] | None) -> None:
        if d:
            self.level = max(0, min(int(d.get("level", 0)), LEVEL_CAP))
            self.times = [float(t) for t in d.get("times", [])]
            self.opened_at = float(d["opened_at"]) if d.get("opened_at") is not None else None
            self.trial = bool(d.get("trial", False))


def _iso(t: float | None) -> str | None:
    return None if t is None else iso_utc(t)


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.1f} min"
