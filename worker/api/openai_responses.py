"""OpenAI Responses: POST /v1/responses, streaming and not (what Codex speaks).

input: a string or a list of items: messages (role user/system/developer/assistant, content a
string or input_text/output_text parts), function_call / function_call_output items (and the
other *_call / *_call_output kinds, rendered as tool calls and tool results); a reasoning item's
text is the reasoning_content of the assistant turn right after it (templates that replay reasoning,
DeepSeek's, read it). tools (function tools) / tool_choice / parallel_tool_calls and reasoning.effort: see
tool_plan.py and prepare.py; the output is then reasoning items, a message and function_call items,
streamed with response.reasoning_text.delta and response.function_call_arguments.delta/.done events.
instructions becomes a leading system message. max_output_tokens caps the output; when it is
reached the response ends `incomplete` (reason max_output_tokens) with a `response.incomplete`
event, as the API does. Responses are not stored: previous_response_id is refused (400).
Extensions beyond the API: top_k, min_p, repetition_penalty, seed and stop. Streams carry
typed events with an increasing sequence_number:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or .incomplete); a failure ends the stream
with response.failed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.requests import Finished, FinishReason, GenerationRequest
from ..text.formats import ToolCallArgsDelta, ToolCallStart
from . import common, structured, tool_plan
from .adapter import ProtocolAdapter, Submitted
from .common import ApiContext, Collected, bad_request
from .errors import ApiError
from .openai_chat import flatten_content
from .output_parser import parse_result
from .prepare import apply, prepare
from .sse import frame
from .stream_base import ParsedStream

PROTOCOL = "responses"


class TextConfig(msgspec.Struct):
    format: dict[str, Any] | None = None


class ResponsesRequest(common.SamplingFields, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    stop: str | list[str] | None = None  # extension (not in the Responses API), as top_k and min_p
    stream: bool | None = None  # null as false, as the OpenAI API documents it
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


# -- response bodies ---------------------------------------------------------------------------------------


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct):
    id: str
    status: str
    content: list[OutputText]
    type: str = "message"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    type: str = "function_call"


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct):
    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = []
    type: str = "reasoning"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class TextFormat(msgspec.Struct):
    format: dict[str, Any]


class Response(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] = {}
    object: str = "response"
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    text: TextFormat = msgspec.field(default_factory=lambda: TextFormat({"type": "text"}))
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    truncation: str = "disabled"
    user: str | None = None


# stream events: each names its type and a sequence number; most then the output item (and the
# content part of it) they concern


class StreamEvent(msgspec.Struct):
    type: str
    sequence_number: int


class LifecycleEvent(StreamEvent):
    response: Response


class OutputItemEvent(StreamEvent):
    output_index: int
    item: OutputItem


class ItemEvent(StreamEvent):
    item_id: str
    output_index: int


class ContentEvent(ItemEvent):
    content_index: int


class ContentPartEvent(ContentEvent):
    part: OutputText


class TextDeltaEvent(ContentEvent):
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(ContentEvent):
    text: str
    logprobs: list[Any] = []


class ReasoningDeltaEvent(ContentEvent):
    delta: str


class ReasoningDoneEvent(ContentEvent):
    text: str


class ItemDeltaEvent(ItemEvent):
    """response.function_call_arguments.delta"""

    delta: str


class ArgumentsDoneEvent(ItemEvent):
    arguments: str
    name: str


# -- request -> GenerationRequest ------------------------------------------------------------------------------


def template_messages(body: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        msgs.append({"role": "user", "content": body.input})
        return msgs
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type")
        if kind in (None, "message") and "role" in item:
            role = item.get("role")
            if not isinstance(role, str):
                raise bad_request(f"{param}.role must be a string", param=f"{param}.role")
            content = item.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise bad_request(f"{param}.content must be a string or a list of parts", param=f"{param}.content")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": flatten_content(content, f"{param}.content")})
        elif kind == "reasoning":
            reasoning = reasoning_text(item)
            continue
        elif isinstance(kind, str) and kind.endswith("_call_output"):
            out = item.get("output")
            if not isinstance(out, str):
                out = flatten_content(out, f"{param}.output") if isinstance(out, list) else msgspec.json.encode(
                    out).decode()
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": out})
        elif isinstance(kind, str) and kind.endswith("_call"):
            args = item.get("arguments", item.get("input", item.get("action", {})))
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name") or kind.removesuffix("_call"),
                                 "arguments": common.json_arguments(args)}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            elif msgs and msgs[-1]["role"] == "assistant":
                msgs[-1]["tool_calls"] = [call]
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            raise bad_request(f"{param}: items of type {kind!r} are not supported", param=param,
                              code="unsupported_value")
        if reasoning and msgs[-1]["role"] == "assistant":
            msgs[-1]["reasoning_content"] = reasoning  # the template decides whether it is kept
        reasoning = ""
    if not msgs:
        raise bad_request("input must not be empty", param="input")
    return msgs


def reasoning_text(item: dict) -> str:
    """A reasoning input item's text: its reasoning_text parts (as ember writes them), else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


async def to_generation(ctx: ApiContext, body: ResponsesRequest, request_id: str) -> GenerationRequest:
    if body.previous_response_id:
        raise bad_request("previous_response_id is not supported: this worker does not store responses; send the "
                          "whole conversation in input", param="previous_response_id", code="unsupported_parameter")
    grammar = await structured.off_loop(structured.responses_grammar, body.text.format if body.text else None)
    params = common.sampling_params(
        ctx, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed)
    stop = common.stop_list(ctx, body.stop)
    plan = tool_plan.responses_plan(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.limits)
    if body.reasoning is not None and not isinstance(body.reasoning, dict):
        raise bad_request("reasoning must be an object", param="reasoning")
    ask = tool_plan.effort_ask((body.reasoning or {}).get("effort"), "reasoning.effort")
    prep = await prepare(ctx, template_messages(body), plan, ask, "input", structured=grammar is not None)
    prompt = prep.prompt
    max_tokens = common.output_tokens(ctx, body.max_output_tokens, len(prompt), "max_output_tokens")
    return apply(GenerationRequest(request_id, prompt, params, max_tokens, stop=stop, protocol=PROTOCOL,
                                   grammar=grammar), prep)


# -- events -> response ----------------------------------------------------------------------------------------


def response_usage(f: Finished, reasoning_tokens: int = 0) -> ResponseUsage:
    return ResponseUsage(f.prompt_tokens, InputTokensDetails(f.cached_tokens), f.completion_tokens,
                         OutputTokensDetails(min(reasoning_tokens, f.completion_tokens)),
                         f.prompt_tokens + f.completion_tokens)


class ResponseBuilder:
    def __init__(self, ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int):
        self.ctx, self.body, self.id, self.created = ctx, body, request_id, created
        self.item_id = "msg_" + request_id.removeprefix("resp_")
        self.n_items = 0

    def new_id(self, prefix: str) -> str:
        """Ids of the items after the first message: derived from the response id, so they are unique."""
        self.n_items += 1
        return f"{prefix}{self.id.removeprefix('resp_')}_{self.n_items}"

    def response(self, status: str, output: list, usage: ResponseUsage | None = None,
                 error: ResponseError | None = None, incomplete: IncompleteDetails | None = None) -> Response:
        b = self.body
        return Response(self.id, self.created, self.ctx.model_name, status, output, usage, error, incomplete,
                        b.instructions, b.max_output_tokens, b.temperature if b.temperature is not None else 1.0,
                        b.top_p if b.top_p is not None else 1.0, b.metadata or {}, tools=b.tools or [], user=b.user,
                        text=TextFormat(b.text.format if b.text and b.text.format else {"type": "text"}),
                        parallel_tool_calls=b.parallel_tool_calls is not False,
                        tool_choice=b.tool_choice if b.tool_choice is not None else "auto",
                        reasoning=b.reasoning)

    def final(self, output: list, f: Finished, reasoning_tokens: int = 0) -> Response:
        truncated = f.reason is FinishReason.LENGTH
        return self.response("incomplete" if truncated else "completed", output, response_usage(f, reasoning_tokens),
                             incomplete=IncompleteDetails("max_output_tokens") if truncated else None)


def completed(ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int, c: Collected,
              req: GenerationRequest | None = None) -> Response:
    f = c.finished
    assert f is not None
    b = ResponseBuilder(ctx, body, request_id, created)
    out = parse_result(ctx, req, c.text, c.tokens)
    truncated = f.reason is FinishReason.LENGTH
    items: list = []
    if out.reasoning or out.reasoning_open:
        items.append(ReasoningItem(b.new_id("rs_"), "incomplete" if out.reasoning_open else "completed",
                                   [ReasoningText(out.reasoning)]))
    if out.content or not out.calls:
        items.append(OutputMessage(b.item_id, "incomplete" if truncated else "completed", [OutputText(out.content)]))
    for call in out.calls:
        items.append(FunctionCallItem(b.new_id("fc_"), call.id, call.name, call.arguments, "completed"))
    return b.final(items, f, out.reasoning_tokens)


class ResponsesStream(ParsedStream):
    """Output items open as their first text arrives (reasoning, then the message, then function
    calls) and each closes before the next opens, as the API streams them."""

    def __init__(self, ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int,
                 req: GenerationRequest | None = None):
        super().__init__(ctx, req)
        self.b = ResponseBuilder(ctx, body, request_id, created)
        self.seq = 0
        self.items: list = []  # finished items, in output order
        self.cur: Any = None  # the open item
        self.text: list[str] = []  # the open item's text (reasoning, message or arguments)

    def _emit(self, cls, type_: str, *args, **kw) -> bytes:
        data = cls(type_, self.seq, *args, **kw)
        self.seq += 1
        return frame(data, type_)

    def open(self) -> list[bytes]:
        r = self.b.response("in_progress", [])
        return [self._emit(LifecycleEvent, "response.created", r),
                self._emit(LifecycleEvent, "response.in_progress", r)]

    @property
    def _index(self) -> int:
        return len(self.items)

    def _open(self, item: Any) -> list[bytes]:
        out = self._close()
        self.cur, self.text = item, []
        out.append(self._emit(OutputItemEvent, "response.output_item.added", self._index, item))
        if isinstance(item, OutputMessage):
            out.append(self._emit(ContentPartEvent, "response.content_part.added", item.id, self._index, 0,
                                  OutputText("")))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item, idx = self.cur, self._index
        if item is None:
            return []
        text = "".join(self.text)
        out = []
        if isinstance(item, ReasoningItem):
            item = ReasoningItem(item.id, status, [ReasoningText(text)])
            out.append(self._emit(ReasoningDoneEvent, "response.reasoning_text.done", item.id, idx, 0, text))
        elif isinstance(item, OutputMessage):
            item = OutputMessage(item.id, status, [OutputText(text)])
            out += [self._emit(TextDoneEvent, "response.output_text.done", item.id, idx, 0, text),
                    self._emit(ContentPartEvent, "response.content_part.done", item.id, idx, 0, OutputText(text))]
        else:
            item = FunctionCallItem(item.id, item.call_id, item.name, text, "completed")
            out.append(self._emit(ArgumentsDoneEvent, "response.function_call_arguments.done", item.id, idx, text,
                                  item.name))
        out.append(self._emit(OutputItemEvent, "response.output_item.done", idx, item))
        self.items.append(item)
        self.cur = None
        return out

    def reasoning(self, text: str) -> list[bytes]:
        out = []
        if not isinstance(self.cur, ReasoningItem):
            out = self._open(ReasoningItem(self.b.new_id("rs_"), "in_progress", []))
        self.text.append(text)
        return out + [self._emit(ReasoningDeltaEvent, "response.reasoning_text.delta", self.cur.id, self._index, 0,
                                 text)]

    def content(self, text: str) -> list[bytes]:
        out = []
        if not isinstance(self.cur, OutputMessage):
            out = self._open(OutputMessage(self.b.item_id, "in_progress", []))
        self.text.append(text)
        return out + [self._emit(TextDeltaEvent, "response.output_text.delta", self.cur.id, self._index, 0, text)]

    def call_start(self, e: ToolCallStart) -> list[bytes]:
        return self._open(FunctionCallItem(self.b.new_id("fc_"), e.id, e.name, "", "in_progress"))

    def call_arguments(self, e: ToolCallArgsDelta) -> list[bytes]:
        if not isinstance(self.cur, FunctionCallItem):
            return []
        self.text.append(e.text)
        return [self._emit(ItemDeltaEvent, "response.function_call_arguments.delta", self.cur.id, self._index,
                           e.text)]

    def finished(self, e: Finished) -> list[bytes]:
        truncated = e.reason is FinishReason.LENGTH
        out = self.parsed(self.parser.finish())
        if isinstance(self.cur, ReasoningItem) and self.parser.reasoning_open:
            out += self._close("incomplete")  # the stream ended inside the reasoning block
        elif isinstance(self.cur, OutputMessage) and truncated:
            out += self._close("incomplete")
        out += self._close()
        if not any(isinstance(i, (OutputMessage, FunctionCallItem)) for i in self.items):
            out += self._open(OutputMessage(self.b.item_id, "in_progress", []))  # an (empty) answer
            out += self._close("incomplete" if truncated else "completed")
        final = self.b.final(list(self.items), e, self.parser.reasoning_tokens)
        return out + [self._emit(LifecycleEvent, f"response.{final.status}", final)]

    def error_frames(self, err: ApiError) -> list[bytes]:
        # the engine's failure kind is the code ("overloaded" is a server error to this API)
        code = err.code if err.code not in (None, "overloaded") else "server_error"
        r = self.b.response("failed", [], error=ResponseError(code, err.message))
        return [self._emit(LifecycleEvent, "response.failed", r)]


class Responses(ProtocolAdapter):
    path = "/v1/responses"
    summary = "OpenAI Responses"
    body_type = ResponsesRequest
    id_prefix = "resp_"
    protocol = PROTOCOL
    prompt_param = "input"

    async def to_generation(self, ctx: ApiContext, body: ResponsesRequest,
                            request_id: str) -> tuple[GenerationRequest, Any]:
        return await to_generation(ctx, body, request_id), None

    def renderer(self, s: Submitted) -> ResponsesStream:
        return ResponsesStream(s.ctx, s.body, s.request_id, s.created, s.req)

    def response(self, s: Submitted, result: Collected) -> Response:
        return completed(s.ctx, s.body, s.request_id, s.created, result, s.req)
