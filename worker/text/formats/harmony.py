"""gpt-oss's Harmony format, through openai_harmony: the whole turn, prompt and output.

Harmony is more than a tool-call convention: every message names a channel, the model reasons on
`analysis`, answers on `final`, and calls a function on `commentary` with a recipient:

    <|start|>assistant<|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

So this format owns the whole turn: it renders the conversation itself with openai_harmony
(system message with the reasoning level, developer message with the instructions and the tools,
prior reasoning, calls and results) instead of the chat template, and its parser turns the output
into reasoning, answer text and tool calls with openai_harmony's StreamableParser. The bridge is
text: the rendered prompt is tokenized by the model's own tokenizer (special tokens parsed), and the
decoded output is encoded with the Harmony encoding before the parser sees it, so a vocabulary whose
ids are not o200k's (the synthetic gpt-oss models) works as the real one does. The encoding's
vocabulary file comes from harmony_vocab.py (offline, hash-checked). `<|call|>` and `<|return|>` end
generation (the vocabulary marks them end-of-generation, as llama.cpp does).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

from ..chat_template import ChatTemplateError
from .events import ContentDelta, Event, ReasoningDelta, ToolCall, ToolCallArgsDelta, ToolCallStart, merge_text
from .fenced import text_of
from .lark import Term, lark_literal
from .reasoning import ReasoningFormat
from .scan import partial_suffix
from .tool_format import ToolFormat, call_names
from .tool_stream import ToolCallStreamParser

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
SPECIALS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ANALYSIS = CHANNEL + "analysis" + MESSAGE
FUNCTIONS = "functions."
HEADER_LIMIT = 128  # tokens of header without <|message|>: the output is not Harmony, show it as text
# the APIs' effort names (api/tool_plan.py EFFORT_BUDGETS) -> Harmony's three levels
EFFORT_LEVELS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                 "xhigh": "high", "max": "high"}


@dataclass(frozen=True)
class HarmonyAnalysis(ReasoningFormat):
    """The analysis channel as a reasoning block: its markers bound the reasoning budget, and a forced
    call may follow one analysis message. Splitting is the Harmony parser's job, never a splitter's."""

    start: str = ANALYSIS
    end: str = END
    name: str = "harmony"

    def starts_inside(self, prompt_text: str) -> bool:
        return False  # a Harmony prompt always ends with `<|start|>assistant`, before any channel

    def before_calls_lark(self, calls: str, reasoning_open: bool, term: Term,
                          hidden: set[str]) -> tuple[str, list[str]]:
        if self.end in hidden:  # <|end|> is a control token here: no free analysis before a forced call
            return f"start: {calls}", []
        rules = [f"analysis_text[stop={lark_literal(END)}]: /(.|\\n)*/"]
        return f'start: ({term(self.start)} analysis_text {term(START)} "assistant")? {calls}', rules


def _tool_description(harmony: Any, tool: dict) -> Any:
    fn = tool.get("function") or tool
    return harmony.ToolDescription.new(fn.get("name", ""), fn.get("description") or "",
                                       parameters=fn.get("parameters") or None)


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


class Harmony(ToolFormat):
    """The Harmony format of one model; `encoding` is openai_harmony's (harmony_vocab.harmony_encoding)."""

    name = "harmony"
    signals = (CHANNEL,)
    markers = SPECIALS
    # forced-call grammars spell these as the exact tokens of the vocabulary (ModelFormats.spelled):
    # llguidance cannot choose between a token reference and a literal that start alike, and the
    # reasoning budget watches for the analysis header's own tokens
    spelled: tuple[str, ...] = (CHANNEL, ANALYSIS)
    call_tail = ""  # the arguments end the call's message; <|call|> follows (calls_lark)

    def __init__(self, encoding: Any = None):
        self._encoding = encoding

    @property
    def encoding(self) -> Any:
        if self._encoding is None:
            from ..harmony_vocab import harmony_encoding

            self._encoding = harmony_encoding()
        return self._encoding

    @property
    def reasoning(self) -> ReasoningFormat:
        return HarmonyAnalysis()

    # -- the prompt

    def render(self, messages: list[dict], tools: list[dict] | None, effort: str | None = None) -> str:
        """The conversation in Harmony up to `<|start|>assistant`, as text (special tokens spelled out).
        effort: an API effort name ("low", "high", "none"...; None: medium)."""
        import openai_harmony as h

        try:
            conv = h.Conversation.from_messages(self._messages(h, messages, tools or [], effort))
            ids = self.encoding.render_conversation_for_completion(conv, h.Role.ASSISTANT)
            return str(self.encoding.decode_utf8(ids))
        except (h.HarmonyError, ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            raise ChatTemplateError(f"Harmony: {e}") from None

    def _messages(self, h: Any, messages: list[dict], tools: list[dict], effort: str | None) -> list[Any]:
        level = EFFORT_LEVELS.get(effort or "medium", "medium")
        system = (h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(level.capitalize()))
                  .with_conversation_start_date(date.today().isoformat()))
        out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
        lead = 0  # the client's leading system/developer messages are Harmony's developer instructions
        while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
            lead += 1
        instructions = "\n\n".join(text_of(m.get("content")) for m in messages[:lead])
        if instructions or tools:
            dev = h.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions(instructions)
            if tools:
                dev = dev.with_function_tools([_tool_description(h, t) for t in tools])
            out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
        names = call_names(messages)
        for m in messages[lead:]:
            out += self._message(h, m, names)
        return out

    def _message(self, h: Any, m: dict, names: dict[str, str]) -> list[Any]:
        role, text = m.get("role"), text_of(m.get("content"))
        if role in ("system", "developer"):
            return [h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(text))]
        if role == "tool":
            name = names.get(str(m.get("tool_call_id"))) or m.get("name") or "tool"
            author = h.Author.new(h.Role.TOOL, FUNCTIONS + name)
            return [h.Message.from_author_and_content(author, text).with_channel("commentary")
                    .with_recipient("assistant")]
        if role != "assistant":
            return [h.Message.from_role_and_content(h.Role.USER, text)]
        out = []
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking") if isinstance(m.get(k), str)),
                         "")
        if reasoning:
            out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, reasoning).with_channel("analysis"))
        calls = m.get("tool_calls") or []
        if text:
            out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, text)
                       .with_channel("commentary" if calls else "final"))
        for c in calls:
            fn = c.get("function") or {}
            out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, _arguments_text(fn.get("arguments")))
                       .with_channel("commentary").with_recipient(FUNCTIONS + str(fn.get("name", "")))
                       .with_content_type(CONSTRAIN + "json"))
        return out

    # -- the output

    def parser(self, id_factory: Callable[[], str] | None = None, args_chunk: int = 0,
               forced: bool = False) -> ToolCallStreamParser:
        return self.turn_parser(id_factory, calls=True, forced=forced)

    def turn_parser(self, id_factory: Callable[[], str] | None = None, *, calls: bool = True,
                    forced: bool = False) -> HarmonyParser:
        return HarmonyParser(id_factory or self.new_call_id, self.encoding, calls=calls, forced=forced)

    # -- forced calls

    def call_head(self, name: str) -> str:
        return f"commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"  # after <|channel|> (calls_lark)

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        # <|call|> ends the generation: one call per turn, whatever `more` allows
        return [f"call: {term(CHANNEL)} obj {term(CALL)}"], "call"


class HarmonyParser(ToolCallStreamParser):
    """Decoded output text -> ReasoningDelta (analysis), ContentDelta (final, and commentary without a
    recipient), ToolCallStart + ToolCallArgsDelta (a message to functions.NAME, arguments streamed as
    they come). Output that is not Harmony (no header, or one openai_harmony refuses) is content from
    there on. calls: False shows a call's arguments as content (the request offered no tools)."""

    opener = CHANNEL

    def __init__(self, id_factory: Callable[[], str], encoding: Any, *, calls: bool = True, forced: bool = False):
        from openai_harmony import Role, StreamableParser

        super().__init__(id_factory, 0, forced)
        self.enc = encoding
        self.calls_on = calls
        self.p = StreamableParser(encoding, Role.ASSISTANT)
        self.raw = False  # not Harmony: everything from here on is content
        self._header: list[int] = []  # tokens since the last message's content, while in a header
        self._in: tuple[int, str | None, str | None] | None = None  # (message index, channel, recipient)

    @property
    def open(self) -> bool:
        """Inside an analysis message."""
        return self._in is not None and self._in[1] == "analysis" and self._in[2] is None

    def feed(self, text: str) -> list[Event]:
        if self.finished or not text:
            return []
        self.buf += text
        keep = 0 if self.raw else partial_suffix(self.buf, SPECIALS)  # a special token may be cut here
        ready, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return _merged(self._process(ready))

    def finish(self) -> list[Event]:
        if self.finished:
            return []
        out = self._process(self.buf)
        self.buf = ""
        self.finished = True
        if not self.raw:
            with contextlib.suppress(Exception):  # cut inside a header: what it held is text (below)
                self.p.process_eos()
            if self._header:
                out += self._release(self.enc.decode(self._header))
        return _merged(out)

    def _release(self, text: str) -> list[Event]:
        """Text that turned out not to be Harmony markup (dropped under a forced call: see the base)."""
        self._header = []
        return [] if self.forced or not text else [ContentDelta(text)]

    def _process(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.raw:
            return [] if self.forced else [ContentDelta(text)]
        from openai_harmony import StreamState

        out: list[Event] = []
        ids = self.enc.encode(text, allowed_special="all")
        for k, tok in enumerate(ids):
            try:
                self.p.process(tok)
            except Exception:  # openai_harmony refuses the sequence; never raise on model output
                self.raw = True
                return out + self._release(self.enc.decode(self._header + ids[k:]))
            if self.p.state != StreamState.CONTENT:
                if self._in is not None:  # the message ended
                    self._in = None
                elif self.p.state == StreamState.HEADER:
                    self._header.append(tok)
                    if len(self._header) > HEADER_LIMIT:
                        self.raw = True
                        return out + self._release(self.enc.decode(self._header + ids[k + 1:]))
                continue
            index = len(self.p.messages)
            if self._in is None or self._in[0] != index:
                self._in = (index, self.p.current_channel, self.p.current_recipient)
                self._header = []
                if self._in[2] and self.calls_on:
                    name = self._in[2].removeprefix(FUNCTIONS)
                    call = ToolCall(self.id_factory(), name, "")
                    self.calls.append(call)
                    out.append(ToolCallStart(len(self.calls) - 1, call.id, name))
            delta = self.p.last_content_delta
            if delta:
                out.append(self._route(delta))
        return out

    def _route(self, delta: str) -> Event:
        assert self._in is not None
        _, channel, recipient = self._in
        if recipient and self.calls_on:
            self.calls[-1].arguments += delta
            return ToolCallArgsDelta(len(self.calls) - 1, delta)
        if channel == "analysis" and not recipient:
            return ReasoningDelta(delta)
        return ContentDelta(delta)


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent text of one kind joined, a call's adjacent argument pieces too."""
    out: list[Event] = []
    for e in merge_text(events, (ContentDelta, ReasoningDelta)):
        last = out[-1] if out else None
        if isinstance(e, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta) and last.index == e.index:
            out[-1] = ToolCallArgsDelta(e.index, last.text + e.text)
        else:
            out.append(e)
    return out
