"""`ember bench resume`: what a kill -9 costs a long conversation, cold versus warm.

1. reference: a worker with persistence off answers the conversation (cold TTFT, the
   uninterrupted temperature-0 continuation, prefill and decode speed without persistence);
2. a worker with persistence on answers it again and is killed with SIGKILL mid-decode
   (prefill and decode speed with persistence: the cost of writing);
3. a new worker on the same KV directory gets the same request: warm TTFT, restore bandwidth,
   and whether its continuation equals the reference token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .machine import machine_facts
from .workerproc import WorkerProcess

FILLER = ("The build failed in CI after the refactor of the storage layer. The log shows a timeout in the "
          "integration suite, then a retry, then a second failure in the cache warmer. ")


def _conversation(approx_tokens: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent. Answer briefly."}]
    words_per_turn = 400
    turns = max(1, approx_tokens // (words_per_turn * 13 // 10))
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Step {i}: " + FILLER * (words_per_turn // 30)})
        msgs.append({"role": "assistant", "content": f"Noted step {i}; checking the next log segment."})
    msgs.append({"role": "user", "content": "Summarize the likely root cause in one sentence."})
    return msgs


@dataclass
class _Streamed:
    """One streamed answer as the client saw it."""

    ttft_s: float | None = None
    text: str = ""
    tokens: int = 0
    usage: dict[str, Any] = field(default_factory=dict)
    killed: bool = False
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None

    @property
    def ttft(self) -> float:
        """The time to first token of an answer that had one."""
        if self.ttft_s is None:
            raise RuntimeError("the worker streamed no content")
        return self.ttft_s


def _stream(url: str, messages: list[dict], max_tokens: int, kill_after: int | None = None,
            worker: WorkerProcess | None = None) -> _Streamed:
    body = {"model": "ember", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    out = _Streamed()
    t_first = None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        if t_first is None:
                            t_first = time.monotonic()
                            out.ttft_s = t_first - t0
                        out.text += piece
                        out.tokens += 1
                        if kill_after is not None and out.tokens >= kill_after and worker is not None:
                            worker.kill()
                            out.killed = True
                            return out
    except httpx.HTTPError:
        if not out.killed:
            raise
    t_end = time.monotonic()
    usage = out.usage
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out.prefill_tok_s = (prompt - cached) / out.ttft_s if out.ttft_s else None
    gen = usage.get("completion_tokens", out.tokens)
    out.decode_tok_s = (gen - 1) / (t_end - t_first) if t_first and gen > 1 and t_end > t_first else None
    return out


def add_resume_parser(bsub) -> None:
    p = bsub.add_parser("resume", help="kill -9 mid-decode, restart, resend: warm vs cold time to first token")
    p.add_argument("--model", metavar="PATH", help="GGUF model (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=16000, help="approximate conversation length (default 16000)")
    p.add_argument("--gen", type=int, default=32, help="tokens of continuation compared (default 32)")
    p.add_argument("--kv-mem", default="2GiB", help="KV budget of the workers (default 2GiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resume)


def cmd_resume(args: argparse.Namespace) -> int:
    model = ["--model", args.model] if args.model else []
    messages = _conversation(args.tokens)
    with tempfile.TemporaryDirectory(prefix="ember-resume-") as tmp_name:
        tmp = Path(tmp_name)
        common = [*model, "--kv-mem", args.kv_mem, "--max-seqs", "1"]
        with WorkerProcess(*common, "--kv-persist", "off", "--kv-dir", str(tmp / "off"), log_path=tmp / "ref.log") as w:
            ref = _stream(w.url, messages, args.gen)
        print(f"reference (persistence off): TTFT {ref.ttft_s:.2f} s, {ref.usage.get('prompt_tokens')} "
              f"prompt tokens", file=sys.stderr)
        w2 = WorkerProcess(*common, "--kv-persist", "all", "--kv-dir", str(tmp / "kv"),
                           log_path=tmp / "killed.log").start()
        try:
            killed = _stream(w2.url, messages, args.gen, kill_after=max(2, args.gen // 2), worker=w2)
        finally:
            w2.kill()
        print(f"persistence on: TTFT {killed.ttft_s:.2f} s, killed with SIGKILL after {killed.tokens} tokens",
              file=sys.stderr)
        with WorkerProcess(*common, "--kv-persist", "all", "--kv-dir", str(tmp / "kv"),
                           log_path=tmp / "warm.log") as w3:
            warm = _stream(w3.url, messages, args.gen)
            stats = httpx.get(f"{w3.url}/v1/stats", timeout=10).json()["metrics"]
    restore_s = stats.get("ember_kv_restore_seconds_total", 0.0)
    restore_b = stats.get("ember_kv_restore_bytes_total", 0.0)
    prompt_tokens = ref.usage.get("prompt_tokens") or 0
    result = {
        "prompt_tokens": prompt_tokens,
        "cold_ttft_s": round(ref.ttft, 3),
        "warm_ttft_s": round(warm.ttft, 3),
        "warm_over_cold": round(warm.ttft / ref.ttft, 4),
        "warm_cached_tokens": (warm.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "continuation_identical": warm.text == ref.text,
        "restore_mb_s": round(restore_b / restore_s / 1e6, 1) if restore_s else None,
        "prefill_tok_s_persist_off": ref.prefill_tok_s and round(ref.prefill_tok_s, 1),
        "prefill_tok_s_persist_on": round(prompt_tokens / killed.ttft_s, 1) if killed.ttft_s else None,
        "decode_tok_s_persist_off": ref.decode_tok_s and round(ref.decode_tok_s, 2),
        "killed_mid_decode_after_tokens": killed.tokens,
        "machine": machine_facts(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32} {v}")
    return 0 if result["continuation_identical"] else 1
