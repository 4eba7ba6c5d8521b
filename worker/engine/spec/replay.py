"""A benchmark's drafter (`--spec replay:P`): it proposes what this worker generated before after the same
tokens, each proposed token the recorded one with probability P and a wrong one otherwise.

Speculation's speed depends on how often drafts stand, and on the synthetic benchmark models (random
weights) no real drafter guesses anything: their greedy text never repeats what came before. Replaying a
recorded greedy run gives the machinery drafts that stand at a chosen rate per token (P = 0.8: each
drafted token stands with probability 0.8 given the one before it stood, as speculative decoding's
acceptance rate is defined), so a card's speed at 100%, 80% or 50% acceptance can be measured on any
model. `ember bench spec --spec replay:P` runs each session once to record it and measures the second
run. Whether a drafted token is the recorded one or a wrong one depends only on its position in the
sequence (and the seed), so a run drafts the same wrong tokens wherever its drafts start.

Nothing a drafter proposes changes the output (speculation.py checks every draft), so a recording that
does not match (another prompt, sampling) only costs what a refused draft costs.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

RECORDINGS = 64  # finished sequences kept (the oldest go first)
MIN_RECORDED = 2  # shorter outputs are not worth keeping


class ReplayIndex:
    """One sequence's tokens and the recording they follow (checked as far as `checked`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.recording: tuple[int, ...] | None = None
        self.checked = 0  # tokens known to agree with the recording
        self.searched = -1  # the recordings' generation last searched without a match

    def sync(self, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> None:
        if len(tokens) > len(self.tokens):
            self.tokens.extend(int(t) for t in tokens[len(self.tokens):])


class ReplayDrafter:
    """Drafts from recorded sequences, each token kept with probability `accept` (see the module doc)."""

    name = "replay"

    def __init__(self, accept: float, vocab_size: int, seed: int = 0, recordings: int = RECORDINGS):
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"replay acceptance {accept} is not between 0 and 1")
        if vocab_size < 2:
            raise ValueError("a replay drafter needs a vocabulary of two tokens or more")
        self.accept, self.vocab_size, self.seed = accept, vocab_size, seed
        self._recordings: collections.deque[tuple[int, ...]] = collections.deque(maxlen=recordings)
        self._generation = 0  # bumped with every recording, so a sequence searched in vain searches again
        self._lock = threading.Lock()

    def new_index(self) -> ReplayIndex:
        return ReplayIndex()

    def kept(self, position: int) -> bool:
        """Whether the drafted token at this position of a sequence is the recorded one (a hash of the
        position and the seed, uniform in [0, 1), against the acceptance)."""
        h = (position * 0x9E3779B1 + self.seed * 0x85EBCA77) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        return h / 2**32 < self.accept

    def propose(self, index: ReplayIndex, k: int) -> tuple[list[int], int]:
        """(up to k tokens, the length of the match they continue); ([], 0) where no recording continues
        the sequence."""
        rec = self._follow(index)
        n = len(index.tokens)
        if rec is None or len(rec) <= n or k <= 0:
            return [], 0
        draft = [t if self.kept(n + i) else (t + 1) % self.vocab_size for i, t in enumerate(rec[n : n + k])]
        return draft, n

    def _follow(self, index: ReplayIndex) -> tuple[int, ...] | None:
        """The recording the sequence's tokens are a prefix of: the one it followed so far, checked over
        the tokens since, else the most recent that matches (searched again only after a new recording)."""
        toks, n = index.tokens, len(index.tokens)
        rec = index.recording
        if rec is not None and len(rec) >= n and all(rec[i] == toks[i] for i in range(index.checked, n)):
            index.checked = n
            return rec
        index.recording, index.checked = None, 0
        with self._lock:
            generation, recordings = self._generation, list(self._recordings)
        if generation == index.searched:  # no recording matched these tokens' prefix, nor can one now
            return None
        for rec in reversed(recordings):
            if len(rec) > n and list(rec[:n]) == toks:
                index.recording, index.checked = rec, n
                return rec
        index.searched = generation
        return None

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        """A finished sequence is recorded, replacing an earlier recording of the same prompt."""
        if len(tokens) - prompt_len < MIN_RECORDED:
            return
        rec = tuple(int(t) for t in tokens)
        with self._lock:
            for old in list(self._recordings):
                if old[:prompt_len] == rec[:prompt_len]:
                    self._recordings.remove(old)
            self._recordings.append(rec)
            self._generation += 1

    def release(self, index: ReplayIndex) -> None:
        pass


def parse_replay(spec: str) -> float:
    """`replay:P` -> P, or ValueError in one line."""
    _, _, text = spec.partition(":")
    try:
        p = float(text)
    except ValueError:
        raise ValueError(f"spec: {spec!r}: replay takes an acceptance between 0 and 1, e.g. replay:0.8") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"spec: {spec!r}: replay takes an acceptance between 0 and 1, e.g. replay:0.8")
    return p
