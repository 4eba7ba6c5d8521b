"""DeepSeek's formats (worker/text/formats/dsml.py, worker/text/templates/deepseek.jinja): DSML tool
calls parsed whole and in awkward pieces, prior calls, results and reasoning rendered into a prompt,
thinking on and off, the forced-call grammar on the synthetic deepseek4 vocabulary, and a worker
serving the tiny deepseek4 model to the openai and anthropic SDKs on all three agent APIs.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from ember.worker.bench import synth
from ember.worker.text.chat_template import ChatTemplate, builtin_source
from ember.worker.text.formats import collect, detect_tool_format
from ember.worker.text.formats.dsml import Dsml, in_call_order
from ember.worker.text.formats.events import ContentDelta, ToolCallArgsDelta, ToolCallStart
from ember.worker.text.formats.reasoning import ThinkTags

D = "｜DSML｜"
DAYS = {"type": "integer", "minimum": 1, "maximum": 9}
FREE = {"type": "object", "properties": {"city": {"type": "string"}, "days": DAYS}, "required": ["city"],
        "additionalProperties": False}
# the served tool names its cities: a random model's free string would run to its length bound
TOOL = {**FREE, "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "days": DAYS}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": TOOL}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def _param(name: str, value: str, string: bool = True) -> str:
    return f'<{D}parameter name="{name}" string="{"true" if string else "false"}">{value}</{D}parameter>\n'


def _invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + ("".join(params) or "\n") + f"</{D}invoke>\n"


def _block(*invokes: str, name: str = "tool_calls") -> str:
    return f"<{D}{name}>\n" + "".join(invokes) + f"</{D}{name}>"


TWO_CALLS = "Let me look that up.\n\n" + _block(
    _invoke("get_weather", _param("city", "Oslo <North>"), _param("days", "3", False),
            _param("opts", '{"unit": "c", "hours": [6, 12]}', False), _param("exact", "true", False)),
    _invoke("now"))
WANT = [("get_weather", {"city": "Oslo <North>", "days": 3, "opts": {"unit": "c", "hours": [6, 12]}, "exact": True}),
        ("now", {})]


def _feed(parser, pieces: list[str]) -> list:
    events = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def _calls(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


# -- parsing ---------------------------------------------------------------------------------------------


def test_a_block_of_calls_with_string_and_json_parameters():
    r = Dsml().parse(TWO_CALLS)
    assert r.content == "Let me look that up." and _calls(r) == WANT
    # V3.2 names the block function_calls; the blank line before a block is the block's
    v32 = Dsml().parse("\n\n" + _block(_invoke("now"), name="function_calls"))
    assert v32.content == "" and _calls(v32) == [("now", {})]
    # string="false" that is not JSON: the value as written
    odd = Dsml().parse(_block(_invoke("f", _param("x", "not json", False))))
    assert _calls(odd) == [("f", {"x": "not json"})]


def _chunkings(text: str) -> list[list[str]]:
    cuts = [i for i in range(1, len(text)) if text[i - 1] in "<｜/\">\n"][::3]
    out = [[text], list(text)]
    out += [[text[i:i + n] for i in range(0, len(text), n)] for n in (2, 3, 5, 7, 13)]
    out += [[text[:i], text[i:]] for i in cuts]
    return out


@pytest.mark.parametrize("pieces", _chunkings(TWO_CALLS), ids=lambda p: f"{len(p)}-pieces-{len(p[0])}")
def test_calls_in_any_pieces(pieces):
    ids = iter(["call_a", "call_b"])
    events = _feed(Dsml().parser(lambda: next(ids)), pieces)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == "Let me look that up."  # no markup, no separator, nothing held back
    assert [e for e in events if isinstance(e, ToolCallStart)] == [ToolCallStart(0, "call_a", "get_weather"),
                                                                    ToolCallStart(1, "call_b", "now")]
    args = ["".join(e.text for e in events if isinstance(e, ToolCallArgsDelta) and e.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [w[1] for w in WANT]


def test_what_is_not_a_block_is_text():
    stray = f'I wrote <{D}invoke name="x"> by hand.'
    assert Dsml().parse(stray).content == stray and not Dsml().parse(stray).tool_calls
    broken = _block(f"<{D}invoke nme=\"x\">\n</{D}invoke>\n")
    r = Dsml().parse("Hi " + broken + " after")
    assert r.content == "Hi " + broken + " after" and not r.tool_calls  # verbatim, markup included
    assert Dsml().parse("a\n\nb  ").content == "a\n\nb  "


def test_a_stream_cut_inside_a_block():
    done = _invoke("get_weather", _param("city", "Oslo"))
    # the closing tag never came: the complete invoke is a call
    cut = collect(_feed(Dsml().parser(), ["x\n\n" + _block(done)[:-5]]))
    assert cut.content == "x" and _calls(cut) == [("get_weather", {"city": "Oslo"})]
    half = _block(done)[:_block(done).index("Oslo") + 2]
    assert collect(_feed(Dsml().parser(), [half])).content == half  # nothing complete: text
    assert _feed(Dsml().parser(forced=True), [half]) == []  # under a forced call: dropped, not shown


# -- prompts ---------------------------------------------------------------------------------------------


def _template() -> ChatTemplate:
    return ChatTemplate(builtin_source("deepseek"), bos_token="<｜begin▁of▁sentence｜>",
                        eos_token="<｜end▁of▁sentence｜>")


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Two tools.",
     "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Oslo", "days": 2}}},
                    {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "b", "content": "12:00"},  # answered out of order
    {"role": "tool", "tool_call_id": "a", "content": "3 C"},
]


def test_history_renders_calls_results_and_reasoning():
    msgs = Dsml().history(HISTORY)
    assert [m.get("tool_call_id") for m in msgs[3:]] == ["a", "b"]  # results in the order of the calls
    text = _template().render(msgs, tools=TOOLS, enable_thinking=True)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools") and '"name": "get_weather"' in text
    turn = ("<｜User｜>Weather and time in Oslo?<｜Assistant｜><think>Two tools.</think>Checking.\n\n" +
            _block(_invoke("get_weather", _param("city", "Oslo"), _param("days", "2", False)), _invoke("now")) +
            "<｜end▁of▁sentence｜><｜User｜><tool_result>3 C</tool_result>\n\n<tool_result>12:00</tool_result>"
            "<｜Assistant｜><think>")
    assert text.endswith(turn)
    # what the template wrote is what the parser reads back
    rendered = text[text.index("Checking."):text.index("<｜end▁of▁sentence｜>")]
    assert _calls(Dsml().parse(rendered)) == [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]


def test_thinking_on_and_off():
    t, think = _template(), ThinkTags()
    on = t.render(ASK, enable_thinking=True)
    off = t.render(ASK, enable_thinking=False)
    assert on.endswith("<｜User｜>Weather in Oslo?<｜Assistant｜><think>") and think.starts_inside(on)
    assert off.endswith("<｜Assistant｜></think>") and not think.starts_inside(off)
    assert t.render(ASK) == off  # DeepSeek's default: no thinking unless asked (ember asks: api/prepare.py)
    # a finished turn's reasoning is dropped once a new user turn follows, unless tools are in play
    chat = [*ASK, {"role": "assistant", "content": "Cold.", "reasoning_content": "Guess."},
            {"role": "user", "content": "Sure?"}]
    assert "<｜Assistant｜></think>Cold.<｜end▁of▁sentence｜>" in t.render(chat, enable_thinking=True)
    assert "<think>Guess.</think>Cold." in t.render(chat, tools=TOOLS, enable_thinking=True)
    assert "Guess." not in t.render(chat, tools=TOOLS, enable_thinking=False)


# DeepSeek V4's strongest thinking mode, word for word as llama.cpp's copy of its template writes it
# (models/templates/deepseek-ai-DeepSeek-V4.jinja: reasoning_effort_max, after the BOS when thinking)
MAX_EFFORT = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
              "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
              "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
              "Explicitly write out your entire deliberation process, documenting every intermediate step, "
              "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
              "unchecked.\n\n")


def test_reasoning_effort_max_is_deepseek_v4s_strongest_thinking_mode():
    t = _template()
    assert t.effort_levels == {"max"}  # V4's template knows this one level
    plain = t.render(ASK, tools=TOOLS, enable_thinking=True)
    top = t.render(ASK, tools=TOOLS, enable_thinking=True, reasoning_effort="max")
    bos = "<｜begin▁of▁sentence｜>"
    assert top == bos + MAX_EFFORT + plain.removeprefix(bos)  # before the system part, the rest unchanged
    for effort in ("high", "xhigh", "low"):
        assert t.render(ASK, tools=TOOLS, enable_thinking=True, reasoning_effort=effort) == plain
    assert MAX_EFFORT not in t.render(ASK, enable_thinking=False, reasoning_effort="max")  # only when thinking


def test_the_apis_top_effort_is_the_templates_strongest_level():
    from ember.worker.api.tool_plan import template_effort

    v4, flash_0731 = frozenset({"max"}), ChatTemplate(
        "{% if reasoning_effort == 'high' %}H{% elif reasoning_effort == \"max\" %}M{% endif %}").effort_levels
    assert flash_0731 == {"high", "max"}
    assert [template_effort(e, v4) for e in ("xhigh", "max", "high", "low")] == ["max", "max", "high", "low"]
    assert [template_effort(e, flash_0731) for e in ("xhigh", "max", "high")] == ["max", "max", "high"]
    assert template_effort("xhigh", frozenset()) == template_effort("xhigh", frozenset({"xhigh", "max"})) == "xhigh"


def test_tool_results_follow_the_order_of_the_calls():
    msgs = [{"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]}, {"role": "tool", "tool_call_id": "b"},
            {"role": "user", "content": "and"}, {"role": "tool", "tool_call_id": "a"},
            {"role": "tool", "tool_call_id": "zz"}]
    # one run of user and tool messages: the results move between the tool slots, an unknown id sorts
    # as the first call's (as llama.cpp orders them)
    assert [m.get("tool_call_id") or m["role"] for m in in_call_order(msgs)[1:]] == ["a", "user", "zz", "b"]
    no_ids = [{"role": "assistant", "tool_calls": [{}, {}]}, {"role": "tool", "content": "2"},
              {"role": "tool", "content": "1"}]
    assert in_call_order(no_ids) == no_ids


def test_deepseeks_own_templates_read_string_arguments_and_are_detected():
    # DeepSeek V3.2/V4 templates read a call's string arguments with llama.cpp's from_json filter
    t = ChatTemplate(f"{{% set dsml = '{D}' %}}{{{{ (messages[0].args | from_json).city }}}}")
    assert t.render([{"args": '{"city": "Oslo"}'}]) == "Oslo"
    assert detect_tool_format(f"{{%- set dsml_token = '{D}' -%}} <{{{{dsml_token}}}}tool_calls>").name == "dsml"


# -- on the synthetic deepseek4 vocabulary ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ember.worker.model.loader import open_model

    return open_model(synth.make_model("deepseek4", "tiny", tmp_path_factory.mktemp("d") / "deepseek4.gguf"))


@pytest.fixture(scope="module")
def formats(tiny):
    from ember.worker.text.formats import resolve

    return resolve(tiny.template, tiny.tokenizer)


def test_the_synthetic_model_speaks_deepseek(tiny, formats):
    tok = tiny.tokenizer
    assert tiny.template.name == "gguf" and isinstance(formats.tool, Dsml) and formats.native_tools
    assert isinstance(formats.reasoning, ThinkTags)
    text, ids = tiny.template.render_encode(Dsml().history(HISTORY), tools=TOOLS, enable_thinking=False)
    # the turn markers are single tokens, the prompt starts with one BOS, and generation ends at <｜end▁of▁sentence｜>
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids.count(tok.id_of("<｜User｜>")) == 2 and ids.count(tok.id_of("<｜Assistant｜>")) == 2
    assert tok.id_of("<｜end▁of▁sentence｜>") in tok.eot_ids
    assert tok.decode(ids[1:], skip_special=False) == text


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "not-thinking"])
def test_the_output_parser_splits_reasoning_answer_and_calls_token_by_token(tiny, formats, thinking):
    from ember.worker.api.output_parser import OutputPlan
    from ember.worker.text.formats.events import ReasoningDelta
    from ember.worker.text.tokenizer import IncrementalDecoder

    tok = tiny.tokenizer
    prompt = tiny.template.render(ASK, tools=TOOLS, enable_thinking=thinking)
    inside = formats.reasoning.starts_inside(prompt)
    assert inside == thinking
    out = ("Oslo, then.</think>" if thinking else "") + TWO_CALLS + "<｜end▁of▁sentence｜>"
    plan = OutputPlan(formats.tool, formats.reasoning, inside, formats.marker_tokens)
    p, dec = plan.parser(tok, id_factory=lambda: "c"), IncrementalDecoder(tok)
    ids = tok.encode(out, add_special=False, parse_special=True)
    pieces = [tok.token_piece(i) for i in ids]
    assert any(b.decode("utf-8", "replace") != b.decode("utf-8", "ignore") for b in pieces)  # ｜ cut in bytes
    events = []
    for i in ids:  # one token per delta, as the engine streams (the end of sentence is hidden)
        events += p.feed(dec.feed(i), [i])
    events += p.finish()
    r = collect(events)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == ("Oslo, then." if thinking else "")
    assert r.content == "Let me look that up." and _calls(r) == WANT


@pytest.mark.parametrize("reasoning_open", [None, False, True], ids=["no-reasoning", "optional", "open"])
def test_the_forced_call_grammar_takes_exactly_dsml(tiny, formats, reasoning_open):
    import llguidance

    from ember.worker.api.prepare import _schema_json
    from ember.worker.engine.constraints import lltokenizer_for

    tok = tiny.tokenizer
    free = {"type": "object"}
    lark = formats.forced_calls_lark([("get_weather", _schema_json(FREE)), ("note", _schema_json(free))], 7,
                                     reasoning_open)
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lt = lltokenizer_for(tok, tok.vocab_size)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar)
        return m.consume_tokens(tok.encode(text, add_special=False, parse_special=True)) and m.is_accepting()

    one = _block(_invoke("get_weather", _param("city", "Oslo </b>"), _param("days", "3", False)))
    lead = "" if reasoning_open is None else "Oslo it is.</think>\n\n" if reasoning_open else ""
    assert accepts(lead + one)
    assert accepts(lead + _block(_invoke("get_weather", _param("city", "Lima")), _invoke("note"),
                                 _invoke("note", _param("text", "hi"))))
    # a reasoning block may open first (or, when the prompt opened it, the text is in it); never without one
    assert accepts("<think>Oslo it is.</think>\n\n" + one) == (reasoning_open is not None)
    assert not accepts(lead + _block(_invoke("get_weather", _param("days", "3", False))))  # city is required
    assert not accepts(lead + _block(_invoke("get_weather", _param("city", "Oslo"), _param("days", "30", False))))
    assert not accepts(lead + _block(_invoke("get_weather", _param("city", "Oslo"), _param("wind", "1", False))))
    assert not accepts(lead + _block(_invoke("get_time", _param("city", "Oslo"))))
    assert not accepts(lead + '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not accepts(lead + "Sure.\n\n" + one)  # a forced call is the whole answer


def _matcher(tiny, formats, tools):
    import llguidance

    from ember.worker.api.prepare import _schema_json
    from ember.worker.engine.constraints import lltokenizer_for

    tok = tiny.tokenizer
    grammar = llguidance.grammar_from("lark", formats.forced_calls_lark(
        [(name, _schema_json(schema)) for name, schema in tools], 7, None))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lt = lltokenizer_for(tok, tok.vocab_size)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar)
        return m.consume_tokens(tok.encode(text, add_special=False, parse_special=True)) and m.is_accepting()

    return accepts


def test_a_forced_calls_parameters_may_come_in_any_order(tiny, formats):
    """Each at most once, every required one present, in whatever order the model writes them (a tool of
    three: two required, one optional; and one of four optional ones)."""
    import itertools

    three = {"type": "object", "properties": {"days": DAYS, "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
             "required": ["city", "days"]}
    four = {"type": "object", "properties": {k: {"type": "string"} for k in "abcd"}}
    accepts = _matcher(tiny, formats, [("get_weather", three), ("note", four)])
    params = {"city": _param("city", "Oslo"), "days": _param("days", "3", False), "unit": _param("unit", "f")}

    def weather(*keys: str) -> str:
        return _block(_invoke("get_weather", *(params[k] for k in keys)))

    for n in (2, 3):
        for keys in itertools.permutations(params, n):
            assert accepts(weather(*keys)) == ({"city", "days"} <= set(keys)), keys
    assert not accepts(weather("city", "days", "city"))  # at most once
    assert not accepts(weather("unit", "days", "unit", "city"))
    assert not accepts(weather("days", "unit"))  # city is required
    for keys in ["", "d", "ca", "dbac", "bd"]:
        assert accepts(_block(_invoke("note", *(_param(k, k.upper()) for k in keys)))), keys
    assert not accepts(_block(_invoke("note", _param("b", "1"), _param("a", "2"), _param("b", "3"))))


def test_a_tool_past_the_any_order_bound_keeps_the_schemas_order(tiny, formats):
    from ember.worker.text.formats.dsml import ANY_ORDER_PARAMS

    keys = [f"k{i}" for i in range(ANY_ORDER_PARAMS + 1)]
    wide = {"type": "object", "properties": {k: {"type": "string"} for k in keys}, "required": keys[:2]}
    accepts = _matcher(tiny, formats, [("wide", wide)])
    assert accepts(_block(_invoke("wide", *(_param(k, "x") for k in [*keys[:2], keys[5], keys[7]]))))
    assert not accepts(_block(_invoke("wide", *(_param(k, "x") for k in [*keys[:2], keys[7], keys[5]]))))
    assert not accepts(_block(_invoke("wide", *(_param(k, "x") for k in [keys[0], keys[5]]))))


def test_a_dsml_special_token_is_referenced_by_id():
    # a vocabulary holding ｜DSML｜ as one special token: grammars name it by id, the rest stays literal
    def term(text: str) -> str:
        return "<[99]>" if text == D else json.dumps(text, ensure_ascii=False)

    rules, expr = Dsml().calls_lark(term, 0)
    assert expr == "calls" and rules == ['calls: "<" <[99]> "tool_calls>" "\\n" (obj "\\n"){1,1} "</" <[99]> '
                                         '"tool_calls>"']
    (inv, obj) = Dsml().call_rules([("f", '{"type": "object"}')], term)[-2:]
    assert inv.startswith('inv0: "<" <[99]> "invoke name=\\"f\\">" "\\n"') and obj == "obj: inv0"


# -- a worker serving the tiny deepseek4 -----------------------------------------------------------------


def _prompts(worker) -> list[str]:
    """The prompts the worker rendered (--log-prompts)."""
    lines = [json.loads(ln) for ln in worker.log_path.read_text().splitlines() if ln.startswith("{")]
    return [e["text"] for e in lines if e.get("event") == "prompt"]


@pytest.fixture(scope="module")
def worker(start_worker, tiny):
    return start_worker("--max-seqs", "2", "--ctx", "2048", "--kv-mem", "64MiB", "--log-prompts",
                        model=tiny.gguf.path)


def test_forced_calls_on_all_three_apis_with_thinking_on_and_off(worker, openai_factory):
    import anthropic

    oa = openai_factory(worker)
    before = len(_prompts(worker))
    named = {"type": "function", "function": {"name": "get_weather"}}
    # thinking on (the random model reasons until the budget closes the block; with seed 3 it is inside
    # a character of several bytes then), then off. A DSML call is about 200 tokens of this vocabulary.
    for effort, cap in (("minimal", 700), ("none", 300)):
        stream = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=cap,
                                            seed=3, reasoning_effort=effort, stream=True)
        names, args, finish = [], "", None
        for chunk in stream:
            for c in chunk.choices[0].delta.tool_calls or []:
                names += [c.function.name] if c.function and c.function.name else []
                args += c.function.arguments or "" if c.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert names == ["get_weather"] and finish == "tool_calls", effort
        jsonschema.validate(json.loads(args), TOOL)
    resp = oa.responses.create(model="m", input="Weather in Oslo?", max_output_tokens=300, reasoning={"effort": "none"},
                               tools=[{"type": "function", "name": "get_weather", "parameters": TOOL}],
                               tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOL)
    an = anthropic.Anthropic(base_url=worker.url, api_key=worker.api_key, max_retries=0, timeout=300)
    with an.messages.stream(model="m", max_tokens=300, messages=ASK,
                            tools=[{"name": "get_weather", "input_schema": TOOL}],
                            tool_choice={"type": "tool", "name": "get_weather"},
                            thinking={"type": "enabled", "budget_tokens": 16}) as s:
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, TOOL)
    # DeepSeek's prompts: the tools with the DSML convention, the reply opened with <think> or </think>
    prompts = _prompts(worker)[before:]
    assert len(prompts) == 4 and all(f"<{D}tool_calls>" in p for p in prompts)
    assert [p.endswith("<｜Assistant｜><think>") for p in prompts] == [True, False, False, True]
    assert all(p.endswith("<｜Assistant｜></think>") for p in prompts[1:3])


def test_a_tool_loop_is_replayed_in_dsml(worker, openai_factory):
    import anthropic

    oa = openai_factory(worker)
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "Use the tool."},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}]
    r = oa.chat.completions.create(model="m", messages=chat, tools=TOOLS, max_tokens=8, seed=1,
                                   reasoning_effort="low")
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    an = anthropic.Anthropic(base_url=worker.url, api_key=worker.api_key, max_retries=0, timeout=300)
    an.messages.create(model="m", max_tokens=8, tools=[{"name": "get_weather", "input_schema": TOOL}], messages=[
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Lima, then.", "signature": ""},
                                          {"type": "tool_use", "id": "tu_1", "name": "get_weather",
                                           "input": {"city": "Lima"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "20 C"}]}])
    oa.responses.create(model="m", max_output_tokens=8, tools=[{"type": "function", "name": "get_weather",
                                                                  "parameters": TOOL}], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Paris, then."}]},
        {"type": "function_call", "call_id": "fc_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "fc_1", "output": "15 C"}])
    prompts = _prompts(worker)[-3:]
    replay = ("<think>Use the tool.</think>\n\n" + _block(_invoke("get_weather", _param("city", "Oslo"),
                                                                  _param("days", "2", False))) +
              "<｜end▁of▁sentence｜><｜User｜><tool_result>3 C</tool_result><｜Assistant｜><think>")
    assert prompts[0].endswith("<｜User｜>Weather in Oslo?<｜Assistant｜>" + replay)
    lima = "<think>Lima, then.</think>\n\n" + _block(_invoke("get_weather", _param("city", "Lima")))
    result = "<｜end▁of▁sentence｜><｜User｜><tool_result>20 C</tool_result><｜Assistant｜><think>"
    assert prompts[1].endswith(lima + result)  # Anthropic's thinking block sent back is the turn's reasoning
    paris = "<think>Paris, then.</think>\n\n" + _block(_invoke("get_weather", _param("city", "Paris")))
    assert prompts[2].endswith(paris + result.replace("20 C", "15 C"))  # and so is a Responses reasoning item


def test_the_top_effort_of_each_api_reaches_deepseeks_max_mode(worker, openai_factory):
    """Chat completions' reasoning_effort xhigh (and llama-server's max), Responses' reasoning.effort xhigh,
    Anthropic's output_config.effort max and a thinking budget of 31999 tokens (Claude Code's largest) put
    V4's strongest mode into the prompt; high, a smaller budget and thinking off do not."""
    import anthropic
    import openai

    oa = openai_factory(worker)
    an = anthropic.Anthropic(base_url=worker.url, api_key=worker.api_key, max_retries=0, timeout=300)
    before = len(_prompts(worker))
    want = []
    for effort in ("xhigh", "max", "high", "none"):
        oa.chat.completions.create(model="m", messages=ASK, max_tokens=1, reasoning_effort=effort)  # type: ignore
        want.append(effort in ("xhigh", "max"))
    oa.responses.create(model="m", input="Weather in Oslo?", max_output_tokens=16, reasoning={"effort": "xhigh"})
    want.append(True)
    for effort, thinking in (("max", None), ("high", None), ("max", {"type": "disabled"})):
        an.messages.create(model="m", max_tokens=1, messages=ASK, extra_body={"output_config": {"effort": effort}},
                           **({"thinking": thinking} if thinking else {}))
        want.append(effort == "max" and thinking is None)
    for budget in (31999, 4000):  # a budget's effort: the smallest whose budget covers it (xhigh, medium)
        with an.messages.stream(model="m", max_tokens=budget + 1, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": budget}) as stream:
            next(iter(stream))  # the prompt is rendered and logged at admission; the rest is not needed
        want.append(budget > 16384)
    prompts = _prompts(worker)[before:]
    assert [MAX_EFFORT in p for p in prompts] == want
    with pytest.raises(anthropic.BadRequestError, match="output_config.effort must be one of low, medium, high"):
        an.messages.create(model="m", max_tokens=1, messages=ASK, extra_body={"output_config": {"effort": "ultra"}})
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of"):
        oa.chat.completions.create(model="m", messages=ASK, max_tokens=1, reasoning_effort="ultra")  # type: ignore
