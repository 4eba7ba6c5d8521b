"""A recording stand-in for ember.kernels.ops, so the CUDA forward pass (worker/backends/cuda/forward.py,
matmul.py, step.py) runs on a machine without a GPU: every launcher call is logged with its arguments
instead of launched, and the weights are uploaded by the real layers.upload_weights into fake device
arrays (named by allocation order, so a log names the buffers a kernel reads and writes).

What it checks is the host code: which kernels a step issues, in which order, over which buffers and
with which switches (windows, sinks, RoPE scale, activation, biases), for every layer variant a recipe
and a file's types make. The numbers are the gpu tests' (tests/test_cuda_backend.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from types import SimpleNamespace

import numpy as np

from ember.kernels import ops as real_ops

# launchers that decide (or size) without launching: the real ones run
PASS_THROUGH = {"kq8_supported", "kv2_supported", "post_norm_supported", "matvec_gated_supported",
                "stream_q8_0_supported", "sample_parts", "flash_tiles", "qgemm_supported", "qmoc_supported",
                "hc_mix_supported", "attend_splits", "matvec_groups_supported", "matvec_fan_supported"}


class FakeArray:
    """A device allocation or a view into one: a name, an element offset, a size."""

    _ptrs = itertools.count(1)

    def __init__(self, name: str, shape, dtype=np.float32, offset: int = 0, ptr: int | None = None):
        self.name, self.offset = name, offset
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.ptr = ptr if ptr is not None else next(self._ptrs) << 32
        self.nbytes = self.size * self.dtype.itemsize
        self.data: np.ndarray | None = None  # the host array a to_device upload came from

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def view(self, offset_elements: int, shape, dtype=None) -> FakeArray:
        return FakeArray(self.name, shape, dtype or self.dtype, self.offset + offset_elements * self.dtype.itemsize,
                         self.ptr + offset_elements * self.dtype.itemsize)

    def view_bytes(self, offset_bytes: int, count: int, dtype) -> FakeArray:
        return FakeArray(self.name, count, dtype, self.offset + offset_bytes, self.ptr + offset_bytes)

    def zero(self) -> None:
        pass

    def poison(self) -> None:
        pass

    def upload(self, arr) -> None:
        pass

    def copy_from(self, src, nbytes: int, stream) -> None:
        pass

    def upload_from(self, host, nbytes: int, stream, host_offset: int = 0) -> None:
        pass

    def download_into(self, host, nbytes: int, stream, host_offset: int = 0) -> None:
        pass

    def to_host(self) -> np.ndarray:
        return np.zeros(self.shape, self.dtype)

    def __repr__(self) -> str:
        return f"{self.name}+{self.offset}" if self.offset else self.name


class FakeDevice:
    """What upload_weights, Activations.alloc and the launchers' pass-through helpers ask of a Device."""

    def __init__(self):
        self.caps = SimpleNamespace(pdl=True, clusters=True, smem_optin=227 << 10, integrated=False)
        self.sm_count = 132
        self._n = itertools.count()
        self.scratched: dict[str, int] = {}  # the largest each scratch buffer was asked for

    def empty(self, shape, dtype=np.float32) -> FakeArray:
        return FakeArray(f"buf{next(self._n)}", shape, dtype)

    def scratch(self, key: str, nbytes: int) -> FakeArray:
        self.scratched[key] = max(nbytes, self.scratched.get(key, 0))
        return FakeArray(f"scratch_{key}", (nbytes,), np.uint8)

    def pinned(self, nbytes: int):
        return SimpleNamespace(nbytes=max(int(nbytes), 8), array=np.zeros(max(int(nbytes), 8), np.uint8),
                               free=lambda: None)

    def event(self):
        return SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)

    def make_current(self) -> None:
        pass

    def to_device(self, arr) -> FakeArray:
        arr = np.asarray(arr)
        a = FakeArray(f"w{next(self._n)}", arr.shape, arr.dtype)
        a.data = arr.copy()  # what was uploaded, for checks of the device layout
        return a


def fmt(v, drop: dict | None = None) -> str:
    """An argument as the log shows it: arrays by name, matrices by their data's name, dataclasses by field
    (those named in `drop` left out where they hold that value)."""
    drop = drop or {}
    if isinstance(v, FakeArray):
        return repr(v)
    if isinstance(v, real_ops.QuantMatrix):
        return f"Q({v.data!r}:{v.type}:{v.rows}x{v.cols})"
    if isinstance(v, real_ops.ExpertMatrices):
        return f"E({v.m.data!r})" if v.bias is None else f"E({v.m.data!r}, bias={v.bias!r})"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = ", ".join(f"{f.name}={fmt(getattr(v, f.name), drop)}" for f in dataclasses.fields(v)
                           if not (f.name in drop and drop[f.name] == getattr(v, f.name)))
        return f"{type(v).__name__}({fields})"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(fmt(x, drop) for x in v) + ")"
    if isinstance(v, float):
        return repr(float(np.float32(v)))
    if isinstance(v, FakeDevice) or (hasattr(v, "handle") and not isinstance(v, (int, str))):
        return type(v).__name__
    return repr(v)


class Recorder:
    """Stands in for the `ops` module: launchers log (name, formatted args) to `calls`, their arguments bound to
    the real launcher's signature; constants, classes and the deciding helpers are the real ones."""

    def __init__(self, drop_defaults: dict[str, object] | None = None):
        """drop_defaults: keyword arguments left out of the log when they have this value (so a log
        recorded before a launcher gained an argument compares with one after)."""
        self.calls: list[str] = []
        self.drop = drop_defaults or {}

    def __getattr__(self, name: str):
        real = getattr(real_ops, name)
        if not callable(real) or isinstance(real, type) or name in PASS_THROUGH or not name[0].islower():
            return real

        signature = inspect.signature(real)

        def launcher(*args, **kwargs):
            signature.bind(*args, **kwargs)  # a call the real launcher would refuse fails here too
            shown = [fmt(a, self.drop) for a in args] + [f"{k}={fmt(v, self.drop)}" for k, v in kwargs.items()
                                                         if not (k in self.drop and self.drop[k] == v)]
            self.calls.append(f"{name}({', '.join(shown)})")

        return launcher


class FakeStream:
    handle = 0

    def synchronize(self) -> None:
        pass


def forward_for(model, monkeypatch, *, stack: bool = True, tensor_cores: bool = True, int8: bool = True,
                device_attention: bool = True, rows: int = 256, seqs: int = 8, drop_defaults=None):
    """A Forward over `model`'s real layer variants (upload_weights on a FakeDevice), with the recorder
    standing in for ops in forward.py, matmul.py and step.py. Returns (forward, recorder, step inputs)."""
    from ember.worker.backends.cuda import forward as fwd_mod
    from ember.worker.backends.cuda import matmul as mm_mod
    from ember.worker.backends.cuda import step as step_mod
    from ember.worker.backends.cuda.layers import upload_weights

    rec = Recorder(drop_defaults)
    for mod in (fwd_mod, mm_mod, step_mod):
        monkeypatch.setattr(mod, "ops", rec)
    cfg, dev, st = model.config, FakeDevice(), FakeStream()
    w = upload_weights(dev, model.gguf, cfg, stack=stack)
    tc = tensor_cores and all(m.cols % 32 == 0 for lw in w.layers for m in lw.matrices())
    act = fwd_mod.Activations.alloc(dev, cfg, rows, w.layers, cfg.recipe.post_norms)
    mm = mm_mod.Matmuls(dev, st, cfg, w.output, int8_activations=int8, tensor_cores=tc,
                        half_kind=cfg.recipe.half_type, g=act.g, u=act.u, gu=act.gu)
    n_blocks, block = 64, 16
    layer_elems = (n_blocks + 1) * block * cfg.kv_dim
    kv = fwd_mod.KVPools(dev.empty((cfg.n_layers * layer_elems,), np.float16),
                         dev.empty((cfg.n_layers * layer_elems,), np.float16), layer_elems, n_blocks, block)
    f = fwd_mod.Forward(dev, st, cfg, w, act, mm, kv, device_attention=device_attention, tensor_cores=tc,
                        half_kind=cfg.recipe.half_type)
    layout = step_mod.StepLayout(rows, seqs, (seqs + 1) * 64)
    inputs = step_mod.StepInputs.of(dev.empty((layout.nbytes,), np.uint8), layout)
    return f, rec, inputs


def step_cases(f, inputs, rec) -> dict[str, list[str]]:
    """The kernel log of each kind of step the backend runs: captured decode (one row and four, fed),
    eager decode, a prefill chunk on flash tiles with the last row's logits, a prefill without flash
    with every row's, and two chunks with a subset of rows."""
    from ember.worker.backends.base import SeqChunk

    act, out = f.act, f.act.tokens_out
    parts = (FakeArray("part_acc", 1 << 20), FakeArray("part_ml", 1 << 16))

    def chunk(n, start=0):
        return SeqChunk(np.zeros(n, np.int32), start, list(range(8)), "last")

    def host(chunks):  # what the host attention fallback needs
        spans, at, pos = [], 0, []
        for c in chunks:
            spans.append((at, at + len(c.tokens)))
            pos += list(range(c.start, c.start + len(c.tokens)))
            at += len(c.tokens)
        return spans, np.asarray(pos, np.int32)

    cases = {
        "decode-graph-1": dict(n=1, chunks=None, n_out=1, fed=out[1], partials=parts, max_keys=64),
        "decode-graph-4": dict(n=4, chunks=None, n_out=4, fed=out[1], partials=parts, max_keys=512),
        "decode-eager-2": dict(n=2, chunks=[chunk(1, 40), chunk(1, 70)], n_out=2, fed=None, max_keys=71),
        "prefill-flash": dict(n=70, chunks=[chunk(70)], n_out=1, fed=None, n_tiles=2, sample=False, max_keys=70),
        "prefill-all-logits": dict(n=24, chunks=[chunk(24)], n_out=24, fed=None, sample=False, max_keys=24),
        "prefill-two-chunks": dict(n=20, chunks=[chunk(12), chunk(8, 30)], n_out=2, fed=None, max_keys=38),
    }
    logs = {}
    for name, c in cases.items():
        chunks = c["chunks"]
        if chunks is None and not f.device_attention:  # a captured step needs the attention kernels
            continue
        rec.calls.clear()
        spans, positions = host(chunks) if chunks is not None else (None, None)
        f.run(inputs, out[0], c["fed"], c["n"], 8, c["max_keys"], c["n_out"], chunks, spans, positions,
              partials=c.get("partials"), sample=c.get("sample", True), n_tiles=c.get("n_tiles", 0))
        logs[name] = list(rec.calls)
    del act
    return logs
