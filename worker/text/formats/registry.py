"""Which formats a model speaks, resolved once per model when it loads.

TOOL_FORMATS lists the tool-call formats in detection order: the first whose signals appear in
the chat template wins, and fenced JSON (any template) comes last. Reasoning formats are detected
likewise (reasoning.py), unless the worker's `reasoning_format` setting names one. A model served
through its family's built-in template (its file has none) speaks what the family's recipe declares
for it instead (model/arch/recipe.Formats: the tool-call format, and the reasoning markers where it
names them). `resolve` reads the template and the vocabulary once and answers a ModelFormats, which
the API keeps beside the model (api/state.py); nothing here is global state.

Harmony (gpt-oss) owns the whole turn: when it is detected, `ModelFormats.channels` is the format
that renders the prompt and parses the output, and its analysis channel is the reasoning format
(the `reasoning_format` setting does not apply). It needs openai_harmony's vocabulary file; when no
verified copy can be had offline (harmony_vocab.py) the model falls back to its chat template and
fenced JSON, with one warning line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.worker.logs import log

from ..harmony_vocab import HarmonyUnavailable, harmony_encoding
from .dsml import Dsml
from .fenced import FencedJson
from .harmony import Harmony
from .hermes import Hermes
from .lark import lark_literal
from .llama3 import Llama3
from .mistral import Mistral
from .reasoning import ReasoningFormat, detect, parse_override
from .tool_format import ToolFormat

if TYPE_CHECKING:
    from ember.worker.model.arch.recipe import Formats

TOOL_FORMATS: tuple[type[ToolFormat], ...] = (Harmony, Dsml, Hermes, Mistral, Llama3, FencedJson)


def tool_format(name: str) -> ToolFormat:
    for cls in TOOL_FORMATS:
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown tool-call format {name!r}")


def detect_tool_format(template_source: str | None) -> ToolFormat:
    source = template_source or ""
    return next(cls for cls in TOOL_FORMATS if cls.detects(source))()


@dataclass(frozen=True)
class ModelFormats:
    """The served model's tool-call and reasoning formats, and how their markers map onto its vocabulary."""

    tool: ToolFormat
    native_tools: bool  # the template reads `tools`
    reasoning: ReasoningFormat | None
    marker_tokens: tuple[tuple[int, str], ...] = ()  # special tokens the detokenizer hides but parsers must see
    token_refs: tuple[tuple[str, int], ...] = ()  # markers that are one token: grammars reference them by id
    # markup a grammar spells as these exact tokens (Harmony's <|channel|> and analysis header: see
    # Harmony.spelled)
    spelled: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def channels(self) -> Harmony | None:
        """The format that renders the whole prompt and parses the whole output itself, if any."""
        return self.tool if isinstance(self.tool, Harmony) else None

    @property
    def hidden(self) -> set[str]:
        return {m for _, m in self.marker_tokens}

    def term(self, text: str) -> str:
        """A markup string in Lark: a token reference when it is one special token of the vocabulary
        (the model is trained to emit that token, and its text may be hidden), else a literal."""
        if text in self.hidden:
            return f"<[{dict(self.token_refs)[text]}]>"
        ids = dict(self.spelled).get(text)
        if ids:
            return " ".join(f"<[{i}]>" for i in ids)
        return lark_literal(text)

    def prompt_messages(self, messages: list[dict], tools: list[dict], forced: str | None = None,
                        required: bool = False) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for the chat template. A template that reads `tools` gets both, with the
        history as the model's format wants it; one that never does gets the tools described in a
        system message with the fenced-JSON convention, and the history rewritten to match."""
        if self.native_tools or self.channels is not None:
            return self.tool.history(messages), tools or None
        return FencedJson().describe(messages, tools, forced, required), None

    def forced_calls_lark(self, schemas: list[tuple[str, str]], more: int, reasoning_open: bool | None) -> str:
        """Lark that forces one call of the named tools (schema JSON texts), or up to `more` more, in the
        model's format. reasoning_open: None (no reasoning), False (an optional reasoning block may
        come first), True (the prompt opened the block: the output starts inside it)."""
        rules = self.tool.call_rules(schemas, self.term)
        call_rules, calls = self.tool.calls_lark(self.term, more)
        rules += call_rules
        if reasoning_open is None or self.reasoning is None:
            start = f"start: {calls}"
        else:
            start, think_rules = self.reasoning.before_calls_lark(calls, reasoning_open, self.term, self.hidden)
            rules += think_rules
        return "\n".join([start, *rules])


def resolve(template: Any, tokenizer: Any, reasoning_setting: str | None = None,
            family: Formats | None = None) -> ModelFormats:
    """The formats of a model with this chat template and vocabulary. reasoning_setting: the worker's
    `reasoning_format` ("auto" or None: detect; see reasoning.parse_override). family: what the
    model's family declares (its recipe's Formats), which holds when the template is the family's
    built-in one."""
    source = getattr(template, "source", "") or ""
    declared = family if family is not None and getattr(template, "name", None) == family.chat else None
    choice = parse_override(reasoning_setting)
    reasoning: ReasoningFormat | None
    if not isinstance(choice, str):  # the setting names one, or "none"
        reasoning = choice
    elif declared is not None and declared.reasoning is not None:
        named = parse_override(declared.reasoning)
        if not isinstance(named, ReasoningFormat):
            raise ValueError(f"the family declares reasoning {declared.reasoning!r}, which is no reasoning format")
        reasoning = named
    else:
        reasoning = detect(source, tokenizer)
    tool = tool_format(declared.tool) if declared is not None else detect_tool_format(source)
    spelled: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if isinstance(tool, Harmony):
        try:
            tool = Harmony(harmony_encoding(tokenizer))
            reasoning = tool.reasoning
            spelled = tuple((m, tuple(tokenizer.encode(m, add_special=False, parse_special=True)))
                            for m in tool.spelled)
        except HarmonyUnavailable as e:
            log("harmony_unavailable", level="warning", fallback="chat template, fenced JSON tool calls",
                error=str(e))
            tool = FencedJson()
    # every known tool-call format's markers, not only the model's: a hidden special token is put
    # back into the text whichever format it belongs to (Harmony's only for Harmony: other families
    # have an <|end|> of their own)
    markers = {m for cls in TOOL_FORMATS if cls is not Harmony for m in cls.markers} | set(tool.markers)
    if reasoning is not None:
        markers |= {reasoning.start, reasoning.end}
    hidden, refs = [], []
    for m in sorted(markers):
        i = tokenizer.id_of(m)
        if i is None:
            continue
        refs.append((m, i))
        if tokenizer.is_special(i):
            hidden.append((i, m))
    return ModelFormats(tool, bool(getattr(template, "supports_tools", False)), reasoning,
                        tuple(hidden), tuple(refs), spelled)
