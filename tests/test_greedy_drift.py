"""The soak's greedy identity, tie-aware: two answers that part where each run's token is among the other's
leading alternatives and both runs hold the two within TIE_NATS are a tie (recorded with its evidence);
any other parting, or one without logprobs to judge it, is drift and fails the check."""

from __future__ import annotations

from ember.worker.bench.greedy_drift import TIE_NATS, Answer, chunk_alternatives, compare, part
from ember.worker.bench.soak_report import Phase, find_problems, greedy_ties


def _answer(*steps: tuple[str, float, str, float]) -> Answer:
    """Each step: the chosen token and its logprob, the runner-up and its logprob."""
    return Answer(tuple(s[0] for s in steps), tuple(((s[0], s[1]), (s[2], s[3])) for s in steps))


def test_the_legacy_and_the_chat_shaped_logprobs_are_read():
    ember = {"text": "ab", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                                        "top_logprobs": [{"z": -0.9, "a": -0.5}, {"b": -1.0, "c": -1.2}]}}
    assert chunk_alternatives(ember) == [("a", (("a", -0.5), ("z", -0.9))), ("b", (("b", -1.0), ("c", -1.2)))]
    # as llama-server streams /v1/completions (captured from the build .ci/run makes)
    llama = {"text": " tokens", "logprobs": {"content": [
        {"id": 398, "token": " tokens", "logprob": -5.655, "top_logprobs": [
            {"id": 27, "token": "\u0018", "logprob": -5.697}, {"id": 398, "token": " tokens", "logprob": -5.655}]}]}}
    assert chunk_alternatives(llama) == [(" tokens", ((" tokens", -5.655), ("\u0018", -5.697)))]
    assert chunk_alternatives({"text": "a"}) == [] and chunk_alternatives({"text": "a", "logprobs": None}) == []


def test_a_swap_of_a_near_tie_is_a_tie_and_anything_else_is_drift():
    same = ("x", -0.1, "y", -3.0)
    a = _answer(same, ("p", -0.70, "q", -0.72), ("r", -1.0, "s", -2.0))
    b = _answer(("x", -0.1003, "y", -3.0), ("q", -0.705, "p", -0.71), ("t", -1.0, "u", -2.0))
    assert part(a, a) is None
    p = part(a, b)
    assert p is not None and p.at == 1 and (p.a, p.b) == ("p", "q") and p.tie
    assert abs(p.gap_a - 0.02) < 1e-9 and abs(p.gap_b - 0.005) < 1e-9 and abs(p.noise - 0.0003) < 1e-9
    # the same swap where run a holds its token well ahead: drift
    far = _answer(same, ("p", -0.2, "q", -0.2 - TIE_NATS - 0.01), ("r", -1.0, "s", -2.0))
    assert not part(far, b).tie
    # run b's token is not among run a's alternatives: the runs disagree on more than an order
    other = _answer(same, ("p", -0.70, "w", -0.71), ("r", -1.0, "s", -2.0))
    assert not part(other, b).tie
    # no logprobs: nothing to judge a parting by
    assert not part(Answer(("x", "p")), Answer(("x", "q"))).tie
    # one answer ended where the other went on
    assert not part(Answer(("x",)), Answer(("x", "q"))).tie


def test_ties_pass_the_soak_checks_and_are_reported_and_drifts_fail():
    x = _answer(("x", -0.1, "y", -3.0))
    tie_a = _answer(("p", -0.70, "q", -0.72))
    tie_b = _answer(("q", -0.705, "p", -0.71))
    drift = _answer(("r", -0.1, "p", -4.0))
    baseline = Phase("baseline", [], greedy_before=[x, tie_a], greedy_after=[x, tie_b])
    churn = Phase("churn", [], greedy_before=[x, tie_a], greedy_after=[x, drift])
    checks = find_problems([baseline, churn], logs=False)
    assert checks["greedy_identical"] == ["churn: prompt 1: token 0: 'p' vs 'r' (not in each other's top 5)"]
    assert not checks["greedy_identical_across_phases"]
    ties = greedy_ties([baseline, churn])
    assert [(t["where"], t["prompt"], t["at"], t["tie"]) for t in ties] == [("baseline", 1, 0, True)]
    v = compare([x], [x, x], "w")
    assert v.drifts == ["w: 1 outputs vs 2"] and not v.ties
