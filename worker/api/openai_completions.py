"""OpenAI legacy completions: POST /v1/completions, streaming and not.

prompt: a string, a list of one string, a list of token ids, or a list of one list of token ids
(a batch of several prompts is refused: 400 naming `prompt`). String prompts are tokenized with
BOS (once) and special tokens parsed, like llama-server; token-id prompts are used as given.
logprobs: k (0..20) gives the legacy {tokens, token_logprobs, top_logprobs, text_offset} object;
echo puts the prompt in front of the text and, with logprobs, the prompt tokens' logprobs too
(the first token has none). max_tokens defaults to 16 as in the legacy API; 0 is allowed (with
echo: score a prompt without generating).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from ..engine.requests import Delta, Finished, GenerationRequest, PromptLogprobs, Started, TokenLogprob
from . import common
from .adapter import ProtocolAdapter, Submitted
from .common import ApiContext, Collected, bad_request
from .openai_chat import StreamOptions, Usage, finish_reason, usage
from .sse import frame
from .stream_base import StreamRenderer, openai_error_frames, openai_stream_end

PROTOCOL = "completions"
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(common.SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    model: str = ""
    stream: bool | None = None  # null as false, as the OpenAI API documents it
    stream_options: StreamOptions | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    stop: str | list[str] | None = None
    n: int | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class LegacyLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    text: str
    index: int
    logprobs: LegacyLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class _NullUsageCompletion(Completion, omit_defaults=False):
    """A chunk with `"usage": null`, as the API sends when include_usage is on."""


class Prompt(msgspec.Struct):
    ids: list[int]
    text: str  # what echo prints ("" for token ids without echo)


async def prompt_of(ctx: ApiContext, p: Any, echo: bool = True) -> Prompt:
    """The prompt's ids, and its text where echo prints it: decoding a long token-id prompt costs the
    interpreter milliseconds an agent's every request would pay for nothing."""

    async def text_of(ids: list[int]) -> str:
        return await asyncio.to_thread(ctx.tokenizer.decode, ids) if echo else ""

    if isinstance(p, str):
        return Prompt(await common.text_prompt(ctx, p), p)
    if not p:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        ids = await common.token_prompt(ctx, list(p), "prompt")
        return Prompt(ids, await text_of(ids))
    if len(p) > 1:
        raise bad_request(f"prompt holds {len(p)} prompts; this worker takes one prompt per request",
                          param="prompt", code="unsupported_value")
    one = p[0]
    if isinstance(one, str):
        return Prompt(await common.text_prompt(ctx, one), one)
    if isinstance(one, list):
        ids = await common.token_prompt(ctx, list(one), "prompt[0]")
        return Prompt(ids, await text_of(ids))
    raise bad_request("prompt must be a string, a list of token ids, or a list holding one of them", param="prompt")


class Plan(msgspec.Struct):
    """What the adapter must remember about a request to render its result."""

    prompt: Prompt
    echo: bool
    logprobs: int | None
    zero: bool  # max_tokens=0: run the prompt only, report no generated text


async def to_generation(ctx: ApiContext, body: CompletionRequest, request_id: str) -> tuple[GenerationRequest, Plan]:
    if body.n not in (None, 1):
        raise bad_request(f"n must be 1 (got {body.n}): this worker returns one choice per request", param="n",
                          code="unsupported_value")
    if body.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1 (got {body.best_of})", param="best_of", code="unsupported_value")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported_parameter")
    common.check_logprobs(body.logprobs, "logprobs")
    params = common.sampling_params(
        ctx, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, logit_bias=body.logit_bias)
    stop = common.stop_list(ctx, body.stop)
    prompt = await prompt_of(ctx, body.prompt, echo=bool(body.echo))
    zero = body.max_tokens == 0
    max_tokens = 1 if zero else common.output_tokens(ctx, body.max_tokens, len(prompt.ids), "max_tokens")
    want_prompt_lp = body.echo and body.logprobs is not None
    req = GenerationRequest(request_id, prompt.ids, params, max_tokens, stop=stop, logprobs=body.logprobs,
                            prompt_logprobs=want_prompt_lp, protocol=PROTOCOL)
    return req, Plan(prompt, body.echo, body.logprobs, zero)


# -- legacy logprobs -----------------------------------------------------------------------------------------


class LogprobBuilder:
    """Accumulates the legacy logprobs object; text_offset counts characters of the returned text."""

    def __init__(self, ctx: ApiContext, offset: int = 0):
        self.ctx, self.offset = ctx, offset

    def build(self, tokens: list[int], entries: list[TokenLogprob | None]) -> LegacyLogprobs:
        out = LegacyLogprobs([], [], [], [])
        tok = self.ctx.tokenizer
        for t, lp in zip(tokens, entries, strict=False):
            out.tokens.append(common.token_str(self.ctx, t))
            out.text_offset.append(self.offset)
            self.offset += len(tok.decode([t]))
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(lp.logprob)
                top: dict[str, float] = {}
                for i, v in lp.top:
                    top.setdefault(common.token_str(self.ctx, i), v)
                out.top_logprobs.append(top)
        return out


def _concat(a: LegacyLogprobs, b: LegacyLogprobs) -> LegacyLogprobs:
    return LegacyLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs, a.top_logprobs + b.top_logprobs,
                          a.text_offset + b.text_offset)


def completion(ctx: ApiContext, request_id: str, created: int, plan: Plan, c: Collected) -> Completion:
    f = c.finished
    assert f is not None
    text = "" if plan.zero else c.text
    lps = None
    if plan.logprobs is not None:
        b = LogprobBuilder(ctx)
        lps = LegacyLogprobs([], [], [], [])
        if plan.echo:
            lps = b.build(plan.prompt.ids, list(c.prompt_logprobs or [None] * len(plan.prompt.ids)))
            b.offset = len(plan.prompt.text)
        if not plan.zero:
            lps = _concat(lps, b.build(c.tokens, list(c.logprobs)))
    if plan.echo:
        text = plan.prompt.text + text
    u = usage(f)
    reason = finish_reason(f)
    if plan.zero:
        u.completion_tokens, u.total_tokens, reason = 0, u.prompt_tokens, "length"
    return Completion(request_id, "text_completion", created, ctx.model_name, ctx.fingerprint,
                      [CompletionChoice(text, 0, lps, reason)], u)


class CompletionStream(StreamRenderer):
    error_frames = staticmethod(openai_error_frames)

    def __init__(self, ctx: ApiContext, request_id: str, created: int, plan: Plan, include_usage: bool):
        self.ctx, self.id, self.created, self.plan = ctx, request_id, created, plan
        self.include_usage = include_usage
        self.echoed = not plan.echo
        self.lp = LogprobBuilder(ctx)

    def _chunk(self, text: str, lps: LegacyLogprobs | None, finish: str | None) -> bytes:
        cls = _NullUsageCompletion if self.include_usage else Completion
        return frame(cls(self.id, "text_completion", self.created, self.ctx.model_name, self.ctx.fingerprint,
                         [CompletionChoice(text, 0, lps, finish)]))

    def _echo(self, entries: list[TokenLogprob | None] | None) -> list[bytes]:
        self.echoed = True
        lps = None
        if self.plan.logprobs is not None:
            ids = self.plan.prompt.ids
            lps = self.lp.build(ids, list(entries or [None] * len(ids)))
        self.lp.offset = len(self.plan.prompt.text)
        return [self._chunk(self.plan.prompt.text, lps, None)]

    def prompt_logprobs(self, e: PromptLogprobs) -> list[bytes]:
        return [] if self.echoed else self._echo(e.entries)

    def started(self, e: Started) -> list[bytes]:
        # with prompt logprobs the echo waits for them (they come before the first token)
        if not self.echoed and self.plan.logprobs is None:
            return self._echo(None)
        return []

    def delta(self, e: Delta) -> list[bytes]:
        out = [] if self.echoed else self._echo(None)
        if self.plan.zero:
            return out
        lps = self.lp.build(e.tokens, list(e.logprobs)) if self.plan.logprobs is not None and e.logprobs else None
        if e.text or lps is not None:
            out.append(self._chunk(e.text, lps, None))
        return out

    def finished(self, e: Finished) -> list[bytes]:
        out = [] if self.echoed else self._echo(None)
        u = usage(e)
        reason = finish_reason(e)
        if self.plan.zero:
            u.completion_tokens, u.total_tokens, reason = 0, u.prompt_tokens, "length"
        out.append(self._chunk("", None, reason))
        usage_chunk = Completion(self.id, "text_completion", self.created, self.ctx.model_name, self.ctx.fingerprint,
                                 [], u)
        return out + openai_stream_end(usage_chunk if self.include_usage else None)


class Completions(ProtocolAdapter):
    path = "/v1/completions"
    summary = "OpenAI (legacy) completions"
    body_type = CompletionRequest
    id_prefix = "cmpl-"
    protocol = PROTOCOL
    prompt_param = "prompt"
    reads_probe = True

    async def to_generation(self, ctx: ApiContext, body: CompletionRequest,
                            request_id: str) -> tuple[GenerationRequest, Plan]:
        return await to_generation(ctx, body, request_id)

    def renderer(self, s: Submitted) -> CompletionStream:
        include = bool(s.body.stream_options and s.body.stream_options.include_usage)
        return CompletionStream(s.ctx, s.request_id, s.created, s.notes, include)

    def response(self, s: Submitted, result: Collected) -> Completion:
        return completion(s.ctx, s.request_id, s.created, s.notes, result)
