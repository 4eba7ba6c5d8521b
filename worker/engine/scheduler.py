"""The engine loop: continuous batching with chunked prefill and a prefix cache.

One thread owns the backend. Each step it takes new requests and cancellations, admits waiting
requests while there are sequence slots and KV blocks, applies the step plan the scheduler returns
(planner.py: decode tokens, prefill chunks, preemptions), runs the backend once, and hands each
sequence's output to the output processor (output.py), settling the requests it ends. KV blocks,
prefix matching and the KV store are the KV manager's (kv_manager.py); decode steps launched
before the last one's tokens are read are run_ahead.py's; injected step faults wrap the backend
(faults.FaultyBackend).

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
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..logs import log
from ..metrics import Metrics
from ..model.loader import Model
from ..text.tokenizer import IncrementalDecoder
from ..threads import ThreadWatch
from .backend import Backend, ContextPoisoned, SampledToken, SeqChunk
from .constraints import Constraints, GrammarError
from .faults import FaultInjector, FaultyBackend
from .kv_blocks import BlockPool, kv_salt
from .kv_manager import KVManager
from .loopguard import LoopGuard
from .output import Finish, OutputProcessor
from .planner import Scheduler
from .prefill_sizing import FLOOR_TOKENS, PrefillSizing
from .reasoning_budget import ReasoningTracker
from .requests import Failed, Finished, Keepalive, Outcome, RequestHandle, Started
from .restore_policy import RestoreCosts
from .run_ahead import Ahead, RunAhead
from .sampling import Sampler
from .sequence import OutputState, Seq
from .speculation import Speculator
from .step_costs import PrefillCost
from .textstream import StopMatcher

KEEPALIVE_SECONDS = 5.0
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
    # speculative decoding (speculation.py): the drafter ("off", "ngram", "suffix"), the longest draft,
    # and off above this many decoding sequences or this context depth
    spec: str = "off"
    spec_k: int = 8
    spec_max_batch: int = 8
    spec_max_context: int = 32768


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
        drafter=None,
    ):
        """drafter: a drafter built by the caller (draft_model.ModelDrafter for --spec draft:PATH)."""
        self.faults = faults or FaultInjector([])
        if self.faults and not isinstance(backend, FaultyBackend):  # the server wraps it itself
            backend = FaultyBackend(backend, self.faults)
        self.model, self.backend, self.limits = model, backend, limits
        self.store = store  # KVStore or None
        self.metrics = metrics or Metrics()
        # one record of dead threads per worker: the store's, which started its threads first
        self.watch = watch or (store.watch if store is not None else ThreadWatch())
        self.metrics.attach_threads(self.watch)
        self.on_poisoned = on_poisoned
        self.pool = BlockPool(backend.n_blocks, backend.block_size, kv_salt(model.fingerprint, backend.kv_layout))
        self.metrics.kv_blocks_total.set(backend.n_blocks)
        self._lock = threading.Lock()
        self._inbox: collections.deque[Seq] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.accepting = True
        self.poisoned: ContextPoisoned | None = None
        self.dead: str | None = None  # why the loop thread died
        self.step_count = 0
        self.last_progress = time.monotonic()  # heartbeat for hang detection
        self._arrivals = 0
        self._stop = False
        self._ahead: Ahead | None = None  # a decode step launched before the last one's tokens were read
        self.restore_costs = RestoreCosts()  # measured rates: restore or recompute, and the prefill chunk
        self._sizing = PrefillSizing(limits.prefill_chunk, limits.prefill_step_s)
        self._chunk = limits.prefill_chunk  # until start() calibrates
        self._rates = store.dir / "rates.json" if store is not None else None
        if self._rates is not None:
            self.restore_costs.load(self._rates)
        self._rates_saved: float | None = None  # the first rate measured is written at once
        self.kv = KVManager(self.pool, backend, store, self.metrics, self.restore_costs)
        self.output = OutputProcessor(model.tokenizer, backend, limits.context, self.metrics)
        self.speculator = (Speculator(drafter or limits.spec, limits.spec_k, limits.spec_max_batch,
                                      limits.spec_max_context) if limits.spec != "off" else None)
        self.scheduler = Scheduler(self.kv, self.output, limits.max_step_tokens, limits.max_seqs,
                                   sized=limits.prefill_step_s is not None, speculator=self.speculator)
        self.run_ahead = RunAhead(backend, self.kv, self.output, limits.context)
        self.constraints = Constraints(model.tokenizer, model.config.vocab_size, watch=self.watch)
        self._thread = self.watch.thread("ember-engine", self._run, on_death=self._died, stopping=lambda: self._stop)
        self.faults.arm_threads(self.watch)

    # -- HTTP side -----------------------------------------------------------------------------------


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
                self.backend.unhooked().forward([chunk])  # a measurement, not a step: no faults
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
                f"the prompt has {len(req.prompt)} tokens; the KV cache holds {self.pool.n_blocks * bs} tokens"
                " (raise --kv-mem)"
            )
        tok = self.model.tokenizer
        with self._lock:
            if self.dead is not None:
                raise NotAccepting(f"the engine loop thread died ({self.dead}); the worker is restarting")
            if len(self.waiting) + len(self._inbox) >= self.limits.max_queue:
                raise QueueFull(f"{self.limits.max_queue} requests are already waiting")
            self._arrivals += 1
            out = OutputState(
                sampler=Sampler(req.params), decoder=IncrementalDecoder(tok), stopper=StopMatcher(req.stop),
                reasoning=ReasoningTracker(req.reasoning) if req.reasoning is not None else None,
                # a grammar bounds its own output (structured.py caps strings, lists and depth) and a
                # cut document would not parse: the guard is for free text only
                guard=self._loop_guard() if req.grammar is None else None,
            )
            seq = Seq(
                handle=handle, number=self._arrivals, arrived=time.monotonic(), tokens=list(req.prompt),
                prompt_len=len(req.prompt), out=out,
                compiling=self.constraints.compile(req.grammar) if req.grammar is not None else None,
                spec=self.speculator.state() if self.speculator is not None else None,
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
        with contextlib.suppress(Exception):
            self._update_gauges()

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

    def _flush_offers(self) -> None:
        self.kv.flush_offers(poisoned=self.poisoned is not None)

    @property
    def ahead_steps(self) -> int:  # run-ahead steps launched
        return self.run_ahead.steps

    @property
    def ahead_rows_dropped(self) -> int:  # rows of run-ahead steps recomputed
        return self.run_ahead.rows_dropped

    def _step_once(self) -> None:
        self._reap_cancelled()
        self._admit()
        for s in self.kv.progress_restores(self.running):
            self._begin(s)
        ahead, self._ahead = self._ahead, None
        rerun = False  # the step already counted and ran its fault hooks: forward it unhooked
        if ahead is not None:  # launched during the last step: its rows whose sequence moved on are dropped
            chunks, members, rows = self.run_ahead.take(ahead, self.running)
            pending = ahead.pending
        else:
            if not self.running:
                return
            chunks, members = self._plan()
            if not chunks:
                return
            t0 = time.monotonic()
            pending, rerun = self._launch(chunks)
            rows = list(range(len(chunks)))
        # launch the next decode step before reading this one's tokens (they are fed on the device):
        # the host's work for a step then overlaps the device's
        nxt = self._launch_ahead(chunks, members, rows) if pending is not None else None
        try:
            if pending is not None:
                outputs = pending.result()
            else:
                outputs = (self.backend.unhooked() if rerun else self.backend).forward(chunks)
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
            self.restore_costs.observe_prefill(sum(len(c.tokens) for c in chunks if c.prefill and len(c.tokens) > 1),
                                               now - t0)  # (a draft's positions are not prefill)
            if self.speculator is not None and not any(c.prefill for c in chunks):  # what a wider step costs
                self.speculator.costs.observe(sum(len(c.tokens) for c in chunks), len(chunks), now - t0)
        for chunk, seq, out in zip(chunks, members, outputs, strict=True):
            if out is _FAILED:
                continue
            try:
                self._after_forward(seq, chunk, out, now)
            except ContextPoisoned:
                raise
            except Exception as e:
                log("request_error", level="error", request_id=seq.req.request_id, error=f"{type(e).__name__}: {e}")
                self._settle(seq, Outcome.FAILED, Failed(f"{type(e).__name__}: {e}"))

    def _count_step(self) -> None:
        self.step_count += 1
        self.metrics.steps.inc()

    def _launch(self, chunks: list[SeqChunk]):
        """Count the step and submit it where the backend can run ahead. (None, rerun): the caller
        runs it with forward, unhooked when a failed submit already ran the step's fault hooks."""
        self._count_step()
        if not self.backend.runs_ahead:
            return None, False
        try:
            return self.backend.submit(chunks), False
        except ContextPoisoned:
            raise
        except Exception:
            return None, True  # forward() reruns it, and _isolate finds the culprit

    def _launch_ahead(self, chunks: list[SeqChunk], members: list[Seq], rows: list[int]) -> Ahead | None:
        admitting = bool(self.waiting or self._inbox) and len(self.running) < self.limits.max_seqs
        return self.run_ahead.launch(chunks, members, rows, self.running, admitting, self._count_step)

    def _isolate(self, chunks: list[SeqChunk], members: list[Seq]) -> list:
        """A batched step raised: rerun each chunk alone so only the culprit fails."""
        outputs: list = []
        for c, s in zip(chunks, members, strict=True):
            try:
                outputs.append(self.backend.unhooked().forward([c])[0])
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
        while self.waiting and len(self.running) < self.limits.max_seqs:
            s = self.waiting[0]
            if s.compiling is not None:
                if not self._take_grammar(s):
                    return  # still compiling: admit in order, on a later step
                continue
            prefix = self.kv.find_prefix(s)
            if prefix is None:
                if self.running:
                    return  # wait for running sequences to free blocks
                self._settle(self.waiting.popleft(), Outcome.REFUSED,
                             Failed("not enough KV cache for this prompt", status=503, kind="overloaded"))
                continue
            self.waiting.popleft()
            self.kv.take_prefix(s, prefix)
            s.last_keepalive = time.monotonic()
            self.running.append(s)
            if prefix.stored and self.kv.worth_restoring(s, prefix.stored):
                self.kv.start_restore(s, prefix)
            else:
                self._begin(s)

    def _take_grammar(self, s: Seq) -> bool:
        """Resolve the head's grammar: False while it still compiles (waiting briefly only when
        nothing runs); a grammar that does not compile fails the request with a 400."""
        fut = s.compiling
        assert fut is not None
        if not fut.done() and (self.running or not concurrent.futures.wait([fut], timeout=0.05).done):
            return False
        s.compiling = None
        try:
            s.out.constraint = constraint = fut.result()
        except GrammarError as e:
            self._settle(s, Outcome.FAILED, Failed(str(e), status=400, kind="invalid_grammar"))
            return True
        except Exception as e:  # llguidance itself failed: this request alone
            self._settle(s, Outcome.FAILED, Failed(f"the grammar could not be compiled: {type(e).__name__}: {e}"))
            return True
        constraint.prefetch()  # the first mask computes during the prefill
        return True

    def _begin(self, s: Seq) -> None:
        """Admission accounting, once the prompt's cached part (device or store) is known."""
        if s.begun:  # a preempted sequence keeps its first accounting
            return
        s.begun = True
        s.cached_tokens = s.kv.n_computed
        self.metrics.prompt_tokens.inc(s.prompt_len)
        self.metrics.cached_tokens.inc(s.cached_tokens)
        probe: dict[str, Any] = {"probe": True} if s.req.probe else {}
        log("admit", request_id=s.req.request_id, seq=s.number, protocol=s.req.protocol,
            prompt_tokens=s.prompt_len, cached_tokens=s.cached_tokens, new_tokens=s.prompt_len - s.cached_tokens,
            **probe)
        s.handle.push([Started(s.prompt_len, s.cached_tokens)])

    def prefill_chunk(self) -> int:
        """Prompt tokens a sequence may prefill in a step (see prefill_sizing and _calibrate)."""
        return self._chunk

    def _plan(self) -> tuple[list[SeqChunk], list[Seq]]:
        """The scheduler's plan for this step, its preemptions and failures applied."""
        plan = self.scheduler.plan(self.running, self.prefill_chunk())
        for s in plan.preempted:  # its blocks are back in the pool; its full ones stay in the prefix cache
            self.running.remove(s)
            self.waiting.appendleft(s)
            log("preempt", request_id=s.req.request_id, seq=s.number, tokens=len(s.tokens))
        for s in plan.failed:
            self._settle(s, Outcome.FAILED, Failed("the KV cache is full", status=503, kind="overloaded"))
        return plan.chunks, plan.members

    # -- after a step ------------------------------------------------------------------------------------

    def _after_forward(self, s: Seq, chunk: SeqChunk, logits, now: float) -> None:
        draft: list[int] = []
        if s.spec is not None and s.spec.pending:
            draft, s.spec.pending = s.spec.pending, []
        s.kv.n_computed += len(chunk.tokens) - len(draft)  # a guess's position counts once it stands
        self.kv.register_full_blocks(s)
        if self.faults:
            self.faults.check_request(s.number)
        if chunk.logits == "all" and s.out.generated == 0:
            logits = self.output.prompt_logprobs(s, chunk, logits)
        if s.kv.n_computed < len(s.tokens):  # still prefilling
            if now - s.last_keepalive >= KEEPALIVE_SECONDS:
                s.last_keepalive = now
                s.handle.push([Keepalive(s.kv.n_computed, len(s.tokens))])
            return
        self.output.prompt_done(s)
        if draft:
            end = self._verify(s, draft, logits, now)
        else:
            end = self.output.token(s, logits if isinstance(logits, SampledToken) else logits[-1], now)
        if isinstance(end, Finish):
            self._settle(s, Outcome.COMPLETED, self.output.finished(s, end))
        elif end is not None:
            self._settle(s, Outcome.FAILED, end)

    def _verify(self, s: Seq, draft: list[int], logits: np.ndarray, now: float) -> Finish | Failed | None:
        """Check a draft position by position (speculation.py): every chosen token is emitted as any
        other; each guess that stands makes its position's KV count, and the first that does not ends
        the step (the token chosen there instead is the step's last)."""
        assert self.speculator is not None and s.spec is not None
        t0 = time.monotonic()
        accepted, end = 0, None
        for i in range(len(draft) + 1):
            end, stood = self.output.verify(s, logits[i], draft[i] if i < len(draft) else None, now)
            if end is not None or not stood:
                break
            accepted += 1
            s.kv.n_computed += 1
        self.kv.register_full_blocks(s)
        self.speculator.record(s.spec, len(draft), accepted)
        m = self.metrics
        m.spec_drafted.inc(len(draft))
        m.spec_accepted.inc(accepted)
        m.spec_steps.inc()
        m.spec_seconds.labels("verify").inc(time.monotonic() - t0)
        m.spec_seconds.labels("draft").inc(self.speculator.take_draft_seconds())
        return end

    def _settle(self, s: Seq, outcome: Outcome, event) -> None:
        """The one place a request ends: free its blocks, send its last event, log its outcome."""
        if s in self.running:
            self.kv.finished(s)  # its last full blocks copied off before the pool may hand them out again
            self.running.remove(s)
        if s.spec is not None and self.speculator is not None:
            self.speculator.release(s.spec)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.kv.free(s)
        if event is None:
            event = Failed("the client went away", status=499, kind="canceled")
        self.metrics.outcomes.labels(outcome.value).inc()
        fields = dict(request_id=s.req.request_id, seq=s.number, protocol=s.req.protocol, prompt_tokens=s.prompt_len,
                      cached_tokens=s.cached_tokens, completion_tokens=s.out.generated,
                      seconds=round(time.monotonic() - s.arrived, 3))
        if s.req.probe:
            fields["probe"] = True
        if s.spec is not None and s.spec.steps:
            fields.update(spec_drafted=s.spec.drafted, spec_accepted=s.spec.accepted,
                          spec_tokens_per_step=round((s.spec.accepted + s.spec.steps) / s.spec.steps, 2))
        if isinstance(event, Finished):
            fields["finish_reason"] = event.reason.value
            if self.speculator is not None:
                self.speculator.finished(s.tokens, s.prompt_len)  # a later turn may quote this output
        elif outcome is not Outcome.CANCELED:
            fields["error"] = event.message
        else:
            fields["phase"] = "decode" if s.out.generated else ("prefill" if s.kv.n_computed else "queued")
        log(outcome.value, level="error" if outcome is Outcome.FAILED else "info", **fields)
        s.handle.push([event])  # last: whoever sees the end also sees the counters and the log line

    def _poison(self, e: ContextPoisoned) -> None:
        self.poisoned = e
        self.accepting = False
        log("engine_poisoned", level="error", code=e.code, name=e.name, message=e.message, step=self.step_count,
            running=[s.req.request_id for s in self.running])
        for s in list(self.running) + list(self.waiting):
            self.running.remove(s) if s in self.running else self.waiting.remove(s)
            s.kv.blocks = []  # the device memory is gone; nothing to release into
            s.handle.push([Failed(f"the engine's compute context failed ({e.name}); the worker is restarting",
                                  status=503, kind="service_unavailable")])  # as the door answers, not overloaded
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
