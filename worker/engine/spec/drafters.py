"""Draft tokens for speculative decoding, guessed from text the sequence (or its session) already has.

Agent traffic repeats itself: a rewritten file re-emits the lines it read, a tool result is quoted, a
JSON object comes back a turn later. A drafter finds the longest recent stretch of tokens that the
sequence's tail repeats and proposes what followed it there; the target model then checks the whole
draft in one step (speculation.py), so nothing a drafter proposes can change the output.

- `ngram` (prompt lookup): matches of 1 to NGRAM_MAX tokens in the sequence's own prompt and output,
  the latest occurrence first; drafts of the requested length.
- `suffix`: matches of up to SUFFIX_MAX tokens in the sequence and in a bounded pool of recent outputs
  of other requests (a session's earlier turns), the longest match first, and drafts whose length
  grows with the match (a long match is a copy in progress; a short one is a guess).

Both keep an index from each n-gram to where it last ended, updated as tokens arrive, so a proposal
costs O(longest match) whatever the context length.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, Protocol

NGRAM_MAX = 4
SUFFIX_MAX = 16
POOL_SEQUENCES = 64  # outputs the suffix drafter's shared pool keeps (the oldest go first)
POOL_MIN_TOKENS = 16  # shorter outputs teach the pool nothing


class Drafter(Protocol):
    """What speculation.py asks of a drafter (these two, draft_model.ModelDrafter, mtp_drafter.MtpDrafter)."""

    name: str

    def new_index(self) -> Any: ...  # a sequence's state: `tokens`, and `sync(tokens, blocks)` as it grows

    def propose(self, index: Any, k: int) -> tuple[list[int], int]: ...  # (draft, length of its match)

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None: ...

    def release(self, index: Any) -> None: ...  # the sequence is gone


class TokenIndex:
    """Where each n-gram (1 <= n <= max_n) of a token list last ended: n-gram -> the index after it."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self._prev: dict[tuple[int, ...], int] = {}  # the occurrence before the latest (for the tail itself)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n : end])
                old = self.ends.get(key)
                if old is not None:
                    self._prev[key] = old
                self.ends[key] = end

    def sync(self, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> None:
        """Follow a sequence that only grows (a sequence preempted and resumed keeps its tokens); its
        KV blocks are no concern of a drafter that reads text."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def continuation(self, tail: Sequence[int], k: int, own: bool) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of `tail`. own: the index is the
        tail's own sequence, whose latest occurrence is the tail itself (then the one before counts)."""
        key = tuple(tail)
        end = self.ends.get(key)
        if own and end == len(self.tokens):
            end = self._prev.get(key)
        if end is None or end >= len(self.tokens):
            return []
        return self.tokens[end : end + k]


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens."""

    name = "ngram"

    def __init__(self, max_n: int = NGRAM_MAX):
        self.max_n = max_n

    def new_index(self) -> TokenIndex:
        return TokenIndex(self.max_n)

    def propose(self, index: TokenIndex, k: int) -> tuple[list[int], int]:
        """(up to k tokens, the length of the match they continue); ([], 0) where nothing matches."""
        toks = index.tokens
        for n in range(min(self.max_n, len(toks)), 0, -1):
            draft = index.continuation(toks[-n:], k, own=True)
            if draft:
                return draft, n
        return [], 0

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        pass

    def release(self, index: TokenIndex) -> None:
        pass


class SuffixDrafter:
    """The longest match in the sequence or the shared pool, drafting further the longer it is."""

    name = "suffix"

    def __init__(self, max_n: int = SUFFIX_MAX, pool_sequences: int = POOL_SEQUENCES):
        self.max_n = max_n
        self._pool: collections.deque[TokenIndex] = collections.deque(maxlen=pool_sequences)
        self._lock = threading.Lock()  # finished() runs on the engine thread; tests may call from others

    def new_index(self) -> TokenIndex:
        return TokenIndex(self.max_n)

    def propose(self, index: TokenIndex, k: int) -> tuple[list[int], int]:
        """(up to k tokens, the length of the match they continue); ([], 0) where nothing matches."""
        toks = index.tokens
        with self._lock:
            pool = list(self._pool)
        for n in range(min(self.max_n, len(toks)), 0, -1):
            tail = toks[-n:]
            want = min(k, max(2, 2 * n))  # a long match is a copy in progress: draft further
            draft = index.continuation(tail, want, own=True)
            for other in reversed(pool):  # the most recent output first
                if len(draft) >= want:
                    break
                more = other.continuation(tail, want, own=False)
                if len(more) > len(draft):
                    draft = more
            if draft:
                return draft, n
        return [], 0

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        """A request's output joins the pool: the next turn of its session is likely to quote it."""
        out = tokens[prompt_len:]
        if len(out) < POOL_MIN_TOKENS:
            return
        idx = TokenIndex(self.max_n)
        idx.extend(out)
        with self._lock:
            self._pool.append(idx)

    def release(self, index: TokenIndex) -> None:
        pass


DRAFTERS = ("ngram", "suffix")


def make_drafter(name: str) -> NgramDrafter | SuffixDrafter:
    if name == "ngram":
        return NgramDrafter()
    if name == "suffix":
        return SuffixDrafter()
    raise ValueError(f"unknown drafter {name!r} (have: {', '.join(DRAFTERS)})")
