"""Reasoning ("thinking") formats: which markers a model writes its reasoning between, one class each.

Thinking models write their reasoning first, between markers such as ``<think>``/``</think>``
(Qwen 3, QwQ, DeepSeek R1), ``<seed:think>`` (Seed-OSS), ``[THINK]``/``[/THINK]`` (Magistral) or
``<|START_THINKING|>``/``<|END_THINKING|>`` (Command A reasoning). Each format owns its markers, its
streaming splitter (reasoning_stream.py), and the Lark that lets a forced tool call be preceded by
reasoning. `detect` picks the format from the chat template (it mentions the start marker) or,
failing that, the vocabulary (both markers are single tokens); `parse_override` reads an explicit
choice (a name, "START,END", or "none"). Harmony's analysis channel (harmony.py HarmonyAnalysis) is
a subclass whose markers bound the reasoning budget and whose grammar puts one analysis message
before a forced call; its output is split by the Harmony parser, never by a splitter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .lark import Term, lark_literal
from .reasoning_stream import ReasoningSplitter


class ReasoningConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning block between two markers (the base, and the configured "START,END" pair)."""

    start: str
    end: str
    name: str = "custom"

    def splitter(self, *, inside: bool = False) -> ReasoningSplitter:
        return ReasoningSplitter(self, inside=inside)

    def starts_inside(self, prompt_text: str) -> bool:
        """True when the rendered prompt ends inside an open reasoning block (the template opened it)."""
        i = prompt_text.rfind(self.start)
        return i >= 0 and i > prompt_text.rfind(self.end) and not prompt_text[i + len(self.start):].strip()

    def before_calls_lark(self, calls: str, reasoning_open: bool, term: Term,
                          hidden: set[str]) -> tuple[str, list[str]]:
        """(start rule, extra rules): the forced `calls` after an optional reasoning block (or the
        rest of the block, when the prompt opened it). hidden: markers that are special tokens."""
        if self.end in hidden:
            # a special-token end marker cannot end a text lexeme in llguidance: no free reasoning
            # before a forced call; if the prompt opened the block, close it at once
            return (f"start: {term(self.end)} {calls}" if reasoning_open else f"start: {calls}"), []
        # the reasoning text runs until (and includes) the end marker; a `stop` lexeme, since a
        # lazy regex followed by the marker trips an llguidance assertion
        rules = [f"think_text[stop={lark_literal(self.end)}]: /(.|\\n)*/"]
        ws = '/[ \\n]{0,2}/'
        if reasoning_open:
            return f"start: think_text {ws} {calls}", rules
        return f"start: ({term(self.start)} think_text {ws})? {calls}", rules


@dataclass(frozen=True)
class ThinkTags(ReasoningFormat):
    start: str = "<think>"
    end: str = "</think>"
    name: str = "think"


@dataclass(frozen=True)
class SeedThink(ReasoningFormat):
    start: str = "<seed:think>"
    end: str = "</seed:think>"
    name: str = "seed"


@dataclass(frozen=True)
class MistralThink(ReasoningFormat):
    start: str = "[THINK]"
    end: str = "[/THINK]"
    name: str = "mistral"


@dataclass(frozen=True)
class CommandThink(ReasoningFormat):
    start: str = "<|START_THINKING|>"
    end: str = "<|END_THINKING|>"
    name: str = "command"


# in detection order (frozen: one instance of each serves every model)
REASONING_FORMATS: tuple[ReasoningFormat, ...] = (ThinkTags(), SeedThink(), MistralThink(), CommandThink())


def parse_override(value: str | None) -> ReasoningFormat | None | Literal["auto"]:
    """A configured reasoning format: "auto" (or empty: detect), "none" (no reasoning parsing),
    a known name ("think", "mistral"...) or "START,END". Returns "auto", None or a format."""
    v = (value or "").strip()
    if not v or v.lower() == "auto":
        return "auto"
    if v.lower() in ("none", "off", "false"):
        return None
    for fmt in REASONING_FORMATS:
        if v.lower() == fmt.name:
            return fmt
    if "," in v:
        start, end = (p.strip() for p in v.split(",", 1))
        if start and end and start != end:
            return ReasoningFormat(start, end)
    raise ReasoningConfigError(f"reasoning format {value!r}: use auto, none, one of "
                               f"{', '.join(fmt.name for fmt in REASONING_FORMATS)}, or START,END markers")


def detect(template_source: str | None, tokenizer: Any = None) -> ReasoningFormat | None:
    """The model's reasoning format, or None for a model that does not think."""
    src = template_source or ""
    for fmt in REASONING_FORMATS:
        if fmt.start in src:
            return fmt
    if tokenizer is not None:
        for fmt in REASONING_FORMATS:
            if tokenizer.id_of(fmt.start) is not None and tokenizer.id_of(fmt.end) is not None:
                return fmt
    return None
