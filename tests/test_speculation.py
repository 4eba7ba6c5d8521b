"""Speculative decoding (worker/engine/spec/speculation.py, drafters.py): drafts never change the output.

Greedy outputs are token-for-token those of decoding without drafts, through the real engine on the
embedded model, with stop strings and a grammar in force; sampled ones keep the target distribution
(rejection sampling, checked with a chi-squared test over many seeded draws)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ember.worker import config as worker_config
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.requests import Delta, Finished, GenerationRequest, RequestHandle
from ember.worker.engine.sampling import Sampler, SamplingParams
from ember.worker.engine.spec.drafters import NgramDrafter, SuffixDrafter, TokenIndex
from ember.worker.engine.spec.replay import ReplayDrafter, parse_replay
from ember.worker.engine.spec.speculation import PAUSE_STEPS, Speculator, tokens_per_step
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

GREEDY = SamplingParams(temperature=0.0)


# -- drafters ------------------------------------------------------------------------------------------


def _index(tokens, max_n=4):
    idx = TokenIndex(max_n)
    idx.extend(tokens)
    return idx


def test_ngram_drafts_what_followed_the_latest_earlier_occurrence():
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    d = NgramDrafter()
    assert d.propose(_index(toks), 3) == ([7, 8, 1], 3)  # "1 2 3" last ended before 7 8 1 (not the tail)
    assert d.propose(_index([5, 6, 7]), 3) == ([], 0)  # nothing repeats
    idx = _index([1, 2, 3, 4])
    idx.sync([1, 2, 3, 4, 1, 2])  # grows with the sequence
    assert d.propose(idx, 4) == ([3, 4, 1, 2], 2)


def test_suffix_prefers_long_matches_drafts_further_and_reads_the_pool():
    d = SuffixDrafter(max_n=8)
    # one-token match: short draft (at most 2); a long match drafts up to k
    toks = [10, 11, 12, 13, 14, 15, 16, 17, 18, 10]
    assert d.propose(_index(toks, 8), 8) == ([11, 12], 1)
    long_ = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13]
    assert d.propose(_index(long_, 8), 8) == ([14, 15, 16, 17, 18, 19, 20, 10], 4)
    # another request's finished output (a session's earlier turn) supplies the continuation
    d.finished([0] * 5 + list(range(100, 130)), prompt_len=5)
    assert d.propose(_index([7, 7, 100, 101, 102, 103], 8), 6) == ([104, 105, 106, 107, 108, 109], 4)


def test_the_policy_drafts_only_where_it_pays():
    sp = Speculator("ngram", k=8, max_batch=4, max_context=100)
    st = sp.state()
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    assert sp.draft(st, toks, decoding=1) == []  # a fresh worker: its first step has none, to time one
    sp.costs.observe(1, 1, 0.02)
    assert sp.draft(st, toks, decoding=1) == [3, 4, 5, 6, 7, 8, 9, 10]  # no fit yet: the longest draft
    assert sp.draft(st, toks, decoding=5) == []  # a wide batch: no drafts
    assert sp.draft(sp.state(), toks + [0] * 90, decoding=1) == []  # past max_context
    # a GPU-like device: 10 ms a step, 0.1 ms a token more with a draft
    for i in range(20):
        sp.costs.observe(1, 1, 0.010)
        sp.costs.observe(2 + i % 7, 1, 0.010 + 0.0001 * (2 + i % 7))
    (an, bn), (aw, bw) = sp.costs.model()
    assert abs(an - 0.010) < 1e-3 and bn == 0.0 and abs(aw - 0.010) < 1e-9 and abs(bw - 0.0001) < 1e-9
    assert tokens_per_step(0.5, 2) == 1.75 and tokens_per_step(1.0, 4) == 5.0
    assert sp.best_length(0.1, 8, 1) == 1  # even a poor guess pays where a wider step is nearly free
    assert sp.best_length(0.9, 8, 1) == 8
    # the CPU reference's 270M: 27 ms a step, 78 ms with a draft of any length (another BLAS path)
    cpu = Speculator("suffix", k=8, max_batch=4)
    for i in range(20):
        cpu.costs.observe(1, 1, 0.027)
        cpu.costs.observe(2 + i % 7, 1, 0.078 + 0.001 * (i % 7))
    assert cpu.best_length(0.2, 8, 1) == 0  # prose: never worth it there
    assert cpu.best_length(0.95, 8, 1) == 8  # a copy: 6.7 tokens for 3x the time
    assert cpu.best_length(0.9, 8, 4) < 8  # a batch gains less from one sequence's draft
    # a new sequence: a long match is trusted as a copy, a one-token match is not
    copy = list(range(50, 70)) + list(range(50, 62))  # its tail repeats 12 tokens
    assert len(cpu.draft(cpu.state(), copy, decoding=1)) == 8
    st = cpu.state()
    assert cpu.draft(st, [5, 6, 7, 5], decoding=1) == [] and st.paused > PAUSE_STEPS
    # its own record replaces the prior: drafts that stop paying pause it, probes cost <= 1% of the time
    st = cpu.state()
    for _ in range(5):
        cpu.record(st, 5, 0)
    assert st.acceptance < 0.2
    assert cpu.draft(st, copy, decoding=1) == [] and st.paused == cpu.pause_steps(1)
    assert 150 < st.paused < 250  # (78 + 2 - 27) ms / 0.27 ms
    assert all(cpu.draft(st, copy, decoding=1) == [] for _ in range(cpu.pause_steps(1)))
    assert cpu.draft(st, copy, decoding=1) == [62, 63]  # the probe
    cpu.record(st, 2, 2)
    assert st.drafted == 27 and st.accepted == 2 and st.steps == 6


# -- rejection sampling keeps the target distribution --------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=1),
                                    SamplingParams(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02, seed=2)])
def test_rejection_sampling_draws_the_target_distribution(params):
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, 40).astype(np.float32)
    target = Sampler(params)
    ids, probs = target.distribution(logits, [])
    p = np.zeros(40)
    p[ids] = probs
    n = 40_000
    for draft in (int(np.argmax(p)), int(np.argsort(p)[-4]), int(np.argmin(p))):  # likely, less, impossible
        s = Sampler(params)
        counts = np.zeros(40)
        stood = 0
        for _ in range(n):
            tok, ok = s.verify(logits, [], None, draft)
            counts[tok] += 1
            stood += ok
        keep = p > 0
        assert counts[~keep].sum() == 0
        expected = n * p[keep]
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        df = int(keep.sum()) - 1
        assert chi2 < df + 6 * np.sqrt(2 * df) + 10, (draft, chi2, df)  # far past p = 1e-4 for these df
        assert abs(stood / n - p[draft]) < 4 * np.sqrt(max(p[draft] * (1 - p[draft]), 1e-9) / n) + 1e-9


def test_greedy_verification_is_the_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    s = Sampler(GREEDY)
    assert s.verify(logits, [], None, 1) == (1, True)
    assert s.verify(logits, [], None, 2) == (1, False)
    bias = np.array([0.0, -np.inf, 0.0, 0.0], np.float32)  # a grammar forbids the argmax
    assert s.verify(logits, [], bias, 1) == (2, False)


def test_unknown_drafters_are_config_errors():
    with pytest.raises(worker_config.ConfigError, match="not available"):
        worker_config.validate(worker_config.WorkerConfig(spec="eagle"))
    worker_config.validate(worker_config.WorkerConfig(spec="mtp"))  # the model decides (tests/test_mtp.py)
    with pytest.raises(worker_config.ConfigError, match="mtp runs on the numpy backend only"):
        worker_config.validate(worker_config.WorkerConfig(spec="mtp", backend="cuda"))
    with pytest.raises(worker_config.ConfigError, match="spec_k"):
        worker_config.validate(worker_config.WorkerConfig(spec="ngram", spec_k=0))


# -- the engine: drafts never change greedy output -----------------------------------------------------


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=4096)


def _engine(runtime, spec="off", drafter=None, **limits):
    e = Engine(runtime.model, runtime.backend,
               EngineLimits(**{"max_seqs": 4, "context": 4096, "spec": spec, **limits}), metrics=Metrics(),
               drafter=drafter)
    e.start()
    return e


async def _collect(engine, req):
    h = RequestHandle(req, asyncio.get_running_loop())
    engine.submit(h)
    text, tokens, last = "", [], None
    async for e in h.events():
        if isinstance(e, Delta):
            text += e.text
            tokens += e.tokens
        elif isinstance(e, Finished):
            last = e
    return text, tokens, last


# a code edit: the model re-emits a block it was just shown (where drafts from the prompt pay)
EDIT = ("Here is a Python function:\n\ndef area(width, height):\n    total = width * height\n    return total\n\n"
        "def perimeter(width, height):\n    total = 2 * (width + height)\n    return total\n\n"
        "Repeat both functions exactly, unchanged:\n\ndef area(width, height):\n")


def _run(runtime, spec, prompt, n, drafter=None, **req_kw):
    engine = _engine(runtime, spec, drafter)
    try:
        ids = runtime.model.tokenizer.encode(prompt)
        out = asyncio.run(_collect(engine, GenerationRequest("r", ids, req_kw.pop("params", GREEDY), n, **req_kw)))
        return out, engine.metrics.snapshot()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("spec", ["ngram", "suffix"])
def test_greedy_output_is_identical_with_drafts(runtime, spec):
    (text0, toks0, last0), _ = _run(runtime, "off", EDIT, 40)
    (text1, toks1, last1), m = _run(runtime, spec, EDIT, 40)
    assert toks1 == toks0 and text1 == text0
    assert (last1.reason, last1.completion_tokens) == (last0.reason, last0.completion_tokens)
    drafted, accepted = m["ember_spec_drafted_tokens_total"], m["ember_spec_accepted_tokens_total"]
    steps = m["ember_spec_verify_steps_total"]
    assert accepted > 0 and steps > 0
    print(f"{spec}: {len(toks1)} tokens, {steps:.0f} steps with drafts, {accepted:.0f}/{drafted:.0f} accepted")
    assert (accepted + steps) / steps > 1.5  # the copy is drafted: more than one token a step


def test_stop_strings_and_grammars_act_on_drafted_tokens_as_on_others(runtime):
    from ember.worker.engine.constraints import grammar_from_lark

    (text0, toks0, last0), _ = _run(runtime, "off", EDIT, 40, stop=["return"])
    (text1, toks1, last1), _ = _run(runtime, "ngram", EDIT, 40, stop=["return"])
    assert (text1, toks1, last1.stop_string) == (text0, toks0, last0.stop_string)
    assert last1.stop_string == "return"
    g = grammar_from_lark('start: "    total = width * height\\n    return " /[a-z]+/ "\\n"')
    (text0, toks0, _), _ = _run(runtime, "off", EDIT, 30, grammar=g)
    (text1, toks1, _), m = _run(runtime, "suffix", EDIT, 30, grammar=g)
    assert (text1, toks1) == (text0, toks0) and text1.startswith("    total = width * height")


@pytest.mark.parametrize("spec", ["suffix", "replay:1.0"])
def test_bench_spec_replays_sessions_against_real_workers(capsys, spec):
    """`ember bench spec` at CI scale: two real workers (spec off, then on), identical greedy output; with the
    replay drafter the measured run drafts its recorded first run, every draft standing."""
    import argparse

    from ember.worker.bench.spec import cmd_spec

    args = argparse.Namespace(model=None, backend="numpy", spec=spec, gen=16, lines=20, spec_k=4,
                              sessions=["json_again"], json=True)
    assert cmd_spec(args) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    s = report["sessions"]["json_again"]
    assert report["identical"] and s["identical"] and s["decode_tok_s_off"] and s["decode_tok_s_on"]
    assert s["drafted"] is not None and report["machine"]["cores"]
    if spec.startswith("replay"):
        assert s["drafted"] > 0 and s["acceptance"] == 1.0 and s["tokens_per_step"] > 1.5


def test_bench_spec_beside_llama_server(capsys, llama_server):
    """`ember bench spec --llama-server`: the same session against a real llama-server on the same (embedded)
    model, its speculation off and with ngram-mod, each run's decode speed and drafts from its stream, and
    ember's speed over llama-server's fastest speculative configuration."""
    import argparse
    import json

    from ember.worker.bench.spec import cmd_spec

    args = argparse.Namespace(model=None, backend="numpy", spec="suffix", gen=16, lines=20, spec_k=4,
                              sessions=["json_again"], json=True, llama_server=str(llama_server),
                              llama_spec=["ngram-mod"], llama_args="")
    assert cmd_spec(args) == 0
    report = json.loads(capsys.readouterr().out)
    llama = report["llama_server"]
    assert list(llama["configs"]) == ["none", "ngram-mod"] and llama["path"] == str(llama_server)
    off, on = llama["configs"]["none"]["json_again"], llama["configs"]["ngram-mod"]["json_again"]
    assert off["tokens"] == on["tokens"] == 16 and off["decode_tok_s"] and on["decode_tok_s"]
    assert off["drafted"] is None and 0 <= on["accepted"] <= on["drafted"]
    assert isinstance(on["identical"], bool) and off["identical"] and on["speedup"]
    s = report["sessions"]["json_again"]
    assert s["llama_best"] == "ngram-mod" and s["vs_llama_best"] == round(s["decode_tok_s_on"] / on["decode_tok_s"], 3)


@pytest.mark.parametrize("spec, error", [("ngram-mod", None), ("draft-simple:{model}", None), ("draft-mtp", None),
                                         ("draft-simple", "needs its draft GGUF"), ("ngram-mod:{model}", "takes no"),
                                         ("draft-simple:/nowhere.gguf", "is not a file"),
                                         ("lookahead", "is not a llama-server --spec-type")])
def test_bench_spec_llama_spec_flags(spec, error, default_model_path, capsys):
    import argparse

    from ember.worker.bench.spec import add_spec_parser, llama_spec_args

    parser = argparse.ArgumentParser(prog="ember bench")
    add_spec_parser(parser.add_subparsers())
    spec = spec.format(model=default_model_path)
    if error is None:
        assert parser.parse_args(["spec", "--llama-spec", spec]).llama_spec == [spec]
        kind, _, path = spec.partition(":")
        assert llama_spec_args(spec) == ["--spec-type", kind, *(["-md", path] if path else [])]
        return
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["spec", "--llama-spec", spec])
    assert e.value.code == 2 and error in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["spec", "--llama-server", "/nowhere/llama-server"])


@pytest.mark.parametrize("spec, error", [("suffix", None), ("mtp", None), ("draft:{model}", None),
                                         ("mtp:{model}", None), ("mtp:/nowhere/mtp-x.gguf", "is not a file"),
                                         ("replay:0.8", None), ("replay:1", None), ("replay:1.5", "between 0 and 1"),
                                         ("replay:lots", "between 0 and 1"),
                                         ("off", "is not a drafter"), ("beam", "is not a drafter"),
                                         ("draft:", "is not a drafter")])
def test_bench_spec_takes_every_drafter_the_worker_takes(spec, error, default_model_path, capsys):
    """`ember bench spec --spec`: the worker's drafters, PATH forms included (mtp:PATH, draft:PATH); a
    missing file or an unknown drafter is argparse's one-line usage error."""
    import argparse

    from ember.worker.bench.spec import add_spec_parser

    parser = argparse.ArgumentParser(prog="ember bench")
    add_spec_parser(parser.add_subparsers())
    spec = spec.format(model=default_model_path)
    if error is None:
        assert parser.parse_args(["spec", "--spec", spec]).spec == spec
        return
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["spec", "--spec", spec])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_a_draft_model_drafts_and_never_changes_the_output(runtime, default_model_path):
    """--spec draft:PATH with the model itself as its draft: every guess stands, the output is the same."""
    from ember.worker.backends.numpy.backend import NumpyBackend
    from ember.worker.engine.spec.draft_model import ModelDrafter, open_draft_model
    from ember.worker.model.weights import load_weights

    draft = open_draft_model(str(default_model_path), runtime.model)
    drafter = ModelDrafter(draft, NumpyBackend(draft.config, load_weights(draft.gguf, draft.config), n_blocks=64,
                                               block_size=16), n_blocks=64)
    prose = "Write a short essay about the history of lighthouses.\n\n"
    (text0, toks0, _), _ = _run(runtime, "off", prose, 24)
    (text1, toks1, _), m = _run(runtime, f"draft:{default_model_path}", prose, 24, drafter=drafter)
    assert toks1 == toks0 and text1 == text0
    assert m["ember_spec_accepted_tokens_total"] > 0
    assert m["ember_spec_accepted_tokens_total"] == m["ember_spec_drafted_tokens_total"]  # its own guesses
    assert sorted(drafter._free) == list(range(64))  # the finished sequence's draft cache is released


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(runtime, tmp_path):
    from ember.worker.bench.synth import make_model
    from ember.worker.engine.spec.draft_model import open_draft_model
    from ember.worker.model.gguf_file import ModelFileError

    other = make_model("llama", "tiny", tmp_path / "tiny.gguf")
    with pytest.raises(ModelFileError, match="vocabulary .* is not the model's") as e:
        open_draft_model(str(other), runtime.model)
    assert "\n" not in str(e.value)
    with pytest.raises(worker_config.ConfigError, match="is not a file"):
        worker_config.validate(worker_config.WorkerConfig(spec=f"draft:{tmp_path / 'missing.gguf'}"))


# -- a real worker: requests that end while queued leave the queue ---------------------------------------------


def test_requests_that_end_while_queued_settle_once_and_never_run(start_worker, default_model_path):
    """Issue 37: with --spec on, a request canceled while queued, and one whose grammar fails while
    queued, each log exactly one outcome, are never admitted after it, and have nothing decoded. One
    slot: a stream (completions, its end-of-text tokens banned) holds it while a chat request is
    canceled in the queue and a Responses request with a JSON format waits behind it, its grammar
    failing at once (the grammar threads die at their first call: fault thread-die:thread=mask)."""
    import json
    import socket
    import threading
    import time

    import httpx

    from ember.ops.contract import OUTCOMES
    from ember.worker.model.loader import open_model

    eot = open_model(str(default_model_path)).tokenizer.eot_ids
    w = start_worker("--spec", "suffix", "--max-seqs", "1", "--ctx", "1024", "--kv-mem", "64MiB", "--no-loop-guard",
                     "--fault", "thread-die:thread=mask")

    def raw(path: str, body: dict) -> socket.socket:  # a client that goes away when the test says
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", w.port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {w.api_key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def started() -> float:
        return w.metric_values().get("ember_requests_started_total", 0.0)

    def wait_for(what, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"timed out; log:\n{w.log_text()[-3000:]}"
            time.sleep(0.05)

    runner = raw("/v1/completions", {"model": "m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 900, "temperature": 0,
                                     "stream": True, "logit_bias": {str(t): -100 for t in eot}})
    w.wait_event("admit", protocol="completions")
    queued = raw("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 8, "temperature": 0})
    wait_for(lambda: started() >= 2)
    queued.close()  # canceled while the stream holds the one slot
    w.wait_event("canceled", protocol="chat")
    answer: list[httpx.Response] = []
    grammar = threading.Thread(target=lambda: answer.append(httpx.post(
        w.url + "/v1/responses", headers=w.headers(), timeout=120,
        json={"model": "m", "input": "Reply in JSON.", "max_output_tokens": 8, "temperature": 0,
              "text": {"format": {"type": "json_object"}}})))
    grammar.start()
    wait_for(lambda: started() >= 3)
    runner.close()  # the slot frees: the grammar request is next
    grammar.join(120)
    assert answer and answer[0].status_code == 500 and "died" in answer[0].text, answer
    wait_for(lambda: (lambda e: e["running"] == 0 and e["waiting"] == 0)(
        httpx.get(w.url + "/v1/stats", headers=w.headers(), timeout=5).json()["engine"]))
    time.sleep(0.5)  # a few more idle turns of the loop: a request left in a queue would show again

    log = [r for r in w.events() if r.get("protocol") in ("chat", "responses", "completions")]
    for protocol, outcome in (("chat", "canceled"), ("responses", "failed")):
        mine = [(i, r) for i, r in enumerate(log) if r.get("protocol") == protocol]
        ends = [(i, r) for i, r in mine if r["event"] in OUTCOMES]
        assert [r["event"] for _, r in ends] == [outcome], [r["event"] for _, r in mine]
        end, rec = ends[0]
        assert not [r for i, r in mine if r["event"] == "admit" and i > end], protocol
        assert rec["completion_tokens"] == 0
    (stream_end,) = [r for r in log if r["protocol"] == "completions" and r["event"] in OUTCOMES]
    assert stream_end["event"] == "canceled"
    # nothing was decoded but the stream's tokens
    assert w.metric_values()["ember_generated_tokens_total"] == stream_end["completion_tokens"]


# -- the replay drafter (a benchmark's: engine/spec/replay.py) ---------------------------------------------------


def test_replay_drafts_the_recorded_continuation_of_the_same_tokens():
    d = ReplayDrafter(1.0, vocab_size=1000)
    d.finished([1, 2, 3, 10, 11, 12, 13, 14], prompt_len=3)
    idx = d.new_index()
    idx.sync([1, 2, 3])
    assert d.propose(idx, 4) == ([10, 11, 12, 13], 3)
    idx.sync([1, 2, 3, 10, 11])
    assert d.propose(idx, 8) == ([12, 13, 14], 5)  # as far as the recording goes
    idx.sync([1, 2, 3, 10, 11, 12, 13, 14])
    assert d.propose(idx, 4) == ([], 0)  # past its end
    other = d.new_index()
    other.sync([1, 2, 4])
    assert d.propose(other, 4) == ([], 0)  # another prompt
    off = d.new_index()
    off.sync([1, 2, 3, 10, 99])  # left the recording (a sampled token): nothing more
    assert d.propose(off, 4) == ([], 0)
    d.finished([1, 2, 4, 20, 21], prompt_len=3)  # a recording made since: searched again
    assert d.propose(other, 4) == ([20, 21], 3)


def test_replay_keeps_each_drafted_token_with_the_acceptance_by_its_position():
    rec = list(range(5, 4005))
    for accept in (0.0, 0.5, 0.8, 1.0):
        d = ReplayDrafter(accept, vocab_size=5000, seed=3)
        d.finished(rec, prompt_len=1)
        idx = d.new_index()
        idx.sync(rec[:1])
        draft, _ = d.propose(idx, 3999)
        kept = np.mean([a == b for a, b in zip(draft, rec[1:], strict=True)])
        assert abs(kept - accept) < 0.03, (accept, kept)
        assert all(0 <= t < 5000 for t in draft)
        later = d.new_index()  # the same positions decide the same way, wherever a draft starts
        later.sync(rec[:100])
        assert d.propose(later, 50)[0] == draft[99:149]
    d = ReplayDrafter(0.8, vocab_size=50)
    d.finished([1, 2, 3] * 40, prompt_len=3)
    d.finished([1, 2, 3, 7, 7, 7], prompt_len=3)  # the same prompt again: replaces the first
    idx = d.new_index()
    idx.sync([1, 2, 3])
    assert len(d.propose(idx, 10)[0]) == 3
    for bad in ("replay:", "replay:-0.1", "replay:1.01", "replay:x"):
        with pytest.raises(ValueError, match="between 0 and 1"):
            parse_replay(bad)
    assert parse_replay("replay:0.5") == 0.5
    with pytest.raises(worker_config.ConfigError, match="between 0 and 1"):
        worker_config.validate(worker_config.WorkerConfig(spec="replay:2"))


def test_replayed_runs_draft_at_the_acceptance_and_never_change_the_output(runtime):
    """A run recorded, then replayed through the engine: every draft stands at 1.0, about half of the drafted
    tokens at 0.5, and the greedy output is the spec-off run's either way."""
    prompt = "Write a short essay about the history of lighthouses.\n\n"
    (text0, toks0, _), _ = _run(runtime, "off", prompt, 32)
    for accept in (1.0, 0.5):
        d = ReplayDrafter(accept, runtime.model.config.vocab_size)
        (text1, toks1, _), m1 = _run(runtime, f"replay:{accept}", prompt, 32, drafter=d)  # records
        assert m1["ember_spec_drafted_tokens_total"] == 0 and toks1 == toks0
        (text2, toks2, _), m2 = _run(runtime, f"replay:{accept}", prompt, 32, drafter=d)  # replays
        assert toks2 == toks0 and text2 == text0
        drafted, accepted = m2["ember_spec_drafted_tokens_total"], m2["ember_spec_accepted_tokens_total"]
        assert drafted > 0
        if accept == 1.0:
            assert accepted == drafted
        else:
            assert 0 < accepted < drafted
