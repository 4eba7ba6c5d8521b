"""`ember bench trace`: where a captured decode step's time goes, kernel by kernel, on the GPU.

A decode step is one CUDA graph of PDL-chained kernels, so a profiler that serializes kernels (ncu)
times each one alone, not what it adds to the chain. Here the kernels are built in their profiling
variant (EMBER_TRACE=1, common.cuh): block 0 of every kernel stamps %globaltimer when its wait for the
kernel before it returns. In a chain that wait returns when the kernel before is done, so the gap
between consecutive stamps is what each kernel costs the step (its work after the wait, and the hand
over to the next; the last kernel, the draw or the head, has no next and is left out). The step is replayed
--replays times after warm-up; figures are means. With --prefill N, one eager step that prefills N
tokens of a new sequence is timed instead: launched without PDL each kernel's wait returns as it starts, and
it starts when the one before has ended (one stream), so the gaps are again what each kernel costs, the
host's launching included where it falls behind. Inside the kernels whose phases are marked
(common.cuh TRACE_MARK), the SM cycles from the wait's return to the end of each phase are shown too,
for the step's last launch of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

from ember.ops.contract import ExitCode

# common.cuh TRACE_MARK: per marked kernel, its first mark (the wait returned) and what each next one ends
PHASES = {
    "decode attention (attn_warp)": (0, ["q ready, new key stored", "K/V rows landed", "keys scored and summed",
                                         "warps merged", "cluster parts shared", "cluster merge stored",
                                         "cluster left"]),
    "staged batch-1 matvec (qmv, qmvs)": (8, ["x staged", "rows decoded"]),
}


def add_trace_parser(bsub) -> None:
    t = bsub.add_parser("trace", help="cuda: each kernel's share of one captured decode step (profiling build)")
    t.add_argument("--model", metavar="PATH", required=True, help="GGUF model file")
    t.add_argument("--keys", type=int, default=40, metavar="N",
                   help="context length of the traced step, at least 3 (default 40)")
    t.add_argument("--rows", type=int, default=1, metavar="N", help="sequences decoding together (default 1)")
    t.add_argument("--replays", type=int, default=100, metavar="N", help="timed replays (default 100)")
    t.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="time an eager step prefilling N tokens instead of the captured decode step")
    t.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    t.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    for name, least in (("keys", 3), ("rows", 1), ("replays", 1), ("prefill", 0)):
        if getattr(args, name) < least:
            print(f"ember bench trace: --{name} must be at least {least}", file=sys.stderr)
            return 2
    os.environ["EMBER_TRACE"] = "1"  # before any module is built or loaded
    from ember.kernels.errors import CudaUnavailable

    try:
        result = trace_step(args.model, keys=args.keys, rows=args.rows, replays=args.replays, prefill=args.prefill)
    except CudaUnavailable as e:
        print(f"ember bench trace: no usable CUDA device ({e})", file=sys.stderr)
        return ExitCode.CONFIG
    if args.json:
        print(json.dumps(result))
        return 0
    what = f"a prefill of {args.prefill} tokens" if args.prefill else f"rows {args.rows}, {args.keys} keys"
    print(f"{result['model']}: {result['kernels']} kernels, {what}; first wait to last: {result['span_us']} us")
    for k in result["by_kernel"]:
        print(f"  {k['kernel']:<34} x{k['launches']:<4} {k['total_us']:>8.1f} us  ({k['mean_us']:.2f} us each)")
    for name, phases in result["phases"].items():
        print(f"  {name}, SM cycles after its wait: " + ", ".join(f"{p['phase']} {p['cycles']}" for p in phases))
    return 0


def trace_step(model_path: str, *, keys: int, rows: int, replays: int, prefill: int = 0) -> dict:
    """Capture the decode step of `rows` sequences at `keys` keys and time its kernels; prefill: time the
    eager step of a `prefill`-token prompt instead (see module doc)."""
    import numpy as np

    from ember.kernels.cuda_runtime import Device

    from ..backends.base import SeqChunk
    from ..backends.cuda import open_backend
    from ..model.loader import open_model
    from .gpu_speed import GREEDY

    model = open_model(model_path)
    bs = 16
    if prefill:
        keys, rows = prefill, 1
    per_seq = -(-(keys + 2) // bs)
    backend = open_backend(model.config, model.gguf, n_blocks=rows * per_seq + 2, block_size=bs,
                           max_rows=max(64, keys), max_seqs=max(rows, 1), device=Device())
    # DeepSeek V4's step draws its tokens after its graph: asked for logits, it launches the graph's kernels alone
    sample = None if model.config.hyper is not None else GREEDY
    dev = backend.dev
    if dev.trace is None:
        raise RuntimeError("the kernels were not built for tracing (EMBER_TRACE=1)")
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(rows)]
    # every sequence its own tokens, as in service: a mixture of experts then routes each row its own way
    # (rows of one token all take the same experts, and a batched step's expert tiles come out few and full)
    tokens = np.random.default_rng(0).integers(1, model.config.vocab_size, (rows, keys), dtype=np.int32)

    def step(pos: int) -> None:
        backend.forward([SeqChunk(tokens[s, pos:pos + 1], pos, t, "last", sample=sample)
                         for s, t in enumerate(tables)])

    if prefill:
        def replay() -> None:
            backend.forward([SeqChunk(tokens[0], 0, tables[0], "last", sample=sample, prefill=True)])
    else:
        for s, t in enumerate(tables):
            backend.forward([SeqChunk(tokens[s, : keys - 2], 0, t, "last", sample=sample)])
        step(keys - 2)  # run eagerly: modules loaded, the step's shape seen
    dev.launch_names.clear()
    dev.launch_shapes.clear()
    if prefill:
        replay()  # its launches, in order (and every module loaded)
    else:
        step(keys - 1)  # captured now (and replayed): its launches, in order
        graph = next(iter(backend._graphs.values()))[0]

        def replay() -> None:
            graph.launch()
            backend.stream.synchronize()
    names, shapes = list(dev.launch_names), list(dev.launch_shapes)
    released, clocks = _stamps(dev, replay, len(names), replays, warm=1 if prefill else 10)
    cost = np.diff(released, axis=1).mean(axis=0) / 1000.0  # kernel i: from its release to the next's
    by: dict[str, list[float]] = defaultdict(list)
    for name, c in zip(names, cost, strict=False):
        by[name].append(float(c))
    kernels: list[dict[str, Any]] = [{"kernel": k, "launches": len(v), "total_us": round(sum(v), 2),
                                      "mean_us": round(sum(v) / len(v), 2)} for k, v in by.items()]
    table = sorted(kernels, key=lambda d: -d["total_us"])
    phases = {}
    for name, (first, ends) in PHASES.items():
        got = [{"phase": p, "cycles": round(float((clocks[:, first + 1 + i] - clocks[:, first]).mean()))}
               for i, p in enumerate(ends) if (clocks[:, [first, first + 1 + i]] > 0).all()]
        if got:
            phases[name] = got
    return {"model": model.path.name, "device": dev.name, "kernels": len(names), "rows": rows, "keys": keys,
            "prefill": prefill,
            "phases": phases,
            "span_us": round(float((released[:, -1] - released[:, 0]).mean()) / 1000.0, 1),
            "by_kernel": table,
            "sequence": [{"kernel": n, "launch": sh, "us": round(float(c), 2)}
                         for n, sh, c in zip(names, shapes, cost, strict=False)]}


def _stamps(dev, replay, launched: int, replays: int, *, warm: int):
    """Replay the step warm + replays times; the timed replays' release stamps [replays, kernels] (ns) and
    their TRACE_MARK clocks [replays, 64]."""
    import numpy as np

    from ember.kernels.cuda_runtime import TRACE_MARKS

    stamps, marks = [], []
    for r in range(replays + warm):
        dev.trace.zero()
        replay()
        buf = dev.trace.to_host()
        n = int(buf[0]) // 2
        if n > (TRACE_MARKS - 2) // 2:
            raise RuntimeError(f"{n} kernels launched: more than the trace buffer holds ({(TRACE_MARKS - 2) // 2})")
        if n != launched:
            raise RuntimeError(f"{n} kernels stamped, {launched} launched")
        if r >= warm:
            stamps.append(buf[1:1 + 2 * n].reshape(n, 2)[:, 1].astype(np.int64))
            marks.append(buf[TRACE_MARKS:TRACE_MARKS + 64].astype(np.int64))
    return np.array(stamps), np.array(marks)
