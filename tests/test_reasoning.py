"""The reasoning splitter and the API-side output parser over scripted token streams: every split
point, random cuts, streams cut inside reasoning, tool-call markup inside reasoning, tool results
round-tripping through the templates, and the request knobs (reasoning_effort, thinking)."""

from __future__ import annotations

import json
import random

import pytest

from ember.worker.api import tool_plan as tp
from ember.worker.api.errors import ApiError
from ember.worker.api.output_parser import OutputParser, OutputPlan, ReasoningDelta
from ember.worker.api.prepare import tool_grammar
from ember.worker.text.formats import (
    ContentDelta,
    ModelFormats,
    ToolCallArgsDelta,
    ToolCallStart,
    resolve,
    tool_format,
)
from ember.worker.text.formats import reasoning as rz
from ember.worker.text.formats.reasoning_stream import CONTENT, REASONING, ReasoningSplitter

THINK = rz.ThinkTags()


def split_all(text: str, chunks: list[int] | None = None, *, inside: bool = False, fmt=THINK):
    """(reasoning, content, open) from feeding text in pieces of the given sizes (None: whole)."""
    s = ReasoningSplitter(fmt, inside=inside)
    pieces = []
    if chunks is None:
        pieces += s.feed(text)
    else:
        i = 0
        for n in chunks:
            pieces += s.feed(text[i:i + n])
            i += n
        pieces += s.feed(text[i:])
    open_before_finish = s.open
    pieces += s.finish()
    r = "".join(t for k, t in pieces if k == REASONING)
    c = "".join(t for k, t in pieces if k == CONTENT)
    return r, c, open_before_finish


CASES = [
    # (text, inside, reasoning, content)
    ("<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", False, "Let me add 2 and 2.", "The answer is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Let me add.\n</think>\n\n4", True, "Let me add.", "4"),
    ("No thinking here, <think> is just text.", False, "", "No thinking here, <think> is just text."),
    ("<thinking> is not the marker", False, "", "<thinking> is not the marker"),
    ("<think></think>Answer", False, "", "Answer"),
    ("<think>x</think>a </think> b", False, "x", "a  b"),  # after a block, a stray end marker is markup
    ("</think>only answer", True, "", "only answer"),
    # a second block (here: opened after a budget ran out, closed at once by the engine) stays out
    ("<think>a</think>The answer.<think></think>", False, "a", "The answer."),
    ("b</think>x<think>c</think>", True, "bc", "x"),
    ("<think>r</think>In-house</think>\n\nvisual</think</", False, "r", "In-house\n\nvisual</think</"),
]


@pytest.mark.parametrize("text,inside,want_r,want_c", CASES)
def test_every_split_point_gives_the_same_result(text, inside, want_r, want_c):
    assert split_all(text, inside=inside)[:2] == (want_r, want_c)
    for cut in range(len(text) + 1):
        assert split_all(text, [cut], inside=inside)[:2] == (want_r, want_c), cut
    # one character at a time: nothing of a marker ever leaks on either side
    assert split_all(text, [1] * len(text), inside=inside)[:2] == (want_r, want_c)


def test_random_chunkings_agree():
    rng = random.Random(7)
    for text, inside, want_r, want_c in CASES:
        for _ in range(50):
            chunks, left = [], len(text)
            while left > 0:
                n = rng.randint(1, 5)
                chunks.append(n)
                left -= n
            assert split_all(text, chunks, inside=inside)[:2] == (want_r, want_c)


def test_stream_cut_inside_reasoning_is_flushed_and_reported_open():
    full = "<think>step one, step two</think>done"
    for cut in range(len("<think>") + 1, full.index("</think>")):
        r, c, was_open = split_all(full[:cut], [1] * cut)
        assert was_open and c == ""
        assert full[len("<think>"):cut].strip().startswith(r) and r
    # cut inside the end marker: the partial marker is reasoning text (it never closed)
    r, c, was_open = split_all("<think>abc</thi")
    assert (r, c, was_open) == ("abc</thi", "", True)


def test_other_marker_families():
    fmt = rz.MistralThink()
    assert split_all("[THINK]hmm[/THINK]ok", [1] * 20, fmt=fmt)[:2] == ("hmm", "ok")
    assert split_all("[THINK]hmm[/THINK]ok", [1] * 20, fmt=rz.ReasoningFormat("[THINK]", "[/THINK]"))[:2] == \
        ("hmm", "ok")
    assert split_all("plain", fmt=None)[:2] == ("", "plain")


def test_detection_from_template_and_override():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert rz.detect(qwen3) == THINK
    assert rz.detect("{{ '[THINK]' }}").name == "mistral"
    assert rz.detect("{{ messages }}") is None
    assert rz.parse_override("none") is None
    assert rz.parse_override("auto") == "auto"
    assert rz.parse_override("<r>,</r>") == rz.ReasoningFormat("<r>", "</r>")
    with pytest.raises(rz.ReasoningConfigError):
        rz.parse_override("<r>")


def test_starts_inside_reads_how_the_prompt_ends():
    assert THINK.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not THINK.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.starts_inside("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")


# -- the API-side output parser: reasoning first, then tool calls on the answer only ---------------


def parser(tool_format_name="hermes", reasoning=THINK, inside=False):
    plan = OutputPlan(tool_format(tool_format_name) if tool_format_name else None, reasoning, inside)
    counter = iter(range(1000))
    return OutputParser(plan, id_factory=lambda: f"call_{next(counter)}")


def run(text: str, chunks: list[int] | None = None, **kw):
    p = parser(**kw)
    events = []
    if chunks is None:
        events += p.feed(text)
    else:
        i = 0
        for n in chunks:
            events += p.feed(text[i:i + n])
            i += n
        events += p.feed(text[i:])
    events += p.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append([e.name, ""])
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index][1] += e.text
    return reasoning, content, [(n, json.loads(a)) for n, a in calls]


def test_tool_call_markup_inside_reasoning_is_not_a_call():
    text = ('<think>I could write <tool_call>{"name": "rm", "arguments": {}}</tool_call> but no.</think>'
            'Here is the plan.\n<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>')
    want = ('I could write <tool_call>{"name": "rm", "arguments": {}}</tool_call> but no.', "Here is the plan.\n",
            [("ls", {"path": "/tmp"})])
    assert run(text) == want
    for cut in range(len(text) + 1):
        assert run(text, [cut]) == want, cut
    assert run(text, [1] * len(text)) == want


def test_parallel_calls_after_reasoning_started_by_the_template():
    text = ('plan: two lookups</think>\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": "</tool_call>"}}\n</tool_call>')
    want = ("plan: two lookups", "", [("a", {"x": 1}), ("b", {"y": "</tool_call>"})])
    rng = random.Random(3)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text)), 6))
        chunks = [b - a for a, b in zip([0] + cuts, cuts, strict=False)]
        assert run(text, chunks, inside=True) == want


@pytest.mark.parametrize("fmt,text", [
    ("fenced", 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_each_format_through_the_output_parser(fmt, text):
    r, c, calls = run(text, [1] * len(text), tool_format_name=fmt, reasoning=None)
    assert r == "" and calls == [("get_weather", {"city": "Oslo"})]
    assert c.strip() in ("", "Sure.")


def test_no_tools_means_no_parsing():
    text = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    assert run(text, tool_format_name=None, reasoning=None) == ("", text, [])


# -- tool results round-trip through the templates --------------------------------------------------


@pytest.fixture(scope="module")
def gemma_model(default_model_path):
    from ember.worker.model.loader import open_model

    return open_model(default_model_path)


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.mark.parametrize("builtin", ["chatml", "llama3", "gemma"])
def test_history_round_trips_through_template_and_parser(gemma_model, builtin):
    """A call rendered into the prompt by the template parses back with the model's parser, and
    the tool result reaches the prompt."""
    from ember.worker.text.chat_template import ChatTemplate

    template = ChatTemplate.builtin(builtin, gemma_model.tokenizer)
    facts = resolve(template, gemma_model.tokenizer)
    plan = tp.chat_plan(TOOLS, "auto", None)
    msgs, tools = facts.prompt_messages(HISTORY, plan.template_tools(), plan.forced, plan.mode == "required")
    prompt = template.render(msgs, tools=tools)
    assert "-3 C, snow" in prompt and "get_weather" in prompt
    assert bool(tools) == facts.native_tools
    # the assistant turn as the template wrote it, parsed back
    turn = template.render(msgs[:2] if facts.native_tools else msgs[:3], tools=tools, add_generation_prompt=False)
    rendered_call = turn[turn.rindex('{"name"') - 20:]
    for stop in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        rendered_call = rendered_call.split(stop)[0]
    start = min(i for i in (rendered_call.find("<tool_call>"), rendered_call.find("```json"),
                            rendered_call.find('{"name"')) if i >= 0)
    r, c, calls = run(rendered_call[start:], [3] * 100, tool_format_name=facts.tool.name, reasoning=None)
    assert calls == [("get_weather", {"city": "Oslo"})]


def test_forced_call_grammar_is_valid_for_each_format(gemma_model):
    import llguidance

    from ember.worker.text.chat_template import ChatTemplate

    plan = tp.chat_plan(TOOLS + [{"type": "function", "function": {"name": "noop"}}], "required", None)
    for builtin in ("chatml", "llama3", "gemma"):
        facts = resolve(ChatTemplate.builtin(builtin, gemma_model.tokenizer), gemma_model.tokenizer)
        for inside in (None, False, True):
            g = tool_grammar(plan, ModelFormats(facts.tool, True, THINK), reasoning_open=inside)
            assert llguidance.LLMatcher.validate_grammar(g) == ""
    bad = tp.chat_plan([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}], "required", None)
    with pytest.raises(ApiError) as e:
        tool_grammar(bad, facts)
    assert e.value.status == 400 and e.value.param == "tools[0].function"


def test_forced_call_arguments_are_bounded_like_response_formats(gemma_model):
    """A forced call's unbounded strings and numbers get the structured-output bounds, so a looping
    model closes the call before the output cap (Claude Code's `max_results: number` ran away)."""
    from ember.worker.text.chat_template import ChatTemplate

    plan = tp.anthropic_plan([{"name": "ToolSearch", "input_schema": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "number", "default": 5}}, "required": ["query"]}}],
        {"type": "tool", "name": "ToolSearch"})
    facts = resolve(ChatTemplate.builtin("gemma", gemma_model.tokenizer), gemma_model.tokenizer)
    g = json.dumps(tool_grammar(plan, facts))
    assert "maxLength" in g and "9007199254740991" in g and "additionalProperties" in g


def test_formats_resolve_per_model_with_the_reasoning_setting(gemma_model):
    """The worker's reasoning setting goes into each resolution: no process-wide state, so two
    resolutions with different settings keep their own formats."""
    from ember.worker.text.chat_template import ChatTemplate

    tok = gemma_model.tokenizer
    template = ChatTemplate.builtin("chatml", tok)
    auto, off, magistral = resolve(template, tok), resolve(template, tok, "none"), resolve(template, tok, "mistral")
    assert (auto.tool.name, auto.reasoning, off.reasoning) == ("hermes", None, None)
    assert magistral.reasoning == rz.MistralThink() and magistral.tool.name == "hermes"
    assert resolve(template, tok, "<r>,</r>").reasoning == rz.ReasoningFormat("<r>", "</r>")
    with pytest.raises(rz.ReasoningConfigError):
        resolve(template, tok, "sometimes")


# -- request knobs ---------------------------------------------------------------------------------


def test_reasoning_effort_and_thinking_map_to_budgets():
    assert tp.effort_ask("low", "reasoning_effort").budget == tp.EFFORT_BUDGETS["low"]
    assert tp.effort_ask("none", "reasoning_effort").disabled
    assert tp.effort_ask(None, "reasoning_effort").budget is None
    assert tp.anthropic_ask({"type": "enabled", "budget_tokens": 2048}, 4096).budget == 2048
    assert tp.anthropic_ask({"type": "disabled"}, None).disabled
    for bad, param in ((("extreme", "reasoning_effort"), "reasoning_effort"),):
        with pytest.raises(ApiError) as e:
            tp.effort_ask(*bad)
        assert e.value.param == param
    for thinking, param in (({"type": "enabled"}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 5000}, "thinking.budget_tokens"),
                            ({"type": "sometimes"}, "thinking.type")):
        with pytest.raises(ApiError) as e:
            tp.anthropic_ask(thinking, 4096)
        assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("fn,args,param", [
    (tp.chat_plan, ([{"type": "function", "function": {"name": "a"}}], "sometimes", None), "tool_choice"),
    (tp.chat_plan, ([{"type": "function", "function": {"name": "a"}}],
                    {"type": "function", "function": {"name": "b"}}, None), "tool_choice"),
    (tp.chat_plan, (None, "required", None), "tool_choice"),
    (tp.chat_plan, ([{"type": "function", "function": {"name": "bad name!"}}], None, None), "tools[0].function.name"),
    (tp.chat_plan, ([{"type": "function", "function": {"name": "a", "parameters": []}}], None, None),
     "tools[0].function"),
    (tp.anthropic_plan, ([{"name": "a", "input_schema": {"type": "object"}}], {"type": "tool"}), "tool_choice.name"),
    (tp.anthropic_plan, ([{"name": "a", "input_schema": {"type": "object"}}], {"type": "maybe"}), "tool_choice.type"),
    (tp.responses_plan, ([{"type": "function", "name": "a"}], {"type": "function", "name": "zzz"}, None),
     "tool_choice"),
])
def test_bad_tool_parameters_are_400s_naming_the_parameter(fn, args, param):
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_modes():
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    assert tp.chat_plan(tools, "none", None).active is False
    p = tp.chat_plan(tools, {"type": "function", "function": {"name": "b"}}, False)
    assert (p.mode, p.forced, p.parallel) == ("required", "b", False)
    p = tp.anthropic_plan([{"name": "a", "input_schema": {}}], {"type": "any", "disable_parallel_tool_use": True})
    assert (p.mode, p.parallel) == ("required", False)
    p = tp.responses_plan([{"type": "function", "name": "a"}, {"type": "web_search"}],
                          {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]},
                          None)
    assert [t.name for t in p.tools] == ["a"] and p.mode == "required"
