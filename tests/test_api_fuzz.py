"""Property-based fuzzing of a real worker: no generated request may get a 5xx, an internal error
or a restart.

Two sources of requests, about 1,100 in all:
- schemathesis, from the OpenAPI document the worker serves (GET /openapi.json, built from the
  msgspec types the handlers decode), in both its modes: bodies that fit the schema and bodies
  that break it (wrong types, missing fields, extra nesting);
- hypothesis strategies for the four agent request bodies, which fit the envelope but fill it
  with what clients get wrong: odd roles and content parts, malformed tools, tool_choice and
  allowed_tools shapes, response formats with unsupported schemas, extreme sampling values,
  logit_bias and stop lists, lone surrogates.

Each run is bounded (examples per test below) and derandomized, so CI sees the same requests every
time; EMBER_FUZZ_EXAMPLES scales them for a longer local run.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from conftest import API_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

SCALE = float(os.environ.get("EMBER_FUZZ_EXAMPLES", "1"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                print_blob=True)


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


@pytest.fixture(scope="module")
def w(hardened_worker):
    w = hardened_worker
    w.pid_at_start = w.proc.pid
    return w


def check_answer(path: str, r: httpx.Response, body: object) -> None:
    """A 4xx in the protocol's own error shape, or a success; never a 5xx, never a broken stream."""
    assert r.status_code < 500, (path, r.status_code, r.text[:400], json.dumps(body)[:400])
    if r.status_code >= 400:
        err = r.json()
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"] and err["error"]["message"], err
        else:
            assert err["error"]["message"] and err["error"]["type"], err
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert '"server_error"' not in r.text and '"api_error"' not in r.text, r.text[-400:]


def served_schema(worker) -> schemathesis.BaseSchema:
    doc = httpx.get(worker.url + "/openapi.json", headers=AUTH, timeout=30).json()
    return schemathesis.openapi.from_dict(doc)


POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", POST_PATHS)
def test_schemathesis_post(w, path, mode):
    op = served_schema(w)[path]["POST"]
    seen = []

    @settings(FUZZ, max_examples=examples(40))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        r = case.call(base_url=w.url, headers=AUTH, timeout=120)
        seen.append(r.status_code)
        assert r.status_code < 500, (path, r.status_code, r.text[:400], repr(case.body)[:400])

    run()
    assert len(seen) >= examples(40) // 2  # most draws are sent (hypothesis may stop early on tiny spaces)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/{model_id}", "/health/live", "/health/ready",
                                  "/metrics", "/v1/stats", "/openapi.json"])
def test_schemathesis_get(w, path):
    doc = served_schema(w)
    if path == "/openapi.json":
        assert httpx.get(w.url + path, headers=AUTH).status_code == 200
        return
    op = doc[path]["GET"]

    @settings(FUZZ, max_examples=examples(8))
    @given(case=op.as_strategy())
    def run(case) -> None:
        r = case.call(base_url=w.url, headers=AUTH, timeout=60)
        assert r.status_code < 500, (path, r.status_code, r.text[:400])

    run()


# -- hypothesis: the four agent bodies, filled with what clients get wrong ---------------------------------

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24)
odd_text = text | st.sampled_from(["\ud800", "a\udfffb", "<start_of_turn>", "<tool_call>", "</think>", "\x00",
                                   "```json\n{", "[TOOL_CALLS]", "{{ raise }}", "{% for %}"])
scalars = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False,
                                                                                     allow_infinity=False) | text
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=6)
names = st.sampled_from(["f", "get_weather", "Read", "a.b:c-d", "", "x" * 200, "bad name"]) | text

schemas = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "bogus"])
        | st.lists(st.sampled_from(["string", "null"]), max_size=2),
        "pattern": st.sampled_from(["^[a-z]+$", "(", "(?=x)", "\\d{2,}"]),
        "format": st.sampled_from(["date-time", "email", "uuid", "color"]),
        "enum": st.lists(scalars, max_size=3), "minLength": st.integers(-2, 5), "maxLength": st.integers(-1, 300),
        "minimum": st.integers(-5, 5), "multipleOf": st.sampled_from([0, 0.5, 3]), "not": st.just({}),
        "$ref": st.sampled_from(["#/$defs/x", "#/nowhere", "http://example.com/s"]),
        "uniqueItems": st.booleans(), "additionalProperties": st.booleans(),
    }),
    lambda c: st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": st.dictionaries(text, c, max_size=3), "required": st.lists(text, max_size=2),
        "items": c, "anyOf": st.lists(c, max_size=2), "allOf": st.lists(c, max_size=2),
        "$defs": st.dictionaries(st.just("x"), c, max_size=1)}),
    max_leaves=6,
) | junk

sampling = {
    "temperature": st.floats(-1, 1e6, allow_nan=False) | st.sampled_from([0, 1e-40, 5e-324, 1e-6, 2.0]) | junk,
    "top_p": st.floats(-1, 2, allow_nan=False) | st.sampled_from([1e-300, 0.0, 1.0]),
    "top_k": st.integers(-3, 5000) | junk, "min_p": st.floats(-1, 2, allow_nan=False),
    "presence_penalty": st.floats(-3, 3, allow_nan=False), "frequency_penalty": st.floats(-3, 3, allow_nan=False),
    "repetition_penalty": st.floats(-1, 1e30, allow_nan=False) | st.sampled_from([1e-30, 0.0]),
    "seed": st.integers(-(2 ** 70), 2 ** 70) | junk,
    "stop": st.none() | text | st.lists(text, max_size=20) | junk,
}
openai_tool_choice = st.sampled_from(["auto", "none", "required", "any", ""]) | st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "allowed_tools", "custom", "tool"])},
    optional={"function": st.fixed_dictionaries({}, optional={"name": names}) | junk, "name": names,
              "mode": st.sampled_from(["auto", "required", "none", 3]),
              "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "mcp"])},
                                                      optional={"name": names, "function": junk}), max_size=3) | junk,
              "allowed_tools": st.fixed_dictionaries({}, optional={
                  "mode": st.sampled_from(["auto", "required", "odd"]),
                  "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}, optional={
                      "function": st.fixed_dictionaries({}, optional={"name": names})}), max_size=3) | junk}) | junk,
              }) | junk

chat_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "ghost"])},
    optional={
        "content": st.none() | odd_text | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "input_text", "image_url", "refusal", "thinking", "weird"])},
            optional={"text": odd_text | junk, "image_url": junk}), max_size=3) | junk,
        "name": text | junk, "tool_call_id": text | junk,
        "tool_calls": st.lists(st.fixed_dictionaries({"id": text, "type": st.just("function")}, optional={
            "function": st.fixed_dictionaries({}, optional={"name": names, "arguments": text | junk}) | junk}),
            max_size=2) | junk,
    })
chat_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "custom"])}, optional={
    "function": st.fixed_dictionaries({"name": names}, optional={"description": text | junk,
                                                                "parameters": schemas}) | junk}) | junk
chat_body = st.fixed_dictionaries({"messages": st.lists(chat_message, max_size=4) | junk}, optional={
    **sampling, "stream": st.booleans(), "max_tokens": st.integers(-2, 10 ** 9) | junk,
    "max_completion_tokens": st.integers(-2, 100), "n": st.integers(-1, 3),
    "logprobs": st.booleans() | junk, "top_logprobs": st.integers(-1, 30),
    "logit_bias": st.dictionaries(st.integers(-5, 300_000).map(str) | text, st.floats(-150, 150, allow_nan=False)
                                  | junk, max_size=5) | junk,
    "tools": st.lists(chat_tool, max_size=3) | junk, "tool_choice": openai_tool_choice,
    "parallel_tool_calls": st.booleans() | junk, "reasoning_effort": st.sampled_from(["low", "high", "none", "max"])
    | junk, "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema",
                                                                              "xml"])}, optional={
        "json_schema": st.fixed_dictionaries({"name": text}, optional={"schema": schemas, "strict": st.booleans()})
        | junk}) | junk,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk}) | junk,
})
completions_body = st.fixed_dictionaries({"prompt": odd_text | st.lists(st.integers(-5, 300_000), max_size=8)
                                          | st.lists(odd_text | st.lists(st.integers(0, 1000), max_size=3),
                                                     max_size=2) | junk}, optional={
    **sampling, "max_tokens": st.integers(-2, 10 ** 9) | junk, "echo": st.booleans() | junk,
    "logprobs": st.integers(-1, 30) | junk, "suffix": odd_text | junk, "best_of": st.integers(0, 3),
    "n": st.integers(-1, 3), "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(-5, 300_000).map(str), st.floats(-150, 150, allow_nan=False),
                                  max_size=4),
})
responses_item = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                                 "reasoning", "item_reference", "weird"])}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | junk,
    "content": odd_text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                                    "input_image", "refusal"])},
                                                         optional={"text": odd_text | junk}), max_size=2) | junk,
    "name": names, "arguments": text | junk, "call_id": text | junk, "output": odd_text | junk,
    "summary": junk, "id": text,
})
responses_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "mcp"])}, optional={
    "name": names, "parameters": schemas, "description": text | junk, "strict": st.booleans() | junk}) | junk
responses_body = st.fixed_dictionaries({"input": odd_text | st.lists(responses_item, max_size=4) | junk}, optional={
    **sampling, "stream": st.booleans(), "max_output_tokens": st.integers(-2, 10 ** 9) | junk,
    "instructions": odd_text | junk, "tools": st.lists(responses_tool, max_size=3) | junk,
    "tool_choice": openai_tool_choice, "parallel_tool_calls": st.booleans(),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high", "x"]) | junk,
                                                      "summary": junk}) | junk,
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_schema", "json_object", "yaml"])},
        optional={"name": text, "schema": schemas, "strict": st.booleans()}) | junk}) | junk,
    "previous_response_id": st.none() | text, "store": st.booleans() | junk, "metadata": junk,
})
anthropic_block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking",
                                                                  "redacted_thinking", "image", "document", "odd"])},
                                        optional={"text": odd_text | junk, "id": text, "name": names, "input": junk,
                                                  "tool_use_id": text | junk, "thinking": odd_text, "signature": text,
                                                  "content": odd_text | st.lists(junk, max_size=2) | junk,
                                                  "is_error": st.booleans() | junk, "cache_control": junk})
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"])}, optional={
    "content": odd_text | st.lists(anthropic_block, max_size=3) | junk})
anthropic_body = st.fixed_dictionaries({"messages": st.lists(anthropic_message, max_size=4) | junk,
                                        "max_tokens": st.integers(-2, 10 ** 6) | junk}, optional={
    "temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": sampling["top_k"],
    "stop_sequences": st.lists(text, max_size=20) | junk, "stream": st.booleans(),
    "system": odd_text | st.lists(anthropic_block, max_size=2) | junk,
    "tools": st.lists(st.fixed_dictionaries({}, optional={"name": names, "input_schema": schemas,
                                                          "description": text | junk, "type": text}), max_size=3)
    | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "all"])}, optional={
        "name": names, "disable_parallel_tool_use": st.booleans() | junk}) | junk,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "on"])},
                                      optional={"budget_tokens": st.integers(-5, 10 ** 6) | junk}) | junk,
    "output_config": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "text"])}, optional={"schema": schemas}) | junk,
        "effort": junk}) | junk,
    "metadata": junk,
})

# mostly-valid bodies as well, so that the generation path itself gets fuzzed, not only validation
prose = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=40)
fine = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 1024),
        "seed": st.integers(0, 2 ** 63), "stop": st.lists(prose, max_size=3), "stream": st.booleans()}
fine_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.sampled_from(["f", "get_weather", "Read"]), "parameters": st.just(
        {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]})})})
valid_chat = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system"]), "content": prose}), min_size=1, max_size=3)}, optional={
    **fine, "logit_bias": st.dictionaries(st.integers(0, 200_000).map(str), st.floats(-100, 100), max_size=3),
    "tools": st.lists(fine_tool, max_size=1, unique_by=lambda t: t["function"]["name"]),
    "tool_choice": st.sampled_from(["auto", "none"]), "logprobs": st.booleans(),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}])})
valid_completions = st.fixed_dictionaries({"prompt": prose | st.lists(st.integers(0, 200_000), min_size=1,
                                                                      max_size=8)}, optional={
    **fine, "echo": st.booleans(), "logprobs": st.integers(0, 5)})
valid_responses = st.fixed_dictionaries({"input": prose}, optional={**fine, "instructions": prose,
                                                                     "reasoning": st.just({"effort": "low"})})
valid_messages = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.just("user"), "content": prose}), min_size=1, max_size=2), "max_tokens": st.integers(1, 64)},
    optional={"temperature": st.floats(0, 1), "top_k": st.integers(0, 50), "system": prose,
              "stop_sequences": st.lists(prose, max_size=3), "stream": st.booleans()})

BODIES = {"/v1/chat/completions": valid_chat | chat_body, "/v1/completions": valid_completions | completions_body,
          "/v1/responses": valid_responses | responses_body, "/v1/messages": valid_messages | anthropic_body}


@pytest.mark.parametrize("path", list(BODIES))
def test_agent_bodies(w, path):
    sent = []
    client = httpx.Client(base_url=w.url, headers={**AUTH, "content-type": "application/json"}, timeout=120)

    @settings(FUZZ, max_examples=examples(110))
    @given(body=BODIES[path])
    def run(body) -> None:
        r = client.post(path, content=json.dumps(body).encode())  # lone surrogates go as \ud800 escapes
        sent.append(r.status_code)
        check_answer(path, r, body)

    try:
        run()
    finally:
        client.close()
    assert len(sent) >= examples(110) // 2
    assert any(s == 200 for s in sent) and any(400 <= s < 500 for s in sent), sorted(set(sent))


def test_zz_the_worker_survived_the_fuzzing(w):
    assert w.proc.poll() is None and w.proc.pid == w.pid_at_start
    assert httpx.get(w.url + "/health/ready").status_code == 200
    assert not w.events("api_error"), w.events("api_error")[:3]
    assert not [e for e in w.events("failed") if e.get("status", 500) >= 500], w.events("failed")[:3]
