"""A chat request's prompt, forced-call grammar and reasoning budget, from its tool and reasoning plan.

`prepare` renders the prompt through the model's chat template with the history as the model's
formats want it (text/formats: a template that never reads `tools` gets them described in a system
message, with the fenced-JSON convention), builds the llguidance grammar that forces a call for
`required` or a named tool (the format's own markup around each tool's bounded parameter schema, so
the result always parses), and the reasoning budget. `apply` puts them on the GenerationRequest
with the `OutputPlan` the renderers read back (output_parser.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from ..engine.requests import GenerationRequest, MessageSpans, ReasoningBudget
from ..text.chat_template import message_starts
from ..text.formats import ModelFormats
from . import common, structured
from .errors import bad_request
from .output_parser import OutputPlan
from .tool_plan import ReasoningAsk, Tool, ToolPlan, effort_for_budget, template_effort

MAX_PARALLEL_CALLS = 8  # a forced-call grammar allows this many calls in one turn (parallel on)
SPANS_INLINE_CHARS = 1 << 16  # a longer prompt's messages are found off the event loop


def _schema_json(schema: dict) -> str:
    # bounded as response formats are: a forced call must close before the output cap, never run
    # away in an unbounded string or digit run
    s = dict(structured.bound_schema(schema))
    # compact output: a constrained small model must not be able to pad with endless whitespace
    s.setdefault("x-guidance", {"whitespace_flexible": False})
    return json.dumps(s, ensure_ascii=False, separators=(",", ":"))


def validate_schema(tool: Tool) -> None:
    import llguidance

    grammar = llguidance.grammar_from("lark", "start: a\na: %json" + _schema_json(tool.parameters))
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        msg = " ".join(err.split())
        raise bad_request(f"{tool.param}: the parameters schema of tool {tool.name!r} cannot be enforced: {msg}",
                          param=tool.param, code="invalid_schema")


def tool_grammar(plan: ToolPlan, formats: ModelFormats, *, reasoning_open: bool | None = None) -> str:
    """An llguidance grammar that forces one call (or up to MAX_PARALLEL_CALLS) in the model's format.
    reasoning_open: None (no reasoning), False (an optional reasoning block may come first), True
    (the prompt opened the block: the output starts inside it)."""
    import llguidance

    tools = [t for t in plan.tools if plan.forced is None or t.name == plan.forced]
    for t in tools:
        validate_schema(t)
    # a named tool is one call of it (as OpenAI and vLLM do); `required` may call several in parallel
    more = MAX_PARALLEL_CALLS - 1 if plan.parallel and plan.forced is None else 0
    lark = formats.forced_calls_lark([(t.name, _schema_json(t.parameters)) for t in tools], more, reasoning_open)
    grammar = llguidance.grammar_from("lark", lark)
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:  # pragma: no cover - the schemas were validated one by one above
        raise bad_request(f"tool_choice: cannot build the tool-call grammar: {' '.join(err.split())}",
                          param="tool_choice", code="invalid_schema")
    return grammar


@dataclass
class Prepared:
    prompt: list[int]
    grammar: str | None
    reasoning: ReasoningBudget | None
    output: OutputPlan
    spans: MessageSpans | None = None


async def prepare(ctx: Any, messages: list[dict], plan: ToolPlan, ask: ReasoningAsk | None, param: str,
                  *, structured: bool = False, bounded: bool = True) -> Prepared:
    """Render and tokenize the prompt; build the grammar and reasoning budget for this request.
    structured: the answer is grammar-constrained from its first token (a response format), so a
    reasoning block the template opens is closed in the prompt: the document is the answer, never
    swallowed into reasoning. bounded: refuse a prompt past the context as soon as that is known
    (before tokenizing, when its length alone shows it)."""
    ask = ask or ReasoningAsk()
    formats: ModelFormats = ctx.formats
    msgs, tools = formats.prompt_messages(messages, plan.template_tools(), plan.forced, plan.mode == "required")
    kwargs: dict[str, Any] = {}
    r = formats.reasoning
    if formats.channels is not None:  # Harmony: the effort becomes its reasoning level (low/medium/high)
        kwargs["reasoning_effort"] = ask.effort or effort_for_budget(ask.budget)
    elif r is not None:
        # a thinking model thinks unless asked not to (as llama-server does): Qwen 3 style templates
        # then leave the block to the model or pre-close it; DeepSeek's, off by default, open or close it
        kwargs["enable_thinking"] = not ask.disabled
        # the effort asked for, or the one whose budget covers the thinking budget asked for (Anthropic's
        # budget_tokens: 31999 is xhigh), as the template names it (xhigh: DeepSeek V4's "max")
        effort = ask.effort or effort_for_budget(ask.budget)
        if effort and effort != "none" and not ask.disabled:
            kwargs["reasoning_effort"] = template_effort(effort, ctx.model.template.effort_levels)
    text, prompt = await common.render_prompt(ctx, msgs, tools, param, bounded=bounded, **kwargs)
    roles = [str(m.get("role", "")) if isinstance(m, dict) else "" for m in msgs]
    starts = (message_starts(text, msgs) if len(text) <= SPANS_INLINE_CHARS
              else await asyncio.to_thread(message_starts, text, msgs))
    inside = r is not None and r.starts_inside(text)
    if structured and inside and r is not None:  # (inside: r is not None)
        prompt = prompt + ctx.tokenizer.encode(r.end + "\n\n", add_special=False, parse_special=True)
        inside, ask = False, ReasoningAsk(disabled=True)
    budget = None
    # a response format's document has no reasoning block to bound: "<think>" written inside one of its
    # strings is text (Qwen 3 spells it with one ordinary token), and forcing "</think>" after it would
    # corrupt the document, or fail the request where the schema refuses the marker
    if r is not None and ask.budget is not None and not structured:
        tok = ctx.tokenizer
        budget = ReasoningBudget(tok.encode(r.start, add_special=False, parse_special=True),
                                 tok.encode(r.end, add_special=False, parse_special=True),
                                 ask.budget, starts_inside=inside)
    grammar = None
    if plan.active and plan.mode == "required":
        # a block the template opened must be closable (the engine closes it when the budget is
        # spent); otherwise one may be opened only when thinking is not switched off
        opening = None if r is None else (True if inside else (None if ask.disabled else False))
        grammar = await asyncio.to_thread(tool_grammar, plan, formats, reasoning_open=opening)
    output = OutputPlan(formats.tool if plan.active else None, None if structured else r, inside,
                        formats.marker_tokens, forced=grammar is not None, channels=formats.channels)
    return Prepared(prompt, grammar, budget, output, MessageSpans(starts, roles))


def apply(req: GenerationRequest, prep: Prepared) -> GenerationRequest:
    if prep.grammar is not None:
        if req.grammar is not None:
            raise bad_request("a forced tool call (tool_choice required or a named tool) cannot be combined with "
                              "a structured output format", param="tool_choice", code="invalid_value")
        req.grammar = prep.grammar
    if prep.reasoning is not None:
        req.reasoning = prep.reasoning
    req.output_plan = prep.output
    req.message_spans = prep.spans
    return req
