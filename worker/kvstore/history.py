"""What a KV store remembers about blocks beyond the blocks themselves, across restarts: which are
shared (their use counts, for eviction.py) and what became of blocks it does not hold (for explaining
misses: engine/misses.py). Hashes and small numbers only, never tokens or text.

    <layout dir>/history   magic "EMBERBH1", then records of 21 bytes: chain hash (16), kind (1), value (u32)

Kinds: USES (value: the block's use count, kept for shared blocks only) and the fates of blocks the
store lost or never had, LOST_KINDS: not persisted (offered, then dropped: the writer was behind, the
disk full), evicted from disk by the budget, or unreadable (quarantined). Both maps are bounded
(MAX_USES, MAX_LOST; the oldest fates go first), so the file stays small (a few MB at most).

The file is advisory (it is not kvdir's `usage` ledger of bytes): written whole (a temp file, then a
rename) every few seconds by the writer thread while something changed, and at close; a missing, short
or garbled file reads as empty. Two stores on one directory each write their own view; the last one
wins, which costs only a little precision.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections import OrderedDict
from pathlib import Path

MAGIC = b"EMBERBH1"
HISTORY_FILE = "history"
_RECORD = struct.Struct("<16sBI")
USES = 0
NOT_PERSISTED, EVICTED, UNREADABLE = "not_persisted", "evicted", "unreadable"
LOST_KINDS = {NOT_PERSISTED: 1, EVICTED: 2, UNREADABLE: 3}
_LOST_NAMES = {v: k for k, v in LOST_KINDS.items()}
MAX_USES = 1 << 18  # shared blocks whose counts are kept (the most used, when there are more)
MAX_LOST = 1 << 16  # fates of blocks not held, newest kept


class BlockHistory:
    """The two maps (not thread-safe: the store holds its lock around every use)."""

    def __init__(self) -> None:
        self.uses: dict[bytes, int] = {}  # shared blocks only (a block absent here was used once)
        self.lost: OrderedDict[bytes, str] = OrderedDict()  # hash -> a LOST_KINDS name, oldest first
        self.dirty = False

    def count(self, h: bytes) -> int:
        return self.uses.get(h, 1)

    def used(self, h: bytes) -> int:
        n = self.uses[h] = self.uses.get(h, 1) + 1
        self.dirty = True
        return n

    def forget_uses(self, h: bytes) -> None:
        if self.uses.pop(h, None) is not None:
            self.dirty = True

    def lose(self, h: bytes, fate: str) -> None:
        self.lost[h] = fate
        self.lost.move_to_end(h)
        if len(self.lost) > MAX_LOST:
            self.lost.popitem(last=False)
        self.dirty = True

    def found(self, h: bytes) -> None:
        """Block `h` is held again (written): no fate."""
        if self.lost.pop(h, None) is not None:
            self.dirty = True

    # -- the file ----------------------------------------------------------------------------------------

    def encode(self) -> bytes:
        uses = self.uses.items()
        if len(self.uses) > MAX_USES:
            uses = sorted(uses, key=lambda kv: kv[1], reverse=True)[:MAX_USES]  # type: ignore[assignment]
        parts = [MAGIC]
        parts += [_RECORD.pack(h, USES, min(n, 0xFFFFFFFF)) for h, n in uses]
        parts += [_RECORD.pack(h, LOST_KINDS[fate], 0) for h, fate in self.lost.items()]
        return b"".join(parts)

    @staticmethod
    def write(directory: Path, data: bytes) -> None:
        """Write encode()'s bytes as the file, whole (raises OSError; the caller decides what a failure
        means)."""
        tmp = directory / f".{HISTORY_FILE}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, directory / HISTORY_FILE)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    @classmethod
    def load(cls, directory: Path) -> BlockHistory:
        """The history a previous process left in `directory` (empty when there is none or it is bad)."""
        led = cls()
        try:
            data = (directory / HISTORY_FILE).read_bytes()
        except OSError:
            return led
        if not data.startswith(MAGIC) or (len(data) - len(MAGIC)) % _RECORD.size:
            return led
        for h, kind, value in _RECORD.iter_unpack(data[len(MAGIC):]):
            if kind == USES and value > 1:
                led.uses[h] = value
            elif kind in _LOST_NAMES:
                led.lost[h] = _LOST_NAMES[kind]
        while len(led.lost) > MAX_LOST:
            led.lost.popitem(last=False)
        return led
