"""`ember bench soak`: agent-shaped churn against real workers, phase by phase, in one run.

Each phase starts a fresh worker with the same model and flags but the one under test, and its own
empty KV dir: (1) baseline: the decoders alone; (2) churn with `--kv-persist off`; (3) churn with
the default persistence; (4) unless `--no-kill`: churn with persistence, a kill -9 mid-churn and a
restart on the same KV dir, then a long conversation's warm admit timed against its cold prefill
on the first worker, and the churn again. A phase's KV dir is removed when it ends (its logs stay).
The traffic itself is soak_load.py; the figures, the checks and the tables are soak_report.py.

Checked (the exit status): greedy outputs equal before and after the churn on the same worker,
and across phases, or parted only at a near-tie (greedy_drift.py: the paths' rounding on a model
whose leading tokens are that close, reported with its evidence); exactly one outcome per request in
the worker's log, `completed` for what the client saw complete and `canceled` for what it abandoned;
nothing failed; a kill -9 loses only the requests in flight, the restarted worker restores
conversations from disk and answers the long one as the cold worker did (or parts from it only at a
near-tie). Reported, never asserted: requests/s, TTFT and inter-token latency by
request class, decode tok/s per stream, cached-token share, persistence backlog, writes and drops,
and the ratios the issue's targets name.

With `--url` the soak drives a server it did not start (ember, llama-server, another that takes
token-id prompts on /v1/completions and has llama-server's /tokenize) with the same clients, prompts
and seeds: (1) baseline, (2) churn, (3) with `--restart-cmd`: the kill -9 mid-churn, the command,
the long conversation and the churn again. Its figures and checks are the client's alone (the
report names those that read a worker's log and did not apply); `--compare A.json B.json` puts two
such reports side by side against the issue's targets (soak_compare.py). Finding, killing and
restarting servers: soak_target.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from .greedy_drift import TOP, Answer, part
from .soak_load import (
    COMPLETED,
    EMBER,
    LOST,
    Churner,
    Decoder,
    Engine,
    RateEstimate,
    Record,
    Shape,
    Vocab,
    Window,
    prime,
    run_window,
    stream,
)
from .soak_report import Phase, build_report, build_url_report, read_events, render, rnd
from .soak_target import Running, Target, Workers, describe, wait_idle, wait_ready, wait_writes


@dataclass(frozen=True)
class Scale:
    """Defaults of the flags, for one kind of machine."""

    shape: Shape
    duration: float
    warmup: float
    long: int
    greedy: tuple[int, ...]
    greedy_tokens: int
    kv_mem: str | None = None  # worker flags; None: the worker's own default
    prefill_chunk: int | None = None


SCALES = {
    # the load on an H200: 150 s a phase, three churners with 4k-16k suffixes, two decoders
    "full": Scale(Shape(churners=3, decoders=2, conversation=8192, suffix=(4096, 16384), warm_suffix=(32, 512),
                        answer=32, decode_prompt=256, decode_tokens=256, abandon=0.5, truncate_share=0.5),
                  duration=150.0, warmup=10.0, long=16384, greedy=(64, 1024, 4096), greedy_tokens=32),
    # CI on two shared CPU cores with the numpy backend: small prefill chunks, so abandons land mid-prefill
    "small": Scale(Shape(churners=2, decoders=1, conversation=96, suffix=(64, 160), warm_suffix=(8, 24),
                         answer=3, decode_prompt=16, decode_tokens=8, abandon=0.5, truncate_share=0.5),
                   duration=3.0, warmup=0.0, long=192, greedy=(16, 40), greedy_tokens=4, kv_mem="64MiB",
                   prefill_chunk=32),
}


@dataclass
class Soak:
    shape: Shape
    duration: float
    warmup: float  # seconds of the same traffic before each phase's measured window (compiles, captures)
    long: int  # tokens of the conversation timed warm after the restart against cold
    kill: bool
    seed: int
    greedy: tuple[int, ...]  # prompt lengths of the greedy identity set
    greedy_tokens: int
    worker_args: list[str]
    notes: list[str] = field(default_factory=list)
    url: str | None = None  # a running server to drive instead of workers started here
    restart_cmd: str | None = None  # with url: the shell command that starts it again after the kill
    server_pid: int | None = None  # with url: the process to kill (default: the one listening on its port)
    ctx: int | None = None  # with url: plan prompts for at most this context
    ready_timeout: float = 900.0  # with url: seconds the server may take to be ready


class _Run:
    """One soak: its phases against a target (soak_target: workers started here, or a running server)."""

    def __init__(self, soak: Soak, target: Target, say, engine: Engine | None = None):
        self.soak, self.target, self.say = soak, target, say
        self.engine = engine
        self.learned = False
        self.vocab = Vocab([], [])
        self.greedy_prompts: list[list[int]] = []
        self.long_prompt: list[int] = []
        self.first_prompt: list[int] = []

    def start(self, phase: Phase) -> str:
        phase.setup.append([])
        url = self.target.up(phase)
        if not self.learned:
            self._learn(url)
        return url

    def _learn(self, url: str) -> None:
        """Token ids and sizes from the first server; later phases reuse them, so prompts are equal."""
        self.engine, self.vocab, self.learned = self.engine or Engine.of(url), Vocab.of(url), True
        s, sh, ctx = self.soak, self.soak.shape, self.engine.context
        most = ctx - sh.answer * 8 - 64  # a suffix leaves room for a cut and an abandon's answer
        s.shape = replace(sh, conversation=min(sh.conversation, ctx // 2),
                          suffix=(min(sh.suffix[0], most), min(sh.suffix[1], most)),
                          decode_tokens=min(sh.decode_tokens, ctx - sh.decode_prompt - 1))
        for k in ("conversation", "suffix", "decode_tokens"):
            if getattr(s.shape, k) != getattr(sh, k):
                s.notes.append(f"{k} {getattr(sh, k)} -> {getattr(s.shape, k)}: the server's context is {ctx}")
        rng = random.Random(f"{s.seed}-prompts")
        room = ctx - max(s.greedy_tokens, sh.answer) - 1
        self.greedy_prompts = [self.vocab.bos + self.vocab.random(rng, min(n, room)) for n in s.greedy]
        self.long_prompt = self.vocab.bos + self.vocab.random(rng, min(s.long, room - 16))
        self.first_prompt = self.vocab.bos + self.vocab.random(rng, 16)  # a restarted server's first request
        if len(self.long_prompt) < s.long:
            s.notes.append(f"long conversation {s.long} -> {len(self.long_prompt)} tokens: the server's context "
                           f"is {ctx}")

    def one(self, phase: Phase, url: str, prompt: list[int], max_tokens: int, cls: str,
            top: int = 0) -> tuple[Record, str]:
        async def go():
            async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10)) as http:
                rec = Record(cls, "setup", time.monotonic(), prompt)
                return rec, await stream(http, url, rec, max_tokens, top=top)

        rec, text = asyncio.run(go())
        phase.setup[-1].append(rec)
        if rec.outcome != COMPLETED:
            raise RuntimeError(f"{phase.name}: a {cls} request ended {rec.outcome}: {rec.error}")
        return rec, text

    def answer(self, phase: Phase, url: str, prompt: list[int], max_tokens: int, cls: str) -> tuple[Record, Answer]:
        """A greedy answer for an identity check, each token's leading alternatives with it (greedy_drift)."""
        rec, _ = self.one(phase, url, prompt, max_tokens, cls, top=TOP)
        return rec, Answer(tuple(t for t, _ in rec.answer), tuple(a for _, a in rec.answer))

    def on_disk(self, url: str, clients: list[Churner | Decoder]) -> list[dict]:
        """Each churner's conversation as it stands: its tokens, and how many of them the worker's KV store
        holds on disk, from the first (ember's /v1/kv/lookup); nothing from a server without it."""
        assert self.engine is not None
        if self.engine.server != EMBER:
            return []
        out = []
        for c in clients:
            if not isinstance(c, Churner):
                continue
            try:
                r = httpx.post(f"{url}/v1/kv/lookup", json={"tokens": c.convo}, timeout=10)
                r.raise_for_status()
                got = r.json()
            except (httpx.HTTPError, ValueError):
                continue  # an older worker, or one already going down
            out.append({"client": c.name, "tokens": len(c.convo), "full_blocks": got["full_blocks"],
                        "on_disk_tokens": got["on_disk"] * got["block_size"]})
        return out

    def greedy(self, phase: Phase, url: str) -> list[Answer]:
        return [self.answer(phase, url, p, self.soak.greedy_tokens, "greedy")[1] for p in self.greedy_prompts]

    def window(self, url: str, clients: list[Churner | Decoder], duration: float, rate: RateEstimate,
               kill=None) -> Window:
        assert self.engine is not None
        return asyncio.run(run_window(url, clients, duration, rate, kill=kill,
                                      sample_stats=self.engine.server == EMBER))

    def ready(self, phase: Phase, url: str, churn: bool) -> tuple[list[Churner | Decoder], RateEstimate]:
        """The phase's clients, their conversations primed and (on ember) written, after the warm-up
        traffic (whose requests are checked like the rest, and counted in no figure)."""
        sh, seed, engine = self.soak.shape, self.soak.seed, self.engine
        assert engine is not None
        churners = [Churner(i, sh, self.vocab, engine, seed) for i in range(sh.churners if churn else 0)]
        clients: list[Churner | Decoder] = [*churners, *(Decoder(i, sh, self.vocab, engine, seed)
                                                         for i in range(sh.decoders))]
        recs = asyncio.run(prime(url, churners))
        phase.setup[-1].extend(recs)
        bad = [r for r in recs if r.outcome != COMPLETED]
        if bad:
            raise RuntimeError(f"{phase.name}: priming a conversation ended {bad[0].outcome}: {bad[0].error}")
        wait_writes(engine, url)
        # the fastest of the conversations primed together: prefill shares steps with the others
        rate = RateEstimate(max((r.prompt_tokens / r.ttft for r in recs if r.ttft), default=1000.0))
        if self.soak.warmup > 0:
            phase.setup[-1].extend(self.window(url, clients, self.soak.warmup, rate).records)
            wait_idle(engine, url)
        return clients, rate

    def _said(self, phase: Phase, clients: list[Churner | Decoder], what: str) -> None:
        churners = sum(isinstance(c, Churner) for c in clients)
        self.say(f"{phase.name}: {churners} churners and {len(clients) - churners} decoders {what}")

    def phase(self, name: str, flags: list[str], churn: bool) -> Phase:
        ph = Phase(name, flags)
        self.say(f"{name}: " + ("the running server" if self.target.foreign
                                else f"starting the worker ({' '.join(flags) or 'default persistence'})"))
        url = self.start(ph)
        try:
            ph.greedy_before = self.greedy(ph, url)
            clients, rate = self.ready(ph, url, churn)
            self._said(ph, clients, f"for {self.soak.duration:g} s")
            ph.windows.append(self.window(url, clients, self.soak.duration, rate))
            assert self.engine is not None
            wait_idle(self.engine, url)
            ph.greedy_after = self.greedy(ph, url)
        finally:
            self.target.down(ph)
        return ph

    def kill_phase(self) -> Phase:
        ph = Phase("kill_restart", [])
        s = self.soak
        self.say(f"{ph.name}: {'the running server' if self.target.foreign else 'starting the worker'}; "
                 f"the long conversation ({len(self.long_prompt)} tokens) cold")
        url = self.start(ph)
        try:
            ph.greedy_before = self.greedy(ph, url)
            cold, cold_answer = self.answer(ph, url, self.long_prompt, s.shape.answer, "long")
            clients, rate = self.ready(ph, url, True)
            self._said(ph, clients, f"for {s.duration / 2:g} s, then kill -9")
            rc: list[int | None] = []
            found: list[dict] = []  # what a restart would find of each conversation, asked just before the kill

            def kill() -> None:
                found.extend(self.on_disk(url, clients))
                rc.append(self.target.kill())

            ph.windows.append(self.window(url, clients, s.duration / 2, rate, kill=kill))
            self.say(f"{ph.name}: " + ("running the restart command" if self.target.foreign
                                       else "restarting on the same KV dir") + "; the long conversation warm")
            url = self.start(ph)
            # the process's own first-request costs apart, as the cold server had them behind it too
            self.one(ph, url, self.first_prompt, 2, "setup")
            warm, warm_answer = self.answer(ph, url, self.long_prompt, s.shape.answer, "long")
            for c in clients:
                if isinstance(c, Churner):
                    c.resume = True
            ph.windows.append(self.window(url, clients, s.duration / 2, rate))
            assert self.engine is not None
            wait_idle(self.engine, url)
            ph.greedy_after = self.greedy(ph, url)
        finally:
            self.target.down(ph)
        # restore or recompute, where the worker says which it chose (it may recompute when that is faster)
        choice = {e.get("request_id"): e.get("choice") for e in read_events(ph.logs[1:])
                  if e["event"] == "kv_restore_choice"}
        ph.kill = {
            "killed_exit": rc[0] if rc else None,  # -9 when the kill found the server alive
            "in_flight_lost": sum(r.outcome == LOST for r in ph.windows[0].records),
            "completed_before_kill": sum(r.outcome == COMPLETED for r in ph.windows[0].records),
            "backlog_at_kill": ph.windows[0].stats_last.get("ember_kv_write_queue_depth"),
            "long_tokens": cold.prompt_tokens,
            "long_cold_ttft_s": rnd(cold.ttft), "long_warm_ttft_s": rnd(warm.ttft),
            "long_speedup": rnd(cold.ttft / warm.ttft if cold.ttft and warm.ttft else None, 2),
            "long_warm_cached_tokens": warm.cached,
            "long_restore_choice": choice.get(warm.rid),
            "long_identical": warm_answer.tokens == cold_answer.tokens,
            "long_parting": (p.as_dict() if (p := part(cold_answer, warm_answer)) else None),
            # each live conversation's blocks on disk at the kill (ember: /v1/kv/lookup; [] elsewhere)
            "on_disk_at_kill": found,
            # each live conversation's next turn after the restart: what the restarted server found of it
            "resumed": [{"client": r.client, "prompt_tokens": r.prompt_tokens, "cached": r.cached,
                         "expected_cached": r.expect_cached, "restore_choice": choice.get(r.rid),
                         "on_disk_at_kill": next((f["on_disk_tokens"] for f in found if f["client"] == r.client),
                                                 None),
                         "ttft_s": rnd(r.ttft)}
                        for r in ph.windows[1].records if r.resume and r.outcome == COMPLETED],
        }
        if isinstance(self.target, Running):
            ph.kill.update({"killed_pid": (self.target.last_kill or {}).get("pid"),
                            "restart": self.target.restarts[-1] if self.target.restarts else None})
        return ph


def run_soak(soak: Soak, workdir: Path, say=lambda msg: None) -> dict:
    """Every phase, the checks and the comparisons, as one JSON-able report."""
    if soak.url:
        return _run_url(soak, workdir, say)
    run = _Run(soak, Workers(soak.worker_args, workdir), say)
    phases = [run.phase("baseline", [], churn=False), run.phase("persist_off", ["--kv-persist", "off"], churn=True),
              run.phase("persist_on", [], churn=True)]
    if soak.kill:
        phases.append(run.kill_phase())
    return build_report(phases, _settings(soak, run) | {"worker_args": soak.worker_args}, soak.notes)


def _run_url(soak: Soak, workdir: Path, say) -> dict:
    """The soak against a server it did not start: decoders alone, churn, and with a restart command
    the kill -9 and restart; the same clients, prompts and seeds as against ember's own workers."""
    assert soak.url
    wait_ready(soak.url, "/health", soak.ready_timeout)  # what both say while loading and once ready
    engine, facts = describe(soak.url, soak.ctx)
    target = Running(soak.url, engine, soak.restart_cmd, soak.server_pid, workdir, soak.ready_timeout)
    clients = soak.shape.churners + soak.shape.decoders
    if facts.get("slots") and facts["slots"] < clients:
        soak.notes.append(f"the server has {facts['slots']} slots for {clients} clients: some requests wait for one")
    run = _Run(soak, target, say, engine)
    phases = [run.phase("baseline", [], churn=False), run.phase("churn", [], churn=True)]
    if soak.restart_cmd and soak.kill:
        phases.append(run.kill_phase())
    settings = _settings(soak, run) | facts | {"restart_cmd": soak.restart_cmd,
                                               "kill": bool(soak.restart_cmd and soak.kill)}
    return build_url_report(phases, settings, soak.notes)


def _settings(soak: Soak, run: _Run) -> dict:
    return {"duration_s": soak.duration, "warmup_s": soak.warmup,
            **{k: getattr(soak.shape, k) for k in Shape.__dataclass_fields__},
            "long": len(run.long_prompt), "kill": soak.kill, "seed": soak.seed,
            **({"model": run.engine.model, "backend": run.engine.backend, "context": run.engine.context}
               if run.engine else {})}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: want MIN-MAX tokens, 0 < MIN <= MAX")
    return a, b


def add_soak_parser(bsub) -> None:
    p = bsub.add_parser("soak", help="agent-shaped churn against real workers (baseline, persistence off and on, "
                                     "kill -9 and restart) or against a running server (--url); latency by "
                                     "request class and greedy identity",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=URL_EPILOG)
    p.add_argument("--scale", choices=tuple(SCALES), default="full",
                   help="defaults for the flags below: full (the issue's H200 load, default) or small (CPU, CI)")
    p.add_argument("--duration", type=float, help="seconds of measured traffic a phase (full 150, small 3)")
    p.add_argument("--warmup", type=float, help="seconds of the same traffic before each phase's measured window, "
                                                "counted in no figure (full 10, small 0)")
    p.add_argument("--churners", type=int, help="clients warm-admitting, truncating and abandoning (full 3)")
    p.add_argument("--decoders", type=int, help="streams decoding long answers back to back (full 2)")
    p.add_argument("--conversation", type=int, help="tokens of each churner's conversation at start (full 8192)")
    p.add_argument("--suffix", type=_range, metavar="MIN-MAX", help="a truncation's new tokens (full 4096-16384)")
    p.add_argument("--warm-suffix", type=_range, metavar="MIN-MAX", help="a warm admit's new tokens (full 32-512)")
    p.add_argument("--answer", type=int, help="tokens a churner asks for (full 32)")
    p.add_argument("--decode-tokens", type=int, help="tokens a decoder asks for (full 256)")
    p.add_argument("--abandon", type=float, help="share of truncations abandoned mid-prefill (default 0.5)")
    p.add_argument("--truncate-share", type=float, help="share of a churner's requests that truncate (default 0.5)")
    p.add_argument("--long", type=int, help="tokens of the conversation timed warm after the restart against cold "
                                            "(full 16384)")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="skip the kill -9 and restart phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", metavar="PATH", help="GGUF model (default: the embedded model)")
    p.add_argument("--backend", choices=("numpy", "cuda"), help="worker compute backend (default: the worker's)")
    p.add_argument("--prefill-chunk", type=int, help="worker --prefill-chunk (default: the worker's; small 32)")
    p.add_argument("--kv-mem", help="worker --kv-mem (default: the worker's; small 64MiB)")
    p.add_argument("--ctx", type=int, help="worker --ctx (default: the worker's); with --url: plan prompts for at "
                                           "most this context (default: what the server says)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARGS",
                   help="more worker flags, repeatable: --worker-arg '--max-seqs 16'")
    p.add_argument("--workdir", type=Path, help="keep the workers' logs and KV dirs here (default: a temporary "
                                                "dir); with --url, the restart command's output")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    u = p.add_argument_group("a running server, instead of workers started here")
    u.add_argument("--url", help="drive the server at this base URL (http://HOST:PORT): decoders alone, churn, and "
                                 "with --restart-cmd the kill -9 and restart; the worker flags above do not apply")
    u.add_argument("--restart-cmd", metavar="CMD",
                   help="shell command that starts the server again after the soak kills it with SIGKILL mid-churn; "
                        "the soak runs it in a session of its own (the server keeps running after the soak) and "
                        "waits for /health (llama-server) or /health/ready (ember)")
    u.add_argument("--server-pid", type=int, metavar="PID",
                   help="the process to kill (default: the one of this machine listening on the URL's port)")
    u.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="seconds the server may take to be ready, at the start and after the restart (default 900)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                   help="no soak: put two --json reports side by side, A against B, with the issue's targets "
                        "(ember against llama-server: churn requests >= 2x, warm-admit TTFT p50 <= 0.5x, decode "
                        "ITL p99 <= 50 ms and <= B's, decode tok/s per stream >= 1.5x, no 5xx, lost requests or "
                        "greedy drift)")
    p.set_defaults(func=cmd_soak)


URL_EPILOG = """\
against a running server (--url):
  The clients send token-id prompts to /v1/completions (streaming, greedy) and read /tokenize, as
  llama-server and ember both offer. Figures come from the client side: requests completed and
  abandoned (mid-prefill or after the first token), TTFT, inter-token latency and end-to-end latency
  by request class, decode tok/s per stream, 5xx, 4xx, stream errors and lost connections, and the
  cached prompt tokens the server reports (usage.prompt_tokens_details.cached_tokens, or
  llama-server's timings.cache_n). The checks that read ember's own log do not apply and the report
  names them. Give both servers the same model file, --seed, sizes and --ctx, and the prompts are the
  same (each conversation then grows by what its server answered).

  With --restart-cmd, the churn of the third phase ends in SIGKILL to the process listening on the
  URL's port (found when the server comes up; --server-pid names another) and its children, while
  requests are in flight. The command runs in a session of its own, its output in
  WORKDIR/restart-N.log, and the restarted server is left running, as the soak found the first.
  Reported: kill to ready, each live conversation's next turn (TTFT, cached tokens against what it
  had completed), and the long conversation warm against its cold prefill before the kill.

  ember bench soak --url http://127.0.0.1:8081 --ctx 32768 --json \\
      --restart-cmd 'llama-server -m M.gguf -ngl 99 -fa on -np 6 -c 196608 --cache-reuse 256 --port 8081' >B.json
  ember bench soak --compare A.json B.json
"""


def soak_from_args(args: argparse.Namespace) -> Soak:
    scale = SCALES[args.scale]
    shape = replace(scale.shape, **{k: getattr(args, k) for k in Shape.__dataclass_fields__
                                    if getattr(args, k, None) is not None})
    wargs = ["--model", args.model] if args.model else []
    if not args.url:
        for flag, v in (("--backend", args.backend), ("--prefill-chunk", args.prefill_chunk or scale.prefill_chunk),
                        ("--kv-mem", args.kv_mem or scale.kv_mem), ("--ctx", args.ctx)):
            if v is not None:
                wargs += [flag, str(v)]
        for extra in args.worker_arg:
            wargs += shlex.split(extra)
    warmup = scale.warmup if args.warmup is None else args.warmup
    return Soak(shape, args.duration or scale.duration, warmup, args.long or scale.long, args.kill, args.seed,
                scale.greedy, scale.greedy_tokens, wargs, url=args.url.rstrip("/") if args.url else None,
                restart_cmd=args.restart_cmd, server_pid=args.server_pid, ctx=args.ctx if args.url else None,
                ready_timeout=args.ready_timeout)


def _misused(args: argparse.Namespace) -> str | None:
    """A one-line reason the flags do not go together, or None."""
    if args.url:
        worker = [f for f, v in (("--model", args.model), ("--backend", args.backend),
                                 ("--prefill-chunk", args.prefill_chunk), ("--kv-mem", args.kv_mem),
                                 ("--worker-arg", args.worker_arg)) if v]
        if worker:
            return f"{', '.join(worker)}: flags of the workers the soak starts; with --url the server is running"
        if not args.url.startswith(("http://", "https://")):
            return f"--url {args.url!r}: want http://HOST:PORT"
    elif args.restart_cmd or args.server_pid:
        return "--restart-cmd and --server-pid go with --url"
    return None


def cmd_soak(args: argparse.Namespace) -> int:
    if args.compare:
        from .soak_compare import cmd_compare

        return cmd_compare(args.compare[0], args.compare[1], args.json)
    problem = _misused(args)
    if problem:
        print(f"ember bench soak: {problem}", file=sys.stderr)
        return 2
    soak = soak_from_args(args)
    sh = soak.shape
    if (soak.duration <= 0 or soak.warmup < 0 or sh.decoders < 0 or sh.churners < 1 or sh.answer < 1
            or not 0 <= sh.abandon <= 1 or not 0 <= sh.truncate_share <= 1):
        print("ember bench soak: want --duration > 0, --warmup >= 0, --churners >= 1, --answer >= 1, shares "
              "within 0..1", file=sys.stderr)
        return 2

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"soak [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    try:
        if args.workdir or soak.restart_cmd:
            # a restarted server outlives the soak and keeps writing its output here: never a dir removed at the end
            workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ember-soak-"))
            workdir.mkdir(parents=True, exist_ok=True)
            report = run_soak(soak, workdir, say)
        else:
            with tempfile.TemporaryDirectory(prefix="ember-soak-") as tmp:
                report = run_soak(soak, Path(tmp), say)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"ember bench soak: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report) if args.json else render(report))
    return 0 if report["ok"] else 1
