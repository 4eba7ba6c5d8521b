"""The engine loop: continuous batching with chunked prefill and a prefix cache.

One thread owns the backend, and each of its steps reads as vLLM's EngineCore.step: plan, execute,
settle. Plan: take cancellations and new requests, admit waiting ones while there are sequence slots
and KV blocks, and apply the plan the scheduler returns (scheduler.py: decode tokens, prefill
chunks, preemptions), unless a decode step launched before the last one's tokens were read is
already running (run_ahead.py). Execute: run the backend once (a batched step that raises is run
again chunk by chunk: isolation.py). Settle: hand each sequence's output to the output processor
(output.py) and settle the requests it ends. KV blocks, prefix matching and the KV store are the KV
manager's (kv_manager.py); the requests' queues are queues.py's; what steps cost is sampled by
cost_sampling.py; injected step faults wrap the backend (backends/faults.FaultyBackend).

Every request settles exactly once (completed, failed, canceled or refused) with one log line.
A failure inside one request fails that request alone; a poisoned compute context stops the
engine and hands control to `on_poisoned` (the server exits with code 75). The frontend knows the
engine by the stats it publishes (stats.py), never by its queues.

The loop runs on a guarded thread (worker/threads.py): if it dies, every request in flight fails
with a 503 at once, new ones are refused, and /health/live names the thread.

Three guards act on each sampled token: a request's grammar (constraints.py: the mask is computed
while the backend step runs and applied before sampling), its reasoning budget (the engine closes
the reasoning block itself), and the loop guard (a repeating n-gram ends the generation).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ember.ops.contract import ADMIT_CLIENT_FIELD, Event

from ..backends.base import Backend, ContextPoisoned, Failure, SampledToken, SeqChunk, attempt
from ..backends.faults import FaultInjector, FaultyBackend
from ..logs import log
from ..metrics import Metrics
from ..model.loader import Model
from ..text.tokenizer import IncrementalDecoder
from ..threads import ThreadWatch
from .constraints import Constraints, GrammarError
from .cost_sampling import CostSampler
from .isolation import FAILED, alone, rerun_alone
from .kv_blocks import BlockPool, kv_salt
from .kv_manager import KVManager
from .limits import EngineLimits
from .loopguard import LoopGuard
from .misses import MissExplainer
from .output import Finish, OutputProcessor
from .prefill_sizing import PrefillSizing
from .queues import RequestQueues
from .reasoning_budget import ReasoningTracker
from .requests import (
    Failed,
    Finished,
    Keepalive,
    NotAccepting,
    Outcome,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    Started,
)
from .restore_policy import RestoreCosts
from .run_ahead import Ahead, RunAhead
from .sampling import Sampler
from .scheduler import Scheduler
from .sequence import OutputState, Seq
from .spec.speculation import Speculator
from .stats import EngineStats, Poison
from .step_costs import UNITS, PrefillCost
from .textstream import StopMatcher

KEEPALIVE_SECONDS = 5.0


@dataclass
class StepWork:
    """One backend step, planned or launched ahead: chunks[i] is members[i]'s."""

    chunks: list[SeqChunk]
    members: list[Seq]
    rows: list[int]  # chunk i's row in the step the backend runs (a step run ahead may have dropped some)
    pending: Any = None  # submitted: its result() is the outputs; None: forward() runs it
    rerun: bool = False  # its fault hooks already ran (a submit that failed): forward it unhooked
    started: float | None = None  # a planned step's start: its time is a cost sample (one run ahead overlaps)


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
        """drafter: a drafter built by the caller (spec/draft_model.ModelDrafter for --spec draft:PATH)."""
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
        self.queues = RequestQueues()  # inbox, waiting and running: one owner, one remove()
        self.accepting = True
        self.poisoned: ContextPoisoned | None = None
        self.dead: str | None = None  # why the loop thread died
        self.step_count = 0
        self.last_progress = time.monotonic()  # heartbeat for hang detection
        self._arrivals = 0
        self._stop = False
        self.restore_costs = RestoreCosts()  # measured rates: restore or recompute
        self._sizing = PrefillSizing(limits.prefill_chunk, limits.itl_target_s)
        self.speculator = (Speculator(drafter or limits.spec, limits.spec_k, limits.spec_max_batch,
                                      limits.spec_max_context) if limits.spec != "off" else None)
        # reads the last process's rates; counts the steps decoding streams wait on against the target
        self.costs = CostSampler(self.restore_costs, self.speculator, store, limits.itl_target_s, self.metrics)
        self.kv = KVManager(self.pool, backend, store, self.metrics, self.restore_costs)
        self.misses = MissExplainer(self.pool, store, model.tokenizer)  # the admit line's account of a miss
        self.output = OutputProcessor(model.tokenizer, backend, limits.context, self.metrics)
        self.scheduler = Scheduler(self.kv, self.output, limits.max_step_tokens, self._sizing,
                                   speculator=self.speculator)
        self.run_ahead = RunAhead(backend, self.kv, self.output, limits.context)
        self.constraints = Constraints(model.tokenizer, model.config.vocab_size, watch=self.watch)
        self._stats = EngineStats(last_progress=self.last_progress, kv_blocks=self.pool.n_blocks)
        self._thread = self.watch.thread("ember-engine", self._run, on_death=self._died, stopping=lambda: self._stop)
        self.faults.arm_threads(self.watch)

    # -- HTTP side -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._calibrate()
        self._thread.start()

    def _calibrate(self) -> None:
        """Auto prefill chunks: time a few steps before serving (prefill_sizing.calibrate), the start of
        the step cost model that sizes each step's prefill to the decode-latency target; every planned
        step refines it (cost_sampling.py). The restore decisions start from the same figures."""
        cost = self._sizing.calibrate(self.backend.unhooked(), self.pool, self.limits.context)
        if cost is None or cost.coefficients is None:
            return
        self.costs.step_cost = cost  # every planned step refines it, and the scheduler sizes prefills by it
        fixed, per_token, per_key, per_pair = (cost.coefficients / UNITS).tolist()
        if self.restore_costs.prefill.model is None:
            self.restore_costs.prefill = PrefillCost(fixed, per_token)
        log("prefill_sizing", itl_target_ms=round((self.limits.itl_target_s or 0) * 1000, 1),
            most_tokens=self._sizing.most, fixed_ms=round(fixed * 1000, 3), per_token_us=round(per_token * 1e6, 3),
            per_key_ns=round(per_key * 1e9, 3), per_pair_ps=round(per_pair * 1e12, 3))

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
        with self.queues.lock:
            if self.dead is not None:
                raise NotAccepting(f"the engine loop thread died ({self.dead}); the worker is restarting")
            if self.queues.depth >= self.limits.max_queue:
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
            self.queues.put(seq)
            self.metrics.started.inc()
            # the engine is busy from now on, also to a reader that comes before the loop wakes
            self._stats = msgspec.structs.replace(self._stats, queued=self.queues.depth, busy=True)

    def _loop_guard(self) -> LoopGuard | None:
        lim = self.limits
        if not lim.loop_guard:
            return None
        return LoopGuard(max_period=lim.loop_guard_period, repeats=lim.loop_guard_repeats,
                         min_span=lim.loop_guard_min_span)

    @property
    def stats(self) -> EngineStats:
        """The engine as of its last step (stats.py): what the frontend reads, from any thread."""
        return self._stats

    @property
    def busy(self) -> bool:
        """Anything running, waiting or submitted, now (the engine thread's own view; others read stats)."""
        return self.queues.busy

    @property
    def running(self) -> list[Seq]:  # the engine thread's: others read stats
        return self.queues.running

    def stop_accepting(self) -> None:
        self.accepting = False

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self.queues.wake()
        self.faults.stop_hang.set()
        if self._thread.ident is not None:  # (start() may have failed before the thread began)
            self._thread.join(timeout)
        self.constraints.shutdown()

    @property
    def ahead_steps(self) -> int:  # run-ahead steps launched
        return self.run_ahead.steps

    @property
    def ahead_rows_dropped(self) -> int:  # rows of run-ahead steps recomputed
        return self.run_ahead.rows_dropped

    # -- the loop --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while self.queues.wait_for_work(lambda: self._stop, self._heartbeat):
            if self.watch.doomed:  # fault injection (thread-die:thread=engine)
                self.watch.checkpoint()
            try:
                self.step()
            except ContextPoisoned as e:
                self._poison(e)
                return
            except Exception as e:  # a bug in the loop itself: fail what is in flight, keep serving
                log("engine_error", level="error", error=f"{type(e).__name__}: {e}")
                self._drop_ahead()
                for s in self.queues.in_flight():
                    self._settle(s, Outcome.FAILED, Failed(f"internal error: {type(e).__name__}"))
                self.queues.clear()
            self.last_progress = time.monotonic()
            self._update_gauges()
            self._publish()
            self.costs.save_due(self.last_progress)
        self._drop_ahead()
        self.costs.save()
        self.queues.take_inbox()
        for s in self.queues.in_flight():
            self._settle(s, Outcome.CANCELED, Failed("the worker is shutting down", status=503, kind="overloaded"))
        self._publish()

    def step(self) -> None:
        """One engine step: plan, execute, settle (the step's full blocks go to the KV store either way)."""
        try:
            work = self._plan()
            if work is not None:
                self._settle_step(work, self._execute(work))
        finally:
            self.kv.flush_offers(poisoned=self.poisoned is not None)

    def _heartbeat(self) -> None:  # the idle loop's turn (the queues' lock held)
        self.last_progress = time.monotonic()
        self._publish(locked=True)

    def _died(self, e: BaseException) -> None:
        """The loop thread is dying (still on it): refuse new requests and fail those in flight with
        a 503, so no client waits on a loop that is gone."""
        with self.queues.lock:
            self.dead = f"{type(e).__name__}: {e}"
            self.accepting = False
        self.queues.take_inbox()
        failed = Failed("the worker's engine loop failed; the worker is restarting", status=503, kind="overloaded")
        for s in self.queues.in_flight():
            try:
                self._settle(s, Outcome.FAILED, failed)
            except Exception:  # the state it would clean up may be what broke: the client hears anyway
                s.handle.push([failed])
        self.queues.clear()
        with contextlib.suppress(Exception):
            self._update_gauges()
            self._publish()

    def _drop_ahead(self) -> None:
        """Wait for a run-ahead step still in flight and forget it (its rows are not wanted)."""
        try:
            self.run_ahead.drop()
        except ContextPoisoned as e:
            self._poison(e)
            self._stop = True  # nothing more can run in this process

    # -- plan -------------------------------------------------------------------------------------------

    def _plan(self) -> StepWork | None:
        """Requests in and out of the batch (cancellations, admissions, finished restores), then this
        step: the one launched ahead during the last step (its rows whose sequence moved on dropped), or
        the scheduler's plan, launched. None: nothing to run."""
        self._reap_cancelled()
        self._admit()
        for s in self.kv.progress_restores(self.running):
            self._begin(s)
        ahead = self.run_ahead.take(self.running)
        if ahead is not None:
            chunks, members, rows, pending = ahead
            return StepWork(chunks, members, rows, pending)
        if not self.running:
            return None
        plan = self.scheduler.plan(self.running, self.costs.step_cost)
        for s in plan.preempted:  # its blocks are back in the pool; its full ones stay in the prefix cache
            self.queues.requeue(s)
            log(Event.PREEMPT, request_id=s.req.request_id, seq=s.number, tokens=len(s.tokens))
        for s in plan.failed:
            self._settle(s, Outcome.FAILED, Failed("the KV cache is full", status=503, kind="overloaded"))
        if not plan.chunks:
            return None
        work = StepWork(plan.chunks, plan.members, list(range(len(plan.chunks))), started=time.monotonic())
        self._launch(work)
        return work

    def _launch(self, work: StepWork) -> None:
        """Count the step and submit it where the backend can run ahead; else forward() runs it in
        _execute (unhooked when a submit that failed already ran the step's fault hooks)."""
        self._count_step()
        if self.backend.runs_ahead:
            pending = attempt(self.backend.submit, work.chunks)
            work.pending, work.rerun = (None, True) if isinstance(pending, Failure) else (pending, False)

    def _count_step(self) -> None:
        self.step_count += 1
        self.metrics.steps.inc()

    def _reap_cancelled(self) -> None:
        for s in [s for s in self.queues.in_flight() if s.handle.cancelled.is_set()]:
            self._settle(s, Outcome.CANCELED, None)

    def _admit(self) -> None:
        waiting = self.queues.waiting
        while waiting and len(self.running) < self.limits.max_seqs:
            s = waiting[0]
            if s.compiling is not None:
                if not self._take_grammar(s):
                    return  # still compiling: admit in order, on a later step
                continue
            prefix = self.kv.find_prefix(s)
            if prefix is None:
                if self.running:
                    return  # wait for running sequences to free blocks
                self._settle(s, Outcome.REFUSED,
                             Failed("not enough KV cache for this prompt", status=503, kind="overloaded"))
                continue
            self.queues.admit(s)
            self.kv.take_prefix(s, prefix)
            s.last_keepalive = time.monotonic()
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
        extra: dict[str, Any] = {"probe": True} if s.req.probe else {}
        if s.req.user_agent:
            extra[ADMIT_CLIENT_FIELD] = s.req.user_agent
        miss = self.misses.explain(s)
        if miss is not None:
            extra.update(miss.fields())
        log(Event.ADMIT, request_id=s.req.request_id, seq=s.number, protocol=s.req.protocol,
            prompt_tokens=s.prompt_len, cached_tokens=s.cached_tokens, new_tokens=s.prompt_len - s.cached_tokens,
            **extra)
        s.handle.push([Started(s.prompt_len, s.cached_tokens)])

    # -- execute ----------------------------------------------------------------------------------------

    def _execute(self, work: StepWork) -> list:
        """The step's outputs, one a chunk (FAILED where its request failed). Where the backend runs
        ahead, the next decode step is launched before this one's tokens are read (they are fed on the
        device): the host's work for a step then overlaps the device's."""
        nxt = self._launch_ahead(work) if work.pending is not None else None
        if work.pending is not None:
            outputs = attempt(work.pending.result)
        else:
            outputs = attempt((self.backend.unhooked() if work.rerun else self.backend).forward, work.chunks)
        if isinstance(outputs, Failure):  # rerun each chunk alone so only the culprit fails
            if nxt is not None:  # it was fed from this step's draws
                nxt.discard()
                nxt = None
            outputs = rerun_alone(self.backend, work.chunks, work.members, self._fail)
        if nxt is not None:
            nxt.fed_from(outputs)
        self.run_ahead.inflight = nxt
        return outputs

    def _launch_ahead(self, work: StepWork) -> Ahead | None:
        admitting = self.queues.depth > 0 and len(self.running) < self.limits.max_seqs
        return self.run_ahead.launch(work.chunks, work.members, work.rows, self.running, admitting, self._count_step)

    # -- settle -----------------------------------------------------------------------------------------

    def _settle_step(self, work: StepWork, outputs: list) -> None:
        now = time.monotonic()
        if work.started is not None:
            self.costs.observe(work.chunks, now - work.started, now)
        for chunk, seq, out in zip(work.chunks, work.members, outputs, strict=True):
            if out is not FAILED:
                alone(seq, self._fail, self._after_forward, seq, chunk, out, now)

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
        """Check a draft position by position (spec/speculation.py): every chosen token is emitted as any
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

    def _fail(self, s: Seq, e: Exception) -> None:
        """A request's own work raised: it fails alone."""
        log("request_error", level="error", request_id=s.req.request_id, error=f"{type(e).__name__}: {e}")
        self._settle(s, Outcome.FAILED, Failed(f"{type(e).__name__}: {e}"))

    def _settle(self, s: Seq, outcome: Outcome, event) -> None:
        """The one place a request ends: out of its queue, its blocks freed, its last event sent and its
        outcome logged."""
        if s in self.running:
            self.kv.finished(s)  # its last full blocks copied off before the pool may hand them out again
        self.queues.remove(s)
        if s.spec is not None and self.speculator is not None:
            self.speculator.release(s.spec)
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
        self.misses.record(s)  # its chain, for explaining a later turn's miss
        s.handle.push([event])  # last: whoever sees the end also sees the counters and the log line

    def _poison(self, e: ContextPoisoned) -> None:
        self.poisoned = e
        self.accepting = False
        log(Event.ENGINE_POISONED, level="error", code=e.code, name=e.name, message=e.message, step=self.step_count,
            running=[s.req.request_id for s in self.running])
        self._publish()  # before any request hears of it: a client given the 503 then finds /health/live poisoned
        for s in self.queues.in_flight():
            self.queues.remove(s)
            s.kv.blocks = []  # the device memory is gone; nothing to release into
            s.handle.push([Failed(f"the engine's compute context failed ({e.name}); the worker is restarting",
                                  status=503, kind="service_unavailable")])  # as the door answers, not overloaded
            self.metrics.outcomes.labels(Outcome.FAILED.value).inc()
            log(Outcome.FAILED.value, level="error", request_id=s.req.request_id, seq=s.number, error=str(e))
        self._publish()
        if self.on_poisoned:
            self.on_poisoned(e)

    # -- what the engine publishes ------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(self.queues.depth)
        m.running.set(len(self.running))
        m.kv_blocks_used.set(self.pool.in_use)
        m.kv_blocks_cached.set(self.pool.cached_count)
        m.kv_usage.set(self.pool.in_use / max(self.pool.n_blocks, 1))

    def _publish(self, locked: bool = False) -> None:
        """Swap in the stats as the engine is now (engine thread). Under the queues' lock, so that a
        submit's `busy` is never overwritten by a picture taken before it."""
        with contextlib.nullcontext() if locked else self.queues.lock:
            q, pool, p = self.queues, self.pool, self.poisoned
            self._stats = EngineStats(
                last_progress=self.last_progress, running=len(q.running), waiting=len(q.waiting), queued=q.depth,
                busy=q.busy, steps=self.step_count, kv_blocks=pool.n_blocks, kv_blocks_used=pool.in_use,
                kv_blocks_cached=pool.cached_count, poisoned=None if p is None else Poison(p.code, p.name, p.message),
                dead=self.dead)
