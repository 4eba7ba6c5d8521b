"""POST /v1/kv/lookup: what of a token sequence's KV a restart of this worker would find.

Takes `tokens` (ids) and answers, for the sequence's full blocks from the first: how many the KV store
holds on disk (`on_disk`: what a restarted worker restores instead of computing) and how many it can
supply now, from RAM or disk (`stored`). The device's own prefix cache is not counted: it is the
engine thread's, and it is gone at a restart. The soak asks it for each live conversation just before
its kill -9, beside what the restarted worker then found (worker/bench/soak.py).

It answers only what a generation request already tells its client (the cached tokens in `usage`), so
it takes the same API key; it reads the store's index and the file system, off the event loop.
"""

from __future__ import annotations

import asyncio

import msgspec

from ..engine.kv_blocks import chain_hashes
from .common import ApiContext, bad_request


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]


class LookupResponse(msgspec.Struct):
    tokens: int
    block_size: int
    full_blocks: int
    on_disk: int  # leading full blocks in the store's files: what a restart would find
    stored: int  # leading full blocks the store can supply now (RAM or disk)
    persistence: bool  # whether this worker writes blocks to disk at all (--kv-persist all or finished)


async def lookup(ctx: ApiContext, body: LookupRequest) -> LookupResponse:
    engine = ctx.engine
    if engine is None:
        raise bad_request("the model is not loaded yet", param="tokens")
    if any(t < 0 for t in body.tokens):
        raise bad_request("token ids are not negative", param="tokens")
    bs, store = engine.backend.block_size, engine.kv.store
    full = len(body.tokens) // bs
    if store is None:
        return LookupResponse(len(body.tokens), bs, full, 0, 0, False)

    def count() -> tuple[int, int]:
        hashes = chain_hashes(body.tokens, bs, engine.pool.salt)
        return store.persisted(hashes), len(store.where(hashes))

    on_disk, stored = await asyncio.to_thread(count)
    return LookupResponse(len(body.tokens), bs, full, on_disk, stored, store.persist != "off")
