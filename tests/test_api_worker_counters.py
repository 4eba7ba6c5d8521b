"""The shared worker's counters balance, and every admitted request logged exactly one outcome.

The test sends its own traffic first (completed requests, a prefix-cache hit, a refusal and a client
that goes away), so it stands alone; named to run after the other API modules, it then also settles
the account of all their traffic on the shared worker."""

from __future__ import annotations

import time

import httpx

OUTCOMES = ("completed", "failed", "canceled", "refused")
PREFIX = ("You are a careful assistant working inside a code editor. Answer briefly, prefer plain words, never "
          "invent file names, and say when you are unsure. When asked for code, give the smallest complete "
          "example, explain nothing unless asked, and keep every line short.")  # several 16-token KV blocks


def _send_own_traffic(worker) -> None:
    def complete(prompt: str, **kw) -> httpx.Response:
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
        return httpx.post(worker.url + "/v1/completions", json=body, headers=worker.headers(), timeout=120)

    for question in ("Name a colour.", "Name a fruit."):  # the second reuses the first's prefix blocks
        assert complete(f"{PREFIX}\n{question}").status_code == 200
    assert complete("word " * 1500).status_code == 400  # over the shared worker's --ctx 1024: refused
    body = {"model": "m", "prompt": "Tell a long story.", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", worker.url + "/v1/completions", json=body, headers=worker.headers(), timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # then the client goes away: canceled, or completed if it was quicker


def test_started_equals_sum_of_outcomes(api_worker):
    _send_own_traffic(api_worker)
    deadline = time.monotonic() + 120
    while (s := httpx.get(api_worker.url + "/v1/stats").json()["engine"])["running"] or s["waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    m = api_worker.metric_values()
    by_outcome = {o: m[f"ember_requests_total{{outcome={o}}}"] for o in OUTCOMES}
    assert by_outcome["completed"] >= 2 and by_outcome["refused"] >= 1 and by_outcome["failed"] == 0
    assert m["ember_requests_started_total"] == sum(by_outcome.values())
    settled = [r["request_id"] for o in OUTCOMES for r in api_worker.events(o)]
    assert len(settled) == len(set(settled)) == sum(by_outcome.values())
    assert {r["request_id"] for r in api_worker.events("admit")} <= set(settled)
    assert m["ember_prompt_tokens_total"] > m["ember_cached_prompt_tokens_total"] > 0
