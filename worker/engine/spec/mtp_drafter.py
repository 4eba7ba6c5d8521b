"""`--spec mtp`: the model's own next-token (MTP) layer drafts, where the GGUF ships one (DeepSeek V4's
blk.N.nextn.*; backends/numpy/mtp.MtpHead computes it, and on cuda backends/cuda/hyper_mtp.MtpLayer).

From the last token and the trunk's output streams at the position before it, the layer guesses the
next token; its own output streams and that guess make the next guess, and so on (llama.cpp drafts
a single-layer head the same way). The target model checks the draft as it checks any other
(speculation.py), so the output is the model's own whatever the layer guesses.

The layer's attention reads its key rows over the window from the model's KV pool, where the target's
forward pass writes them with every position it computes. A sequence's state is therefore only its
block table (handed over with its tokens at each draft), and nothing is rolled back when guesses are
refused: a draft keeps its own rows apart, and the pool's rows past what the target accepted are
written over when those positions are computed again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MTP_MATCH = 8  # the "match length" its drafts report to the policy (speculation.MATCH_PRIOR): a trained
# head's first guess stands about as often as a draft model's


class DraftHead(Protocol):
    """The layer that drafts (the numpy backend's MtpHead, the cuda backend's `mtp`): k greedy guesses after
    `token` at position `at`, from the sequence's KV in the pool."""

    @property
    def block_size(self) -> int: ...

    def draft(self, block_table: list[int], token: int, at: int, k: int) -> list[int]: ...


class MtpState:
    """One sequence as the drafter sees it: its tokens, and the blocks holding their KV."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.blocks: list[int] = []

    def sync(self, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> None:
        if len(tokens) > len(self.tokens):
            self.tokens.extend(int(t) for t in tokens[len(self.tokens):])
        self.blocks = list(blocks or [])


class MtpDrafter:
    name = "mtp"
    match = MTP_MATCH

    def __init__(self, head: DraftHead):
        self.head = head

    def new_index(self) -> MtpState:
        return MtpState()

    def propose(self, st: MtpState, k: int) -> tuple[list[int], int]:
        """k guesses after the last token; every position before it is in the pool (the scheduler drafts
        only for a sequence whose last token is all it has left to compute)."""
        at = len(st.tokens) - 1
        if at < 1 or k < 1 or len(st.blocks) * self.head.block_size <= at - 1:
            return [], 0
        return self.head.draft(st.blocks, st.tokens[-1], at, k), self.match

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        pass

    def release(self, st: MtpState) -> None:
        st.blocks = []
