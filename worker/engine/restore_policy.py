"""Restore or recompute: whether reading a prompt's stored KV blocks back beats computing them.

A warm admit finds part of its prompt in the KV store (host RAM or disk). Reading it back costs its
bytes over the tier's bandwidth; computing it costs its tokens over the device's prefill rate. On
a small model and a fast GPU computing can win (the H200 prefills a 270M model at hundreds of
thousands of tokens a second); on a slow one (a DGX Spark at about 900 tok/s, the CPU backend at a
few hundred) reading wins by far. Both rates are measured by this worker as it runs (moving
averages of real prefill steps and real restores) and kept beside the KV blocks (`rates.json`), so
a restarted worker decides its first warm admits by them too; until a rate is known, restoring is
assumed to win, so the first restore measures it. The engine logs each choice (`kv_restore_choice`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PRIOR_BANDWIDTH = {"host": 8e9, "disk": 1e9}  # bytes/s until measured
MIN_PREFILL_TOKENS = 64  # steps with fewer prefill tokens say little about the rate
WEIGHT = 0.2  # of a new measurement in the moving average
FIXED_SECONDS = 0.002  # a restore's own overhead (a job on the reader thread, one load a batch)


@dataclass(frozen=True)
class Choice:
    restore: bool
    restore_seconds: float
    compute_seconds: float | None  # None: the prefill rate is not measured yet


class RestoreCosts:
    def __init__(self) -> None:
        self.prefill_tps: float | None = None
        self.bandwidth: dict[str, float] = {}  # measured bytes/s by tier

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tps = _blend(self.prefill_tps, tokens / seconds)

    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = _blend(self.bandwidth.get(tier), nbytes / seconds)

    def load(self, path: Path) -> None:
        """The rates a previous process measured (a missing or unreadable file: none)."""
        try:
            data = json.loads(path.read_text())
            tps = data.get("prefill_tps")
            self.prefill_tps = float(tps) if tps else None
            self.bandwidth = {t: float(v) for t, v in data.get("bandwidth", {}).items() if t in PRIOR_BANDWIDTH}
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def save(self, path: Path) -> None:
        """Atomically, best effort (a read-only KV dir keeps no rates)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"prefill_tps": self.prefill_tps, "bandwidth": self.bandwidth}))
            os.replace(tmp, path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def rate(self, tier: str) -> float:
        return self.bandwidth.get(tier, PRIOR_BANDWIDTH[tier])

    def choose(self, tokens: int, host_bytes: int, disk_bytes: int) -> Choice:
        """Restore `host_bytes` + `disk_bytes` standing for `tokens` prompt tokens, or compute them."""
        restore = FIXED_SECONDS + host_bytes / self.rate("host") + disk_bytes / self.rate("disk")
        if self.prefill_tps is None:
            return Choice(True, restore, None)
        compute = tokens / self.prefill_tps
        return Choice(restore <= compute, restore, compute)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
