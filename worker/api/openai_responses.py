"""OpenAI Responses: POST /v1/responses, streaming and not (what Codex speaks).

input: a string or a list of items: messages (role user/system/developer/assistant, content a
string or input_text/output_text parts), function_call / function_call_output items (and the
other *_call / *_call_output kinds, rendered as tool calls and tool results); reasoning items are
skipped. instructions becomes a leading system message. max_output_tokens caps the output; when
it is reached the response ends `incomplete` (reason max_output_tokens) with a
`response.incomplete` event, as the API does. Responses are not stored: previous_response_id is
refused (400). Extensions beyond the API: top_k, min_p, repetition_penalty, seed and stop.
Streams carry typed events with an increasing sequence_number:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or .incomplete); a failure ends the stream
with response.failed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine.requests import Delta, Failed, Finished, FinishReason, GenerationRequest, Started
from . import common
from .common import ApiContext, Collected, bad_request
from .openai_chat import check_response_format, flatten_content
from .sse import KEEPALIVE_COMMENT, frame

PROTOCOL = "responses"


class TextConfig(msgspec.Struct):
    format: dict[str, Any] | None = None


class ResponsesRequest(common.SamplingFields, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    stop: str | list[str] | None = None  # extension (not in the Responses API), as top_k and min_p
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
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
    output: list[OutputMessage]
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
    reasoning: None = None
    store: bool = False
    text: TextFormat = msgspec.field(default_factory=lambda: TextFormat({"type": "text"}))
    tool_choice: str = "auto"
    tools: list[dict[str, Any]] = []
    truncation: str = "disabled"
    user: str | None = None


# stream events


class LifecycleEvent(msgspec.Struct):
    type: str
    sequence_number: int
    response: Response


class OutputItemEvent(msgspec.Struct):
    type: str
    sequence_number: int
    output_index: int
    item: OutputMessage


class ContentPartEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


# -- request -> GenerationRequest ------------------------------------------------------------------------------


def template_messages(body: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        msgs.append({"role": "user", "content": body.input})
        return msgs
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
    if not msgs:
        raise bad_request("input must not be empty", param="input")
    return msgs


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    out = []
    for t in tools or []:
        if t.get("type") == "function" and t.get("name"):
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                         if k in t}})
    return out or None


async def to_generation(ctx: ApiContext, body: ResponsesRequest, request_id: str) -> GenerationRequest:
    if body.previous_response_id:
        raise bad_request("previous_response_id is not supported: this worker does not store responses; send the "
                          "whole conversation in input", param="previous_response_id", code="unsupported_parameter")
    if body.text is not None:
        check_response_format(body.text.format, "text.format")
    params = common.sampling_params(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed)
    prompt = await common.chat_prompt(ctx, template_messages(body), template_tools(body.tools), "input")
    max_tokens = common.max_new_tokens(body.max_output_tokens, len(prompt), ctx.context_limit, "max_output_tokens")
    return GenerationRequest(request_id, prompt, params, max_tokens, stop=common.stop_list(body.stop),
                             protocol=PROTOCOL)


# -- events -> response ----------------------------------------------------------------------------------------


def response_usage(f: Finished) -> ResponseUsage:
    return ResponseUsage(f.prompt_tokens, InputTokensDetails(f.cached_tokens), f.completion_tokens,
                         OutputTokensDetails(), f.prompt_tokens + f.completion_tokens)


class ResponseBuilder:
    def __init__(self, ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int):
        self.ctx, self.body, self.id, self.created = ctx, body, request_id, created
        self.item_id = "msg_" + request_id.removeprefix("resp_")

    def response(self, status: str, output: list[OutputMessage], usage: ResponseUsage | None = None,
                 error: ResponseError | None = None, incomplete: IncompleteDetails | None = None) -> Response:
        b = self.body
        return Response(self.id, self.created, self.ctx.model_name, status, output, usage, error, incomplete,
                        b.instructions, b.max_output_tokens, b.temperature if b.temperature is not None else 1.0,
                        b.top_p if b.top_p is not None else 1.0, b.metadata or {}, tools=b.tools or [], user=b.user)

    def final(self, text: str, f: Finished) -> Response:
        truncated = f.reason is FinishReason.LENGTH
        item = OutputMessage(self.item_id, "incomplete" if truncated else "completed", [OutputText(text)])
        return self.response("incomplete" if truncated else "completed", [item], response_usage(f),
                             incomplete=IncompleteDetails("max_output_tokens") if truncated else None)


def completed(ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int, c: Collected) -> Response:
    assert c.finished is not None
    return ResponseBuilder(ctx, body, request_id, created).final(c.text, c.finished)


class ResponsesStream:
    def __init__(self, ctx: ApiContext, body: ResponsesRequest, request_id: str, created: int):
        self.b = ResponseBuilder(ctx, body, request_id, created)
        self.seq = 0
        self.opened_item = False
        self.parts: list[str] = []

    def _emit(self, cls, type_: str, *args, **kw) -> bytes:
        data = cls(type_, self.seq, *args, **kw)
        self.seq += 1
        return frame(data, type_)

    def open(self) -> list[bytes]:
        r = self.b.response("in_progress", [])
        return [self._emit(LifecycleEvent, "response.created", r),
                self._emit(LifecycleEvent, "response.in_progress", r)]

    def _item(self) -> list[bytes]:
        if self.opened_item:
            return []
        self.opened_item = True
        iid = self.b.item_id
        return [self._emit(OutputItemEvent, "response.output_item.added", 0, OutputMessage(iid, "in_progress", [])),
                self._emit(ContentPartEvent, "response.content_part.added", iid, 0, 0, OutputText(""))]

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def on_event(self, e) -> list[bytes]:
        iid = self.b.item_id
        if isinstance(e, Started):
            return self._item()
        if isinstance(e, Delta):
            if not e.text:
                return []
            self.parts.append(e.text)
            return self._item() + [self._emit(TextDeltaEvent, "response.output_text.delta", iid, 0, 0, e.text)]
        if isinstance(e, Finished):
            text = "".join(self.parts)
            final = self.b.final(text, e)
            item = final.output[0]
            return self._item() + [
                self._emit(TextDoneEvent, "response.output_text.done", iid, 0, 0, text),
                self._emit(ContentPartEvent, "response.content_part.done", iid, 0, 0, OutputText(text)),
                self._emit(OutputItemEvent, "response.output_item.done", 0, item),
                self._emit(LifecycleEvent, f"response.{final.status}", final),
            ]
        if isinstance(e, Failed):
            return self._failed(e.kind if e.kind != "overloaded" else "server_error", e.message)
        return []

    def _failed(self, code: str, message: str) -> list[bytes]:
        r = self.b.response("failed", [], error=ResponseError(code, message))
        return [self._emit(LifecycleEvent, "response.failed", r)]

    def internal_error(self, message: str) -> list[bytes]:
        return self._failed("server_error", message)
