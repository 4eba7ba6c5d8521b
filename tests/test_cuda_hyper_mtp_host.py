"""DeepSeek V4's next-token (MTP) layer on the CUDA step (worker/backends/cuda/hyper_mtp.py), run on the CPU:
its launchers computed in numpy (tests/cuda_emulator.py), held to the numpy twin (backends/numpy/mtp.py) on
the tiny file, which carries the layer as llama.cpp's loader reads it. With every step the layer's rows (each
position's h and its key row) go into the pool as the twin writes them, in prefill chunks, in decode steps
replayed as graphs and for a sequence's first position; a draft gives the twin's guesses from them. The GPU
runs the same in tests/test_cuda_deepseek4_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import EmuDevice, EmuGraph, EmuOps, EmuStream

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.hyper import HyperStack
from ember.worker.bench.synth import make_model
from ember.worker.model.loader import open_model

BS, N_BLOCKS = 16, 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = open_model(make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf", seed=1))
    assert m.config.hyper is not None and m.config.hyper.nextn_layers == 1
    return m


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    from ember.worker.backends.numpy.backend import NumpyBackend
    from ember.worker.model.weights import load_weights

    with pytest.MonkeyPatch.context() as mp:  # the dequantized weights' cache: the test's own
        mp.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        weights = load_weights(model.gguf, model.config)
    return lambda: NumpyBackend(model.config, weights, n_blocks=N_BLOCKS, block_size=BS, mtp=True)


@pytest.fixture(params=[False, True], ids=["matvec", "tensor-cores"])
def emulated(model, monkeypatch, request):
    """A HyperStep with the layer, over the weights as upload_hyper_weights and upload_mtp_weights put them on
    an emulated device."""
    from ember.worker.backends.cuda import hyper_mtp, hyper_step
    from ember.worker.backends.cuda import matmul as mm_mod
    from ember.worker.backends.cuda.hyper_mtp import upload_mtp_weights
    from ember.worker.backends.cuda.hyper_weights import upload_hyper_weights

    emu = EmuOps()
    for mod in (hyper_step, hyper_mtp, mm_mod):
        monkeypatch.setattr(mod, "ops", emu)
    monkeypatch.setattr(hyper_step.HyperStep, "_capture", lambda self, forward: EmuGraph(forward))
    cfg, dev = model.config, EmuDevice()
    pool = dev.empty(((N_BLOCKS + 1) * BS * HyperStack.width(cfg, BS, mtp=True),))
    pool.zero()
    w = upload_hyper_weights(dev, model.gguf, cfg)
    step = hyper_step.HyperStep(dev, EmuStream(), cfg, w, pool, n_blocks=N_BLOCKS, block_size=BS, max_rows=160,
                                tensor_cores=request.param, mtp=upload_mtp_weights(dev, model.gguf, None, cfg, w))
    return step, request.param


def _rows(step, ref, table: list[int], positions) -> tuple[dict, dict]:
    """The layer's pool columns (h, kv) at a sequence's positions: (the step's, the twin's)."""
    cols = step.columns[step.config.n_layers]
    p = np.asarray(positions)
    slots = np.asarray(table)[p // BS] * BS + p % BS
    mine = step.pool.a.reshape(-1, step.width)[slots]
    theirs = ref.hyper.pool.reshape(-1, step.width)[slots]
    return ({k: mine[:, cols[k]] for k in ("h", "kv")}, {k: theirs[:, cols[k]] for k in ("h", "kv")})


def _close(got: np.ndarray, want: np.ndarray, tensor_cores: bool) -> None:
    """To float32 rounding through the matvecs. Through the tensor cores' 16-bit inputs, row by row
    correlated to 0.98, and 0.99 for 95% of them (a 16-bit rounding may flip a near-tied router's expert
    in one of the trunk's layers; a wrong row correlates near 0)."""
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    if not tensor_cores:
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        return
    corr = np.array([np.corrcoef(g, w)[0, 1]
                     for g, w in zip(got.reshape(len(got), -1), want.reshape(len(want), -1), strict=True)])
    assert corr.min() >= 0.98 and np.mean(corr >= 0.99) >= 0.95, np.sort(corr)[:8]


def test_prefill_writes_the_twins_rows_and_drafts_its_guesses(emulated, reference):
    """200 positions in chunks of 64 over scattered blocks: every position's h and key row as the twin's
    (position 0's key row from zeros, a chunk's first from the pool's h before it); then a draft of 4 from
    the last position: the twin's guesses, each the argmax of logits close to the twin's."""
    step, tc = emulated
    ref = reference()
    tokens = np.random.default_rng(3).integers(0, 700, 200).astype(np.int32)
    table = np.random.default_rng(4).permutation(N_BLOCKS)[:13].tolist()
    for at in range(0, 199, 64):  # the last token is left for the draft, as the scheduler leaves it
        part = tokens[at : min(at + 64, 199)]
        ref.forward([SeqChunk(part, at, table, "last")])
        step.run([SeqChunk(part, at, table, "last")])
    mine, theirs = _rows(step, ref, table, range(199))
    for k in ("h", "kv"):
        _close(mine[k], theirs[k], tc)
    assert step.mtp is not None and ref.mtp is not None
    guesses, logits = step.mtp.chain(table, int(tokens[199]), 199, 4)
    want_guesses, want_logits = ref.mtp.chain(table, int(tokens[199]), 199, 4)
    same = next((i + 1 for i in range(4) if guesses[i] != want_guesses[i]), 4)  # a different guess: its own chain on
    assert same >= 2 or tc
    _close(logits[:same], want_logits[:same], tc)
    for i in range(same):
        top2 = np.sort(want_logits[i])[-2:]
        if not tc or top2[1] - top2[0] >= 0.5:
            assert guesses[i] == want_guesses[i], (i, guesses, want_guesses)
    assert step.mtp.draft(table, int(tokens[199]), 199, 2) == guesses[:2]  # a draft leaves the pool as it was
    mine_after, _ = _rows(step, ref, table, range(199))
    np.testing.assert_array_equal(mine_after["kv"], mine["kv"])


def test_decode_steps_in_graphs_write_the_twins_rows(emulated, reference):
    """Three rows a step at a padded shape of 4 (eager, captured, replayed): two sequences decoding, and a third
    row from two more taking turns, each a one-token prompt at position 0 first (the captured step has one),
    then its next token: each step's rows are the twin's."""
    step, tc = emulated
    ref = reference()
    rng = np.random.default_rng(11)
    seqs = [(20, list(range(0, 3))), (60, list(range(3, 8)))]
    last, lengths = [], []
    for n, table in seqs:
        prompt = rng.integers(0, 700, n).astype(np.int32)
        (want,) = ref.forward([SeqChunk(prompt, 0, table, "last")])
        step.run([SeqChunk(prompt, 0, table, "last")])
        last.append(int(want[-1].argmax()))
        lengths.append(n)
    turns = [(5, 0, [10]), (6, 0, [11]), (7, 1, [10]), (8, 1, [11])]  # (token, position, blocks)
    for i, (tok, pos, blocks) in enumerate(turns):
        chunks = [SeqChunk(np.array([t], np.int32), n, table, "last")
                  for t, n, (_, table) in zip(last, lengths, seqs, strict=True)]
        chunks.append(SeqChunk(np.array([tok], np.int32), pos, blocks, "last"))
        want, _ = ref.forward(chunks), step.run(chunks)
        assert step.graph_replays == i  # eager, then captured and launched, then replayed
        for c in chunks:
            mine, theirs = _rows(step, ref, c.block_table, range(c.start + 1))
            for k in ("h", "kv"):
                _close(mine[k], theirs[k], tc)
        last, lengths = [int(w[-1].argmax()) for w in want[:2]], [n + 1 for n in lengths]
    assert list(step._graphs) == [(4, 256)]
