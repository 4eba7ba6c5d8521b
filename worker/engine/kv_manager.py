"""The KV manager: the block pool, prefix matching, and the KV store's offers and restores.

It answers the engine with data: the blocks a prompt can start from (or None: not enough room),
whether a sequence could grow (yes, or no and nothing taken), which restores finished. It owns
each sequence's `KVState` and never decides what to preempt or fail: that is the scheduler's and
the loop's. It reaches the pool only through BlockPool's public methods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..backends.base import Backend, ContextPoisoned
from ..kvstore.store import LATER, TAKE
from ..logs import log
from ..metrics import Metrics
from .kv_blocks import ROOT_HASH, BlockPool, OutOfBlocks, chain_hash
from .restore_policy import RestoreCosts
from .sequence import Seq

RESTORE_BYTES_PER_STEP = 32 << 20  # KV a step restores while other streams decode (a few ms of copies)
OFFER_LOOKAHEAD = 8  # owed blocks a flush asks the store about past the writer's room (those it has cost a lookup)


@dataclass
class Prefix:
    """What admission found for a prompt: cached blocks (retained), every full block's chain hash,
    and where the KV store holds the blocks after them ("host" or "disk" each)."""

    blocks: list[int]
    hashes: list[bytes]
    stored: list[str]


class KVManager:
    def __init__(self, pool: BlockPool, backend: Backend, store, metrics: Metrics, costs: RestoreCosts):
        self.pool, self.backend, self.store, self.metrics, self.costs = pool, backend, store, metrics, costs
        self.bs = backend.block_size
        # sequences with full blocks the store has not got yet (kv.n_offered < kv.n_registered), by number:
        # offered at every flush, heads first, until the writer takes them or the sequence is gone
        self._owing: dict[int, Seq] = {}

    # -- admission and growth ------------------------------------------------------------------------

    def find_prefix(self, s: Seq) -> Prefix | None:
        """The prompt's cached prefix, if the rest of it fits in the pool now (else None, nothing held)."""
        bs = self.bs
        reuse = 0 if s.req.prompt_logprobs else (len(s.tokens) - 1) // bs
        blocks, hashes = self.pool.match(s.tokens, reuse)  # retained: each path below hands them on
        stored = self._stored(hashes[len(blocks) : reuse]) if self.store and len(blocks) < reuse else []
        need = -(-(len(s.tokens) + 1) // bs) - len(blocks)
        if need > self.pool.available:
            self.pool.release(blocks)
            return None
        return Prefix(blocks, hashes, stored)

    def take_prefix(self, s: Seq, p: Prefix) -> None:
        kv = s.kv
        kv.blocks, kv.hashes = p.blocks, p.hashes
        kv.n_computed, kv.n_registered = len(p.blocks) * self.bs, len(p.blocks)
        # the matched blocks are offered like computed ones: the store answers KNOWN for those it has, and a
        # block a writer that was behind never got is persisted now
        kv.n_offered = min(kv.n_offered, kv.n_registered)
        if not s.begun and p.blocks:  # one more sequence took them (a preempted one comes back: not counted)
            self.pool.used_by_another(p.blocks)
            self._touch(p.hashes[: len(p.blocks)], new_use=True)

    def start_restore(self, s: Seq, p: Prefix) -> None:
        kv = s.kv
        kv.restore_blocks = self.pool.allocate(len(p.stored))
        kv.restoring = job = self.store.restore(p.hashes[len(p.blocks) : len(p.blocks) + len(p.stored)])
        job.tiers = p.stored
        kv.restore_used = 0

    def grow(self, s: Seq, length: int) -> bool:
        """Blocks for `length` positions: True once held, False if the pool is short (nothing taken)."""
        need = -(-length // self.bs) - len(s.kv.blocks)
        if need > 0:
            try:
                s.kv.blocks.extend(self.pool.allocate(need))
            except OutOfBlocks:
                return False
        return True

    def free(self, s: Seq) -> None:
        """Release every block the sequence holds (its registered ones stay cached; those the store has not
        got are given up)."""
        kv = s.kv
        self._give_up(s)
        if kv.blocks:
            self.pool.release(kv.blocks)
            kv.blocks = []
        if kv.restoring is not None:  # the payloads read and not loaded go back to the backend's buffers
            self.store.drop(kv.restoring, kv.restore_used)
            kv.restoring = None
        if kv.restore_blocks:
            self.pool.release(kv.restore_blocks[kv.restore_used :])
            kv.restore_blocks = []

    def preempted(self, s: Seq) -> None:
        self.register_full_blocks(s)
        self.flush_offers(last=s)  # copied off before the pool may hand its blocks out again
        self.pool.release(s.kv.blocks)
        s.kv.blocks, s.kv.n_computed, s.kv.n_registered = [], 0, 0

    def finished(self, s: Seq) -> None:
        """A running sequence ends: its last full blocks registered (and offered where the store
        persists finished ones) and copied off before its blocks are released; the store hears its
        chain was used just now, head last (so its own tiers evict the leaves first, as the pool does)."""
        self.register_full_blocks(s)
        if self.store is not None and self.store.persist == "finished":
            self._offer(s)
        self.flush_offers(last=s)
        self._touch(s.kv.hashes[: s.kv.n_registered], new_use=False)

    def _touch(self, hashes: list[bytes], new_use: bool) -> None:
        """Tell the store a chain was used (eviction.py); it never raises: the order of evictions is
        not worth a request."""
        if self.store is None or not hashes:
            return
        try:
            self.store.touch(hashes, new_use=new_use)
        except Exception as e:
            log("kv_lookup_error", level="warning", error=f"{type(e).__name__}: {e}")

    # -- the prefix cache and the store ---------------------------------------------------------------

    def register_full_blocks(self, s: Seq) -> None:
        bs, kv = self.bs, s.kv
        full = kv.n_computed // bs
        while len(kv.hashes) < full:
            i = len(kv.hashes)
            parent = kv.hashes[-1] if kv.hashes else ROOT_HASH
            kv.hashes.append(chain_hash(parent, s.tokens[i * bs : (i + 1) * bs], self.pool.salt))
        for i in range(kv.n_registered, full):  # an identical block computed meanwhile is shared
            kv.blocks[i] = self.pool.share(kv.blocks[i], kv.hashes[i])
        kv.n_registered = max(kv.n_registered, full)
        if self.store is not None and self.store.persist == "all":
            self._offer(s)

    def _offer(self, s: Seq) -> None:
        """The sequence's registered full blocks are for the KV store: flush_offers offers them."""
        if s.kv.n_offered < s.kv.n_registered:
            self._owing[s.number] = s

    def flush_offers(self, poisoned: bool = False, last: Seq | None = None) -> None:
        """Offer the store every owing sequence's blocks it has not got, and copy those it takes off the
        device in one batch (save_blocks never makes the engine wait), before any of them can be
        released and written again. What a restart needs goes first: blocks nearer their chain's head
        before those further down, older sequences first among equals, so that under churn each live
        conversation's chain is persisted from its root rather than whichever blocks completed last.
        Blocks the writer has no room for stay owed to the next flush. `last`: a sequence ending (or
        preempted) now, whose blocks the writer does not take now are given up."""
        if self.store is None or poisoned or not self._owing:
            if last is not None:
                self._owing.pop(last.number, None)
            return
        room = self.store.write_room()
        candidates = []  # (chain index, sequence number, hash, parent, sequence)
        for n, s in self._owing.items():
            kv = s.kv
            # a sequence's blocks up to the writer's room past the last it has (those it knows cost a lookup)
            for i in range(kv.n_offered, min(kv.n_registered, kv.n_offered + room + OFFER_LOOKAHEAD)):
                candidates.append((i, n, kv.hashes[i], kv.hashes[i - 1] if i else ROOT_HASH, s))
        candidates.sort(key=lambda c: (c[0], c[1]))
        status = dict(zip((c[2] for c in candidates),
                          self.store.claim([(c[2], c[3]) for c in candidates]), strict=False))
        batch: dict[bytes, tuple[bytes, list[int], int]] = {}
        for i, _, h, parent, s in candidates:
            if status[h] == TAKE and h not in batch:
                batch[h] = (parent, s.tokens[i * self.bs : (i + 1) * self.bs], s.kv.blocks[i])
        for n, s in list(self._owing.items()):  # each sequence's owed blocks start after those the store has now
            kv = s.kv
            while kv.n_offered < kv.n_registered and status.get(kv.hashes[kv.n_offered], LATER) != LATER:
                kv.n_offered += 1
            if kv.n_offered >= kv.n_registered:
                del self._owing[n]
        if last is not None:
            self._give_up(last)
        if batch:
            self._copy_off(batch)

    def _give_up(self, s: Seq) -> None:
        """The sequence's blocks the store has not got are dropped: its blocks go back to the pool."""
        if self._owing.pop(s.number, None) is None or self.store is None:
            return
        kv = s.kv
        self.store.lose(kv.hashes[kv.n_offered : kv.n_registered])
        kv.n_offered = kv.n_registered

    def _copy_off(self, batch: dict[bytes, tuple[bytes, list[int], int]]) -> None:
        entries = [(h, parent, tokens) for h, (parent, tokens, _) in batch.items()]
        try:
            copy = self.backend.save_blocks([block for _, _, block in batch.values()])
        except ContextPoisoned:
            self.store.offer_batch(entries, None)
            raise
        except Exception as e:  # persistence is best effort: the request goes on
            log("kv_offer_error", level="warning", error=f"{type(e).__name__}: {e}")
            copy = None
        self.store.offer_batch(entries, copy)

    def _stored(self, hashes: list[bytes]) -> list[str]:
        """Where the KV store holds the leading `hashes` ("host" or "disk"). It never raises: a store
        that fails (an I/O error it did not absorb, a bug) answers none, and the prompt is computed."""
        try:
            return self.store.where(hashes)
        except Exception as e:
            log("kv_lookup_error", level="warning", error=f"{type(e).__name__}: {e}")
            return []

    def _stored_uses(self, hashes: list[bytes]) -> list[int]:
        try:
            return self.store.uses_of(hashes)
        except Exception:
            return []

    def worth_restoring(self, s: Seq, tiers: list[str]) -> bool:
        """Restore the stored blocks, or compute them again: whichever this worker measured faster."""
        probe = self.store.take_disk_probe()
        if probe is not None:  # the scan's timed reads of this disk: the first disk rate, or one more
            self.costs.observe_restore("disk", *probe)
        host = tiers.count("host") * self.store.block_bytes
        c = self.costs.choose(len(tiers) * self.bs, host, len(tiers) * self.store.block_bytes - host)
        self.metrics.restore_choices.labels("restore" if c.restore else "recompute").inc()
        log("kv_restore_choice", request_id=s.req.request_id, seq=s.number,
            choice="restore" if c.restore else "recompute", blocks=len(tiers), host_blocks=tiers.count("host"),
            restore_seconds=round(c.restore_seconds, 4),
            compute_seconds=None if c.compute_seconds is None else round(c.compute_seconds, 4))
        return c.restore

    def progress_restores(self, running: list[Seq]) -> Iterator[Seq]:
        """Copy blocks the store has read into the pool, in chain order; a miss ends the chain
        (the rest of the prompt is computed). Yields each sequence whose restore is over."""
        for s in [s for s in running if s.kv.restoring is not None]:
            kv = s.kv
            job = kv.restoring
            assert job is not None
            if not job.done.is_set() and running and all(r.kv.restoring is not None for r in running):
                job.wait(0.05)  # nothing else to run: do not spin (the reader wakes it when it needs room)
            results = list(job.results)
            # the payloads read so far, in chain order, up to the first miss; while other streams
            # decode, a step loads a bounded share, so a long restore never stalls them
            most = len(results) if len(running) == 1 else max(1, RESTORE_BYTES_PER_STEP // self.store.block_bytes)
            ready = []
            for payload in results[kv.restore_used:kv.restore_used + most]:
                if payload is None:
                    break
                ready.append(payload)
            if ready:  # into the pool in one batch: the backend queues their copies, no host copy or wait
                first, start = kv.restore_used, kv.n_registered
                self.backend.load_blocks(kv.restore_blocks[first:first + len(ready)], ready)
                for k in range(first, first + len(ready)):
                    kv.blocks.append(self.pool.share(kv.restore_blocks[k], job.hashes[k]))
                # as shared on the device as the store counted them (the restore was one more use)
                landed = job.hashes[first:first + len(ready)]
                self.pool.used_by_another(kv.blocks[-len(ready):], self._stored_uses(landed))
                kv.restore_used += len(ready)
                kv.n_computed += len(ready) * self.bs
                kv.n_registered += len(ready)
                if kv.n_offered >= start:  # restored blocks are the store's (owed ones before them stay owed)
                    kv.n_offered = kv.n_registered
            finished = job.done.is_set() and (kv.restore_used == len(job.results) or
                                              job.results[kv.restore_used] is None)
            if finished:
                self.pool.release(kv.restore_blocks[kv.restore_used :])
                seconds = time.monotonic() - job.started
                tiers = job.tiers[: kv.restore_used]
                if kv.restore_used:
                    self.costs.observe_restore("disk" if "disk" in tiers else "host",
                                               kv.restore_used * self.store.block_bytes, seconds)
                log("kv_restore", request_id=s.req.request_id, seq=s.number, blocks=kv.restore_used,
                    tokens=kv.restore_used * self.bs, seconds=round(seconds, 3))
                kv.restoring, kv.restore_blocks = None, []
                yield s
