"""The CUDA DeepSeek V4 backend (worker/backends/cuda/hyper.py) under a real Engine, run on the CPU: its
launchers computed in numpy (tests/cuda_emulator.py) on an emulated device, its captured decode steps
replayed as calls of their forward pass. A greedy generation goes through what the worker does on a GPU
(tokens drawn on the device from the step's logits, decode steps in graphs, `--spec mtp` drafting with the
next-token layer, or a DSpark block drafter, between steps and checked by the target) and gives the numpy
backend's tokens, with the drafts as without. The GPU runs the backend itself in tests/test_cuda_deepseek4_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import EmuDevice, EmuGraph, EmuOps, EmuStream
from dspark_support import load_pair, make_pair
from engine_runs import RecordingDrafter, generate

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.backend import NumpyBackend
from ember.worker.bench.synth import make_model
from ember.worker.engine.spec.dspark_drafter import DSparkDrafter
from ember.worker.engine.spec.mtp_drafter import MtpDrafter
from ember.worker.model.loader import open_model
from ember.worker.model.weights import load_weights

PROMPT = [int(t) for t in np.random.default_rng(1).integers(3, 700, 40)]  # past the 16-token window


class EmuCudaDevice(EmuDevice):
    """The emulated device as CudaHyperBackend opens it: room for anything."""

    memory_cap: int | None = None

    def memory_info(self) -> tuple[int, int]:
        return 64 << 30, 80 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return open_model(make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf"))


@pytest.fixture(scope="module")
def weights(model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the dequantized weights' cache: the test's own
        mp.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_weights(model.gguf, model.config)


@pytest.fixture
def cuda(model, monkeypatch):
    """CudaHyperBackend(mtp=...) on the emulated device: its matmuls through the matvec (float32, as the
    twin computes), so greedy tokens are the twin's."""
    from ember.kernels import cuda_runtime
    from ember.worker.backends.cuda import hyper_dspark, hyper_mtp, hyper_step
    from ember.worker.backends.cuda import matmul as mm_mod
    from ember.worker.backends.cuda.hyper import CudaHyperBackend

    emu = EmuOps()
    for mod in (hyper_step, hyper_mtp, hyper_dspark, mm_mod):
        monkeypatch.setattr(mod, "ops", emu)
    monkeypatch.setattr(hyper_step.HyperStep, "_capture", lambda self, forward: EmuGraph(forward))
    monkeypatch.setattr(cuda_runtime, "Stream", EmuStream)

    def make(m=model, **drafter) -> CudaHyperBackend:
        return CudaHyperBackend(m.config, m.gguf, n_blocks=64, block_size=16, device=EmuCudaDevice(), max_rows=64,
                                max_seqs=2, tensor_cores=False, **drafter)

    return make


def test_greedy_tokens_are_the_twins_with_and_without_mtp_drafts(model, weights, cuda):
    """24 greedy tokens after a 40-token prompt: the numpy backend's, on the emulated GPU without drafts and
    with the next-token layer's; and each draft the GPU's layer made is the one the twin's makes from the
    same tokens."""
    want, _ = generate(model, NumpyBackend(model.config, weights, n_blocks=64, block_size=16), "off", PROMPT, 24)
    plain = cuda()
    assert plain.samples_on_device and plain.runs_ahead and plain.kv_layout == "cuda-hyper-v2"
    fed = _count_fed(plain)
    off, _ = generate(model, plain, "off", PROMPT, 24)
    assert off == want and len(off) == 24
    assert plain.graph_replays > 0  # the decode steps replayed their graph
    assert fed[0] >= 10  # most of them launched before the host had read the token they decode
    drafting = cuda(mtp=True)
    assert drafting.kv_layout == "cuda-hyper-mtp-v2" and drafting.mtp is not None
    assert not drafting.runs_ahead  # the drafter drafts from each step's token
    drafter = RecordingDrafter(MtpDrafter(drafting.mtp))
    on, metrics = generate(model, drafting, "mtp", PROMPT, 24, drafter)
    assert on == want
    assert metrics["ember_spec_drafted_tokens_total"] > 0 and drafter.seen
    for tokens, draft in drafter.seen[:2] + drafter.seen[-2:]:
        twin = NumpyBackend(model.config, weights, n_blocks=8, block_size=16, mtp=True)
        assert twin.mtp is not None and _twin_draft(twin, twin.mtp, tokens, len(draft)) == draft


def test_greedy_tokens_are_the_twins_with_dspark_drafts(tmp_path, cuda):
    """The same with a DSpark block drafter beside the trunk (the pair `ember bench make-model --dspark-out`
    writes): the twin's tokens with the drafts as without, each draft the one the twin's drafter makes."""
    m, w, f, fw = load_pair(*make_pair(tmp_path), tmp_path / "cache")
    want, _ = generate(m, NumpyBackend(m.config, w, n_blocks=64, block_size=16), "off", PROMPT, 24)
    drafting = cuda(m, dspark=f)
    assert drafting.kv_layout == "cuda-hyper-dspark-v2" and drafting.dspark is not None
    drafter = RecordingDrafter(DSparkDrafter(drafting.dspark))
    on, metrics = generate(m, drafting, "dspark", PROMPT, 24, drafter)
    assert on == want and len(on) == 24
    assert metrics["ember_spec_drafted_tokens_total"] > 0 and drafter.seen
    for tokens, draft in drafter.seen[:2] + drafter.seen[-2:]:
        twin = NumpyBackend(m.config, w, n_blocks=8, block_size=16, dspark=(f, fw))
        assert twin.dspark is not None and _twin_draft(twin, twin.dspark, tokens, len(draft)) == draft


def _count_fed(backend) -> list[int]:
    """A counter of the steps submitted with a token fed from the step before's draws (run-ahead)."""
    fed, submit = [0], backend.submit

    def counting(chunks, feed=None):
        fed[0] += feed is not None and any(j is not None for j in feed)
        return submit(chunks, feed)

    backend.submit = counting
    return fed


def _twin_draft(twin: NumpyBackend, head, tokens: list[int], k: int) -> list[int]:
    """What the twin's drafter drafts after `tokens` from a fresh pool (its pass over all but the last)."""
    table = list(range(8))
    twin.forward([SeqChunk(np.asarray(tokens[:-1], np.int32), 0, table, "none")])
    return head.draft(table, tokens[-1], len(tokens) - 1, k)


def test_the_dense_matrices_are_decoded_to_16_bits_once_and_the_steps_read_that_copy(model, monkeypatch, cuda):
    """f16_weights: the matrices a step multiplies on the tensor cores (attention, compressors, indexer, shared
    expert) are decoded to 16 bits when the backend opens, so prefill and batched decode skip that decode each
    step (ops.linear_tc reads the kept copy); the routed experts, routers and mixes keep none. The copy is the
    per-step decode's: a 40-token prefill and a decode give the same logits with it as without, and the step
    reads it (a kept copy zeroed changes them). "auto" keeps it where memory.keep_half_copy says: never on
    unified memory."""
    from ember.kernels.ops import quant_matrix
    from ember.worker.backends.cuda.hyper import CudaHyperBackend
    from ember.worker.backends.cuda.hyper_step import tensor_core_matrices

    emu = EmuOps()
    monkeypatch.setattr(quant_matrix, "dequant_half", emu.dequant_half)

    def make(f16: str, integrated: bool = False) -> CudaHyperBackend:
        dev = EmuCudaDevice()
        dev.caps.integrated = integrated
        return CudaHyperBackend(model.config, model.gguf, n_blocks=64, block_size=16, device=dev, max_rows=64,
                                max_seqs=2, tensor_cores=True, f16_weights=f16)

    kept, off = make("on"), make("off")
    assert kept.f16_weights and not off.f16_weights
    assert "gemm_w" not in kept.dev.scratched and "gemm_w" in off.dev.scratched  # no decode left to stage
    mats = [m for m, _ in tensor_core_matrices(kept.w, None, None, hc=model.config.hyper.hc_mult)]
    assert len(mats) >= 5 * model.config.n_layers
    assert all(m.half is not None and m.half_kind == "f16" for m in mats)
    assert kept.memory.half_copy == sum(2 * m.rows * m.cols for m in mats) and off.memory.half_copy == 0
    others = [m for lw in kept.w.layers for m in (lw.attn_mix[0], lw.ffn_mix[0], lw.experts.router, lw.experts.down.m)]
    assert all(m.half is None for m in others + [kept.w.output, kept.w.token_embd, kept.w.output_mix[0]])
    assert make("auto").f16_weights and not make("auto", integrated=True).f16_weights

    def run(backend: CudaHyperBackend) -> list[np.ndarray]:
        table = list(range(4))
        (pre,) = backend.forward([SeqChunk(np.asarray(PROMPT, np.int32), 0, table, "all")])
        (dec,) = backend.forward([SeqChunk(np.array([5], np.int32), len(PROMPT), table, "last")])
        return [pre, dec]

    for got, want in zip(run(kept), run(off), strict=True):
        np.testing.assert_array_equal(got, want)
    kept.w.layers[0].q_b.half.zero()  # the prefill's rows read the copy (a one-row decode takes the matvec)
    assert not np.array_equal(run(kept)[0], run(off)[0])
