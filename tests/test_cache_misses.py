"""Every miss explained (issue 43 item 2): when an admitted prompt gets less from the prefix cache than it
could have, its `admit` line says where the prompt stopped matching and why (engine/misses.py). Real
components: the engine over the numpy backend on a tiny synthetic qwen2 (byte-level BPE), with and
without a KV store; prompts are token ids where the test builds a miss by hand. The chat path (the
message a miss falls in, the user agent) and `ember cache report` run against a real worker in
tests/test_cache_report.py.
"""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest

from ember.ops.contract import ADMIT_MISS_FIELDS, Event, MissCause
from ember.worker import logs
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model
from ember.worker.engine.kv_blocks import chain_hash, kv_salt
from ember.worker.engine.limits import EngineLimits
from ember.worker.engine.loop import Engine
from ember.worker.engine.misses import Chain, RecentChains, anchored_windows, common_blocks
from ember.worker.engine.requests import Delta, Finished, GenerationRequest, RequestHandle, Started
from ember.worker.engine.sampling import SamplingParams
from ember.worker.engine.step_costs import PrefillCost
from ember.worker.kvstore.store import KVStore
from ember.worker.metrics import Metrics
from ember.worker.runtime import Runtime
from ember.worker.text.chat_template import message_starts

BS = 16


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "qwen2.gguf", seed=1)
    return Runtime.load(str(path), kv_tokens=2048)


@pytest.fixture
def admits():
    """The engine's admit lines, by request id (the worker's log stream, captured)."""
    buf = io.StringIO()
    logs.set_stream(buf)

    def read() -> dict[str, dict]:
        out = {}
        for line in buf.getvalue().splitlines():
            rec = json.loads(line)
            if rec["event"] == Event.ADMIT:
                out[rec["request_id"]] = rec
        return out

    try:
        yield read
    finally:
        logs.set_stream(None)


def _ids(seed: int, n: int, vocab: int = 700) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def _engine(runtime, store=None, n_blocks: int = 64) -> Engine:
    be = NumpyBackend(runtime.config, runtime.backend.weights, n_blocks=n_blocks, block_size=BS)
    e = Engine(runtime.model, be, EngineLimits(max_seqs=1, context=2048), metrics=Metrics(), store=store)
    # the restore policy is not under test (but where named): computing looks slow, so stored blocks come back
    e.restore_costs.prefill = PrefillCost(1.0, 1.0)
    e.start()
    return e


def _run(engine: Engine, prompt: list[int], rid: str, n: int = 2) -> tuple[Started, list[int]]:
    req = GenerationRequest(rid, list(prompt), SamplingParams(temperature=0), n)

    async def go():
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        return [e async for e in h.events()]

    events = asyncio.run(go())
    assert isinstance(events[-1], Finished), events[-1]
    return next(e for e in events if isinstance(e, Started)), [t for e in events if isinstance(e, Delta)
                                                               for t in e.tokens]


def _store(runtime, root, **kw) -> KVStore:
    be = runtime.backend
    return KVStore(root, salt=kv_salt(runtime.model.fingerprint, be.kv_layout), model_key=runtime.model.fingerprint,
                   block_shape=be.read_block(0).shape, block_tokens=BS, chain_hash=chain_hash,
                   disk_budget=1 << 30, host_budget=kw.pop("host_budget", 64 << 20), **kw)


def _no_miss(rec: dict) -> bool:
    return not set(ADMIT_MISS_FIELDS) & set(rec)


# -- lost: the cache had it once --------------------------------------------------------------------------


def test_a_prompt_evicted_from_the_device_says_so(runtime, admits):
    engine = _engine(runtime, n_blocks=24)
    try:
        prompt = _ids(1, 150)
        _run(engine, prompt, "first")
        for i in range(3):  # one-off work past the pool
            _run(engine, _ids(50 + i, 200), f"burst-{i}")
        started, _ = _run(engine, prompt, "again")  # the agent's retry: the same prompt
    finally:
        engine.shutdown()
    assert started.cached_tokens == 0
    rec = admits()["again"]
    assert rec["miss_cause"] == MissCause.EVICTED and rec["evicted_from"] == "device"
    assert rec["diverged_at"] == 0 and rec["could_have_cached"] == (150 - 1) // BS * BS
    assert rec["diverged_char"] == 0 and "diverged_message" not in rec  # token ids: no messages
    assert all(_no_miss(admits()[f"burst-{i}"]) for i in range(3)) and _no_miss(admits()["first"])


def test_blocks_the_writer_dropped_are_never_persisted_after_a_restart(runtime, tmp_path, admits):
    block_bytes = runtime.backend.read_block(0).nbytes
    prompt = _ids(2, 150)
    # a writer with room for one block, and a request that ends at its first step: the writer takes the chain's
    # head, and the rest, owed when the sequence ends, is given up (with more steps it would have been offered
    # again until the writer had room)
    store = _store(runtime, tmp_path, host_budget=block_bytes)
    engine = _engine(runtime, store)
    try:
        _run(engine, prompt, "first", n=1)
    finally:
        engine.shutdown()
        store.close()
    store = _store(runtime, tmp_path)  # a restarted worker: the disk and the block history only
    engine = _engine(runtime, store)
    try:
        store.scan_done.wait(10)
        started, _ = _run(engine, prompt, "after-restart")
    finally:
        engine.shutdown()
        store.close()
    assert started.cached_tokens == BS  # the one block written came back
    rec = admits()["after-restart"]
    assert rec["miss_cause"] == MissCause.NEVER_PERSISTED and "evicted_from" not in rec
    assert rec["diverged_at"] == BS and rec["could_have_cached"] == (150 - 1) // BS * BS


def test_a_restore_the_policy_declined_is_named(runtime, tmp_path, admits):
    prompt = _ids(3, 100)
    store = _store(runtime, tmp_path)
    try:
        engine = _engine(runtime, store)
        try:
            _run(engine, prompt, "first")
            assert store.flush()
        finally:
            engine.shutdown()
        engine = _engine(runtime, store)  # an empty device over the same store
        engine.restore_costs.prefill = PrefillCost(0.0, 1e-9)  # computing measured far faster than reading
        engine.restore_costs.bandwidth = {"host": 1.0, "disk": 1.0}
        try:
            started, _ = _run(engine, prompt, "declined")
        finally:
            engine.shutdown()
    finally:
        store.close()
    assert started.cached_tokens == 0
    rec = admits()["declined"]
    assert rec["miss_cause"] == MissCause.RESTORE_DECLINED and rec["could_have_cached"] == (100 - 1) // BS * BS


# -- diverged: the text changed, or only its tokens -----------------------------------------------------------


def test_an_early_change_is_told_and_a_new_conversation_is_not(runtime, admits):
    """An agent rewrites a line early in its prompt (its git status) and sends the rest again: the
    admission names the block where it diverged. A new conversation on the same system prompt is no miss."""
    engine = _engine(runtime)
    try:
        system, body = _ids(4, 96), _ids(5, 200)
        first = system + body
        _, out = _run(engine, first, "turn-1")
        changed = list(first)
        changed[40] = (changed[40] + 1) % 700 + 10  # token 40: inside block 2
        _run(engine, changed + out + _ids(6, 30), "turn-2")
        _run(engine, system + _ids(7, 200), "other-conversation")
    finally:
        engine.shutdown()
    rec = admits()["turn-2"]
    assert rec["miss_cause"] == MissCause.CHANGED_TEXT and rec["diverged_at"] == 32
    assert rec["cached_tokens"] == 32 and rec["could_have_cached"] == (296 + 2 - 1) // BS * BS
    assert _no_miss(admits()["other-conversation"]) and admits()["other-conversation"]["cached_tokens"] == 96


def _split_first_multibyte(tok, out: list[int], limit: int) -> tuple[list[int], int]:
    """`out` with its first token of several bytes (before index `limit`) spelt byte by byte: the same
    text, other tokens; and that token's index."""
    single = {tok.token_piece(i): i for i in range(tok.vocab_size) if len(tok.token_piece(i)) == 1
              and not tok.is_special(i)}
    for j, t in enumerate(out[:limit]):
        piece = tok.token_piece(t)
        if len(piece) > 1 and not tok.is_special(t):
            return out[:j] + [single[piece[i:i + 1]] for i in range(len(piece))] + out[j + 1:], j
    raise AssertionError("no multi-byte token in the output")


def test_the_previous_answer_tokenized_afresh_is_a_tokenization_miss(runtime, admits):
    tok = runtime.model.tokenizer
    engine = _engine(runtime)
    try:
        prompt = _ids(8, 100)
        _, out = _run(engine, prompt, "answer", n=40)
        # the chain covers the full blocks computed: prompt and answer but its last token (139 tokens)
        respelt, j = _split_first_multibyte(tok, out, 128 - len(prompt))
        assert tok.decode_bytes(respelt, skip_special=False) == tok.decode_bytes(out, skip_special=False)
        _run(engine, prompt + respelt + _ids(9, 20), "next-turn")
        prompt2 = _ids(10, 100)
        _, out2 = _run(engine, prompt2, "answer-2", n=40)
        edited = list(out2)
        edited[3] = (edited[3] + 1) % 700 + 10  # another token: another text
        _run(engine, prompt2 + edited + _ids(11, 20), "next-turn-2")
    finally:
        engine.shutdown()
    rec = admits()["next-turn"]
    assert rec["miss_cause"] == MissCause.TOKENIZATION and rec["diverged_at"] == (100 + j) // BS * BS
    rec = admits()["next-turn-2"]
    assert rec["miss_cause"] == MissCause.CHANGED_TEXT and rec["diverged_at"] == (100 + 3) // BS * BS


# -- the parts -------------------------------------------------------------------------------------------------


def test_recent_chains_are_bounded_and_find_the_most_similar():
    def chain(blocks: list[int]) -> Chain:
        return Chain(b"".join(b.to_bytes(16, "little") for b in blocks), 1, np.zeros(0, np.int32),
                     np.zeros(0, np.uint64), ())

    recent = RecentChains(max_chains=3)
    recent.add(chain([1, 2, 3]))
    recent.add(chain([1, 2, 3, 4]))  # the same sequence, further on: the shorter one goes
    assert len(recent) == 1
    recent.add(chain([1, 2, 9]))
    recent.add(chain([5, 6]))
    best, n = recent.most_similar(chain([1, 2, 3, 4, 5]).hashes)
    assert n == 4 and best is not None and best.blocks == 4
    recent.add(chain([7]))  # past three: the oldest goes
    assert recent.most_similar(chain([1, 2, 3]).hashes)[1] == 2
    assert common_blocks(chain([1, 2]).hashes, chain([3]).hashes) == 0


def test_anchored_windows_find_shifted_content():
    rng = np.random.default_rng(0)
    body = rng.integers(0, 1000, 2000)
    shifted = np.concatenate([rng.integers(0, 1000, 37), body])  # the same content, 37 tokens on
    (p1, f1), (p2, f2) = anchored_windows(body), anchored_windows(shifted)
    assert len(f1) > 50 and np.isin(f1, f2).mean() > 0.95
    assert set((p2[np.isin(f2, f1)] - 37).tolist()) <= set(p1.tolist())
    assert np.isin(f1, anchored_windows(rng.integers(0, 1000, 2000))[1]).mean() < 0.05


def test_message_starts_name_each_messages_content():
    msgs = [{"role": "system", "content": "You are terse.  "}, {"role": "user", "content": [{"type": "text",
            "text": "list files"}]}, {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]
    text = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nlist files<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>ls</tool_call><|im_end|>\n<|im_start|>user\nok<|im_end|>\n")
    starts = message_starts(text, msgs)
    assert [text[s:s + 4] for s in starts] == ["You ", "list", "<|im", "ok<|"]
    assert starts[2] == starts[1] + len("list files")  # a message not found starts where the last one ended


def test_piece_chars_count_characters_across_tokens(runtime):
    tok = runtime.model.tokenizer
    text = "naïve café — ünïcödé"
    ids = tok.encode(text, add_special=False)
    assert int(tok.piece_chars()[np.asarray(ids)].sum()) == len(text)
