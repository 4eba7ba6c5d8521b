"""Readiness and liveness without a model: ServerState over a stand-in engine that publishes stats as
the engine does (engine/stats.py), and the app's health endpoints and refusals in each state
(Litestar's in-process test client)."""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import msgspec
import pytest
from litestar.testing import TestClient

from ember.ops.contract import Event, HealthState
from ember.worker import logs
from ember.worker.api.app import create_app
from ember.worker.api.state import ServerState
from ember.worker.engine.stats import EngineStats, Poison
from ember.worker.metrics import Metrics
from ember.worker.threads import ThreadWatch


def stand_in_engine():
    return SimpleNamespace(stats=EngineStats(last_progress=time.monotonic()), watch=ThreadWatch(), metrics=Metrics())


def publish(engine, **changes) -> None:
    """What the engine thread does: a new snapshot, swapped in whole."""
    engine.stats = msgspec.structs.replace(engine.stats, **changes)


POISON = Poison(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "boom")


def test_states_and_stall_detection():
    st = ServerState(stall_seconds=5)
    assert st.state == "loading" and st.live_ok() and not st.ready_ok() and not st.accepting()
    engine = stand_in_engine()
    st.attach(engine, None)
    st.set("ready")
    assert st.ready_ok() and st.accepting()
    publish(engine, last_progress=time.monotonic() - 30)  # idle for long: fine
    assert st.live_ok() and st.stalled_for() is None
    publish(engine, busy=True)  # work in hand and no progress: stalled
    assert not st.live_ok() and not st.ready_ok() and st.stalled_for() > 29
    publish(engine, last_progress=time.monotonic())
    assert st.live_ok()
    st.set("draining")
    assert st.live_ok() and not st.ready_ok() and not st.accepting()
    publish(engine, poisoned=POISON)
    assert st.state == "poisoned" and not st.live_ok()
    st.set("ready")
    assert st.state == "poisoned"
    with pytest.raises(ValueError):
        st.set("sleeping")


@pytest.fixture
def app_and_engine():
    engine = stand_in_engine()
    state = ServerState(stall_seconds=2)
    app = create_app(engine, None, api_key="k", model_name="m", state=state)
    return app, engine, state


CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def test_health_endpoints_follow_the_state(app_and_engine):
    app, engine, state = app_and_engine
    with TestClient(app, base_url="http://127.0.0.1") as c:  # a loopback worker wants a local Host
        assert c.get("/health/live").json()["state"] == "loading" and c.get("/health/live").status_code == 200
        r = c.get("/health/ready")
        assert r.status_code == 503 and r.json()["state"] == "loading" and "retry-after" in r.headers
        state.set("ready")
        assert c.get("/health/ready").status_code == 200
        publish(engine, busy=True, running=1, steps=7, last_progress=time.monotonic() - 10)
        live = c.get("/health/live")
        assert live.status_code == 503 and live.json()["stalled"] is True
        assert (live.json()["running"], live.json()["steps"]) == (1, 7)  # what the engine published
        publish(engine, busy=False)
        state.set("draining")
        assert c.get("/health/live").status_code == 200 and c.get("/health/ready").json()["state"] == "draining"
        publish(engine, poisoned=POISON)
        live = c.get("/health/live")
        assert live.status_code == 503 and live.json()["state"] == "poisoned"
        assert live.json()["error"]["code"] == 700


@pytest.mark.parametrize("state_name", ["loading", "draining", "poisoned"])
def test_generation_refused_with_503_and_retry_after(app_and_engine, state_name):
    app, engine, state = app_and_engine
    if state_name == "poisoned":
        publish(engine, poisoned=Poison(700, "X", "y"))
    else:
        state.set(state_name)
    with TestClient(app, base_url="http://127.0.0.1") as c:  # a loopback worker wants a local Host
        h = {"Authorization": "Bearer k"}
        r = c.post("/v1/chat/completions", json=CHAT, headers=h)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["code"] == "service_unavailable"
        r = c.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "k"})
        assert r.status_code == 503 and r.json() == {"type": "error", "error": {
            "type": "overloaded_error", "message": r.json()["error"]["message"]}}
        r = c.post("/v1/responses", json={"model": "x", "input": "hi"}, headers=h)
        assert r.status_code == 503
    m = engine.metrics
    assert m.started._value.get() == 3 and m.outcomes.labels("refused")._value.get() == 3


def test_auth_applies_before_anything_else(app_and_engine):
    app, engine, state = app_and_engine
    with TestClient(app, base_url="http://127.0.0.1") as c:  # a loopback worker wants a local Host
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer kk"})
        assert r.status_code == 401
        assert c.get("/health/live").status_code == 200 and c.get("/metrics").status_code == 200


def test_unexpected_exceptions_become_a_plain_500(app_and_engine):
    app, engine, state = app_and_engine
    state.set("ready")
    with TestClient(app, base_url="http://127.0.0.1") as c:  # a loopback worker wants a local Host
        # a ready state with no model loaded: the handler trips over the missing model
        r = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "Traceback" not in r.text and r.json()["error"]["message"].startswith("internal error")


def test_each_change_of_state_is_logged_once():
    out = io.StringIO()
    logs.set_stream(out)
    try:
        st = ServerState()
        for s in ("ready", "ready", "draining", "poisoned", "ready", "poisoned"):
            st.set(s)
    finally:
        logs.set_stream(None)
    changes = [r for r in map(json.loads, out.getvalue().splitlines()) if r["event"] == Event.HEALTH_STATE]
    assert [(r["previous"], r["state"]) for r in changes] == [("loading", "ready"), ("ready", "draining"),
                                                               ("draining", "poisoned")]  # no way back
    assert st.state is HealthState.POISONED
    with pytest.raises(ValueError, match="unknown state"):
        st.set("sleeping")
