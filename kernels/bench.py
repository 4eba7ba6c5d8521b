"""Micro-benchmark of the kernels on the local GPU: ``python -m ember.kernels.bench [--out F.json]``.

Timing: each measured kernel is captured N times into a CUDA graph (cycling through enough copies of
its weights that they never sit in L2), the graph is replayed with device events around it, and the
median over replays divided by N is reported, warm-up excluded. Bandwidth counts the bytes a kernel
must move at least (weights once, activations once). The ceiling is measured in the same run: a large
device-to-device copy, bytes read + written.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np

from . import ops
from .cuda_runtime import Device, Graph, Stream, Timer, _driver, check, pdl_launches

PDL = [False]  # --pdl: graphs captured with programmatic dependent launch


def _time_graph(dev: Device, stream: Stream, body, n_inner: int, replays: int = 7) -> float:
    """Median seconds of one body() call (body issues n_inner launches per call of its own)."""
    body()  # eager first run: loads modules and allocates scratch, which a capture must not do
    stream.synchronize()
    with Graph.capture(stream) as g, pdl_launches(PDL[0]):
        body()
    timer = Timer()
    g.launch()
    g.launch()  # warm-up
    stream.synchronize()
    times = []
    for _ in range(replays):
        timer.start(stream)
        g.launch()
        times.append(timer.stop(stream) / 1e3)
    g.destroy()
    return statistics.median(times) / n_inner


def copy_ceiling(dev: Device) -> float:
    n = 1 << 30
    a, b = dev.empty(n, np.uint8), dev.empty(n, np.uint8)
    a.fill_bytes(1)
    timer = Timer()
    drv = _driver()
    ts = []
    for i in range(6):
        timer.start()
        check(drv.cuMemcpyDtoD(b.ptr, a.ptr, n), "cuMemcpyDtoD")
        t = timer.stop() / 1e3
        if i:
            ts.append(t)
    a.free()
    b.free()
    return 2 * n / statistics.median(ts)


def _rand_weights(rng, tname: str, rows: int, cols: int) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType as T

    from .quants import BLOCK_DTYPES

    t = {"q4_0": T.Q4_0, "q5_0": T.Q5_0, "q8_0": T.Q8_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}.get(tname)
    nbytes = rows * ops.row_nbytes(tname, cols)
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if t is not None:
        blocks = raw.view(BLOCK_DTYPES[t])
        for name in blocks.dtype.names:
            if blocks.dtype[name] == np.dtype("<f2"):
                blocks[name] = rng.normal(0, 0.02, len(blocks)).astype(np.float16)
    else:  # float types: random finite values
        raw = rng.normal(0, 1, rows * cols).astype(np.float16 if tname == "f16" else np.float32).view(np.uint8)
    return raw


def bench_matvec(dev, stream, rng, tname, rows, cols, batch=1, rows_per_warp=None, min_bytes=256 << 20, int8=False,
                 **kw):
    rb = rows * ops.row_nbytes(tname, cols)
    copies = max(2, -(-min_bytes // rb))
    raw = _rand_weights(rng, tname, rows, cols)
    mats = [ops.QuantMatrix.upload(dev, raw, tname, rows, cols) for _ in range(copies)]
    x = dev.to_device(rng.normal(0, 1, (batch, cols)).astype(np.float32))
    y = dev.empty((batch, rows))

    def body():
        for m in mats:
            if int8:
                ops.matvec_q8(dev, m, x, y, n=batch, stream=stream, **kw)
            else:
                ops.matvec(dev, m, x, y, rows_per_warp=rows_per_warp, stream=stream, **kw)

    t = _time_graph(dev, stream, body, len(mats))
    for m in mats:
        m.data.free()
    return t, rb


# llama-3-8B Q4_K_M, per layer (llama.cpp's mix: attn_v and ffn_down are Q6_K in about half the layers)
LLAMA8B = [
    ("q", "q4_k", 4096, 4096, 32), ("k", "q4_k", 1024, 4096, 32), ("v", "q6_k", 1024, 4096, 16),
    ("v", "q4_k", 1024, 4096, 16), ("o", "q4_k", 4096, 4096, 32), ("gate", "q4_k", 14336, 4096, 32),
    ("up", "q4_k", 14336, 4096, 32), ("down", "q6_k", 4096, 14336, 16), ("down", "q4_k", 4096, 14336, 16),
    ("lm_head", "q6_k", 128256, 4096, 1),
]


# the 8B's prefill matmuls (n x k of the weight): q|k|v, o, gate|up, down
GEMM_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate|up", 28672, 4096), ("down", 4096, 14336))

SECTIONS = ("types", "kv2", "kq8", "batch", "step", "attention", "small", "gemm", "launch")


def cublas_seconds(m: int, n: int, k: int, reps: int = 10) -> float | None:
    """The same f16 matmul through cuBLAS (PyTorch's a @ b.T, f32 accumulation), where PyTorch is
    installed (ember does not depend on it): the comparison behind the choice of own mma kernels."""
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(n, k, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b.T
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            a @ b.T
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def run(out_path: str | None = None, sections=SECTIONS) -> dict:
    dev = Device()
    res: dict = {"device": dev.name, "arch": dev.arch, "sms": dev.sm_count, "date": time.strftime("%Y-%m-%d")}
    print(f"device: {dev.name} ({dev.arch}, {dev.sm_count} SMs, L2 {dev.l2_bytes >> 20} MiB)")
    b = _Bench(dev, Stream(), np.random.default_rng(0), res)
    ceil = b.ceil = copy_ceiling(dev)
    res["copy_TBps"] = ceil / 1e12
    print(f"device-to-device copy: {ceil / 1e12:.2f} TB/s (read + write)")
    for name in SECTIONS:  # in this order, whichever order they are asked for in
        if name in sections:
            _SECTION_RUNS[name](b)
    res["rows"] = b.rows
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return res


class _Bench:
    """One run: the device and stream, the random numbers, the copy ceiling, the results."""

    def __init__(self, dev: Device, stream: Stream, rng: np.random.Generator, res: dict):
        self.dev, self.stream, self.rng, self.res = dev, stream, rng, res
        self.ceil = 0.0
        self.rows: list[dict] = []

    def rec(self, kind: str, name: str, t: float, nbytes: int, **kw) -> None:
        bw = nbytes / t
        self.rows.append(dict(kind=kind, name=name, us=t * 1e6, GBps=bw / 1e9, share=bw / self.ceil, **kw))
        extra = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"  {kind:<10} {name:<34} {t * 1e6:9.2f} us  {bw / 1e9:8.1f} GB/s  {100 * bw / self.ceil:5.1f}%  {extra}")

    def matvec(self, tname: str, rows: int, cols: int, **kw) -> tuple[float, int]:
        return bench_matvec(self.dev, self.stream, self.rng, tname, rows, cols, **kw)

    def time(self, body, n_inner: int, replays: int = 7) -> float:
        return _time_graph(self.dev, self.stream, body, n_inner, replays)


def _types(b: _Bench) -> None:
    # matvec: quant types on the big 8B shape, batch 1
    print("matvec, batch 1, [14336 x 4096] (ffn gate/up of an 8B model), staged kernel:")
    for tname in ("q4_0", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "f16"):
        t, nb = b.matvec(tname, 14336, 4096, variant="staged")
        b.rec("matvec", f"{tname} 14336x4096 b1 staged", t, nb)


def _kv2(b: _Bench) -> None:
    print("matvec Q4_K / Q5_K, column-resident kv2 kernel (unroll, prefetch, rows per block) vs staged:")
    for tname in ("q4_k", "q5_k"):
        for rows, cols in ((4096, 4096), (14336, 4096), (1024, 4096), (4096, 14336)):
            for u, pf in ((4, False), (8, False), (2, True), (4, True)):
                for rpb in (None, 8, 16):
                    if rpb is not None and rpb % u:
                        continue
                    t, nb = b.matvec(tname, rows, cols, variant="kv2", unroll=u, prefetch=pf, rows_per_block=rpb)
                    b.rec("matvec", f"{tname} {rows}x{cols} b1 kv2{'p' if pf else ''} u{u} rpb{rpb or 'auto'}", t, nb)
            t, nb = b.matvec(tname, rows, cols, variant="staged")
            b.rec("matvec", f"{tname} {rows}x{cols} b1 staged", t, nb)
            for kw in (dict(variant="kv2", unroll=4), dict(variant="staged")):
                t, nb = b.matvec(tname, rows, cols, batch=2, **kw)
                b.rec("matvec", f"{tname} {rows}x{cols} b2 {kw['variant']}", t, nb)


def _kq8(b: _Bench) -> None:
    print("matvec Q4_K / Q5_K, int8 x (kq8: unroll, prefetch, rows per block):")
    for tname in ("q4_k", "q5_k", "q6_k"):
        for rows, cols in ((4096, 4096), (14336, 4096), (1024, 4096), (4096, 14336), (20480, 2560), (2560, 10240),
                           (1024, 2560), (128256, 4096)):
            full = tname == "q4_k" and (rows, cols) == (14336, 4096)  # every variant on one shape
            for batch, u, pf in sorted(ops.KQ8_VARIANTS):
                if not full and (batch > 1 or (u, pf) not in ((4, True), (2, True), (4, False))):
                    continue
                for rpb in (None, 8, 16, 32) if full else (None, 8, 16):
                    if rpb is not None and rpb % u:
                        continue
                    t, nb = b.matvec(tname, rows, cols, batch=batch, int8=True, unroll=u, prefetch=pf,
                                     rows_per_block=rpb)
                    variant = f"kq8{'p' if pf else ''} u{u} rpb{rpb or 'auto'}"
                    b.rec("matvec", f"{tname} {rows}x{cols} b{batch} {variant}", t, nb)


def _batch(b: _Bench) -> None:
    for batch in (4, 8):
        t, nb = b.matvec("q4_k", 14336, 4096, batch=batch, variant="staged")
        b.rec("matvec", f"q4_k 14336x4096 b{batch} staged", t, nb)


def _step(b: _Bench) -> None:
    print("llama-8B Q4_K_M decode step, matvecs only (default variant choice):")
    total = 0.0
    total_bytes = 0
    seen: dict = {}
    for _name, tname, rows, cols, count in LLAMA8B:
        key = (tname, rows, cols)
        if key not in seen:
            seen[key] = b.matvec(tname, rows, cols)
            b.rec("matvec", f"{tname} {rows}x{cols} b1 (auto)", *seen[key])
        t, nb = seen[key]
        total += t * count
        total_bytes += nb * count
    total8 = 0.0
    for _name, tname, rows, cols, count in LLAMA8B:
        if tname in ("q4_k", "q5_k", "q6_k"):  # every K-quant (Q6_K repacked on upload)
            t, nb = b.matvec(tname, rows, cols, int8=True)
            b.rec("matvec", f"{tname} {rows}x{cols} b1 kq8 (default)", t, nb)
        else:
            t, nb = seen[(tname, rows, cols)]
        total8 += t * count
    b.res["llama8b_matvec_int8_ms"] = total8 * 1e3
    print(f"  8B step with int8 x: {total8 * 1e3:.3f} ms = {total_bytes / total8 / 1e9:.0f} GB/s")
    b.res["llama8b_matvec_ms"] = total * 1e3
    b.res["llama8b_matvec_GB"] = total_bytes / 1e9
    print(f"  8B step: {total_bytes / 1e9:.2f} GB of weights in {total * 1e3:.3f} ms = "
          f"{total_bytes / total / 1e9:.0f} GB/s -> at most {1 / total:.0f} tok/s from the matvecs alone "
          f"(bandwidth limit {b.ceil / total_bytes:.0f} tok/s)")


def _attention(b: _Bench) -> None:
    # attention decode
    dev, rng = b.dev, b.rng
    print("paged attention decode (fp16 KV, 32 q heads, 8 kv heads, D 128, block 16):")
    for L, B in ((4096, 1), (32768, 1), (4096, 8), (1024, 64)):
        hq, hk, d, bs = 32, 8, 128, 16
        nblk = B * (L // bs)
        kc = dev.empty((nblk * bs, hk, d), np.float16)
        vc = dev.empty((nblk * bs, hk, d), np.float16)
        kc.fill_bytes(0x3C)
        vc.fill_bytes(0x3C)
        tables = dev.to_device(rng.permutation(nblk).astype(np.int32).reshape(B, L // bs))
        q = dev.to_device(rng.normal(0, 1, (B, hq, d)).astype(np.float32))
        seq = dev.to_device(np.arange(B, dtype=np.int32))
        pos = dev.to_device(np.full(B, L - 1, np.int32))
        out = dev.empty((B, hq, d))

        body = functools.partial(ops.attention, dev, q, kc, vc, tables, seq, pos, out, rows=B, heads=hq,
                                 kv_heads=hk, head_dim=d, block_size=bs, max_blocks=L // bs, max_keys=L,
                                 scale=0.088, stream=b.stream)
        t = b.time(body, 1, replays=9)
        b.rec("attention", f"ctx {L} x {B} seqs", t, 2 * B * L * hk * d * 2)
        kc.free()
        vc.free()


def _small(b: _Bench) -> None:
    # small kernels: latency
    dev, rng, stream = b.dev, b.rng, b.stream
    print("small kernels (20 launches per graph; time per launch):")
    x = dev.to_device(rng.normal(0, 1, (64, 4096)).astype(np.float32))
    w = dev.to_device(np.ones(4096, np.float32))
    y = dev.empty((64, 4096))
    for n in (1, 64):
        def norms(n: int = n) -> None:
            for _ in range(20):
                ops.rms_norm(dev, x, w, y, eps=1e-5, rows=n, cols=4096, res=x, h_out=y, stream=stream)
        b.rec("rms_norm", f"residual+norm 4096 x {n}", b.time(norms, 20), n * 4096 * 4 * 4)
    qkv = dev.to_device(rng.normal(0, 1, (64, 6144)).astype(np.float32))
    posd = dev.to_device(np.arange(64, dtype=np.int32) + 1000)
    invf = dev.to_device((1.0 / 500000 ** (np.arange(0, 128, 2) / 128)).astype(np.float32))
    for n in (1, 64):
        def ropes(n: int = n) -> None:
            for _ in range(20):
                ops.rope(dev, qkv, qkv.view(4096, (64 * 6144 - 4096,)), posd, invf, n=n, hq=32, hk=8, head_dim=128,
                         neox=False, ldq=6144, ldk=6144, stream=stream)
        b.rec("rope", f"32+8 heads x {n}", b.time(ropes, 20), n * 40 * 128 * 8)
    logits = dev.to_device(rng.normal(0, 1, (8, 128256)).astype(np.float32))
    idx = dev.empty(8, np.int32)
    for n in (1, 8):
        def argmaxes(n: int = n) -> None:
            for _ in range(20):
                ops.argmax(dev, logits, idx, rows=n, vocab=128256, stream=stream)
        b.rec("argmax", f"vocab 128256 x {n}", b.time(argmaxes, 20), n * 128256 * 4)
    emb_raw = _rand_weights(rng, "q4_k", 128256, 4096)
    emb = ops.QuantMatrix.upload(dev, emb_raw, "q4_k", 128256, 4096)
    ids = dev.to_device(rng.integers(0, 128256, 64).astype(np.int32))
    eo = dev.empty((64, 4096))
    for n in (1, 64):
        def embeds(n: int = n) -> None:
            for _ in range(20):
                ops.dequant_rows(dev, emb, eo, ids, n=n, stream=stream)
        b.rec("embed", f"q4_k rows 4096 x {n}", b.time(embeds, 20), n * (ops.row_nbytes("q4_k", 4096) + 4096 * 4))


def _gemm(b: _Bench) -> None:
    dev, rng = b.dev, b.rng
    print("prefill matmul, f16 inputs, f32 accumulation (m tokens x n x k): ember's mma.sync kernel, then cuBLAS")
    for m in (2048, 512, 64):
        for name, n, k in GEMM_SHAPES:
            x = dev.to_device(rng.normal(0, 1, (m, k)).astype(np.float16).view(np.uint16))
            w = dev.to_device(rng.normal(0, 0.02, (n, k)).astype(np.float16).view(np.uint16))
            c = dev.empty((m, n))
            t = b.time(functools.partial(ops.gemm, dev, x, w, c, m=m, n=n, k=k, stream=b.stream), 1)
            nbytes = 2 * (m + n) * k + 4 * m * n
            b.rec("gemm", f"ember {name} {m}x{n}x{k}", t, nbytes, TFLOPS=round(2 * m * n * k / t / 1e12, 1))
            tc = cublas_seconds(m, n, k)
            if tc is not None:
                b.rec("gemm", f"cublas {name} {m}x{n}x{k}", tc, nbytes, TFLOPS=round(2 * m * n * k / tc / 1e12, 1))
            x.free()
            w.free()
            c.free()


def _launch(b: _Bench) -> None:
    b.res["launch"] = launch_probes(b.dev, b.stream)


_SECTION_RUNS = {"types": _types, "kv2": _kv2, "kq8": _kq8, "batch": _batch, "step": _step,
                 "attention": _attention, "small": _small, "gemm": _gemm, "launch": _launch}


def launch_probes(dev: Device, stream: Stream, links: int = 200, iters: int = 2000) -> dict:
    """Microseconds per dependent step (probe.cu): a graph of `links` kernels, with and without
    programmatic dependent launch, empty or passing a 640-float vector on; the same vector passed
    between the phases of one persistent grid through a barrier on a global counter; a cluster
    barrier followed by a read of another CTA's shared memory."""
    from .cuda_runtime import I32

    out: dict[str, float] = {}
    n = 640
    x, y = dev.empty((2 * n,)), dev.empty((2 * n,))
    x.zero()
    y.zero()
    empty, chain = dev.kernel("probe", "probe_empty"), dev.kernel("probe", "probe_chain")
    timer = Timer()

    def chain_us(kernel, grid: int, args, pdl: bool) -> float:  # per link of `links` launches, a graph
        def body():
            for i in range(links):
                kernel.launch((grid,), (128,), *args(i), stream=stream)
        was, PDL[0] = PDL[0], pdl
        try:
            return _time_graph(dev, stream, body, links) * 1e6
        finally:
            PDL[0] = was

    for pdl in (False, True):
        for grid in (1, 40, 132, 264):
            out[f"empty kernel, grid {grid}, pdl {pdl}"] = chain_us(empty, grid, lambda i: (0,), pdl)
        for grid in (40, 160):
            out[f"dependent kernel (640 floats), grid {grid}, pdl {pdl}"] = chain_us(
                chain, grid, lambda i: ((x, y, n) if i % 2 == 0 else (y, x, n)), pdl)
    barrier = dev.kernel("probe", "probe_grid_barrier")
    count = dev.empty((1,), np.uint32)
    for grid in (16, 66, dev.sm_count):
        count.zero()
        stream.synchronize()
        timer.start(stream)
        barrier.launch((grid,), (256,), count, x, I32(iters), I32(n), stream=stream)
        out[f"grid barrier (640 floats), {grid} blocks"] = timer.stop(stream) * 1e3 / iters
    cbar = dev.kernel("probe", "probe_cluster_barrier")
    drv = _driver()
    check(drv.cuFuncSetAttribute(
        cbar.handle, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
        "cuFuncSetAttribute")
    for ctas in (2, 8, 16):
        stream.synchronize()
        timer.start(stream)
        cbar.launch((ctas,), (256,), y, I32(iters), stream=stream, cluster=(ctas, 1, 1))
        out[f"cluster barrier + DSMEM read, {ctas} CTAs"] = timer.stop(stream) * 1e3 / iters
    for k, v in out.items():
        print(f"  launch     {k:<52} {v:7.3f} us")
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.kernels.bench")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of: {', '.join(SECTIONS)}")
    p.add_argument("--pdl", action="store_true", help="capture with programmatic dependent launch")
    a = p.parse_args(argv)
    PDL[0] = a.pdl
    unknown = set(a.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    run(a.out, a.sections.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
