"""How the CUDA backend divides the device's memory, decided from what the device reports rather than
from constants, so one configuration works on a 24 GB card, a 141 GB H200 and a DGX Spark:

1. the weights, in their block formats (checked to fit before the upload: layers.check_fits);
2. the 16-bit copy of the tensor-core matmuls' weights (`--f16-weights auto`): kept where it leaves the
   KV pool at least half of what is free after the weights, never on an integrated GPU (its memory is
   the host's: the copy would take RAM the KV tiers want, for a speed-up the unified memory's bandwidth
   does not give back);
3. the step buffers and scratch;
4. the KV pool: `--kv-mem SIZE`, or with `auto` (the default on CUDA) what is free after all of the
   above, minus a margin for the captured graphs and the driver, and on an integrated GPU minus the
   host KV tier as well (`--kv-host-mem`): the pool and the tier come out of one budget, the same RAM.

"What the device reports" is the card's memory, or with `--gpu-mem SIZE` that of a card of SIZE holding
everything the real one holds (Device.memory_cap): every decision above is then made as on that card.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_MARGIN_MIN = 1 << 30  # left free after an automatic KV pool: graphs, the driver, other processes' slack
KV_MARGIN_SHARE = 0.03  # ... or this share of the device where that is more
HALF_COPY_KV_SHARE = 0.5  # auto keeps the 16-bit weight copy where the KV pool keeps at least this share
MIN_KV_TOKENS = 4096  # an automatic pool smaller than one sequence of this many tokens is refused


def kv_margin(total: int) -> int:
    return max(KV_MARGIN_MIN, int(total * KV_MARGIN_SHARE))


@dataclass(frozen=True)
class MemoryPicture:
    """The device's memory as the backend divided it (bytes), for `ready` facts and `ember status`."""

    total: int
    weights: int
    half_copy: int
    kv_pool: int
    integrated: bool
    host_tier: int  # the host KV tier's budget (on an integrated GPU: out of the same memory)

    def as_dict(self) -> dict:
        return {"device_total_mb": self.total >> 20, "weights_mb": self.weights >> 20,
                "f16_copy_mb": self.half_copy >> 20, "kv_pool_mb": self.kv_pool >> 20,
                "unified_memory": self.integrated, "kv_host_tier_mb": self.host_tier >> 20}


def keep_half_copy(mode: str, half_bytes: int, free: int, total: int, *, integrated: bool, kv_sized: bool) -> bool:
    """Whether to keep the 16-bit weight copy. kv_sized: the KV pool already has its memory (--kv-mem
    SIZE), so the copy only needs to leave a tenth of the device free; else (auto) it may take at most
    half of what the pool would get."""
    if mode == "off":
        return False
    if mode == "on":
        return True
    if integrated:
        return False
    if kv_sized:
        return half_bytes + total // 10 <= free
    return half_bytes <= (free - kv_margin(total)) * HALF_COPY_KV_SHARE


def auto_kv_bytes(free: int, total: int, *, integrated: bool, host_tier: int) -> int:
    """The KV pool `--kv-mem auto` takes from what is free now (after weights, copy, buffers)."""
    return free - kv_margin(total) - (host_tier if integrated else 0)


def check_unified_budget(kv_bytes: int, host_tier: int, free: int, total: int) -> str | None:
    """On an integrated GPU, an explicit --kv-mem and --kv-host-mem draw on one memory: the problem, in
    one line, where together they exceed what is free (None: they fit)."""
    room = free - kv_margin(total)
    if kv_bytes + host_tier <= room:
        return None
    return (f"--kv-mem ({kv_bytes >> 20} MiB) and --kv-host-mem ({host_tier >> 20} MiB) share this GPU's unified "
            f"memory and together exceed the {max(room, 0) >> 20} MiB free after the weights; lower one of them "
            "or use --kv-mem auto")
