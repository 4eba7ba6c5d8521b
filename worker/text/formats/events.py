"""What a tool-call parser emits: answer text and tool calls, as stream events or as one result.

Stream events: ContentDelta(text); ToolCallStart(index, id, name) once per call, then
ToolCallArgsDelta(index, text) pieces whose concatenation is the call's arguments JSON string;
ReasoningDelta(text) from a format that parses reasoning itself (Harmony's analysis channel).
`collect` folds events into a ParseResult, so streaming and non-streaming results agree.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass
class ParseResult:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ContentDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgsDelta:
    index: int
    text: str


Event = ContentDelta | ToolCallStart | ToolCallArgsDelta | ReasoningDelta


def merge_text(events: list, text_types: tuple[type[ContentDelta | ReasoningDelta], ...] = (ContentDelta,)) -> list:
    """Adjacent text events of one type joined into one, empty ones dropped."""
    out: list = []
    for e in events:
        if isinstance(e, text_types):
            if not e.text:
                continue
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
                continue
        out.append(e)
    return out


def collect(events: Iterable[Event]) -> ParseResult:
    """Fold stream events into a ParseResult (other event types are not its concern)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.id, e.name, ""))
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index].arguments += e.text
    return ParseResult("".join(content), calls)


_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Mistral templates require 9 alphanumeric characters."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
