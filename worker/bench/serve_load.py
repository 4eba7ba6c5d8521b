"""`ember bench serve`: agent-shaped load against a running worker.

N concurrent clients each hold a conversation that grows turn by turn behind a long shared system
prompt (as coding agents do); a share of the turns abandon the request mid-prefill or mid-decode
by closing the socket, then retry. Reported: TTFT p50/p99 (first turns and later turns apart),
per-stream and aggregate decode tokens/s, prefix-cache hit rate, and outcomes from /v1/stats.
Traffic goes only to the given base URL (default loopback).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from .machine import machine_facts

SYSTEM = (
    "You are a coding agent working in a large Python repository. Follow the repository's style, "
    "keep functions small, explain each change briefly, and never invent APIs. "
) * 8
TOPICS = ["a retry decorator", "a CSV parser", "an LRU cache", "a CLI with argparse", "a thread pool",
          "a JSON schema validator", "a rate limiter", "a file watcher", "a tokenizer", "a priority queue"]


@dataclass
class TurnResult:
    client: int
    turn: int
    ttft: float | None
    tokens: int
    decode_s: float
    outcome: str  # ok | abandoned | error
    cached: int = 0
    prompt: int = 0


@dataclass
class LoadReport:
    turns: list[TurnResult] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def _turn(client: httpx.AsyncClient, base: str, cid: int, turn: int, messages: list[dict], max_tokens: int,
                abandon: str | None, rng: random.Random) -> tuple[TurnResult, str]:
    body = {"model": "ember", "messages": messages, "max_tokens": max_tokens, "temperature": 0.7,
            "seed": cid * 1000 + turn, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft, tokens, text, usage = None, 0, "", {}
    abandon_after = rng.randint(1, max(1, max_tokens // 2)) if abandon == "decode" else None
    try:
        if abandon == "prefill":
            # close the connection before any token can arrive (the server is still prefilling)
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                await asyncio.sleep(0.05)
            return TurnResult(cid, turn, None, 0, 0.0, "abandoned"), ""
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return TurnResult(cid, turn, None, 0, 0.0, f"http_{resp.status_code}"), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return TurnResult(cid, turn, ttft, tokens, 0.0, "error"), text
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        tokens += 1
                        text += delta
                if abandon_after is not None and tokens >= abandon_after:
                    return TurnResult(cid, turn, ttft, tokens, 0.0, "abandoned"), text
    except httpx.HTTPError:
        return TurnResult(cid, turn, ttft, tokens, 0.0, "error"), text
    t_end = time.monotonic()
    decode_s = t_end - t0 - (ttft or 0.0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return TurnResult(cid, turn, ttft, usage.get("completion_tokens", tokens), decode_s, "ok", cached,
                      usage.get("prompt_tokens", 0)), text


async def _client(base: str, cid: int, deadline: float, args, report: LoadReport, headers: dict) -> None:
    rng = random.Random(args.seed * 7919 + cid)
    messages = [{"role": "system", "content": SYSTEM}]
    turn = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), headers=headers) as client:
        while time.monotonic() < deadline and (args.turns == 0 or turn < args.turns):
            turn += 1
            topic = TOPICS[(cid + turn) % len(TOPICS)]
            messages.append({"role": "user", "content": f"Turn {turn}: write {topic} and explain it in two sentences."})
            r = rng.random()
            abandon = ("prefill" if r < args.abandon_prefill
                       else "decode" if r < args.abandon_prefill + args.abandon_decode else None)
            result, text = await _turn(client, base, cid, turn, messages, args.max_tokens, abandon, rng)
            report.turns.append(result)
            if result.outcome == "abandoned":  # the agent retries the same request at once
                result, text = await _turn(client, base, cid, turn, messages, args.max_tokens, None, rng)
                report.turns.append(result)
            messages.append({"role": "assistant", "content": text or "ok"})
            if len(messages) > 2 * args.max_history + 1:  # history compression: keep the system prompt
                messages = [messages[0]] + messages[-2 * args.max_history :]


def summarize(report: LoadReport, stats_before: dict, stats_after: dict, wall: float) -> dict:
    ok = [t for t in report.turns if t.outcome == "ok"]
    first = [t.ttft for t in ok if t.turn == 1 and t.ttft is not None]
    later = [t.ttft for t in ok if t.turn > 1 and t.ttft is not None]
    per_stream = [t.tokens / t.decode_s for t in ok if t.decode_s > 0 and t.tokens > 1]
    prompt = sum(t.prompt for t in ok)
    cached = sum(t.cached for t in ok)
    outcomes: dict[str, int] = {}
    for t in report.turns:
        outcomes[t.outcome] = outcomes.get(t.outcome, 0) + 1

    def delta(key: str) -> float:
        return stats_after.get(key, 0) - stats_before.get(key, 0)

    return {
        "wall_s": round(wall, 1),
        "turns": len(report.turns),
        "client_outcomes": outcomes,
        "server_outcomes": {o: delta(f"ember_requests_total_{o}") for o in ("completed", "failed", "canceled",
                                                                            "refused")},
        "ttft_first_turn_p50_s": _pct(first, 50), "ttft_first_turn_p99_s": _pct(first, 99),
        "ttft_later_turns_p50_s": _pct(later, 50), "ttft_later_turns_p99_s": _pct(later, 99),
        "ttft_p50_s": _pct(first + later, 50), "ttft_p99_s": _pct(first + later, 99),
        "decode_tok_s_per_stream_p50": _pct(per_stream, 50),
        "decode_tok_s_aggregate": round(delta("ember_generated_tokens_total") / wall, 2) if wall else None,
        "prefix_cache_hit_rate": round(cached / prompt, 3) if prompt else None,
    }


async def _run(args) -> dict:
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=10, headers=headers) as c:
        before = (await c.get(f"{base}/v1/stats")).json()["metrics"]
    report = LoadReport()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    await asyncio.gather(*[_client(base, i, deadline, args, report, headers) for i in range(args.clients)])
    wall = time.monotonic() - t0
    async with httpx.AsyncClient(timeout=10, headers=headers) as c:
        after = (await c.get(f"{base}/v1/stats")).json()["metrics"]
    result = summarize(report, before, after, wall)
    result["clients"] = args.clients
    result["machine"] = machine_facts()
    return result


def add_serve_parser(bsub) -> None:
    p = bsub.add_parser("serve", help="agent-shaped streaming load against a running worker")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="worker base URL (default http://127.0.0.1:8080)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--duration", type=float, default=600, help="seconds to run (default 600)")
    p.add_argument("--turns", type=int, default=0, help="stop each client after this many turns (0 = until --duration)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    p.add_argument("--max-history", type=int, default=6, help="turns kept before history compression (default 6)")
    p.add_argument("--abandon-prefill", type=float, default=0.1,
                   help="share of turns abandoned in prefill (default 0.1)")
    p.add_argument("--abandon-decode", type=float, default=0.1, help="share of turns abandoned in decode (default 0.1)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    if not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")) and not args.url.startswith("https://"):
        print(f"ember: warning: sending load to {args.url}", file=sys.stderr)
    try:
        result = asyncio.run(_run(args))
    except httpx.HTTPError as e:
        print(f"ember: cannot reach the worker at {args.url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    for k, v in result.items():
        if k != "machine":
            print(f"{k:32} {v}")
    m = result["machine"]
    print(f"{'machine':32} {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB")
    return 0
