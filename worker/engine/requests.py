"""What the HTTP layer hands the engine, and what comes back.

A request is submitted once (Engine.submit, which may refuse it with one of the exceptions below)
and settles exactly once, as one of the outcomes below. Events flow from the engine thread to the
request's asyncio queue on the HTTP event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from dataclasses import dataclass, field

from ..logs import log
from .sampling import SamplingParams


class QueueFull(Exception):
    """The waiting queue is at its bound; answer 429 with Retry-After."""


class NotAccepting(Exception):
    """Draining or poisoned; answer 503 with Retry-After."""


class PromptTooLong(ValueError):
    pass


class Outcome(str, enum.Enum):  # noqa: UP042 (StrEnum would change str() of a member)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    REFUSED = "refused"


@dataclass
class ReasoningBudget:
    """Bounds a thinking model's reasoning block. The engine counts generated tokens while inside
    the block (from `start` to `end`, both token-id sequences; `starts_inside` when the template
    already opened it) and, once `budget` tokens are spent, emits `end` itself as if sampled, so
    the answer still follows and the API layer sees a closed block."""

    start: list[int]
    end: list[int]
    budget: int
    starts_inside: bool = False


class FinishReason(str, enum.Enum):  # noqa: UP042 (as Outcome)
    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens, the context limit, or the loop guard (a repeating n-gram)


@dataclass(frozen=True)
class MessageSpans:
    """Where each message of a chat-shaped prompt begins in its rendered text (characters) and its
    role, as the API rendered it: how a cache miss names the message it diverged in (misses.py). No
    text: offsets and roles only."""

    starts: list[int]
    roles: list[str]


@dataclass
class GenerationRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob and the top k
    prompt_logprobs: bool = False  # logprobs of the prompt tokens too (completions `echo`)
    ignore_eos: bool = False
    protocol: str = ""  # for logs and metrics only
    probe: bool = False  # the daemon's health probe: marked in the log so it is not taken for traffic
    # An llguidance grammar (the JSON text `llguidance.grammar_from` and the compilers produce) that
    # every sampled token must keep valid: structured outputs and grammar-constrained tool calls.
    # The API layer builds and validates it (400 on unsupported features); the engine enforces it.
    grammar: str | None = None
    reasoning: ReasoningBudget | None = None  # None: no bound (or not a thinking model)
    output_plan: object | None = None  # the protocol adapter's own state (how to parse the output); never read here
    user_agent: str = ""  # the client's User-Agent, for the admit line only
    message_spans: MessageSpans | None = None  # a chat-shaped prompt's messages in its rendered text (misses.py)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), best first


@dataclass
class Delta:
    """New output: text that is safe to show (never part of a stop string) and the token ids
    that produced it. `logprobs` has one entry per token when asked for."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class PromptLogprobs:
    entries: list[TokenLogprob | None]  # the first prompt token has none


@dataclass
class Started:
    """Sent once when the request is admitted: how much of the prompt came from the cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Keepalive:
    """Sent during long prefills so streams can show life (SSE comment, Anthropic ping)."""

    prefilled: int
    total: int


@dataclass
class Finished:
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stop_string: str | None = None


@dataclass
class Failed:
    """The request failed; `status` is the HTTP status to use if nothing was sent yet."""

    message: str
    status: int = 500
    kind: str = "server_error"


Event = Started | Keepalive | Delta | PromptLogprobs | Finished | Failed


class RequestHandle:
    """The HTTP side of one request: an async stream of events and a way to cancel."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.transcript: list[str] | None = None  # --log-prompts: the output text, logged when it settles

    def cancel(self) -> None:
        """The client went away: stop work at the next engine step."""
        self.cancelled.set()

    def push(self, events: list[Event]) -> None:
        """Called from the engine thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is going down
            self.loop.call_soon_threadsafe(self._put_all, events)

    def _put_all(self, events: list[Event]) -> None:
        for e in events:
            self.queue.put_nowait(e)
            if self.transcript is not None:
                self._record(e)

    def _record(self, e: Event) -> None:
        assert self.transcript is not None
        if isinstance(e, Delta):
            self.transcript.append(e.text)
        elif isinstance(e, (Finished, Failed)):
            log("output", request_id=self.request.request_id, text="".join(self.transcript))
            self.transcript = None

    async def events(self):
        """Yield events until the request finishes or fails."""
        while True:
            e = await self.queue.get()
            yield e
            if isinstance(e, (Finished, Failed)):
                return
