"""Clients that go away: a stream or a plain request whose client closes or resets the connection
while its request is in prefill or decoding is canceled within an engine step, keeps what it
computed in the prefix cache, and leaves other streams untouched. Keepalives flow during long
prefills. A worker with slow steps (fault `slow`) makes the phases long enough to hit."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid

import httpx
import pytest

CHUNK = 32  # --prefill-chunk: a long prompt takes many steps


@pytest.fixture(scope="module")
def slow_worker(start_worker):
    w = start_worker("--max-seqs", "4", "--ctx", "2048", "--kv-mem", "128MiB", "--prefill-chunk", str(CHUNK),
                     "--fault", "slow:ms=150")
    yield w
    w.stop()  # free its memory now, not at the end of the session


def long_text(tag: str, words: int = 700) -> str:
    vocab = ["river", "stone", "lamp", "window", "garden", "paper", "signal", "market", "engine", "cloud"]
    return f"[{tag}] " + " ".join(vocab[(i * 7 + len(tag)) % len(vocab)] for i in range(words))


class RawClient:
    """An HTTP/1.1 request on a bare socket, so the test decides exactly when and how it goes away."""

    def __init__(self, worker, path: str, body: dict):
        self.sock = socket.create_connection(("127.0.0.1", worker.port))
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {worker.api_key}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        self.sock.sendall(head + data)
        self.buf = b""
        self.headers: dict[str, str] = {}

    def read_until(self, marker: bytes, timeout: float = 60.0, count: int = 1) -> bytes:
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while self.buf.count(marker) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} in {self.buf[-500:]!r}")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {marker!r}: {self.buf[-500:]!r}")
            self.buf += chunk
            if not self.headers and b"\r\n\r\n" in self.buf:
                head = self.buf.split(b"\r\n\r\n", 1)[0].decode()
                self.headers = {k.strip().lower(): v.strip() for k, _, v in
                                (line.partition(":") for line in head.split("\r\n")[1:])}
        return self.buf

    def go_away(self, how: str) -> float:
        if how == "reset":  # RST instead of FIN, as agents killed mid-request often do
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        return time.monotonic()


def chat_body(content: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def wait_canceled(worker, request_id: str, since: float, limit: float = 5.0) -> dict:
    rec = worker.wait_event("canceled", timeout=limit + 20, request_id=request_id)
    assert time.monotonic() - since < limit, f"cancel took {time.monotonic() - since:.1f}s"
    return rec


@pytest.mark.parametrize("how", ["close", "reset"])
def test_stream_disconnect_mid_prefill_keeps_computed_blocks(slow_worker, how):
    content = long_text(uuid.uuid4().hex[:8])
    c = RawClient(slow_worker, "/v1/chat/completions", chat_body(content, max_tokens=4, stream=True))
    c.read_until(b'"role":"assistant"')  # admitted: the prefill has begun
    rid = c.headers["x-request-id"]
    time.sleep(1.5)  # several 32-token chunks at >= 150 ms a step
    gone = c.go_away(how)
    rec = wait_canceled(slow_worker, rid, gone)
    assert rec["phase"] == "prefill" and rec["completion_tokens"] == 0
    # an identical retry reuses the blocks the abandoned prefill computed
    r = httpx.post(slow_worker.url + "/v1/chat/completions", json=chat_body(content, max_tokens=1),
                   headers=slow_worker.headers(), timeout=300).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 16


@pytest.mark.parametrize("how", ["close", "reset"])
def test_non_streaming_disconnect_mid_prefill(slow_worker, how):
    before = {r["request_id"] for r in slow_worker.events("admit")}
    c = RawClient(slow_worker, "/v1/messages", {"model": "claude", "max_tokens": 4, "temperature": 0,
                                                "messages": [{"role": "user", "content": long_text(how)}]})
    deadline = time.monotonic() + 60
    while not (new := [r for r in slow_worker.events("admit") if r["request_id"] not in before]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    gone = c.go_away(how)
    rec = wait_canceled(slow_worker, new[0]["request_id"], gone)
    assert rec["phase"] == "prefill"


def solo(worker, content: str, max_tokens: int) -> str:
    r = httpx.post(worker.url + "/v1/chat/completions", json=chat_body(content, max_tokens=max_tokens),
                   headers=worker.headers(), timeout=300)
    return r.json()["choices"][0]["message"]["content"]


def test_disconnect_mid_decode_leaves_other_streams_untouched(slow_worker, openai_factory):
    prompts = [f"Write about {topic}." for topic in ("bridges", "owls", "tea")]
    alone = [solo(slow_worker, p, 6) for p in prompts]
    client = openai_factory(slow_worker)
    results: dict[int, str] = {}

    def run(i: int) -> None:
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=6, temperature=0, stream=True)
        results[i] = "".join(ch.choices[0].delta.content or "" for ch in chunks)

    victim = RawClient(slow_worker, "/v1/chat/completions", chat_body("Tell a long story.", max_tokens=300,
                                                                      stream=True))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    victim.read_until(b'"content":"', count=3)  # the role chunk, then two tokens
    gone = victim.go_away("reset")
    rec = wait_canceled(slow_worker, victim.headers["x-request-id"], gone)
    assert rec["phase"] == "decode" and 0 < rec["completion_tokens"] < 300
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(3)] == alone


def sse_lines(resp) -> list[str]:
    return [line for line in resp.iter_lines()]


def test_keepalive_comments_during_long_prefill(slow_worker):
    body = chat_body(long_text(uuid.uuid4().hex[:8], 500), max_tokens=1, stream=True)
    with httpx.stream("POST", slow_worker.url + "/v1/chat/completions", json=body, headers=slow_worker.headers(),
                      timeout=300) as r:
        lines = sse_lines(r)
    role = next(i for i, line in enumerate(lines) if '"role":"assistant"' in line)
    first_token = next(i for i, line in enumerate(lines) if line.startswith("data: {") and i > role)
    assert ": keepalive" in lines[role:first_token]
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"


def test_anthropic_pings_during_long_prefill(slow_worker):
    body = {"model": "claude", "max_tokens": 1, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": long_text(uuid.uuid4().hex[:8], 500)}]}
    headers = {"x-api-key": slow_worker.api_key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", slow_worker.url + "/v1/messages", json=body, headers=headers, timeout=300) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events.count("ping") >= 2  # the one after content_block_start, then keepalives
    assert events[-1] == "message_stop"


def test_sdks_read_through_keepalives(slow_worker, openai_factory):
    """Prefills of several seconds: keepalive comments between typed events do not upset the client."""
    client = openai_factory(slow_worker)
    text = long_text(uuid.uuid4().hex[:8], 400)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                 max_tokens=1, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    other = long_text(uuid.uuid4().hex[:8], 400)  # a new prefix: a full prefill again
    events = list(client.responses.create(model="m", input=other, max_output_tokens=1, temperature=0, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_counters_balance(slow_worker):
    deadline = time.monotonic() + 120
    while True:
        stats = httpx.get(slow_worker.url + "/v1/stats").json()
        if stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    m = slow_worker.metric_values()
    outcomes = {o: m[f"ember_requests_total{{outcome={o}}}"] for o in ("completed", "failed", "canceled", "refused")}
    assert m["ember_requests_started_total"] == sum(outcomes.values())
    assert outcomes["canceled"] >= 5 and outcomes["failed"] == 0
    assert m["ember_time_to_first_token_seconds_count"] >= outcomes["completed"]
    assert stats["metrics"]["ember_requests_started_total"] == m["ember_requests_started_total"]
    # exactly one outcome line per admitted request
    admitted = {r["request_id"] for r in slow_worker.events("admit")}
    settled = [r["request_id"] for o in outcomes for r in slow_worker.events(o) if "request_id" in r]
    assert sorted(settled) == sorted(set(settled)) and admitted <= set(settled)
