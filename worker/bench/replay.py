"""Session-shape replay: the conversation shapes coding agents produce, against real workers.

Shapes: a conversation that grows turn by turn; history-compression truncation (a cut well inside
the conversation, then suffixes of the given sizes); tiny-suffix truncations; a client killed
halfway through a long suffix prefill while a second stream decodes; a worker killed with SIGKILL
and restarted between turns. Prompts are token ids (/v1/completions), so cut points are exact.

Checked: every request ends as expected; cached-token counts equal what the shapes predict; every
temperature-0 output equals a clean reference worker's output for the same prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from .workerproc import WorkerProcess

BLOCK = 16


@dataclass
class Shapes:
    base: int = 1200  # tokens of the first conversation turn
    turns: int = 3
    answer: int = 16  # tokens generated per turn
    suffixes: tuple[int, ...] = (1500, 8000, 22000)
    tiny_suffixes: tuple[int, ...] = (1, 3, 7)
    kill_suffix: int = 3000


@dataclass
class Check:
    name: str
    prompt_tokens: int
    cached: int
    expected_cached: int | str
    output_matches_reference: bool | None = None

    @property
    def ok(self) -> bool:
        if isinstance(self.expected_cached, str):  # ">=N"
            return self.cached >= int(self.expected_cached[2:])
        return self.cached == self.expected_cached and self.output_matches_reference is not False


@dataclass
class ReplayReport:
    checks: list[Check] = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and self.outcomes.get("failed", 0) == 0


def _complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 3600) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "logprobs": 0}, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _predict(prev_computed: list[int], prompt: list[int]) -> int:
    """Full blocks of `prompt` that the previous work computed (the last token is always recomputed)."""
    lcp = 0
    for a, b in zip(prev_computed, prompt, strict=False):
        if a != b:
            break
        lcp += 1
    return min(lcp, len(prompt) - 1) // BLOCK * BLOCK


def _wait_writes(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/v1/stats", timeout=10).json()["metrics"]
        if stats.get("ember_kv_write_queue_depth", 0) == 0:
            return
        time.sleep(0.05)


def _outcomes(url: str) -> dict[str, float]:
    stats = httpx.get(f"{url}/v1/stats", timeout=10).json()["metrics"]
    return {o: stats.get(f"ember_requests_total_{o}", 0) for o in ("completed", "failed", "canceled", "refused")}


def _tokenizer(url: str):
    def tokenize(text: str) -> list[int]:
        r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False}, timeout=60)
        r.raise_for_status()
        return r.json()["tokens"]
    return tokenize


def run_replay(shapes: Shapes, workdir: Path, worker_args: list[str], seed: int = 0) -> ReplayReport:
    rng = np.random.default_rng(seed)
    vocab_lo, vocab_hi = 1000, 30000  # ordinary text tokens of the embedded vocabulary
    report = ReplayReport()
    kv = workdir / "kv"
    common = [*worker_args, "--kv-dir", str(kv), "--kv-persist", "all", "--max-seqs", "2"]
    ref = WorkerProcess(*worker_args, "--kv-dir", str(workdir / "ref-kv"), "--kv-persist", "off",
                        log_path=workdir / "reference.log").start()
    work = WorkerProcess(*common, log_path=workdir / "worker.log").start()
    try:
        def turn(name: str, prompt: list[int], computed: list[int], expected=None) -> list[int]:
            """Send `prompt`; `computed` is what earlier work is known to have computed. Returns the
            prompt plus the answer as an agent would resend it (text, tokenized again)."""
            resp = _complete(work.url, prompt, shapes.answer)
            out = resp["choices"][0]["text"]
            ref_out = _complete(ref.url, prompt, shapes.answer)["choices"][0]["text"]
            exp = _predict(computed, prompt) if expected is None else expected
            report.checks.append(Check(name, len(prompt), _cached(resp), exp, out == ref_out))
            return prompt + _tokenizer(work.url)(out)

        bos = [2]
        convo = bos + rng.integers(vocab_lo, vocab_hi, shapes.base).tolist()
        sent: list[int] = []
        for t in range(shapes.turns):  # growing conversation
            # the answer's ids as generated may tokenize differently as text: at least the
            # previous prompt's full blocks must be reused
            expected = None if t == 0 else f">={_predict(sent, convo)}"
            with_answer = turn(f"grow-{t}", convo, sent, expected)
            sent = convo
            convo = with_answer + rng.integers(vocab_lo, vocab_hi, 40).tolist()
        cut = len(convo) // 2
        for n in shapes.suffixes:  # history compression: cut well inside, then a long suffix
            prompt = convo[:cut] + rng.integers(vocab_lo, vocab_hi, n).tolist()
            turn(f"compress-{n}", prompt, convo)
        for n in shapes.tiny_suffixes:  # tiny-suffix truncations
            prompt = convo[: cut + 5 * n] + rng.integers(vocab_lo, vocab_hi, n).tolist()
            turn(f"tiny-{n}", prompt, convo)

        # a client killed halfway through a long prefill while a second stream decodes
        long_prompt = convo[:cut] + rng.integers(vocab_lo, vocab_hi, shapes.kill_suffix).tolist()
        decoder = threading.Thread(target=_complete, args=(work.url, convo[: cut // 2] + [4242], 64))
        decoder.start()
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up and closes its socket mid-prefill
            httpx.post(f"{work.url}/v1/completions", json={"model": "m", "prompt": long_prompt,
                                                           "max_tokens": 4, "temperature": 0}, timeout=1.5)
        decoder.join()
        turn("retry-after-abandon", long_prompt, convo, expected=f">={cut // BLOCK * BLOCK}")

        # worker SIGKILL between turns; the new worker restores from disk
        next_prompt = convo + rng.integers(vocab_lo, vocab_hi, 30).tolist()
        _wait_writes(work.url)
        before_kill = _outcomes(work.url)
        work.kill()
        work = WorkerProcess(*common, log_path=workdir / "worker-2.log").start()
        turn("after-kill-9", next_prompt, sent, expected=f">={_predict(sent, next_prompt)}")

        after = _outcomes(work.url)
        report.outcomes = {o: before_kill[o] + after[o] for o in after}
    finally:
        work.kill()
        ref.kill()
    return report


def add_replay_parser(bsub) -> None:
    p = bsub.add_parser("replay", help="replay agent session shapes (growth, compression, abandon, kill -9)")
    p.add_argument("--model", metavar="PATH")
    p.add_argument("--base", type=int, default=1200, help="first turn's tokens (default 1200)")
    p.add_argument("--suffixes", default="1500,8000,22000", help="compression suffix sizes (default 1500,8000,22000)")
    p.add_argument("--kill-suffix", type=int, default=3000, help="suffix abandoned mid-prefill (default 3000)")
    p.add_argument("--kv-mem", default="2GiB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    shapes = Shapes(base=args.base, suffixes=tuple(int(x) for x in args.suffixes.split(",") if x),
                    kill_suffix=args.kill_suffix)
    wargs = (["--model", args.model] if args.model else []) + ["--kv-mem", args.kv_mem]
    with tempfile.TemporaryDirectory(prefix="ember-replay-") as tmp:
        report = run_replay(shapes, Path(tmp), wargs)
    rows = [{"shape": c.name, "prompt_tokens": c.prompt_tokens, "cached": c.cached, "expected": c.expected_cached,
             "output_matches_reference": c.output_matches_reference, "ok": c.ok} for c in report.checks]
    if args.json:
        print(json.dumps({"ok": report.ok, "checks": rows, "outcomes": report.outcomes}))
    else:
        for r in rows:
            print(f"{r['shape']:22} prompt {r['prompt_tokens']:>6}  cached {r['cached']:>6}  expected "
                  f"{str(r['expected']):>7}  same output {r['output_matches_reference']}  "
                  f"{'ok' if r['ok'] else 'FAIL'}")
        print(f"outcomes {report.outcomes}  ->  {'ok' if report.ok else 'FAIL'}")
    return 0 if report.ok else 1
