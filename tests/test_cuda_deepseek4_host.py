"""DeepSeek V4's CUDA step (worker/backends/cuda/hyper_step.py), checked on the CPU through the recording
stand-in for ember.kernels.ops (tests/cuda_recorder.py): the weights uploaded by the real
upload_hyper_weights into fake device arrays, every launcher call bound to its real signature, and the
kernels each kind of layer issues counted: one launch of each attention kernel for all the step's
sequences, the window-only layer attending without compressed rows, an HCA layer making its compressed rows
only once a block of 128 is whole, a CSA layer making its indexer's rows and picking from them, the first
layers routing by token id. Then the whole step with each launcher computed
as its kernel computes, in numpy (tests/cuda_emulator.py): its composition gives the numpy twin's logits.
The kernels' own numbers are the GPU tests' (tests/test_kernels_hyper_gpu.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from cuda_emulator import EmuDevice, EmuGraph, EmuStream
from cuda_recorder import FakeDevice, FakeStream, Recorder

from ember.worker.backends.base import SeqChunk
from ember.worker.backends.numpy.hyper import HyperStack
from ember.worker.bench.synth import make_model
from ember.worker.model.loader import open_model

BS, N_BLOCKS = 16, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return open_model(make_model("deepseek4", "tiny", tmp_path_factory.mktemp("ds4") / "tiny.gguf", seed=1))


def _step(model, monkeypatch, ops, dev, max_rows: int, tensor_cores: bool = True):
    """A HyperStep over `model`'s weights as upload_hyper_weights puts them on `dev`, with `ops` standing in for
    the launchers in hyper_step.py and matmul.py."""
    from ember.worker.backends.cuda import hyper_step
    from ember.worker.backends.cuda import matmul as mm_mod
    from ember.worker.backends.cuda.hyper_weights import upload_hyper_weights

    for mod in (hyper_step, mm_mod):
        monkeypatch.setattr(mod, "ops", ops)
    if isinstance(dev, EmuDevice):  # a captured decode step replays its forward pass
        monkeypatch.setattr(hyper_step.HyperStep, "_capture", lambda self, forward: EmuGraph(forward))
    cfg = model.config
    pool = dev.empty(((N_BLOCKS + 1) * BS * HyperStack.width(cfg, BS),))
    pool.zero()
    stream = EmuStream() if isinstance(dev, EmuDevice) else FakeStream()
    return hyper_step.HyperStep(dev, stream, cfg, upload_hyper_weights(dev, model.gguf, cfg), pool,
                                n_blocks=N_BLOCKS, block_size=BS, max_rows=max_rows, tensor_cores=tensor_cores)


@pytest.fixture
def step(model, monkeypatch):
    rec = Recorder()
    return _step(model, monkeypatch, rec, FakeDevice(), 64), rec


def _layer_logs(calls: list[str], n_layers: int) -> list[list[str]]:
    """The step's log cut into layers: each layer begins with its attention's mix (a step of many rows: its
    matmul, then the first hc_pre after the embeddings, then every second one); the output rows' gather and
    the head's mix of their few rows (hc_mix, the matmul within) end the last."""
    starts = [i for i, c in enumerate(calls) if c.startswith("hc_pre(")]
    assert len(starts) == 2 * n_layers
    head = max(i for i, c in enumerate(calls) if c.startswith("hc_mix("))
    assert calls[head - 1].startswith("gather_rows(") and head > starts[-1]
    bounds = [starts[2 * li] - 1 for li in range(n_layers)] + [head - 1]
    return [calls[bounds[li] : bounds[li + 1]] for li in range(n_layers)]


def count(log: list[str], kernel: str) -> int:
    return sum(1 for c in log if c.startswith(kernel + "("))


def test_each_kind_of_layer_issues_its_kernels(step, model):
    f, rec = step
    cfg, h = model.config, model.config.hyper
    # 230 .. 269 closes HCA block 1 and CSA blocks 57 .. 66, and sees 2 and 67 rows; 99 closes CSA block 24, sees 25
    chunks = [SeqChunk(np.arange(40, dtype=np.int32), 230, list(range(19)), "last"),
              SeqChunk(np.array([3], np.int32), 99, list(range(19, 26)), "all")]
    out = f.run(chunks)
    assert [o.shape for o in out] == [(1, cfg.vocab_size), (1, cfg.vocab_size)]
    layers = _layer_logs(rec.calls, cfg.n_layers)
    spread = {r: HyperStack.spread(r, BS) for r in (4, 128)}
    for li, log in enumerate(layers):
        ratio = h.compress_ratios[li]
        # one launch each for the whole step, whatever its number of sequences
        assert count(log, "attend_rows") == 1
        gathers = [c for c in log if c.startswith("gather_rows(")]
        per_position = 1 + (2 if ratio else 0) + (2 if ratio == 4 else 0)  # key row; compressor's; indexer's
        stores = [c for c in log if c.startswith("store_rows(")]
        assert sum("ape=" in c and "ape=None" not in c for c in stores) == per_position // 2
        if ratio == 4:  # both chunks close CSA blocks and see CSA rows: the compressor's and the indexer's
            assert len(stores) == per_position + 2 and f"n={11 * spread[4]}," in stores[-1]
            assert count(log, "compress_rows") == 2
            assert all("blocks=11," in c for c in log if c.startswith("compress_rows("))  # only what closes
            assert len(gathers) == 3 and all(f"n={92 * spread[4]}," in c for c in gathers[1:])  # 67 + 25 rows
            assert count(log, "indexer_scores") == count(log, "top_k_rows") == 1
        elif ratio == 128:  # only the first chunk closes and sees whole blocks of 128
            assert len(stores) == per_position + 1 and f"n={spread[128]}," in stores[-1]
            assert count(log, "compress_rows") == 1
            assert "blocks=1," in next(c for c in log if c.startswith("compress_rows("))
            assert len(gathers) == 2 and f"n={2 * spread[128]}," in gathers[1]
            assert count(log, "indexer_scores") == 0
        else:
            assert len(stores) == per_position and len(gathers) == 1  # the window's rows alone
            assert count(log, "compress_rows") == count(log, "indexer_scores") == 0
        routes = [c for c in log if c.startswith("moe_route_group(")]
        assert len(routes) == 1 and ("hashed=None" in routes[0]) == (li >= h.hash_layers)
        assert "gating='sqrt-softplus'" in routes[0]
        assert count(log, "clamped_swiglu") == 2  # the shared expert's and the routed experts'
        assert count(log, "hc_merge") == 2
        # RoPE: q's heads, the key row, the compressed rows of each chunk that has them, the output turned back
        ropes = [c for c in log if c.startswith("rope(")]
        assert sum("inverse=True" in c for c in ropes) == 1
        assert len(ropes) >= 3
        # a step of 41 rows multiplies on the tensor cores: the grouped low-rank output one matmul a group;
        # the experts' gate|up and down through the expert tiles; the mixes' logits in float32 (hc_logits)
        o_a = [c for c in log if c.startswith("linear_tc(") and f":{h.o_lora_rank}x" in c.split(",")[1]]
        assert len(o_a) == h.o_groups
        assert count(log, "moe_gemm") == 2 and count(log, "moe_matvec") == count(log, "moe_gather") == 0
        assert count(log, "hc_logits") == 2 and count(log, "matvec") == 0 and count(log, "linear_tc") >= 7
    head = next(c for c in reversed(rec.calls) if c.startswith("hc_mix("))
    assert "None, None" in head and "n=2," in head  # the head's mix of the two rows asked: no post, no comb


def test_the_tensor_core_scratch_is_sized_once_for_the_largest_matmul(step, model):
    """Graphs replay over the tensor-core matmuls' 16-bit scratch, so it is allocated at its largest when the
    step is made: every matrix a step of the most rows multiplies on the tensor cores fits it, and it is not
    sized by the embeddings or the head (which never take the tensor cores here)."""
    f, rec = step
    reserved = dict(f.dev.scratched)
    f.run([SeqChunk(np.arange(f.max_rows, dtype=np.int32), 0, list(range(8)), "last")])
    shapes = [tuple(map(int, m.groups())) for c in rec.calls if c.startswith("linear_tc(")
              for m in [re.search(r":(\d+)x(\d+)\)", c.split(",")[1])] if m]
    assert len(shapes) >= 7 * model.config.n_layers
    assert all(2 * r * c <= reserved["gemm_w"] and 2 * f.max_rows * c <= reserved["gemm_x"] for r, c in shapes)
    assert reserved["gemm_w"] < 2 * f.w.token_embd.rows * f.w.token_embd.cols


def test_a_step_beyond_its_rows_is_refused(step):
    f, _ = step
    with pytest.raises(ValueError, match="exceeds"):
        f.run([SeqChunk(np.zeros(65, np.int32), 0, list(range(5)), "last")])


def test_the_indexer_weights_are_scaled_as_the_twin_divides(model):
    """The twin divides the indexer's head weights by sqrt(heads * dim) after the product; the device folds
    that into the matrix, uploaded as float32."""
    from ember.kernels import quants
    from ember.worker.backends.cuda.hyper_weights import upload_hyper_weights

    h = model.config.hyper
    w = upload_hyper_weights(FakeDevice(), model.gguf, model.config)
    li = h.compress_ratios.index(4)
    name = f"blk.{li}.indexer.proj.weight"
    info = model.gguf.tensors[name]
    want = quants.dequantize(model.gguf.raw(name), info.ggml_type, tuple(reversed(info.shape)))
    proj = w.layers[li].indexer_proj
    assert proj is not None and proj.type == "f32"
    got = proj.data.data.view(np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want / np.sqrt(h.indexer_dim * h.indexer_heads), rtol=1e-6)
    assert re.fullmatch(r"q8_0", w.layers[li].q_b.type)


def test_a_one_token_step_reads_the_token_row_itself(step, model):
    """Batch-1 decode: the experts' grouped matvec takes tiles of one pair and every pair reads the token's
    own row (no gather), as moe_mlp's batch-1 path does."""
    f, rec = step
    (out,) = f.run([SeqChunk(np.array([5], np.int32), 200, list(range(13)), "last")])
    assert out.shape == (1, model.config.vocab_size)
    assert not any(c.startswith("moe_gather(") for c in rec.calls)
    mv = [c for c in rec.calls if c.startswith("moe_matvec(")]
    assert len(mv) == 2 * model.config.n_layers and all("tile=1" in c for c in mv)
    # gate|up read the token's row; down reads each pair's activations
    assert all("x_per_pair=False" in c for c in mv[0::2]) and not any("x_per_pair=False" in c for c in mv[1::2])
    assert all("n=1" in c for c in rec.calls if c.startswith("attend_rows("))
    # the token's heads through their groups' matrices in one launch a layer, not one a group and two swaps
    L = model.config.n_layers
    # what reads the attention's input (the key row, the query, the compressors' rows): one launch a layer
    fans = [c for c in rec.calls if c.startswith("matvec_fan(")]
    assert len(fans) == L
    for li, c in enumerate(fans):
        ratio = model.config.hyper.compress_ratios[li]
        rows = c.split("rows=(")[1].split(")")[0].split(",")
        assert len(rows) == 2 + 2 * bool(ratio) + 2 * (ratio == 4), c
    assert count(rec.calls, "matvec_groups") == L and count(rec.calls, "swap_rows") == 0
    assert all(f"groups={model.config.hyper.o_groups}" in c for c in rec.calls if c.startswith("matvec_groups("))


def test_the_shared_experts_gate_and_up_are_one_matmul(step, model):
    """Gate and up of the same type are stacked in one upload; the step makes both in one matmul and the
    clamped SwiGLU reads its halves."""
    f, rec = step
    layers = f.w.layers
    assert all(lw.shared_gate_up is not None for lw in layers)
    lw = layers[0]
    assert lw.shared_gate_up.rows == 2 * lw.shared_gate.rows  # type: ignore[union-attr]
    assert lw.shared_up.data.ptr == lw.shared_gate.data.ptr + lw.shared_gate.rows * lw.shared_gate.row_bytes
    f.run([SeqChunk(np.array([5], np.int32), 200, list(range(13)), "last")])
    ffs = lw.shared_gate.rows
    L = model.config.n_layers
    assert count(rec.calls, "clamped_swiglu") == 2 * L  # the shared expert's, the routed experts'
    shared = [c for c in rec.calls if c.startswith("clamped_swiglu(") and "n=1," in c]  # the routed: n=k pairs
    assert len(shared) == L and all(f"ffn={ffs}," in c and f"ldg={2 * ffs}," in c for c in shared)


# -- the whole step on the CPU: its launchers computed in numpy (tests/cuda_emulator.py) -------------------


@pytest.fixture(scope="module")
def reference_backend(model, tmp_path_factory):
    from ember.worker.backends.numpy.backend import NumpyBackend
    from ember.worker.model.weights import load_weights

    with pytest.MonkeyPatch.context() as mp:  # the dequantized weights' cache: the test's own
        mp.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        weights = load_weights(model.gguf, model.config)
    return lambda: NumpyBackend(model.config, weights, n_blocks=N_BLOCKS, block_size=BS)


@pytest.fixture(params=[False, True], ids=["matvec", "tensor-cores"])
def emulated(model, monkeypatch, request):
    from cuda_emulator import EmuOps

    return _step(model, monkeypatch, EmuOps(), EmuDevice(), 160, tensor_cores=request.param), request.param


def _agree(got: np.ndarray, want: np.ndarray, tensor_cores: bool) -> None:
    """The twin's logits: to float32 rounding through the matvecs. Through the tensor cores' 16-bit inputs,
    as test_cuda_backend's fast mode: each position correlated to 0.99 (a rounding may flip a near-tied
    router's choice of an expert), and the same argmax where the twin's top two are 0.5 apart."""
    if not tensor_cores:
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        return
    for g, w in zip(np.atleast_2d(got), np.atleast_2d(want), strict=True):
        assert np.corrcoef(g, w)[0, 1] >= 0.99
        top2 = np.sort(w)[-2:]
        if top2[1] - top2[0] >= 0.5:
            assert g.argmax() == w.argmax()


def _prefill_both(ref, emulated, seqs: list[tuple[int, list[int]]], seed: int,
                  tc: bool | None = None) -> tuple[list[int], list[int]]:
    """Each (length, block table) of `seqs` prefilled with random tokens on the twin and on the emulated step
    (their logits compared where tc is given); each sequence's next token (the twin's argmax) and length."""
    rng = np.random.default_rng(seed)
    last, lengths = [], []
    for n, table in seqs:
        prompt = rng.integers(0, 700, n).astype(np.int32)
        (want,) = ref.forward([SeqChunk(prompt, 0, table, "last")])
        (got,) = emulated.run([SeqChunk(prompt, 0, table, "last")])
        if tc is not None:
            _agree(got, want, tc)
        last.append(int(want[-1].argmax()))
        lengths.append(n)
    return last, lengths


def test_the_step_computes_the_twins_logits(emulated, reference_backend):
    """300 positions in chunks of 64 (the window, 75 CSA rows of which the indexer picks 8, two HCA rows),
    then two sequences decoding together over scattered blocks: the step's composition of its kernels gives
    the numpy twin's logits (with the tensor cores on, the 64-row chunks' matmuls and experts take them)."""
    emulated, tc = emulated
    ref = reference_backend()
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 700, 300)]
    table = list(range(19))
    for at in range(0, 300, 64):
        part = np.asarray(tokens[at : at + 64], np.int32)
        (want,) = ref.forward([SeqChunk(part, at, table, "all")])
        (got,) = emulated.run([SeqChunk(part, at, table, "all")])
        _agree(got, want, tc)
    other = [int(t) for t in np.random.default_rng(8).integers(0, 700, 140)]
    table2 = list(range(40, 31, -1))  # scattered, descending
    (want,) = ref.forward([SeqChunk(np.asarray(other, np.int32), 0, table2, "last")])
    (got,) = emulated.run([SeqChunk(np.asarray(other, np.int32), 0, table2, "last")])
    _agree(got, want, tc)
    last, lengths = [int(want[-1].argmax()), int(np.random.default_rng(9).integers(0, 700))], [140, 300]
    for _ in range(3):
        step = [SeqChunk(np.array([t], np.int32), n, tab, "last")
                for t, n, tab in zip(last, lengths, (table2, table), strict=True)]
        want, got = ref.forward(step), emulated.run(step)
        for g, w in zip(got, want, strict=True):
            _agree(g, w, tc)
        last, lengths = [int(w[-1].argmax()) for w in want], [n + 1 for n in lengths]


def test_decode_steps_replay_their_captured_graph(emulated, reference_backend):
    """Three sequences at different depths decoding together: the step is padded to four rows and a context
    of 256; the first such step runs eagerly, the second is captured, later ones replay it (the launches and
    their arguments of the capture, over the inputs each step uploads), and every step gives the twin's
    logits for the real rows, though the sequences move deeper, close compress blocks inside the replays, and the
    padded row reads and writes the trash block."""
    emulated, tc = emulated
    ref = reference_backend()
    # the decodes close CSA blocks (at 23, 103, 127) and an HCA block (at 127) in replays
    seqs = [(20, list(range(0, 3))), (100, list(range(3, 10))), (125, list(range(20, 29)))]
    last, lengths = _prefill_both(ref, emulated, seqs, 11, tc)
    for step in range(4):
        chunks = [SeqChunk(np.array([t], np.int32), n, table, "last")
                  for t, n, (_, table) in zip(last, lengths, seqs, strict=True)]
        want, got = ref.forward(chunks), emulated.run(chunks)
        for g, w in zip(got, want, strict=True):
            _agree(g, w, tc)
        assert emulated.graph_replays == max(0, step)  # eager, then captured and launched, then replayed
        last, lengths = [int(w[-1].argmax()) for w in want], [n + 1 for n in lengths]
    assert list(emulated._graphs) == [(4, 256)]


def test_a_steps_inputs_go_up_in_one_copy_each_in_a_place_it_keeps(monkeypatch):
    """GrowingBuffers.upload: every array lands as itself (int32, uint8 and float32 in one arena), in one
    copy; a name keeps its place while its arrays fit its room, so a captured graph's pointers stay good; a
    larger one lays the arena out anew and counts a move, and a new name takes room after the others."""
    from cuda_emulator import EmuArray

    from ember.worker.backends.cuda.buffers import GrowingBuffers

    copies = []
    upload = EmuArray.upload
    monkeypatch.setattr(EmuArray, "upload", lambda self, arr: (copies.append(self.nbytes), upload(self, arr)))
    b = GrowingBuffers(EmuDevice())
    rng = np.random.default_rng(0)
    first = {"tok": np.arange(5, dtype=np.int32), "sample": rng.integers(0, 255, 40).astype(np.uint8),
             "w": rng.normal(size=7).astype(np.float32)}
    d = b.upload(first)
    assert len(copies) == 1
    for k, v in first.items():
        assert d[k].dtype == v.dtype and np.array_equal(d[k].to_host(), v)
    at = {k: d[k].ptr for k in d}
    again = b.upload({"tok": np.arange(60, 64, dtype=np.int32), "w": np.ones(60, np.float32)})  # fit their rooms
    assert {k: again[k].ptr for k in again} == {k: at[k] for k in again} and b.moves == 0
    assert np.array_equal(again["tok"].to_host(), np.arange(60, 64)) and again["w"].to_host().sum() == 60
    grown = b.upload({"tok": np.arange(100, dtype=np.int32), "extra": np.full(3, 7, np.int32)})
    assert b.moves >= 1 and np.array_equal(grown["tok"].to_host(), np.arange(100))
    assert grown["extra"].to_host().tolist() == [7, 7, 7] and (grown["extra"].ptr - grown["tok"].ptr) % 256 == 0
    assert len(copies) == 3


def test_inputs_go_up_from_pinned_memory_on_the_stream_and_a_move_waits_first():
    """With pinned memory to stage in (a step run ahead), the arena goes up in one asynchronous copy, no
    synchronous one; the arena replaced by a larger one calls before_move first (the owner waits there for the
    step still reading it), and only then."""
    from cuda_emulator import EmuArray

    from ember.worker.backends.cuda.buffers import GrowingBuffers

    waits, staged = [], []
    dev = EmuDevice()

    def stage(nbytes):
        staged.append(nbytes)
        return dev.pinned(nbytes)

    b = GrowingBuffers(dev, before_move=lambda: waits.append(b.moves))
    sync = EmuArray.upload
    EmuArray.upload = lambda self, arr: pytest.fail("a synchronous copy")
    try:
        d = b.upload({"tok": np.arange(5, dtype=np.int32), "w": np.ones(3, np.float32)}, stage, None)
        assert np.array_equal(d["tok"].a, np.arange(5)) and d["w"].a.sum() == 3 and staged and not waits
        b.upload({"tok": np.arange(7, dtype=np.int32)}, stage, None)  # fits its room: nothing moves
        assert not waits and b.moves == 0
        grown = b.upload({"tok": np.arange(5000, dtype=np.int32)}, stage, None)
        assert waits and b.moves >= 1 and np.array_equal(grown["tok"].a, np.arange(5000))
    finally:
        EmuArray.upload = sync


def test_graphs_share_their_buffers_and_one_that_grows_drops_them(model, monkeypatch, reference_backend):
    """The captured shapes share one set of buffers (the largest shape's room, not the sum). Shallow
    sequences decode at (4 rows, context 256): captured, replayed. A deep one joins: (4, 512) grows the
    buffers, so the first graph goes. Back at (4, 256), it is captured anew (a replay of the old one would
    read the inputs of its own step, from buffers no longer filled) and every step gives the twin's logits."""
    from cuda_emulator import EmuOps

    step, ref = _step(model, monkeypatch, EmuOps(), EmuDevice(), 160, tensor_cores=False), reference_backend()
    rng = np.random.default_rng(3)
    seqs = {"a": (20, list(range(0, 3))), "b": (60, list(range(3, 8))), "c": (90, list(range(8, 15))),
            "deep": (300, list(range(15, 35)))}
    state = {}
    for name, (n, table) in seqs.items():
        prompt = rng.integers(0, 700, n).astype(np.int32)
        for at in range(0, n, 150):  # the step's 160 rows
            piece = SeqChunk(prompt[at : at + 150], at, table, "last")
            (want,), _ = ref.forward([piece]), step.run([piece])
        state[name] = [int(want[-1].argmax()), n]

    def decode(names: list[str]) -> None:
        chunks = [SeqChunk(np.array([state[k][0]], np.int32), state[k][1], seqs[k][1], "last") for k in names]
        want, got = ref.forward(chunks), step.run(chunks)
        for k, g, w in zip(names, got, want, strict=True):
            _agree(g, w, False)
            state[k] = [int(w[-1].argmax()), state[k][1] + 1]

    for _ in range(3):
        decode(["a", "b", "c"])
    assert list(step._graphs) == [(4, 256)] and step.graph_replays == 2
    moves = step._graph_bufs.moves
    for _ in range(2):
        decode(["a", "b", "deep"])
    assert step._graph_bufs.moves > moves and list(step._graphs) == [(4, 512)] and step.graph_replays == 3
    for _ in range(2):
        decode(["a", "b", "c"])
    assert sorted(step._graphs) == [(4, 256), (4, 512)] and step.graph_replays == 5


def test_chunks_that_ask_are_sampled_on_the_device(model, monkeypatch, reference_backend):
    """Three sequences decoding together (eager, then captured and replayed at a padded shape of 4 rows): one
    asks a greedy draw, one a seeded draw at temperature 0.8 and top-k 40, one its logits. The first two come
    back as SampledToken, the host sampler's chain over the twin's logits (reference.sample_rows), the third
    as the twin's logits."""
    from cuda_emulator import EmuOps

    from ember.kernels.reference import sample_rows
    from ember.worker.backends.base import DeviceSample, SampledToken

    emulated, ref = _step(model, monkeypatch, EmuOps(), EmuDevice(), 160, tensor_cores=False), reference_backend()
    seqs = [(20, list(range(0, 3))), (50, list(range(3, 8))), (90, list(range(8, 15)))]
    last, lengths = _prefill_both(ref, emulated, seqs, 5)
    for i in range(3):
        asks = [DeviceSample(0.0, 0, 1.0, 0.0, 0, i), DeviceSample(0.8, 40, 1.0, 0.0, 1234, i), None]
        chunks = [SeqChunk(np.array([t], np.int32), n, table, "last", sample=a)
                  for t, n, (_, table), a in zip(last, lengths, seqs, asks, strict=True)]
        want = ref.forward([SeqChunk(c.tokens, c.start, c.block_table, "last") for c in chunks])
        got = emulated.run(chunks)
        assert emulated.graph_replays == max(0, i)
        assert isinstance(got[0], SampledToken) and isinstance(got[1], SampledToken)
        assert got[0] == int(want[0][-1].argmax())
        (drawn,), _ = sample_rows(want[1][-1:], [0.8], [40], [1.0], [0.0], [1234], [i])
        assert got[1] == drawn
        np.testing.assert_allclose(got[2], want[2], rtol=1e-3, atol=1e-3)
        last, lengths = [int(got[0]), int(got[1]), int(want[2][-1].argmax())], [n + 1 for n in lengths]


def test_a_step_run_ahead_decodes_the_draws_of_the_one_before(model, monkeypatch, reference_backend):
    """Run-ahead: two sequences decode greedily, each step submitted with its tokens fed from the draws of the
    step before, before the host has read them (the emulator fails any host copy while a step is queued, so a
    replay that waited or copied synchronously would show). Every draw is the twin's argmax; the steps replay
    their graph; a step whose one chunk asks its logits instead keeps its token and gets the twin's logits."""
    from cuda_emulator import EmuOps

    from ember.worker.backends.base import DeviceSample, SampledToken

    emulated, ref = _step(model, monkeypatch, EmuOps(), EmuDevice(), 160, tensor_cores=False), reference_backend()
    seqs = [(30, list(range(0, 4))), (70, list(range(4, 10)))]
    last, lengths = _prefill_both(ref, emulated, seqs, 21)
    greedy = DeviceSample(0.0, 0, 1.0, 0.0, 0, 0)

    def step(i, tokens, logits_of=None):
        return [SeqChunk(np.array([t], np.int32), n + i, table, "last", sample=None if j == logits_of else greedy)
                for j, (t, n, (_, table)) in enumerate(zip(tokens, lengths, seqs, strict=True))]

    def twin(i, tokens):  # the twin's logits of step i over these tokens
        return ref.forward([SeqChunk(c.tokens, c.start, c.block_table, "last") for c in step(i, tokens)])

    pending, drawn = emulated.submit(step(0, last)), []
    for i in range(1, 6):
        nxt = emulated.submit(step(i, [0, 0]), emulated.feed_sources(step(i, [0, 0]), [0, 1]))
        drawn.append([int(t) for t in pending.result()])
        pending = nxt
    drawn.append([int(t) for t in pending.result()])
    assert emulated.graph_replays >= 4
    tokens = [last] + drawn
    for i in range(6):  # the twin over the same tokens: each draw its argmax
        assert [int(w[-1].argmax()) for w in twin(i, tokens[i])] == tokens[i + 1]
    # a fed step whose second chunk asks its logits: the first is fed, the second keeps the host's token
    first = emulated.submit(step(6, tokens[6]))
    mixed = step(7, [0, 123], logits_of=1)
    got = emulated.submit(mixed, emulated.feed_sources(mixed, [0, None])).result()
    before = [int(t) for t in first.result()]
    assert before == [int(w[-1].argmax()) for w in twin(6, tokens[6])]
    want = twin(7, [before[0], 123])
    assert isinstance(got[0], SampledToken) and got[0] == int(want[0][-1].argmax())
    np.testing.assert_allclose(got[1], want[1], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="drew no token"):
        emulated.feed_sources(mixed, [None, 1])  # the last step drew none for its second chunk
