"""`ember bench spec`: agent-shaped sessions replayed against a real worker with speculative decoding
off and on, on the same machine, one worker at a time: decode tokens/s, tokens per step and the share
of drafted tokens accepted for each session, and a check that greedy outputs are identical.

The sessions are the shapes agents produce: a file edit that re-emits a file with one change, a quote
of a tool's output, a JSON object emitted again a turn later, and free prose (where drafts should
find little and must not cost more than they save). With `--spec replay:P` each session's first run is
recorded and the second replayed, each drafted token standing with probability P: the machinery's
speed at that acceptance on a model whose own text no drafter guesses (the synthetic ones).

With `--llama-server PATH` the same sessions go to llama.cpp's llama-server on the same GGUF file,
started by the bench with its speculation off and then with each `--llama-spec` configuration (its
draftless modes, `ngram-mod` by default, or a draft model): its decode tokens/s measured the same way
(the stream's chunk times), its own counts of drafted and accepted tokens (the stream's last `timings`),
and each configuration's greedy output against llama-server's own with speculation off.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .machine import machine_facts
from .workerproc import LlamaServerProcess, WorkerProcess

SPEC_COUNTERS = ("ember_spec_drafted_tokens_total", "ember_spec_accepted_tokens_total",
                 "ember_spec_verify_steps_total", "ember_generated_tokens_total")
# llama-server's --spec-type values (common/speculative.cpp); the draft-* ones take a draft GGUF (TYPE:PATH;
# draft-mtp may use the model's own next-token layer)
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple",
                    "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
LLAMA_CTX = 16384  # llama-server's context: the longest session's prompt and its tokens, with room


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
    """One greedy completion, streamed: its text, the time to its first text and from there to its last,
    and llama-server's `timings` where the last chunk carries them."""
    body = {"model": "ember", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    text, times, timings = "", [], None
    t0 = time.monotonic()
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            timings = ev.get("timings") or timings
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    text += ch["text"]
                    times.append(time.monotonic())
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"text": text, "ttft_s": (times[0] - t0) if times else None, "decode_s": decode_s, "chunks": len(times),
            "timings": timings}


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
            kind = mode.partition(":")[0]  # draft:PATH, mtp:PATH and dspark:PATH name no folder
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
    if getattr(args, "llama_server", None):
        report["llama_server"] = run_llama(args, prompts)
        _beside(report)
    report["machine"] = machine_facts()
    return report


def llama_spec_args(spec: str) -> list[str]:
    """llama-server's flags for one --llama-spec: TYPE, or TYPE:DRAFT_GGUF for the draft-* types."""
    kind, _, path = spec.partition(":")
    return ["--spec-type", kind, *(["-md", path] if path else [])]


def run_llama(args: argparse.Namespace, prompts: dict[str, str]) -> dict:
    """The sessions against llama-server on the same model: speculation off, then each --llama-spec."""
    from ..model.embedded import default_model_path

    model = args.model or str(default_model_path(quiet=True))
    extra = shlex.split(args.llama_args or "")
    configs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ember-bench-spec-llama-") as tmp:
        for spec in ("none", *(args.llama_spec or ["ngram-mod"])):
            flags = [] if spec == "none" else llama_spec_args(spec)
            rows: dict[str, dict] = {}
            with LlamaServerProcess(args.llama_server, "-m", model, "-np", "1", "-c", str(LLAMA_CTX), *flags, *extra,
                                    log_path=Path(tmp) / f"llama-{len(configs)}.log") as srv:
                for name, prompt in prompts.items():
                    _stream(srv.url, prompt, 4)  # warm: the prompt's prefill cached in the slot
                    out = _stream(srv.url, prompt, args.gen)
                    t = out["timings"] or {}
                    n = int(t.get("predicted_n") or out["chunks"])
                    # (its timings leave the draft counts out where nothing was drafted)
                    drafted = None if spec == "none" else int(t.get("draft_n") or 0)
                    rows[name] = {"tokens": n, "decode_tok_s": round((n - 1) / out["decode_s"], 2)
                                  if out["decode_s"] else None, "text": out["text"], "drafted": drafted,
                                  "accepted": None if drafted is None else int(t.get("draft_n_accepted") or 0)}
            configs[spec] = rows
    off = configs["none"]
    for rows in configs.values():
        for name, row in rows.items():
            row["identical"] = row["text"] == off[name]["text"]
            row["speedup"] = (round(row["decode_tok_s"] / off[name]["decode_tok_s"], 3)
                              if row["decode_tok_s"] and off[name]["decode_tok_s"] else None)
    return {"path": str(args.llama_server), "args": extra, "configs": configs,
            "identical": all(r["identical"] for rows in configs.values() for r in rows.values())}


def _beside(report: dict) -> None:
    """Per session: ember's decode with speculation over llama-server's fastest speculative configuration's
    (issue 41's bar: 1.3x), and which that was."""
    llama = report["llama_server"]["configs"]
    for name, s in report["sessions"].items():
        runs = [(rows[name]["decode_tok_s"] or 0.0, spec) for spec, rows in llama.items() if spec != "none"]
        best, which = max(runs) if runs else (0.0, None)
        s["llama_best"] = which
        s["llama_best_tok_s"] = best or None
        s["vs_llama_best"] = round(s["decode_tok_s_on"] / best, 3) if best and s["decode_tok_s_on"] else None


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
        llama = report.get("llama_server")
        if llama:
            print(f"llama-server ({llama['path']} {' '.join(llama['args'])}), the same sessions:")
            for spec, rows in llama["configs"].items():
                for name, r in rows.items():
                    print(f"  {spec:<14} {name:<11} {r['decode_tok_s']} tok/s (x{r['speedup']} of its own off), "
                          f"{r['accepted']}/{r['drafted']} drafted accepted, "
                          f"{'identical' if r['identical'] else 'OUTPUT DIFFERS from its own off run'}")
            for name, s in report["sessions"].items():
                print(f"  ember {report['spec']} over llama-server {s['llama_best']}: {name} x{s['vs_llama_best']}")
    if not report["identical"]:
        print("ember bench spec: greedy outputs differ with speculation on", file=sys.stderr)
        return 1
    return 0


def _drafter(text: str) -> str:
    """--spec as the worker takes it, less off (the bench compares against off itself); a PATH must be a file."""
    from ..engine.spec.replay import parse_replay

    kind, _, path = text.partition(":")
    if text in ("ngram", "suffix", "mtp") or (kind in ("draft", "mtp", "dspark") and path
                                              and Path(path).expanduser().is_file()):
        return text
    if kind in ("draft", "mtp", "dspark") and path:
        raise argparse.ArgumentTypeError(f"{path!r} is not a file")
    if kind == "replay":
        try:
            parse_replay(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("spec: ")) from None
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a drafter (ngram, suffix, draft:PATH, mtp, mtp:PATH, "
                                     "dspark:PATH, replay:P)")


def _binary(text: str) -> str:
    path = Path(text).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable file")
    return str(path)


def _llama_spec(text: str) -> str:
    kind, _, path = text.partition(":")
    if kind not in LLAMA_SPEC_TYPES:
        raise argparse.ArgumentTypeError(f"{kind!r} is not a llama-server --spec-type ({', '.join(LLAMA_SPEC_TYPES)})")
    if kind.startswith("draft-") and kind != "draft-mtp" and not path:  # (draft-mtp: the model's own layer)
        raise argparse.ArgumentTypeError(f"{kind} needs its draft GGUF: {kind}:PATH")
    if path and not kind.startswith("draft-"):
        raise argparse.ArgumentTypeError(f"{kind} takes no PATH")
    if path and not Path(path).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{path!r} is not a file")
    return text


def add_spec_parser(bsub) -> None:
    p = bsub.add_parser("spec", help="speculative decoding on agent-shaped sessions: speed, acceptance, and "
                                     "identical greedy output against spec off")
    p.add_argument("--model", metavar="PATH", help="GGUF model (default: the embedded model)")
    p.add_argument("--backend", choices=("numpy", "cuda"), default="numpy")
    p.add_argument("--spec", type=_drafter, default="suffix",
                   help="the drafter: ngram, suffix (default), draft:PATH (a small GGUF of the model's vocabulary), "
                        "mtp (the model's next-token layer, where it has one), mtp:PATH (that layer's own GGUF), "
                        "dspark:PATH (a DeepSeek V4 DSpark block drafter) or "
                        "replay:P (each session's first run replayed, each drafted token the recorded one with "
                        "probability P: speculation's speed at that acceptance, on any model)")
    p.add_argument("--spec-k", type=int, metavar="K", help="the longest draft (the worker's --spec-k; default its 8)")
    p.add_argument("--gen", type=int, default=128, help="greedy tokens a session (default 128)")
    p.add_argument("--lines", type=int, default=200, help="lines of the edited file (default 200)")
    p.add_argument("--sessions", nargs="+", choices=tuple(sessions(8)), help="only these sessions")
    p.add_argument("--llama-server", type=_binary, metavar="PATH",
                   help="also replay the sessions against this llama-server on the same model: speculation off, then "
                        "each --llama-spec")
    p.add_argument("--llama-spec", action="append", type=_llama_spec, metavar="TYPE[:DRAFT]",
                   help=f"a llama-server --spec-type ({', '.join(LLAMA_SPEC_TYPES)}), with :PATH a draft GGUF for the "
                        "draft-* types; repeat for more (default: ngram-mod)")
    p.add_argument("--llama-args", metavar="ARGS", default="",
                   help="more llama-server flags, one string (e.g. '-ngl 99 -fa on' on a GPU)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_spec)
