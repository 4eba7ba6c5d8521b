"""KV block pool: allocation, reference counts, and the prefix cache over full blocks.

A full block is named by a hash chain over (model fingerprint, parent block hash, its token ids),
so two sequences that share a prefix share its blocks, whichever conversation computed them.
A block is in exactly one of three states:
  - in use: referenced by one or more sequences (refs > 0);
  - cached: unreferenced but holding a registered full block, kept for reuse;
  - free: holds nothing worth keeping.
Allocation takes free blocks first, then evicts cached ones by the policy every tier shares
(kvstore/eviction.py): blocks only one sequence ever took go first, least recently used first, and
blocks that two or more took (a system prompt three sessions start from, the head of a long session)
only when no other is left. A sequence releases its blocks tail first, so its head outlives its leaves.
The pool remembers the hashes it evicted lately, so a miss can say where its block went (misses.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..kvstore.eviction import SHARED_SHARE, TwoClassLRU, is_shared


class OutOfBlocks(Exception):
    pass


def chain_hash(parent: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
    """Hash of a full block given its parent's hash; salt binds it to one model and KV layout."""
    h = hashlib.blake2b(digest_size=16)
    h.update(salt)
    h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.digest()


ROOT_HASH = b"\0" * 16


def chain_hashes(tokens: Sequence[int], block_size: int, salt: bytes) -> list[bytes]:
    """The chain hash of every full block of `tokens`, first block first (a partial tail has none)."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


KV_LAYOUT_VERSION = 1
EVICTED_MEMO = 16384  # hashes of blocks evicted lately, for explaining misses (a few MB at most)


def kv_salt(model_fingerprint: str, kv_layout: str) -> bytes:
    """Binds block names to one model and one KV layout (a backend's `kv_layout`: its name, and its
    block dtype where that changed): a different model, backend precision or layout version never
    matches (in memory or on disk)."""
    return f"{model_fingerprint}:{kv_layout}:kv{KV_LAYOUT_VERSION}".encode()


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, salt: bytes = b""):
        self.n_blocks, self.block_size, self.salt = n_blocks, block_size, salt
        self.refs = [0] * n_blocks
        self.block_hash: list[bytes | None] = [None] * n_blocks
        self.by_hash: dict[bytes, int] = {}
        self.uses = [0] * n_blocks  # sequences that took each registered block (eviction.py)
        self._free = list(range(n_blocks - 1, -1, -1))
        # unreferenced registered blocks, in eviction order
        self._cached: TwoClassLRU[int, None] = TwoClassLRU(int(n_blocks * SHARED_SHARE))
        self._evicted: OrderedDict[bytes, None] = OrderedDict()  # the last EVICTED_MEMO hashes evicted
        self.hits = 0  # blocks reused from the cache
        self.evictions = 0

    # -- counts ------------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks an allocation can get now (free plus evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def in_use(self) -> int:
        return self.n_blocks - self.available

    @property
    def cached_count(self) -> int:
        return len(self._cached)

    # -- allocation ----------------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int]:
        if n > self.available:
            raise OutOfBlocks(f"need {n} KV blocks, {self.available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.evict()
                h = self.block_hash[b]
                if h is not None:  # always: a cached block is a registered one
                    del self.by_hash[h]
                    self._evicted[h] = None
                    if len(self._evicted) > EVICTED_MEMO:
                        self._evicted.popitem(last=False)
                self.block_hash[b] = None
                self.uses[b] = 0
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A chain is released tail first: its head ends up the more
        recently used, so the pool evicts a sequence's leaves before the prefix later turns need."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released twice")
            if self.refs[b] == 0:
                if self.block_hash[b] is not None:
                    self._cached.put(b, None, shared=is_shared(self.uses[b]))  # most recently used of its class
                else:
                    self._free.append(b)

    # -- prefix cache -----------------------------------------------------------------------------------

    def register(self, block: int, h: bytes) -> int:
        """Name a just-completed block. If an identical block is already cached, the caller should
        use the returned block instead (and release its own); otherwise returns `block`."""
        existing = self.by_hash.get(h)
        if existing is not None and existing != block:
            return existing
        if self.block_hash[block] != h:
            self.uses[block] = 1  # the sequence that computed it
        self.block_hash[block] = h
        self.by_hash[h] = block
        self._evicted.pop(h, None)
        return block

    def share(self, block: int, h: bytes) -> int:
        """Register a just-completed block held by the caller; where an identical block is cached
        already, hand back that one (retained) and release the caller's. Returns the block to use."""
        canonical = self.register(block, h)
        if canonical != block:
            self.retain(canonical)
            self.release([block])
            self.uses[canonical] += 1  # two sequences computed it: it is shared
        return canonical

    def match(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], list[bytes]]:
        """The longest chain of cached full blocks that prefixes `tokens` (at most max_blocks).
        Returns the blocks (each retained for the caller) and the chain hashes of all full blocks
        of `tokens`, so the caller can register the rest as it computes them."""
        hashes = chain_hashes(tokens, self.block_size, self.salt)
        blocks = []
        for h in hashes[:max_blocks]:
            b = self.by_hash.get(h)
            if b is None:
                break
            self.retain(b)
            blocks.append(b)
        self.hits += len(blocks)
        return blocks, hashes

    def retain(self, b: int) -> None:
        """One more reference to block b (a cached one is in use again)."""
        if self.refs[b] == 0:
            self._cached.pop(b)
        self.refs[b] += 1

    def used_by_another(self, blocks: Sequence[int], at_least: Sequence[int] = ()) -> None:
        """A sequence other than the ones that computed them took `blocks` (its prompt matched them,
        or they were restored for it): one more use each, and at least at_least[i] (what the KV store
        counted for a restored block)."""
        for i, b in enumerate(blocks):
            self.uses[b] = max(self.uses[b] + 1, at_least[i] if i < len(at_least) else 0)

    def was_evicted(self, h: bytes) -> bool:
        """Block `h` was cached here lately and evicted (not registered again since)."""
        return h in self._evicted
