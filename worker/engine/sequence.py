"""One request's state inside the engine, grouped by the unit that owns each part.

`Seq` is what the engine loop holds in its queues. Its KV state (blocks, hashes, how far they are
computed, registered, offered to the store, restored) belongs to the KV manager (kv_manager.py);
its output state (sampler, detokenizer, stop matcher, grammar, reasoning budget, loop guard, counts)
to the output processor (output.py). The loop owns only arrival, admission and keepalive times.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..text.tokenizer import IncrementalDecoder
from .constraints import SequenceConstraint
from .loopguard import LoopGuard
from .reasoning_budget import ReasoningTracker
from .requests import GenerationRequest, RequestHandle, TokenLogprob
from .sampling import Sampler
from .textstream import StopMatcher

if TYPE_CHECKING:
    from ..kvstore.store import RestoreJob
    from .spec.speculation import SpecState


@dataclass(eq=False)
class KVState:
    """The KV manager's part: the sequence's blocks and how far each step of their life has got."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    n_computed: int = 0
    n_registered: int = 0
    n_offered: int = 0  # full blocks handed to the KV store
    restoring: RestoreJob | None = None  # a RestoreJob while blocks come back from the KV store
    restore_blocks: list[int] = field(default_factory=list)
    restore_used: int = 0


@dataclass(eq=False)
class OutputState:
    """The output processor's part: how tokens are chosen and what the client has been sent."""

    sampler: Sampler
    decoder: IncrementalDecoder
    stopper: StopMatcher
    generated: int = 0
    last_token_at: float = 0.0
    prompt_lp: list[TokenLogprob | None] = field(default_factory=list)
    constraint: SequenceConstraint | None = None  # survives preemption: it has seen every output token
    device_seed: int | None = None  # the seed of draws made on the device
    reasoning: ReasoningTracker | None = None
    guard: LoopGuard | None = None


@dataclass(eq=False)  # a sequence is itself: `s in running` and remove() by identity, not by fields
class Seq:
    handle: RequestHandle
    number: int  # 1-based arrival order, for fault injection and logs
    arrived: float
    tokens: list[int]  # prompt, then every generated token
    prompt_len: int
    out: OutputState
    kv: KVState = field(default_factory=KVState)
    cached_tokens: int = 0
    last_keepalive: float = 0.0
    begun: bool = False
    compiling: concurrent.futures.Future | None = None  # the grammar, until admission takes it
    spec: SpecState | None = None  # speculative decoding's part (speculation.py), where it is on

    @property
    def req(self) -> GenerationRequest:
        return self.handle.request
