"""A hostile client's named cases against a real worker: size before work, every mistake a 4xx in the
protocol's own shape, pages in a browser kept out, and the server-wide caps. The worker must end
them all with the same pid, ready, with no 5xx and no internal error in its log."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import API_KEY

GENERATION = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}


def post(worker, path: str, body, headers: dict[str, str] | None = None, timeout: float = 120) -> httpx.Response:
    h = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(worker.url + path, content=content, headers=h, timeout=timeout)


def error_of(path: str, r: httpx.Response) -> dict:
    """The error object, checked to be in the protocol's own shape."""
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


class LiveProbe:
    """Polls /health/live from a thread while a test runs; `worst` is the slowest answer."""

    def __init__(self, worker):
        self.worker, self.worst, self.failures = worker, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get(self.worker.url + "/health/live").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - t0)
                self.failures += not ok
                time.sleep(0.05)

    def __enter__(self) -> LiveProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def w(hardened_worker):
    w = hardened_worker
    w.pid_at_start = w.proc.pid
    return w


# -- size before work ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(GENERATION))
def test_a_10mb_prompt_is_refused_at_once_and_liveness_holds(w, path):
    big = "All work and no play makes Jack a dull boy. " * (10_000_000 // 44)
    body = dict(GENERATION[path])
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": big}]
    else:
        body["prompt" if "prompt" in body else "input"] = big
    with LiveProbe(w) as probe:
        t0 = time.monotonic()
        r = post(w, path, body)
        took = time.monotonic() - t0
    assert r.status_code == 413 and "larger than" in error_of(path, r)["message"]
    assert took < 5 and probe.worst < 1.0 and probe.failures == 0, (took, probe.worst)


def test_a_prompt_within_the_byte_bound_is_counted_off_the_event_loop(w):
    # short enough that its length alone does not prove it too long, so it is tokenized: in batches,
    # on a worker thread, stopping as soon as the count passes the context
    words = ["alpha", "beta(", "[gamma]", "δέλτα", "\n", "    ", "ε"]
    text = " ".join(words[i % len(words)] for i in range(90_000))
    with LiveProbe(w) as probe:
        r = post(w, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    err = error_of("/v1/chat/completions", r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "context limit is 2048 tokens" in err["message"]
    assert probe.worst < 1.0 and probe.failures == 0, probe.worst
    assert w.events("refused", status=400)  # counted and logged as one outcome


def test_tokenize_counts_past_the_context_off_the_loop(w):
    text = "tokenize me " * 40_000
    with LiveProbe(w) as probe:
        r = post(w, "/tokenize", {"content": text})
    assert r.status_code == 200 and r.json()["count"] > 2048
    assert probe.worst < 1.0, probe.worst
    r = post(w, "/detokenize", {"tokens": [2, 10, 10 ** 9]})
    assert r.status_code == 400 and error_of("/detokenize", r)["param"] == "tokens"


def test_token_id_prompts_past_the_context_or_vocabulary(w):
    r = post(w, "/v1/completions", {"prompt": [5] * 5000})
    assert r.status_code == 400 and error_of("/v1/completions", r)["code"] == "context_length_exceeded"
    r = post(w, "/v1/completions", {"prompt": [5, 7, 1 << 40]})
    assert r.status_code == 400 and "not in the vocabulary" in error_of("/v1/completions", r)["message"]


def test_stop_strings_are_bounded(w):
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], "stop": ["x"] * 100_000})
    err = error_of("/v1/chat/completions", r)
    assert r.status_code == 400 and err["param"] == "stop" and "at most 16" in err["message"]
    r = post(w, "/v1/messages", {**GENERATION["/v1/messages"], "stop_sequences": ["a", "b" * 600]})
    assert r.status_code == 400 and "stop_sequences[1]" in error_of("/v1/messages", r)["message"]
    r = post(w, "/v1/completions", {"prompt": "hi", "stop": "s" * 513})
    assert r.status_code == 400 and error_of("/v1/completions", r)["param"] == "stop"


def test_tools_top_k_and_n_are_bounded(w):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], "tools": [tool] * 257})
    assert r.status_code == 400 and error_of("/v1/chat/completions", r)["param"] == "tools"
    fat = {"name": "f", "input_schema": {"type": "object", "description": "x" * 70_000}}
    r = post(w, "/v1/messages", {**GENERATION["/v1/messages"], "tools": [fat]})
    assert r.status_code == 400 and "tools[0]" in error_of("/v1/messages", r)["message"]
    r = post(w, "/v1/responses", {**GENERATION["/v1/responses"], "top_k": 5000})
    assert r.status_code == 400 and error_of("/v1/responses", r)["param"] == "top_k"
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], "n": 3})
    assert r.status_code == 400 and error_of("/v1/chat/completions", r)["param"] == "n"


def test_logit_bias_is_honoured_or_refused(w):
    base = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0, "max_tokens": 1}
    plain = post(w, "/v1/chat/completions", {**base, "logprobs": True})
    assert plain.status_code == 200
    forced = 107  # any ordinary token: +100 makes it the greedy choice
    r = post(w, "/v1/chat/completions", {**base, "logprobs": True, "logit_bias": {str(forced): 100}})
    assert r.status_code == 200
    token = r.json()["choices"][0]["logprobs"]["content"][0]["bytes"]
    tok = post(w, "/detokenize", {"tokens": [forced]}).json()["content"]
    assert bytes(token).decode() == tok
    r = post(w, "/v1/completions", {"prompt": "The", "temperature": 0, "max_tokens": 1,
                                    "logit_bias": {str(forced): 100}, "logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok
    for bias, where in (({"x": 1}, "logit_bias.x"), ({"5": 101}, "logit_bias.5"), ({"-1": 1}, "logit_bias.-1"),
                        ({str(10 ** 9): 1}, f"logit_bias.{10 ** 9}")):
        r = post(w, "/v1/chat/completions", {**base, "logit_bias": bias})
        assert r.status_code == 400 and error_of("/v1/chat/completions", r)["param"] == where, r.text
    r = post(w, "/v1/chat/completions", {**base, "logit_bias": {str(i): 1 for i in range(1025)}})
    assert r.status_code == 400 and "at most 1024" in error_of("/v1/chat/completions", r)["message"]


def test_the_server_output_cap_holds_on_every_api(w):
    asks = {"/v1/chat/completions": {"max_tokens": 32000}, "/v1/completions": {"max_tokens": 32000},
            "/v1/responses": {"max_output_tokens": 32000}, "/v1/messages": {"max_tokens": 32000}}
    for path, ask in asks.items():
        r = post(w, path, {**GENERATION[path], **ask, "temperature": 0.8})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u.get("completion_tokens", u.get("output_tokens")) <= 2, (path, u)


# -- every client mistake is a 4xx in the protocol's shape ----------------------------------------------------


@pytest.mark.parametrize("path", list(GENERATION) + ["/v1/messages/count_tokens", "/tokenize"])
def test_json_nested_5000_deep(w, path):
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = post(w, path, deep)
    assert r.status_code == 400 and "nested deeper" in error_of(path, r)["message"]
    valid = GENERATION.get(path, GENERATION["/v1/messages"] if path.startswith("/v1/messages") else {"content": "hi"})
    moderate = json.dumps({**valid,
                           "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                           "extra": json.loads("[" * 200 + "]" * 200)}).encode()
    r = post(w, path, moderate)
    assert r.status_code == 400 and "nested deeper than 64" in error_of(path, r)["message"]


@pytest.mark.parametrize("path", list(GENERATION))
def test_invalid_utf8_and_broken_json(w, path):
    text = json.dumps(GENERATION[path]).encode().replace(b'"hi"', b'"h\xff\xfei"')
    assert b"\xff" in text
    r = post(w, path, text)
    assert r.status_code == 400 and "UTF-8" in error_of(path, r)["message"]
    r = post(w, path, b'{"messages": [')
    assert r.status_code == 400
    r = post(w, path, b"")
    assert r.status_code == 400


@pytest.mark.parametrize("path", list(GENERATION))
def test_non_json_bodies_are_415(w, path):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = httpx.post(w.url + path, content=json.dumps(GENERATION[path]).encode(), timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}", "content-type": ctype})
        assert r.status_code == 415, (ctype, r.text)
        assert "Content-Type: application/json" in error_of(path, r)["message"]
    r = post(w, path, {**GENERATION[path], "max_tokens": 1}, {"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_tiny_temperatures_are_greedy(w, temperature):
    base = {"prompt": "Once upon a time", "max_tokens": 2}
    greedy = post(w, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    r = post(w, "/v1/completions", {**base, "temperature": temperature})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize("fields", [
    {"temperature": 1e308}, {"repetition_penalty": 1e-30}, {"repetition_penalty": 1e30},
    {"frequency_penalty": -1e-45}, {"top_p": 1e-300}, {"min_p": 1e-300}, {"temperature": 2, "top_k": 1024},
    {"repetition_penalty": 1e-30, "logit_bias": {"107": -100, "108": 100}, "temperature": 1e-3},
])
def test_extreme_sampling_values_never_fail(w, fields):
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("fields", [
    {"temperature": -1}, {"top_p": 0}, {"presence_penalty": 3}, {"top_k": -2},
    {"repetition_penalty": 0}, {"temperature": "hot"}, {"messages": "hi"}, {"messages": [{"role": 5}]},
    {"max_tokens": -5}, {"stream": "yes"}, {"seed": 1.5},
])
def test_wrong_values_and_types_name_the_field(w, fields):
    """(A temperature of 1e400 is inf, which JSON cannot carry: see test_overflowing_numbers.)"""
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], **fields})
    assert r.status_code == 400, r.text
    err = error_of("/v1/chat/completions", r)
    assert err["param"] and err["param"].split(".")[0].split("[")[0] in fields, err


def test_overflowing_numbers(w):
    for raw in (b"1e400", b"-1e400", b"1" + b"0" * 400):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + raw + b"}"
        r = post(w, "/v1/chat/completions", body)
        assert r.status_code == 400 and error_of("/v1/chat/completions", r)["param"] == "temperature", r.text
    r = post(w, "/v1/chat/completions", {**GENERATION["/v1/chat/completions"], "max_tokens": 10 ** 30})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2  # only clamped, as any max_tokens


MALFORMED_TOOL_CHOICE = {
    "/v1/chat/completions": [
        "sometimes", 5, [], {}, {"type": "function"}, {"type": "function", "function": {}},
        {"type": "function", "function": {"name": 7}}, {"type": "function", "function": "f"},
        {"type": "function", "function": {"name": "nope"}}, {"type": "allowed_tools"},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": "x"}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "odd", "tools": []}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function"}]}},
        {"type": "custom", "custom": {"name": "f"}},
    ],
    "/v1/responses": [
        "sometimes", {"type": "function"}, {"type": "function", "name": ["f"]}, {"type": "allowed_tools"},
        {"type": "allowed_tools", "mode": "required", "tools": "f"}, {"type": "allowed_tools", "mode": 3, "tools": []},
        {"type": "file_search"}, {"type": "function", "name": "nope"},
    ],
    "/v1/messages": [
        "auto", {}, {"type": "tool"}, {"type": "tool", "name": 5}, {"type": "tool", "name": "nope"},
        {"type": "sometimes"}, {"type": "any", "disable_parallel_tool_use": "no"},
    ],
}
TOOLS = {
    "/v1/chat/completions": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "/v1/responses": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "/v1/messages": [{"name": "f", "input_schema": {"type": "object"}}],
}


@pytest.mark.parametrize("path,choice", [(p, c) for p, cs in MALFORMED_TOOL_CHOICE.items() for c in cs])
def test_malformed_tool_choice(w, path, choice):
    r = post(w, path, {**GENERATION[path], "tools": TOOLS[path], "tool_choice": choice})
    assert r.status_code == 400, (choice, r.text)
    assert "tool_choice" in json.dumps(error_of(path, r))


@pytest.mark.parametrize("path,tools", [
    ("/v1/chat/completions", "f"), ("/v1/chat/completions", [5]), ("/v1/chat/completions", [{"type": "function"}]),
    ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters": "object"}}]),
    ("/v1/chat/completions", [{"type": "function", "function": {"name": ""}}]),
    ("/v1/responses", [{"type": "function"}]), ("/v1/responses", [{"type": "function", "name": 3}]),
    ("/v1/messages", [{"input_schema": {}}]), ("/v1/messages", [{"name": "f", "input_schema": []}]),
])
def test_malformed_tools(w, path, tools):
    r = post(w, path, {**GENERATION[path], "tools": tools, "tool_choice": "required" if path != "/v1/messages"
                       else {"type": "any"}})
    assert r.status_code == 400, (tools, r.text)
    assert "tools" in json.dumps(error_of(path, r))


# -- pages in a browser --------------------------------------------------------------------------------------


def test_foreign_host_and_origin_are_refused(w):
    path, body = "/v1/chat/completions", GENERATION["/v1/chat/completions"]
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.nip.io", "[::2]"):
        r = post(w, path, body, {"Host": host})
        assert r.status_code == 403 and error_of(path, r)["code"] == "forbidden_host", (host, r.text)
    for host in (f"127.0.0.1:{w.port}", f"localhost:{w.port}", "app.localhost"):
        assert post(w, path, {**body, "max_tokens": 1}, {"Host": host}).status_code == 200, host
    r = post(w, path, body, {"Origin": "https://evil.example"})
    assert r.status_code == 403 and error_of(path, r)["code"] == "forbidden_origin"
    r = post(w, "/v1/messages", GENERATION["/v1/messages"], {"Origin": "null"})
    assert r.status_code == 403 and error_of("/v1/messages", r)["type"] == "permission_error"
    for origin in ("http://localhost:3000", "https://ok.example"):
        r = post(w, path, {**body, "max_tokens": 1}, {"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(w.url + path, headers={"Origin": "https://evil.example",
                                               "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    pre = httpx.options(w.url + path, headers={"Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
                                               "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://ok.example"


def test_metrics_want_the_key_with_metrics_auth(w):
    assert httpx.get(w.url + "/metrics").status_code == 401
    assert httpx.get(w.url + "/v1/stats").status_code == 401
    assert httpx.get(w.url + "/metrics", headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(w.url + "/health/live").status_code == 200  # the daemon's probes stay public
    doc = httpx.get(w.url + "/openapi.json", headers={"x-api-key": API_KEY}).json()
    assert "/v1/messages" in doc["paths"] and doc["openapi"].startswith("3.1")


def test_prompt_text_stays_out_of_the_log(w):
    secret = "zebra-quartz-4417 is the launch code"
    assert post(w, "/v1/chat/completions", {"messages": [{"role": "user", "content": secret}],
                                            "max_tokens": 1}).status_code == 200
    post(w, "/v1/chat/completions", {"messages": [{"role": "user", "content": secret * 50_000}]})
    assert "zebra-quartz" not in w.log_text()


def test_log_prompts_logs_the_prompt_and_output(start_worker):
    lw = start_worker("--ctx", "512", "--kv-mem", "32MiB", "--log-prompts", "--max-output-tokens", "3")
    try:
        r = post(lw, "/v1/completions", {"prompt": "zebra-quartz-4417", "temperature": 0})
        assert r.status_code == 200
        rid = r.json()["id"]
        assert "zebra-quartz-4417" in lw.wait_event("prompt", request_id=rid)["text"]
        assert lw.wait_event("output", request_id=rid)["text"] == r.json()["choices"][0]["text"]
    finally:
        lw.stop()


def test_a_bind_beyond_loopback_without_a_key_warns(start_worker):
    lw = start_worker("--host", "0.0.0.0", "--ctx", "256", "--kv-mem", "16MiB", api_key=None)
    try:
        warning = lw.wait_event("insecure_bind")
        assert warning["level"] == "warning" and "--api-key" in warning["message"]
        # beyond loopback the Host check is off (a LAN client names the box as it likes); Origin still holds
        r = httpx.get(lw.url + "/v1/models", headers={"Host": "ember.lan"})
        assert r.status_code == 200
    finally:
        lw.stop()


# -- and the worker is unharmed --------------------------------------------------------------------------------


def test_zz_the_worker_survived_everything(w):
    assert w.proc.poll() is None and w.proc.pid == w.pid_at_start
    assert httpx.get(w.url + "/health/ready").status_code == 200
    assert not w.events("api_error"), w.events("api_error")[:3]
    statuses = [e["status"] for e in w.events("refused")]
    assert all(400 <= s < 500 for s in statuses)
