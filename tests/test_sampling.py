from __future__ import annotations

import numpy as np
import pytest

from ember.worker.engine.sampling import Sampler, SamplingParams, log_softmax

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0, 2.9], dtype=np.float32)


def _draws(params: SamplingParams, n: int = 4000, logits=LOGITS, history=()) -> np.ndarray:
    s = Sampler(params)
    return np.array([s.sample(logits, list(history)) for _ in range(n)])


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0.0)).sample(LOGITS, []) == 1
    assert Sampler(SamplingParams(temperature=1.5, top_k=1)).sample(LOGITS, []) == 1


def test_seed_reproducible_and_seeds_differ():
    a = _draws(SamplingParams(temperature=1.0, seed=42), 200)
    b = _draws(SamplingParams(temperature=1.0, seed=42), 200)
    c = _draws(SamplingParams(temperature=1.0, seed=43), 200)
    assert (a == b).all() and not (a == c).all()


def test_temperature_one_follows_softmax():
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, seed=0), 20000), minlength=6) / 20000
    expected = np.exp(log_softmax(LOGITS))
    np.testing.assert_allclose(counts, expected, atol=0.015)


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(_draws(SamplingParams(top_k=2, seed=1))) == {1, 5}
    # probabilities (sorted): 0.39, 0.32, 0.24, ...: top_p 0.5 keeps the first two
    assert set(_draws(SamplingParams(top_p=0.5, seed=2))) == {1, 5}
    # min_p 0.7 keeps tokens with p >= 0.7 * p_max: logits within ln(1/0.7) = 0.357 of the max
    assert set(_draws(SamplingParams(min_p=0.7, seed=3))) == {1, 5}


def test_low_temperature_sharpens():
    hot = np.bincount(_draws(SamplingParams(temperature=2.0, seed=4)), minlength=6)
    cold = np.bincount(_draws(SamplingParams(temperature=0.2, seed=4)), minlength=6)
    assert cold[1] > hot[1] and cold[3] <= hot[3]


def test_penalties():
    s = Sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s.apply_penalties(LOGITS, [1, 1, 3])
    assert out[1] == pytest.approx(3.0 / 2.0 - 0.5 - 0.5)  # positive logit divided; 2 occurrences
    assert out[3] == pytest.approx(-1.0 * 2.0 - 0.5 - 0.25)  # negative logit multiplied
    assert out[0] == LOGITS[0] and out.dtype == np.float32
    # greedy with a strong repetition penalty avoids the repeated token
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=3.0)).sample(LOGITS, [1]) == 5


def test_validate_names_bad_field():
    assert SamplingParams(temperature=-1).validate() == "temperature"
    assert SamplingParams(top_p=0).validate() == "top_p"
    assert SamplingParams(min_p=1.5).validate() == "min_p"
    assert SamplingParams().validate() is None
