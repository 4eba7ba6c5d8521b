"""Tool calls and reasoning on the API side, shared by chat completions, Responses and messages.

Request side: each protocol's `tools` / `tool_choice` become a `ToolPlan`; its reasoning knobs
(`reasoning_effort`, Responses `reasoning.effort`, Anthropic `thinking`) a `ReasoningAsk`.
`prepare` renders the prompt through the model's chat template (templates that never read `tools`
get the tools described in a system message, with the fenced-JSON calling convention, and tool
calls / results in the history rewritten to match), builds the llguidance grammar that forces a
call for `required` or a named tool, and the reasoning budget. `apply` puts them on the
GenerationRequest and attaches the `OutputPlan` the renderers read back with `output_of`.

Response side: `OutputParser` turns engine deltas into reasoning text, answer text and tool-call
events: the reasoning splitter first (so tool-call markup inside reasoning is never a call), then
the model's tool-call parser (worker/text/toolcalls.py) on the answer only.

Tool-call formats follow the template (`detect_format`): hermes `<tool_call>{...}</tool_call>`,
llama3 bare JSON, mistral `[TOOL_CALLS][...]`, and fenced ```json blocks for templates without a
convention of their own. The grammar for a forced call spells out exactly that markup with the
tool's parameter schema as `%json`, so the result always parses.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..engine.requests import Delta, GenerationRequest, ReasoningBudget
from ..text import reasoning as rz
# the event types are re-exported: the protocol modules match on toolcalling.ContentDelta etc.
from ..text.toolcalls import (  # noqa: F401
    ContentDelta, ToolCall, ToolCallArgsDelta, ToolCallStart, ToolCallStreamParser, collect, detect_format,
)
from ..text.tokenizer import TooManyTokens
from . import structured
from .common import too_long
from .errors import bad_request

MAX_PARALLEL_CALLS = 8  # a forced-call grammar allows this many calls in one turn (parallel on)
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")

# -- request side: tools ---------------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    param: str = "tools"  # where it came from, for error messages

    def template_dict(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolPlan:
    tools: list[Tool] = field(default_factory=list)  # offered to the model (none: [])
    mode: str = "auto"  # none | auto | required
    forced: str | None = None  # a named tool (mode required)
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"


def _tool(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{param}.name must be 1-128 letters, digits, '_', '-', '.' or ':' (got {name!r})",
                          param=f"{param}.name", code="invalid_value")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{param}.description must be a string", param=f"{param}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{param} parameters must be a JSON schema object", param=param, code="invalid_value")
    return Tool(name, description or "", parameters, param)


def _unique(tools: list[Tool], param: str) -> list[Tool]:
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise bad_request(f"{param}: two tools are named {t.name!r}", param=param, code="invalid_value")
        seen.add(t.name)
    return tools


def _check_choice(plan: ToolPlan, param: str) -> ToolPlan:
    if plan.mode == "required" and not plan.tools:
        raise bad_request(f"{param} requires a tool call but no tools were given", param=param,
                          code="invalid_value")
    if plan.forced is not None and plan.forced not in {t.name for t in plan.tools}:
        raise bad_request(f"{param} names the tool {plan.forced!r}, which is not among the tools", param=param,
                          code="invalid_value")
    if plan.mode == "none":
        plan.tools = []
    return plan


def chat_plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """OpenAI chat completions: tools [{type: function, function: {name, description, parameters}}],
    tool_choice "none" | "auto" | "required" | {type: function, function: {name}} |
    {type: allowed_tools, allowed_tools: {mode, tools: [{type: function, function: {name}}]}}."""
    out = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"{p}: only function tools are supported (got {kind!r})", param=f"{p}.type",
                              code="unsupported_value")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{p}.function must be an object with a name", param=f"{p}.function")
        out.append(_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{p}.function"))
    plan = ToolPlan(_unique(out, "tools"), parallel=parallel is not False)
    _choice_openai(plan, tool_choice, "tool_choice", nested=True)
    return _check_choice(plan, "tool_choice")


def responses_plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Responses: tools [{type: function, name, description, parameters, strict}]; hosted tool types
    (web_search, file_search, computer, mcp, custom...) are not run here and are left out.
    tool_choice "none" | "auto" | "required" | {type: function, name} | {type: allowed_tools, mode, tools}."""
    out = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{p} must be an object", param=p)
        if t.get("type") != "function":
            continue
        out.append(_tool(t.get("name"), t.get("description"), t.get("parameters"), p))
    plan = ToolPlan(_unique(out, "tools"), parallel=parallel is not False)
    _choice_openai(plan, tool_choice, "tool_choice", nested=False)
    return _check_choice(plan, "tool_choice")


def _choice_openai(plan: ToolPlan, choice: Any, param: str, nested: bool) -> None:
    """OpenAI's tool_choice on `plan`. nested: chat's shapes ({function: {name}}, {allowed_tools:
    {...}}); else the Responses API's flat ones ({name}, {mode, tools}). Each side also takes the
    other's shape of a named function, as clients mix them up."""
    if choice is None:
        plan.mode = "auto"
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"{param} must be none, auto, required or an object (got {choice!r})",
                              param=param, code="invalid_value")
        plan.mode = choice
        return
    if not isinstance(choice, dict):
        raise bad_request(f"{param} must be none, auto, required or an object", param=param, code="invalid_value")
    kind = choice.get("type")
    if kind == "function":
        plan.mode, plan.forced = "required", _function_name(choice, param)
    elif kind == "allowed_tools":
        spec = choice.get("allowed_tools") if nested else choice
        where = f"{param}.allowed_tools" if nested else param
        if not isinstance(spec, dict):
            raise bad_request(f"{where} must be an object with mode and tools", param=where, code="invalid_value")
        _allow(plan, spec, where)
    else:
        raise bad_request(f"{param}.type must be function or allowed_tools (got {kind!r})", param=f"{param}.type",
                          code="invalid_value")


def _function_name(ref: dict, param: str) -> str:
    """The name in {function: {name}} (chat) or {name} (Responses)."""
    fn = ref.get("function")
    if fn is not None and not isinstance(fn, dict):
        raise bad_request(f"{param}.function must be an object with a name", param=f"{param}.function",
                          code="invalid_value")
    name = fn.get("name") if fn is not None else ref.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param} names no function", param=param, code="invalid_value")
    return name


def _allow(plan: ToolPlan, spec: dict, param: str) -> None:
    """allowed_tools: offer only the listed function tools, in `mode` (auto or required)."""
    mode = spec.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise bad_request(f"{param}.mode must be auto or required (got {mode!r})", param=f"{param}.mode",
                          code="invalid_value")
    listed = spec.get("tools")
    if not isinstance(listed, list):
        raise bad_request(f"{param}.tools must be a list of tools", param=f"{param}.tools", code="invalid_value")
    names = set()
    for i, ref in enumerate(listed):
        where = f"{param}.tools[{i}]"
        if not isinstance(ref, dict):
            raise bad_request(f"{where} must be an object", param=where, code="invalid_value")
        if ref.get("type", "function") == "function":  # hosted tools (mcp, web_search...) are not run here
            names.add(_function_name(ref, where))
    offered = {t.name for t in plan.tools}
    for name in sorted(names - offered):
        raise bad_request(f"{param}.tools names {name!r}, which is not among the tools", param=f"{param}.tools",
                          code="invalid_value")
    plan.tools = [t for t in plan.tools if t.name in names]
    plan.mode = mode


def anthropic_plan(tools: list[dict] | None, tool_choice: Any) -> ToolPlan:
    """Anthropic messages: tools [{name, description, input_schema}] (server tools without an
    input_schema are left out); tool_choice {type: auto | any | tool (name) | none,
    disable_parallel_tool_use}."""
    out = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{p} must be an object", param=p)
        if "input_schema" not in t:
            continue
        out.append(_tool(t.get("name"), t.get("description"), t.get("input_schema"), p))
    plan = ToolPlan(_unique(out, "tools"))
    if tool_choice is not None:
        if not isinstance(tool_choice, dict):
            raise bad_request("tool_choice must be an object with a type", param="tool_choice")
        kind = tool_choice.get("type")
        if kind == "auto":
            plan.mode = "auto"
        elif kind == "any":
            plan.mode = "required"
        elif kind == "none":
            plan.mode = "none"
        elif kind == "tool":
            name = tool_choice.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request("tool_choice.name is required with type tool", param="tool_choice.name")
            plan.mode, plan.forced = "required", name
        else:
            raise bad_request(f"tool_choice.type must be auto, any, tool or none (got {kind!r})",
                              param="tool_choice.type", code="invalid_value")
        no_parallel = tool_choice.get("disable_parallel_tool_use", False)
        if not isinstance(no_parallel, bool):
            raise bad_request("tool_choice.disable_parallel_tool_use must be true or false",
                              param="tool_choice.disable_parallel_tool_use", code="invalid_value")
        plan.parallel = not no_parallel
    return _check_choice(plan, "tool_choice")


# -- request side: reasoning -----------------------------------------------------------------------------


@dataclass
class ReasoningAsk:
    budget: int | None = None  # tokens; None: unbounded
    disabled: bool = False  # the client asked for no thinking
    effort: str | None = None  # passed to templates that read `reasoning_effort`


def effort_ask(effort: Any, param: str) -> ReasoningAsk:
    """OpenAI reasoning_effort (chat) / reasoning.effort (Responses) -> a token budget."""
    if effort is None:
        return ReasoningAsk()
    if not isinstance(effort, str) or effort not in rz.EFFORT_BUDGETS:
        raise bad_request(f"{param} must be one of {', '.join(rz.EFFORT_BUDGETS)} (got {effort!r})", param=param,
                          code="invalid_value")
    budget = rz.EFFORT_BUDGETS[effort]
    return ReasoningAsk(budget, disabled=budget == 0, effort=effort)


def anthropic_ask(thinking: Any, max_tokens: int | None) -> ReasoningAsk:
    """Anthropic thinking {type: enabled, budget_tokens} | {type: disabled} | {type: adaptive}."""
    if thinking is None:
        return ReasoningAsk()
    if not isinstance(thinking, dict):
        raise bad_request("thinking must be an object with a type", param="thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return ReasoningAsk(0, disabled=True)
    if kind == "adaptive":
        return ReasoningAsk()
    if kind != "enabled":
        raise bad_request(f"thinking.type must be enabled, disabled or adaptive (got {kind!r})",
                          param="thinking.type", code="invalid_value")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request(f"thinking.budget_tokens must be a positive integer (got {budget!r})",
                          param="thinking.budget_tokens", code="invalid_value")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"max_tokens ({max_tokens}) must be greater than thinking.budget_tokens ({budget})",
                          param="thinking.budget_tokens", code="invalid_value")
    return ReasoningAsk(budget)


# -- per-model facts -------------------------------------------------------------------------------------

_REASONING_OVERRIDE: str | None = None  # "auto" | "none" | name | "START,END" (see reasoning.parse_override)


def configure(reasoning_format: str | None) -> None:
    """Set the reasoning markers for the served model (a worker setting); validated here."""
    global _REASONING_OVERRIDE
    rz.parse_override(reasoning_format)  # raises ReasoningConfigError on a bad value
    _REASONING_OVERRIDE = reasoning_format
    _model_facts.cache_clear()


@dataclass(frozen=True)
class ModelFacts:
    tool_format: str
    native_tools: bool  # the template reads `tools`
    reasoning: rz.ReasoningFormat | None
    marker_tokens: tuple[tuple[int, str], ...]  # special tokens the detokenizer hides but we must see
    token_refs: tuple[tuple[str, int], ...]  # markers that are one token: grammar references them by id


@lru_cache(maxsize=8)
def _model_facts(template: Any, tokenizer: Any) -> ModelFacts:
    source = getattr(template, "source", "") or ""
    fmt = detect_format(source)
    choice = rz.parse_override(_REASONING_OVERRIDE)
    reasoning = rz.detect(source, tokenizer) if choice == "auto" else choice
    markers = {"<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"}
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
    return ModelFacts(fmt, bool(getattr(template, "supports_tools", False)), reasoning, tuple(hidden), tuple(refs))


def model_facts(ctx: Any) -> ModelFacts:
    model = ctx.model
    return _model_facts(model.template, model.tokenizer)


# -- prompt ----------------------------------------------------------------------------------------------


def _fenced_call(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "```json\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n```"


def tools_system_text(tools: list[Tool], plan: ToolPlan) -> str:
    """The tools and the fenced-JSON calling convention, for templates without tool support."""
    lines = ["# Tools", "", "You can call these functions (JSON schemas):"]
    for t in tools:
        lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                ensure_ascii=False))
    lines += ["", "To call a function, answer with a JSON object in a fenced block, one block per call:",
              "```json", '{"name": "<function name>", "arguments": {<arguments>}}', "```",
              "Results come back in a message that starts with \"Tool result\"."]
    if plan.forced:
        lines.append(f"Call the function {plan.forced} now.")
    elif plan.mode == "required":
        lines.append("Call at least one function now.")
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def _mistral_id(call_id: Any) -> str:
    """Mistral templates insist on 9-character alphanumeric ids; map others onto such ids stably."""
    s = str(call_id or "")
    if len(s) == 9 and s.isalnum():
        return s
    return hashlib.sha1(s.encode()).hexdigest()[:9]


def template_messages(messages: list[dict], plan: ToolPlan, facts: ModelFacts) -> tuple[list[dict], list | None]:
    """(messages, tools) for the template: native tool support passes both through (tool messages
    gain the `name` of their call); otherwise tools go into the system message and calls / results
    in the history become fenced JSON and "Tool result" user turns."""
    names: dict[str, str] = {}
    for m in messages:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            if c.get("id"):
                names[str(c["id"])] = fn.get("name", "")
    if facts.native_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "tool" and "name" not in m and str(m.get("tool_call_id")) in names:
                m["name"] = names[str(m.get("tool_call_id"))]
            if facts.tool_format == "mistral":
                if m.get("tool_calls"):
                    m["tool_calls"] = [{**c, "id": _mistral_id(c.get("id"))} for c in m["tool_calls"]]
                if m.get("role") == "tool":
                    m["tool_call_id"] = _mistral_id(m.get("tool_call_id"))
            out.append(m)
        return out, [t.template_dict() for t in plan.tools] or None
    out = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [_fenced_call((c.get("function") or {}).get("name", ""), (c.get("function") or {}).get("arguments"))
                     for c in m["tool_calls"]]
            text = _text(m.get("content"))
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + calls)})
        elif role == "tool":
            cid = str(m.get("tool_call_id") or "")
            label = names.get(cid) or m.get("name") or "tool"
            piece = f"Tool result ({label}, call {cid}):\n{_text(m.get('content'))}" if cid else \
                f"Tool result ({label}):\n{_text(m.get('content'))}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n\n" + piece
            else:
                out.append({"role": "user", "content": piece, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if plan.tools:
        text = tools_system_text(plan.tools, plan)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _text(out[0].get("content")) + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


# -- grammar ---------------------------------------------------------------------------------------------


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _marker(text: str, facts: ModelFacts) -> str:
    """A markup string in Lark: a token reference when it is one special token of the vocabulary
    (the model is trained to emit that token, and its text may be hidden), else a literal."""
    hidden = {m for _, m in facts.marker_tokens}
    if text in hidden:
        return f"<[{dict(facts.token_refs)[text]}]>"
    return _lit(text)


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


def tool_grammar(plan: ToolPlan, facts: ModelFacts, *, reasoning_open: bool | None = None) -> str:
    """An llguidance grammar that forces one call (or up to MAX_PARALLEL_CALLS) in the model's format.
    reasoning_open: None (no reasoning), False (an optional reasoning block may come first), True
    (the prompt opened the block: the output starts inside it)."""
    import llguidance

    tools = [t for t in plan.tools if plan.forced is None or t.name == plan.forced]
    fmt = facts.tool_format
    args_key = "parameters" if fmt == "llama3" else "arguments"
    rules, alts = [], []
    for i, t in enumerate(tools):
        validate_schema(t)
        rules.append(f"args{i}: %json{_schema_json(t.parameters)}")
        head = "{" + f'"name": {json.dumps(t.name, ensure_ascii=False)}, "{args_key}": '
        alts.append(f"{_lit(head)} args{i} \"}}\"")
    rules.append("obj: " + " | ".join(alts))
    # a named tool is one call of it (as OpenAI and vLLM do); `required` may call several in parallel
    more = MAX_PARALLEL_CALLS - 1 if plan.parallel and plan.forced is None else 0
    if fmt == "hermes":
        rules.append(f"call: {_marker('<tool_call>', facts)} \"\\n\" obj \"\\n\" {_marker('</tool_call>', facts)}")
        calls = f'call ("\\n" call){{0,{more}}}' if more else "call"
    elif fmt == "mistral":
        calls = f'{_marker("[TOOL_CALLS]", facts)} "[" obj (", " obj){{0,{more}}} "]"' if more else \
            f'{_marker("[TOOL_CALLS]", facts)} "[" obj "]"'
    elif fmt == "llama3":
        calls = f'obj ("\\n" obj){{0,{more}}}' if more else "obj"
    else:  # fenced
        rules.append('call: "```json\\n" obj "\\n```"')
        calls = f'call ("\\n" call){{0,{more}}}' if more else "call"
    r = facts.reasoning
    hidden = {m for _, m in facts.marker_tokens}
    if reasoning_open is None or r is None:
        start = f"start: {calls}"
    elif r.end in hidden:
        # a special-token end marker cannot end a text lexeme in llguidance: no free reasoning
        # before a forced call; if the prompt opened the block, close it at once
        start = f"start: {_marker(r.end, facts)} {calls}" if reasoning_open else f"start: {calls}"
    else:
        # the reasoning text runs until (and includes) the end marker; a `stop` lexeme, since a
        # lazy regex followed by the marker trips an llguidance assertion
        rules.append(f"think_text[stop={_lit(r.end)}]: /(.|\\n)*/")
        ws = '/[ \\n]{0,2}/'
        if reasoning_open:
            start = f"start: think_text {ws} {calls}"
        else:
            start = f"start: ({_marker(r.start, facts)} think_text {ws})? {calls}"
    lark = "\n".join([start, *rules])
    grammar = llguidance.grammar_from("lark", lark)
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:  # pragma: no cover - the schemas were validated one by one above
        raise bad_request(f"tool_choice: cannot build the tool-call grammar: {' '.join(err.split())}",
                          param="tool_choice", code="invalid_schema")
    return grammar


# -- prepare / apply -------------------------------------------------------------------------------------


@dataclass
class OutputPlan:
    """What the response renderers need to split the output."""

    tool_format: str | None  # None: no tool-call parsing
    reasoning: rz.ReasoningFormat | None
    inside: bool  # generation starts inside the reasoning block
    marker_tokens: tuple[tuple[int, str], ...] = ()
    tool_names: frozenset[str] = frozenset()
    forced: bool = False  # a grammar forces the output into calls (tool_choice required or named)

    def parser(self, tokenizer: Any = None, **kw: Any) -> "OutputParser":
        return OutputParser(self, tokenizer, **kw)


@dataclass
class Prepared:
    prompt: list[int]
    grammar: str | None
    reasoning: ReasoningBudget | None
    output: OutputPlan


async def prepare(ctx: Any, messages: list[dict], plan: ToolPlan, ask: ReasoningAsk | None, param: str,
                  *, structured: bool = False, bounded: bool = True) -> Prepared:
    """Render and tokenize the prompt; build the grammar and reasoning budget for this request.
    structured: the answer is grammar-constrained from its first token (a response format), so a
    reasoning block the template opens is closed in the prompt: the document is the answer, never
    swallowed into reasoning. bounded: refuse a prompt past the context as soon as that is known
    (before tokenizing, when its length alone shows it)."""
    from ..text.chat_template import ChatTemplateError

    ask = ask or ReasoningAsk()
    facts = model_facts(ctx)
    msgs, tools = template_messages(messages, plan, facts)
    template = ctx.model.template
    kwargs: dict[str, Any] = {}
    if facts.reasoning is not None:
        if ask.disabled:
            kwargs["enable_thinking"] = False  # Qwen 3 style templates then pre-close the block
        if ask.effort and ask.effort != "none":
            kwargs["reasoning_effort"] = ask.effort

    limit = ctx.prompt_limit if bounded else None

    def build() -> tuple[str, list[int]]:
        return template.render_encode(msgs, add_generation_prompt=True, tools=tools, limit=limit, **kwargs)

    try:
        text, prompt = await asyncio.to_thread(build)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template could not render these messages: {e}", param=param,
                          code="invalid_messages") from None
    except TooManyTokens as e:
        raise too_long(ctx, e, param) from None
    r = facts.reasoning
    inside = r is not None and rz.starts_inside(text, r)
    if structured and inside:
        prompt = prompt + ctx.tokenizer.encode(r.end + "\n\n", add_special=False, parse_special=True)
        inside, ask = False, ReasoningAsk(disabled=True)
    budget = None
    if r is not None and ask.budget is not None:
        tok = ctx.tokenizer
        budget = ReasoningBudget(tok.encode(r.start, add_special=False, parse_special=True),
                                 tok.encode(r.end, add_special=False, parse_special=True),
                                 ask.budget, starts_inside=inside)
    grammar = None
    if plan.active and plan.mode == "required":
        # a block the template opened must be closable (the engine closes it when the budget is
        # spent); otherwise one may be opened only when thinking is not switched off
        opening = None if r is None else (True if inside else (None if ask.disabled else False))
        grammar = await asyncio.to_thread(tool_grammar, plan, facts, reasoning_open=opening)
    output = OutputPlan(facts.tool_format if plan.active else None, r, inside, facts.marker_tokens,
                        frozenset(t.name for t in plan.tools), forced=grammar is not None)
    return Prepared(prompt, grammar, budget, output)




def apply(req: GenerationRequest, prep: Prepared) -> GenerationRequest:
    if prep.grammar is not None:
        if req.grammar is not None:
            raise bad_request("a forced tool call (tool_choice required or a named tool) cannot be combined with "
                              "a structured output format", param="tool_choice", code="invalid_value")
        req.grammar = prep.grammar
    if prep.reasoning is not None:
        req.reasoning = prep.reasoning
    req.output_plan = prep.output
    return req


def output_of(req: GenerationRequest | None) -> OutputPlan:
    plan = req.output_plan if req is not None else None
    return plan if plan is not None else OutputPlan(None, None, False)


# -- response side ---------------------------------------------------------------------------------------


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class Parsed:
    """A whole non-streaming result."""

    reasoning: str
    content: str
    calls: list  # toolcalls.ToolCall
    reasoning_tokens: int
    reasoning_open: bool


class OutputParser:
    """Engine deltas -> ReasoningDelta / ContentDelta / ToolCallStart / ToolCallArgsDelta events."""

    def __init__(self, plan: OutputPlan, tokenizer: Any = None, *, id_factory=None, args_chunk: int = 0):
        self.plan = plan
        self.tokenizer = tokenizer
        self.split = rz.ReasoningSplitter(plan.reasoning, inside=plan.inside)
        self.tools = (ToolCallStreamParser(plan.tool_format, id_factory, args_chunk, forced=plan.forced)
                      if plan.tool_format else None)
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
        was_open = self.split.open
        if tokens:
            text = self._restore(text, tokens)
        pieces = self.split.feed(text)
        if tokens and (was_open or self.split.open or any(k == rz.REASONING for k, _ in pieces)):
            self.reasoning_tokens += len(tokens)
        return self._route(pieces)

    def finish(self) -> list:
        out = self._route(self.split.finish())
        if self.tools is not None:
            out += self.tools.finish()
        return _merge(out)

    def _route(self, pieces: list[tuple[str, str]]) -> list:
        out: list = []
        for kind, text in pieces:
            if kind == rz.REASONING:
                out.append(ReasoningDelta(text))
            elif self.tools is not None:
                out += self.tools.feed(text)
            else:
                out.append(ContentDelta(text))
        return _merge(out)

    @property
    def reasoning_open(self) -> bool:
        return self.split.open

    def parse_all(self, text: str, tokens: list[int] | None = None) -> Parsed:
        events = self.feed(text, tokens) + self.finish()
        answer = collect(events)  # content and calls; reasoning deltas are not its concern
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        return Parsed(reasoning, answer.content, answer.tool_calls, self.reasoning_tokens, self.split.open)


def _merge(events: list) -> list:
    out: list = []
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)) and not e.text:
            continue
        if out and type(out[-1]) is type(e) and isinstance(e, (ContentDelta, ReasoningDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
            continue
        out.append(e)
    return out


def parse_arguments(arguments: str) -> dict:
    """A call's arguments JSON as a dict (Anthropic's tool_use.input)."""
    try:
        v = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}
