"""Tool-call parsers: every format, parallel calls, tricky JSON, streaming == non-streaming."""

import json
import random

import pytest

from ember.worker.text.formats import (
    ContentDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    collect,
    detect_tool_format,
    tool_format,
)
from ember.worker.text.formats.events import mistral_call_id, openai_call_id


def parse_tool_calls(text, fmt, id_factory=None):
    return tool_format(fmt).parse(text, id_factory)


def new_parser(fmt, id_factory, **kw):
    return tool_format(fmt).parser(id_factory, **kw)


def ids():
    n = iter(range(10_000))
    return lambda: f"id{next(n)}"


def parse(text, fmt):
    r = parse_tool_calls(text, fmt, ids())
    return r.content, [(c.name, json.loads(c.arguments)) for c in r.tool_calls]


def stream(text, fmt, cuts):
    p = new_parser(fmt, ids())
    ev, last = [], 0
    for c in list(cuts) + [len(text)]:
        ev += p.feed(text[last:c])
        last = c
    ev += p.finish()
    return ev


# --------------------------------------------------------------------------- detect_tool_format

@pytest.mark.parametrize("tpl,fmt", [
    ("{% for t in tools %}<tools>{{ t }}</tools>{% endfor %}<tool_call>\n{\"name\"...</tool_call>", "hermes"),
    ("{{- '<|start_header_id|>ipython<|end_header_id|>' }}", "llama3"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
    ("{{ '[TOOL_CALLS][' }}{% for tc in tool_calls %}", "mistral"),
    ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}", "fenced"),
    ("", "fenced"),
    (None, "fenced"),
])
def test_detect_tool_format(tpl, fmt):
    assert detect_tool_format(tpl).name == fmt


def test_repo_templates_detect():
    import pathlib
    d = pathlib.Path(__file__).resolve().parents[1] / "worker" / "text" / "templates"
    found = {f.stem: detect_tool_format(f.read_text()).name for f in d.glob("*.jinja")}
    assert set(found.values()) <= {"hermes", "llama3", "mistral", "dsml", "fenced"}
    assert found["deepseek"] == "dsml" and found["chatml"] == "hermes"


def test_ids():
    a, b = openai_call_id(), openai_call_id()
    assert a.startswith("call_") and a != b
    m = mistral_call_id()
    assert len(m) == 9 and m.isalnum()


# --------------------------------------------------------------------------- hermes

def test_hermes_single():
    c, calls = parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "hermes")
    assert c == "" and calls == [("get_weather", {"city": "Paris"})]


def test_hermes_parallel_with_content():
    t = ('Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "b", "arguments": {"y": [1, 2, {"z": null}]}}\n</tool_call>\n')
    c, calls = parse(t, "hermes")
    assert c == "Let me check both.\n"
    assert calls == [("a", {"x": 1}), ("b", {"y": [1, 2, {"z": None}]})]


def test_hermes_braces_and_markup_in_strings():
    args = {"code": "def f():\n    return {'a': [1]}  # }]}", "q": "\"quoted\" \\ back"}
    t = "<tool_call>" + json.dumps({"name": "run", "arguments": args}) + "</tool_call>"
    assert parse(t, "hermes") == ("", [("run", args)])


def test_hermes_unicode():
    args = {"text": "héllo 世界 🚀", "esc": "\u00e9"}
    t = "Résumé → <tool_call>" + json.dumps({"name": "translate", "arguments": args},
                                            ensure_ascii=False) + "</tool_call>"
    c, calls = parse(t, "hermes")
    assert c == "Résumé → " and calls == [("translate", args)]
    r = parse_tool_calls(t, "hermes")
    assert "世界" in r.tool_calls[0].arguments  # not \u-escaped


def test_hermes_arguments_as_string_and_parameters_key():
    t = ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>'
         '<tool_call>{"name": "g", "parameters": {"b": 3}}</tool_call>')
    assert parse(t, "hermes")[1] == [("f", {"a": 2}), ("g", {"b": 3})]


def test_hermes_missing_arguments_is_empty_object():
    r = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>', "hermes")
    assert r.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>',
    '<tool_call>not json</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": 5}</tool_call>',
    '<tool_call>[]</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
])
def test_hermes_malformed_stays_content(bad):
    t = "before " + bad + " after"
    assert parse(t, "hermes") == (t, [])


def test_hermes_malformed_and_good_mixed():
    t = '<tool_call>{oops}</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    c, calls = parse(t, "hermes")
    assert c == "<tool_call>{oops}</tool_call>" and calls == [("ok", {})]


def test_hermes_cut_mid_call_is_content():
    t = 'Hi <tool_call>{"name": "f", "argum'
    assert parse(t, "hermes") == (t, [])


def test_hermes_missing_close_tag_but_complete_json_is_call():
    t = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}\n'
    assert parse(t, "hermes") == ("Hi ", [("f", {"a": 1})])


def test_hermes_cut_inside_closing_tag_is_call():
    assert parse('x<tool_call>{"name": "f", "arguments": {}}</tool_', "hermes") == ("x", [("f", {})])


def test_hermes_closing_tag_inside_argument_string():
    args = {"s": "a</tool_call>b", "t": "<tool_call>"}
    t = "<tool_call>" + json.dumps({"name": "w", "arguments": args}) + "</tool_call>"
    assert parse(t, "hermes") == ("", [("w", args)])


def test_hermes_junk_after_json_uses_plain_close():
    t = '<tool_call>{"name": "w"}} junk</tool_call>ok'
    assert parse(t, "hermes") == (t, [])


def test_hermes_partial_marker_at_end_is_content():
    assert parse("text <tool_c", "hermes") == ("text <tool_c", [])


def test_plain_text_untouched_all_formats():
    t = "Just an answer with {braces} and [brackets] and `code`."
    for fmt in ("hermes", "llama3", "mistral", "fenced"):
        assert parse(t, fmt) == (t, [])


def test_empty():
    for fmt in ("hermes", "llama3", "mistral", "fenced"):
        assert parse("", fmt) == ("", [])


def test_unknown_format():
    with pytest.raises(ValueError):
        tool_format("nope")


# --------------------------------------------------------------------------- llama3

def test_llama3_bare_json():
    assert parse('{"name": "get", "parameters": {"id": 7}}', "llama3") == ("", [("get", {"id": 7})])


def test_llama3_leading_whitespace_and_python_tag():
    assert parse('\n {"name": "get", "parameters": {}}', "llama3") == ("", [("get", {})])
    assert parse('<|python_tag|>{"name": "s", "parameters": {"q": "x"}}', "llama3") == ("", [("s", {"q": "x"})])


def test_llama3_content_then_python_tag():
    t = 'I will search.<|python_tag|>{"name": "s", "parameters": {"q": "}{"}}'
    assert parse(t, "llama3") == ("I will search.", [("s", {"q": "}{"})])


def test_llama3_parallel_semicolon():
    t = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"}}'
    assert parse(t, "llama3") == ("", [("a", {}), ("b", {"k": "v"})])


def test_llama3_list_of_calls():
    t = '[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {}}]'
    assert parse(t, "llama3") == ("", [("a", {}), ("b", {})])


def test_llama3_json_answer_not_a_call_is_content():
    for t in ['{"answer": 42}', '[1, 2, 3] are numbers', 'The JSON is {"name": "x", "parameters": {}}']:
        assert parse(t, "llama3") == (t, [])


def test_llama3_leading_whitespace_kept_when_not_a_call():
    for t in ['\n  {"answer": 1}', ' [1]']:
        assert parse(t, "llama3") == (t, [])


def test_llama3_cut_mid_call():
    t = '{"name": "a", "parameters": {"x": "unterminated'
    assert parse(t, "llama3") == (t, [])


# --------------------------------------------------------------------------- mistral

def test_mistral_array():
    t = '[TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]'
    assert parse(t, "mistral") == ("", [("a", {"x": "]"}), ("b", {})])


def test_mistral_content_before_and_after():
    t = 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}] trailing'
    assert parse(t, "mistral") == ("Sure.  trailing", [("a", {})])


def test_mistral_new_style():
    t = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    assert parse(t, "mistral") == ("", [("get_weather", {"city": "Paris"}), ("now", {})])


def test_mistral_ids_are_9_alnum():
    r = parse_tool_calls('[TOOL_CALLS][{"name": "a", "arguments": {}}]', "mistral")
    assert len(r.tool_calls[0].id) == 9 and r.tool_calls[0].id.isalnum()


def test_mistral_malformed():
    for t in ['[TOOL_CALLS][{"name": "a", "arguments": {]', '[TOOL_CALLS][{"nam": "a"}]', '[TOOL_CALLS]']:
        assert parse(t, "mistral") == (t, [])


# --------------------------------------------------------------------------- fenced

def test_fenced_call():
    t = 'I will list files.\n```json\n{"tool": "ls", "arguments": {"path": "/tmp"}}\n```\n'
    assert parse(t, "fenced") == ("I will list files.\n", [("ls", {"path": "/tmp"})])


def test_fenced_parallel_and_name_key():
    t = ('```json\n{"tool": "a", "arguments": {}}\n```\n```json\n{"name": "b", "arguments": {"q": "```"}}\n```')
    # a ``` inside a JSON string ends the fence early: that block is not a call, stays content
    c, calls = parse(t, "fenced")
    assert calls[0] == ("a", {})
    t2 = '```json\n{"tool": "a", "arguments": {}}\n```\n```json\n{"name": "b", "arguments": {"q": 1}}\n```'
    assert parse(t2, "fenced") == ("", [("a", {}), ("b", {"q": 1})])


def test_fenced_other_code_blocks_are_content():
    for t in ['```python\nx = {"tool": 1}\n```', '```json\n{"answer": 1}\n```', '```\nplain\n```',
              'text ``` not closed']:
        assert parse(t, "fenced") == (t, [])


def test_fenced_code_block_streams_before_it_closes():
    p = new_parser("fenced", ids())
    ev = p.feed("Here:\n```python\nprint(1)\n")
    assert collect(ev).content == "Here:\n```python\nprint(1)\n"
    ev = p.feed("```\nand ```json\n{\"tool\": \"t\", \"arguments\": {}}\n```")
    r = collect(ev + p.finish())
    assert r.content == "```\nand " and [c.name for c in r.tool_calls] == ["t"]
    p = new_parser("fenced", ids())
    assert collect(p.feed("```\nplain text")).content == "```\nplain text"


def test_fenced_cut_mid_call():
    t = 'x\n```json\n{"tool": "a", "argu'
    assert parse(t, "fenced") == (t, [])


# --------------------------------------------------------------------------- streaming

EXAMPLES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "a", "arguments": '
               '{"s": "x}</tool_call>y", "u": "世界"}}\n</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call>'),
    ("hermes", 'a <tool_call>{bad}</tool_call> b <tool_c'),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}'),
    ("hermes", '<tool_call>{"name": "w"}} junk</tool_call>ok '
               '<tool_call>{"name": "v", "arguments": {"a": "</tool_call>"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_'),
    ("llama3", '<|python_tag|>{"name": "s", "parameters": {"q": "}{"}}; {"name": "t", "parameters": {}}'),
    ("llama3", '  {"answer": 1} and more'),
    ("mistral", 'ok [TOOL_CALLS][{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}] tail'),
    ("mistral", '[TOOL_CALLS]get[ARGS]{"c": "P"}'),
    ("fenced", 'List:\n```json\n{"tool": "ls", "arguments": {"p": "/é"}}\n```\nthen ```py\nx\n```'),
    ("fenced", '```\ncode\n``` then ```json\n{"answer": 1}\n``` ```{"tool": "a", "arguments": {}}``` ```json\n[1]'),
    ("fenced", 'use ``` inline and ```tool\n{"name": "n", "arguments": {"x": "y"}}\n```'),
    ("fenced", 'a ``` b ``` c\n```json\n{"name": "n", "arguments": {"x": "```"}}\n```\n'
               '```tool\n{"tool": "m", "arguments": {}}\n```'),
]


def _norm(res):
    return res.content, [(c.id, c.name, c.arguments) for c in res.tool_calls]


@pytest.mark.parametrize("fmt,text", EXAMPLES)
def test_stream_split_at_every_position_equals_parse(fmt, text):
    whole = _norm(parse_tool_calls(text, fmt, ids()))
    for i in range(len(text) + 1):
        assert _norm(collect(stream(text, fmt, [i]))) == whole, i


@pytest.mark.parametrize("fmt,text", EXAMPLES)
def test_stream_char_by_char_and_random_chunks(fmt, text):
    whole = _norm(parse_tool_calls(text, fmt, ids()))
    assert _norm(collect(stream(text, fmt, range(1, len(text))))) == whole
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        assert _norm(collect(stream(text, fmt, cuts))) == whole


@pytest.mark.parametrize("fmt,text", EXAMPLES)
def test_stream_cut_at_every_position_never_leaks_markup(fmt, text):
    """A stream cut at any point: content never contains markup of a call that was parsed,
    and every emitted content delta is final (the content seen so far is a prefix of the final)."""
    for i in range(len(text) + 1):
        p = new_parser(fmt, ids())
        ev = []
        for ch in text[:i]:
            ev += p.feed(ch)
        before = collect(ev).content
        ev += p.finish()
        res = collect(ev)
        assert res.content.startswith(before)
        for c in res.tool_calls:
            json.loads(c.arguments)
        if fmt == "hermes" and res.tool_calls and "{bad}" not in text and "junk" not in text:
            assert "</tool_call>" not in res.content


def test_stream_holds_partial_marker():
    p = new_parser("hermes", ids())
    assert collect(p.feed("Hello <tool")).content == "Hello "
    assert collect(p.feed("_call>{\"name\"")).content == ""
    ev = p.feed(': "f", "arguments": {"a": 1}}</tool_call>')
    assert [type(e) for e in ev] == [ToolCallStart, ToolCallArgsDelta]
    assert ev[0].name == "f" and ev[0].index == 0 and ev[1].text == '{"a": 1}'
    assert p.finish() == []


def test_stream_name_once_then_arg_deltas():
    p = new_parser("hermes", ids(), args_chunk=3)
    ev = p.feed('<tool_call>{"name": "f", "arguments": {"abc": "defgh"}}</tool_call>') + p.finish()
    starts = [e for e in ev if isinstance(e, ToolCallStart)]
    deltas = [e for e in ev if isinstance(e, ToolCallArgsDelta)]
    assert len(starts) == 1 and len(deltas) > 1
    assert "".join(d.text for d in deltas) == '{"abc": "defgh"}'


def test_stream_parallel_indices():
    t = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(5))
    ev = stream(t, "hermes", range(0, len(t), 7))
    starts = [e for e in ev if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(5)) and [s.name for s in starts] == [f"f{i}" for i in range(5)]


def test_content_streams_before_call_completes():
    p = new_parser("hermes", ids())
    ev = p.feed("Thinking about it")
    assert ev == [ContentDelta("Thinking about it")]


def test_feed_after_finish_is_noop():
    p = new_parser("hermes", ids())
    p.feed("x")
    p.finish()
    assert p.feed("more") == [] and p.finish() == []


def test_fuzz_never_raises():
    rng = random.Random(1)
    alphabet = ['<tool_call>', '</tool_call>', '{', '}', '[', ']', '"', '\\', ':', ',', 'name', 'arguments',
                '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', '```', 'json', '\n', ' ', 'x', 'é', ';']
    for _ in range(600):
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for fmt in ("hermes", "llama3", "mistral", "fenced"):
            res = parse_tool_calls(t, fmt, ids())
            if not res.tool_calls:  # nothing parsed: the text comes back unchanged
                assert res.content == t
            whole = _norm(res)
            cuts = sorted(rng.randint(0, len(t)) for _ in range(rng.randint(1, 4)))
            assert _norm(collect(stream(t, fmt, cuts))) == whole


@pytest.mark.parametrize("fmt,cut", [
    ("fenced", '```json\n{"name": "Read", "arguments": {"file_path": "/tm'), ("fenced", '```json\n{"na'),
    ("hermes", '<tool_call>\n{"name": "f", "argu'), ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a'),
    ("llama3", '{"name": "f", "parameters": {"a": [1, 2'),
])
def test_a_forced_call_cut_short_is_never_content(fmt, cut):
    """With tool_choice required or named the grammar allows nothing but calls: what the output cap
    leaves unclosed is a call, dropped, never shown as the answer. Unforced, it stays content."""
    for cuts in ([], [3], [len(cut) // 2]):
        p = new_parser(fmt, ids(), forced=True)
        ev, last = [], 0
        for c in cuts + [len(cut)]:
            ev += p.feed(cut[last:c])
            last = c
        ev += p.finish()
        assert not [e for e in ev if isinstance(e, ContentDelta)], (cuts, ev)
    done = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    p = new_parser("hermes", ids(), forced=True)
    assert collect(p.feed(done) + p.finish()).tool_calls[0].name == "f"
    assert collect(stream(cut, fmt, [])).content == cut


def test_fenced_forced_choice_is_asked_for_in_the_last_user_turn_so_the_head_stays_cached():
    """A template that never reads tools gets them in the system message; a forced tool choice is asked for
    at the end of the last user turn, not in that block: the forced request and the next one (tool choice
    auto, the call and its result appended) render the same system message and history up to that turn
    (in the tools block, a Codex session re-prefilled 2,035 of 14,515 tokens after every forced call)."""
    from ember.worker.text.formats.fenced import FencedJson

    tools = [{"type": "function", "function": {"name": "get_goal", "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the goal?"}]
    forced = FencedJson().describe(history, tools, forced="get_goal")
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                 "function": {"name": "get_goal", "arguments": "{}"}}]}
    later = FencedJson().describe([*history, call, {"role": "tool", "tool_call_id": "c1", "content": "ship it"}], tools)
    assert forced[0] == later[0] and "get_goal" in forced[0]["content"] and "now." not in forced[0]["content"]
    assert forced[1]["content"] == "What is the goal?\n\nCall the function get_goal now."
    assert later[1]["content"] == "What is the goal?" and len(later) == 4
    parts = FencedJson().describe([{"role": "user", "content": [{"type": "text", "text": "Go."}]}], tools,
                                  required=True)
    assert parts[-1]["content"] == [{"type": "text", "text": "Go."},
                                    {"type": "text", "text": "Call at least one function now."}]
    assistant_last = FencedJson().describe([*history, {"role": "assistant", "content": "Sure"}], tools,
                                           forced="get_goal")
    assert assistant_last[0]["content"].endswith("\nCall the function get_goal now.")
