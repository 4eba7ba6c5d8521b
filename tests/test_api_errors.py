"""Errors in each protocol's shape (400 naming the field, 401, 404, the context limit), health and
metrics of the shared worker."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    kw.setdefault("max_tokens", 1)
    return client.chat.completions.create(model="m", **kw)


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"extra_body": {"temperature": "hot"}}, "temperature"),
    ({"extra_body": {"stop": 7}}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
     "messages[0].content[0]"),
])
def test_bad_chat_parameters_name_the_field(openai_client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, **kw)
    assert e.value.status_code == 400
    assert e.value.param == param, e.value.body
    assert e.value.type == "invalid_request_error"
    assert "Traceback" not in e.value.message


def test_bad_completion_parameters(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="m", prompt=["a", "b"], max_tokens=1)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="m", prompt=[1, 2, 10**9], max_tokens=1)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="m", prompt="x", max_tokens=1, logprobs=99)
    assert e.value.param == "logprobs"


def test_malformed_json(api_worker):
    headers = {**api_worker.headers(), "content-type": "application/json"}
    r = httpx.post(api_worker.url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(api_worker.url + "/v1/messages", content=b"", headers=headers)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(api_worker.url + "/v1/messages", content=b"{}", headers=api_worker.headers())  # no Content-Type
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_over_the_context_limit(openai_client, anthropic_client, api_worker):
    long = "word " * 1500  # the shared worker runs with --ctx 1024
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, messages=[{"role": "user", "content": long}])
    assert e.value.code == "context_length_exceeded" and "1024" in e.value.message
    assert e.value.param == "messages"
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="claude", max_tokens=1, messages=[{"role": "user", "content": long}])
    assert "1024" in e.value.body["error"]["message"]
    refused = api_worker.wait_event("refused", status=400)
    assert refused["protocol"] in ("chat", "messages") and refused["request_id"]


def test_max_tokens_beyond_the_context_is_clamped(openai_client, api_worker):
    def n_tokens(content: str) -> int:
        r = httpx.post(api_worker.url + "/tokenize", headers=api_worker.headers(),
                       json={"messages": [{"role": "user", "content": content}]})
        return r.json()["count"]

    base = n_tokens("")
    per_word = n_tokens("word " * 100) - n_tokens("word " * 99)
    content = "word " * ((1020 - base) // per_word)
    room = 1024 - n_tokens(content)
    assert 0 < room <= 8
    r = chat(openai_client, messages=[{"role": "user", "content": content}], max_tokens=100_000, temperature=0)
    assert r.usage.completion_tokens <= room
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == room  # greedy: it goes on


def test_auth(api_worker):
    bad = openai.OpenAI(base_url=api_worker.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        chat(bad)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for path in ("/v1/models", "/tokenize"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", api_worker.url + path, json={})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    ok = httpx.get(api_worker.url + "/v1/models", headers={"x-api-key": api_worker.api_key})
    assert ok.status_code == 200
    for public in ("/health/live", "/health/ready", "/metrics", "/v1/stats"):
        assert httpx.get(api_worker.url + public).status_code == 200


def test_unknown_route_and_method(api_worker):
    r = httpx.get(api_worker.url + "/v1/nothing", headers=api_worker.headers())
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("no such endpoint")
    r = httpx.get(api_worker.url + "/v1/chat/completions", headers=api_worker.headers())
    assert r.status_code == 405 and "error" in r.json()


def test_health(api_worker):
    live = httpx.get(api_worker.url + "/health/live").json()
    ready = httpx.get(api_worker.url + "/health/ready").json()
    assert live["state"] == ready["state"] == "ready" and live["stalled"] is False


def test_metrics_and_stats(openai_client, api_worker):
    chat(openai_client)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(api_worker.url + "/metrics").text)}
    for name in ("ember_requests_started", "ember_requests", "ember_prompt_tokens", "ember_cached_prompt_tokens",
                 "ember_generated_tokens", "ember_time_to_first_token_seconds", "ember_inter_token_latency_seconds",
                 "ember_queue_depth", "ember_running_sequences", "ember_kv_usage_ratio"):
        assert name in families, name
    outcomes = {s.labels["outcome"] for s in families["ember_requests"].samples if "outcome" in s.labels}
    assert outcomes == {"completed", "failed", "canceled", "refused"}
    stats = httpx.get(api_worker.url + "/v1/stats").json()
    assert stats["state"] == "ready" and stats["engine"]["context"] == 1024 and stats["engine"]["max_seqs"] == 4
    assert stats["metrics"]["ember_requests_started_total"] >= 1


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(257)]},
     400, "--max-tools"),
    ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(257)]},
     400, "--max-tools"),
    ("/v1/responses", {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "a"}] * 2}, 400,
     "two tools are named"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     400, "temperature"),
    ("/v1/completions", b'{"model": "m", "prompt": ', 400, "not valid JSON"),
])
def test_every_refused_request_logs_exactly_one_outcome(api_worker, path, body, status, needle):
    """A request the worker refuses before the engine has it (a bound, a bad field, a body that is no JSON)
    logs one `refused` line and counts once, like every other request (issue 38 item 6)."""
    import json
    import time

    w = api_worker
    started = w.metric_values()["ember_requests_started_total"]
    before = len(w.events("refused"))
    headers = {**w.headers(), "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{w.url}{path}", content=content, headers=headers, timeout=30)
    assert r.status_code == status and needle in r.text, r.text
    deadline = time.monotonic() + 5
    while len(w.events("refused")) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    new = w.events("refused")[before:]
    assert len(new) == 1 and new[0]["status"] == status and needle in new[0]["reason"], new
    assert w.metric_values()["ember_requests_started_total"] == started + 1
