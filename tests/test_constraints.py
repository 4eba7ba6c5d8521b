"""Grammar-constrained decoding, the reasoning budget and the loop guard, in the real engine.

Everything runs the embedded Gemma 3 270M on the numpy backend. Where a test needs the model to
do something specific (want to stop at once, or think in a scripted way), `Steered` wraps the real
backend and rewrites the logits it returns; KV, batching and the scheduler stay real.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from ember.worker import logs
from ember.worker.backends.base import Backend
from ember.worker.engine.constraints import (
    ConstraintError,
    Constraints,
    GrammarError,
    grammar_from_json_schema,
    grammar_from_lark,
)
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
from ember.worker.engine.sampling import Sampler, SamplingParams
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runtime(default_model_path):
    return Runtime.load(str(default_model_path), kv_tokens=4096)


@pytest.fixture(scope="module")
def tok(runtime):
    return runtime.model.tokenizer


@pytest.fixture
def log_lines():
    """The worker's JSON log lines written during the test."""
    buf = _Lines()
    logs.set_stream(buf)
    yield buf
    logs.set_stream(None)


class _Lines(io.TextIOBase):
    def __init__(self):
        self._parts, self._lock = [], threading.Lock()

    def write(self, s):
        with self._lock:
            self._parts.append(s)
        return len(s)

    def events(self, name):
        with self._lock:
            text = "".join(self._parts)
        return [r for r in map(json.loads, text.splitlines()) if r["event"] == name]


class Steered(Backend):
    """The real numpy backend, with each returned logits row rewritten by `steer(generated_index,
    logits)` (generated_index: which output token the row is for, counted from 0)."""

    def __init__(self, inner, prompt_len: int, steer):
        self.inner, self.prompt_len, self.steer = inner, prompt_len, steer
        self.name, self.config, self.kv_layout, self.block_dtype = inner.name, inner.config, inner.kv_layout, \
            inner.block_dtype
        self.block_size, self.n_blocks = inner.block_size, inner.n_blocks

    def forward(self, chunks):
        outs = self.inner.forward(chunks)
        for c, out in zip(chunks, outs, strict=True):
            if out is not None:
                index = c.start + len(c.tokens) - self.prompt_len
                if index >= 0:
                    self.steer(index, out[-1])
        return outs

    def read_block(self, block):
        return self.inner.read_block(block)

    def write_block(self, block, data):
        self.inner.write_block(block, data)

    def save_blocks(self, blocks):
        return self.inner.save_blocks(blocks)

    def load_blocks(self, blocks, payloads):
        self.inner.load_blocks(blocks, payloads)


def scripted(script: list[int]):
    """A steer that makes the model emit `script`, then whatever it likes."""

    def steer(i, row):
        if i < len(script):
            row[:] = -np.inf
            row[script[i]] = 0.0

    return steer


def _engine(runtime, backend=None, n_blocks=None, **limits):
    from ember.worker.backends.numpy.backend import NumpyBackend

    be = backend or runtime.backend
    if n_blocks is not None:
        be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=n_blocks, block_size=be.block_size)
    e = Engine(runtime.model, be, EngineLimits(**{"max_seqs": 4, "context": 4096, **limits}), metrics=Metrics())
    e.start()
    return e


def _req(tok, prompt, n=64, rid="r", params=GREEDY, **kw):
    return GenerationRequest(rid, tok.encode(prompt), params, n, **kw)


async def _collect(engine, req):
    h = RequestHandle(req, asyncio.get_running_loop())
    engine.submit(h)
    text, tokens, last = "", [], None
    async for e in h.events():
        if isinstance(e, Delta):
            text += e.text
            tokens += e.tokens
        last = e
    return text, tokens, last


def _run_all(engine, reqs):
    async def together():
        return await asyncio.gather(*[_collect(engine, r) for r in reqs])

    return asyncio.run(together())


# -- the sampler under a mask --------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.5, seed=1),
    SamplingParams(temperature=1.0, top_k=40, seed=2),
    SamplingParams(temperature=1.0, top_p=0.5, seed=3),
    SamplingParams(temperature=1.0, min_p=0.2, seed=4),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=-2.0, frequency_penalty=-2.0, seed=5),
], ids=["greedy", "temperature", "top_k", "top_p", "min_p", "penalties"])
def test_sampler_never_picks_a_masked_token(params):
    rng = np.random.default_rng(0)
    vocab = 5000
    for _trial in range(50):
        logits = rng.normal(size=vocab).astype(np.float32)
        allowed = rng.choice(vocab, size=rng.integers(1, 20), replace=False)
        bias = np.full(vocab, -np.inf, np.float32)
        bias[allowed] = 0.0
        logits[rng.choice(vocab, 30)] += 50.0  # the model prefers forbidden tokens
        history = rng.choice(vocab, 64).tolist()  # penalties (negative here: they boost) see forbidden tokens
        sampler = Sampler(params)
        assert sampler.sample(logits, history, bias) in set(allowed.tolist())


# -- the constraint itself -------------------------------------------------------------------------------


def test_eos_is_allowed_only_where_the_grammar_accepts(tok):
    c = Constraints(tok, tok.vocab_size)
    sc = c.compile(grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]})).result()
    eot = sorted(tok.eot_ids)
    ids = tok.encode('{"a": 12', add_special=False)
    for t in ids:
        assert np.all(np.isneginf(sc.bias()[eot]))
        sc.consume(t)
    assert not sc.stopped
    sc.consume(tok.encode("}", add_special=False)[0])
    assert np.all(sc.bias()[eot] == 0.0) and sc.stopped
    assert sc.bias().sum() == -np.inf and np.count_nonzero(sc.bias() == 0) == len(eot)
    c.shutdown()


def test_special_tokens_never_spell_grammar_text(tok):
    """A control token renders as nothing in the stream, so the grammar must never allow one as text."""
    c = Constraints(tok, tok.vocab_size)
    sc = c.compile(grammar_from_lark('start: /[a-z<>_]*/ "!"')).result()
    allowed = np.flatnonzero(sc.bias() == 0)
    assert allowed.size > 100
    assert not any(tok.is_special(int(i)) for i in allowed)
    with pytest.raises(ConstraintError):
        sc.consume(tok.id_of("<start_of_turn>"))
    c.shutdown()


def test_a_bad_grammar_is_a_grammar_error(tok):
    c = Constraints(tok, tok.vocab_size)
    with pytest.raises(GrammarError, match="grammar is not valid"):
        c.compile("start: foo(").result()
    c.shutdown()


# -- the engine with a grammar ----------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 2, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9},
                                                         {"const": "big"}]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 60},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["temp", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}, "ok": {"type": "boolean"}},
     "required": ["point", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
]
SAMPLING = [GREEDY, SamplingParams(temperature=1.0, seed=7),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=8)]


def test_constrained_outputs_parse_and_validate(runtime, tok):
    engine = _engine(runtime)
    try:
        reqs, cases = [], []
        for i, schema in enumerate(SCHEMAS):
            for j, params in enumerate(SAMPLING):
                if (i + j) % 2:  # half the grid keeps the run short; every schema and sampler still appear
                    continue
                # flexible whitespace only under greedy: a sampled base model may pad JSON at length
                g = grammar_from_json_schema(schema, whitespace_flexible=(j == 0 and i % 2 == 0))
                reqs.append(_req(tok, "Here is the JSON:\n", n=96, rid=f"s{i}-{j}", params=params, grammar=g))
                cases.append(schema)
        for (text, _tokens, last), schema in zip(_run_all(engine, reqs), cases, strict=True):
            assert isinstance(last, Finished) and last.reason is FinishReason.STOP, (text, last)
            jsonschema.validate(json.loads(text), schema)
    finally:
        engine.shutdown()


def test_without_the_grammar_the_same_requests_do_not_validate(runtime, tok):
    """The test above can fail: the unconstrained model does not write this JSON by itself."""
    engine = _engine(runtime)
    try:
        text, _, _ = asyncio.run(_collect(engine, _req(tok, "Here is the JSON:\n", n=24)))
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(text), SCHEMAS[0])
    finally:
        engine.shutdown()


def test_eos_is_masked_until_the_grammar_accepts(runtime, tok):
    """A model that wants to stop at once must go on until the grammar accepts, then may stop."""
    eot = sorted(tok.eot_ids)
    prompt = "Word: "

    def eager_to_stop(i, row):
        row[eot] += 100.0

    engine = _engine(runtime, backend=Steered(runtime.backend, len(tok.encode(prompt)), eager_to_stop))
    try:
        text, tokens, last = asyncio.run(_collect(engine, _req(tok, prompt, n=20)))
        assert tokens == [] and last.reason is FinishReason.STOP  # unconstrained: stops at once
        g = grammar_from_lark("start: /[a-z]{3,}/")
        text, tokens, last = asyncio.run(_collect(engine, _req(tok, prompt, n=20, grammar=g)))
        assert re.fullmatch("[a-z]{3,}", text), text
        assert last.reason is FinishReason.STOP and last.completion_tokens == len(tokens)
        before_last = tok.decode(tokens[:-1])
        assert len(before_last) < 3  # it stopped at the first token that made the grammar accept
    finally:
        engine.shutdown()


def test_grammar_completion_ends_the_generation(runtime, tok):
    """ignore_eos: only the matcher's stop can end this before max_tokens."""
    engine = _engine(runtime)
    try:
        g = grammar_from_lark('start: "The answer is " ("yes" | "no") "."')
        text, tokens, last = asyncio.run(_collect(engine, _req(tok, "Question: is it? ", n=50, grammar=g,
                                                               ignore_eos=True)))
        assert text in ("The answer is yes.", "The answer is no.")
        assert last.reason is FinishReason.STOP and last.completion_tokens == len(tokens) < 50
    finally:
        engine.shutdown()


def test_a_bad_grammar_fails_the_request_cleanly(runtime, tok, log_lines):
    engine = _engine(runtime)
    try:
        _, tokens, last = asyncio.run(_collect(engine, _req(tok, "Hi", rid="bad", grammar="start: foo(")))
        assert isinstance(last, Failed) and last.status == 400 and last.kind == "invalid_grammar"
        assert "grammar is not valid" in last.message and "Traceback" not in last.message and tokens == []
        text, _, after = asyncio.run(_collect(engine, _req(tok, "Hi", n=4, rid="good")))
        assert isinstance(after, Finished)  # the engine goes on serving
        failed = log_lines.events("failed")
        assert [f["request_id"] for f in failed] == ["bad"] and "grammar" in failed[0]["error"]
    finally:
        engine.shutdown()


def test_preemption_keeps_the_matcher_in_step(runtime, tok, log_lines):
    """Sequences preempted mid-generation resume without re-feeding their matcher: outputs equal
    the unpreempted ones and still validate."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 4, "maxItems": 4,
                                                         "items": {"type": "string", "minLength": 5, "maxLength": 8}}},
              "required": ["items"], "additionalProperties": False}
    g = grammar_from_json_schema(schema, whitespace_flexible=False)
    prompts = ["A shopping list as JSON:\n", "Some animals as JSON:\n", "Three colours as JSON:\n"]
    reqs = [_req(tok, p, n=60, rid=f"p{i}", grammar=g) for i, p in enumerate(prompts)]
    ref_engine = _engine(runtime)
    small = _engine(runtime, n_blocks=7, max_seqs=3)  # 112 tokens: two of three sequences of about 40 fit
    try:
        ref = _run_all(ref_engine, reqs)  # batched equals solo (test_scheduler), and is quicker here
        got = _run_all(small, reqs)
        assert [r[0] for r in got] == [r[0] for r in ref]
        for text, _, last in got:
            assert last.reason is FinishReason.STOP
            jsonschema.validate(json.loads(text), schema)
        assert log_lines.events("preempt")
    finally:
        ref_engine.shutdown()
        small.shutdown()


# -- the reasoning budget ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_tracker_bounds_the_whole_generation(seed):
    """A model that opens blocks at random and never closes them: the first block closes after
    exactly `budget` tokens, and every later one at once (the budget is per generation)."""
    from ember.worker.engine.reasoning_budget import ReasoningTracker

    rng = np.random.default_rng(seed)
    start, end, budget = [1, 2], [3, 4, 5], int(rng.integers(0, 12))
    tr = ReasoningTracker(ReasoningBudget(start=start, end=end, budget=budget, starts_inside=bool(seed % 2)))
    out = []
    for _ in range(400):
        forced = tr.forced_token()
        emit = [forced] if forced is not None else start if rng.random() < 0.05 else [int(rng.integers(10, 20))]
        for t in emit:
            tr.feed(t)
            out.append(t)
    blocks = _blocks(out, start, end, bool(seed % 2))
    assert blocks and blocks[0] == budget + len(end)
    assert all(n == len(end) for n in blocks[1:])


def _blocks(out, start, end, inside):
    """Tokens in each reasoning block of `out`, end marker included."""
    blocks, i = [], 0
    while i < len(out):
        if not inside and out[i : i + len(start)] == start:
            inside, i = True, i + len(start)
            blocks.append(0)
            continue
        if inside:
            if not blocks:
                blocks.append(0)
            blocks[-1] += 1
            if out[i - len(end) + 1 : i + 1] == end:
                inside = False
        i += 1
    return [b for b in blocks if b]


def _markers(tok):
    start, end = tok.encode("<think>", add_special=False), tok.encode("</think>", add_special=False)
    assert len(end) >= 2  # the partial-marker test needs a multi-token marker
    return start, end


def _words(tok, n, seed=0):
    rng = np.random.default_rng(seed)
    pool = [tok.encode(w, add_special=False)[0] for w in (" alpha", " beta", " gamma", " delta", " omega")]
    return rng.choice(pool, n).tolist()


def _reasoning_run(runtime, tok, script, budget, starts_inside=True, n=30, grammar=None):
    """Generate `n` tokens (end of sequence ignored) from a model steered through `script`."""
    prompt = "Think first. "
    start, end = _markers(tok)
    engine = _engine(runtime, backend=Steered(runtime.backend, len(tok.encode(prompt)), scripted(script)))
    try:
        rb = ReasoningBudget(start=start, end=end, budget=budget, starts_inside=starts_inside)
        return asyncio.run(_collect(engine, _req(tok, prompt, n=n, reasoning=rb, grammar=grammar, ignore_eos=True)))
    finally:
        engine.shutdown()


def test_budget_spent_forces_the_end_marker(runtime, tok, log_lines):
    _, end = _markers(tok)
    thinking = _words(tok, 40)  # a model that would think for ever
    text, tokens, last = _reasoning_run(runtime, tok, thinking, budget=6)
    assert tokens[:6] == thinking[:6]
    assert tokens[6 : 6 + len(end)] == end  # emitted by the engine, as if sampled
    assert "</think>" in text and len(tokens) == 30 and last.reason is FinishReason.LENGTH
    assert [e["budget"] for e in log_lines.events("reasoning_budget")] == [6]


def test_a_block_closed_within_budget_is_left_alone(runtime, tok, log_lines):
    _, end = _markers(tok)
    script = _words(tok, 4) + end + _words(tok, 10, seed=1)
    _, tokens, _ = _reasoning_run(runtime, tok, script, budget=20)
    assert tokens[: len(script)] == script
    assert not log_lines.events("reasoning_budget")


def test_a_marker_begun_at_the_limit_is_only_completed(runtime, tok):
    _, end = _markers(tok)
    script = _words(tok, 5) + end[:1] + _words(tok, 30, seed=2)  # starts the marker as the budget runs out
    _, tokens, _ = _reasoning_run(runtime, tok, script, budget=6)
    assert tokens[:6] == script[:6]
    assert tokens[6 : 6 + len(end) - 1] == end[1:]  # no doubled prefix
    assert tok.decode(tokens).count("</think>") == 1


def test_counting_starts_at_the_start_marker(runtime, tok):
    start, end = _markers(tok)
    answer_first = _words(tok, 5, seed=3)
    script = answer_first + start + _words(tok, 40, seed=4)
    _, tokens, _ = _reasoning_run(runtime, tok, script, budget=4, starts_inside=False, n=40)
    k = len(answer_first) + len(start) + 4
    assert tokens[:k] == script[:k] and tokens[k : k + len(end)] == end


def test_the_forced_end_marker_goes_through_the_grammar(runtime, tok):
    """The grammar covers the reasoning block too; the forced marker must satisfy it, and it does."""
    g = grammar_from_lark('start: /[a-z ]+/ "</think>" "\\nDONE"')
    text, tokens, last = _reasoning_run(runtime, tok, _words(tok, 3), budget=3, grammar=g)
    assert re.fullmatch(r"[a-z ]+</think>\nDONE", text), text
    assert last.reason is FinishReason.STOP


def test_a_budget_spent_inside_a_character_closes_the_block_after_it(runtime, tok):
    """A grammar's text is whole characters: the budget running out on the first byte of one holds the
    marker back until the character's last byte, then closes the block (it failed the request before)."""
    euro = [tok.id_of(f"<0x{b:02X}>") for b in "€".encode()]
    words = _words(tok, 2)
    g = grammar_from_lark('start: think "\\nDONE"\nthink[stop="</think>"]: /(.|\\n)*/')
    text, tokens, last = _reasoning_run(runtime, tok, words + euro, budget=3, grammar=g)
    assert tokens[:5] == words + euro and "€</think>" in text, text
    assert text.endswith("</think>\nDONE") and last.reason is FinishReason.STOP


def test_a_grammar_that_refuses_the_end_marker_fails_that_request_alone(runtime, tok):
    prompt = "Think first. "
    start, end = _markers(tok)
    steered = Steered(runtime.backend, len(tok.encode(prompt)), scripted(_words(tok, 3)))
    engine = _engine(runtime, backend=steered)
    try:
        rb = ReasoningBudget(start=start, end=end, budget=3, starts_inside=True)
        refusing = _req(tok, prompt, n=20, rid="refuses", reasoning=rb, grammar=grammar_from_lark("start: /[a-z ]+/"),
                        ignore_eos=True)
        bystander = _req(tok, prompt, n=20, rid="bystander", reasoning=rb, ignore_eos=True)
        (_, tokens, last), (_, other, other_last) = _run_all(engine, [refusing, bystander])
        assert isinstance(last, Failed) and "end marker is not allowed by the grammar" in last.message
        assert len(tokens) == 3  # the refused marker never reached the client
        assert isinstance(other_last, Finished) and other[3 : 3 + len(end)] == end and len(other) == 20
    finally:
        engine.shutdown()


def test_reasoning_budget_on_the_real_model(runtime, tok):
    """No steering: whatever the model thinks, the block closes after exactly `budget` tokens."""
    start, end = _markers(tok)
    engine = _engine(runtime)
    try:
        rb = ReasoningBudget(start=start, end=end, budget=5, starts_inside=True)
        text, tokens, last = asyncio.run(_collect(engine, _req(tok, "Let me think step by step.", n=14,
                                                               reasoning=rb, ignore_eos=True)))
        assert tokens[5 : 5 + len(end)] == end and "</think>" in text
        assert len(tokens) == 14  # and the answer follows
    finally:
        engine.shutdown()


# -- the loop guard ---------------------------------------------------------------------------------------


def test_loop_guard_ends_a_looping_generation(runtime, tok, log_lines):
    loop = tok.encode(" and then the cat sat down", add_special=False)  # repeated for ever
    period = len(loop)
    assert len(set(loop)) == period  # distinct tokens: the loop's period is its length

    def looping(i, row):
        row[:] = -np.inf
        row[loop[i % len(loop)]] = 0.0

    prompt = "Story:"
    backend = Steered(runtime.backend, len(tok.encode(prompt)), looping)
    guarded = _engine(runtime, backend=backend, loop_guard_repeats=4, loop_guard_min_span=30)
    unguarded = _engine(runtime, backend=backend, loop_guard=False)
    try:
        _, tokens, last = asyncio.run(_collect(guarded, _req(tok, prompt, n=200, rid="looper")))
        copies = max(4, -(-30 // period))  # at least 4 copies spanning at least 30 tokens
        assert last.reason is FinishReason.LENGTH and len(tokens) == copies * period
        (line,) = log_lines.events("loop_guard")
        assert line["request_id"] == "looper" and line["period"] == period and line["repeats"] == copies
        assert not {"text", "tokens"} & line.keys()
        _, tokens, last = asyncio.run(_collect(unguarded, _req(tok, prompt, n=60)))
        assert len(tokens) == 60  # the same stream runs to max_tokens without it
    finally:
        guarded.shutdown()
        unguarded.shutdown()


def test_default_loop_guard_leaves_ordinary_text_alone(runtime, tok, log_lines):
    engine = _engine(runtime)  # defaults: on, 8 repeats over at least 128 tokens
    try:
        _, tokens, last = asyncio.run(_collect(engine, _req(tok, "The history of the printing press", n=60)))
        assert len(tokens) == 60 and not log_lines.events("loop_guard")
    finally:
        engine.shutdown()
