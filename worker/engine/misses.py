"""Every cache miss explained: where an admitted prompt stopped matching what the cache could have
given it, and why, as fields of its `admit` line (issue 43 item 2). Hashes only: no token or text
of a prompt is kept past its request, and none is ever logged.

A prompt is matched by the chain hashes of its full blocks (kv_blocks.py); its cached part ends at
the first block no tier supplied, block k. The admission is a miss when the cache could have had more:

  lost      block k was in the cache once: a recent sequence's chain went past k (RecentChains), or a
            tier still holds or remembers the block (its hash names this exact prefix). The cause is
            the block's fate: `restore_declined` (the store holds it, and the restore policy chose to
            compute it, being faster here), `never_persisted` (offered to the store and dropped: the
            writer was behind, the disk full or degraded; the device lost it later, or the worker
            restarted), `evicted` with the tier that last held it (`device`, `disk`), `unreadable`
            (its file failed a check), or `unknown`.
  diverged  the prompt's chain leaves the most similar recent chain at block k, inside it. In that
            chain's generated part (the conversation's previous answer, rendered again as history):
            `tokenization` when the text is the same through the end of that chain's block k or a
            few after (its bytes are fingerprinted, not kept), else `changed_text` (the template
            dropped the reasoning, re-serialized a tool call...). In its prompt part: `changed_text`
            only when the prompt goes on with that chain's content after the change (at least
            REALIGN_SHARE of that chain's content-anchored token windows after block k recur in the
            prompt: an agent that rewrote its git status in the system prompt); otherwise the prompt
            is another conversation, or a history the agent cut and summarised, and no miss is told.

The fields: `miss_cause`; `diverged_at`, the first token the cache could have supplied and did not (a
block's first token: chains compare by block, so the change itself lies within the next block_size
tokens); `could_have_cached`, the tokens the cache would have supplied (for a divergence: had the
text not changed, up to the similar chain's length); `evicted_from`; `diverged_char`, the offset of
diverged_at in the rendered prompt, in characters (from the tokens' own text, special tokens as theirs);
and for chat-shaped requests `diverged_message` ({index, role}): the rendered message whose content
begins at or before that offset (api/prepare.py finds each message's content in the rendered text;
where a template rewrites a message, such as a tool call, its start counts as the previous one's end).

Memory is bounded: at most MAX_CHAINS recent chains and MAX_BYTES of their fingerprints, oldest first
out; a chain that is a prefix of a newer one is dropped for it. The work happens at admission (only
when the prompt missed something) and at settling (a join of the chain's hashes, the prompt's anchored
windows, the answer's text fingerprints), on the engine thread; none of it may fail a request.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.ops.contract import MissCause

from ..logs import log
from .kv_blocks import BlockPool
from .sequence import Seq

MAX_CHAINS = 256  # recent sequences remembered
MAX_BYTES = 32 << 20  # their hashes and fingerprints together
MAX_TEXT_BLOCKS = 512  # blocks of a generated part whose text is fingerprinted (the tokenization check)
TEXT_LOOKAHEAD = 8  # blocks past the divergence the tokenization check reads
MAX_RUN = 1 << 16  # blocks past block k checked for what a tier holds or held
WINDOW = 16  # tokens of a content-anchored window
REALIGN_SHARE = 0.5  # of a chain's windows after the change that must recur in the prompt
REALIGN_TOKENS = 1 << 15  # of the chain after the change whose windows are looked for...
REALIGN_SLACK = 1 << 13  # ...in as many tokens of the prompt after it, and this many more (a longer change)
MIN_WINDOWS = 4  # fewer windows after the change: too little to tell a changed text from another conversation

_KEYS = np.random.default_rng().integers(1, 1 << 62, size=WINDOW + 3, dtype=np.uint64) | np.uint64(1)  # per process


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(31))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    return x ^ (x >> np.uint64(29))


def anchored_windows(tokens: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(positions, fingerprints) of the content-anchored windows of tokens[start:]: a window begins
    wherever a pair of tokens hashes to 0 mod 16 (about one position in sixteen, found again wherever
    the same tokens recur, shifted or not) and covers WINDOW tokens; its fingerprint is a keyed hash of
    them (keyed per process, never stored outside it)."""
    t = np.asarray(tokens[start:], dtype=np.int64).astype(np.uint64)
    if len(t) < WINDOW + 1:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    pair = _mix(t[:-1] * _KEYS[0] + t[1:] * _KEYS[1])
    pos = np.flatnonzero((pair >> np.uint64(60)) == 0)
    pos = pos[pos <= len(t) - WINDOW]
    if not len(pos):
        return pos.astype(np.int64), np.zeros(0, np.uint64)
    w = t[pos[:, None] + np.arange(WINDOW)]
    fp = _mix((_mix(w * _KEYS[2:2 + WINDOW]) * _KEYS[2 + WINDOW]).sum(axis=1))
    return pos.astype(np.int64) + start, fp


@dataclass(frozen=True)
class Chain:
    """What is remembered of one settled sequence: its full blocks' chain hashes (16 bytes each), where
    its generated part begins, its prompt's anchored windows, and its generated part's text fingerprints
    ((bytes from gen_block's first token to the end of block j, an 8-byte digest) for j from gen_block)."""

    hashes: bytes
    gen_block: int
    anchors: np.ndarray
    windows: np.ndarray
    text: tuple[tuple[int, bytes], ...]

    @property
    def blocks(self) -> int:
        return len(self.hashes) // 16

    @property
    def nbytes(self) -> int:
        return len(self.hashes) + self.anchors.nbytes + self.windows.nbytes + 24 * len(self.text) + 200


def common_blocks(a: bytes, b: bytes) -> int:
    """Leading blocks two chains share (16 bytes a block)."""
    n = min(len(a), len(b)) // 16
    if not n or a[:16] != b[:16]:
        return 0
    x = np.frombuffer(a, np.uint64, 2 * n)  # views: nothing is copied
    y = np.frombuffer(b, np.uint64, 2 * n)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) // 2 if len(differ) else n


class RecentChains:
    """The last MAX_CHAINS sequences' chains, newest last, within MAX_BYTES."""

    def __init__(self, max_chains: int = MAX_CHAINS, max_bytes: int = MAX_BYTES):
        self.max_chains, self.max_bytes = max_chains, max_bytes
        self._chains: OrderedDict[int, Chain] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._chains)

    def add(self, chain: Chain) -> None:
        for key, old in list(self._chains.items()):
            if chain.hashes.startswith(old.hashes):  # the same sequence's prefix, or an earlier attempt
                self._drop(key)
        self._chains[self._next] = chain
        self._next += 1
        self.nbytes += chain.nbytes
        while self._chains and (len(self._chains) > self.max_chains or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._chains)))

    def _drop(self, key: int) -> None:
        self.nbytes -= self._chains.pop(key).nbytes

    def most_similar(self, hashes: bytes) -> tuple[Chain | None, int]:
        """The chain sharing the most leading blocks with `hashes` (the newest among equals), and how
        many it shares; (None, 0) when none shares the first."""
        best, most = None, 0
        for chain in reversed(self._chains.values()):
            n = common_blocks(chain.hashes, hashes)
            if n > most:
                best, most = chain, n
        return best, most


@dataclass(frozen=True)
class Miss:
    cause: MissCause
    diverged_at: int
    could_have_cached: int
    evicted_from: str | None = None
    diverged_char: int | None = None
    diverged_message: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """The admit line's miss fields (contract.ADMIT_MISS_FIELDS), those that apply."""
        out: dict[str, Any] = {"miss_cause": self.cause.value, "diverged_at": self.diverged_at,
                               "could_have_cached": self.could_have_cached}
        if self.evicted_from is not None:
            out["evicted_from"] = self.evicted_from
        if self.diverged_char is not None:
            out["diverged_char"] = self.diverged_char
        if self.diverged_message is not None:
            out["diverged_message"] = self.diverged_message
        return out


class MissExplainer:
    """The engine's record of recent chains and its account of each admission's misses. `store`: the
    KVStore or None; `tokenizer`: the model's (the characters each token stands for)."""

    def __init__(self, pool: BlockPool, store, tokenizer):
        self.pool, self.store, self.tokenizer = pool, store, tokenizer
        self.bs = pool.block_size
        self.recent = RecentChains()
        self._chars: np.ndarray | None = None
        self._warned = False

    # -- settling: remember the chain --------------------------------------------------------------------

    def record(self, s: Seq) -> None:
        """Remember a settled sequence's chain (never raises)."""
        try:
            if s.kv.n_registered and not s.req.probe:
                self.recent.add(self._chain(s))
        except Exception as e:
            self._trouble("record", e)

    def _chain(self, s: Seq) -> Chain:
        bs, n = self.bs, s.kv.n_registered
        hashes = b"".join(s.kv.hashes[:n])
        gen_block = s.prompt_len // bs
        prompt_end = min(s.prompt_len, n * bs)
        # the windows of the prefix a recent chain shares are that chain's: only the rest is computed
        # (a conversation's turn costs what it added, not its whole length)
        like, common = self.recent.most_similar(hashes)
        shared = min(common, like.gen_block) * bs if like is not None else 0  # where its windows go
        start = max(0, min(shared, prompt_end) - WINDOW + 1)
        anchors, windows = anchored_windows(np.asarray(s.tokens[start:prompt_end], dtype=np.int64), 0)
        anchors += start
        if like is not None and start:
            kept = like.anchors < start
            anchors = np.concatenate([like.anchors[kept].astype(np.int64), anchors])
            windows = np.concatenate([like.windows[kept], windows])
        text: list[tuple[int, bytes]] = []
        if gen_block < n:
            h = hashlib.blake2b(digest_size=8)
            length = 0
            for j in range(gen_block, min(n, gen_block + MAX_TEXT_BLOCKS)):
                piece = self.tokenizer.decode_bytes(s.tokens[max(j * bs, gen_block * bs):(j + 1) * bs],
                                                    skip_special=False)
                h.update(piece)
                length += len(piece)
                text.append((length, h.copy().digest()))
        return Chain(hashes, gen_block, anchors.astype(np.int32), windows, tuple(text))

    # -- admission: explain -------------------------------------------------------------------------------

    def explain(self, s: Seq) -> Miss | None:
        """The admission's miss, or None (everything cacheable was cached, or nothing more was possible).
        Never raises."""
        try:
            return self._explain(s)
        except Exception as e:
            self._trouble("explain", e)
            return None

    def _explain(self, s: Seq) -> Miss | None:
        bs = self.bs
        if s.req.prompt_logprobs:  # nothing of such a prompt is reused, by design
            return None
        reuse = (s.prompt_len - 1) // bs  # the blocks a prompt can take from the cache (its last token computes)
        k = s.cached_tokens // bs
        hashes = s.kv.hashes[: s.prompt_len // bs]
        if k >= reuse or len(hashes) < reuse:
            return None
        best, common = self.recent.most_similar(b"".join(hashes))
        common = min(common, reuse)
        run = self._known_run(hashes, k, reuse)
        if common > k or run:  # lost: block k was in the cache once
            cause, tier = self._fate(hashes[k])
            return self._miss(s, cause, k, max(common, k + run), tier)
        if best is None or common != k or best.blocks <= k:
            return None
        if k >= best.gen_block:
            cause = MissCause.TOKENIZATION if self._same_text(best, s, k) else MissCause.CHANGED_TEXT
        elif self._realigns(best, s, k):
            cause = MissCause.CHANGED_TEXT
        else:
            return None  # another conversation from a shared head, or a history rewritten: new content
        return self._miss(s, cause, k, min(best.blocks, reuse), None)

    def _miss(self, s: Seq, cause: MissCause, k: int, could_blocks: int, tier: str | None) -> Miss:
        at = k * self.bs
        char = self._char_offset(s.tokens, at)
        spans = s.req.message_spans
        message = None
        if spans is not None and spans.starts:
            i = max(0, bisect.bisect_right(spans.starts, char) - 1)
            message = {"index": i, "role": spans.roles[i]}
        return Miss(cause, at, could_blocks * self.bs, tier, char, message)

    def _known_run(self, hashes: list[bytes], k: int, reuse: int) -> int:
        """Consecutive blocks from k that a tier holds (the device, the store) or remembers losing."""
        pool, store = self.pool, self.store
        i = k
        while i < reuse and i - k < MAX_RUN:
            h = hashes[i]
            if not (h in pool.by_hash or pool.was_evicted(h)
                    or (store is not None and (store.lost(h) is not None or store.where([h])))):
                break
            i += 1
        return i - k

    def _fate(self, h: bytes) -> tuple[MissCause, str | None]:
        store = self.store
        if store is not None:
            if store.where([h]):
                return MissCause.RESTORE_DECLINED, None
            fate = store.lost(h)
            if fate == "not_persisted":
                return MissCause.NEVER_PERSISTED, None
            if fate == "evicted":
                return MissCause.EVICTED, "disk"
            if fate == "unreadable":
                return MissCause.UNREADABLE, None
        if self.pool.was_evicted(h):
            return MissCause.EVICTED, "device"
        return MissCause.UNKNOWN, None

    def _same_text(self, chain: Chain, s: Seq, k: int) -> bool:
        """The prompt's text from the chain's generated part on equals the chain's through the end of
        its block k, or one of the next TEXT_LOOKAHEAD blocks: the tokens differ, the text does not."""
        first = k - chain.gen_block
        checks = chain.text[first:first + TEXT_LOOKAHEAD + 1]
        if not checks:
            return False
        start = chain.gen_block * self.bs
        need = checks[-1][0]
        tokens, data, end = s.tokens, b"", start
        while len(data) < need and end < s.prompt_len:  # the prompt's bytes from `start`, as many as needed
            nxt = min(s.prompt_len, end + max(self.bs, need - len(data)))
            data += self.tokenizer.decode_bytes(tokens[end:nxt], skip_special=False)
            end = nxt
        return any(len(data) >= n and hashlib.blake2b(data[:n], digest_size=8).digest() == d for n, d in checks)

    def _realigns(self, chain: Chain, s: Seq, k: int) -> bool:
        """The prompt goes on with the chain's content after block k: REALIGN_SHARE of the chain's
        anchored windows between block k and its generated part recur in the prompt after block k."""
        lo = k * self.bs
        hi = min(chain.gen_block * self.bs, lo + REALIGN_TOKENS)
        theirs = chain.windows[(chain.anchors >= lo) & (chain.anchors + WINDOW <= hi)]
        if len(theirs) < MIN_WINDOWS:
            return False
        end = min(s.prompt_len, hi + REALIGN_SLACK)
        _, ours = anchored_windows(np.asarray(s.tokens[lo:end], dtype=np.int64))
        return float(np.isin(theirs, ours).mean()) >= REALIGN_SHARE

    def _char_offset(self, tokens: list[int], at: int) -> int:
        """Characters of the rendered prompt before token `at` (a BOS the tokenizer added is not in it)."""
        tok = self.tokenizer
        if self._chars is None:
            self._chars = tok.piece_chars()
        first = 1 if tok.add_bos and tokens and tokens[0] == tok.bos_id else 0
        if at <= first:
            return 0
        return int(self._chars[np.asarray(tokens[first:at], dtype=np.int64)].sum())

    def _trouble(self, what: str, e: Exception) -> None:
        if not self._warned:  # once: a diagnostic must not flood the log it serves
            self._warned = True
            log("cache_miss_error", level="warning", stage=what, error=f"{type(e).__name__}: {e}")
