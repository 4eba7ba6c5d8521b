"""The interface every compute backend implements (numpy/, cuda/), and the value types both sides use.

A backend owns the weights and a pool of fixed-size KV blocks. It knows nothing of requests,
prefix caching or scheduling: the caller hands it, per step, a list of sequence chunks, each with
the new token ids, the position of the first one, and the block table that maps the sequence's
positions to pool blocks (position p lives in block_table[p // block_size] at slot p % block_size).
The backend writes the chunk's K/V into those slots, attends over everything before it, and returns
logits for the positions each chunk asks for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from ..model.config import ModelConfig

T = TypeVar("T")


def present(x: T | None) -> T:
    """A weight the layer's variant or the recipe guarantees (the type checker cannot see that)."""
    assert x is not None
    return x


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
    prefill: bool = False  # part of a prompt (what fault injection's phase=prefill matches)


def kv_slots(chunks: list[SeqChunk], block_size: int, n_blocks: int) -> np.ndarray:
    """Pool slot (block * block_size + offset) of every new token of every chunk, in order.

    Every block a chunk's table names must lie in the pool (attention reads them all). A decode step
    of many one-token chunks is computed without a numpy array per chunk: the host's share of a
    64-sequence step is what bounds small models on a GPU."""
    for c in chunks:
        if len(c.block_table) * block_size < c.start + len(c.tokens):
            raise ValueError(f"block table covers {len(c.block_table) * block_size} positions, "
                             f"chunk needs {c.start + len(c.tokens)}")
    used = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks), dtype=np.int64)
    if used.size and (used.min() < 0 or used.max() >= n_blocks):
        raise ValueError("block table names a block outside the pool")
    if all(len(c.tokens) == 1 for c in chunks):
        return np.fromiter((c.block_table[c.start // block_size] * block_size + c.start % block_size for c in chunks),
                           dtype=np.int64, count=len(chunks))
    parts = []
    for c in chunks:
        pos = np.arange(c.start, c.start + len(c.tokens))
        parts.append(np.asarray(c.block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class StepRows(NamedTuple):
    """A step's chunks stacked into one run of rows (see step_rows)."""

    tokens: np.ndarray  # int64 [rows] every chunk's new tokens, chunk after chunk
    positions: np.ndarray  # [rows] the position of each
    spans: list[tuple[int, int]]  # per chunk, its rows [a, b)
    slots: np.ndarray  # [rows] the pool slot each row's KV goes to (kv_slots)


def step_rows(chunks: list[SeqChunk], block_size: int, n_blocks: int) -> StepRows:
    """The chunks' tokens, positions, row spans and KV slots, stacked once so that the numpy backends
    index a step's rows the same way."""
    spans, at = [], 0
    for c in chunks:
        spans.append((at, at + len(c.tokens)))
        at += len(c.tokens)
    return StepRows(tokens=np.concatenate([np.asarray(c.tokens, dtype=np.int64) for c in chunks]),
                    positions=np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks]),
                    spans=spans, slots=kv_slots(chunks, block_size, n_blocks))


def chunk_logits(chunks: list[SeqChunk], spans: list[tuple[int, int]], x: np.ndarray,
                 head: Callable[[np.ndarray], np.ndarray]) -> list[np.ndarray | None]:
    """Each chunk's logits as it asks for them (none, its last row's, or every row's) from the step's
    final rows x, through the model's head."""
    return [None if c.logits == "none" else head(x[b - 1 : b] if c.logits == "last" else x[a:b])
            for c, (a, b) in zip(chunks, spans, strict=True)]


class BlockCopy(Protocol):
    """KV blocks on their way to the host (Backend.save_blocks)."""

    owned: bool  # the payloads are the caller's to keep (else views, gone after release())

    def wait(self) -> list[np.ndarray] | np.ndarray | None:
        """Their payloads, one [2, layers, block_size, kv_heads, head_dim] array a block in the
        backend's block_dtype, once landed (any thread may wait); None when the device failed."""
        ...

    def release(self) -> None:
        """Done with the payloads: the backend may reuse their memory."""
        ...


class Landed:
    """Payloads already on the host, offered as a batch: the BlockCopy of a backend whose KV pools are
    host memory (the numpy backend), and of a block the KV store is handed directly (KVStore.offer)."""

    owned = True

    def __init__(self, payloads: np.ndarray):
        self.payloads = payloads

    def wait(self) -> np.ndarray:
        return self.payloads

    def release(self) -> None:
        pass


class RestoreBuffers(Protocol):
    """Host memory the KV store's reader thread reads restored blocks into (Backend.restore_buffers),
    so that the engine thread hands each payload to load_blocks as it is and only queues its copy to
    the device: on CUDA, slots of a pinned arena the copy reads; on numpy, plain arrays (host memory
    is its pool's own)."""

    def take(self, timeout: float) -> np.ndarray | None:
        """(the reader thread) One block's buffer to read into, C-contiguous [2, layers, block_size,
        kv_heads, head_dim] (the backend's block shape) in its block_dtype. Where every buffer is
        held, take waits for the oldest whose copy to the device is in flight; None when none came
        free within `timeout` seconds (every one read and not loaded yet, which only loading frees:
        the bound on what restores hold)."""
        ...

    def give_back(self, payload: np.ndarray) -> None:
        """A taken buffer that will not be loaded (a bad file, a restore dropped): free again.
        A loaded one comes free by itself once the backend is done with it."""
        ...


class HostBuffers:
    """RestoreBuffers of plain host memory, a new array a block, never short: the numpy backend's
    (load_blocks writes them into its pools) and a KV store's that was given none."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def take(self, timeout: float) -> np.ndarray:
        return np.empty(self.shape, self.dtype)

    def give_back(self, payload: np.ndarray) -> None:
        pass


class Done:
    """A step computed when it was submitted (backends without asynchronous steps)."""

    def __init__(self, outputs: list):
        self.outputs = outputs

    def result(self) -> list:
        return self.outputs


class Backend:
    """The base every backend inherits: the attributes it must set, the methods it must implement
    (forward, read_block, write_block, save_blocks, load_blocks, restore_buffers), and the defaults of what is
    optional (run-ahead, sampling on the device, injected device faults). The engine uses nothing
    else and never probes for a capability."""

    name: str
    config: ModelConfig
    block_size: int
    n_blocks: int
    block_dtype: np.dtype  # the KV blocks' dtype, as save_blocks hands them out and load_blocks takes them
    kv_layout: str  # names the blocks' layout and dtype in the KV salt (kv_blocks.kv_salt)
    runs_ahead: bool = False  # submit() returns before the step ends and can feed a step from the last one's draws
    samples_on_device: bool = False  # chunks with `sample` set may come back as SampledToken
    fault_kinds: tuple[str, ...] = ()  # device faults inject_fault() can cause (faults.py)

    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray | SampledToken | None]:
        """Run one step. Returns, per chunk, float32 logits [rows, vocab] (rows = 1 for "last",
        n for "all"), None for "none", or a SampledToken where the chunk asked for a draw and the
        backend can make it (backends may always return logits instead)."""
        raise NotImplementedError

    def submit(self, chunks: list[SeqChunk], feed: list[int | None] | None = None):
        """Launch a step; result() of what it returns is what forward() returns. feed[i] = j makes
        chunk i's single token the draw of chunk j of the step submitted just before, taken where it
        was drawn, so the scheduler can launch step n + 1 before it has read step n's tokens
        (run-ahead decoding). Only called when `runs_ahead`; the default computes at once."""
        if feed is not None and any(j is not None for j in feed):
            raise NotImplementedError(f"{self.name} does not run ahead")
        return Done(self.forward(chunks))

    def read_block(self, block: int) -> np.ndarray:
        """A copy of one block's K and V for every layer: float32 [2, layers, block_size, kv_heads, head_dim]."""
        raise NotImplementedError

    def write_block(self, block: int, data: np.ndarray) -> None:
        """Fill one block from read_block's layout (restoring a cached prefix)."""
        raise NotImplementedError

    def save_blocks(self, blocks: list[int]) -> BlockCopy | None:
        """Start copying these blocks to the host for the KV store, without waiting for the device:
        a later step may reuse them, never before they were read. None when the backend has no room
        for more copies in flight (the caller drops them from persistence rather than wait)."""
        raise NotImplementedError

    def load_blocks(self, blocks: list[int], payloads) -> None:
        """Fill these blocks from payloads in save_blocks' layout (a list of one array a block, or an
        array of them), restoring a cached prefix, before the next step runs, without waiting for the
        device. On CUDA each payload must be a buffer of restore_buffers() (its copy to the device
        reads it there); the numpy backend takes any arrays."""
        raise NotImplementedError

    def restore_buffers(self) -> RestoreBuffers:
        """Where the KV store's reader reads the payloads that load_blocks will take (the CUDA
        backend's: one pinned arena, whichever call asks)."""
        raise NotImplementedError

    def inject_fault(self, kind: str) -> None:
        """Cause one of `fault_kinds` for real (it raises ContextPoisoned from the device's error)."""
        raise NotImplementedError(f"{self.name} cannot inject {kind}")

    def unhooked(self) -> Backend:
        """This backend without wrappers (faults.FaultyBackend): for calibration and for reruns of a
        step that already counted."""
        return self


class ContextPoisoned(RuntimeError):
    """The compute context is unusable (on CUDA: a sticky error such as 700 illegal address).
    Nothing more can run in this process; the worker reports it and exits with code 75."""

    def __init__(self, code: int, name: str, message: str):
        self.code, self.name, self.message = code, name, message
        super().__init__(f"{name} ({code}): {message}")


class Failure(NamedTuple):
    """What `attempt` returns instead of a result: the exception the call raised."""

    error: Exception


R = TypeVar("R")


def attempt(fn: Callable[..., R], *args, **kwargs) -> R | Failure:
    """fn(*args, **kwargs), or the Failure it raised: the one place the rule of failing alone is written.
    A failed step, chunk or request fails only what it touches, but ContextPoisoned always propagates:
    nothing more can run in this process."""
    try:
        return fn(*args, **kwargs)
    except ContextPoisoned:
        raise
    except Exception as e:
        return Failure(e)
