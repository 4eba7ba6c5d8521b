"""Greedy identity that knows a near-tie from a poisoned context.

The soak asks the same greedy prompts before and after each phase's churn and across restarts: a
context poisoned by a crash, a wrong cache hit or a stale block changes what follows. But the same
prompt is not computed the same way each time. The second time its blocks come from the prefix
cache and only its last token is computed, alone (the batch-1 matvecs, int8 activations); the first
time that token was one row of a prefill chunk (the tensor-core tiles, f16 activations); under churn
the decode rows share their step with others. The sums round differently by path, and a deep random
model amplifies the difference: on the synthetic llama-8b (H100, 2026-12-06) the logprobs of the
tokens two runs agreed on moved by up to 0.18 nats in ember and 0.13 in llama-server, and both
servers' greedy answers parted, at the first token or later, while the 30B-A3B's and the 270M's never
did. Its distributions are near flat (128k tokens, logprobs about -11), so a move that size reorders
the top few tokens.

So the greedy requests ask for each token's top TOP logprobs, and two answers that part count as a
tie, not drift, where each run's token at the parting is among the other run's top TOP and each run
holds the two within TIE_NATS. A poisoned context does not reorder the leaders, it replaces them:
two unrelated contexts share none of their top tokens. Anything else (a parting between tokens the
model does not hold close, a server that sends no logprobs) fails the check as before. The report
says where each tie happened, its gaps, and how far the runs' logprobs of the tokens they agreed on
had moved before it (the paths' rounding), so the evidence is in every report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A tie: the two tokens within 0.5 nats in both runs (probabilities within a factor 1.65), about three
# times the largest move the paths' rounding gave the 8B (0.18 nats); a wrong context moves logprobs
# by whole nats and changes which tokens lead.
TIE_NATS = 0.5
TOP = 5  # the greedy requests' `logprobs`: the chosen token and four alternatives

Alternatives = tuple[tuple[str, float], ...]  # a position's top tokens and logprobs, best first


@dataclass(frozen=True)
class Answer:
    """One greedy answer: its tokens' texts and, where the server sent them, each one's alternatives."""

    tokens: tuple[str, ...]
    top: tuple[Alternatives, ...] = field(default=(), repr=False)  # empty: the server sent no logprobs

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def chunk_alternatives(choice: dict[str, Any]) -> list[tuple[str, Alternatives]]:
    """A streamed choice's tokens with their alternatives, in either shape a server sends: the legacy
    completions object ({tokens, top_logprobs: [{text: logprob}]}: ember, OpenAI) or the chat
    one ({content: [{token, top_logprobs: [{token, logprob}]}]}: llama-server)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    out: list[tuple[str, Alternatives]] = []
    if isinstance(lp.get("content"), list):
        for e in lp["content"]:
            top = [(t["token"], float(t["logprob"])) for t in e.get("top_logprobs") or []]
            out.append((e.get("token", ""), _best_first(top)))
        return out
    for tok, top in zip(lp.get("tokens") or [], lp.get("top_logprobs") or [], strict=False):
        out.append((tok, _best_first([(t, float(v)) for t, v in (top or {}).items()])))
    return out


def _best_first(top: list[tuple[str, float]]) -> Alternatives:
    return tuple(sorted(top, key=lambda t: -t[1]))


@dataclass(frozen=True)
class Parting:
    """Where two greedy answers to one prompt part, and whether that is a tie."""

    at: int  # the first token that differs
    a: str
    b: str
    gap_a: float | None  # run a's logprob of its token minus that of b's (None: unknown)
    gap_b: float | None
    noise: float | None  # the largest move of a shared token's logprob before the parting
    logprobs: bool = True  # both runs sent alternatives at the parting

    @property
    def tie(self) -> bool:
        return (self.gap_a is not None and self.gap_b is not None
                and 0 <= self.gap_a <= TIE_NATS and 0 <= self.gap_b <= TIE_NATS)

    def describe(self) -> str:
        gaps = ("no logprobs" if not self.logprobs else f"not in each other's top {TOP}"
                if self.gap_a is None or self.gap_b is None else f"gaps {self.gap_a:.4f}/{self.gap_b:.4f} nats")
        noise = "" if self.noise is None else f", shared tokens moved up to {self.noise:.4f}"
        return f"token {self.at}: {self.a!r} vs {self.b!r} ({gaps}{noise})"

    def as_dict(self) -> dict:
        return {"at": self.at, "a": self.a, "b": self.b, "gap_a": _r(self.gap_a), "gap_b": _r(self.gap_b),
                "noise": _r(self.noise), "tie": self.tie}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def _logprob(top: tuple[Alternatives, ...], at: int, token: str) -> float | None:
    if at >= len(top):
        return None
    return next((lp for t, lp in top[at] if t == token), None)


def part(a: Answer, b: Answer) -> Parting | None:
    """None when the answers are equal; else where they part."""
    if a.tokens == b.tokens:
        return None
    at = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
              min(len(a.tokens), len(b.tokens)))
    ta = a.tokens[at] if at < len(a.tokens) else ""  # "": that answer ended there
    tb = b.tokens[at] if at < len(b.tokens) else ""
    moves = [abs(x - y) for i in range(at) if (x := _logprob(a.top, i, a.tokens[i])) is not None
             and (y := _logprob(b.top, i, b.tokens[i])) is not None]

    def gap(run: Answer, mine: str, theirs: str) -> float | None:
        m, t = _logprob(run.top, at, mine), _logprob(run.top, at, theirs)
        return None if m is None or t is None else m - t

    return Parting(at, ta, tb, gap(a, ta, tb), gap(b, tb, ta), max(moves) if moves else None,
                   logprobs=at < len(a.top) and at < len(b.top))


@dataclass
class Verdict:
    """Two sets of greedy answers to the same prompts, compared: the drifts fail a check, the ties are
    the evidence that they did not."""

    drifts: list[str] = field(default_factory=list)
    ties: list[dict] = field(default_factory=list)


def compare(a: list[Answer], b: list[Answer], where: str) -> Verdict:
    v = Verdict()
    if len(a) != len(b):
        v.drifts.append(f"{where}: {len(a)} outputs vs {len(b)}")
        return v
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        p = part(x, y)
        if p is None:
            continue
        if p.tie:
            v.ties.append({"where": where, "prompt": i, **p.as_dict()})
        else:
            v.drifts.append(f"{where}: prompt {i}: {p.describe()}")
    return v
