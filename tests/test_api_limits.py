"""A worker with one sequence slot and a queue of one: 429 with Retry-After when full, a queued
request whose client goes away, and a graceful stop (SIGTERM: draining, 503 for new work,
in-flight work finishes, exit 0)."""

from __future__ import annotations

import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
from test_api_disconnect import RawClient, chat_body, wait_canceled


@pytest.fixture(scope="module")
def tiny_worker(start_worker):
    w = start_worker("--max-seqs", "1", "--max-queue", "1", "--ctx", "512", "--kv-mem", "32MiB",
                     "--drain-seconds", "60")
    yield w
    w.stop()  # free its memory now, not at the end of the session


def engine_stats(worker) -> dict:
    return httpx.get(worker.url + "/v1/stats").json()["engine"]


def wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_full_queue_answers_429_and_a_queued_client_can_leave(tiny_worker, openai_factory):
    client = openai_factory(tiny_worker)
    running = RawClient(tiny_worker, "/v1/chat/completions", chat_body("Tell a long story.", max_tokens=400,
                                                                       stream=True))
    running.read_until(b'"content":"', count=2)  # decoding: it holds the only slot
    queued = RawClient(tiny_worker, "/v1/chat/completions", chat_body("Queued one.", max_tokens=2, stream=True))
    wait_for(lambda: engine_stats(tiny_worker)["waiting"] == 1)

    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
    assert e.value.code == "rate_limit_exceeded"
    ac = anthropic.Anthropic(base_url=tiny_worker.url, api_key=tiny_worker.api_key, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as e2:
        ac.messages.create(model="claude", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert e2.value.body["error"]["type"] == "rate_limit_error"
    assert e2.value.response.headers["retry-after"] == "1"

    # the queued client goes away: its request is dropped from the queue at once
    queued.read_until(b"\r\n\r\n")
    rid = queued.headers["x-request-id"]
    gone = queued.go_away("close")
    rec = wait_canceled(tiny_worker, rid, gone, limit=5.0)
    assert rec["phase"] == "queued"
    assert engine_stats(tiny_worker)["running"] == 1  # the running stream carries on
    running.read_until(b'"content":"', count=4)
    gone = running.go_away("reset")
    wait_canceled(tiny_worker, running.headers["x-request-id"], gone)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.usage.completion_tokens <= 1
    refused = tiny_worker.events("refused")
    assert len(refused) == 2 and {r["status"] for r in refused} == {429}


def test_sigterm_drains(tiny_worker, openai_factory):
    client = openai_factory(tiny_worker)
    result: dict = {}

    def in_flight() -> None:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to ten."}],
                                           max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(r)
        result["usage"] = chunks[-1].usage
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    t = threading.Thread(target=in_flight)
    t.start()
    wait_for(lambda: engine_stats(tiny_worker)["running"] == 1)
    tiny_worker.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(tiny_worker.url + "/health/ready").status_code == 503, timeout=10)
    ready = httpx.get(tiny_worker.url + "/health/ready")
    assert ready.json()["state"] == "draining"
    live = httpx.get(tiny_worker.url + "/health/live")
    assert live.status_code == 200 and live.json()["state"] == "draining"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) > 0
    r = httpx.post(tiny_worker.url + "/v1/messages", headers={"x-api-key": tiny_worker.api_key},
                   json={"model": "c", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error" and "retry-after" in r.headers
    t.join(120)
    assert result["finish"] and result["usage"].completion_tokens >= 1
    assert tiny_worker.proc.wait(60) == 0
