"""`ember bench spec`: agent-shaped sessions replayed against a real worker with speculative decoding
off and on, on the same machine, one worker at a time: decode tokens/s, tokens per step and the share
of drafted tokens accepted for each session, and a check that greedy outputs are identical.

The sessions are the shapes agents produce: a file edit that re-emits a file with one change, a quote
of a tool's output, a JSON object emitted again a turn later, and free prose (where drafts should
find little and must not cost more than they save). With `--spec replay:P` each session's first run is
recorded and the second replayed, each drafted token standing with probability P: the machinery's
speed at that acceptance on a model whose own text no drafter guesses (the synthetic ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .machine import machine_facts
from .workerproc import WorkerProcess

SPEC_COUNTERS = ("ember_spec_drafted_tokens_total", "ember_spec_accepted_tokens_total",
                 "ember_spec_verify_steps_total", "ember_generated_tokens_total")


def _file(lines: int) -> str:
    """A plausible source file of `lines` lines (deterministic)."""
    out = ["import math", "", ""]
    i = 0
    while len(out) < lines:
        out += [f"def shape_{i}(width, height, depth={i % 7 + 1}):",
                f'    """Volume and surface of box {i}."""',
                "    volume = width * height * depth",
                "    surface = 2 * (width * height + height * depth + width * depth)",
                f"    return round(volume, {i % 3}), math.sqrt(surface)", "", ""]
        i += 1
    return "\n".join(out[:lines]) + "\n"


def sessions(lines: int) -> dict[str, str]:
    """name -> the prompt whose greedy continuation is measured."""
    src = _file(lines)
    first = src.splitlines()[0]
    tool = "\n".join(f"2026-12-04T10:{m:02d}:{(7 * m) % 60:02d} worker-{m % 4} "
                     + (f"ERROR disk full writing /var/lib/kv/blk-{31 * m:05d}" if m % 5 == 0
                        else f"INFO step {m * 17} took {m % 9 + 1}.{m % 10} ms")
                     for m in range(max(8, lines // 4)))
    obj = json.dumps({"id": "task-4711", "status": "running", "owner": "ci-bot",
                      "steps": [{"name": f"step-{k}", "state": "ok", "seconds": k * 3 + 1} for k in range(8)],
                      "labels": ["agent", "nightly", "gpu"]}, indent=2)
    return {
        "file_edit": (f"Here is the file shapes.py:\n\n```python\n{src}```\n\nRename `surface` to `area` everywhere "
                      f"and print the whole file again.\n\n```python\n{first}\n"),
        "tool_quote": (f"The tool returned:\n\n{tool}\n\nQuote every line of the tool output above, in order, "
                       "exactly as it was printed:\n\n"),
        "json_again": (f"Last turn you produced this object:\n\n{obj}\n\nEmit the same object again, unchanged, "
                       "as JSON:\n\n"),
        "free_prose": "Write a short essay about the history of lighthouses on the coast of Brittany.\n\n",
    }


def _stream(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "ember", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    text, times = "", []
    t0 = time.monotonic()
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    text += ch["text"]
                    times.append(time.monotonic())
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"text": text, "ttft_s": (times[0] - t0) if times else None, "decode_s": decode_s, "chunks": len(times)}


def _counters(url: str) -> dict[str, float]:
    m = httpx.get(f"{url}/v1/stats", timeout=10).json()["metrics"]
    return {k: float(m.get(k, 0.0)) for k in SPEC_COUNTERS}


def run(args: argparse.Namespace) -> dict:
    prompts = sessions(args.lines)
    if args.sessions:
        prompts = {k: v for k, v in prompts.items() if k in args.sessions}
    common = ["--backend", args.backend, "--max-seqs", "1", "--kv-persist", "off"]
    common += ["--model", args.model] if args.model else []
    common += ["--spec-k", str(args.spec_k)] if getattr(args, "spec_k", None) else []
    results: dict[str, dict] = {name: {} for name in prompts}
    with tempfile.TemporaryDirectory(prefix="ember-bench-spec-") as tmp:
        for mode in ("off", args.spec):
            kind = mode.partition(":")[0]  # draft:PATH and mtp:PATH name no folder
            with WorkerProcess(*common, "--spec", mode, "--kv-dir", str(Path(tmp) / kind),
                               log_path=Path(tmp) / f"{kind}.log") as w:
                for name, prompt in prompts.items():
                    # warm: the prompt's prefill is cached, so decode is what is timed; the replay drafter
                    # records the whole greedy run here and replays it in the run measured
                    _stream(w.url, prompt, args.gen if kind == "replay" else 4)
                    before = _counters(w.url)
                    out = _stream(w.url, prompt, args.gen)
                    after = _counters(w.url)
                    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
                    gen = d["ember_generated_tokens_total"]
                    row = {"tokens": int(gen), "decode_tok_s": round((gen - 1) / out["decode_s"], 2)
                           if out["decode_s"] else None, "text": out["text"]}
                    if mode != "off":
                        drafted, accepted = d["ember_spec_drafted_tokens_total"], d["ember_spec_accepted_tokens_total"]
                        row.update(drafted=int(drafted), accepted=int(accepted),
                                   acceptance=round(accepted / drafted, 3) if drafted else None,
                                   tokens_per_step=round(gen / (gen - accepted), 2) if gen > accepted else None)
                    results[name][mode] = row
    report: dict = {"spec": args.spec, "backend": args.backend, "gen": args.gen, "sessions": {}}
    for name, r in results.items():
        off, on = r["off"], r[args.spec]
        report["sessions"][name] = {
            "identical": off["text"] == on["text"],
            "decode_tok_s_off": off["decode_tok_s"], "decode_tok_s_on": on["decode_tok_s"],
            "speedup": round(on["decode_tok_s"] / off["decode_tok_s"], 3)
            if on["decode_tok_s"] and off["decode_tok_s"] else None,
            **{k: on[k] for k in ("drafted", "accepted", "acceptance", "tokens_per_step")},
        }
    report["identical"] = all(s["identical"] for s in report["sessions"].values())
    report["machine"] = machine_facts()
    return report


def cmd_spec(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"speculative decoding ({report['spec']}) vs off, {report['backend']}, {report['gen']} greedy tokens "
              "a session:")
        for name, s in report["sessions"].items():
            print(f"  {name:<11} {s['decode_tok_s_off']} -> {s['decode_tok_s_on']} tok/s (x{s['speedup']}), "
                  f"{s['tokens_per_step']} tokens a step, {s['accepted']}/{s['drafted']} drafted accepted, "
                  f"{'identical' if s['identical'] else 'OUTPUT DIFFERS'}")
    if not report["identical"]:
        print("ember bench spec: greedy outputs differ with speculation on", file=sys.stderr)
        return 1
    return 0


def _drafter(text: str) -> str:
    """--spec as the worker takes it, less off (the bench compares against off itself); a PATH must be a file."""
    from ..engine.spec.replay import parse_replay

    kind, _, path = text.partition(":")
    if text in ("ngram", "suffix", "mtp") or (kind in ("draft", "mtp") and path and Path(path).expanduser().is_file()):
        return text
    if kind in ("draft", "mtp") and path:
        raise argparse.ArgumentTypeError(f"{path!r} is not a file")
    if kind == "replay":
        try:
            parse_replay(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("spec: ")) from None
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a drafter (ngram, suffix, draft:PATH, mtp, mtp:PATH, "
                                     "replay:P)")


def add_spec_parser(bsub) -> None:
    p = bsub.add_parser("spec", help="speculative decoding on agent-shaped sessions: speed, acceptance, and "
                                     "identical greedy output against spec off")
    p.add_argument("--model", metavar="PATH", help="GGUF model (default: the embedded model)")
    p.add_argument("--backend", choices=("numpy", "cuda"), default="numpy")
    p.add_argument("--spec", type=_drafter, default="suffix",
                   help="the drafter: ngram, suffix (default), draft:PATH (a small GGUF of the model's vocabulary), "
                        "mtp (the model's next-token layer, where it has one), mtp:PATH (that layer's own GGUF) or "
                        "replay:P (each session's first run replayed, each drafted token the recorded one with "
                        "probability P: speculation's speed at that acceptance, on any model)")
    p.add_argument("--spec-k", type=int, metavar="K", help="the longest draft (the worker's --spec-k; default its 8)")
    p.add_argument("--gen", type=int, default=128, help="greedy tokens a session (default 128)")
    p.add_argument("--lines", type=int, default=200, help="lines of the edited file (default 200)")
    p.add_argument("--sessions", nargs="+", choices=tuple(sessions(8)), help="only these sessions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_spec)
