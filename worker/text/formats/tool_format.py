"""The base of every tool-call format: one class owns a convention end to end.

A format knows how a chat template shows it (`signals`), which of its markup may be single special
tokens of the vocabulary (`markers`), how to parse it from a stream (`parser_class`), how to force
it with a grammar (`calls_lark`, the Lark for one turn of calls), and how prior calls and results are
written back into a prompt (`history`). To add a format: subclass ToolFormat in
a module of its own and list it in registry.TOOL_FORMATS, ahead of the fenced-JSON fallback. A
format that owns the whole turn (harmony.py: it renders the prompt and parses reasoning too) is
one such subclass that the registry and the API layer know by its type.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from .events import ParseResult, collect, openai_call_id
from .lark import Term, lark_literal
from .tool_stream import ToolCallStreamParser


def call_names(messages: list[dict]) -> dict[str, str]:
    """Call id -> function name, over the assistant turns' tool calls."""
    names: dict[str, str] = {}
    for m in messages:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            if c.get("id"):
                names[str(c["id"])] = fn.get("name", "")
    return names


class ToolFormat:
    """One tool-call convention; stateless, so one instance serves every request for a model."""

    name: ClassVar[str]
    signals: ClassVar[tuple[str, ...]] = ()  # text in a chat template that shows the model speaks this format
    markers: ClassVar[tuple[str, ...]] = ()  # markup that may be one (special) token of the vocabulary
    args_key: ClassVar[str] = "arguments"  # the call object's key for the arguments, when forced
    call_tail: ClassVar[str] = "}"  # what closes a forced call after its arguments (see call_head)
    parser_class: ClassVar[type[ToolCallStreamParser]]

    @classmethod
    def detects(cls, template_source: str) -> bool:
        return any(s in template_source for s in cls.signals)

    def new_call_id(self) -> str:
        return openai_call_id()

    def parser(self, id_factory: Callable[[], str] | None = None, args_chunk: int = 0,
               forced: bool = False) -> ToolCallStreamParser:
        return self.parser_class(id_factory or self.new_call_id, args_chunk, forced)

    def parse(self, text: str, id_factory: Callable[[], str] | None = None) -> ParseResult:
        """Non-streaming parse: (content text, tool calls).  Never raises on model output."""
        p = self.parser(id_factory)
        return collect(p.feed(text or "") + p.finish())

    # -- forced calls

    def call_head(self, name: str) -> str:
        """A forced call object up to its arguments."""
        return "{" + f'"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '

    def call_rules(self, schemas: list[tuple[str, str]], term: Term) -> list[str]:
        """Lark rules that define `obj`: one call of one of the named tools (schema JSON texts), its
        arguments held to the schema. The default is a JSON call object (call_head, the arguments,
        call_tail); a format whose arguments are not one JSON value writes its own (dsml.py)."""
        rules = [f"args{i}: %json{schema}" for i, (_, schema) in enumerate(schemas)]
        tail = f" {lark_literal(self.call_tail)}" if self.call_tail else ""
        rules.append("obj: " + " | ".join(f'{lark_literal(self.call_head(name))} args{i}{tail}'
                                          for i, (name, _) in enumerate(schemas)))
        return rules

    def calls_lark(self, term: Term, more: int) -> tuple[list[str], str]:
        """(rules, expression): Lark for one call, or up to `more` more, given a rule `obj` that
        matches one call object."""
        raise NotImplementedError

    # -- history

    def history(self, messages: list[dict]) -> list[dict]:
        """Prior turns for a template that renders tool calls itself: each tool result gains the
        name of its call (templates print it)."""
        names = call_names(messages)
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "tool" and "name" not in m and str(m.get("tool_call_id")) in names:
                m["name"] = names[str(m.get("tool_call_id"))]
            out.append(self.history_message(m))
        return out

    def history_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """One prior message (a copy) as this format's template wants it."""
        return message
