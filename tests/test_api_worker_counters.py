"""Runs after the other API modules (by name): the shared worker's counters balance, and every
admitted request logged exactly one outcome."""

from __future__ import annotations

import time

import httpx

from test_api_disconnect import metric_values

OUTCOMES = ("completed", "failed", "canceled", "refused")


def test_started_equals_sum_of_outcomes(api_worker):
    deadline = time.monotonic() + 120
    while (s := httpx.get(api_worker.url + "/v1/stats").json()["engine"])["running"] or s["waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    m = metric_values(api_worker)
    by_outcome = {o: m[f"ember_requests_total{{outcome={o}}}"] for o in OUTCOMES}
    assert m["ember_requests_started_total"] == sum(by_outcome.values()) > 0
    assert by_outcome["failed"] == 0
    settled = [r["request_id"] for o in OUTCOMES for r in api_worker.events(o)]
    assert len(settled) == len(set(settled)) == sum(by_outcome.values())
    assert {r["request_id"] for r in api_worker.events("admit")} <= set(settled)
    assert m["ember_prompt_tokens_total"] > m["ember_cached_prompt_tokens_total"] > 0
