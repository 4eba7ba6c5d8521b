"""The soak's traffic: agent-shaped churn beside steady decoders, recorded request by request.

Churners each hold a live conversation and send, at random: warm admits (the conversation plus a
small suffix), history-compression truncations (a cut inside the conversation, then a large
suffix), and truncations abandoned at a random point of their prefill by closing the socket.
Decoders stream long greedy answers back to back. Prompts are token ids on /v1/completions, so cut
points are exact; every request streams (one chunk per token, whose text the worker holds back only
inside a multi-byte character), so TTFT and inter-token gaps come from chunk arrival times. A window
runs the clients against one server for a while, samples ember's /v1/stats (the persistence backlog)
where the server is ember, and can kill the server at its end, mid-request. Everything else the
clients use is what llama-server offers too (/v1/completions with token ids, /tokenize), so the same
traffic drives either. Not here: starting, finding and killing servers (soak_target.py), the phases
(soak.py), the checks and the report (soak_report.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from .greedy_drift import Alternatives, chunk_alternatives
from .serve_load import SYSTEM, TOPICS

WARM, TRUNCATE, ABANDON, DECODE = "warm", "truncate", "abandon", "decode"
CLASSES = (WARM, TRUNCATE, ABANDON, DECODE)
# client-side ends of a request: the answer streamed to [DONE]; the client closed it on purpose;
# the connection died (the worker was killed); the worker answered an error
COMPLETED, ABANDONED, LOST, ERROR = "completed", "abandoned", "lost", "error"


@dataclass
class Shape:
    """The churn's sizes, in tokens unless named otherwise."""

    churners: int
    decoders: int
    conversation: int  # a churner's conversation when it starts
    suffix: tuple[int, int]  # a truncation's new tokens, min and max
    warm_suffix: tuple[int, int]  # a warm admit's new tokens
    answer: int  # tokens a churner asks for
    decode_prompt: int
    decode_tokens: int  # tokens a decoder asks for, request after request
    abandon: float  # share of truncations abandoned mid-prefill
    truncate_share: float  # share of a churner's requests that are truncations (abandoned or not)


EMBER, LLAMA_SERVER, OTHER = "ember", "llama-server", "other"  # the kinds of server the soak knows


@dataclass(frozen=True)
class Engine:
    """What the clients need to know of the server (ember's /v1/stats, llama-server's /props)."""

    model: str
    backend: str
    context: int  # tokens one request may hold, prompt and answer
    # prompt tokens a step computes, at most; None: the soak does not watch the server's steps, and
    # an abandon's point in the prefill is a share of its expected time alone
    step_tokens: int | None
    block_size: int  # the granularity of the server's prefix cache (1: any token)
    server: str = EMBER

    @classmethod
    def of(cls, url: str) -> Engine:
        stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
        e = stats["engine"]
        return cls(stats["model"], e["backend"], e["context"], e["max_step_tokens"], e["block_size"])


@dataclass
class Vocab:
    """Token ids to build prompts from: the model's BOS (if it adds one) and ordinary text tokens."""

    bos: list[int]
    pool: list[int]

    @classmethod
    def of(cls, url: str) -> Vocab:
        text = SYSTEM + " ".join(TOPICS) + " def main(argv): return 0 if argv else 1 # 0123456789"

        def ids(special: bool) -> list[int]:
            r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": special}, timeout=60)
            r.raise_for_status()
            return r.json()["tokens"]

        plain, with_bos = ids(False), ids(True)
        return cls(with_bos[: len(with_bos) - len(plain)], sorted(set(plain)))

    def random(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.pool, k=n)


@dataclass
class Record:
    """One request as its client saw it."""

    cls: str
    client: str
    t0: float
    prompt: list[int] = field(repr=False, default_factory=list)
    rid: str | None = None
    outcome: str = ""
    ttft: float | None = None
    t_first: float | None = None  # the first token's arrival
    t_last: float | None = None  # the last token's
    t_done: float = 0.0  # when the request ended at the client
    gaps: list[float] = field(default_factory=list)  # seconds between streamed tokens after the first
    tokens: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    abandon_phase: str | None = None  # prefill (no token yet) | decode
    status: int | None = None  # the response's HTTP status; None: no response began
    resume: bool = False  # a churner's first request after a worker restart
    expect_cached: int = 0  # for a resume: the full blocks of the last prompt completed before it
    error: str | None = None
    # with logprobs asked for (the greedy identity's requests): each token's text and alternatives
    answer: list[tuple[str, Alternatives]] = field(repr=False, default_factory=list)

    @property
    def decode_s(self) -> float:
        return self.t_last - self.t_first if self.t_first is not None and self.t_last is not None else 0.0


class RateEstimate:
    """Prefill tokens/s under load, from completed truncations: where "a random point of the
    prefill" lies in seconds."""

    def __init__(self, tok_s: float):
        self.tok_s = max(tok_s, 1.0)

    def update(self, rec: Record) -> None:
        if rec.ttft and rec.prompt_tokens > rec.cached:
            self.tok_s = 0.7 * self.tok_s + 0.3 * (rec.prompt_tokens - rec.cached) / rec.ttft


async def _read(resp: httpx.Response, rec: Record, text: list[str], stop_at_first: bool, top: int) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            rec.outcome = COMPLETED
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            rec.outcome, rec.error = ERROR, json.dumps(chunk["error"])[:300]
            return
        rec.rid = rec.rid or chunk.get("id")  # a server that sends no x-request-id (llama-server)
        if chunk.get("usage"):
            rec.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            rec.cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rec.tokens = chunk["usage"].get("completion_tokens", rec.tokens)
        if not rec.cached and isinstance(chunk.get("timings"), dict):  # llama-server's own count
            rec.cached = chunk["timings"].get("cache_n") or 0
        for choice in chunk.get("choices", []):
            if top:  # every token's alternatives, those of a token whose text is held back too
                rec.answer.extend(chunk_alternatives(choice) or ([(choice["text"], ())] if choice.get("text") else []))
            if not choice.get("text"):
                if choice.get("finish_reason") and rec.ttft is None:  # the first token ended it (an end of text)
                    rec.ttft = time.monotonic() - rec.t0
                continue
            now = time.monotonic()
            if rec.t_last is None:
                rec.t_first, rec.ttft = now, now - rec.t0
            else:
                rec.gaps.append(now - rec.t_last)
            rec.t_last = now
            rec.tokens += 1
            text.append(choice["text"])
            if stop_at_first:
                return


async def stream(http: httpx.AsyncClient, url: str, rec: Record, max_tokens: int,
                 abandon: Callable[[], Awaitable] | None = None, top: int = 0) -> str:
    """Send `rec.prompt` greedily, streaming; fill `rec` and return the answer's text. With
    `abandon`, the client closes the socket once it is done, or at the first token if sooner. With
    `top`, each token's `top` logprobs go to `rec.answer` (only for the few identity checks: logprobs
    keep sampling off the device on the GPU, so the measured traffic asks for none)."""
    body = {"model": "ember", "prompt": rec.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"logprobs": top} if top else {})}
    text: list[str] = []
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec.rid, rec.status = resp.headers.get("x-request-id"), resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec.outcome, rec.error = ERROR, f"HTTP {resp.status_code}: {resp.text[:300]}"
                return ""
            if abandon is None:
                await _read(resp, rec, text, stop_at_first=False, top=top)
            else:
                reading = asyncio.ensure_future(_read(resp, rec, text, stop_at_first=True, top=top))
                trigger = asyncio.ensure_future(abandon())
                await asyncio.wait({reading, trigger}, return_when=asyncio.FIRST_COMPLETED)
                for t in (reading, trigger):
                    t.cancel()
                await asyncio.gather(reading, trigger, return_exceptions=True)
                if rec.outcome != ERROR:
                    rec.outcome = ABANDONED
                    rec.abandon_phase = "decode" if rec.tokens else "prefill"
                rec.t_done = time.monotonic()
                return ""  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        rec.outcome, rec.error = LOST, f"{type(e).__name__}: {e}"
    if not rec.outcome:
        rec.outcome, rec.error = LOST, "the stream ended without [DONE]"
    rec.t_done = time.monotonic()
    return "".join(text)


async def _engine_steps(http: httpx.AsyncClient, url: str) -> int | None:
    """Engine steps run so far; None if the worker does not answer (it is being killed)."""
    try:
        r = await http.get(f"{url}/v1/stats")
        r.raise_for_status()
        return r.json()["engine"]["steps"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def _tokenize(http: httpx.AsyncClient, url: str, text: str) -> list[int]:
    r = await http.post(f"{url}/tokenize", json={"content": text, "add_special": False})
    r.raise_for_status()
    return r.json()["tokens"]


class _Client:
    kind = ""

    def __init__(self, index: int, shape: Shape, vocab: Vocab, engine: Engine, seed: int):
        self.name, self.shape, self.vocab, self.engine = f"{self.kind}-{index}", shape, vocab, engine
        self.rng = random.Random(f"{seed}-{self.name}")  # the same requests in every phase


class Churner(_Client):
    """A conversation that an agent keeps extending, compressing and abandoning."""

    kind = "churn"

    def __init__(self, index: int, shape: Shape, vocab: Vocab, engine: Engine, seed: int):
        super().__init__(index, shape, vocab, engine, seed)
        self.convo = vocab.bos + vocab.random(self.rng, shape.conversation)
        # every class early, even in a short window: churner i starts at class i of the rotation
        rotation = [ABANDON, WARM, TRUNCATE]
        self.planned = rotation[index % 3 :] + rotation[: index % 3]
        self.completed = 0  # tokens of the last prompt that completed
        self.resume = False  # set after a restart: the next request is a warm admit of the conversation

    def _next(self) -> str:
        if self.resume:
            return WARM
        if self.planned:
            return self.planned.pop(0)
        if self.rng.random() >= self.shape.truncate_share:
            return WARM
        return ABANDON if self.rng.random() < self.shape.abandon else TRUNCATE

    def _truncation(self, max_tokens: int) -> tuple[list[int], int]:
        """A cut in the middle half of the conversation, then a large suffix, within the context."""
        room = self.engine.context - max_tokens - 1
        suffix = min(self.rng.randint(*self.shape.suffix), room - 16)
        hi = max(1, min(len(self.convo) * 3 // 4, room - suffix))
        cut = self.rng.randint(min(max(1, len(self.convo) // 4), hi), hi)
        return self.convo[:cut] + self.vocab.random(self.rng, suffix), cut

    async def _abandon_point(self, http: httpx.AsyncClient, url: str, new: int, rate: RateEstimate
                             ) -> Callable[[], Awaitable]:
        """A random point of the new tokens' prefill: a share of its expected time, and, on a worker
        whose steps the soak watches, never past the engine step that could at the earliest finish
        it (a step computes at most `step_tokens` prompt tokens), so a slow or loaded worker still
        sees the abandon mid-prefill. A server reached by URL gets the share of the time alone, the
        same rule for every server compared."""
        seconds = self.rng.uniform(0.1, 0.8) * new / rate.tok_s
        if self.engine.step_tokens is None:
            return lambda: asyncio.sleep(seconds)
        steps = self.rng.randint(1, max(1, -(-new // self.engine.step_tokens) - 1))
        start = await _engine_steps(http, url)

        async def point() -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                now = await _engine_steps(http, url)
                if start is None or now is None or now >= start + steps:
                    return
                await asyncio.sleep(0.02)

        return point

    async def prime(self, http: httpx.AsyncClient, url: str) -> Record:
        """The conversation's first turn, before any window (cold: a setup step, not a class)."""
        rec = Record("prime", self.name, time.monotonic(), self.convo)
        await stream(http, url, rec, 1)
        self.completed = len(self.convo)
        return rec

    async def step(self, http: httpx.AsyncClient, url: str, rate: RateEstimate) -> Record:
        cls = self._next()
        answer = self.shape.answer
        # an abandon asks for more, so closing at its first token still lands before it ends
        max_tokens = answer * 8 if cls == ABANDON else answer
        warm = self.convo + self.vocab.random(self.rng, self.rng.randint(*self.shape.warm_suffix))
        if cls == WARM and len(warm) + max_tokens + 1 > self.engine.context:
            cls = TRUNCATE  # too long to grow: the agent compresses its history
        prompt, kept = (warm, len(self.convo)) if cls == WARM else self._truncation(max_tokens)
        rec = Record(cls, self.name, time.monotonic(), prompt, resume=self.resume,
                     expect_cached=self.completed // self.engine.block_size * self.engine.block_size)
        abandon = None
        if cls == ABANDON:
            abandon = await self._abandon_point(http, url, len(prompt) - kept, rate)
        text = await stream(http, url, rec, max_tokens, abandon)
        if rec.outcome == COMPLETED:
            self.resume, self.completed = False, len(prompt)
            try:  # the answer as the agent resends it: its text, tokenized again
                self.convo = prompt + await _tokenize(http, url, text)
            except httpx.HTTPError:
                self.convo = prompt  # the worker went away meanwhile (a kill)
            if cls == TRUNCATE:
                rate.update(rec)
        return rec


class Decoder(_Client):
    """A stream that decodes long answers back to back."""

    kind = "decode"

    async def step(self, http: httpx.AsyncClient, url: str, rate: RateEstimate) -> Record:
        prompt = self.vocab.bos + self.vocab.random(self.rng, self.shape.decode_prompt)
        rec = Record(DECODE, self.name, time.monotonic(), prompt)
        await stream(http, url, rec, min(self.shape.decode_tokens, self.engine.context - len(prompt) - 1))
        return rec


@dataclass
class Window:
    records: list[Record]
    wall_s: float
    stats_first: dict  # /v1/stats metrics at the start and the last ones read (before a kill)
    stats_last: dict
    backlog_max: float | None  # None: the worker has no KV writer (persistence off)
    killed_at: float | None = None


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(3600, connect=10)


async def prime(url: str, churners: list[Churner]) -> list[Record]:
    async with httpx.AsyncClient(timeout=_timeout()) as http:
        return list(await asyncio.gather(*[c.prime(http, url) for c in churners]))


async def run_window(url: str, clients: list, duration: float, rate: RateEstimate,
                     kill: Callable[[], object] | None = None, sample_s: float = 0.25,
                     sample_stats: bool = True) -> Window:
    """Run every client's requests back to back for `duration` seconds. Then new requests stop and
    those in flight finish, or, with `kill`, the server is killed under them (they end LOST). With
    `sample_stats` (an ember server) /v1/stats is sampled meanwhile; without, the window's stats are
    empty."""
    stop = asyncio.Event()
    records: list[Record] = []
    stats: list[dict] = []
    backlog: list[float] = []

    async def loop(c) -> None:
        async with httpx.AsyncClient(timeout=_timeout()) as http:
            while not stop.is_set():
                rec = await c.step(http, url, rate)
                records.append(rec)
                if rec.outcome == LOST:
                    return
                if rec.outcome == ERROR:
                    await asyncio.sleep(0.5)  # refused or failed: the checks report it; do not spin

    async def sample_once(http: httpx.AsyncClient) -> None:
        try:
            m = (await http.get(f"{url}/v1/stats")).json()["metrics"]
        except (httpx.HTTPError, ValueError, KeyError):
            return  # the worker is being killed
        stats.append(m)
        if "ember_kv_write_queue_depth" in m:
            backlog.append(m["ember_kv_write_queue_depth"])

    async def sample(http: httpx.AsyncClient) -> None:
        while sample_stats:
            await asyncio.sleep(sample_s)
            await sample_once(http)

    async with httpx.AsyncClient(timeout=5) as stats_http:
        if sample_stats:
            await sample_once(stats_http)  # the first figures, before any request
            if not stats:
                raise RuntimeError(f"the worker at {url} does not answer /v1/stats")
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample(stats_http))
        tasks = [asyncio.create_task(loop(c)) for c in clients]
        await asyncio.wait(tasks, timeout=duration)
        stop.set()
        killed_at = None
        if kill is not None:
            killed_at = time.monotonic()
            await asyncio.to_thread(kill)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        if kill is None and sample_stats:
            await sample_once(stats_http)  # after the last request in flight ended
    return Window(records, wall, stats[0] if stats else {}, stats[-1] if stats else {}, max(backlog, default=None),
                  killed_at)
