"""Restore or recompute: whether reading a prompt's stored KV blocks back beats computing them.

A warm admit finds part of its prompt in the KV store (host RAM or disk). Reading it back costs its
bytes over the tier's bandwidth; computing it costs its tokens over the device's prefill rate. On
a small model and a fast GPU computing can win (the H200 prefills a 270M model at hundreds of
thousands of tokens a second); on a slow one (a DGX Spark at about 900 tok/s, the CPU backend at a
few hundred) reading wins by far. Both are measured by this worker as it runs (a fit of real
prefill steps, step_costs.py, and a moving average of real restores) and kept beside the KV blocks
(`rates.json`), so a restarted worker decides its first warm admits by them too; until the prefill
cost is known, restoring is assumed to win, so the first restore measures it. The disk's rate is
measured at start too when the store holds files (its scan reads the newest whole, timed:
KVStore.take_disk_probe); until a tier's bandwidth is measured, a conservative prior stands for
it (block files are read one by one and checked, well below a disk's sequential rate). The engine
logs each choice (`kv_restore_choice`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .step_costs import PrefillCost

PRIOR_BANDWIDTH = {"host": 8e9, "disk": 3e8}  # bytes/s until measured
WEIGHT = 0.2  # of a new measurement in the moving average
FIXED_SECONDS = 0.002  # a restore's own overhead (a job on the reader thread, one load a batch)


@dataclass(frozen=True)
class Choice:
    restore: bool
    restore_seconds: float
    compute_seconds: float | None  # None: the prefill rate is not measured yet


class RestoreCosts:
    def __init__(self) -> None:
        self.prefill = PrefillCost()
        self.bandwidth: dict[str, float] = {}  # measured bytes/s by tier

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = _blend(self.bandwidth.get(tier), nbytes / seconds)

    def load(self, path: Path) -> None:
        """The rates a previous process measured (a missing or unreadable file: none)."""
        try:
            data = json.loads(path.read_text())
            self.prefill = PrefillCost.from_json(data.get("prefill"))
            self.bandwidth = {t: float(v) for t, v in data.get("bandwidth", {}).items() if t in PRIOR_BANDWIDTH}
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def save(self, path: Path) -> None:
        """Atomically, best effort (a read-only KV dir keeps no rates)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"prefill": self.prefill.to_json(), "bandwidth": self.bandwidth}))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def rate(self, tier: str) -> float:
        return self.bandwidth.get(tier, PRIOR_BANDWIDTH[tier])

    def choose(self, tokens: int, host_bytes: int, disk_bytes: int) -> Choice:
        """Restore `host_bytes` + `disk_bytes` standing for `tokens` prompt tokens, or compute them."""
        restore = FIXED_SECONDS + host_bytes / self.rate("host") + disk_bytes / self.rate("disk")
        compute = self.prefill.seconds(tokens)
        if compute is None:
            return Choice(True, restore, None)
        return Choice(restore <= compute, restore, compute)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
