"""Anthropic messages: POST /v1/messages (streaming and not) and /v1/messages/count_tokens.

system: a string or text blocks. Messages may also carry role "system" (Claude Code sends some
inside `messages`); they are passed to the chat template where they stand. Content blocks: text;
tool_use and tool_result become the template's tool calls and tool messages; an assistant's thinking
blocks become its reasoning_content (templates that replay reasoning, DeepSeek's, read it); images
and documents are refused (text-only model). stop_sequences, temperature, top_p, top_k (the current
SDK no longer offers temperature; absent, it is the API's default 1.0); max_tokens is clamped to the
context (and may be left out). output_config.format (or the beta's top-level output_format)
constrains the output to a JSON schema (structured.py). output_config.effort (low, medium, high,
max) is the level a template reads (max: DeepSeek V4's strongest thinking mode), never a budget.
cache_control, metadata and unknown fields are ignored: the prefix cache is automatic. tools /
tool_choice and thinking ({type: enabled, budget_tokens}): see tool_plan.py; the output then holds
thinking blocks, a text block and tool_use blocks (stop_reason tool_use), streamed as thinking_delta
and input_json_delta.

Usage: input_tokens is the uncached part of the prompt, cache_read_input_tokens the part served
from the prefix cache (so input + cache_read = the whole prompt), cache_creation_input_tokens 0.
Streams: message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta (stop_reason end_turn / max_tokens / stop_sequence, usage), message_stop; `ping`
events keep the stream alive while the request waits or prefills; a failure ends the stream with
`event: error`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.requests import Delta, Finished, FinishReason, GenerationRequest, Started
from ..text.formats import ToolCallArgsDelta, ToolCallStart
from . import common, structured, tool_plan
from .adapter import ProtocolAdapter, Submitted
from .common import ApiContext, Collected, bad_request
from .errors import ApiError, anthropic_error
from .output_parser import parse_arguments, parse_result
from .prepare import Prepared, apply, prepare
from .sse import frame
from .stream_base import ParsedStream

PROTOCOL = "messages"


class MessageIn(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(msgspec.Struct, kw_only=True):
    messages: list[MessageIn]
    model: str = ""
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class TextBlock(msgspec.Struct):
    text: str
    type: str = "text"


class ThinkingBlock(msgspec.Struct):
    thinking: str
    signature: str = ""  # nothing to sign: a thinking block sent back is taken as it is
    type: str = "thinking"


class ToolUseBlock(msgspec.Struct):
    id: str
    name: str
    input: dict[str, Any]
    type: str = "tool_use"


Block = TextBlock | ThinkingBlock | ToolUseBlock


class ThinkingDelta(msgspec.Struct):
    thinking: str
    type: str = "thinking_delta"


class InputJsonDelta(msgspec.Struct):
    partial_json: str
    type: str = "input_json_delta"


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct):
    id: str
    model: str
    content: list[Block]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


class MessageStart(msgspec.Struct):
    message: Message
    type: str = "message_start"


class ContentBlockStart(msgspec.Struct):
    index: int
    content_block: Block
    type: str = "content_block_start"


class TextDelta(msgspec.Struct):
    text: str
    type: str = "text_delta"


class ContentBlockDelta(msgspec.Struct):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta
    type: str = "content_block_delta"


class ContentBlockStop(msgspec.Struct):
    index: int
    type: str = "content_block_stop"


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct):
    delta: StopDelta
    usage: Usage
    type: str = "message_delta"


class Ping(msgspec.Struct):
    type: str = "ping"


class MessageStop(msgspec.Struct):
    type: str = "message_stop"


PING_FRAME = frame(Ping(), "ping")

# -- request -> GenerationRequest ------------------------------------------------------------------------------


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"{param}[{j}] must be a content block", param=f"{param}[{j}]")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
            texts.append(text)
        elif kind in ("image", "document"):
            raise bad_request(f"{param}[{j}]: this model accepts text only (got a {kind} block)",
                              param=f"{param}[{j}]")
    return "\n".join(texts)


def template_messages(body: MessagesRequest) -> list[dict]:
    msgs: list[dict] = []
    if body.system:
        msgs.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        param = f"messages[{i}].content"
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        thoughts: list[str] = []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "thinking" and m.role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])  # the template decides whether prior reasoning is kept
            elif kind == "text":
                texts.append(_text_of([block], param))
            elif kind in ("image", "document"):
                _text_of([block], param)  # raises the 400
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name", ""), "arguments": block.get("input", {})}})
            elif kind == "tool_result":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _text_of(block.get("content"), f"{param}[{j}].content")})
            # redacted_thinking, server tool blocks: nothing for the prompt
        msgs.extend(results)
        if texts or calls or not results:
            d: dict[str, Any] = {"role": m.role, "content": "\n".join(texts) if texts or not calls else None}
            if calls:
                d["tool_calls"] = calls
            if thoughts:
                d["reasoning_content"] = "\n".join(thoughts)
            msgs.append(d)
    return msgs


async def prepared(ctx: ApiContext, body: MessagesRequest, structured: bool = False,
                   bounded: bool = True) -> Prepared:
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    plan = tool_plan.anthropic_plan(body.tools, body.tool_choice, ctx.limits)
    ask = tool_plan.anthropic_ask(body.thinking, body.max_tokens, (body.output_config or {}).get("effort"))
    return await prepare(ctx, template_messages(body), plan, ask, "messages", structured=structured, bounded=bounded)


async def prompt_of(ctx: ApiContext, body: MessagesRequest) -> list[int]:
    """The prompt's tokens (count_tokens: also past the context, which is what the caller asks)."""
    return (await prepared(ctx, body, bounded=False)).prompt


async def to_generation(ctx: ApiContext, body: MessagesRequest, request_id: str) -> GenerationRequest:
    fmt, where = (body.output_config or {}).get("format"), "output_config.format"
    if fmt is None and body.output_format is not None:
        fmt, where = body.output_format, "output_format"
    grammar = await structured.off_loop(structured.anthropic_grammar, fmt, where)
    params = common.sampling_params(ctx, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    stop = common.stop_list(ctx, body.stop_sequences, "stop_sequences")
    prep = await prepared(ctx, body, structured=grammar is not None)
    prompt = prep.prompt
    max_tokens = common.output_tokens(ctx, body.max_tokens, len(prompt), "max_tokens")
    return apply(GenerationRequest(request_id, prompt, params, max_tokens, stop=stop, protocol=PROTOCOL,
                                   grammar=grammar), prep)


# -- events -> response ----------------------------------------------------------------------------------------


def stop_reason(f: Finished, tool_use: bool = False) -> tuple[str, str | None]:
    if f.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if f.stop_string is not None:
        return "stop_sequence", f.stop_string
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> Usage:
    return Usage(prompt_tokens - cached_tokens, output_tokens, 0, cached_tokens)


def message(ctx: ApiContext, request_id: str, c: Collected, req: GenerationRequest | None = None) -> Message:
    f = c.finished
    assert f is not None
    out = parse_result(ctx, req, c.text, c.tokens)
    blocks: list = []
    if out.reasoning or out.reasoning_open:
        blocks.append(ThinkingBlock(out.reasoning))
    if out.content or not out.calls:
        blocks.append(TextBlock(out.content))
    for call in out.calls:
        blocks.append(ToolUseBlock(tool_use_id(call.id), call.name, parse_arguments(call.arguments)))
    reason, seq = stop_reason(f, bool(out.calls))
    return Message(request_id, ctx.model_name, blocks, reason, seq,
                   usage(f.prompt_tokens, f.cached_tokens, f.completion_tokens))


class MessagesStream(ParsedStream):
    """Content blocks open as their first text arrives (thinking, text, tool_use) and each closes
    before the next opens; a stream cut inside thinking still closes its block."""

    def __init__(self, ctx: ApiContext, request_id: str, prompt_tokens: int, req: GenerationRequest | None = None):
        super().__init__(ctx, req)
        self.id, self.prompt_tokens = request_id, prompt_tokens
        self.sent_start = False
        self.index = -1  # the last block opened
        self.kind: str | None = None  # the open block's type
        self.tool_use = False

    def _start(self, cached: int) -> list[bytes]:
        if self.sent_start:
            return []
        self.sent_start = True
        msg = Message(self.id, self.ctx.model_name, [], None, None, usage(self.prompt_tokens, cached, 0))
        return [frame(MessageStart(msg), "message_start")]

    def _open(self, block: Block) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.kind = block.type
        out.append(frame(ContentBlockStart(self.index, block), "content_block_start"))
        return out + [PING_FRAME] if self.index == 0 else out  # the API's order: start, block, ping

    def _close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [frame(ContentBlockStop(self.index), "content_block_stop")]

    def _delta(self, delta: Any) -> bytes:
        return frame(ContentBlockDelta(self.index, delta), "content_block_delta")

    def reasoning(self, text: str) -> list[bytes]:
        out = [] if self.kind == "thinking" else self._open(ThinkingBlock(""))
        return out + [self._delta(ThinkingDelta(text))]

    def content(self, text: str) -> list[bytes]:
        out = [] if self.kind == "text" else self._open(TextBlock(""))
        return out + [self._delta(TextDelta(text))]

    def call_start(self, e: ToolCallStart) -> list[bytes]:
        self.tool_use = True
        return self._open(ToolUseBlock(tool_use_id(e.id), e.name, {}))

    def call_arguments(self, e: ToolCallArgsDelta) -> list[bytes]:
        return [self._delta(InputJsonDelta(e.text))] if self.kind == "tool_use" else []

    def keepalive(self) -> bytes:
        return PING_FRAME

    def started(self, e: Started) -> list[bytes]:
        self.prompt_tokens = e.prompt_tokens
        return self._start(e.cached_tokens)

    def delta(self, e: Delta) -> list[bytes]:
        if not e.text and not e.tokens:
            return []
        return self._start(0) + super().delta(e)

    def finished(self, e: Finished) -> list[bytes]:
        reason, seq = stop_reason(e, self.tool_use)
        out = self._start(e.cached_tokens) + self.parsed(self.parser.finish())
        if self.index < 0:
            out += self._open(TextBlock(""))  # an empty answer still has its text block
        return out + self._close() + [
            frame(MessageDelta(StopDelta(reason, seq), usage(e.prompt_tokens, e.cached_tokens,
                                                             e.completion_tokens)), "message_delta"),
            frame(MessageStop(), "message_stop"),
        ]

    def error_frames(self, err: ApiError) -> list[bytes]:
        return [frame(anthropic_error(err), "error")]


class Messages(ProtocolAdapter):
    path = "/v1/messages"
    summary = "Anthropic messages"
    body_type = MessagesRequest
    id_prefix = "msg_"
    protocol = PROTOCOL
    prompt_param = "messages"

    def headers(self, request_id: str) -> dict[str, str]:
        return {"request-id": request_id, "x-request-id": request_id}

    async def to_generation(self, ctx: ApiContext, body: MessagesRequest,
                            request_id: str) -> tuple[GenerationRequest, Any]:
        return await to_generation(ctx, body, request_id), None

    def renderer(self, s: Submitted) -> MessagesStream:
        return MessagesStream(s.ctx, s.request_id, len(s.req.prompt), s.req)

    def response(self, s: Submitted, result: Collected) -> Message:
        return message(s.ctx, s.request_id, result, s.req)
