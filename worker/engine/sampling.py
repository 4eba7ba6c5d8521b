"""Token sampling on the host: a grammar's mask, logit_bias, penalties, then top-k, top-p, min-p,
temperature, then a draw.

The order follows llama.cpp's default sampler chain. Each request owns a seeded generator, so a
request with a seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divides positive logits of seen tokens, multiplies negative
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # window of recent tokens the penalties look at; -1 = all
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias

    @property
    def on_host(self) -> bool:
        """Needs the logits on the host: a device sampler applies neither penalties nor a bias."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> str | None:
        """The name of the first out-of-range field, or None."""
        if not (self.temperature >= 0.0):
            return "temperature"
        if not (0.0 < self.top_p <= 1.0):
            return "top_p"
        if not (0.0 <= self.min_p <= 1.0):
            return "min_p"
        if self.top_k < 0:
            return "top_k"
        if not (self.repetition_penalty > 0.0):
            return "repetition_penalty"
        if not (-2.0 <= self.presence_penalty <= 2.0):
            return "presence_penalty"
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            return "frequency_penalty"
        return None


class Sampler:
    """Samples one sequence's tokens; holds its random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def apply_penalties(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return logits
        recent = history if p.penalty_last_n < 0 else history[-p.penalty_last_n :] if p.penalty_last_n else []
        if not recent:
            return logits
        counts = Counter(recent)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        freq = np.fromiter(counts.values(), dtype=np.float32)
        out = logits.astype(np.float32, copy=True)
        sel = out[ids]
        if p.repetition_penalty != 1.0:
            rp = np.float32(p.repetition_penalty)
            sel = np.where(sel > 0, sel / rp, sel * rp)
        sel = sel - freq * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
        out[ids] = sel
        return out

    def sample(self, logits: np.ndarray, history: list[int], bias: np.ndarray | None = None) -> int:
        """`bias` (0 or -inf per token, from a grammar) goes first, so every later stage only ever
        sees allowed tokens: a -inf logit stays -inf through the penalties and gets probability 0.
        Penalties and logit_bias can push a logit past float32's range: +inf is held at the range's
        edge (and the temperature divides in float64), so no stage ever sees inf - inf."""
        dist = self.distribution(logits, history, bias)
        if isinstance(dist, int):
            return dist
        ids, probs = dist
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def verify(self, logits: np.ndarray, history: list[int], bias: np.ndarray | None, draft: int) -> tuple[int, bool]:
        """The token at a position a draft guessed `draft` for, and whether the guess stands. Greedy: the
        argmax, the guess standing where it is that. Sampling: rejection sampling against a drafter that
        proposes one token for sure (probability 1): the guess stands with the target's probability of
        it, and otherwise the token is drawn from the target with the guess taken out (renormalised).
        Either way the token's distribution is exactly the target's (sample's)."""
        dist = self.distribution(logits, history, bias)
        if isinstance(dist, int):
            return dist, dist == draft
        ids, probs = dist
        hit = np.flatnonzero(ids == draft)
        p_draft = float(probs[hit[0]]) if hit.size else 0.0
        if p_draft > 0.0 and self.rng.random() < p_draft:
            return int(draft), True
        if hit.size:
            probs = probs.copy()
            probs[hit[0]] = 0.0
            probs /= probs.sum()
        return int(ids[self.rng.choice(len(ids), p=probs)]), False

    def distribution(self, logits: np.ndarray, history: list[int],
                     bias: np.ndarray | None = None) -> int | tuple[np.ndarray, np.ndarray]:
        """What a draw chooses from after every stage of the chain: the token itself where greedy, else
        (token ids, their probabilities in float64)."""
        logits = np.asarray(logits, dtype=np.float32)
        if bias is not None:
            logits = logits + bias
        p = self.params
        if p.logit_bias:
            ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64, count=len(p.logit_bias))
            logits = logits.copy() if bias is None else logits
            logits[ids] += np.fromiter((v for _, v in p.logit_bias), dtype=np.float32, count=len(ids))
        logits = self.apply_penalties(logits, history)
        if p.logit_bias or p.repetition_penalty != 1.0:
            logits = np.minimum(logits, _FLOAT32_MAX)
        if p.greedy:
            return int(np.argmax(logits))
        ids = np.arange(logits.shape[0])
        vals = logits
        if p.top_k > 0 and p.top_k < vals.shape[0]:
            keep = np.argpartition(-vals, p.top_k - 1)[: p.top_k]
            ids, vals = ids[keep], vals[keep]
        order = np.argsort(-vals, kind="stable")
        ids, vals = ids[order], vals[order]
        probs = _softmax64(vals)
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1  # keep the token that crosses top_p
            ids, vals = ids[:cut], vals[:cut]
            probs = _softmax64(vals)
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, vals = ids[keep], vals[keep]
        return ids, _softmax64(vals.astype(np.float64) / p.temperature)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - float(np.max(x)))
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(np.float32)
