"""`ember bench grammar`: what a JSON-schema grammar costs decoding.

The real engine (scheduler, numpy backend, one sequence, greedy) generates from the same prompt in
three modes, interleaved run by run (the order rotating) so that load from other processes hits all
of them alike:

- `grammar`: constrained by the schema, each mask computed on a worker thread while the backend
  step runs (what the worker does);
- `grammar-sync`: the same, with each mask computed when it is needed (its full cost on the
  critical path; `compute_us_per_mask` here is the mask's real cost);
- `plain`: unconstrained, as many tokens as the grammar run produced (end of sequence ignored).

Per run: decode tok/s from the first to the last streamed token (wall clock: what a client sees,
and what other processes' load disturbs), and the process's CPU milliseconds per generated token
(all threads; barely moved by other load, but blind to overlap). Medians and bests over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from pathlib import Path

import numpy as np

from .machine import machine_facts

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 24},
        "members": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 18, "maximum": 99},
                    "role": {"enum": ["admin", "developer", "guest"]},
                    "email": {"type": "string", "format": "email"},
                },
                "required": ["name", "age", "role", "email"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["team", "members"],
    "additionalProperties": False,
}
PROMPT = "A software team described as JSON:\n"


def add_grammar_parser(subparsers) -> None:
    g = subparsers.add_parser("grammar", help="decode tok/s with and without a JSON-schema grammar, and the mask cost")
    g.add_argument("--model", metavar="PATH", help="GGUF model file (default: the embedded model)")
    g.add_argument("--schema", metavar="FILE", help="JSON schema file (default: a team of two members)")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="cap per run (default 256)")
    g.add_argument("--repeat", type=int, default=5, metavar="R", help="runs per mode (default 5)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    g.set_defaults(func=cmd_grammar)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run(engine, tokenizer, grammar: str | None, max_tokens: int, ignore_eos: bool) -> tuple[str, int, float, str]:
    """(text, tokens, decode tok/s, finish reason) of one request through the engine."""
    from ..engine.requests import Delta, Failed, Finished, GenerationRequest, RequestHandle
    from ..engine.sampling import SamplingParams

    async def go():
        req = GenerationRequest(f"bench-{time.monotonic_ns()}", tokenizer.encode(PROMPT),
                                SamplingParams(temperature=0.0), max_tokens, grammar=grammar, ignore_eos=ignore_eos)
        h = RequestHandle(req, asyncio.get_running_loop())
        engine.submit(h)
        text, stamps = "", []
        async for e in h.events():
            if isinstance(e, Delta):
                text += e.text
                stamps += [time.perf_counter()] * len(e.tokens)
            elif isinstance(e, Failed):
                raise RuntimeError(e.message)
            elif isinstance(e, Finished):
                rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
                return text, len(stamps), rate, e.reason.value

    return asyncio.run(go())


def cmd_grammar(args: argparse.Namespace) -> int:
    from ..engine.constraints import grammar_from_json_schema
    from ..engine.limits import EngineLimits
    from ..engine.loop import Engine
    from ..metrics import Metrics
    from ..runtime import Runtime

    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    grammar = grammar_from_json_schema(schema)
    runtime = Runtime.load(args.model, kv_tokens=args.max_tokens + 256)
    tok = runtime.model.tokenizer
    engine = Engine(runtime.model, runtime.backend, EngineLimits(max_seqs=1, context=args.max_tokens + 256,
                                                                 loop_guard=False), metrics=Metrics())
    engine.start()
    load_before = os.getloadavg()
    try:
        rates, cpu_ms, costs, sample = _measure(engine, tok, grammar, args.max_tokens, max(1, args.repeat))
    finally:
        engine.shutdown()
    result = _result(args, runtime, rates, cpu_ms, costs, sample, load_before)
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def _measure(engine, tok, grammar: str, max_tokens: int, repeat: int):
    """Per mode: decode tok/s and CPU ms/token of each run, and the mask figures of each grammar run."""
    modes = ["grammar", "grammar-sync", "plain"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    cpu_ms: dict[str, list[float]] = {m: [] for m in modes}
    costs: dict[str, list[dict]] = {"grammar": [], "grammar-sync": []}
    text, n, _, reason = _run(engine, tok, grammar, max_tokens, False)  # warm-up, and the plain length
    for r in range(repeat):
        for mode in modes[r % 3:] + modes[: r % 3]:
            engine.constraints.overlap = mode == "grammar"
            engine.constraints.stats.reset()  # per-run figures
            cpu = _cpu_s()
            if mode == "plain":
                _, got, rate, _ = _run(engine, tok, None, n, True)
            else:
                _, got, rate, _ = _run(engine, tok, grammar, max_tokens, False)
                costs[mode].append(engine.constraints.stats.snapshot())
            cpu_ms[mode].append((_cpu_s() - cpu) * 1000 / max(got, 1))
            rates[mode].append(rate)
    return rates, cpu_ms, costs, {"text": text, "tokens": n, "finish_reason": reason}


def _result(args, runtime, rates, cpu_ms, costs, sample, load_before) -> dict:
    med = {k: round(float(np.median(v)), 2) for k, v in rates.items()}
    best = {k: round(float(np.max(v)), 2) for k, v in rates.items()}
    cpu = {k: round(float(np.median(v)), 2) for k, v in cpu_ms.items()}

    def cost(mode: str, key: str) -> float:
        return round(float(np.median([c[key] for c in costs[mode]])), 1)

    return {
        "model": runtime.model.path.name,
        "backend": runtime.backend.name,
        "tokens_per_run": sample["tokens"],
        "finish_reason": sample["finish_reason"],
        "output_parses": _parses(sample["text"]),
        "decode_tok_s_median": med,
        "decode_tok_s_best": best,
        "cpu_ms_per_token_median": cpu,
        "slowdown_pct_median": _pct(med["grammar"], med["plain"]),
        "slowdown_pct_best": _pct(best["grammar"], best["plain"]),
        "cpu_overhead_pct": _pct(cpu["plain"], cpu["grammar"]),
        "mask_us_per_token": cost("grammar-sync", "compute_us_per_mask"),
        "mask_wait_us_per_token_overlapped": cost("grammar", "wait_us_per_mask"),
        "runs": len(rates["plain"]),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "machine": machine_facts(),
    }


def _pct(slow: float, fast: float) -> float | None:
    """How much slower `slow` is than `fast` (rates), in percent."""
    return round(100 * (1 - slow / fast), 1) if fast else None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _print_table(r: dict) -> None:
    m, med, best, cpu = r["machine"], r["decode_tok_s_median"], r["decode_tok_s_best"], r["cpu_ms_per_token_median"]
    print(f"model     {r['model']} ({r['backend']} backend), {r['tokens_per_run']} tokens per run, "
          f"output parses: {r['output_parses']}, {r['runs']} runs per mode")
    print(f"machine   {m['cpu']}, {m['cores']} cores; load average {r['loadavg_before']} -> {r['loadavg_after']}")
    print("mode          tok/s median  tok/s best  CPU ms/token")
    for mode in ("plain", "grammar", "grammar-sync"):
        print(f"{mode:<13} {med[mode]:>12.2f} {best[mode]:>11.2f} {cpu[mode]:>13.2f}")
    print(f"grammar vs plain: {r['slowdown_pct_median']:+.1f}% (medians), {r['slowdown_pct_best']:+.1f}% (bests), "
          f"CPU {r['cpu_overhead_pct']:+.1f}%")
    print(f"mask: {r['mask_us_per_token']:.0f} us/token computed inline; "
          f"{r['mask_wait_us_per_token_overlapped']:.0f} us/token left on the critical path when overlapped")
