"""Eviction that keeps what agents share: the one policy the device pool, the host tier and the disk
apply to KV blocks.

A block's *uses* count the sequences that took it: the one that computed it, and each later one whose
prompt matched it (a prefix hit on the device, a restore from the host tier or disk, the same block
computed by two sequences at once). The system prompt and tool definitions that three live sessions
start from have been used three times, the head of a long session once a turn, a one-off prompt's
blocks once. A block used by SHARED_USES sequences or more is *shared*; the rest are *ordinary*.

Every tier evicts ordinary blocks first and shared ones only when no ordinary block is left, least
recently used first within each class. A sequence hands its chain back tail first (its head counts as
the more recently used), so within a class the leaves go before the prefix every later turn needs,
and no tier punches a hole at the head of a chain whose tail it keeps. Shared blocks may fill at most
SHARED_SHARE of a tier: past that, the least recently used of them are ordinary again, so heads that
no session uses any more age out instead of pinning the tier for good.

So a burst of one-off long prompts evicts other one-off work and the live sessions' private tails,
never the heads they share, as long as the tier holds those heads beside the prompt being computed.
It is a segmented LRU (SLRU) whose promotion rule is "taken by a second sequence". The device pool
(engine/kv_blocks.py) and the host tier (store.py) keep a TwoClassLRU; the disk tier sorts its index
with disk_order when it must free room (store.py's _fit_budget).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

SHARED_USES = 2  # sequences that took a block before it is kept ahead of ordinary ones
SHARED_SHARE = 0.5  # of a tier that shared blocks may hold; past it the least recently used are ordinary

K = TypeVar("K")
V = TypeVar("V")


def is_shared(uses: int) -> bool:
    return uses >= SHARED_USES


class TwoClassLRU(Generic[K, V]):
    """Evictable entries in two LRU queues: ordinary ones go first, shared ones only when no ordinary
    one is left. At most `shared_cap` entries are shared: one more moves the least recently used
    shared entry to the ordinary queue (as its most recently used entry)."""

    def __init__(self, shared_cap: int):
        self.shared_cap = max(0, shared_cap)
        self.ordinary: OrderedDict[K, V] = OrderedDict()
        self.shared: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self.ordinary) + len(self.shared)

    def __contains__(self, key: object) -> bool:
        return key in self.ordinary or key in self.shared

    def get(self, key: K) -> V | None:
        if key in self.ordinary:
            return self.ordinary[key]
        return self.shared.get(key)

    def put(self, key: K, value: V, shared: bool) -> None:
        """Insert or refresh `key` as the most recently used entry of its class."""
        self.ordinary.pop(key, None)
        self.shared.pop(key, None)
        if shared and self.shared_cap:
            self.shared[key] = value
            while len(self.shared) > self.shared_cap:
                old, v = self.shared.popitem(last=False)
                self.ordinary[old] = v
        else:
            self.ordinary[key] = value

    def touch(self, key: K, shared: bool) -> None:
        """`key` was used again (now shared or not): the most recently used of its class. No-op if absent."""
        if key in self.ordinary or key in self.shared:
            value = self.ordinary.pop(key) if key in self.ordinary else self.shared.pop(key)
            self.put(key, value, shared)

    def pop(self, key: K) -> V | None:
        if key in self.ordinary:
            return self.ordinary.pop(key)
        return self.shared.pop(key, None)

    def evict(self) -> tuple[K, V]:
        """The entry to evict: the least recently used ordinary one, else the least recently used shared
        one. KeyError when empty."""
        if self.ordinary:
            return self.ordinary.popitem(last=False)
        return self.shared.popitem(last=False)


def disk_order(entries: Iterable[tuple[float, int, bytes]], uses: dict[bytes, int], shared_cap_bytes: int
               ) -> list[tuple[float, int, bytes]]:
    """The disk tier's files, (last used, size, hash) each, in the order to evict them: ordinary files
    least recently used first, then shared ones least recently used first. Shared files past
    `shared_cap_bytes` (the least recently used of them) join the ordinary ones."""
    ordinary: list[tuple[float, int, bytes]] = []
    shared: list[tuple[float, int, bytes]] = []
    for e in entries:
        (shared if is_shared(uses.get(e[2], 1)) else ordinary).append(e)
    shared.sort(reverse=True)  # most recently used first: they keep their place up to the cap
    kept, room = [], shared_cap_bytes
    for i, e in enumerate(shared):
        if e[1] > room:
            ordinary += shared[i:]
            break
        room -= e[1]
        kept.append(e)
    ordinary.sort()
    kept.reverse()
    return ordinary + kept
