"""The interface every compute backend implements (numpy reference now, CUDA later).

A backend owns the weights and a pool of fixed-size KV blocks. It knows nothing of requests,
prefix caching or scheduling: the caller hands it, per step, a list of sequence chunks, each with
the new token ids, the position of the first one, and the block table that maps the sequence's
positions to pool blocks (position p lives in block_table[p // block_size] at slot p % block_size).
The backend writes the chunk's K/V into those slots, attends over everything before it, and returns
logits for the positions each chunk asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..model.config import ModelConfig


@dataclass(frozen=True)
class DeviceSample:
    """How to draw a chunk's next token where the logits are (the CUDA backend): the host sampler's
    chain without penalties. `step` (tokens generated so far) and `seed` pick the random draw."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    step: int


class SampledToken(int):
    """A token the backend drew itself (for a chunk with `sample` set), instead of logits."""


@dataclass
class SeqChunk:
    tokens: np.ndarray  # int32 [n] new token ids
    start: int  # position of tokens[0]; positions [0, start) are already in the KV blocks
    block_table: list[int]  # covers at least start + n positions
    logits: str = "last"  # "last", "all" or "none"
    sample: DeviceSample | None = None  # with "last": the backend may return a SampledToken instead


def kv_slots(chunks: list[SeqChunk], block_size: int, n_blocks: int) -> np.ndarray:
    """Pool slot (block * block_size + offset) of every new token of every chunk, in order."""
    parts = []
    for c in chunks:
        end = c.start + len(c.tokens)
        pos = np.arange(c.start, end)
        table = np.asarray(c.block_table, dtype=np.int64)
        if len(table) * block_size < end:
            raise ValueError(f"block table covers {len(table) * block_size} positions, chunk needs {end}")
        if table.size and (table.min() < 0 or table.max() >= n_blocks):
            raise ValueError("block table names a block outside the pool")
        parts.append(table[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(parts)


class Backend(Protocol):
    name: str
    config: ModelConfig
    block_size: int
    n_blocks: int

    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray | SampledToken | None]:
        """Run one step. Returns, per chunk, float32 logits [rows, vocab] (rows = 1 for "last",
        n for "all"), None for "none", or a SampledToken where the chunk asked for a draw and the
        backend can make it (backends may always return logits instead)."""
        ...

    def read_block(self, block: int) -> np.ndarray:
        """A copy of one block's K and V for every layer: float32 [2, layers, block_size, kv_heads, head_dim]."""
        ...

    def write_block(self, block: int, data: np.ndarray) -> None:
        """Fill one block from read_block's layout (restoring a cached prefix)."""
        ...


class ContextPoisoned(RuntimeError):
    """The compute context is unusable (on CUDA: a sticky error such as 700 illegal address).
    Nothing more can run in this process; the worker reports it and exits with code 75."""

    def __init__(self, code: int, name: str, message: str):
        self.code, self.name, self.message = code, name, message
        super().__init__(f"{name} ({code}): {message}")
