"""Anthropic messages, driven by the official `anthropic` client (and raw HTTP for the event
sequence) against a real worker process."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest
from test_api_openai import system_prompt

MODEL = "claude-sonnet-4-5"  # what Claude Code asks for; one model is served, so any name is accepted


# The current SDK has no `temperature` argument (older clients and Claude Code versions send it):
# it goes in extra_body, so the output is greedy and comparable across requests.
GREEDY = {"temperature": 0}


def ask(client, content="Name a colour.", temperature=0, **kw):
    kw.setdefault("max_tokens", 4)
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                  extra_body={"temperature": temperature}, **kw)


def test_non_streaming(anthropic_client):
    m = ask(anthropic_client, system=f"Answer in one word. ({uuid.uuid4().hex[:8]})")  # not cached yet
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "gemma-3-270m-q4_k_m"
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.output_tokens <= 4 and m.usage.input_tokens > 0
    assert m.usage.cache_read_input_tokens == 0 and m.usage.cache_creation_input_tokens == 0


def test_streaming_matches_non_streaming(anthropic_client):
    kw = dict(content=f"Say something about rain. {uuid.uuid4().hex[:8]}", max_tokens=5)
    whole = ask(anthropic_client, **kw)
    with anthropic_client.messages.stream(model=MODEL, messages=[{"role": "user", "content": kw["content"]}],
                                          max_tokens=5, extra_body=GREEDY) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    raw = [t for t in types if t not in ("text",)]
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def sse_events(resp: httpx.Response) -> list[tuple[str, dict]]:
    out, event = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append((event, json.loads(line[6:])))
    return out


def test_raw_event_sequence_with_ping(api_worker):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    headers = {"x-api-key": api_worker.api_key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", api_worker.url + "/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["request-id"].startswith("msg_")
        events = sse_events(r)
    names = [e for e, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    n_deltas = names.count("content_block_delta")
    assert 0 < n_deltas <= delta["usage"]["output_tokens"] <= 3


def test_system_blocks_system_messages_and_claude_code_headers(anthropic_client):
    m = anthropic_client.messages.create(
        model="claude-opus-4-1", max_tokens=2,
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                               {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "system", "content": "A system message inside messages, as Claude Code sends."},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                    {"type": "text", "text": "Hello."}]},
                  {"role": "user", "content": "Again"}],
        metadata={"user_id": "u1"},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                       "x-app": "cli", "user-agent": "claude-cli/2.0 (external, cli)"},
        extra_body={"thinking": {"type": "disabled"}, "context_management": {"edits": []}, "temperature": 0},
        extra_query={"beta": "true"},
    )
    assert m.content[0].type == "text" and m.usage.input_tokens > 20


def test_tool_use_and_tool_result_are_rendered(anthropic_client):
    tools = [{"name": "Read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY, tools=tools,
        messages=[{"role": "user", "content": "Open a.txt"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                                    {"type": "tool_use", "id": "tu_1", "name": "Read",
                                                     "input": {"path": "a.txt"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                                "content": [{"type": "text", "text": "hello"}]},
                                               {"type": "text", "text": "What does it say?"}]}])
    assert m.usage.input_tokens > 10


def test_stop_sequences(anthropic_client):
    content = f"Describe a dog. {uuid.uuid4().hex[:8]}"
    full = ask(anthropic_client, content, max_tokens=8).content[0].text
    k = next((i for i in range(1, len(full) - 2) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip()), None)
    assert k is not None, f"greedy output {full!r} has no usable stop sequence"
    stop = full[k:k + 3]
    m = ask(anthropic_client, content, max_tokens=8, stop_sequences=[stop])
    assert m.content[0].text == full[:k]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    with anthropic_client.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY, stop_sequences=[stop],
                                          messages=[{"role": "user", "content": content}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == full[:k] and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_cached_tokens_and_count_tokens(anthropic_client):
    system = system_prompt(uuid.uuid4().hex[:10])
    msgs = [{"role": "user", "content": "Hello there."}]
    counted = anthropic_client.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens
    first = anthropic_client.messages.create(model=MODEL, system=system, messages=msgs, max_tokens=2,
                                             extra_body=GREEDY)
    with anthropic_client.messages.stream(model=MODEL, system=system, messages=msgs, max_tokens=2,
                                          extra_body=GREEDY) as s:
        second = s.get_final_message()
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == counted
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted
    assert second.usage.input_tokens < 32  # only the tail past the last full cached block


def test_models_list(anthropic_client):
    page = anthropic_client.models.list()
    assert [m.id for m in page.data] == ["gemma-3-270m-q4_k_m"]


def test_errors_in_anthropic_shape(anthropic_client, api_worker):
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(anthropic_client, temperature=-1)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "text only" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(anthropic_client, output_config={"format": {"type": "json_schema", "schema": {"not": {"type": "null"}}}})
    assert "output_config.format.schema" in e.value.body["error"]["message"]
    bad = anthropic.Anthropic(base_url=api_worker.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        ask(bad)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=api_worker.url, auth_token=api_worker.api_key, max_retries=0)
    assert ask(bearer, max_tokens=1).usage.output_tokens <= 1
