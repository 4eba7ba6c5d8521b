"""`ember bench`: measured figures, recorded with the machine they ran on."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ember.ops.contract import ExitCode

from .machine import machine_facts, peak_rss_bytes


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks and synthetic models")
    bsub = bench.add_subparsers(dest="bench_verb", required=True)

    s = bsub.add_parser("speed", help="prefill and decode tokens/s of one sequence (like llama-bench pp/tg)")
    s.add_argument("--model", metavar="PATH", help="GGUF model file (default: the embedded model)")
    s.add_argument("--prompt-tokens", type=int, default=500, metavar="N", help="prefill length (default 500)")
    s.add_argument("--gen-tokens", type=int, default=128, metavar="N", help="decode length (default 128)")
    s.add_argument("--repeat", type=int, default=3, metavar="R", help="runs; the median is reported (default 3)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--backend", choices=("numpy", "cuda"), default="numpy", help="compute backend (default numpy)")
    s.add_argument("--streams", type=int, default=1, metavar="N",
                   help="cuda: also decode N streams together and report total tok/s (default 1: single stream only)")
    s.add_argument("--stream-prompt", type=int, default=128, metavar="N",
                   help="cuda: prompt tokens per stream (default 128)")
    s.add_argument("--prefill-chunk", type=int, default=2048, metavar="N",
                   help="cuda: prompt tokens per step (default 2048)")
    s.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16", help="cuda: KV cache precision (default f16)")
    s.add_argument("--f16-weights", choices=("auto", "on", "off"), default="auto",
                   help="cuda: keep a 16-bit copy of the weights for prefill and large batches (default auto)")
    s.add_argument("--gpu-mem", metavar="SIZE",
                   help="cuda: count only this much of the GPU as the device's, as the worker's --gpu-mem does (e.g. "
                        "24GiB for a 24 GB card); the KV pool is then the worker's automatic one, which must hold "
                        "the run (default: the whole device, a pool sized to the run)")
    s.add_argument("--no-int8", dest="int8", action="store_false",
                   help="cuda: float activations in the decode matvecs (default: int8, as llama.cpp)")
    s.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="cuda: capture decode steps without programmatic dependent launch")
    s.add_argument("--no-run-ahead", dest="run_ahead", action="store_false",
                   help="cuda: read each decode step's tokens before launching the next (default: the next step "
                        "is launched first, its tokens fed on the device, as the server does)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.set_defaults(func=cmd_speed)

    from .agents import add_agents_parser
    from .agree import add_agree_parser
    from .grammar import add_grammar_parser
    from .replay import add_replay_parser
    from .resume import add_resume_parser
    from .serve_load import add_serve_parser
    from .soak import add_soak_parser
    from .spec import add_spec_parser
    from .synth import add_make_model_parser
    from .trace import add_trace_parser

    add_serve_parser(bsub)
    add_resume_parser(bsub)
    add_replay_parser(bsub)
    add_make_model_parser(bsub)
    add_grammar_parser(bsub)
    add_trace_parser(bsub)
    add_soak_parser(bsub)
    add_spec_parser(bsub)
    add_agents_parser(bsub)
    add_agree_parser(bsub)


def cmd_speed(args: argparse.Namespace) -> int:
    import time

    for name in ("prompt_tokens", "gen_tokens", "repeat", "streams", "stream_prompt", "prefill_chunk"):
        if getattr(args, name) < 1:
            print(f"ember bench speed: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.backend == "cuda":
        return _speed_cuda(args)

    import numpy as np

    from ..runtime import Runtime

    t0 = time.perf_counter()
    runtime = Runtime.load(args.model, kv_tokens=args.prompt_tokens + args.gen_tokens + 32)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    tok = runtime.model.tokenizer
    candidates = np.array([i for i in range(min(tok.vocab_size, 32000)) if not tok.is_special(i)])
    prompt = [tok.bos_id] + rng.choice(candidates, size=args.prompt_tokens - 1).tolist()
    pp, tg = [], []
    for _ in range(max(1, args.repeat)):
        seq = runtime.sequence()
        t = time.perf_counter()
        logits = seq.prefill(prompt)
        pp.append(len(prompt) / (time.perf_counter() - t))
        token = int(np.argmax(logits))
        t = time.perf_counter()
        for _ in range(args.gen_tokens):
            (logits,) = seq.feed([token])
            token = int(np.argmax(logits[-1]))
        tg.append(args.gen_tokens / (time.perf_counter() - t))
        seq.close()
    result: dict[str, Any] = {
        "model": str(runtime.model.path.name),
        "backend": runtime.backend.name,
        f"pp{args.prompt_tokens}_tok_s": round(float(np.median(pp)), 1),
        f"tg{args.gen_tokens}_tok_s": round(float(np.median(tg)), 1),
        "load_s": round(load_s, 2),
        "peak_rss_mb": round(peak_rss_bytes() / 2**20),
        "runs": len(pp),
        "machine": machine_facts(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        m = result["machine"]
        print(f"model    {result['model']} ({result['backend']} backend)")
        print(f"machine  {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['blas']}")
        print(f"pp{args.prompt_tokens:<6} {result[f'pp{args.prompt_tokens}_tok_s']:>9.1f} tok/s")
        print(f"tg{args.gen_tokens:<6} {result[f'tg{args.gen_tokens}_tok_s']:>9.1f} tok/s")
        print(f"load     {result['load_s']:>9.2f} s")
        print(f"peak RSS {result['peak_rss_mb']:>9d} MB")
    return 0


def _speed_cuda(args: argparse.Namespace) -> int:
    from ember.kernels.errors import CudaUnavailable

    from ..config import ConfigError
    from ..model.gguf_file import ModelFileError
    from .gpu_speed import TooLittleMemory, run

    try:
        result = run(args)
    except CudaUnavailable as e:
        print(f"ember bench speed: no usable CUDA device ({e})", file=sys.stderr)
        return ExitCode.CONFIG
    except (TooLittleMemory, ModelFileError, ConfigError) as e:
        print(f"ember bench speed: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    result["machine"] = machine_facts()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model    {result['model']} (cuda backend, {result['device']}, KV {result['kv_dtype']})")
    for key, value in result.items():
        if key.endswith("_tok_s") or key in ("tg_share_of_limit", "load_s", "peak_device_mb", "graph_replays",
                                             "kv_pool_tokens", "f16_weights"):
            print(f"{key:<28} {value}")
    return 0
