"""What the engine publishes about itself, for the frontend (health, /v1/stats) and the server.

The engine thread builds an `EngineStats` after every step (and on its idle heartbeat, when a
request arrives, when its context is poisoned or its thread dies) and swaps it in whole: a reader
takes `engine.stats` once and sees one consistent picture, without a lock and without touching the
engine's queues, which only the engine thread may walk. As vLLM's scheduler stats, it is data only.
"""

from __future__ import annotations

import msgspec


class Poison(msgspec.Struct, frozen=True):
    """The sticky device error that poisoned the compute context (ContextPoisoned's fields)."""

    code: int
    name: str
    message: str


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    last_progress: float  # time.monotonic() of the loop's last step or idle turn (hang detection)
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # admitted to the queue, waiting for a slot
    queued: int = 0  # waiting, and submitted but not yet seen by the loop
    busy: bool = False  # anything running, waiting or submitted
    steps: int = 0  # backend steps launched
    kv_blocks: int = 0  # the KV pool's blocks
    kv_blocks_used: int = 0  # referenced by sequences
    kv_blocks_cached: int = 0  # unreferenced, kept for prefix reuse
    poisoned: Poison | None = None
    dead: str | None = None  # why the loop thread died
