"""Prefill chunks sized by the measured prefill rate (the default) or fixed (--prefill-chunk N)."""

from __future__ import annotations

import asyncio

import pytest

from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.prefill_sizing import FLOOR_TOKENS, PrefillSizing
from ember.worker.engine.requests import Delta, GenerationRequest, RequestHandle
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.step_costs import PrefillCost
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime


def _cost(fixed_s: float, per_token_s: float, sizes=(64, 512, 2048)) -> PrefillCost:
    cost = PrefillCost()
    for _ in range(3):
        for n in sizes:
            cost.observe(n, fixed_s + per_token_s * n)
    return cost


def test_the_step_cost_fit_separates_the_fixed_part():
    cost = _cost(0.008, 1 / 190_000)  # a 270M model: launches dominate small steps
    fixed, per = cost.model
    assert fixed == pytest.approx(0.008) and per == pytest.approx(1 / 190_000)
    assert cost.seconds(4096) == pytest.approx(0.008 + 4096 / 190_000)
    assert cost.tokens_within(0.025) == int(0.017 * 190_000)
    assert cost.tokens_within(0.005) == 0  # the fixed part alone is longer
    same = PrefillCost()
    for _ in range(5):
        same.observe(2048, 0.01)  # one size only: a rate through zero
    assert same.model == pytest.approx((0.0, 0.01 / 2048))
    assert PrefillCost().model is None and PrefillCost().tokens_within(0.025) is None
    again = PrefillCost.from_json(cost.to_json())  # what a restarted worker starts from
    assert again.model == pytest.approx(cost.model)
    assert PrefillCost.from_json({"per_token_s": -1}).model is None and PrefillCost.from_json("x").model is None


def test_fixed_chunks_ignore_the_cost():
    assert PrefillSizing(2048).chunk(PrefillCost()) == 2048
    assert PrefillSizing(2048).chunk(_cost(0.005, 1 / 13_000)) == 2048


def test_auto_chunks_fit_the_target_step_time_in_powers_of_two():
    auto = PrefillSizing(2048, target_s=0.025)
    assert auto.chunk(PrefillCost()) == 2048  # unmeasured: the ceiling, and the first steps measure the cost
    assert auto.chunk(_cost(0.005, 1 / 13_000)) == 256  # an 8B model on an H200: 260 tokens fit 25 ms
    assert auto.chunk(_cost(0.002, 1 / 40_000)) == 512  # 920 tokens fit: rounded down to a power of two
    assert auto.chunk(_cost(0.008, 1 / 190_000)) == 2048  # a 270M model: capped at the backend's rows
    assert auto.chunk(_cost(0.05, 1 / 500)) == FLOOR_TOKENS  # the CPU: never below the floor
    assert PrefillSizing(64, target_s=0.025).chunk(_cost(0.05, 1 / 500)) == 64  # a ceiling under the floor wins


class _Recording(NumpyBackend):
    """The real numpy backend, noting each step's chunk lengths."""

    steps: list[list[int]]

    def forward(self, chunks):
        self.steps.append([len(c.tokens) for c in chunks])
        return super().forward(chunks)


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=2048)


def _prefill_steps(runtime, prompt: list[int], **limits) -> list[int]:
    rt = runtime.backend
    be = _Recording(runtime.config, rt.weights, n_blocks=rt.n_blocks, block_size=rt.block_size)
    be.steps = []
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=2048, max_step_tokens=512, **limits),
                    metrics=Metrics())
    engine.start()  # auto sizing times its prefills here, before serving
    be.steps = []

    async def go():
        h = RequestHandle(GenerationRequest("r", prompt, SamplingParams(temperature=0.0), 2),
                          asyncio.get_running_loop())
        engine.submit(h)
        return [e async for e in h.events() if isinstance(e, Delta)]

    try:
        assert asyncio.run(go())
    finally:
        engine.shutdown()
    return [n for step in be.steps for n in step if n > 1]


def test_the_engine_sizes_chunks_by_prefills_it_times_at_start(runtime, capfd):
    prompt = runtime.model.tokenizer.encode("A long prompt about printing presses and their history. " * 80)[:800]
    assert len(prompt) == 800
    # a target far below what a CPU step takes: the floor, as the prefills timed at start showed
    assert _prefill_steps(runtime, prompt, prefill_chunk=512, prefill_step_s=1e-4) == [256, 256, 256, 32]
    # a target a CPU step meets: the ceiling
    assert _prefill_steps(runtime, prompt, prefill_chunk=512, prefill_step_s=100.0) == [512, 288]
    assert _prefill_steps(runtime, prompt, prefill_chunk=512) == [512, 288]  # fixed
    said = [line for line in capfd.readouterr().err.splitlines() if '"prefill_chunk"' in line]
    assert len(said) == 2 and '"tokens": 256' in said[0] and '"tokens": 512' in said[1]
