"""Slow and vanishing clients against a real worker (issue 38 item 4): connections that send their headers
or body a byte at a time, or nothing at all, are closed (408) after the read timeouts, at most
--max-slow-connections of them are mid-request at once, normal requests are answered meanwhile, and a
client that goes away mid-body is one info line without a traceback."""

from __future__ import annotations

import json
import select
import socket
import struct
import time

import httpx
import pytest

SLOW = ("--read-header-seconds", "2", "--read-body-seconds", "2", "--read-body-min-rate", "500",
        "--max-slow-connections", "16", "--ctx", "512", "--kv-mem", "32MiB", "--kv-persist", "off")


@pytest.fixture(scope="module")
def slow_worker(start_worker):
    return start_worker(*SLOW)


class Trickle:
    """One raw connection that sends `data` a byte at a time; `closed` once the server hangs up."""

    def __init__(self, port: int, data: bytes):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.setblocking(False)
        self.data, self.sent, self.answer = data, 0, b""
        self.closed_at: float | None = None

    def step(self, now: float) -> None:
        if self.closed_at is not None:
            return
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
            if r:
                got = self.sock.recv(65536)
                self.answer += got
                if not got:
                    raise ConnectionResetError
                return
            if self.sent < len(self.data):
                self.sock.send(self.data[self.sent:self.sent + 1])
                self.sent += 1
        except OSError:
            self.closed_at = now
            self.sock.close()


def _head(path: str, key: str, body_len: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}",
             "Content-Type: application/json", f"Content-Length: {body_len or 0}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_slow_clients_are_closed_and_capped_while_others_are_served(slow_worker):
    w = slow_worker
    heads = [Trickle(w.port, _head("/v1/completions", w.api_key, 20) + b"{}") for _ in range(20)]
    bodies = []
    for _ in range(10):
        t = Trickle(w.port, b"")
        t.sock.setblocking(True)
        t.sock.sendall(_head("/v1/completions", w.api_key, 100_000))  # the head at once, then a body trickle
        t.sock.setblocking(False)
        t.data = b" " * 100_000
        bodies.append(t)
    silent = [Trickle(w.port, b"") for _ in range(10)]  # connect, say nothing
    every = heads + bodies + silent
    t0 = time.monotonic()
    served = None
    while time.monotonic() - t0 < 15 and any(t.closed_at is None for t in every):
        now = time.monotonic()
        for t in every:
            t.step(now)
        if served is None and now - t0 > 0.5:  # a normal client meanwhile
            served = httpx.post(f"{w.url}/v1/completions", headers=w.headers(), timeout=30,
                                json={"model": "m", "prompt": "Hello", "max_tokens": 2})
        time.sleep(0.25)
    assert served is not None and served.status_code == 200, served
    open_ = [t for t in every if t.closed_at is None]
    assert not open_, f"{len(open_)} slow connections still open after 15 s"
    took = max(t.closed_at for t in every) - t0
    assert took < 2 + 2 + 4, took  # the timeouts, and a tick of slack (no 60-second hold any more)
    assert any(t.answer.startswith(b"HTTP/1.1 408") for t in heads + silent)
    assert any(t.answer.startswith(b"HTTP/1.1 408") for t in bodies)
    closes = w.events("slow_client")
    phases = {e["phase"] for e in closes}
    assert {"head", "body", "evicted"} <= phases, phases  # 40 at once: past 16, the oldest went at once
    assert sum(e["phase"] == "evicted" for e in closes) >= 40 - 16
    assert all(e["level"] == "info" for e in closes)
    m = w.metric_values()
    assert sum(m[f"ember_http_slow_clients_total{{phase={p}}}"] for p in ("head", "body", "evicted")) >= 40
    assert not [e for e in w.events() if e.get("level") in ("error", "critical")]
    assert httpx.get(f"{w.url}/health/live", timeout=5).status_code == 200


def test_a_client_that_goes_away_mid_body_is_one_info_line(slow_worker):
    w = slow_worker
    before = len(w.events("client_gone"))
    for reset in (False, True):
        s = socket.create_connection(("127.0.0.1", w.port), timeout=5)
        s.sendall(_head("/v1/chat/completions", w.api_key, 5000) + b'{"model": "m", "messages": [')
        time.sleep(0.3)
        if reset:  # an abortive close (RST), as a killed agent's socket
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(w.events("client_gone")) < before + 2:
        time.sleep(0.1)
    gone = w.events("client_gone")[before:]
    assert len(gone) == 2 and all(e["level"] == "info" and e["path"] == "/v1/chat/completions" for e in gone)
    assert all(e["body_bytes"] > 0 and e["content_length"] == 5000 for e in gone)
    assert not w.events("api_error")
    text = w.log_text()
    assert "Traceback" not in text and '"traceback"' not in text
    assert json.loads(httpx.get(f"{w.url}/health/live", timeout=5).text)["state"] == "ready"
