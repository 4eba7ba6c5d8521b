"""DeepSeek V4's DSpark block drafter on the CUDA step (worker/backends/cuda/hyper_dspark.py), run on the CPU:
its launchers computed in numpy (tests/cuda_emulator.py), held to the numpy twin (backends/numpy/dspark.py)
on the tiny trunk and drafter pair `ember bench make-model --dspark-out` writes (the pair llama-server drafts
with in tests/test_dspark.py). With every step the drafter's key rows go into the pool as the twin writes
them (prefill chunks, decode steps replayed as graphs); a draft's block gives the twin's chain. The GPU runs
the same in tests/test_cuda_deepseek4_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import EmuDevice, EmuGraph, EmuOps, EmuStream
from dspark_support import load_pair, make_pair

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.backends.numpy.hyper import HyperStack

BS, N_BLOCKS = 16, 24


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(the trunk, its weights, the drafter file, the drafter's weights)."""
    return load_pair(*make_pair(tmp_path_factory.mktemp("dspark")), tmp_path_factory.mktemp("cache"))


@pytest.fixture(params=[False, True], ids=["matvec", "tensor-cores"])
def emulated(loaded, monkeypatch, request):
    """A HyperStep with the drafter, over the weights as the uploaders put them on an emulated device."""
    from ember.worker.backends.cuda import hyper_dspark, hyper_step
    from ember.worker.backends.cuda import matmul as mm_mod
    from ember.worker.backends.cuda.hyper_dspark import upload_dspark_weights
    from ember.worker.backends.cuda.hyper_weights import upload_hyper_weights

    emu = EmuOps()
    for mod in (hyper_step, hyper_dspark, mm_mod):
        monkeypatch.setattr(mod, "ops", emu)
    monkeypatch.setattr(hyper_step.HyperStep, "_capture", lambda self, forward: EmuGraph(forward))
    m, _, f, _ = loaded
    cfg, dev = m.config, EmuDevice()
    pool = dev.empty(((N_BLOCKS + 1) * BS * HyperStack.width(cfg, BS, drafter_width=f.key_width),))
    pool.zero()
    w = upload_hyper_weights(dev, m.gguf, cfg)
    step = hyper_step.HyperStep(dev, EmuStream(), cfg, w, pool, n_blocks=N_BLOCKS, block_size=BS, max_rows=96,
                                tensor_cores=request.param, dspark=upload_dspark_weights(dev, f, w))
    return step, request.param


def _twin(loaded) -> NumpyBackend:
    m, w, f, fw = loaded
    return NumpyBackend(m.config, w, n_blocks=N_BLOCKS, block_size=BS, dspark=(f, fw))


def _drafter_rows(step, twin, table: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    cols = step.columns[-1]["drafter"]
    p = np.arange(n)
    slots = np.asarray(table)[p // BS] * BS + p % BS
    return (step.pool.a.reshape(-1, step.width)[slots][:, cols],
            twin.hyper.pool.reshape(-1, step.width)[slots][:, cols])


def _close(got: np.ndarray, want: np.ndarray, tensor_cores: bool) -> None:
    """To float16 rounding through the matvecs (the rows are float16 values); through the tensor cores' 16-bit
    inputs, every row correlated to 0.98, 95% of them to 0.99 (a flipped near-tied expert in a trunk layer)."""
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    if not tensor_cores:
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
        return
    corr = np.array([np.corrcoef(g, w)[0, 1] for g, w in zip(got, want, strict=True)])
    assert corr.min() >= 0.98 and np.mean(corr >= 0.99) >= 0.95, np.sort(corr)[:8]


def test_prefill_and_graphs_write_the_twins_rows_and_a_draft_is_its_chain(emulated, loaded):
    """100 positions in chunks of 40 over scattered blocks, then three decode steps (eager, captured,
    replayed): every position's key row a stage as the twin's; then a block of the file's size drafted
    after the last: the twin's chain, its biased logits close to the twin's."""
    step, tc = emulated
    twin = _twin(loaded)
    f = loaded[2]
    tokens = np.random.default_rng(3).integers(0, 700, 104).astype(np.int32)
    table = np.random.default_rng(4).permutation(N_BLOCKS)[:7].tolist()
    for at in range(0, 100, 40):
        part = tokens[at : min(at + 40, 100)]
        twin.forward([SeqChunk(part, at, table, "last")])
        step.run([SeqChunk(part, at, table, "last")])
    for at in range(100, 103):
        chunk = [SeqChunk(tokens[at : at + 1], at, table, "last")]
        twin.forward(chunk)
        step.run(chunk)
    assert step.graph_replays == 2
    mine, theirs = _drafter_rows(step, twin, table, 103)
    _close(mine, theirs, tc)
    assert step.dspark is not None and twin.dspark is not None
    n = f.block_size
    guesses, logits = step.dspark.chain(table, int(tokens[103]), 103, n)
    want, want_logits, _ = twin.dspark.chain(table, int(tokens[103]), 103, n)
    same = next((i + 1 for i in range(n) if guesses[i] != want[i]), n)  # a different guess: its own chain on
    assert same == n or tc
    _close(logits[:same], want_logits[:same], tc)
    if not tc:  # a shorter block is another block (its slots see each other): the twin's too
        assert step.dspark.draft(table, int(tokens[103]), 103, 3) == twin.dspark.draft(table, int(tokens[103]), 103, 3)
