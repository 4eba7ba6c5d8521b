"""The accounting of agent sessions (worker/bench/agent_report.py) and what the proxy reads from responses
(worker/bench/agent_proxy.py: request ids and prompt usage in each protocol, as ember and llama-server
send them), over fabricated exchanges; `ember bench agents --compare` on two reports. No CLI, no server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ember.worker.bench.agent_proxy import Exchange, Usage, _cap_output, _set_answer_format, _thinking_off
from ember.worker.bench.agent_report import (
    admitted,
    compare,
    compare_table,
    log_records,
    report,
    requests_of,
    restored,
    table,
    turn_rows,
)
from ember.worker.bench.agent_session import TurnResult


def _sse(*docs: dict) -> bytes:
    return "".join(f"event: x\ndata: {json.dumps(d)}\n\n" for d in docs).encode()


def _ex(path: str, turn: int, response: bytes, tools=("Read",), headers=None) -> Exchange:
    return Exchange("POST", path, {}, list(tools), None, bool(tools), [], turn=turn, status=200,
                    headers=dict(headers or {}), response=response)


def test_usage_in_every_protocol():
    # messages, ember: input_tokens is the uncached part; the last report in the stream wins
    m = _ex("/v1/messages", 1, _sse(
        {"type": "message_start", "message": {"id": "msg_1", "usage": {
            "input_tokens": 100, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}},
        {"type": "message_delta", "usage": {"input_tokens": 40, "cache_read_input_tokens": 60, "output_tokens": 3}}),
        headers={"x-request-id": "msg_1"})
    assert m.usage() == Usage(100, 60) and m.request_id == "msg_1"
    # messages, llama-server: no header, the id in message_start, the delta without input tokens
    ll = _ex("/v1/messages", 1, _sse(
        {"type": "message_start", "message": {"id": "chatcmpl-x", "usage": {"cache_read_input_tokens": 4926,
                                                                            "input_tokens": 43, "output_tokens": 0}}},
        {"type": "message_delta", "usage": {"output_tokens": 2}}))
    assert ll.usage() == Usage(4969, 4926) and ll.request_id == "chatcmpl-x"
    # chat: usage with prompt_tokens_details; llama-server's timings when there is no usage
    c = _ex("/v1/chat/completions", 1, _sse({"id": "c1", "choices": []}, {"id": "c1", "choices": [], "usage": {
        "prompt_tokens": 500, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 480}}}))
    assert c.usage() == Usage(500, 480) and c.request_id == "c1"
    t = _ex("/v1/chat/completions", 1, _sse({"id": "c2", "timings": {"prompt_n": 12, "cache_n": 300}}))
    assert t.usage() == Usage(312, 300)
    # Responses: response.completed carries the usage, the id is the response's
    r = _ex("/v1/responses", 1, _sse({"type": "response.created", "response": {"id": "resp_1"}},
                                     {"type": "response.completed", "response": {"id": "resp_1", "usage": {
                                         "input_tokens": 900, "input_tokens_details": {"cached_tokens": 880}}}}))
    assert r.usage() == Usage(900, 880) and r.request_id == "resp_1"
    # a non-streamed body, chunk-framed
    body = json.dumps({"id": "msg_2", "usage": {"input_tokens": 7, "cache_read_input_tokens": 93}}).encode()
    framed = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    n = _ex("/v1/messages", 1, framed)
    n.chunked = True
    assert n.usage() == Usage(100, 93) and n.request_id == "msg_2"
    assert _ex("/v1/messages", 1, b"event: ping\ndata: {}\n\n").usage() is None


def test_request_edits_per_protocol():
    body: dict = {"max_tokens": 32000, "thinking": {"type": "adaptive"}}
    _set_answer_format("/v1/messages", body, "stop")
    _thinking_off("/v1/messages", body)
    _cap_output("/v1/messages", body, 256)
    assert body == {"max_tokens": 256, "thinking": {"type": "disabled"}, "stop_sequences": ["k"]}
    chat: dict = {"max_completion_tokens": 100}
    _set_answer_format("/v1/chat/completions", chat, "stop")
    _thinking_off("/v1/chat/completions", chat)
    _cap_output("/v1/chat/completions", chat, 256)
    assert chat == {"max_completion_tokens": 100, "max_tokens": 256, "stop": ["k"],
                    "reasoning_effort": "none"}
    resp: dict = {"reasoning": {"summary": "auto"}}
    _set_answer_format("/v1/responses", resp, "stop")  # Responses has no stop parameter: the format
    _thinking_off("/v1/responses", resp)
    _cap_output("/v1/responses", resp, 256)
    assert resp["text"]["format"]["type"] == "json_schema" and resp["max_output_tokens"] == 256
    assert resp["reasoning"] == {"summary": "auto", "effort": "none"}


def _session() -> tuple[list[Exchange], list[TurnResult]]:
    """Three turns: the first cold with a side request (no tools), a restart before the third."""
    def msg(rid: str, turn: int, prompt: int, cached: int, tools=("Read",)) -> Exchange:
        return _ex("/v1/messages", turn, _sse({"type": "message_start", "message": {"id": rid, "usage": {
            "input_tokens": prompt - cached, "cache_read_input_tokens": cached}}}), tools=tools,
            headers={"x-request-id": rid})
    ex = [msg("a", 1, 1000, 0), msg("title", 1, 200, 0, tools=()), msg("b", 1, 1100, 990),
          msg("c", 2, 1200, 1180), msg("d", 3, 1300, 1000), msg("e", 3, 1350, 1300)]
    ex.append(Exchange("GET", "/v1/models", None, [], None, False, [], turn=1, status=200))
    return ex, [TurnResult(1, None, 0), TurnResult(2, None, 0), TurnResult(3, "kill", 0)]


def test_turns_and_totals_by_the_rule():
    ex, turns = _session()
    reqs = requests_of(ex, "/v1/messages")
    assert [r.request_id for r in reqs] == ["a", "title", "b", "c", "d", "e"]  # the GET is no model call
    assert [r.conversation for r in reqs] == [True, False, True, True, True, True]
    rows = turn_rows(reqs, turns)
    assert [(r.requests, r.prompt_tokens, r.cached_tokens, r.side_requests) for r in rows] == \
        [(2, 2100, 990, 1), (1, 1200, 1180, 0), (2, 2650, 2300, 0)]
    rep = report("claude", {"server": "ember"}, reqs, turns, "the responses")
    s = rep["totals"]
    assert s["first_prompt_tokens"] == 1000 and s["requests"] == 5 and s["side_requests"] == 1
    assert s["prefilled_after_first"] == 110 + 20 + 300 + 50  # the side request and the first are out
    assert s["prefilled_after_restarts"] == 350
    assert s["lowest_share_turn_2_on"] == pytest.approx(2300 / 2650) and not s["target_met"]
    text = table(rep)
    assert "MISSED" in text and "1 (200/0)" in text and "kill" in text
    # ember's log instead of the responses: a request the log lacks is uncounted, not zero
    counts = admitted(log_records(['{"event": "admit", "request_id": "a", "prompt_tokens": 1000, "cached_tokens": 0}',
                                   "not json", '{"event": "admit", "request_id": "c", "prompt_tokens": 1200, '
                                   '"cached_tokens": 1200}']))
    logged = requests_of(ex, "/v1/messages", counts)
    assert [r.prompt_tokens for r in logged] == [1000, None, None, 1200, None, None]
    assert report("claude", {}, logged, turns, "log")["totals"]["uncounted"] == 3


def test_restored_sums_a_requests_restores():
    recs = log_records(['{"event": "kv_restore", "request_id": "d", "tokens": 992}',
                        '{"event": "kv_restore", "request_id": "d", "tokens": 16}', '{"event": "admit"}'])
    assert restored(recs) == {"d": 1008}


def test_compare_against_the_target(tmp_path):
    ex, turns = _session()
    a = report("claude", {"server": "ember", "model": "m"}, requests_of(ex, "/v1/messages"), turns, "x")
    b = json.loads(json.dumps(a))
    b["server"] = {"server": "llama-server", "model": "m"}
    b["totals"]["prefilled_after_first"] = 960  # exactly twice A's 480: the target's edge
    c = compare(a, b)
    assert c["ratio"] == 0.5 and c["target_met"] and c["same_turns"]
    b["totals"]["prefilled_after_first"] = 959
    assert not compare(a, b)["target_met"]
    assert "A/B 0.500" in compare_table(c)
    pa, pb, junk = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "junk.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    junk.write_text("{}")
    cmd = [sys.executable, "-m", "ember.worker", "bench", "agents", "--compare"]
    out = subprocess.run([*cmd, str(pa), str(pb), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["prefilled_after_first_b"] == 959, out.stderr
    out = subprocess.run([*cmd, str(pa), str(junk)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no `ember bench agents --json` report" in out.stderr
