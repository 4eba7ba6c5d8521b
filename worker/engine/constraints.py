"""Grammar-constrained decoding with llguidance: structured outputs and constrained tool calls.

Every constrained sequence owns an `LLMatcher` compiled from its request's grammar. The mask for its
next token is computed on a worker thread as soon as its previous token is consumed, so it runs while
the backend computes the next step (llguidance drops the GIL while it works); the sampler waits for
it just before sampling and adds it to the logits as a 0 / -inf bias, so greedy, temperature, top-k,
top-p, min-p and the penalties all see only the tokens the grammar allows.

The worker threads are guarded (worker/threads.py): if one dies, the calls waiting on it fail as
ConstraintError (their requests fail alone), later grammars fail at once, and /health/live names it.

The engine's only use of llguidance is here (the API layer uses it to build and check grammars).
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, cast

import llguidance
import numpy as np

from ..text.tokenizer import Tokenizer
from ..threads import GuardedPool, ThreadDied, ThreadWatch


class GrammarError(ValueError):
    """The request's grammar does not compile: a client error (400)."""


class ConstraintError(RuntimeError):
    """The matcher failed mid-generation (a resource limit, or a token it cannot take)."""


# One LLTokenizer per tokenizer: building the token trie and its slices holds the GIL for about
# 1.3 s on a 262k vocabulary, so it is done once, on the first grammar, and shared by all engines.
_LLTOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_LLTOKENIZER_LOCK = threading.Lock()

# Row b: the 8 bits of byte b (least significant first) as a 0 / -inf bias; turns a packed mask
# into a logit bias with one gather instead of a per-token loop.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(0.0), np.float32(-np.inf),
).astype(np.float32)


class _Vocabulary:
    """ember's tokenizer in the shape llguidance.TokenizerWrapper reads."""

    def __init__(self, tok: Tokenizer, n_vocab: int):
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eot_ids, default=0)
        self.bos_token_id = tok.bos_id
        # Raw bytes per token; control and unknown tokens are marked special (llguidance prefixes
        # them with 0xFF), so grammar text can never be spelled with a token that renders as nothing.
        self.tokens = [tok.token_piece(i) for i in range(tok.vocab_size)] + [b""] * (n_vocab - tok.vocab_size)
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        self._tok = tok

    def __call__(self, text):
        # Raw text: control-token strings stay text, as in any other generated text.
        if isinstance(text, bytes):
            raise TypeError("str only")  # TokenizerWrapper then hands us str
        return self._tok.encode(text, add_special=False, parse_special=False)


def lltokenizer_for(tok: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    with _LLTOKENIZER_LOCK:
        lt = _LLTOKENIZERS.get(tok)
        if lt is None or lt.vocab_size != n_vocab:
            eos = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else None)
            lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, n_vocab)),
                                        n_vocab=n_vocab, eos_token=eos)
            _LLTOKENIZERS[tok] = lt
        return lt


def grammar_from_json_schema(schema: dict | str, **options) -> str:
    """An llguidance grammar for a JSON schema (options: llguidance's JsonCompileOptions)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=cast(Any, options) or None)


def grammar_from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


class MaskStats:
    """Where the constraint time goes: computing masks (on worker threads with overlap, so the
    figure includes waits for the GIL while the engine thread holds it) and the engine thread's
    wait for them (with overlap, only what the backend step did not hide)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.masks = 0
        self.compute_s = 0.0
        self.wait_s = 0.0

    def add(self, compute_s: float = 0.0, wait_s: float = 0.0, masks: int = 0) -> None:
        with self._lock:
            self.compute_s += compute_s
            self.wait_s += wait_s
            self.masks += masks

    def snapshot(self) -> dict:
        with self._lock:
            n = max(self.masks, 1)
            return {"masks": self.masks, "compute_us_per_mask": round(self.compute_s / n * 1e6, 1),
                    "wait_us_per_mask": round(self.wait_s / n * 1e6, 1)}


class Constraints:
    """Compiles grammars and computes masks for one model (one engine)."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, *, overlap: bool = True, workers: int = 2,
                 watch: ThreadWatch | None = None):
        self.tokenizer, self.n_vocab, self.overlap = tokenizer, n_vocab, overlap
        self.stats = MaskStats()
        self._pool = GuardedPool(watch if watch is not None else ThreadWatch(), "ember-mask", workers)

    def compile(self, grammar: str) -> Future:
        """A future SequenceConstraint (GrammarError if the grammar is bad); compiled off the engine
        thread because a large grammar takes up to a second."""
        return self._pool.submit(self._compile, grammar)

    def _compile(self, grammar: str) -> SequenceConstraint:
        lt = lltokenizer_for(self.tokenizer, self.n_vocab)
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)  # never raises; errors are a state
        if matcher.is_error():
            raise GrammarError(f"the grammar is not valid: {_one_line(matcher.get_error())}")
        return SequenceConstraint(self, matcher)

    def shutdown(self) -> None:
        self._pool.shutdown()


class SequenceConstraint:
    """One sequence's matcher and its next-token mask. Not thread-safe: the engine thread drives it,
    and every method waits for the mask in flight before touching the matcher."""

    def __init__(self, owner: Constraints, matcher: llguidance.LLMatcher):
        self.owner, self.matcher = owner, matcher
        n_words = (owner.n_vocab + 31) // 32
        self._words = np.zeros(n_words, np.int32)  # llguidance's packed mask, bit i = token i allowed
        self._rows = np.empty((n_words * 4, 8), np.float32)
        self._bias = self._rows.reshape(-1)[: owner.n_vocab]  # a view: 0 allowed, -inf not
        self._pending: Future | None = None
        self._fresh = False  # the mask matches the matcher's current state

    def prefetch(self) -> None:
        """Start computing the next mask (called right after a token is consumed)."""
        if self.owner.overlap and self._pending is None and not self._fresh:
            self._pending = self.owner._pool.submit(self._compute)

    def bias(self) -> np.ndarray:
        """The next token's logit bias; raises ConstraintError if the grammar allows nothing."""
        t = time.perf_counter()
        self._settle_pending()
        if not self._fresh:
            self._compute()
        self.owner.stats.add(wait_s=time.perf_counter() - t)
        if self.matcher.is_error():
            raise ConstraintError(_one_line(self.matcher.get_error()))
        if not self._words.any():
            raise ConstraintError("the grammar allows no next token")
        return self._bias

    def consume(self, token: int) -> None:
        """Advance past a token (sampled, or forced by the engine); ConstraintError if not allowed."""
        self._settle_pending()
        self._fresh = False
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(_one_line(self.matcher.get_error()) or f"token {token} is not allowed here")

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        self._settle_pending()
        return self.matcher.is_stopped()

    def _settle_pending(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            try:
                fut.result()
            except ThreadDied as e:
                raise ConstraintError(f"the grammar worker thread died ({e})") from None

    def _compute(self) -> None:
        t = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        np.take(_BYTE_BIAS, self._words.view(np.uint8), axis=0, out=self._rows)
        self._fresh = True
        self.owner.stats.add(compute_s=time.perf_counter() - t, masks=1)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]
