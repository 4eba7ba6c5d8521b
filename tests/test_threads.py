"""A worker thread that dies is logged, counted in /metrics and fails /health/live by name; whatever
waited on it is released (requests fail with a 503 or compute instead), never a silent stall."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from ember.worker.api.state import ServerState
from ember.worker.backends.faults import FaultInjector, FaultSpecError, parse_faults
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.constraints import grammar_from_json_schema
from ember.worker.engine.kv_blocks import chain_hash, kv_salt
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    NotAccepting,
    RequestHandle,
    Started,
)
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.stats import EngineStats
from ember.worker.kvstore.store import KVStore
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime
from ember.worker.threads import GuardedPool, ThreadDied, ThreadWatch

GREEDY = SamplingParams(temperature=0.0)
PROMPT = ("The lighthouse keeper wrote in his log every evening. The storm had lasted three days, "
          "and the supply boat was late. He counted the candles, checked the lamp, and wound the clock. ") * 2


def _log_events(err: str, event: str) -> list[dict]:
    out = []
    for line in err.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


# -- the watch itself -------------------------------------------------------------------------------------------

def test_a_thread_that_dies_is_logged_counted_and_fails_liveness(tmp_path, capfd):
    watch, metrics = ThreadWatch(), Metrics()
    metrics.attach_threads(watch)
    settled = []

    def work():  # a real failure: the thread's input is not what it expects
        json.loads((tmp_path / "job.json").read_text())

    (tmp_path / "job.json").write_text("{not json")
    t = watch.thread("ember-test-worker", work, on_death=settled.append)
    t.start()
    t.join(5)
    assert list(watch.dead) == ["ember-test-worker"] and watch.dead["ember-test-worker"].startswith("JSONDecodeError")
    assert len(settled) == 1 and isinstance(settled[0], json.JSONDecodeError)
    (rec,) = _log_events(capfd.readouterr().err, "thread_died")
    assert rec["level"] == "error" and rec["thread"] == "ember-test-worker" and rec["error_type"] == "JSONDecodeError"
    assert "json.loads" in rec["traceback"]
    assert 'ember_thread_deaths_total{thread="ember-test-worker"} 1.0' in metrics.prometheus_text().decode()
    state = ServerState("ready")
    state.attach(SimpleNamespace(watch=watch, stats=EngineStats(last_progress=time.monotonic())), None)
    assert not state.live_ok() and not state.ready_ok()
    body = state.describe()
    assert body["dead_threads"] == [{"thread": "ember-test-worker", "error": watch.dead["ember-test-worker"]}]
    assert body["error"]["name"] == "thread_died" and "ember-test-worker" in body["error"]["message"]


def test_threads_that_end_at_shutdown_do_not_count(capfd):
    watch, stopping = ThreadWatch(), threading.Event()

    def raises_once_stopping():
        stopping.wait(5)
        raise OSError("the queue it read from was closed")  # shutdown tore its input down

    threads = [watch.thread("ember-returns", lambda: None),
               watch.thread("ember-stopping", raises_once_stopping, stopping=stopping.is_set)]
    for t in threads:
        t.start()
    stopping.set()
    for t in threads:
        t.join(5)
    assert watch.dead == {} and not watch.deaths
    err = capfd.readouterr().err
    assert not _log_events(err, "thread_died") and _log_events(err, "thread_exit_error")


def test_a_pool_thread_that_dies_fails_what_waits_and_refuses_more():
    watch = ThreadWatch()
    pool = GuardedPool(watch, "ember-test-pool", workers=1)
    try:
        assert pool.submit(lambda: 6 * 7).result(5) == 42
        with pytest.raises(ZeroDivisionError):  # a call's own error is its caller's; the thread lives on
            pool.submit(lambda: 1 / 0).result(5)
        assert pool.submit(lambda: "alive").result(5) == "alive" and not watch.dead
        gate = threading.Event()
        blocked = pool.submit(gate.wait, 5)  # holds the only thread while more calls queue behind it
        while not blocked.running():
            time.sleep(0.001)
        watch.doom("ember-test-pool")
        queued = [pool.submit(lambda: "never") for _ in range(3)]
        gate.set()
        assert blocked.result(5) is True
        for f in queued:  # the first is taken by the dying thread, the rest fail with it
            with pytest.raises(ThreadDied):
                f.result(5)
        assert list(watch.dead) == ["ember-test-pool-0"]
        t0 = time.monotonic()
        with pytest.raises(ThreadDied, match="ember-test-pool-0 died"):
            pool.submit(lambda: "later").result(5)
        assert time.monotonic() - t0 < 1
    finally:
        pool.shutdown()


def test_thread_die_faults_parse():
    (f,) = parse_faults("thread-die:thread=kv-writer")
    assert f.kind == "thread-die" and f.thread == "kv-writer"
    with pytest.raises(FaultSpecError, match="needs thread"):
        parse_faults("thread-die")
    with pytest.raises(FaultSpecError, match="bad option"):
        parse_faults("thread-die:thread=everything")


# -- in one process: the engine and the KV store over the embedded model ---------------------------------------

@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=1024)


def _engine(runtime, faults="", store=None):
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=64, block_size=runtime.backend.block_size)
    e = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=1024), metrics=Metrics(),
               faults=FaultInjector(parse_faults(faults)), store=store)
    e.start()
    return e


def _request(runtime, prompt=PROMPT, n=8, rid="r", **kw):
    return GenerationRequest(rid, runtime.model.tokenizer.encode(prompt), GREEDY, n, **kw)


async def _events(engine, req):
    h = RequestHandle(req, asyncio.get_running_loop())
    engine.submit(h)
    return [e async for e in h.events()]


def _run(engine, req, timeout=60):
    async def go():
        return await asyncio.wait_for(_events(engine, req), timeout)

    return asyncio.run(go())


def _tokens(events):
    return [t for e in events if isinstance(e, Delta) for t in e.tokens]


def test_a_dead_engine_loop_fails_requests_at_once_and_refuses_more(runtime, capfd):
    engine = _engine(runtime, "thread-die:thread=engine")
    state = ServerState("ready")
    state.attach(engine, runtime.model)
    try:
        t0 = time.monotonic()
        events = _run(engine, _request(runtime), timeout=10)  # hangs (and times out) if nobody answers
        assert time.monotonic() - t0 < 5
        assert isinstance(events[-1], Failed) and events[-1].status == 503, events[-1]
        with pytest.raises(NotAccepting):
            _run(engine, _request(runtime, rid="after"))
        assert not state.live_ok()
        (dead,) = state.describe()["dead_threads"]
        assert dead["thread"] == "ember-engine" and dead["error"].startswith("InjectedThreadDeath")
        assert engine.metrics.snapshot()["ember_thread_deaths_total_ember-engine"] == 1
        assert engine.pool.in_use == 0 and not engine.busy
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert _log_events(err, "thread_died")[0]["thread"] == "ember-engine"
    assert _log_events(err, "failed")[0]["error"].startswith("the worker's engine loop failed")


def test_a_dead_kv_reader_turns_restores_into_computing(runtime, tmp_path):
    def store():
        be = runtime.backend
        return KVStore(tmp_path, salt=kv_salt(runtime.model.fingerprint, be.kv_layout),
                       model_key=runtime.model.fingerprint,
                       block_shape=be.read_block(0).shape, block_tokens=be.block_size, chain_hash=chain_hash,
                       disk_budget=1 << 30, host_budget=64 << 20)

    cold_store = store()
    engine = _engine(runtime, store=cold_store)
    try:
        cold = _run(engine, _request(runtime))
    finally:
        engine.shutdown()
    assert cold_store.flush()
    cold_store.close()
    warm_store = store()  # a restarted worker: its blocks are on disk, to be read by the reader
    engine = _engine(runtime, "thread-die:thread=kv-reader", store=warm_store)
    try:
        events = _run(engine, _request(runtime), timeout=60)
        assert isinstance(events[-1], Finished) and _tokens(events) == _tokens(cold)
        assert next(e for e in events if isinstance(e, Started)).cached_tokens == 0  # computed, not restored
        assert list(engine.watch.dead) == ["ember-kv-reader"] and warm_store.watch is engine.watch
        again = _run(engine, _request(runtime, rid="again"), timeout=60)  # no restore is even tried now
        assert isinstance(again[-1], Finished) and _tokens(again) == _tokens(cold)
        for _ in range(100):
            if engine.pool.in_use == 0:
                break
            time.sleep(0.01)
        assert engine.pool.in_use == 0
    finally:
        engine.shutdown()
        warm_store.close()


def test_a_dead_grammar_thread_fails_grammar_requests_fast(runtime):
    engine = _engine(runtime, "thread-die:thread=mask")
    grammar = grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    try:
        t0 = time.monotonic()
        first = _run(engine, _request(runtime, "Reply in JSON:", n=16, grammar=grammar), timeout=30)
        second = _run(engine, _request(runtime, "Reply in JSON:", n=16, rid="second", grammar=grammar), timeout=30)
        assert time.monotonic() - t0 < 20
        for events in (first, second):
            assert isinstance(events[-1], Failed) and "died" in events[-1].message, events[-1]
        assert [n for n in engine.watch.dead] in (["ember-mask-0"], ["ember-mask-1"])
        plain = _run(engine, _request(runtime, rid="plain"))  # the engine itself serves on
        assert isinstance(plain[-1], Finished)
    finally:
        engine.shutdown()


# -- in a real worker process -------------------------------------------------------------------------------------

def _chat(w, **kw):
    body = {"model": "x", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}
    return httpx.post(w.url + "/v1/chat/completions", json={**body, **kw}, headers=w.headers(), timeout=60)


def test_a_worker_whose_kv_writer_dies_says_so(start_worker):
    w = start_worker("--ctx", "512", "--kv-mem", "32MiB", "--kv-persist", "all", "--fault",
                     "thread-die:thread=kv-writer")
    try:
        assert httpx.get(w.url + "/health/live", timeout=5).status_code == 200
        r = _chat(w)  # its blocks go to the writer, which dies taking the first; the request is fine
        assert r.status_code == 200, r.text
        w.wait_event("thread_died", thread="ember-kv-writer", timeout=30)
        live = httpx.get(w.url + "/health/live", timeout=5)
        assert live.status_code == 503
        (dead,) = live.json()["dead_threads"]
        assert dead["thread"] == "ember-kv-writer" and "InjectedThreadDeath" in dead["error"]
        assert httpx.get(w.url + "/health/ready", timeout=5).status_code == 503
        metrics = httpx.get(w.url + "/metrics", timeout=5).text
        assert 'ember_thread_deaths_total{thread="ember-kv-writer"} 1.0' in metrics
        assert w.events("kv_persistence", state="off", reason="the KV writer thread died")
        assert live.json()["kv_persistence"]["state"] == "off"
        assert _chat(w).status_code == 200  # it serves on (without persistence) until it is restarted
    finally:
        w.stop()
    assert w.proc.returncode == 0  # and the clean stop does not wait on the dead writer


def test_a_worker_whose_engine_loop_dies_answers_503_at_once(start_worker):
    w = start_worker("--ctx", "512", "--kv-mem", "32MiB", "--kv-persist", "off", "--fault", "thread-die:thread=engine")
    try:
        t0 = time.monotonic()
        r = _chat(w)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        assert time.monotonic() - t0 < 10
        assert _chat(w, stream=True).status_code == 503  # refused at submit now
        live = httpx.get(w.url + "/health/live", timeout=5)
        assert live.status_code == 503 and live.json()["dead_threads"][0]["thread"] == "ember-engine"
        assert 'ember_thread_deaths_total{thread="ember-engine"} 1.0' in httpx.get(w.url + "/metrics", timeout=5).text
    finally:
        w.stop()
