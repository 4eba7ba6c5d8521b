"""Run-ahead decoding: the engine launches decode step n + 1 before it reads step n's tokens, which
the backend feeds from its own draws. Checked on the CPU with the numpy backend in its drawing mode
(the CUDA sampler's twin, the same feed contract): the tokens must be exactly those of the engine
that waits for every step, whatever ends, stops or cancels a sequence in between."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ember.worker.backends.base import DeviceSample, SampledToken, SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import (
    Delta,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    ReasoningBudget,
    RequestHandle,
)
from ember.worker.engine.sampling import SamplingParams
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n    ",
           "Photosynthesis is the process by which", "In 1969, the first humans"]


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=4096)


def _engine(runtime, ahead: bool, **limits) -> Engine:
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=256, block_size=runtime.backend.block_size,
                      draws=True)
    be.runs_ahead = ahead  # the same draws either way; only the overlap differs
    e = Engine(runtime.model, be, EngineLimits(**{"max_seqs": 4, "context": 4096, **limits}), metrics=Metrics())
    e.start()
    return e


def _req(runtime, text, n=12, rid="r", params=GREEDY, **kw):
    return GenerationRequest(rid, runtime.model.tokenizer.encode(text), params, n, **kw)


async def _collect(engine, req, cancel_after=None):
    h = RequestHandle(req, asyncio.get_running_loop())
    engine.submit(h)
    tokens, last = [], None
    async for e in h.events():
        if isinstance(e, Delta):
            tokens += e.tokens
            if cancel_after is not None and len(tokens) >= cancel_after:
                h.cancel()
        last = e
    return tokens, last


def _together(engine, reqs, cancel=None):
    async def run():
        return await asyncio.gather(*[_collect(engine, r, (cancel or {}).get(r.request_id)) for r in reqs])

    return asyncio.run(run())


def _both(runtime, reqs_fn, cancel=None, **limits):
    out = []
    for ahead in (False, True):
        engine = _engine(runtime, ahead, **limits)
        try:
            out.append((_together(engine, reqs_fn(), cancel), engine.ahead_steps, engine.ahead_rows_dropped))
        finally:
            engine.shutdown()
    (plain, plain_steps, _), (fast, steps, dropped) = out
    assert plain_steps == 0 and steps > 0
    return plain, fast, steps, dropped


def test_batched_greedy_tokens_equal_the_waiting_engine(runtime):
    lengths = [5, 12, 9, 16]  # sequences end at different steps: the step ahead leaves out those that end
    plain, fast, steps, dropped = _both(
        runtime, lambda: [_req(runtime, p, n=n, rid=f"r{i}", ignore_eos=True)
                          for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))])
    assert [t for t, _ in fast] == [t for t, _ in plain]
    assert [len(t) for t, _ in fast] == lengths
    assert all(isinstance(last, Finished) and last.reason is FinishReason.LENGTH for _, last in fast)
    assert steps >= 10


def test_seeded_draws_follow_the_same_steps(runtime):
    """Temperature sampling on the device: a draw's noise depends on (seed, step), so a run-ahead row
    must carry the step its sequence will be at."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    plain, fast, _, _ = _both(runtime, lambda: [_req(runtime, p, n=10, rid=f"s{i}", params=params, ignore_eos=True)
                                                for i, p in enumerate(PROMPTS[:2])])
    assert [t for t, _ in fast] == [t for t, _ in plain]


def test_stop_strings_and_cancels_drop_rows_already_launched(runtime):
    def reqs():
        return [_req(runtime, PROMPTS[0], n=30, rid="stops", stop=[" the"]),
                _req(runtime, PROMPTS[1], n=30, rid="cancelled", ignore_eos=True),
                _req(runtime, PROMPTS[2], n=20, rid="runs", ignore_eos=True)]

    plain, fast, _, dropped = _both(runtime, reqs, cancel={"cancelled": 6})
    assert [t for t, _ in fast][0] == [t for t, _ in plain][0]
    assert [t for t, _ in fast][2] == [t for t, _ in plain][2] and len(fast[2][0]) == 20
    assert isinstance(fast[1][1], Failed) and fast[1][1].kind == "canceled"
    assert fast[1][0][:6] == plain[1][0][:6]
    assert dropped >= 1  # the cancelled row, at least, was launched and thrown away


def test_a_forced_reasoning_marker_replaces_the_fed_token(runtime):
    """When the reasoning budget runs out the engine emits the end marker itself: the row launched
    with the drawn token is dropped and recomputed with the marker."""
    tok = runtime.model.tokenizer
    start, end = tok.encode("<think>", add_special=False), tok.encode("</think>", add_special=False)

    def reqs():
        rb = ReasoningBudget(start=start, end=end, budget=5, starts_inside=True)
        return [_req(runtime, "Let me think step by step.", n=14, rid="think", reasoning=rb, ignore_eos=True)]

    plain, fast, _, dropped = _both(runtime, reqs)
    assert fast[0][0] == plain[0][0]
    assert fast[0][0][5 : 5 + len(end)] == end and len(fast[0][0]) == 14
    assert dropped >= 1


def _drive(runtime, ahead: bool, first, late, join_after: int):
    """Run the engine loop on this thread, step by step: `first` alone for join_after steps, then the
    `late` requests arrive. Returns each request's tokens and whether a run-ahead step was in flight
    when they arrived."""
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=256, block_size=runtime.backend.block_size,
                      draws=True)
    be.runs_ahead = ahead
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=4, context=4096), metrics=Metrics())
    loop = asyncio.new_event_loop()
    handles = []

    def arrive(req):
        handles.append(RequestHandle(req, loop))
        engine.submit(handles[-1])

    def step():
        engine.queues.take_inbox()
        engine.step()

    arrive(first)
    for _ in range(join_after):
        step()
    in_flight = engine.run_ahead.inflight is not None
    for r in late:
        arrive(r)
    while engine.busy:
        step()

    async def tokens(h):
        out = []
        async for e in h.events():
            if isinstance(e, Delta):
                out += e.tokens
        return out

    try:
        return [loop.run_until_complete(tokens(h)) for h in handles], in_flight
    finally:
        loop.close()


def test_a_new_request_joins_after_the_step_ahead(runtime):
    """Requests that arrive while a run-ahead step is in flight are admitted at the next step, and
    every sequence's tokens are those of the engine that waits for each step."""
    def reqs():
        return [_req(runtime, p, n=14, rid=f"j{i}", ignore_eos=True) for i, p in enumerate(PROMPTS)]

    plain, was_ahead = _drive(runtime, False, reqs()[0], reqs()[1:], join_after=5)
    fast, in_flight = _drive(runtime, True, reqs()[0], reqs()[1:], join_after=5)
    assert not was_ahead and in_flight  # the late requests arrived with a step already launched
    assert fast == plain and [len(t) for t in fast] == [14] * len(PROMPTS)


def test_the_numpy_feed_contract(runtime):
    """submit(feed=) takes the previous step's draw as the token; feeding a chunk that drew nothing is
    refused."""
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=8, block_size=16, draws=True)
    greedy = DeviceSample(0.0, 0, 1.0, 0.0, 0, 0)
    prompt = np.asarray(runtime.model.tokenizer.encode(PROMPTS[0]), np.int32)
    table = list(range(8))
    (first,) = be.submit([SeqChunk(prompt, 0, table, "last", sample=greedy)]).result()
    assert isinstance(first, SampledToken)
    (fed,) = be.submit([SeqChunk(np.zeros(1, np.int32), len(prompt), table, "last", sample=greedy)], feed=[0]).result()
    ref = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=8, block_size=16)
    ref.forward([SeqChunk(prompt, 0, table, "none")])
    (logits,) = ref.forward([SeqChunk(np.array([int(first)], np.int32), len(prompt), table, "last")])
    assert int(fed) == int(np.argmax(logits[-1]))
    be.forward([SeqChunk(np.array([1], np.int32), 0, table, "last")])  # draws nothing
    with pytest.raises(ValueError, match="drew no token"):
        be.submit([SeqChunk(np.zeros(1, np.int32), 1, table, "last", sample=greedy)], feed=[0])


def test_the_benchmark_decode_loop_runs_ahead_to_the_same_tokens(runtime):
    from ember.worker.bench.gpu_speed import decode

    prompts = [np.asarray(runtime.model.tokenizer.encode(p), np.int32) for p in PROMPTS[:2]]
    length = min(len(p) for p in prompts)  # decode() steps every stream at the same positions
    results = []
    for run_ahead in (False, True):
        be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=16, block_size=16, draws=True)
        tables = [list(range(0, 8)), list(range(8, 16))]
        firsts = be.forward([SeqChunk(p[:length], 0, t, "last", sample=DeviceSample(0.0, 0, 1.0, 0.0, 0, 0))
                             for p, t in zip(prompts, tables, strict=True)])
        results.append(decode(be, [int(t) for t in firsts], length, tables, 6, run_ahead))
    assert results[0] == results[1] and len(results[0]) == 6  # every step's tokens
