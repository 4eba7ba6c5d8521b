"""Tool calls and reasoning through the official openai and anthropic clients against a real worker.

The embedded Gemma 3 270M base model cannot call tools on its own, so the calls here are forced
(tool_choice required / a named tool): the grammar makes them parse, and every argument object is
checked against the tool's schema with jsonschema. `auto` shows that plain content still passes.
Reasoning uses a copy of the same model whose chat template opens a <think> block in the
generation prompt (as DeepSeek R1 and Qwen 3 thinking templates do), so the output starts inside
it; budgets are enforced by the engine, and cut streams must still close their blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
DICE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "roll_dice": DICE}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
              for n, s in SCHEMAS.items()]
RESP_TOOLS = [{"type": "function", "name": n, "description": f"{n} tool", "parameters": s, "strict": True}
              for n, s in SCHEMAS.items()]
ANTH_TOOLS = [{"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Oslo? Answer with a tool call."}]


def check_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


# -- chat completions -----------------------------------------------------------------------------------


def test_chat_required_parses(openai_client):
    r = openai_client.chat.completions.create(model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    assert calls[0].type == "function" and calls[0].id.startswith("call_")
    check_call(calls[0].function.name, calls[0].function.arguments)


def test_chat_named_tool_streams_argument_deltas(openai_client):
    stream = openai_client.chat.completions.create(
        model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "roll_dice"}},
        max_tokens=120, stream=True, seed=2)
    names, args, ids, finish, content = {}, {}, {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tcall in d.tool_calls or []:
            if tcall.id:
                ids[tcall.index] = tcall.id
            if tcall.function and tcall.function.name:
                names[tcall.index] = tcall.function.name
            if tcall.function and tcall.function.arguments:
                args[tcall.index] = args.get(tcall.index, "") + tcall.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert names and set(names.values()) == {"roll_dice"} and set(ids) == set(names)
    for i in names:
        check_call("roll_dice", args[i])
    assert "```" not in content and "roll_dice" not in content


def test_chat_parallel_calls_all_parse(openai_client):
    r = openai_client.chat.completions.create(model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                                              max_tokens=400, seed=5, temperature=1.0)
    calls = r.choices[0].message.tool_calls
    assert calls
    for c in calls:
        check_call(c.function.name, c.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def test_chat_auto_and_none_pass_content_through(openai_client):
    for choice in ("auto", "none"):
        r = openai_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                                  tools=CHAT_TOOLS, tool_choice=choice, max_tokens=16, seed=3)
        c = r.choices[0]
        assert c.message.tool_calls is None, choice  # seeded: the model answers in text either way
        assert isinstance(c.message.content, str) and c.finish_reason in ("stop", "length")


def test_chat_tool_results_round_trip(openai_client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "-3 C and snowing"},
        {"role": "user", "content": "And in Lima?"},
    ]
    r = openai_client.chat.completions.create(model="m", messages=history, tools=CHAT_TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              parallel_tool_calls=False, max_tokens=120, seed=4)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    check_call("get_weather", calls[0].function.arguments)
    assert r.usage.prompt_tokens > 60  # the tools, the earlier call and its result are in the prompt


def test_chat_bad_tool_input_is_400(openai_client):
    import openai

    cases = [
        (dict(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=CHAT_TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": "object"}}]), "tools[0].function"),
        (dict(reasoning_effort="extreme"), "reasoning_effort"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


# -- Responses ------------------------------------------------------------------------------------------


def test_responses_required_function_call_item(openai_client):
    r = openai_client.responses.create(model="m", input="Weather in Paris?", tools=RESP_TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=120)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    check_call(calls[0].name, calls[0].arguments)


def test_responses_stream_and_round_trip(openai_client):
    stream = openai_client.responses.create(
        model="m", input="Roll a die.", tools=RESP_TOOLS, tool_choice={"type": "function", "name": "roll_dice"},
        parallel_tool_calls=False, max_output_tokens=120, stream=True)
    deltas, done, final = "", None, None
    for ev in stream:
        if ev.type == "response.function_call_arguments.delta":
            deltas += ev.delta
        elif ev.type == "response.function_call_arguments.done":
            done = ev.arguments
        elif ev.type == "response.completed":
            final = ev.response
    assert done is not None and deltas == done
    check_call("roll_dice", done)
    item = [o for o in final.output if o.type == "function_call"][0]
    assert item.arguments == done and item.name == "roll_dice"
    # the call and its output go back in as input items
    r = openai_client.responses.create(
        model="m", tools=RESP_TOOLS, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120,
        parallel_tool_calls=False,
        input=[{"role": "user", "content": "Roll a die, then the weather."},
               {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
               {"type": "function_call_output", "call_id": item.call_id, "output": "4"}])
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    check_call("get_weather", calls[0].arguments)


def test_responses_stream_helper_accumulates(openai_client):
    with openai_client.responses.stream(model="m", input="Weather?", tools=RESP_TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=120) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls
    check_call(calls[0].name, calls[0].arguments)


# -- Anthropic messages ---------------------------------------------------------------------------------


def test_messages_any_gives_tool_use(anthropic_client):
    m = anthropic_client.messages.create(model="m", max_tokens=120, messages=ASK, tools=ANTH_TOOLS,
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    check_call(uses[0].name, uses[0].input)


def test_messages_stream_input_json_delta_and_round_trip(anthropic_client):
    with anthropic_client.messages.stream(model="m", max_tokens=120, messages=ASK, tools=ANTH_TOOLS,
                                          tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [ev.type if ev.type != "content_block_delta" else ev.delta.type for ev in s]
        final = s.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert use.name == "get_weather"
    check_call("get_weather", use.input)
    m = anthropic_client.messages.create(
        model="m", max_tokens=120, tools=ANTH_TOOLS, tool_choice={"type": "tool", "name": "roll_dice",
                                                                  "disable_parallel_tool_use": True},
        messages=ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                           "input": use.input}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "-3 C"},
                                                     {"type": "text", "text": "Now roll a die."}]}])
    use2 = [b for b in m.content if b.type == "tool_use"]
    assert use2 and use2[0].name == "roll_dice"
    check_call("roll_dice", use2[0].input)


def test_messages_auto_and_bad_input(anthropic_client):
    import anthropic

    m = anthropic_client.messages.create(model="m", max_tokens=12, tools=ANTH_TOOLS, tool_choice={"type": "none"},
                                         messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in m.content] == ["text"] and m.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="m", max_tokens=12, tools=ANTH_TOOLS, messages=ASK,
                                         tool_choice={"type": "tool", "name": "missing"})
    assert "tool_choice" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="m", max_tokens=100, messages=ASK,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert "budget_tokens" in e.value.message


# -- reasoning on a model whose template opens the block ------------------------------------------------


def _with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a GGUF file with tokenizer.chat_template set (tensors copied byte for byte)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF.") \
                or f.name == gguf.Keys.Tokenizer.CHAT_TEMPLATE:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    w.add_chat_template(template)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    return dst


@pytest.fixture(scope="module")
def thinking_worker(default_model_path, tmp_path_factory, start_worker):
    from ember.worker.text.chat_template import builtin_source

    src = builtin_source("gemma").replace('{{- "<start_of_turn>model\\n" -}}',
                                          '{{- "<start_of_turn>model\\n<think>\\n" -}}')
    assert "<think>" in src
    path = _with_template(default_model_path, tmp_path_factory.mktemp("think") / "gemma-think.gguf", src)
    w = start_worker("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "96MiB", "--prefill-chunk", "64", model=path)
    yield w
    w.stop(timeout=10)  # free its memory now, not at the end of the session


@pytest.fixture(scope="module")
def think_openai(thinking_worker, openai_factory):
    return openai_factory(thinking_worker)


@pytest.fixture(scope="module")
def think_anthropic(thinking_worker):
    import anthropic

    return anthropic.Anthropic(base_url=thinking_worker.url, api_key=thinking_worker.api_key, max_retries=0,
                               timeout=300)


# The thinking tests sample greedily: the base model's text is then fixed, so what they assert about
# the split does not hang on a random draw (a 6-token reasoning can otherwise be all whitespace).
def test_thinking_budget_closes_block_and_answer_follows(think_anthropic):
    m = think_anthropic.messages.create(model="m", max_tokens=48, messages=[{"role": "user", "content": "Hi"}],
                                        thinking={"type": "enabled", "budget_tokens": 12},
                                        extra_body={"temperature": 0})  # deterministic: the model's text is fixed
    kinds = [b.type for b in m.content]
    assert kinds[0] == "thinking" and m.content[0].thinking
    assert "</think>" not in m.content[0].thinking
    for b in m.content[1:]:
        assert b.type == "text" and "<think>" not in b.text and "</think>" not in b.text


def test_stream_cut_inside_reasoning_closes_cleanly(think_anthropic, think_openai):
    # no budget and a tiny max_tokens: the stream ends inside the reasoning block
    with think_anthropic.messages.stream(model="m", max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"temperature": 0}) as s:
        events = [ev.type for ev in s]
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["thinking"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert events[-1] == "message_stop"
    stream = think_openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=6, stream=True, temperature=0)
    reasoning, content, finish = "", "", None
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert reasoning and content == "" and finish == "length"
    r = think_openai.responses.create(model="m", input="Hi", max_output_tokens=6, temperature=0)
    assert r.status == "incomplete" and r.output[0].type == "reasoning"
    assert r.output[0].content[0].text and r.output[0].status == "incomplete"


def test_reasoning_effort_bounds_reasoning_on_chat_and_responses(think_openai):
    r = think_openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                             reasoning_effort="none", max_tokens=24, temperature=0)
    msg = r.choices[0].message
    assert "<think>" not in (msg.content or "") and "</think>" not in (msg.content or "")
    assert not getattr(msg, "reasoning_content", None)  # budget 0: the engine closes the block at once
    r = think_openai.responses.create(model="m", input="Hi", reasoning={"effort": "minimal"}, max_output_tokens=300,
                                      temperature=0)
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning"
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_forced_tool_call_after_reasoning(think_anthropic, think_openai):
    m = think_anthropic.messages.create(model="m", max_tokens=160, messages=ASK, tools=ANTH_TOOLS,
                                        thinking={"type": "enabled", "budget_tokens": 16},
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                        extra_body={"temperature": 0})
    assert m.content[0].type == "thinking" and m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1
    check_call(use[0].name, use[0].input)
    stream = think_openai.chat.completions.create(model="m", messages=ASK, tools=CHAT_TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, reasoning_effort="none",
                                                  max_tokens=160, stream=True, temperature=0)
    reasoning, args, names = "", "", []
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or []:
                if t.function.name:
                    names.append(t.function.name)
                args += t.function.arguments or ""
    assert not reasoning.strip() and len(names) == 1  # effort none: the engine closes the block at once
    check_call(names[0], args)


def test_structured_output_on_a_thinking_template_is_the_answer(think_openai):
    """The template opens <think>; a response format closes that block in the prompt, so the JSON
    document is the answer (parsed, valid), not swallowed into reasoning."""
    import json as _json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    r = think_openai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Plan a trip."}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}})
    msg = r.choices[0].message
    doc = _json.loads(msg.content)
    assert set(doc) == {"city", "days"} and 1 <= doc["days"] <= 9
    assert not getattr(msg, "reasoning_content", None)


@pytest.fixture(scope="module")
def qwen3_worker(tmp_path_factory, start_worker):
    """A tiny Qwen 3: its template pre-closes the block when thinking is off, and "<think>" is one
    ordinary (not special) token, as in the real vocabulary."""
    from ember.worker.bench.synth import make_model

    path = make_model("qwen3", "tiny", tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf", ctx=1024)
    w = start_worker("--max-seqs", "2", "--ctx", "1024", "--kv-mem", "64MiB", model=path)
    yield w, path
    w.stop(timeout=10)


def test_think_text_inside_a_structured_answer_stays_text(qwen3_worker, openai_factory):
    """A response format's string may hold "<think>". With thinking off (a budget of 0) the engine took that
    token for a block opened past its budget and forced "</think>" into the document, which this schema's
    maxLength refuses: the request failed mid-stream (an OpenCode session met it). The document has no block."""
    from ember.worker.model.gguf_file import GGUFFile
    from ember.worker.text.tokenizer import Tokenizer

    worker, path = qwen3_worker
    tok = Tokenizer.from_gguf(GGUFFile(path))
    (think,) = tok.encode("<think>", add_special=False, parse_special=True)
    assert not tok.is_special(think)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    r = openai_factory(worker).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Answer."}], max_tokens=32, temperature=0,
        reasoning_effort="none", logit_bias={str(think): 100},  # the model writes it wherever the grammar allows
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    msg = r.choices[0].message
    doc = json.loads(msg.content)
    assert doc["answer"].startswith("<think>") and "</think>" not in msg.content, msg.content
    assert not getattr(msg, "reasoning_content", None) and r.choices[0].finish_reason == "stop"
