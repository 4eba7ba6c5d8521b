"""Loop guard: periods 1..50 trigger, near-repeats don't; bounded default output cap."""

import random

import pytest

from ember.worker.engine.loopguard import LoopGuard


def feed_all(g, toks):
    fired_at = None
    for i, t in enumerate(toks):
        if g.feed(t) and fired_at is None:
            fired_at = i
    return fired_at


def prefix(rng, n=37):
    return [rng.randrange(1000, 2000) for _ in range(n)]  # distinct-ish noise before the loop


@pytest.mark.parametrize("period", range(1, 51))
def test_every_period_triggers_exactly_at_k_repeats(period):
    rng = random.Random(period)
    k = 4
    block = rng.sample(range(100_000), period)  # distinct tokens: minimal period == period
    pre = prefix(rng)
    g = LoopGuard(max_period=50, repeats=k, min_span=0)
    fired = feed_all(g, pre + block * (k + 2))
    assert fired == len(pre) + k * period - 1
    assert g.period == period


@pytest.mark.parametrize("period", [1, 2, 3, 7, 16, 50])
def test_k_minus_one_repeats_do_not_trigger(period):
    rng = random.Random(period)
    k = 5
    block = rng.sample(range(100_000), period)
    g = LoopGuard(max_period=50, repeats=k, min_span=0)
    assert feed_all(g, prefix(rng) + block * (k - 1) + block[:-1]) is None


@pytest.mark.parametrize("period", [2, 5, 16, 33])
def test_near_repeats_do_not_trigger(period):
    rng = random.Random(100 + period)
    block = rng.sample(range(100_000), period)
    toks = prefix(rng)
    for r in range(12):  # each repetition has one token changed: never K exact copies back to back
        b = list(block)
        b[r % period] = 200_000 + r
        toks += b
    g = LoopGuard(max_period=50, repeats=3, min_span=0)
    assert feed_all(g, toks) is None


def test_period_longer_than_max_period_is_not_detected():
    rng = random.Random(5)
    block = rng.sample(range(100_000), 60)
    g = LoopGuard(max_period=50, repeats=3, min_span=0)
    assert feed_all(g, block * 5) is None


def test_repeats_not_back_to_back_do_not_trigger():
    block = [1, 2, 3, 4]
    toks = []
    for i in range(10):
        toks += block + [900 + i]  # a separator each time: period 5 blocks differ
    assert feed_all(LoopGuard(max_period=50, repeats=3, min_span=0), toks) is None


def test_random_text_does_not_trigger():
    rng = random.Random(7)
    toks = [rng.randrange(50) for _ in range(5000)]  # small vocabulary, lots of chance repeats
    assert feed_all(LoopGuard(max_period=64, repeats=8, min_span=64), toks) is None


def test_min_span_protects_short_periods():
    g = LoopGuard(max_period=64, repeats=4, min_span=32)
    # 20 identical tokens (e.g. indentation) is fine; period 1 needs 32 in a row
    assert feed_all(g, [5] * 20) is None
    assert feed_all(g, [5] * 12) == 11  # 32nd in a row
    g = LoopGuard(max_period=64, repeats=4, min_span=32)
    assert feed_all(g, [1, 2] * 15) is None  # 30 tokens
    g = LoopGuard(max_period=64, repeats=4, min_span=32)
    assert feed_all(g, [1, 2] * 16) == 31


def test_defaults_catch_a_real_loop():
    rng = random.Random(3)
    sentence = rng.sample(range(32000), 12)
    g = LoopGuard()
    fired = feed_all(g, prefix(rng, 200) + sentence * 20)
    assert fired is not None and g.period == 12


def test_stays_triggered_and_reset():
    g = LoopGuard(max_period=4, repeats=2, min_span=0)
    assert feed_all(g, [1, 1]) == 1
    assert g.feed(2) is True
    g.reset()
    assert g.feed(1) is False and g.feed(2) is False and g.triggered is False


def test_bad_args():
    with pytest.raises(ValueError):
        LoopGuard(max_period=0)
    with pytest.raises(ValueError):
        LoopGuard(repeats=1)


def test_repeats_for_names_the_copies_that_fire():
    g = LoopGuard(max_period=64, repeats=8, min_span=128)
    assert g.repeats_for(1) == 128 and g.repeats_for(16) == 8 and g.repeats_for(20) == 8 and g.repeats_for(10) == 13
    rng = random.Random(3)
    block = rng.sample(range(100_000), 10)
    fired = feed_all(g, prefix(rng) + block * 20)
    assert g.period == 10 and fired == 37 + g.repeats_for(10) * 10 - 1


def test_worker_config_loop_guard_flag_env_and_file(tmp_path):
    import argparse

    from ember.worker import config as wc

    p = argparse.ArgumentParser()
    wc.add_arguments(p)
    cfg, src = wc.load(p.parse_args([]), env={})
    assert (cfg.loop_guard, cfg.loop_guard_repeats, cfg.loop_guard_min_span) == (True, 8, 128)
    toml = tmp_path / "ember.toml"
    toml.write_text("[worker]\nloop_guard_repeats = 5\nloop_guard_min_span = 40\n")
    cfg, src = wc.load(p.parse_args(["--config", str(toml), "--no-loop-guard"]),
                       env={"EMBER_LOOP_GUARD_MIN_SPAN": "64"})
    assert (cfg.loop_guard, cfg.loop_guard_repeats, cfg.loop_guard_min_span) == (False, 5, 64)
    assert src["loop_guard"] == "flag --loop-guard" and src["loop_guard_min_span"] == "env EMBER_LOOP_GUARD_MIN_SPAN"
    cfg, _ = wc.load(p.parse_args([]), env={"EMBER_LOOP_GUARD": "false"})
    assert cfg.loop_guard is False
    with pytest.raises(wc.ConfigError, match="loop_guard_repeats"):
        wc.load(p.parse_args(["--loop-guard-repeats", "1"]), env={})
