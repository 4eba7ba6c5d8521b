"""The output processor: sampled tokens become text deltas, stop strings and finish reasons.

It chooses each token (a forced reasoning-block marker, a draw the device made, or a sample under
the grammar's mask), feeds it to the detokenizer, stop matcher, reasoning budget and loop guard,
pushes the client's deltas, and answers with data: None (go on), a `Finish` or a `Failed`. It
never touches KV blocks or queues; settling a request is the engine loop's job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..backends.base import Backend, DeviceSample, SampledToken, SeqChunk
from ..logs import log
from ..metrics import Metrics
from .constraints import ConstraintError
from .requests import Delta, Failed, Finished, FinishReason, PromptLogprobs, TokenLogprob
from .sampling import log_softmax
from .sequence import Seq


@dataclass(frozen=True)
class Finish:
    """The generation is over: why, and the stop string that ended it (if one did)."""

    reason: FinishReason
    stop: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer, backend: Backend, context: int, metrics: Metrics):
        self.tokenizer, self.backend, self.context, self.metrics = tokenizer, backend, context, metrics

    def device_sample(self, s: Seq, ahead: int = 0) -> DeviceSample | None:
        """Let a backend that samples on the device (CUDA) draw this token where the logits are,
        unless the request needs them on the host: a grammar mask, penalties, logit_bias or logprobs.
        ahead: the draw is that many tokens past what the sequence has generated (a run-ahead step)."""
        o = s.out
        if not self.backend.samples_on_device or o.constraint or s.req.logprobs is not None:
            return None
        p = s.req.params
        if p.on_host:  # penalties or logit_bias
            return None
        if o.device_seed is None:  # a seeded request repeats; others draw from fresh entropy
            o.device_seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        temp = 0.0 if p.greedy else p.temperature
        return DeviceSample(temp, p.top_k, p.top_p, p.min_p, o.device_seed, o.generated + ahead)

    def prompt_logprobs(self, s: Seq, chunk: SeqChunk, logits: np.ndarray) -> np.ndarray:
        """Record the prompt's logprobs from a chunk's "all" logits; returns its last row."""
        lp = log_softmax(logits)
        for j in range(len(chunk.tokens)):
            p = chunk.start + j
            if p == 0:
                s.out.prompt_lp.append(None)
            if p + 1 < s.prompt_len:
                nxt = s.tokens[p + 1]
                s.out.prompt_lp.append(token_logprob(lp[j], nxt, s.req.logprobs or 0))
        return logits[-1:]

    def prompt_done(self, s: Seq) -> None:
        if s.out.generated == 0 and s.req.prompt_logprobs:
            s.handle.push([PromptLogprobs(s.out.prompt_lp)])

    def token(self, s: Seq, logits, now: float) -> Finish | Failed | None:
        """Choose and emit the next token from its logits (or the device's draw)."""
        o = s.out
        if o.generated == 0:
            self.metrics.ttft.observe(now - s.arrived)
        else:
            self.metrics.itl.observe(now - o.last_token_at)
        o.last_token_at = now
        try:
            token = self._choose(s, logits)
            return self._emit(s, token, logits)
        except ConstraintError as e:
            return self._grammar_failed(s, e)

    def verify(self, s: Seq, logits, draft: int | None, now: float) -> tuple[Finish | Failed | None, bool]:
        """One position of a step that carried a draft: choose and emit its token as `token` does, and
        say whether it is the draft's guess (the draft's next position then stands). draft None: the
        position after the draft, an ordinary token."""
        if draft is None:
            return self.token(s, logits, now), False
        o = s.out
        self.metrics.itl.observe(now - o.last_token_at)
        o.last_token_at = now
        try:
            token = self._choose(s, logits, draft)
            return self._emit(s, token, logits), token == draft
        except ConstraintError as e:
            return self._grammar_failed(s, e), False

    def _choose(self, s: Seq, logits, draft: int | None = None) -> int:
        """The next token: the reasoning block's closing marker once its budget is spent, else a
        sample under the grammar's mask."""
        o = s.out
        r = o.reasoning
        forced = r.forced_token() if r else None
        if forced is not None and o.decoder.pending and o.constraint is not None and o.constraint.bias()[forced] < 0:
            # the block's text stopped inside a character of several bytes, where the grammar takes no
            # marker: sample its last bytes under the mask first (at most three steps), then close
            forced = None
        if r is not None and forced is not None:
            if r.forced == 0:
                log("reasoning_budget", request_id=s.req.request_id, seq=s.number, budget=r.budget)
            r.forced += 1
            return forced
        if isinstance(logits, SampledToken):  # drawn on the device (see device_sample)
            return int(logits)
        bias = o.constraint.bias() if o.constraint else None
        if draft is not None:  # a grammar-forbidden guess has probability 0: rejected like any other
            return o.sampler.verify(logits, s.tokens, bias, draft)[0]
        return o.sampler.sample(logits, s.tokens, bias)

    def _emit(self, s: Seq, token: int, logits) -> Finish | None:
        req, o = s.req, s.out
        is_end = not req.ignore_eos and (token in self.tokenizer.eot_ids or token in req.stop_token_ids)
        if is_end:
            return Finish(FinishReason.STOP)
        if o.constraint:  # before anything is sent: a token the grammar refuses never reaches the client
            o.constraint.consume(token)
        s.tokens.append(token)
        o.generated += 1
        self.metrics.generated_tokens.inc()
        if o.reasoning:
            o.reasoning.feed(token)
        looped = o.guard.feed(token) if o.guard else False
        text, stop = o.stopper.feed(o.decoder.feed(token))
        lps = None
        if req.logprobs is not None:
            lps = [token_logprob(log_softmax(logits), token, req.logprobs)]
        if text or lps or stop is None:
            s.handle.push([Delta(text, [token], lps)])
        if stop is not None:
            return Finish(FinishReason.STOP, stop)
        if o.constraint and o.constraint.stopped:
            return Finish(FinishReason.STOP)  # the grammar is complete
        if o.generated >= req.max_tokens or len(s.tokens) >= self.context:
            return Finish(FinishReason.LENGTH)
        if looped and o.guard is not None:
            period = o.guard.period
            log("loop_guard", request_id=req.request_id, seq=s.number, period=period,
                repeats=o.guard.repeats_for(period) if period is not None else None)
            return Finish(FinishReason.LENGTH)
        if o.constraint:
            o.constraint.prefetch()  # computes while the next backend step runs
        return None

    def _grammar_failed(self, s: Seq, e: ConstraintError) -> Failed:
        forced = s.out.reasoning is not None and s.out.reasoning.forced_token() is not None
        what = "the reasoning block's end marker is not allowed by the grammar" if forced else "the grammar failed"
        # llguidance's errors can carry a panic's backtrace: the log keeps it, the client gets line one
        log("request_error", level="error", request_id=s.req.request_id, error=f"grammar: {e}")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Failed(f"structured output: {what}: {first[:300]}", status=500, kind="server_error")

    def finished(self, s: Seq, end: Finish) -> Finished:
        """The last event of a completed generation, after releasing any held-back text."""
        reason, stop = end.reason, end.stop
        o = s.out
        if stop is None:  # release held-back text; the decoder's last bytes still pass the stop matcher
            text, stop = o.stopper.feed(o.decoder.flush())
            tail = text if stop is not None else text + o.stopper.flush()
            if stop is not None:
                reason = FinishReason.STOP
            if tail:
                s.handle.push([Delta(tail, [])])
        return Finished(reason, s.prompt_len, s.cached_tokens, o.generated, stop)


def token_logprob(lp: np.ndarray, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = [(int(i), float(lp[i])) for i in idx]
    return TokenLogprob(int(token), float(lp[token]), top)
