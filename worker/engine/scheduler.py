"""The engine loop: continuous batching with chunked prefill and a prefix cache.

One thread owns the backend. Each step it takes new requests and cancellations, admits waiting
requests while there are sequence slots and KV blocks (reusing every cached full block of their
prompt), packs one decode token per running sequence plus prefill chunks up to a token budget,
runs the backend once, samples, and pushes events to the requests' HTTP handles.

Every request settles exactly once (completed, failed, canceled or refused) with one log line.
A failure inside one request fails that request alone; a poisoned compute context stops the
engine and hands control to `on_poisoned` (the server exits with code 75).

The loop runs on a guarded thread (worker/threads.py): if it dies, every request in flight fails
with a 503 at once, new ones are refused, and /health/live names the thread.

Three guards act on each sampled token: a request's grammar (constraints.py: the mask is computed
while the backend step runs and applied before sampling), its reasoning budget (the engine closes
the reasoning block itself), and the loop guard (a repeating n-gram ends the generation).
"""

from __future__ import annotations

import collections
import os
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..logs import log
from ..metrics import Metrics
from ..model.loader import Model
from ..text.tokenizer import IncrementalDecoder
from ..threads import ThreadWatch
from .backend import Backend, ContextPoisoned, DeviceSample, SampledToken, SeqChunk
from .constraints import ConstraintError, Constraints, GrammarError, SequenceConstraint
from .faults import FaultInjector
from .kv_blocks import ROOT_HASH, BlockPool, OutOfBlocks, chain_hash, kv_salt
from .loopguard import LoopGuard
from .reasoning_budget import ReasoningTracker
from .prefill_sizing import FLOOR_TOKENS, PrefillSizing
from .restore_policy import RestoreCosts
from .step_costs import PrefillCost
from .requests import (
    Delta, Failed, Finished, FinishReason, GenerationRequest, Keepalive, Outcome, PromptLogprobs,
    RequestHandle, Started, TokenLogprob,
)
from .sampling import Sampler, log_softmax
from .textstream import StopMatcher

KEEPALIVE_SECONDS = 5.0
RESTORE_BYTES_PER_STEP = 32 << 20  # KV a step restores while other streams decode (a few ms of host copies)
RATES_SAVE_SECONDS = 30.0  # how often the measured prefill and restore rates are written for the next process


class QueueFull(Exception):
    """The waiting queue is at its bound; answer 429 with Retry-After."""


class NotAccepting(Exception):
    """Draining or poisoned; answer 503 with Retry-After."""


class PromptTooLong(ValueError):
    pass


@dataclass
class EngineLimits:
    max_seqs: int = 8
    max_queue: int = 64
    max_step_tokens: int = 512  # tokens per backend step (decode tokens + prefill chunks)
    prefill_chunk: int = 256  # fixed, or the most when sized by measurement (prefill_step_s)
    prefill_step_s: float | None = None  # size prefill chunks so a step takes about this long
    context: int = 8192
    # The loop guard (see WorkerConfig.loop_guard for why these defaults): a block of up to
    # `loop_guard_period` tokens repeated back to back max(repeats, min_span / length) times.
    loop_guard: bool = True
    loop_guard_repeats: int = 8
    loop_guard_min_span: int = 128
    loop_guard_period: int = 64


@dataclass(eq=False)  # a sequence is itself: `s in running` and remove() by identity, not by fields
class _Seq:
    handle: RequestHandle
    number: int  # 1-based arrival order, for fault injection and logs
    arrived: float
    tokens: list[int]
    sampler: Sampler
    decoder: IncrementalDecoder
    stopper: StopMatcher
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    n_computed: int = 0
    n_registered: int = 0
    prompt_len: int = 0
    cached_tokens: int = 0
    generated: int = 0
    last_token_at: float = 0.0
    last_keepalive: float = 0.0
    prompt_lp: list[TokenLogprob | None] = field(default_factory=list)
    restoring: object | None = None  # a RestoreJob while blocks come back from the KV store
    restore_blocks: list[int] = field(default_factory=list)
    restore_used: int = 0
    n_offered: int = 0  # full blocks handed to the KV store
    begun: bool = False
    compiling: concurrent.futures.Future | None = None  # the grammar, until admission takes it
    constraint: SequenceConstraint | None = None  # survives preemption: it has seen every output token
    device_seed: int | None = None  # the seed of draws made on the device
    reasoning: ReasoningTracker | None = None
    guard: LoopGuard | None = None

    @property
    def req(self) -> GenerationRequest:
        return self.handle.request


class Engine:
    def __init__(
        self,
        model: Model,
        backend: Backend,
        limits: EngineLimits,
        *,
        metrics: Metrics | None = None,
        faults: FaultInjector | None = None,
        on_poisoned: Callable[[ContextPoisoned], None] | None = None,
        store=None,
        watch: ThreadWatch | None = None,
    ):
        self.model, self.backend, self.limits = model, backend, limits
        self.store = store  # KVStore or None
        self.metrics = metrics or Metrics()
        self.faults = faults or FaultInjector([])
        # one record of dead threads per worker: the store's, which started its threads first
        self.watch = watch or (store.watch if store is not None else ThreadWatch())
        self.metrics.attach_threads(self.watch)
        self.on_poisoned = on_poisoned
        self.pool = BlockPool(backend.n_blocks, backend.block_size, kv_salt(model.fingerprint, backend.kv_layout))
        self.metrics.kv_blocks_total.set(backend.n_blocks)
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Seq] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []
        self.accepting = True
        self.poisoned: ContextPoisoned | None = None
        self.dead: str | None = None  # why the loop thread died
        self.step_count = 0
        self.last_progress = time.monotonic()  # heartbeat for hang detection
        self._arrivals = 0
        self._stop = False
        self._ahead: _Ahead | None = None  # a decode step launched before the last one's tokens were read
        self._offers: list[tuple[bytes, bytes, list[int], int]] = []  # full blocks for the store, this step
        self.restore_costs = RestoreCosts()  # measured rates: restore or recompute, and the prefill chunk
        self._sizing = PrefillSizing(limits.prefill_chunk, limits.prefill_step_s)
        self._chunk = limits.prefill_chunk  # until start() calibrates
        self._rates = store.dir / "rates.json" if store is not None else None
        if self._rates is not None:
            self.restore_costs.load(self._rates)
        self._rates_saved: float | None = None  # the first rate measured is written at once
        self.ahead_steps = self.ahead_rows_dropped = 0  # run-ahead steps launched, and rows of them recomputed
        self.constraints = Constraints(model.tokenizer, model.config.vocab_size, watch=self.watch)
        self._thread = self.watch.thread("ember-engine", self._run, on_death=self._died, stopping=lambda: self._stop)
        self.faults.arm_threads(self.watch)

    # -- HTTP side -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._calibrate()
        self._thread.start()

    def _calibrate(self) -> None:
        """Auto prefill chunks: time prefills of the floor's and the ceiling's size once, before
        serving, and keep the chunk they give for this worker's life (a chunk that followed the load
        would change how the same prompt is split, and with it the last bits of its numerics). The
        restore decisions start from the same figures."""
        bs = self.backend.block_size
        need = -(-self._sizing.most // bs)
        if self.limits.prefill_step_s is None or self._sizing.most <= FLOOR_TOKENS or need > self.pool.available:
            self._chunk = self._sizing.chunk(PrefillCost())
            return
        blocks = self.pool.allocate(need)
        samples = []
        try:
            for n in (FLOOR_TOKENS, self._sizing.most) * 3:  # the first of each size warms up
                chunk = SeqChunk(np.full(n, 1, np.int32), 0, blocks, "last")
                t0 = time.monotonic()
                self.backend.forward([chunk])
                samples.append((n, time.monotonic() - t0))
        finally:
            self.pool.release(blocks)  # never registered: their contents are never matched
        cost = PrefillCost.measured(samples[2:])
        self._chunk = self._sizing.chunk(cost)
        if self.restore_costs.prefill.model is None:
            self.restore_costs.prefill = cost
        fixed, per = cost.model or (0.0, 0.0)
        log("prefill_chunk", tokens=self._chunk, step_ms=round(self.limits.prefill_step_s * 1000, 1),
            fixed_ms=round(fixed * 1000, 2), per_token_us=round(per * 1e6, 3))

    def submit(self, handle: RequestHandle) -> None:
        """Queue a request (called on the HTTP thread). Raises NotAccepting, QueueFull, PromptTooLong."""
        req = handle.request
        if not self.accepting:
            raise NotAccepting("the worker is not accepting requests (draining or restarting)")
        if len(req.prompt) >= self.limits.context:
            raise PromptTooLong(
                f"the prompt has {len(req.prompt)} tokens; this worker's context limit is {self.limits.context} tokens"
            )
        bs = self.backend.block_size
        if -(-(len(req.prompt) + 1) // bs) > self.pool.n_blocks:
            raise PromptTooLong(
                f"the prompt has {len(req.prompt)} tokens; the KV cache holds {self.pool.n_blocks * bs} tokens (raise --kv-mem)"
            )
        tok = self.model.tokenizer
        with self._lock:
            if self.dead is not None:
                raise NotAccepting(f"the engine loop thread died ({self.dead}); the worker is restarting")
            if len(self.waiting) + len(self._inbox) >= self.limits.max_queue:
                raise QueueFull(f"{self.limits.max_queue} requests are already waiting")
            self._arrivals += 1
            seq = _Seq(
                handle=handle, number=self._arrivals, arrived=time.monotonic(), tokens=list(req.prompt),
                sampler=Sampler(req.params), decoder=IncrementalDecoder(tok), stopper=StopMatcher(req.stop),
                prompt_len=len(req.prompt),
                compiling=self.constraints.compile(req.grammar) if req.grammar is not None else None,
                reasoning=ReasoningTracker(req.reasoning) if req.reasoning is not None else None,
                # a grammar bounds its own output (structured.py caps strings, lists and depth) and a
                # cut document would not parse: the guard is for free text only
                guard=self._loop_guard() if req.grammar is None else None,
            )
            self._inbox.append(seq)
            self.metrics.started.inc()
            self._wake.notify()

    def _loop_guard(self) -> LoopGuard | None:
        lim = self.limits
        if not lim.loop_guard:
            return None
        return LoopGuard(max_period=lim.loop_guard_period, repeats=lim.loop_guard_repeats,
                         min_span=lim.loop_guard_min_span)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self._inbox)

    def stop_accepting(self) -> None:
        self.accepting = False

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self.faults.stop_hang.set()
        self._thread.join(timeout)
        self.constraints.shutdown()

    # -- the loop --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self.waiting and not self.running:
                    self._wake.wait(timeout=1.0)
                    self.last_progress = time.monotonic()
                if self._stop:
                    break
                self.waiting.extend(self._inbox)
                self._inbox.clear()
            if self.watch.doomed:  # fault injection (thread-die:thread=engine)
                self.watch.checkpoint()
            try:
                self._step()
            except ContextPoisoned as e:
                self._poison(e)
                return
            except Exception as e:  # a bug in the loop itself: fail what is in flight, keep serving
                log("engine_error", level="error", error=f"{type(e).__name__}: {e}")
                self._drop_ahead()
                for s in list(self.running) + list(self.waiting):
                    self._settle(s, Outcome.FAILED, Failed(f"internal error: {type(e).__name__}"))
                self.running.clear()
                self.waiting.clear()
            self.last_progress = time.monotonic()
            self._update_gauges()
            if self._rates is not None and self.store.writable and self.restore_costs.prefill.model is not None and (
                    self._rates_saved is None or self.last_progress - self._rates_saved > RATES_SAVE_SECONDS):
                self._rates_saved = self.last_progress
                self.restore_costs.save(self._rates)
        self._drop_ahead()
        if self._rates is not None and self.store.writable:
            self.restore_costs.save(self._rates)
        for s in list(self.running) + list(self.waiting):
            self._settle(s, Outcome.CANCELED, Failed("the worker is shutting down", status=503, kind="overloaded"))

    def _died(self, e: BaseException) -> None:
        """The loop thread is dying (still on it): refuse new requests and fail those in flight with
        a 503, so no client waits on a loop that is gone."""
        with self._lock:
            self.dead = f"{type(e).__name__}: {e}"
            self.accepting = False
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        failed = Failed("the worker's engine loop failed; the worker is restarting", status=503, kind="overloaded")
        for s in list(self.running) + list(self.waiting):
            try:
                self._settle(s, Outcome.FAILED, failed)
            except Exception:  # the state it would clean up may be what broke: the client hears anyway
                s.handle.push([failed])
        self.running.clear()
        self.waiting.clear()
        try:
            self._update_gauges()
        except Exception:
            pass

    def _drop_ahead(self) -> None:
        """Wait for a run-ahead step still in flight and forget it (its rows are not wanted)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                ahead.discard()
            except ContextPoisoned as e:
                self._poison(e)
                self._stop = True  # nothing more can run in this process

    def _step(self) -> None:
        try:
            self._step_once()
        finally:
            self._flush_offers()

    def _step_once(self) -> None:
        self._reap_cancelled()
        self._admit()
        self._progress_restores()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # launched during the last step: its rows whose sequence moved on are dropped
            rows = ahead.valid_rows(self.running)
            chunks, members = [ahead.chunks[i] for i in rows], [ahead.members[i] for i in rows]
            pending = ahead.pending
            self.ahead_rows_dropped += len(ahead.chunks) - len(chunks)
        else:
            if not self.running:
                return
            chunks, members = self._plan()
            if not chunks:
                return
            t0 = time.monotonic()
            pending = self._launch(chunks, members)
            rows = list(range(len(chunks)))
        # launch the next decode step before reading this one's tokens (they are fed on the device):
        # the host's work for a step then overlaps the device's
        nxt = self._run_ahead(chunks, members, rows) if pending is not None else None
        try:
            outputs = pending.result() if pending is not None else self.backend.forward(chunks)
        except ContextPoisoned:
            raise
        except Exception:
            if nxt is not None:  # it was fed from this step's draws
                nxt.discard()
                nxt = None
            outputs = self._isolate(chunks, members)
        if nxt is not None:
            nxt.fed_from(outputs)
        self._ahead = nxt
        now = time.monotonic()
        if ahead is None:  # a planned step: its prefill tokens measure the device's prefill rate
            self.restore_costs.observe_prefill(sum(len(c.tokens) for c in chunks if len(c.tokens) > 1), now - t0)
        for chunk, seq, out in zip(chunks, members, outputs):
            if out is _FAILED:
                continue
            try:
                self._after_forward(seq, chunk, out, now)
            except ContextPoisoned:
                raise
            except Exception as e:
                log("request_error", level="error", request_id=seq.req.request_id, error=f"{type(e).__name__}: {e}")
                self._settle(seq, Outcome.FAILED, Failed(f"{type(e).__name__}: {e}"))

    def _launch(self, chunks: list[SeqChunk], members: list[_Seq], phases: set[str] | None = None):
        """Count the step, run the fault hooks, and submit it where the backend can run ahead (None:
        the caller runs it with forward)."""
        if phases is None:
            phases = {"prefill" if len(c.tokens) > 1 or s.generated == 0 else "decode" for c, s in zip(chunks, members)}
        self.step_count += 1
        self.metrics.steps.inc()
        self.faults.before_step(self.step_count, phases, self.backend)
        if not getattr(self.backend, "runs_ahead", False):
            return None
        try:
            return self.backend.submit(chunks)
        except ContextPoisoned:
            raise
        except Exception:
            return None  # forward() reruns it, and _isolate finds the culprit

    def _run_ahead(self, chunks: list[SeqChunk], members: list[_Seq], rows: list[int]) -> "_Ahead | None":
        """Submit the decode step after this one, each sequence's token the draw this step makes on the
        device, when that step is already known: every running sequence is in this step, is drawing
        its next token on the device, and nothing waits to be admitted. Sequences this step ends (by
        length) sit it out; a sequence whose token turns out otherwise (a stop, a forced reasoning
        marker, a cancel) has its row dropped and recomputed (its KV slot is simply rewritten).
        rows[j]: chunk j's index in the step the backend ran (a run-ahead step may have dropped rows)."""
        if not getattr(self.backend, "runs_ahead", False) or len(members) != len(self.running):
            return None
        if (self.waiting or self._inbox) and len(self.running) < self.limits.max_seqs:
            return None
        eligible: list[tuple[int, _Seq, int]] = []  # (chunk index, sequence, position of its next token)
        for j, (c, s) in enumerate(zip(chunks, members)):
            at = c.start + len(c.tokens)
            if c.sample is None or c.logits != "last" or at != len(s.tokens) or s.restoring is not None:
                return None
            if s.generated + 1 >= s.req.max_tokens or at + 1 >= self.limits.context:
                continue  # this step's token is its last
            eligible.append((j, s, at))
        if not eligible:
            return None
        nxt_chunks, nxt_members, feed, sources = [], [], [], []
        for j, s, at in eligible:
            need = -(-(at + 1) // self.backend.block_size) - len(s.blocks)
            if need > 0:
                try:
                    s.blocks.extend(self.pool.allocate(need))
                except OutOfBlocks:
                    return None  # the normal plan preempts if it must
            nxt_chunks.append(SeqChunk(np.zeros(1, np.int32), at, s.blocks, "last", sample=self._device_sample(s, 1)))
            nxt_members.append(s)
            feed.append(rows[j])
            sources.append(j)
        self.step_count += 1
        self.metrics.steps.inc()
        self.faults.before_step(self.step_count, {"decode"}, self.backend)
        try:
            pending = self.backend.submit(nxt_chunks, feed=feed)
        except ContextPoisoned:
            raise
        except Exception as e:
            log("engine_error", level="error", error=f"run-ahead step: {type(e).__name__}: {e}")
            return None
        self.ahead_steps += 1
        return _Ahead(pending, nxt_chunks, nxt_members, sources)

    def _isolate(self, chunks: list[SeqChunk], members: list[_Seq]) -> list:
        """A batched step raised: rerun each chunk alone so only the culprit fails."""
        outputs = []
        for c, s in zip(chunks, members):
            try:
                outputs.append(self.backend.forward([c])[0])
            except ContextPoisoned:
                raise
            except Exception as e:
                log("request_error", level="error", request_id=s.req.request_id, error=f"{type(e).__name__}: {e}")
                self._settle(s, Outcome.FAILED, Failed(f"{type(e).__name__}: {e}"))
                outputs.append(_FAILED)
        return outputs

    # -- admission and planning ------------------------------------------------------------------------

    def _reap_cancelled(self) -> None:
        for s in [s for s in self.running + list(self.waiting) if s.handle.cancelled.is_set()]:
            self._settle(s, Outcome.CANCELED, None)

    def _admit(self) -> None:
        bs = self.backend.block_size
        while self.waiting and len(self.running) < self.limits.max_seqs:
            s = self.waiting[0]
            if s.compiling is not None:
                if not self._take_grammar(s):
                    return  # still compiling: admit in order, on a later step
                continue
            reuse = 0 if s.req.prompt_logprobs else (len(s.tokens) - 1) // bs
            blocks, hashes = self.pool.match(s.tokens, reuse)  # retained: each path below hands them on
            stored = self._stored(hashes[len(blocks) : reuse]) if self.store and len(blocks) < reuse else []
            need = -(-(len(s.tokens) + 1) // bs) - len(blocks)
            if need > self.pool.available:
                self.pool.release(blocks)
                if self.running:
                    return  # wait for running sequences to free blocks
                self._settle(self.waiting.popleft(), Outcome.REFUSED,
                             Failed("not enough KV cache for this prompt", status=503, kind="overloaded"))
                continue
            self.waiting.popleft()
            s.blocks, s.hashes = blocks, hashes
            s.n_computed, s.n_registered = len(blocks) * bs, len(blocks)
            s.n_offered = max(s.n_offered, s.n_registered)  # matched blocks are known to the store
            s.last_keepalive = time.monotonic()
            self.running.append(s)
            if stored and self._worth_restoring(s, stored):
                s.restore_blocks = self.pool.allocate(len(stored))
                s.restoring = self.store.restore(hashes[len(blocks) : len(blocks) + len(stored)])
                s.restoring.tiers = stored
                s.restore_used = 0
            else:
                self._begin(s)

    def _stored(self, hashes: list[bytes]) -> list[str]:
        """Where the KV store holds the leading `hashes` ("host" or "disk"). It never raises: a store
        that fails (an I/O error it did not absorb, a bug) answers none, and the prompt is computed."""
        try:
            return self.store.where(hashes)
        except Exception as e:
            log("kv_lookup_error", level="warning", error=f"{type(e).__name__}: {e}")
            return []

    def _worth_restoring(self, s: _Seq, tiers: list[str]) -> bool:
        """Restore the stored blocks, or compute them again: whichever this worker measured faster."""
        host = tiers.count("host") * self.store.block_bytes
        c = self.restore_costs.choose(len(tiers) * self.backend.block_size, host,
                                      len(tiers) * self.store.block_bytes - host)
        self.metrics.restore_choices.labels("restore" if c.restore else "recompute").inc()
        log("kv_restore_choice", request_id=s.req.request_id, seq=s.number,
            choice="restore" if c.restore else "recompute", blocks=len(tiers), host_blocks=tiers.count("host"),
            restore_seconds=round(c.restore_seconds, 4),
            compute_seconds=None if c.compute_seconds is None else round(c.compute_seconds, 4))
        return c.restore

    def _take_grammar(self, s: _Seq) -> bool:
        """Resolve the head's grammar: False while it still compiles (waiting briefly only when
        nothing runs); a grammar that does not compile fails the request with a 400."""
        fut = s.compiling
        if not fut.done() and (self.running or not concurrent.futures.wait([fut], timeout=0.05).done):
            return False
        s.compiling = None
        try:
            s.constraint = fut.result()
        except GrammarError as e:
            self._settle(s, Outcome.FAILED, Failed(str(e), status=400, kind="invalid_grammar"))
            return True
        except Exception as e:  # llguidance itself failed: this request alone
            self._settle(s, Outcome.FAILED, Failed(f"the grammar could not be compiled: {type(e).__name__}: {e}"))
            return True
        s.constraint.prefetch()  # the first mask computes during the prefill
        return True

    def _begin(self, s: _Seq) -> None:
        """Admission accounting, once the prompt's cached part (device or store) is known."""
        if s.begun:  # a preempted sequence keeps its first accounting
            return
        s.begun = True
        s.cached_tokens = s.n_computed
        self.metrics.prompt_tokens.inc(s.prompt_len)
        self.metrics.cached_tokens.inc(s.cached_tokens)
        log("admit", request_id=s.req.request_id, seq=s.number, protocol=s.req.protocol,
            prompt_tokens=s.prompt_len, cached_tokens=s.cached_tokens, new_tokens=s.prompt_len - s.cached_tokens,
            **({"probe": True} if s.req.probe else {}))
        s.handle.push([Started(s.prompt_len, s.cached_tokens)])

    def _progress_restores(self) -> None:
        """Copy blocks the store has read into the pool, in chain order; a miss ends the chain
        (the rest of the prompt is computed)."""
        for s in [s for s in self.running if s.restoring is not None]:
            job = s.restoring
            if not job.done.is_set() and self.running and all(r.restoring is not None for r in self.running):
                job.done.wait(0.05)  # nothing else to run: do not spin
            results = list(job.results)
            # the payloads read so far, in chain order, up to the first miss; while other streams
            # decode, a step loads a bounded share, so a long restore never stalls them
            most = len(results) if len(self.running) == 1 else max(1, RESTORE_BYTES_PER_STEP // self.store.block_bytes)
            ready = []
            for payload in results[s.restore_used:s.restore_used + most]:
                if payload is None:
                    break
                ready.append(payload)
            if ready:  # into the pool in one batch: the backend copies them without a host wait
                first = s.restore_used
                self.backend.load_blocks(s.restore_blocks[first:first + len(ready)], ready)
                for k in range(first, first + len(ready)):
                    block, h = s.restore_blocks[k], job.hashes[k]
                    canonical = self.pool.register(block, h)
                    if canonical != block:
                        self.pool._retain(canonical)
                        self.pool.release([block])
                        block = canonical
                    s.blocks.append(block)
                s.restore_used += len(ready)
                s.n_computed += len(ready) * self.backend.block_size
                s.n_registered += len(ready)
                s.n_offered = s.n_registered
            finished = job.done.is_set() and (s.restore_used == len(job.results) or
                                              job.results[s.restore_used] is None)
            if finished:
                self.pool.release(s.restore_blocks[s.restore_used :])
                seconds = time.monotonic() - job.started
                tiers = job.tiers[: s.restore_used]
                if s.restore_used:
                    self.restore_costs.observe_restore("disk" if "disk" in tiers else "host",
                                                       s.restore_used * self.store.block_bytes, seconds)
                log("kv_restore", request_id=s.req.request_id, seq=s.number, blocks=s.restore_used,
                    tokens=s.restore_used * self.backend.block_size, seconds=round(seconds, 3))
                s.restoring, s.restore_blocks = None, []
                self._begin(s)

    def prefill_chunk(self) -> int:
        """Prompt tokens a sequence may prefill in a step (see prefill_sizing and _calibrate)."""
        return self._chunk

    def _plan(self) -> tuple[list[SeqChunk], list[_Seq]]:
        chunk = self.prefill_chunk()
        budget = self.limits.max_step_tokens if self.limits.prefill_step_s is None else max(
            chunk, self.limits.max_seqs)
        chunks, members = [], []
        # decode steps first: one token each, so running streams never wait behind a prefill
        order = sorted(self.running, key=lambda s: (s.n_computed < len(s.tokens) - 1, s.number))
        for s in order:
            if budget <= 0:
                break
            if s not in self.running or s.restoring is not None:  # preempted, or still restoring
                continue
            todo = len(s.tokens) - s.n_computed
            if todo <= 0:
                continue
            n = min(todo, budget, chunk) if todo > 1 else 1
            if not self._ensure_blocks(s, s.n_computed + n, members):
                continue
            want = "all" if s.req.prompt_logprobs and s.generated == 0 else (
                "last" if s.n_computed + n == len(s.tokens) else "none")
            chunks.append(SeqChunk(np.asarray(s.tokens[s.n_computed : s.n_computed + n], np.int32),
                                   s.n_computed, s.blocks, want, sample=self._device_sample(s) if want == "last" else None))
            members.append(s)
            budget -= n
        return chunks, members

    def _ensure_blocks(self, s: _Seq, length: int, planned: list[_Seq]) -> bool:
        """Get blocks for `length` positions, preempting the youngest sequence not yet planned in
        this step if the pool is short. False: `s` sits this step out (or failed, if alone)."""
        need = -(-length // self.backend.block_size) - len(s.blocks)
        while need > 0:
            try:
                s.blocks.extend(self.pool.allocate(need))
                return True
            except OutOfBlocks:
                candidates = [r for r in self.running if r is not s and r not in planned and r.restoring is None]
                if candidates:
                    self._preempt(max(candidates, key=lambda r: r.number))
                elif planned:
                    return False  # the planned ones free or grow first; try again next step
                else:
                    self._settle(s, Outcome.FAILED, Failed("the KV cache is full", status=503, kind="overloaded"))
                    return False
        return True

    def _preempt(self, s: _Seq) -> None:
        """Free a sequence's blocks and requeue it first; its full blocks stay in the prefix cache,
        so resuming mostly re-matches them instead of recomputing."""
        self._register_full_blocks(s)
        self._flush_offers()  # copied off before the pool may hand its blocks out again
        self.pool.release(s.blocks)
        s.blocks, s.n_computed, s.n_registered = [], 0, 0
        self.running.remove(s)
        self.waiting.appendleft(s)
        log("preempt", request_id=s.req.request_id, seq=s.number, tokens=len(s.tokens))

    # -- after a step ------------------------------------------------------------------------------------

    def _register_full_blocks(self, s: _Seq) -> None:
        bs = self.backend.block_size
        full = s.n_computed // bs
        while len(s.hashes) < full:
            i = len(s.hashes)
            parent = s.hashes[-1] if s.hashes else ROOT_HASH
            s.hashes.append(chain_hash(parent, s.tokens[i * bs : (i + 1) * bs], self.pool.salt))
        for i in range(s.n_registered, full):
            canonical = self.pool.register(s.blocks[i], s.hashes[i])
            if canonical != s.blocks[i]:  # an identical block was computed meanwhile: share it
                self.pool._retain(canonical)
                self.pool.release([s.blocks[i]])
                s.blocks[i] = canonical
        s.n_registered = max(s.n_registered, full)
        if self.store is not None and self.store.persist == "all":
            self._offer(s)

    def _offer(self, s: _Seq) -> None:
        """Queue newly registered full blocks for the KV store; _flush_offers copies them."""
        bs = self.backend.block_size
        for i in range(s.n_offered, s.n_registered):
            parent = s.hashes[i - 1] if i else ROOT_HASH
            self._offers.append((s.hashes[i], parent, s.tokens[i * bs : (i + 1) * bs], s.blocks[i]))
        s.n_offered = s.n_registered

    def _flush_offers(self) -> None:
        """The step's offered blocks off the device in one batch (save_blocks never makes the engine
        wait), before any of them can be released and written again. Those the store does not want
        (known already, or its writer is behind) are never copied."""
        offers, self._offers = self._offers, []
        if not offers or self.store is None or self.poisoned is not None:
            return
        wanted = set(self.store.accept([(h, parent) for h, parent, _, _ in offers]))
        batch = []
        for h, parent, tokens, block in offers:
            if h in wanted:
                wanted.discard(h)
                batch.append((h, parent, tokens, block))
        if not batch:
            return
        try:
            copy = self.backend.save_blocks([block for _, _, _, block in batch])
        except ContextPoisoned:
            self.store.offer_batch([(h, p, t) for h, p, t, _ in batch], None)
            raise
        except Exception as e:  # persistence is best effort: the request goes on
            log("kv_offer_error", level="warning", error=f"{type(e).__name__}: {e}")
            copy = None
        self.store.offer_batch([(h, p, t) for h, p, t, _ in batch], copy)

    def _after_forward(self, s: _Seq, chunk: SeqChunk, logits: np.ndarray | None, now: float) -> None:
        s.n_computed += len(chunk.tokens)
        self._register_full_blocks(s)
        if self.faults:
            self.faults.check_request(s.number)
        if chunk.logits == "all" and s.generated == 0:
            lp = log_softmax(logits)
            for j in range(len(chunk.tokens)):
                p = chunk.start + j
                if p == 0:
                    s.prompt_lp.append(None)
                if p + 1 < s.prompt_len:
                    nxt = s.tokens[p + 1]
                    s.prompt_lp.append(_token_logprob(lp[j], nxt, s.req.logprobs or 0))
            logits = logits[-1:]
        if s.n_computed < len(s.tokens):  # still prefilling
            if now - s.last_keepalive >= KEEPALIVE_SECONDS:
                s.last_keepalive = now
                s.handle.push([Keepalive(s.n_computed, len(s.tokens))])
            return
        if s.generated == 0 and s.req.prompt_logprobs:
            s.handle.push([PromptLogprobs(s.prompt_lp)])
        self._sample(s, logits if isinstance(logits, SampledToken) else logits[-1], now)

    def _device_sample(self, s: _Seq, ahead: int = 0) -> DeviceSample | None:
        """Let a backend that samples on the device (CUDA) draw this token where the logits are,
        unless the request needs them on the host: a grammar mask, penalties, logit_bias or logprobs.
        ahead: the draw is that many tokens past what the sequence has generated (a run-ahead step)."""
        if not getattr(self.backend, "samples_on_device", False) or s.constraint or s.req.logprobs is not None:
            return None
        p = s.req.params
        if p.on_host:  # penalties or logit_bias
            return None
        if s.device_seed is None:  # a seeded request repeats; others draw from fresh entropy
            s.device_seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        temp = 0.0 if p.greedy else p.temperature
        return DeviceSample(temp, p.top_k, p.top_p, p.min_p, s.device_seed, s.generated + ahead)

    def _sample(self, s: _Seq, logits: np.ndarray, now: float) -> None:
        if s.generated == 0:
            self.metrics.ttft.observe(now - s.arrived)
        else:
            self.metrics.itl.observe(now - s.last_token_at)
        s.last_token_at = now
        try:
            token = self._choose(s, logits)
            self._emit(s, token, logits)
        except ConstraintError as e:
            self._fail_grammar(s, e)

    def _choose(self, s: _Seq, logits: np.ndarray) -> int:
        """The next token: the reasoning block's closing marker once its budget is spent, else a
        sample under the grammar's mask."""
        forced = s.reasoning.forced_token() if s.reasoning else None
        if forced is not None:
            if s.reasoning.forced == 0:
                log("reasoning_budget", request_id=s.req.request_id, seq=s.number, budget=s.reasoning.budget)
            s.reasoning.forced += 1
            return forced
        if isinstance(logits, SampledToken):  # drawn on the device (see _device_sample)
            return int(logits)
        bias = s.constraint.bias() if s.constraint else None
        return s.sampler.sample(logits, s.tokens, bias)

    def _emit(self, s: _Seq, token: int, logits: np.ndarray) -> None:
        req = s.req
        tok = self.model.tokenizer
        is_end = not req.ignore_eos and (token in tok.eot_ids or token in req.stop_token_ids)
        if is_end:
            self._finish(s, FinishReason.STOP, None)
            return
        if s.constraint:  # before anything is sent: a token the grammar refuses never reaches the client
            s.constraint.consume(token)
        s.tokens.append(token)
        s.generated += 1
        self.metrics.generated_tokens.inc()
        if s.reasoning:
            s.reasoning.feed(token)
        looped = s.guard.feed(token) if s.guard else False
        text, stop = s.stopper.feed(s.decoder.feed(token))
        lps = None
        if req.logprobs is not None:
            lps = [_token_logprob(log_softmax(logits), token, req.logprobs)]
        if text or lps or stop is None:
            s.handle.push([Delta(text, [token], lps)])
        if stop is not None:
            self._finish(s, FinishReason.STOP, stop)
        elif s.constraint and s.constraint.stopped:
            self._finish(s, FinishReason.STOP, None)  # the grammar is complete
        elif s.generated >= req.max_tokens or len(s.tokens) >= self.limits.context:
            self._finish(s, FinishReason.LENGTH, None)
        elif looped:
            log("loop_guard", request_id=req.request_id, seq=s.number, period=s.guard.period,
                repeats=s.guard.repeats_for(s.guard.period))
            self._finish(s, FinishReason.LENGTH, None)
        elif s.constraint:
            s.constraint.prefetch()  # computes while the next backend step runs

    def _fail_grammar(self, s: _Seq, e: ConstraintError) -> None:
        forced = s.reasoning is not None and s.reasoning.forced_token() is not None
        what = "the reasoning block's end marker is not allowed by the grammar" if forced else "the grammar failed"
        # llguidance's errors can carry a panic's backtrace: the log keeps it, the client gets line one
        log("request_error", level="error", request_id=s.req.request_id, error=f"grammar: {e}")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._settle(s, Outcome.FAILED, Failed(f"structured output: {what}: {first[:300]}", status=500,
                                               kind="server_error"))

    def _finish(self, s: _Seq, reason: FinishReason, stop: str | None) -> None:
        if stop is None:  # release held-back text; the decoder's last bytes still pass the stop matcher
            text, stop = s.stopper.feed(s.decoder.flush())
            tail = text if stop is not None else text + s.stopper.flush()
            if stop is not None:
                reason = FinishReason.STOP
            if tail:
                s.handle.push([Delta(tail, [])])
        self._settle(s, Outcome.COMPLETED, Finished(reason, s.prompt_len, s.cached_tokens, s.generated, stop))

    def _settle(self, s: _Seq, outcome: Outcome, event) -> None:
        """The one place a request ends: free its blocks, send its last event, log its outcome."""
        if s in self.running:
            self._register_full_blocks(s)
            if self.store is not None and self.store.persist == "finished":
                self._offer(s)
            self._flush_offers()  # copied off before the pool may hand its blocks out again
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        if s.blocks:
            self.pool.release(s.blocks)
            s.blocks = []
        if s.restore_blocks:
            self.pool.release(s.restore_blocks[s.restore_used :])
            s.restore_blocks, s.restoring = [], None
        if event is None:
            event = Failed("the client went away", status=499, kind="canceled")
        self.metrics.outcomes.labels(outcome.value).inc()
        fields = dict(request_id=s.req.request_id, seq=s.number, protocol=s.req.protocol, prompt_tokens=s.prompt_len,
                      cached_tokens=s.cached_tokens, completion_tokens=s.generated,
                      seconds=round(time.monotonic() - s.arrived, 3))
        if s.req.probe:
            fields["probe"] = True
        if isinstance(event, Finished):
            fields["finish_reason"] = event.reason.value
        elif outcome is not Outcome.CANCELED:
            fields["error"] = event.message
        else:
            fields["phase"] = "decode" if s.generated else ("prefill" if s.n_computed else "queued")
        log(outcome.value, level="error" if outcome is Outcome.FAILED else "info", **fields)
        s.handle.push([event])  # last: whoever sees the end also sees the counters and the log line

    def _poison(self, e: ContextPoisoned) -> None:
        self.poisoned = e
        self.accepting = False
        log("engine_poisoned", level="error", code=e.code, name=e.name, message=e.message, step=self.step_count,
            running=[s.req.request_id for s in self.running])
        for s in list(self.running) + list(self.waiting):
            self.running.remove(s) if s in self.running else self.waiting.remove(s)
            s.blocks = []  # the device memory is gone; nothing to release into
            s.handle.push([Failed(f"the engine's compute context failed ({e.name}); the worker is restarting",
                                  status=503, kind="overloaded")])
            self.metrics.outcomes.labels(Outcome.FAILED.value).inc()
            log(Outcome.FAILED.value, level="error", request_id=s.req.request_id, seq=s.number, error=str(e))
        if self.on_poisoned:
            self.on_poisoned(e)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self.waiting) + len(self._inbox))
        m.running.set(len(self.running))
        m.kv_blocks_used.set(self.pool.in_use)
        m.kv_blocks_cached.set(self.pool.cached_count)
        m.kv_usage.set(self.pool.in_use / max(self.pool.n_blocks, 1))


_FAILED = object()


class _Ahead:
    """A run-ahead step in flight: row i fed from the draw of chunk sources[i] of the step before it.
    Once that step's outputs are known (fed_from), a row is valid if its sequence took exactly that
    token and is still running at that position."""

    def __init__(self, pending, chunks: list[SeqChunk], members: list[_Seq], sources: list[int]):
        self.pending, self.chunks, self.members, self.sources = pending, chunks, members, sources
        self.tokens: list[int | None] = [None] * len(chunks)

    def fed_from(self, outputs: list) -> None:
        for i, j in enumerate(self.sources):
            out = outputs[j]
            self.tokens[i] = int(out) if isinstance(out, SampledToken) else None

    def valid_rows(self, running: list[_Seq]) -> list[int]:
        """The rows still wanted; the pending step's result() then returns theirs alone."""
        keep = [i for i, (c, s, t) in enumerate(zip(self.chunks, self.members, self.tokens))
                if t is not None and s in running and s.n_computed == c.start and len(s.tokens) == c.start + 1
                and s.tokens[c.start] == t]
        for i in keep:
            self.chunks[i].tokens[0] = self.tokens[i]  # the token the device used, for a rerun on its own
        if len(keep) != len(self.chunks):
            self.pending = _Selected(self.pending, keep)
        return keep

    def discard(self) -> None:
        try:
            self.pending.result()
        except ContextPoisoned:
            raise
        except Exception:
            pass


class _Selected:
    """Some rows of a pending step's outputs."""

    def __init__(self, pending, rows: list[int]):
        self.pending, self.rows = pending, rows

    def result(self) -> list:
        out = self.pending.result()
        return [out[i] for i in self.rows]


def _token_logprob(lp: np.ndarray, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(i), float(lp[i])) for i in idx]
    return TokenLogprob(int(token), float(lp[token]), top)
