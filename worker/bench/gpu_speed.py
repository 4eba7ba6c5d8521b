"""`ember bench speed --backend cuda`: prefill and decode tokens/s of the CUDA backend, llama-bench
style (pp: one prompt; tg: one stream generating from an empty context, as llama-bench's tg test
does; tg at P: the same after the P-token prompt; --streams N: N streams decoding together), timed
with device events on the backend's stream. Decode runs ahead as the server does (each step launched
before the previous step's tokens are read; --no-run-ahead waits instead). The first run of each
phase is a warm-up (module loads, graph captures) and is not counted; the median of the rest is
reported, with the single-stream share of the memory-bandwidth limit (every weight byte read once per
decode step, at the bandwidth a device-to-device copy reaches on this card) and peak device memory.
"""

from __future__ import annotations

import time

import numpy as np

from ..backends.base import DeviceSample, SampledToken, SeqChunk
from ..config import parse_size

COPY_BYTES = 1 << 30  # the device-to-device copy that measures the card's bandwidth (at most a tenth of what is free)
COPY_RUNS = 5
GREEDY = DeviceSample(0.0, 0, 1.0, 0.0, 0, 0)


EXPERT_TENSORS = ("_exps.", "_exps_")  # a mixture of experts' [experts, ...] tensors (and their biases)


def weight_bytes_per_token(model) -> int:
    """Bytes a decode step of one token reads: every tensor but the embedding table (one row of it is
    read), unless the output projection is the tied embedding; of a mixture of experts' tensors, the
    share of the experts a token goes through (the active parameters)."""
    g, cfg = model.gguf, model.config
    tied = "output.weight" not in g.tensors
    active = cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 1.0
    total = 0.0
    for name, t in g.tensors.items():
        if tied or name != "token_embd.weight":
            total += t.nbytes * (active if any(e in name for e in EXPERT_TENSORS) else 1.0)
    return int(total)


class _Seqs:
    """Contiguous block tables for benchmark sequences (no prefix cache: every run computes)."""

    def __init__(self, block_size: int, n_blocks: int):
        self.bs, self.n_blocks, self.next = block_size, n_blocks, 0

    def table(self, length: int) -> list[int]:
        need = -(-length // self.bs)
        if self.next + need > self.n_blocks:
            self.next = 0  # reuse from the start: the previous run's contents do not matter
        t = list(range(self.next, self.next + need))
        self.next += need
        return t


def run(args) -> dict:
    from ember.kernels.cuda_runtime import Timer

    from ..model.loader import open_model

    t0 = time.perf_counter()
    model = open_model(args.model)
    cfg = model.config
    streams = max(1, args.streams)
    chunk = min(args.prefill_chunk, args.prompt_tokens)
    per_seq = args.prompt_tokens + args.gen_tokens + 1
    stream_ctx = args.stream_prompt + args.gen_tokens + 1
    bs = 16
    gpu_mem = None if args.gpu_mem is None else parse_size(args.gpu_mem, "--gpu-mem")
    backend = _backend(args, model, bs, chunk, streams, per_seq, stream_ctx, gpu_mem)
    n_blocks = backend.n_blocks
    load_s = time.perf_counter() - t0
    peak = backend.device_memory()[0]
    rng = np.random.default_rng(args.seed)
    vocab = min(cfg.vocab_size, 32000)
    seqs = _Seqs(bs, n_blocks)
    timer = Timer()

    def timed(fn) -> float:
        timer.start(backend.stream)
        fn()
        return timer.stop(backend.stream) / 1000.0

    def prefill(prompt, table, last_sample=GREEDY):
        out = None
        for s in range(0, len(prompt), chunk):
            part = prompt[s : s + chunk]
            last = s + len(part) == len(prompt)
            (out,) = backend.forward([SeqChunk(part, s, table, "last" if last else "none",
                                               sample=last_sample if last else None)])
        return out

    pp, tg, tg_ctx, multi = [], [], [], []
    for r in range(args.repeat + 1):  # run 0 warms up
        prompt = rng.integers(1, vocab, args.prompt_tokens).astype(np.int32)
        table = seqs.table(per_seq)
        result: dict = {}
        secs = timed(lambda: result.setdefault("tok", prefill(prompt, table)))  # noqa: B023  (called right here)
        tok = _token(result["tok"])
        if r:
            pp.append(args.prompt_tokens / secs)

        def decode_one(start: int, tab: list[int]):
            nonlocal tok
            tok = decode(backend, [tok], start, [tab], args.gen_tokens, args.run_ahead)[-1][0]

        secs = timed(lambda: decode_one(args.prompt_tokens, table))  # noqa: B023  (called right here)
        if r:
            tg_ctx.append(args.gen_tokens / secs)
        tok = int(rng.integers(1, vocab))
        secs = timed(lambda: decode_one(0, seqs.table(args.gen_tokens + 1)))
        if r:
            tg.append(args.gen_tokens / secs)
        peak = max(peak, backend.device_memory()[0])
    if streams > 1:
        for r in range(args.repeat + 1):
            tables = [seqs.table(stream_ctx) for _ in range(streams)]
            toks = [_token(prefill(rng.integers(1, vocab, args.stream_prompt).astype(np.int32), t)) for t in tables]

            def decode_many():
                nonlocal toks
                toks = decode(backend, toks, args.stream_prompt, tables,  # noqa: B023  (runs in this iteration)
                              args.gen_tokens, args.run_ahead)[-1]

            secs = timed(decode_many)
            if r:
                multi.append(streams * args.gen_tokens / secs)
            peak = max(peak, backend.device_memory()[0])
    graph_ms = _graph_step_ms(backend, timer)
    wbytes = weight_bytes_per_token(model)
    bandwidth = copy_bandwidth(backend.dev, backend.stream, timer)
    limit = bandwidth / wbytes
    tg_med = float(np.median(tg))
    out = {
        "model": model.path.name, "backend": "cuda", "device": backend.dev.name,
        "kv_dtype": "f16" if backend.block_dtype == np.float16 else "f32",  # the pool's, as the backend keeps it
        "f16_weights": backend.f16_weights, "int8": backend.int8_activations, "pdl": backend.pdl,
        "run_ahead": args.run_ahead and backend.runs_ahead,
        f"pp{args.prompt_tokens}_tok_s": round(float(np.median(pp)), 1), "prefill_chunk": chunk,
        f"tg{args.gen_tokens}_tok_s": round(tg_med, 1),
        f"tg{args.gen_tokens}_at_{args.prompt_tokens}_tok_s": round(float(np.median(tg_ctx)), 1),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bandwidth_limit_tok_s": round(limit, 1), "tg_share_of_limit": round(tg_med / limit, 3),
        "weight_bytes": wbytes, "load_s": round(load_s, 2), "peak_device_mb": round(peak / 2**20),
        "gpu_mem_mb": None if gpu_mem is None else gpu_mem >> 20, "kv_pool_tokens": backend.n_blocks * bs,
        # what the pool keeps a token, every layer's (its bytes over its blocks, the trash block included)
        "kv_bytes_per_token": round(backend.memory.kv_pool / ((backend.n_blocks + 1) * bs)),
        "graph_replays": backend.graph_replays, "runs": len(pp),
        "decode_graph_gpu_ms": graph_ms,  # per captured step, replayed back to back: the device's share
    }
    if multi:
        out[f"decode_{streams}_streams_tok_s"] = round(float(np.median(multi)), 1)
    return out


def _backend(args, model, bs: int, chunk: int, streams: int, per_seq: int, stream_ctx: int, gpu_mem: int | None):
    """The run's CUDA backend: a KV pool sized to the run (two sequences of per_seq tokens and the streams'),
    or with --gpu-mem the worker's automatic pool within it, which must hold the run's sequences at once
    (the prompt's, the decode from position 0, the streams'; later runs reuse the pool from its start)."""
    from ..backends.cuda import open_backend

    def blocks(tokens: int) -> int:
        return -(-tokens // bs)

    streams_blocks = streams * blocks(stream_ctx) if streams > 1 else 0
    backend = open_backend(model.config, model.gguf,
                           n_blocks=None if gpu_mem else 2 * blocks(per_seq) + streams * blocks(stream_ctx) + 2,
                           block_size=bs, max_rows=max(chunk, streams), max_seqs=max(streams, 1),
                           kv_dtype=args.kv_dtype, f16_weights=args.f16_weights, int8_activations=args.int8,
                           pdl=args.pdl, gpu_mem=gpu_mem)
    need = blocks(per_seq) + blocks(args.gen_tokens + 1) + streams_blocks
    if backend.n_blocks < need:
        raise TooLittleMemory(f"the KV pool within --gpu-mem {args.gpu_mem} holds {backend.n_blocks * bs} tokens "
                              f"(f16 weight copy {'kept' if backend.f16_weights else 'off'}); this run needs "
                              f"{need * bs} (fewer --prompt-tokens or --streams, or --f16-weights off)")
    return backend


class TooLittleMemory(Exception):
    """The KV pool that --gpu-mem leaves cannot hold the run asked for."""


def copy_bandwidth(dev, stream, timer) -> float:
    """This card's memory bandwidth as a copy reaches it (bytes/s: each byte read once and written once),
    the median of COPY_RUNS device-to-device copies of up to COPY_BYTES after one unmeasured: the limit a
    decode step that reads every weight once is held to, measured on the card it runs on."""
    free, _ = dev.memory_info()
    n = max(1 << 20, min(COPY_BYTES, free // 10)) // 2 * 2
    src, dst = dev.empty((n,), np.uint8), dev.empty((n,), np.uint8)
    try:
        runs = []
        for r in range(COPY_RUNS + 1):
            timer.start(stream)
            dst.copy_from(src, n, stream)
            ms = timer.stop(stream)
            if r:
                runs.append(2 * n / (ms / 1000.0))
        return float(np.median(runs))
    finally:
        src.free()
        dst.free()


def decode(backend, tokens: list[int], start: int, tables: list[list[int]], steps: int,
           run_ahead: bool) -> list[list[int]]:
    """`steps` greedy decode steps of len(tokens) streams; every step's tokens. run_ahead: as the
    server does, step n + 1 is launched (its tokens fed from step n's draws on the device) before step
    n's tokens are read back."""
    n, out = len(tokens), []

    def step(i, toks):
        return [SeqChunk(np.array([t], np.int32), start + i, tab, "last", sample=GREEDY)
                for t, tab in zip(toks, tables, strict=True)]

    if not (run_ahead and backend.runs_ahead) or steps < 1:
        for i in range(steps):
            tokens = [_token(t) for t in backend.forward(step(i, tokens))]
            out.append(tokens)
        return out
    pending = backend.submit(step(0, tokens))
    for i in range(1, steps):
        nxt = backend.submit(step(i, [0] * n), feed=list(range(n)))
        out.append([int(t) for t in pending.result()])  # read (as a server streams them) while the next step runs
        pending = nxt
    out.append([int(t) for t in pending.result()])
    return out


def _token(out) -> int:
    """A greedy step's token: drawn on the device, or the argmax of the logits a backend returned instead
    (DeepSeek V4's eager step samples on the host)."""
    return int(out) if isinstance(out, SampledToken) else int(np.argmax(out[-1]))


def _graph_step_ms(backend, timer, replays: int = 50) -> dict:
    """Device time of each captured decode step, replayed back to back (no host work between):
    what a step costs on the GPU, against which the tok/s above shows the host's share."""
    out = {}
    shapes: dict = {}
    for (rows, stride, _slot), (graph, _) in sorted(backend._graphs.items(), reverse=True):
        shapes[rows, stride] = graph  # either slot's graph: the same step on the other inputs (slot 0's kept)
    for (rows, stride), graph in sorted(shapes.items()):
        timer.start(backend.stream)
        for _ in range(replays):
            graph.launch()
        out[f"b{rows}_blocks{stride}"] = round(timer.stop(backend.stream) / replays, 4)
    return out
