"""A request's tool and reasoning knobs, read and checked the same way for every protocol.

Each protocol's `tools` / `tool_choice` become a `ToolPlan` (chat completions, Responses and
Anthropic messages each have their own shapes); its reasoning knobs (`reasoning_effort`,
Responses `reasoning.effort`, Anthropic `thinking`) a `ReasoningAsk`. Every mistake is a 400
naming the parameter. What the plan does to the prompt and grammar is prepare.py's job.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request
from .limits import RequestLimits

DEFAULT_LIMITS = RequestLimits()

_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")

# reasoning_effort -> token budget. "none" closes the block at once (and asks the template not to
# think, through enable_thinking=False).
# "max" (Anthropic's top output_config.effort, and a level llama-server passes on) is xhigh's equal.
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768,
                  "max": 32768}
ANTHROPIC_EFFORTS = ("low", "medium", "high", "max")  # output_config.effort
# the APIs' top level as a template may name it instead: DeepSeek V4's template has one level, "max",
# its strongest thinking mode (an instruction before the system part); V4-Flash-0731's has "high" and
# "max". A level the template names passes as it is, so "high" is 0731's high and nothing to V4's, and
# a template that names none (Qwen 3's) is given the API's name, which it does not read.
TOP_EFFORT_NAMES = {"xhigh": ("max",)}

# -- tools -----------------------------------------------------------------------------------------------


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

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them."""
        return [t.template_dict() for t in self.tools]


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


def _tool_list(tools: list[Any] | None, limits: RequestLimits, read: Callable[[Any, str], Tool | None]) -> list[Tool]:
    """The one validation of a request's tool list, whatever its protocol: its bounds (--max-tools,
    --max-tool-schema-bytes), every entry as the protocol's `read` takes it (None: a hosted tool,
    left out), and names that are unique."""
    limits.tools(tools)
    out = []
    for i, t in enumerate(tools or []):
        tool = read(t, f"tools[{i}]")
        if tool is not None:
            out.append(tool)
    return _unique(out, "tools")


def _chat_tool(t: Any, p: str) -> Tool:
    """{type: function, function: {name, description, parameters}}"""
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise bad_request(f"{p}: only function tools are supported (got {kind!r})", param=f"{p}.type",
                          code="unsupported_value")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{p}.function must be an object with a name", param=f"{p}.function")
    return _tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{p}.function")


def _responses_tool(t: Any, p: str) -> Tool | None:
    """{type: function, name, description, parameters, strict}; hosted tool types (web_search,
    file_search, computer, mcp, custom...) are not run here and are left out."""
    if not isinstance(t, dict):
        raise bad_request(f"{p} must be an object", param=p)
    if t.get("type") != "function":
        return None
    return _tool(t.get("name"), t.get("description"), t.get("parameters"), p)


def _anthropic_tool(t: Any, p: str) -> Tool | None:
    """{name, description, input_schema}; server tools (without an input_schema) are left out."""
    if not isinstance(t, dict):
        raise bad_request(f"{p} must be an object", param=p)
    if "input_schema" not in t:
        return None
    return _tool(t.get("name"), t.get("description"), t.get("input_schema"), p)


def chat_plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
              limits: RequestLimits = DEFAULT_LIMITS) -> ToolPlan:
    """OpenAI chat completions: tools [{type: function, function: {name, description, parameters}}],
    tool_choice "none" | "auto" | "required" | {type: function, function: {name}} |
    {type: allowed_tools, allowed_tools: {mode, tools: [{type: function, function: {name}}]}}."""
    plan = ToolPlan(_tool_list(tools, limits, _chat_tool), parallel=parallel is not False)
    _choice_openai(plan, tool_choice, "tool_choice", nested=True)
    return _check_choice(plan, "tool_choice")


def responses_plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
                   limits: RequestLimits = DEFAULT_LIMITS) -> ToolPlan:
    """Responses: tools [{type: function, name, description, parameters, strict}, hosted tools...],
    tool_choice "none" | "auto" | "required" | {type: function, name} | {type: allowed_tools, mode, tools}."""
    plan = ToolPlan(_tool_list(tools, limits, _responses_tool), parallel=parallel is not False)
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


def anthropic_plan(tools: list[dict] | None, tool_choice: Any, limits: RequestLimits = DEFAULT_LIMITS) -> ToolPlan:
    """Anthropic messages: tools [{name, description, input_schema}] (server tools without an
    input_schema are left out); tool_choice {type: auto | any | tool (name) | none,
    disable_parallel_tool_use}."""
    plan = ToolPlan(_tool_list(tools, limits, _anthropic_tool))
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


# -- reasoning -------------------------------------------------------------------------------------------


@dataclass
class ReasoningAsk:
    budget: int | None = None  # tokens; None: unbounded
    disabled: bool = False  # the client asked for no thinking
    effort: str | None = None  # passed to templates that read `reasoning_effort`


def effort_ask(effort: Any, param: str) -> ReasoningAsk:
    """OpenAI reasoning_effort (chat) / reasoning.effort (Responses) -> a token budget."""
    if effort is None:
        return ReasoningAsk()
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        raise bad_request(f"{param} must be one of {', '.join(EFFORT_BUDGETS)} (got {effort!r})", param=param,
                          code="invalid_value")
    budget = EFFORT_BUDGETS[effort]
    return ReasoningAsk(budget, disabled=budget == 0, effort=effort)


def template_effort(effort: str, levels: frozenset[str]) -> str:
    """The API's effort as a template that compares reasoning_effort with `levels` names it."""
    if effort in levels:
        return effort
    return next((name for name in TOP_EFFORT_NAMES.get(effort, ()) if name in levels), effort)


def effort_for_budget(budget: int | None) -> str | None:
    """The smallest named effort whose budget covers `budget` tokens (for formats with effort levels)."""
    if budget is None:
        return None
    return next((name for name, b in EFFORT_BUDGETS.items() if b >= budget), "xhigh")


def anthropic_ask(thinking: Any, max_tokens: int | None, effort: Any = None) -> ReasoningAsk:
    """Anthropic thinking {type: enabled, budget_tokens} | {type: disabled} | {type: adaptive}, and
    output_config.effort (low, medium, high, max): the level a template reads, never a budget."""
    if effort is not None and effort not in ANTHROPIC_EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(ANTHROPIC_EFFORTS)} (got {effort!r})",
                          param="output_config.effort", code="invalid_value")
    ask = _anthropic_thinking(thinking, max_tokens)
    if effort is not None and not ask.disabled:
        ask.effort = effort
    return ask


def _anthropic_thinking(thinking: Any, max_tokens: int | None) -> ReasoningAsk:
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
