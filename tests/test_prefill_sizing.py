"""Prefill chunks sized at every step to the decode-latency target at the depth the step runs at (the
default), or fixed (--prefill-chunk N); the step cost model that sizes them."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.prefill_sizing import HEADROOM, MIN_CHUNK, PrefillSizing
from ember.worker.engine.requests import Delta, GenerationRequest, RequestHandle
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.step_costs import UNITS, PrefillCost, StepCost, step_features
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
    same = PrefillCost()
    for _ in range(5):
        same.observe(2048, 0.01)  # one size only: a rate through zero
    assert same.model == pytest.approx((0.0, 0.01 / 2048))
    assert PrefillCost().model is None and PrefillCost().seconds(4096) is None
    again = PrefillCost.from_json(cost.to_json())  # what a restarted worker starts from
    assert again.model == pytest.approx(cost.model)
    assert PrefillCost.from_json({"per_token_s": -1}).model is None and PrefillCost.from_json("x").model is None


# An 8B model on an H100, roughly: 5 ms a step, 80 us a token, 44 ns a key a decode row reads, 1.7 ns a
# query-key pair of prefill
H100_8B = (0.005, 80e-6, 44e-9, 1.7e-9)


def _step_cost(coef, prior=None) -> StepCost:
    """A StepCost fitted to steps of many shapes whose times `coef` gives exactly."""
    cost = StepCost(prior)
    rng = random.Random(1)
    for _ in range(60):
        feats = (rng.randint(1, 2048), rng.randint(0, 2_000_000), rng.randint(0, 60_000_000))
        cost.observe(feats, coef[0] + sum(c * f for c, f in zip(coef[1:], feats, strict=True)))
    return cost


def test_the_step_cost_fit_separates_depth_from_size():
    fitted = _step_cost(H100_8B)
    assert (fitted.coefficients / UNITS) == pytest.approx(H100_8B, rel=1e-6)
    # what the steps never vary is held at the prior (nothing decoded deep: keys unseen)
    held = StepCost((0.004, 70e-6, 40e-9, 2e-9))
    for n in (64, 256, 1024, 2048):
        for at in (0, 8192):
            feats = step_features([SeqChunk(np.zeros(n, np.int32), at, [], "last", prefill=True)])
            held.observe(feats, H100_8B[0] + H100_8B[1] * n + H100_8B[3] * feats[2])
    fixed, per_token, per_key, per_pair = held.coefficients / UNITS
    assert per_key == pytest.approx(40e-9, rel=1e-3) and per_pair == pytest.approx(1.7e-9, rel=0.05)
    assert per_token == pytest.approx(80e-6, rel=0.05)
    # a coefficient the data would make negative is held at zero
    neg = StepCost()
    for n in (64, 512, 2048):
        neg.observe((n, 0, 0), 0.01 - 1e-6 * n)
    assert (neg.coefficients >= 0).all()
    assert StepCost().coefficients is None and StepCost().prefill_within((1, 100, 0), 0, 0.05) is None


def test_step_features_count_what_grows_with_depth():
    decode = SeqChunk(np.zeros(1, np.int32), 30_000, [], "last")
    draft = SeqChunk(np.zeros(5, np.int32), 30_000, [], "all")
    prompt = SeqChunk(np.zeros(256, np.int32), 30_000, [], "none", prefill=True)
    assert step_features([decode, draft]) == (6, 60_006, 0)
    assert step_features([prompt]) == (256, 0, 256 * 30_000 + 256 * 257 // 2)


def _room(cost, decoding=True, most=2048, target=0.05, tokens=2048):
    return PrefillSizing(most, target).room(cost, tokens, decoding)


def test_a_step_carries_what_the_target_leaves_at_its_depth():
    cost = StepCost(H100_8B)
    for depth in (0, 8192, 32768):
        room = _room(cost)
        for _ in range(8):  # eight streams decoding, as deep as the prompt
            room.add(SeqChunk(np.zeros(1, np.int32), depth, [], "last"))
        n = room.prefill(depth, 100_000)
        assert n % MIN_CHUNK == 0 and n >= MIN_CHUNK
        room.add(SeqChunk(np.zeros(n, np.int32), depth, [], "none", prefill=True))
        assert cost.seconds(room.features) <= 0.05 * HEADROOM  # within the target, planned with headroom...
        more = cost.seconds(tuple(a + b for a, b in zip(room.features, (MIN_CHUNK, 0, MIN_CHUNK * (depth + n)),
                                                          strict=True)))
        assert more > 0.05 * HEADROOM  # ...and as much as it allows
        if depth == 0:
            shallow = n
    assert n < shallow / 1.3  # deep in a conversation the same target carries less
    # what is left of a prompt is taken whole where it fits; a second prompt gets the step's remainder
    room = _room(cost)
    room.add(SeqChunk(np.zeros(1, np.int32), 100, [], "last"))
    assert room.prefill(0, 100) == 100


def test_a_waiting_prefill_still_moves_and_nobody_waits_on_an_undecoded_step():
    cost = StepCost(H100_8B)
    room = _room(cost)
    for _ in range(64):  # decode rows that fill the target alone
        room.add(SeqChunk(np.zeros(1, np.int32), 32_768, [], "last"))
    assert cost.seconds(room.features) > 0.05
    assert room.prefill(32_768, 10_000) == MIN_CHUNK  # the first prefill of the step moves anyway...
    room.add(SeqChunk(np.zeros(MIN_CHUNK, np.int32), 32_768, [], "none", prefill=True))
    assert room.prefill(0, 10_000) == 0  # ...the second waits for the next step
    assert _room(cost, decoding=False).prefill(32_768, 10_000) == 2048  # nothing decodes: the ceiling
    assert _room(None).prefill(0, 10_000) == 2048  # nothing known: the ceiling
    assert PrefillSizing(2048).room(cost, 2048, True).prefill(0, 10_000) == 2048  # fixed chunks
    assert _room(cost, tokens=300).prefill(0, 10_000) <= 300  # the step's tokens bound it too


class _Recording(NumpyBackend):
    """The real numpy backend, noting each step's chunk lengths."""

    steps: list[list[int]]

    def forward(self, chunks):
        self.steps.append([len(c.tokens) for c in chunks])
        self.reach = max([getattr(self, "reach", 0)] + [c.start + len(c.tokens) for c in chunks])
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


def test_the_engine_sizes_chunks_by_steps_it_times_at_start(runtime, capfd):
    """Alone, a prompt is split at the ceiling (nothing decodes, nobody waits); the cost model the start
    timed is logged."""
    prompt = runtime.model.tokenizer.encode("A long prompt about printing presses and their history. " * 80)[:800]
    assert len(prompt) == 800
    assert _prefill_steps(runtime, prompt, prefill_chunk=512, itl_target_s=1e-4) == [512, 288]
    assert _prefill_steps(runtime, prompt, prefill_chunk=512) == [512, 288]  # fixed
    said = [json.loads(line) for line in capfd.readouterr().err.splitlines() if '"prefill_sizing"' in line]
    assert len(said) == 1 and said[0]["most_tokens"] == 512 and said[0]["itl_target_ms"] == 0.1
    assert said[0]["per_token_us"] > 0


def test_a_prefill_beside_a_decoding_stream_is_cut_to_the_target(runtime, capfd):
    """A stream decodes while another request's prompt arrives: under a target no CPU step meets, the
    prompt goes in MIN_CHUNK pieces while the stream decodes (each step with its decode row), whole
    steps again once it is done. Every step the stream waited on missed the target, and says so: in
    the metrics, and in one log line (they are rate-limited)."""
    rt = runtime.backend
    be = _Recording(runtime.config, rt.weights, n_blocks=rt.n_blocks, block_size=rt.block_size)
    metrics = Metrics()
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=2048, max_step_tokens=512, prefill_chunk=512,
                                                    itl_target_s=1e-4), metrics=metrics)
    be.steps = []
    engine.start()
    assert 2048 - 2 * 256 < be.reach <= 2048  # the start timed steps deep in the context, none beyond it
    be.steps = []
    tok = runtime.model.tokenizer
    long = tok.encode("A long prompt about printing presses and their history. " * 80)[:800]

    async def go():
        loop = asyncio.get_running_loop()
        a = RequestHandle(GenerationRequest("a", tok.encode("Count:"), SamplingParams(temperature=0.0), 40,
                                            ignore_eos=True), loop)
        engine.submit(a)
        events = a.events()
        while not isinstance(await anext(events), Delta):  # a decodes
            pass
        b = RequestHandle(GenerationRequest("b", long, SamplingParams(temperature=0.0), 2), loop)
        engine.submit(b)
        return [e async for e in events], [e async for e in b.events()]

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    beside = [step for step in be.steps if 1 in step and any(n > 1 for n in step)]
    assert beside, be.steps
    pieces_beside = [n for step in beside for n in step if n > 1]
    assert set(pieces_beside[:-1]) == {MIN_CHUNK} and pieces_beside[-1] <= MIN_CHUNK, beside  # the last: the rest
    pieces = [n for step in be.steps for n in step if n > 1 and step != [2]]
    assert sum(pieces) >= 800 - 16 and max(pieces) <= 512, be.steps
    sample = metrics.registry.get_sample_value
    with_prefill = sample("ember_step_seconds_count", {"kind": "decode+prefill"})
    decode_only = sample("ember_step_seconds_count", {"kind": "decode"})
    assert with_prefill >= len(beside) and decode_only >= 1
    assert sample("ember_steps_over_itl_target_total") == with_prefill + decode_only  # none met 0.1 ms
    lines = [json.loads(x) for x in capfd.readouterr().err.splitlines() if '"step_over_target"' in x]
    # rate-limited: a line per OVER_LOG_SECONDS at most, together counting what they stand for
    assert lines and sum(e["over_since_last"] for e in lines) <= with_prefill + decode_only, lines
    e = lines[0]
    assert e["level"] == "warning" and e["target_ms"] == 0.1 and e["took_ms"] > 0.1 and e["decode_rows"] == 1
    assert e["predicted_ms"] > 0 and e["over_since_last"] == 1


def test_the_itl_target_setting(tmp_path):
    """--itl-target-ms (or --itl-target): 50 ms by default, 0 turns sizing off; the setting it replaced,
    prefill_step_ms, is refused with its successor named, from a file or the environment."""
    import argparse

    from ember.worker import config as wc

    p = argparse.ArgumentParser()
    wc.add_arguments(p)
    assert wc.load(p.parse_args([]), env={})[0].itl_target_ms == 50.0
    cfg, src = wc.load(p.parse_args(["--itl-target", "30"]), env={})
    assert cfg.itl_target_ms == 30.0 and src["itl_target_ms"].startswith("flag")
    assert wc.load(p.parse_args(["--itl-target-ms", "0"]), env={})[0].itl_target_ms == 0.0
    with pytest.raises(wc.ConfigError, match="itl_target_ms: must be between 0"):
        wc.load(p.parse_args([]), env={"EMBER_ITL_TARGET_MS": "-5"})
    toml = tmp_path / "ember.toml"
    toml.write_text("[worker]\nprefill_step_ms = 25\n")
    with pytest.raises(wc.ConfigError, match=r"ember.toml: prefill_step_ms was replaced by itl_target_ms"):
        wc.load(p.parse_args(["--config", str(toml)]), env={})
    with pytest.raises(wc.ConfigError, match="EMBER_PREFILL_STEP_MS was replaced by itl_target_ms"):
        wc.load(p.parse_args([]), env={"EMBER_PREFILL_STEP_MS": "25"})


def test_a_warm_turn_goes_before_a_long_prefill(runtime):
    """A short prompt (an agent's next turn on a cached conversation) that arrives while a long one
    prefills is taken whole in the next step, ahead of the long one, which goes on in the same step's
    remaining tokens (scheduler.QUICK_PREFILL)."""
    rt = runtime.backend
    be = _Recording(runtime.config, rt.weights, n_blocks=rt.n_blocks, block_size=rt.block_size)
    engine = Engine(runtime.model, be, EngineLimits(max_seqs=2, context=2048, max_step_tokens=256, prefill_chunk=256),
                    metrics=Metrics())
    be.steps = []
    engine.start()
    tok = runtime.model.tokenizer
    long = tok.encode("A long prompt about printing presses and their history. " * 160)[:1500]
    short = tok.encode("And a short question about type. " * 20)[:100]
    assert len(long) == 1500 and len(short) == 100

    async def go():
        loop = asyncio.get_running_loop()
        a = RequestHandle(GenerationRequest("long", long, SamplingParams(temperature=0.0), 1), loop)
        engine.submit(a)
        while len(be.steps) < 1:  # the long prompt's first chunk is in
            await asyncio.sleep(0.01)
        b = RequestHandle(GenerationRequest("short", short, SamplingParams(temperature=0.0), 1), loop)
        engine.submit(b)
        return [e async for e in a.events()], [e async for e in b.events()]

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    with_short = next(i for i, step in enumerate(be.steps) if 100 in step)
    assert be.steps[with_short] == [100, 156], be.steps  # the short one first, the long one in what is left
    assert sum(n for step in be.steps[with_short + 1:] for n in step) > 0, be.steps  # the long one still going


def test_steps_over_the_target_are_counted_and_logged_at_most_every_few_seconds(capfd):
    """CostSampler: a step with a decoding stream that takes longer than the target counts, and is logged
    with what it carried and what the model predicted; within OVER_LOG_SECONDS the next ones only count
    (the next line says how many); a step nobody decoded in, or one within the target, neither."""
    from ember.worker.engine.cost_sampling import OVER_LOG_SECONDS, CostSampler
    from ember.worker.engine.restore_policy import RestoreCosts

    metrics = Metrics()
    sampler = CostSampler(RestoreCosts(), None, None, itl_target_s=0.05, metrics=metrics)
    sampler.step_cost = StepCost((0.01, 1e-5, 0.0, 0.0))
    decode = SeqChunk(np.zeros(1, np.int32), 900, [], "last", prefill=False)
    prefill = SeqChunk(np.zeros(256, np.int32), 0, [], "last", prefill=True)
    sampler.observe([decode, prefill], 0.08, now=100.0)  # over: logged
    sampler.observe([decode, prefill], 0.07, now=101.0)  # over: counted
    sampler.observe([decode], 0.02, now=102.0)  # within
    sampler.observe([prefill], 0.5, now=103.0)  # nobody waited on it
    sampler.observe([decode, prefill], 0.09, now=100.0 + OVER_LOG_SECONDS + 1)  # over: logged, with the one before
    sample = metrics.registry.get_sample_value
    assert sample("ember_steps_over_itl_target_total") == 3
    assert sample("ember_step_seconds_count", {"kind": "decode+prefill"}) == 3
    assert sample("ember_step_seconds_count", {"kind": "decode"}) == 1
    lines = [json.loads(x) for x in capfd.readouterr().err.splitlines() if '"step_over_target"' in x]
    assert [(e["took_ms"], e["over_since_last"]) for e in lines] == [(80.0, 1), (90.0, 2)]
    assert lines[0]["predicted_ms"] == pytest.approx(10 + 257 * 0.01, abs=0.01)  # fixed + tokens, before it learned
    assert (lines[0]["decode_rows"], lines[0]["prefill_tokens"], lines[0]["keys"], lines[0]["pairs"]) == \
        (1, 256, 901, 256 * 257 // 2)
    # no target sized (numpy's fixed chunks: nothing calibrated): timed, never called over
    idle = CostSampler(RestoreCosts(), None, None, itl_target_s=0.05, metrics=Metrics())
    idle.observe([decode, prefill], 0.5, now=1.0)
    assert idle.metrics.registry.get_sample_value("ember_steps_over_itl_target_total") == 0
