"""What the protocols' stream renderers share (sse.Renderer).

`StreamRenderer` sends each engine event to one method and ends a failed stream with the
protocol's error frames. `ParsedStream` (chat completions, Responses, messages) also runs the
output through the request's output parser and sends each parsed piece (reasoning text, answer
text, the start of a tool call, a piece of its arguments) to one method.
"""

from __future__ import annotations

from typing import Any

from ..engine.requests import Delta, Failed, Finished, GenerationRequest, PromptLogprobs, Started
from ..text.formats import ContentDelta, ToolCallArgsDelta, ToolCallStart
from . import common
from .errors import ApiError, openai_error
from .output_parser import ReasoningDelta, output_of
from .sse import KEEPALIVE_COMMENT, frame


def openai_error_frames(err: ApiError) -> list[bytes]:
    return [frame(openai_error(err))]


def openai_stream_end(usage_chunk: Any | None) -> list[bytes]:
    """How an OpenAI stream ends: a chunk with no choices and the usage (when stream_options.
    include_usage asked for it), then `data: [DONE]`."""
    return ([frame(usage_chunk)] if usage_chunk is not None else []) + [b"data: [DONE]\n\n"]


class StreamRenderer:
    def open(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def on_event(self, e: Any) -> list[bytes]:
        if isinstance(e, Started):
            return self.started(e)
        if isinstance(e, PromptLogprobs):
            return self.prompt_logprobs(e)
        if isinstance(e, Delta):
            return self.delta(e)
        if isinstance(e, Finished):
            return self.finished(e)
        if isinstance(e, Failed):
            return self.error_frames(common.failed_error(e))
        return []

    def internal_error(self, message: str) -> list[bytes]:
        return self.error_frames(ApiError(500, message))

    def started(self, e: Started) -> list[bytes]:
        return []

    def prompt_logprobs(self, e: PromptLogprobs) -> list[bytes]:
        return []

    def delta(self, e: Delta) -> list[bytes]:
        raise NotImplementedError

    def finished(self, e: Finished) -> list[bytes]:
        raise NotImplementedError

    def error_frames(self, err: ApiError) -> list[bytes]:
        """The frames that end a stream whose request failed."""
        raise NotImplementedError


class ParsedStream(StreamRenderer):
    def __init__(self, ctx: common.ApiContext, req: GenerationRequest | None):
        self.ctx = ctx
        self.parser = output_of(req).parser(ctx.tokenizer)

    def delta(self, e: Delta) -> list[bytes]:
        if not e.text and not e.tokens:
            return []
        return self.parsed(self.parser.feed_delta(e))

    def parsed(self, events: list) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                out += self.reasoning(e.text)
            elif isinstance(e, ContentDelta):
                out += self.content(e.text)
            elif isinstance(e, ToolCallStart):
                out += self.call_start(e)
            elif isinstance(e, ToolCallArgsDelta):
                out += self.call_arguments(e)
        return out

    def reasoning(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def content(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def call_start(self, e: ToolCallStart) -> list[bytes]:
        raise NotImplementedError

    def call_arguments(self, e: ToolCallArgsDelta) -> list[bytes]:
        raise NotImplementedError
