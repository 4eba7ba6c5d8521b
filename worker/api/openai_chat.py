"""OpenAI chat completions: POST /v1/chat/completions, streaming and not.

Request fields used: model (any name: one model is served), messages, stream, stream_options.
include_usage, max_tokens / max_completion_tokens (the latter wins), temperature, top_p, seed,
stop, logprobs / top_logprobs, n (only 1), presence_penalty, frequency_penalty, logit_bias, plus the
common extensions top_k, min_p, repetition_penalty. tools / tool_choice / parallel_tool_calls and
reasoning_effort: see tool_plan.py and prepare.py (tool calls come back as message.tool_calls, reasoning as
message.reasoning_content, both streamed as deltas). response_format json_object / json_schema constrain
the output to the schema (see structured.py). Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.requests import Delta, Finished, FinishReason, GenerationRequest, Started, TokenLogprob
from ..text.formats import ToolCallArgsDelta, ToolCallStart
from . import common, structured, tool_plan
from .adapter import ProtocolAdapter, Submitted
from .common import ApiContext, Collected, bad_request
from .output_parser import parse_result
from .prepare import apply, prepare
from .sse import frame
from .stream_base import ParsedStream, openai_error_frames, openai_stream_end

PROTOCOL = "chat"

# -- request ---------------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, sent back (DeepSeek asks for it)


class ChatRequest(common.SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    model: str = ""
    stream: bool | None = None  # null as false, as the OpenAI API documents it
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None


# -- response ------------------------------------------------------------------------------------------


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # vLLM / DeepSeek's field for the model's reasoning


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int
    audio_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str


class ChunkFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    function: ChunkFunction
    id: str | None = None
    type: str | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class _NullUsageChunk(ChatCompletionChunk, omit_defaults=False):
    """A chunk with `"usage": null`, as the API sends when include_usage is on."""


def usage(finished: Finished, reasoning_tokens: int = 0) -> Usage:
    return Usage(finished.prompt_tokens, finished.completion_tokens,
                 finished.prompt_tokens + finished.completion_tokens,
                 PromptTokensDetails(finished.cached_tokens),
                 CompletionTokensDetails(min(reasoning_tokens, finished.completion_tokens)))


def finish_reason(f: Finished, tool_calls: bool = False) -> str:
    if f.reason is FinishReason.LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def logprob_entries(ctx: ApiContext, lps: list[TokenLogprob]) -> list[TokenLogprobOut]:
    out = []
    for lp in lps:
        b = common.token_bytes(ctx, lp.token)
        top = []
        for t, v in lp.top:
            tb = common.token_bytes(ctx, t)
            top.append(TopLogprob(tb.decode("utf-8", errors="replace"), v, list(tb)))
        out.append(TokenLogprobOut(b.decode("utf-8", errors="replace"), lp.logprob, list(b), top))
    return out


# -- request -> GenerationRequest -----------------------------------------------------------------------------


def template_messages(messages: list[ChatMessageIn]) -> list[dict]:
    """OpenAI messages as the chat template wants them: text content, tool calls with dict arguments."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": flatten_content(m.content, f"messages[{i}].content")}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = f if isinstance(f := c.get("function"), dict) else {}
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn.get("name", ""),
                                           "arguments": common.json_arguments(fn.get("arguments", {}))}})
            d["tool_calls"] = calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content and m.role == "assistant":
            d["reasoning_content"] = m.reasoning_content  # the template decides whether it is kept
        out.append(d)
    return out


TEXT_PARTS = ("text", "input_text", "output_text")


def flatten_content(content: Any, param: str) -> str | None:
    """A message's content as one string: text parts joined by newlines; other media refused."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{param}[{j}] must be an object with a type", param=f"{param}[{j}]")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
            texts.append(text)
        elif kind in ("image_url", "image", "input_image", "input_audio", "file", "input_file", "document"):
            raise bad_request(f"{param}[{j}]: this model accepts text only (got a {kind} part)",
                              param=f"{param}[{j}]", code="unsupported_content")
        # other part types (refusal, thinking...) carry nothing the prompt needs
    return "\n".join(texts)


async def to_generation(ctx: ApiContext, body: ChatRequest, request_id: str) -> GenerationRequest:
    if body.n not in (None, 1):
        raise bad_request(f"n must be 1 (got {body.n}): this worker returns one choice per request", param="n",
                          code="unsupported_value")
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    grammar = await structured.off_loop(structured.chat_grammar, body.response_format)
    k = None
    if body.logprobs:
        common.check_logprobs(body.top_logprobs, "top_logprobs")
        k = body.top_logprobs or 0
    params = common.sampling_params(
        ctx, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, logit_bias=body.logit_bias)
    stop = common.stop_list(ctx, body.stop)
    messages = template_messages(body.messages)
    plan = tool_plan.chat_plan(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.limits)
    prep = await prepare(ctx, messages, plan, tool_plan.effort_ask(body.reasoning_effort, "reasoning_effort"),
                         "messages", structured=grammar is not None)
    prompt = prep.prompt
    which = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = common.output_tokens(ctx, limit, len(prompt), which)
    return apply(GenerationRequest(request_id, prompt, params, max_tokens, stop=stop, logprobs=k, protocol=PROTOCOL,
                                   grammar=grammar), prep)


# -- events -> response ----------------------------------------------------------------------------------------


def completion(ctx: ApiContext, request_id: str, created: int, c: Collected, want_logprobs: bool,
               req: GenerationRequest | None = None) -> ChatCompletion:
    f = c.finished
    assert f is not None
    lps = ChoiceLogprobs(logprob_entries(ctx, c.logprobs)) if want_logprobs else None
    out = parse_result(ctx, req, c.text, c.tokens)
    calls = [ToolCallOut(t.id, FunctionOut(t.name, t.arguments)) for t in out.calls] or None
    message = ChatMessageOut(out.content if out.content or not calls else None, tool_calls=calls,
                             reasoning_content=out.reasoning or None)
    choice = ChatChoice(0, message, lps, finish_reason(f, bool(calls)))
    return ChatCompletion(request_id, "chat.completion", created, ctx.model_name, [choice],
                          usage(f, out.reasoning_tokens), ctx.fingerprint)


class ChatStream(ParsedStream):
    """Engine events -> chat.completion.chunk frames, then `data: [DONE]`."""

    error_frames = staticmethod(openai_error_frames)

    def __init__(self, ctx: ApiContext, request_id: str, created: int, include_usage: bool, want_logprobs: bool,
                 req: GenerationRequest | None = None):
        super().__init__(ctx, req)
        self.id, self.created = request_id, created
        self.include_usage, self.want_logprobs = include_usage, want_logprobs
        self.sent_role = False
        self.calls = 0
        self.logprobs: ChoiceLogprobs | None = None  # rides on the next chunk

    def _chunk(self, delta: ChunkDelta, finish: str | None = None) -> bytes:
        cls = _NullUsageChunk if self.include_usage else ChatCompletionChunk
        logprobs, self.logprobs = self.logprobs, None
        return frame(cls(self.id, "chat.completion.chunk", self.created, self.ctx.model_name, self.ctx.fingerprint,
                         [ChunkChoice(0, delta, logprobs, finish)]))

    def _role(self) -> list[bytes]:
        if self.sent_role:
            return []
        self.sent_role = True
        return [self._chunk(ChunkDelta(role="assistant", content=""))]

    def reasoning(self, text: str) -> list[bytes]:
        return [self._chunk(ChunkDelta(reasoning_content=text))]

    def content(self, text: str) -> list[bytes]:
        return [self._chunk(ChunkDelta(content=text))]

    def call_start(self, e: ToolCallStart) -> list[bytes]:
        self.calls += 1
        return [self._chunk(ChunkDelta(tool_calls=[ChunkToolCall(e.index, ChunkFunction(e.name, ""), e.id,
                                                                 "function")]))]

    def call_arguments(self, e: ToolCallArgsDelta) -> list[bytes]:
        return [self._chunk(ChunkDelta(tool_calls=[ChunkToolCall(e.index, ChunkFunction(arguments=e.text))]))]

    def started(self, e: Started) -> list[bytes]:
        return self._role()

    def delta(self, e: Delta) -> list[bytes]:
        lps = ChoiceLogprobs(logprob_entries(self.ctx, e.logprobs)) if self.want_logprobs and e.logprobs else None
        if not e.text and not e.tokens and lps is None:
            return []
        out = self._role()
        self.logprobs = lps  # logprobs ride on the first chunk of this delta, or on an empty one
        out += self.parsed(self.parser.feed_delta(e))
        if self.logprobs is not None:
            out.append(self._chunk(ChunkDelta()))
        return out

    def finished(self, e: Finished) -> list[bytes]:
        out = self._role() + self.parsed(self.parser.finish())
        out.append(self._chunk(ChunkDelta(), finish_reason(e, self.calls > 0)))
        usage_chunk = ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, self.ctx.model_name,
                                          self.ctx.fingerprint, [], usage(e, self.parser.reasoning_tokens))
        return out + openai_stream_end(usage_chunk if self.include_usage else None)


class ChatCompletions(ProtocolAdapter):
    path = "/v1/chat/completions"
    summary = "OpenAI chat completions"
    body_type = ChatRequest
    id_prefix = "chatcmpl-"
    protocol = PROTOCOL
    prompt_param = "messages"

    async def to_generation(self, ctx: ApiContext, body: ChatRequest, request_id: str) -> tuple[GenerationRequest, Any]:
        return await to_generation(ctx, body, request_id), None

    def renderer(self, s: Submitted) -> ChatStream:
        include = bool(s.body.stream_options and s.body.stream_options.include_usage)
        return ChatStream(s.ctx, s.request_id, s.created, include, bool(s.body.logprobs), s.req)

    def response(self, s: Submitted, result: Collected) -> ChatCompletion:
        return completion(s.ctx, s.request_id, s.created, result, bool(s.body.logprobs), s.req)
