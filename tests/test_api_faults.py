"""Containment over HTTP: a request that fails ends with its protocol's error (event) while other
streams carry on; a poisoned compute context ends every stream with an error event and the worker
exits with code 75. Faults are injected with --fault (loopback only)."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def fault_worker(start_worker):
    # requests #2..#6 (in arrival order) fail inside the engine, one per protocol and mode below
    spec = ",".join(f"raise:request={n}" for n in range(2, 7))
    w = start_worker("--max-seqs", "4", "--ctx", "1024", "--kv-mem", "64MiB", "--fault", spec)
    yield w
    w.stop()  # free its memory now, not at the end of the session


def test_a_failing_request_fails_alone(fault_worker, openai_factory):
    oc = openai_factory(fault_worker)
    ac = anthropic.Anthropic(base_url=fault_worker.url, api_key=fault_worker.api_key, max_retries=0)
    survivor: dict = {}
    msgs = [{"role": "user", "content": "Tell me about lighthouses."}]

    def run_survivor() -> None:  # request #1: streams on while the others fail
        chunks = oc.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0, stream=True)
        survivor["text"] = "".join(c.choices[0].delta.content or "" for c in chunks)

    t = threading.Thread(target=run_survivor)
    t.start()
    fault_worker.wait_event("admit", seq=1)

    # #2 chat stream: `data: {"error": ...}` mid-stream -> the SDK raises
    with pytest.raises(openai.APIError) as e:
        list(oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                        stream=True))
    assert "injected failure" in str(e.value.message)
    # #3 anthropic stream: `event: error`
    with (pytest.raises(anthropic.APIStatusError) as e2,
          ac.messages.stream(model="c", max_tokens=4, messages=[{"role": "user", "content": "b"}]) as s):
        list(s)
    assert e2.value.body["type"] == "error" and e2.value.body["error"]["type"] == "api_error"
    # #4 responses stream: response.failed
    events = list(oc.responses.create(model="m", input="c", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # #5 completions, not streaming: 500 in OpenAI's shape
    with pytest.raises(openai.InternalServerError) as e3:
        oc.completions.create(model="m", prompt="d", max_tokens=2)
    assert e3.value.status_code == 500 and e3.value.type == "server_error"
    assert "Traceback" not in e3.value.message
    # #6 messages, not streaming: 500 in Anthropic's shape
    r = httpx.post(fault_worker.url + "/v1/messages", headers={"x-api-key": fault_worker.api_key},
                   json={"model": "c", "max_tokens": 2, "messages": [{"role": "user", "content": "e"}]}, timeout=120)
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"

    t.join(300)
    solo = oc.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
    assert survivor["text"] == solo.choices[0].message.content
    failed = fault_worker.events("failed")
    assert sorted(r["seq"] for r in failed) == [2, 3, 4, 5, 6] and all(r["request_id"] for r in failed)
    assert {r["seq"] for r in fault_worker.events("completed")} >= {1, 7}
    assert httpx.get(fault_worker.url + "/health/live").json()["state"] == "ready"


def test_poisoned_context_ends_streams_and_exits_75(start_worker, openai_factory):
    w = start_worker("--max-seqs", "4", "--ctx", "512", "--kv-mem", "32MiB", "--fault", "poison:step=8,slow:ms=100")
    oc = openai_factory(w)
    errors: dict = {}

    def anthropic_stream() -> None:
        body = {"model": "c", "max_tokens": 50, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "Tell a story."}]}
        with httpx.stream("POST", w.url + "/v1/messages", json=body, headers={"x-api-key": w.api_key},
                          timeout=120) as r:
            errors["anthropic"] = [line for line in r.iter_lines() if line.startswith("event: ")]

    t = threading.Thread(target=anthropic_stream)
    t.start()
    w.wait_event("admit", seq=1)
    with pytest.raises(openai.APIError) as e:
        list(oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count."}],
                                        max_tokens=50, temperature=0, stream=True))
    assert "compute context" in str(e.value.message)
    t.join(60)
    assert errors["anthropic"][-1] == "event: error"
    t0 = time.monotonic()
    assert w.proc.wait(10) == 75 and time.monotonic() - t0 < 5
    poisoned = w.events("engine_poisoned")
    assert poisoned and poisoned[0]["code"] == 700
