"""Allocation of KV pool blocks to sequences (a free list with reference counts)."""

from __future__ import annotations


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))
        self.refs = [0] * n_blocks

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def retain(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released twice")
