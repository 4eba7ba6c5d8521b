"""What the four protocol adapters share: body decoding, sampling parameters, submission to the
engine (with its refusals mapped to HTTP), and collecting a non-streaming result while watching
for the client to go away."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from ember.ops.contract import HealthState

from ..engine.requests import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    NotAccepting,
    Outcome,
    PromptLogprobs,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    Started,
    TokenLogprob,
)
from ..engine.sampling import SamplingParams
from ..logs import log
from ..text.formats import ModelFormats
from ..text.tokenizer import TooManyTokens
from .errors import ApiError, bad_request, from_validation
from .limits import RequestLimits, finite
from .state import ServerState

if TYPE_CHECKING:
    from ..engine.loop import Engine
    from ..model.loader import Model
    from ..text.tokenizer import Tokenizer


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling knobs every generation request accepts (OpenAI names; top_k, min_p and
    repetition_penalty are extensions that llama.cpp and vLLM clients also send)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

T = TypeVar("T")

RETRY_AFTER_BUSY = 1  # seconds, 429: the queue is full
RETRY_AFTER_UNAVAILABLE = 5  # seconds, 503: loading, draining or restarting
MAX_LOGPROBS = 20
OFF_LOOP_BYTES = 256 * 1024  # bodies and prompts past this size are handled on a worker thread
MIN_TEMPERATURE = 1e-5  # below this a temperature is greedy (1/T would overflow float32 on the device)


@dataclass
class ApiContext:
    """Everything a handler needs; engine and model come from `state` (they may attach late)."""

    state: ServerState
    api_key: str | None
    model_name: str
    keepalive_seconds: float = 2.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    log_prompts: bool = False  # --log-prompts: the prompt and output text go into the log

    @property
    def engine(self) -> Engine | None:
        return self.state.engine

    @property
    def model(self) -> Model | None:
        return self.state.model

    @property
    def loaded(self) -> tuple[Engine, Model]:
        """The engine and the model, for handlers that run only once they are there (check_accepting,
        need_model): an AssertionError, so a 500, where one is missing."""
        engine, model = self.state.engine, self.state.model
        assert engine is not None and model is not None, "the model is not loaded"
        return engine, model

    @property
    def tokenizer(self) -> Tokenizer:
        model = self.state.model
        assert model is not None, "the model is not loaded"
        return model.tokenizer

    @property
    def formats(self) -> ModelFormats | None:
        """The model's tool-call and reasoning formats, resolved once when it loaded (None before)."""
        return self.state.formats

    @property
    def context_limit(self) -> int:
        return self.loaded[0].limits.context

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens a request may have: the engine needs room for one more."""
        return self.loaded[0].limits.context - 1

    def body_limit(self) -> int:
        """The largest request body worth reading now (see limits.py)."""
        engine, model = self.engine, self.model
        if engine is None or model is None:  # loading: generation answers 503, the rest is small
            return self.limits.max_body or self.limits.body_bytes(0, None)
        return self.limits.body_bytes(engine.limits.context, model.tokenizer.longest_token()[0])

    def served_names(self) -> set[str]:
        names = {self.model_name}
        model = self.model
        if model is not None:
            names |= {model.path.name, model.path.stem}
        return names

    @property
    def fingerprint(self) -> str:
        model = self.model
        return "fp_" + str(model.fingerprint)[:12] if model is not None else "fp_none"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def decode_body(body: bytes, type_: type[T], limits: RequestLimits | None = None) -> T:
    """The body as `type_`; a 400 naming the field for anything wrong (bad JSON, invalid UTF-8,
    wrong types, nesting past --max-json-depth)."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    limits = limits or RequestLimits()
    try:
        value = msgspec.json.decode(body, type=type_)
    except RecursionError:
        raise bad_request(f"the request body's JSON is nested deeper than {limits.max_json_depth} levels "
                          "(--max-json-depth)", code="invalid_json") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
    limits.check_depth(body)
    return value


async def decode_body_async(body: bytes, type_: type[T], limits: RequestLimits) -> T:
    if len(body) < OFF_LOOP_BYTES:
        return decode_body(body, type_, limits)
    return await asyncio.to_thread(decode_body, body, type_, limits)


# -- request parameters ----------------------------------------------------------------------------


def sampling_params(ctx: ApiContext, *, temperature: float | None, top_p: float | None, top_k: int | None = None,
                    min_p: float | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                    seed: int | None = None, logit_bias: dict[str, float] | None = None) -> SamplingParams:
    """SamplingParams from protocol fields (None = the default); a 400 naming the field for an
    out-of-range value (the protocols share these names). A temperature too small to divide by
    is greedy, as it means."""
    kw: dict[str, Any] = {}
    if top_k == -1:  # "all tokens" as vLLM and SGLang spell it (sglang-router fills it in): ours is 0
        top_k = 0
    for key, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                       ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                       ("repetition_penalty", repetition_penalty)):
        if value is not None:
            if isinstance(value, float):
                finite(value, key)
            kw[key] = value
    ctx.limits.top_k(top_k)
    if temperature is not None and 0.0 < temperature < MIN_TEMPERATURE:
        kw["temperature"] = 0.0
    if logit_bias:
        kw["logit_bias"] = ctx.limits.logit_bias(logit_bias, ctx.tokenizer.vocab_size)
    if seed is not None:
        kw["seed"] = seed & 0xFFFFFFFFFFFFFFFF  # numpy wants a non-negative seed; keep negative ones distinct
    try:
        params = SamplingParams(**kw)
    except (TypeError, ValueError) as e:  # pragma: no cover - the structs already typed the values
        raise bad_request(str(e)) from None
    bad = params.validate()
    if bad:
        raise bad_request(f"{bad} is out of range (got {kw.get(bad)!r})", param=bad, code="invalid_value")
    return params


def stop_list(ctx: ApiContext, stop: str | list[str] | None, param: str = "stop") -> list[str]:
    return ctx.limits.stop(stop, param)


DEFAULT_OUTPUT_FRACTION = 4  # no max tokens given: a quarter of the context...
DEFAULT_OUTPUT_FLOOR = 1024  # ...but never less than this on a small context...
DEFAULT_OUTPUT_CEILING = 32768  # ...nor more than this on a huge one (a runaway costs minutes of a shared engine)


def default_max_tokens(context: int) -> int:
    """The output cap when the client names none: bounded, so a generation that never emits an
    end token (a looping model, an unbounded JSON string) still ends, with finish reason length.
    1024 tokens for contexts up to 4096, a quarter of the context up to 128K, 32768 beyond."""
    return min(max(context // DEFAULT_OUTPUT_FRACTION, DEFAULT_OUTPUT_FLOOR), DEFAULT_OUTPUT_CEILING)


def max_new_tokens(value: int | None, prompt_len: int, context: int, param: str, *, allow_zero: bool = False,
                   server_cap: int = 0) -> int:
    """The protocol's max tokens, clamped to what the context leaves (None: the default cap) and
    to the server's --max-output-tokens (server_cap; 0 = none)."""
    room = max(context - prompt_len, 1)
    if server_cap:
        room = min(room, server_cap)
    if value is None:
        return min(default_max_tokens(context), room)
    if value < (0 if allow_zero else 1):
        raise bad_request(f"{param} must be at least {0 if allow_zero else 1} (got {value})", param=param,
                          code="invalid_value")
    return min(value, room)


def output_tokens(ctx: ApiContext, value: int | None, prompt_len: int, param: str) -> int:
    return max_new_tokens(value, prompt_len, ctx.context_limit, param, server_cap=ctx.limits.max_output_tokens)


def check_logprobs(k: int | None, param: str) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be between 0 and {MAX_LOGPROBS} (got {k})", param=param,
                          code="invalid_value")


def json_arguments(arguments: Any) -> Any:
    """Tool-call arguments as HF chat templates want them: a dict when the JSON string parses."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


# -- prompts ---------------------------------------------------------------------------------------------


def too_long(ctx: ApiContext, e: TooManyTokens, param: str) -> ApiError:
    return ApiError(400, f"the prompt has at least {e.at_least} tokens ({e.chars} characters); this worker's "
                         f"context limit is {ctx.context_limit} tokens", param=param, code="context_length_exceeded")


async def render_prompt(ctx: ApiContext, messages: list[dict], tools: list[dict] | None, param: str,
                        *, bounded: bool = True, **template_kwargs: Any) -> tuple[str, list[int]]:
    """Render the chat template and tokenize, off the event loop (long prompts take a while): the
    prompt text and its ids. bounded: refuse a prompt past the context, as soon as that is known."""
    from ..text.chat_template import ChatTemplateError

    model = ctx.model
    assert model is not None, "the model is not loaded"
    template = model.template
    limit = ctx.prompt_limit if bounded else None
    channels = ctx.formats.channels if ctx.formats is not None else None

    def build() -> tuple[str, list[int]]:
        if channels is not None:  # Harmony renders the conversation itself (text/formats/harmony.py)
            text = channels.render(messages, tools, template_kwargs.get("reasoning_effort"))
            return text, ctx.tokenizer.encode(text, add_special=True, parse_special=True, limit=limit)
        return template.render_encode(messages, add_generation_prompt=True, tools=tools, limit=limit,
                                      **template_kwargs)

    try:
        return await asyncio.to_thread(build)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template could not render these messages: {e}", param=param,
                          code="invalid_messages") from None
    except TooManyTokens as e:
        raise too_long(ctx, e, param) from None


async def text_prompt(ctx: ApiContext, text: str, param: str = "prompt") -> list[int]:
    tok = ctx.tokenizer
    limit = ctx.prompt_limit

    def build() -> list[int]:
        ids = tok.encode(text, add_special=True, parse_special=True, limit=limit + 1)
        bos = tok.bos_id
        if tok.add_bos and bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the text already began with the BOS token
        if len(ids) > limit:
            raise TooManyTokens(len(ids), limit, len(text))
        return ids

    try:
        return await asyncio.to_thread(build)
    except TooManyTokens as e:
        raise too_long(ctx, e, param) from None


async def token_prompt(ctx: ApiContext, ids: list[Any], param: str) -> list[int]:
    """A prompt given as token ids: within the context and the vocabulary (checked off the event
    loop when long)."""
    if not ids:
        raise bad_request("the prompt is empty", param=param, code="invalid_value")
    if len(ids) > ctx.prompt_limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this worker's context limit is {ctx.context_limit} "
                            "tokens", param=param, code="context_length_exceeded")
    n = ctx.tokenizer.vocab_size

    def check() -> list[int]:
        if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < n:  # C loops: the common case
            return ids
        for i, t in enumerate(ids):  # which one is wrong
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n:
                raise bad_request(f"token id {t!r} at {param}[{i}] is not in the vocabulary (0..{n - 1})",
                                  param=param, code="invalid_value")
        return ids

    return check() if len(ids) < 4096 else await asyncio.to_thread(check)


# -- submission ------------------------------------------------------------------------------------------


def refuse(ctx: ApiContext, request_id: str, protocol: str, err: ApiError) -> ApiError:
    """Count and log a request refused before the engine had it (a bad body, a bound, a full
    queue...): its one outcome, so started == sum of outcomes still holds."""
    _count(ctx, Outcome.REFUSED)
    log(Outcome.REFUSED.value, request_id=request_id, protocol=protocol, status=err.status, reason=err.message)
    return err


def fail_early(ctx: ApiContext, request_id: str, protocol: str, e: Exception) -> None:
    """Count and log a request whose preparation failed unexpectedly (a 500; app.py logs the traceback)."""
    _count(ctx, Outcome.FAILED)
    log(Outcome.FAILED.value, level="error", request_id=request_id, protocol=protocol, status=500,
        error=f"{type(e).__name__}: {e}")


def _count(ctx: ApiContext, outcome: Outcome) -> None:
    engine = ctx.engine
    if engine is not None:
        engine.metrics.started.inc()
        engine.metrics.outcomes.labels(outcome.value).inc()


def check_accepting(ctx: ApiContext) -> None:
    if ctx.state.accepting():
        return
    state = ctx.state.state
    message = {
        HealthState.LOADING: "the model is still loading; retry shortly",
        HealthState.DRAINING: "the worker is shutting down and takes no new requests; retry shortly",
        HealthState.POISONED: "the worker's compute context failed and it is restarting; retry shortly",
    }.get(state, f"the worker is not ready ({state})")
    raise ApiError(503, message, code="service_unavailable", retry_after=RETRY_AFTER_UNAVAILABLE)


def submit(ctx: ApiContext, req: GenerationRequest, param: str) -> RequestHandle:
    """Hand the request to the engine; its refusals as ApiErrors (the caller logs the outcome)."""
    check_accepting(ctx)
    handle = RequestHandle(req, asyncio.get_running_loop())
    engine = ctx.engine
    assert engine is not None, "the model is not loaded"  # (check_accepting: the worker is ready)
    try:
        engine.submit(handle)
    except QueueFull as e:
        raise ApiError(429, f"the worker is busy: {e}; retry shortly", code="rate_limit_exceeded",
                       retry_after=RETRY_AFTER_BUSY) from None
    except NotAccepting as e:
        raise ApiError(503, str(e), code="service_unavailable", retry_after=RETRY_AFTER_UNAVAILABLE) from None
    except PromptTooLong as e:
        raise ApiError(400, str(e), param=param, code="context_length_exceeded") from None
    if ctx.log_prompts:  # the user asked for prompt text in the log (--log-prompts); never otherwise
        log("prompt", request_id=req.request_id, protocol=req.protocol,
            text=ctx.tokenizer.decode(req.prompt, skip_special=False))
        handle.transcript = []
    return handle


def failed_error(f: Failed) -> ApiError:
    retry = RETRY_AFTER_UNAVAILABLE if f.status == 503 else None
    return ApiError(f.status, f.message, code=f.kind, retry_after=retry)


# -- results ---------------------------------------------------------------------------------------------


@dataclass
class Collected:
    """A whole result, gathered from the events of a non-streaming request."""

    started: Started | None = None
    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: Finished | None = None
    failed: Failed | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, e: Any) -> None:
        if isinstance(e, Delta):
            self.parts.append(e.text)
            self.tokens.extend(e.tokens)
            if e.logprobs:
                self.logprobs.extend(e.logprobs)
        elif isinstance(e, Started):
            self.started = e
        elif isinstance(e, PromptLogprobs):
            self.prompt_logprobs = e.entries
        elif isinstance(e, Finished):
            self.finished = e
        elif isinstance(e, Failed):
            self.failed = e


async def watch_disconnect(receive: Callable, handle: RequestHandle) -> None:
    """Cancel the request when the ASGI server reports the client gone (clean close or reset)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            handle.cancel()
            return


async def collect(receive: Callable, handle: RequestHandle) -> Collected:
    """Gather a request's events while watching for a disconnect; raise ApiError if it failed."""
    out = Collected()
    watcher = asyncio.ensure_future(watch_disconnect(receive, handle))
    try:
        async for e in handle.events():
            out.add(e)
    finally:
        watcher.cancel()
        if out.finished is None and out.failed is None:
            handle.cancel()  # the handler itself was cancelled (server shutting down)
    if out.failed is not None:
        raise failed_error(out.failed)
    return out


# -- token text --------------------------------------------------------------------------------------------


def token_bytes(ctx: ApiContext, token: int) -> bytes:
    return ctx.tokenizer.token_piece(token)


def token_str(ctx: ApiContext, token: int) -> str:
    return token_bytes(ctx, token).decode("utf-8", errors="replace")
