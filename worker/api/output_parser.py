"""The response side of tool calls and reasoning, shared by chat completions, Responses and messages.

`OutputParser` turns engine deltas into reasoning text, answer text and tool-call events: the
model's reasoning splitter first (so tool-call markup inside reasoning is never a call), then its
tool-call parser on the answer only; a format that owns the whole turn (Harmony's channels) parses
all three itself. prepare.py attaches the `OutputPlan` that says which formats apply to a request;
the renderers read it back with `output_of`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine.requests import Delta, GenerationRequest
from ..text.formats import ContentDelta, ReasoningFormat, ToolFormat, collect
from ..text.formats.events import ReasoningDelta, merge_text
from ..text.formats.harmony import Harmony
from ..text.formats.reasoning_stream import REASONING, ReasoningSplitter


@dataclass
class OutputPlan:
    """What the response renderers need to split the output."""

    tool_format: ToolFormat | None  # None: no tool-call parsing
    reasoning: ReasoningFormat | None
    inside: bool  # generation starts inside the reasoning block
    marker_tokens: tuple[tuple[int, str], ...] = ()
    forced: bool = False  # a grammar forces the output into calls (tool_choice required or named)
    channels: Harmony | None = None  # parses reasoning, answer and calls itself (tool_format: calls offered)

    def parser(self, tokenizer: Any = None, **kw: Any) -> OutputParser:
        return OutputParser(self, tokenizer, **kw)


def output_of(req: GenerationRequest | None) -> OutputPlan:
    plan = req.output_plan if req is not None else None
    return plan if isinstance(plan, OutputPlan) else OutputPlan(None, None, False)


@dataclass
class Parsed:
    """A whole non-streaming result."""

    reasoning: str
    content: str
    calls: list  # formats.ToolCall
    reasoning_tokens: int
    reasoning_open: bool


class OutputParser:
    """Engine deltas -> ReasoningDelta / ContentDelta / ToolCallStart / ToolCallArgsDelta events."""

    def __init__(self, plan: OutputPlan, tokenizer: Any = None, *, id_factory=None, args_chunk: int = 0):
        self.plan = plan
        self.tokenizer = tokenizer
        self.split = (plan.reasoning.splitter(inside=plan.inside) if plan.reasoning is not None
                      else ReasoningSplitter(None))
        self.tools = (plan.tool_format.parser(id_factory, args_chunk, forced=plan.forced)
                      if plan.tool_format is not None and plan.channels is None else None)
        self.turn = (plan.channels.turn_parser(id_factory, calls=plan.tool_format is not None, forced=plan.forced)
                     if plan.channels is not None else None)
        self.hidden = dict(plan.marker_tokens)
        self.reasoning_tokens = 0

    def _restore(self, text: str, tokens: list[int]) -> str:
        """Put back the text of marker tokens the detokenizer hid (Mistral's [TOOL_CALLS], Llama's
        <|python_tag|>...): each goes before the text of the tokens that follow it in this delta."""
        hits = [k for k, t in enumerate(tokens) if t in self.hidden]
        if not hits or self.tokenizer is None:
            return text
        for k in reversed(hits):
            after = self.tokenizer.decode(tokens[k + 1:])
            pos = len(text) - len(after) if after and text.endswith(after) else len(text)
            if not after:
                pos = len(text)
            text = text[:pos] + self.hidden[tokens[k]] + text[pos:]
        return text

    def feed_delta(self, d: Delta) -> list:
        return self.feed(d.text, d.tokens)

    def feed(self, text: str, tokens: list[int] | None = None) -> list:
        if tokens:
            text = self._restore(text, tokens)
        if self.turn is not None:
            was_open = self.turn.open
            events = self.turn.feed(text)
            if tokens and (was_open or self.turn.open or any(isinstance(e, ReasoningDelta) for e in events)):
                self.reasoning_tokens += len(tokens)
            return _merge(events)
        was_open = self.split.open
        pieces = self.split.feed(text)
        if tokens and (was_open or self.split.open or any(k == REASONING for k, _ in pieces)):
            self.reasoning_tokens += len(tokens)
        return self._route(pieces)

    def finish(self) -> list:
        if self.turn is not None:
            return _merge(self.turn.finish())
        out = self._route(self.split.finish())
        if self.tools is not None:
            out += self.tools.finish()
        return _merge(out)

    def _route(self, pieces: list[tuple[str, str]]) -> list:
        out: list = []
        for kind, text in pieces:
            if kind == REASONING:
                out.append(ReasoningDelta(text))
            elif self.tools is not None:
                out += self.tools.feed(text)
            else:
                out.append(ContentDelta(text))
        return _merge(out)

    @property
    def reasoning_open(self) -> bool:
        return self.turn.open if self.turn is not None else self.split.open

    def parse_all(self, text: str, tokens: list[int] | None = None) -> Parsed:
        events = self.feed(text, tokens) + self.finish()
        answer = collect(events)  # content and calls; reasoning deltas are not its concern
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        return Parsed(reasoning, answer.content, answer.tool_calls, self.reasoning_tokens, self.reasoning_open)


def _merge(events: list) -> list:
    return merge_text(events, (ContentDelta, ReasoningDelta))


def parse_result(ctx: Any, req: GenerationRequest | None, text: str, tokens: list[int]) -> Parsed:
    """A whole non-streaming output, split by the request's output plan."""
    return output_of(req).parser(ctx.tokenizer).parse_all(text, tokens)


def parse_arguments(arguments: str) -> dict:
    """A call's arguments JSON as a dict (Anthropic's tool_use.input)."""
    try:
        v = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}
