"""OpenAI Responses (what Codex speaks), driven by the official `openai` client against a real
worker process."""

from __future__ import annotations

import uuid

import openai
import pytest
from test_api_openai import system_prompt

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def respond(client, input, **kw):
    kw.setdefault("max_output_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.responses.create(model="gpt-5-codex", input=input, **kw)


def test_string_input_with_instructions(openai_client):
    instructions = f"Answer in one word. ({uuid.uuid4().hex[:8]})"  # a prompt no other test sent
    r = respond(openai_client, "Name a colour.", instructions=instructions)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "gemma-3-270m-q4_k_m"
    assert r.instructions == instructions
    assert len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens <= 4
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 4
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_item_input_codex_style(openai_client):
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
        {"role": "user", "content": "Thanks"},
    ]
    tools = [{"type": "function", "name": "shell", "description": "Run a command", "strict": False,
              "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}}]
    r = respond(openai_client, items, tools=tools, store=False, reasoning={"effort": "low"},
                include=["reasoning.encrypted_content"], parallel_tool_calls=False,
                extra_body={"prompt_cache_key": "abc"})
    assert r.usage.input_tokens > 30 and r.output[0].type == "message"


def test_streaming_event_sequence(openai_client):
    text_in = f"Tell me about mountains. {uuid.uuid4().hex[:8]}"
    whole = respond(openai_client, text_in, max_output_tokens=5)
    events = list(respond(openai_client, text_in, max_output_tokens=5, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == STREAM_ORDER
    assert types[-4:-1] == STREAM_TAIL
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    final = events[-1]
    assert final.type == f"response.{whole.status}"
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert ids == {events[0].response.id}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    assert final.response.output[0].content[0].text == whole.output_text
    assert final.response.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.response.output[0].id}


def test_completed_via_stream_helper(openai_client):
    """A response that ends on a stop string (an extension) completes; the SDK's helper accepts it."""
    text_in = f"Describe a river. {uuid.uuid4().hex[:8]}"
    full = respond(openai_client, text_in, max_output_tokens=8).output_text
    k = next((i for i in range(1, len(full) - 2) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip()), None)
    assert k is not None, f"greedy output {full!r} has no usable stop string"
    with openai_client.responses.stream(model="m", input=text_in, max_output_tokens=8, temperature=0,
                                        extra_body={"stop": [full[k:k + 3]]}) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == full[:k]


def test_cached_tokens_on_second_turn(openai_client):
    instructions = system_prompt(uuid.uuid4().hex[:10])
    first = respond(openai_client, "Hello.", instructions=instructions, max_output_tokens=2)
    second = respond(openai_client, "Hello.", instructions=instructions, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens == first.usage.input_tokens
    assert 0 < second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens


def test_errors(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        respond(openai_client, "hi", previous_response_id="resp_123")
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        respond(openai_client, "hi", max_output_tokens=0)
    assert e.value.param == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        respond(openai_client, [{"type": "message", "role": "user",
                                 "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert e.value.param == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        respond(openai_client, "hi", top_p=5)
    assert e.value.param == "top_p"
