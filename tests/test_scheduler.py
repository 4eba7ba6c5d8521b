"""The engine loop on the embedded model: batching, prefix reuse, cancellation, containment."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ember.worker.backends.faults import FaultInjector, parse_faults
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, Failed, GenerationRequest, QueueFull, RequestHandle, Started
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.textstream import StopMatcher
from ember.worker.metrics import OUTCOMES, Metrics
from ember.worker.runtime import Runtime

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=4096)


def _engine(runtime, n_blocks=None, faults="", on_poisoned=None, **limits):
    from ember.worker.backends.numpy.backend import NumpyBackend

    be = runtime.backend
    if n_blocks is not None:
        be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=n_blocks, block_size=be.block_size)
    e = Engine(runtime.model, be, EngineLimits(**{"max_seqs": 4, "context": 4096, **limits}), metrics=Metrics(),
               faults=FaultInjector(parse_faults(faults)), on_poisoned=on_poisoned)
    e.start()
    return e


def _req(runtime, text, n=12, rid="r", **kw):
    ids = runtime.model.tokenizer.encode(text)
    return GenerationRequest(rid, ids, kw.pop("params", GREEDY), n, **kw)


async def _collect(engine, req, cancel_after=None):
    h = RequestHandle(req, asyncio.get_running_loop())
    engine.submit(h)
    text, tokens, events = "", [], []
    async for e in h.events():
        events.append(e)
        if isinstance(e, Delta):
            text += e.text
            tokens += e.tokens
            if cancel_after is not None and len(tokens) >= cancel_after:
                h.cancel()
    return text, tokens, events


def _outcomes(engine):
    snap = engine.metrics.snapshot()
    return {o: snap[f"ember_requests_total_{o}"] for o in OUTCOMES}, snap["ember_requests_started_total"]


PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "In 1969, the first humans",
    "Les montagnes des Alpes sont",
]


def test_batched_outputs_equal_solo_outputs(runtime):
    engine = _engine(runtime)
    try:
        solo = [asyncio.run(_collect(engine, _req(runtime, p, rid=f"s{i}")))[1] for i, p in enumerate(PROMPTS)]

        async def together():
            return await asyncio.gather(*[_collect(engine, _req(runtime, p, rid=f"b{i}"))
                                          for i, p in enumerate(PROMPTS)])

        batched = [r[1] for r in asyncio.run(together())]
        assert batched == solo
        counts, started = _outcomes(engine)
        assert counts["completed"] == 10 and started == sum(counts.values())
    finally:
        engine.shutdown()


def test_second_turn_reuses_every_cached_block(runtime):
    engine = _engine(runtime)
    try:
        system = "You are a careful assistant. " * 12
        a = _req(runtime, system + "Question one: what is a list?", rid="t1")
        _, _, ev1 = asyncio.run(_collect(engine, a))
        b = _req(runtime, system + "Question two: what is a dict?", rid="t2")
        _, _, ev2 = asyncio.run(_collect(engine, b))
        s1, s2 = ev1[0], ev2[0]
        assert isinstance(s1, Started) and s1.cached_tokens == 0
        bs = runtime.backend.block_size
        shared = 0
        while a.prompt[shared] == b.prompt[shared]:
            shared += 1
        assert s2.cached_tokens == shared // bs * bs > 0
        # an identical retry reuses everything but the last partial block
        _, _, ev3 = asyncio.run(_collect(engine, _req(runtime, system + "Question two: what is a dict?", rid="t3")))
        assert ev3[0].cached_tokens == (len(b.prompt) - 1) // bs * bs
        assert ev3[-1].completion_tokens == ev2[-1].completion_tokens
    finally:
        engine.shutdown()


def test_cancel_frees_the_slot_and_keeps_blocks_cached(runtime):
    engine = _engine(runtime)
    try:
        long_prompt = "Once upon a time there was a lighthouse keeper. " * 30
        text, tokens, events = asyncio.run(_collect(engine, _req(runtime, long_prompt, n=50, rid="c1"), cancel_after=3))
        assert isinstance(events[-1], Failed) and len(tokens) < 50
        assert not engine.running and engine.pool.in_use == 0
        _, _, ev = asyncio.run(_collect(engine, _req(runtime, long_prompt, n=2, rid="c2")))
        assert ev[0].cached_tokens > 0
        counts, started = _outcomes(engine)
        assert counts["canceled"] == 1 and counts["completed"] == 1 and started == 2
    finally:
        engine.shutdown()


def test_preemption_under_a_small_kv_pool_keeps_outputs(runtime):
    ref_engine = _engine(runtime)
    small = _engine(runtime, n_blocks=12, max_seqs=3)  # 192 tokens for three growing sequences
    try:
        reqs = [_req(runtime, p, n=40, rid=f"p{i}") for i, p in enumerate(PROMPTS[:3])]
        ref = [asyncio.run(_collect(ref_engine, r))[1] for r in reqs]

        async def together():
            return await asyncio.gather(*[_collect(small, r) for r in reqs])

        got = [r[1] for r in asyncio.run(together())]
        assert got == ref
    finally:
        ref_engine.shutdown()
        small.shutdown()


def test_injected_request_error_fails_only_that_request(runtime):
    engine = _engine(runtime, faults="raise:request=2")
    try:
        async def run():
            return await asyncio.gather(*[_collect(engine, _req(runtime, p, rid=f"f{i}"))
                                          for i, p in enumerate(PROMPTS[:3])])

        results = asyncio.run(run())
        kinds = [type(r[2][-1]).__name__ for r in results]
        assert sorted(kinds) == ["Failed", "Finished", "Finished"]
        counts, started = _outcomes(engine)
        assert counts["failed"] == 1 and counts["completed"] == 2 and started == 3
    finally:
        engine.shutdown()


def test_poison_fails_everything_in_flight_and_reports(runtime):
    seen = threading.Event()
    engine = _engine(runtime, faults="poison:step=3", on_poisoned=lambda e: seen.set())
    try:
        _, _, events = asyncio.run(_collect(engine, _req(runtime, PROMPTS[0], n=20)))
        assert isinstance(events[-1], Failed) and events[-1].status == 503
        assert seen.wait(2) and engine.poisoned.code == 700 and not engine.accepting
    finally:
        engine.shutdown()


def test_queue_bound(runtime):
    engine = _engine(runtime, max_queue=1, max_seqs=1, faults="slow:ms=50")
    try:
        async def run():
            loop = asyncio.get_running_loop()
            hs = [RequestHandle(_req(runtime, PROMPTS[0], n=30, rid=f"q{i}"), loop) for i in range(3)]
            engine.submit(hs[0])
            await asyncio.sleep(0.3)  # the first is running; the second waits; the third is refused
            engine.submit(hs[1])
            with pytest.raises(QueueFull):
                engine.submit(hs[2])
            for h in hs[:2]:
                h.cancel()
                async for _ in h.events():
                    pass

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_stop_strings_hold_back_partial_matches():
    m = StopMatcher(["</end>", "STOP"])
    out = []
    for piece in ["Hello <", "/e", "nd", "> more"]:
        text, stop = m.feed(piece)
        out.append(text)
        if stop:
            break
    assert "".join(out) == "Hello " and stop == "</end>"
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", None) and m.feed("ay") == ("STay", None) and m.flush() == ""
