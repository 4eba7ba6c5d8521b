"""The restart policy: exponential backoff, a circuit breaker, and no restart for configuration errors.

- Backoff: the n-th consecutive failure waits base * 2**(n-1), capped (1 s doubling to 60 s); the
  count resets once the worker has been ready for `reset` seconds (10 minutes).
- A poisoned context (exit 75, or one detected in the log or by the health endpoint) restarts after
  the minimum delay and does not raise the backoff level; it still counts for the breaker.
- Breaker: `crashes` failures within `window` seconds open it: no more restarts, state `failed`
  with the reason, until a person runs `ember start` or `ember restart`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    level: int = 0  # consecutive failures counted for backoff
    times: list[float] = field(default_factory=list)  # failure times (wall clock), for the breaker
    healthy_since: float | None = None

    def on_failure(self, now: float, cls: str, *, minimal: bool = False) -> Decision:
        self.healthy_since = None
        self.times = [t for t in self.times if now - t < self.window] + [now]
        if len(self.times) >= self.crashes:
            span = now - self.times[0]
            return Decision(False, 0.0, f"circuit breaker open: {len(self.times)} failures in {_span(span)} "
                                        f"(limit {self.crashes} in {_span(self.window)}); last: {cls}")
        if minimal:
            return Decision(True, self.base, f"{cls}: restart after the minimum delay")
        delay = min(self.base * (2 ** self.level), self.max)
        self.level += 1
        return Decision(True, delay, f"{cls}: failure {self.level} in a row, restart in {delay:g}s")

    def on_ready(self, now: float) -> None:
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

    def dump(self) -> dict[str, Any]:
        return {"level": self.level, "times": self.times}

    def load(self, d: dict[str, Any] | None) -> None:
        if d:
            self.level = int(d.get("level", 0))
            self.times = [float(t) for t in d.get("times", [])]


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.1f} min"
