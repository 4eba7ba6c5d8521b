"""`--spec draft:PATH`: a small GGUF model with the target's vocabulary drafts by decoding greedily ahead.

It runs on the target's backend kind, with a KV pool of its own (the server builds that backend;
`open_draft_model` opens the file and refuses one whose vocabulary is not the target's). Each sequence
keeps what its draft cache holds (`fed`: the tokens whose KV is there); before a proposal the cache is
rolled back to what the sequence still agrees with (guesses the target refused are simply
overwritten), the new tokens are fed in one step, and k - 1 more single-token steps decode the rest of
the draft.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...backends.base import Backend, SeqChunk
from ...model.gguf_file import ModelFileError
from ...model.loader import Model, open_model

DRAFT_MATCH = 8  # the "match length" a model's draft reports to the policy (speculation.MATCH_PRIOR)


def open_draft_model(path: str, target_model: Model) -> Model:
    """The draft model at `path`, refused in one line where its vocabulary is not the target's."""
    model = open_model(path)
    ours, theirs = (m.gguf.get("tokenizer.ggml.tokens") for m in (target_model, model))
    if model.config.vocab_size != target_model.config.vocab_size or list(ours or []) != list(theirs or []):
        raise ModelFileError(Path(path), f"the draft model's vocabulary ({model.config.vocab_size} tokens) is not "
                                         f"the model's ({target_model.config.vocab_size} tokens): a draft must "
                                         "share the model's tokenizer")
    return model


class DraftState:
    """One sequence's draft cache: its tokens (as TokenIndex keeps them), and what the cache holds."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.fed: list[int] = []  # the tokens at the cache's positions 0.. (the last draft's included)
        self.blocks: list[int] = []

    def sync(self, tokens, blocks=None) -> None:  # its own cache: the target's blocks are no concern of it
        if len(tokens) > len(self.tokens):
            self.tokens.extend(int(t) for t in tokens[len(self.tokens):])


class ModelDrafter:
    name = "draft"

    def __init__(self, model: Model, backend: Backend, n_blocks: int):
        """model: the draft model (open_draft_model); backend: a backend over it with n_blocks KV blocks."""
        self.model, self.backend = model, backend
        self.bs = backend.block_size
        self._free = list(range(n_blocks - 1, -1, -1))

    def new_index(self) -> DraftState:
        return DraftState()

    def propose(self, st: DraftState, k: int) -> tuple[list[int], int]:
        toks = st.tokens
        agree = 0
        for a, b in zip(st.fed, toks, strict=False):
            if a != b:
                break
            agree += 1
        agree = min(agree, len(toks) - 1)  # the last token is fed again: its logits start the draft
        if not self._hold(st, len(toks) + k):
            return [], 0
        st.fed = list(toks[:agree])
        draft = [self._greedy(toks[agree:], agree, st.blocks)]
        st.fed = list(toks)
        while len(draft) < k:
            at = len(st.fed)
            token = self._greedy(draft[-1:], at, st.blocks)
            st.fed.append(draft[-1])
            draft.append(token)
        return draft, DRAFT_MATCH

    def _greedy(self, tokens: list[int], at: int, blocks: list[int]) -> int:
        """The argmax after `tokens` fed at position `at`."""
        (logits,) = self.backend.forward([SeqChunk(np.asarray(tokens, np.int32), at, blocks, "last")])
        assert isinstance(logits, np.ndarray)  # a chunk without `sample`: logits, never a draw
        return int(np.argmax(logits[-1]))

    def _hold(self, st: DraftState, length: int) -> bool:
        need = -(-length // self.bs) - len(st.blocks)
        if need > len(self._free):
            return False
        st.blocks.extend(self._free.pop() for _ in range(max(0, need)))
        return True

    def release(self, st: DraftState) -> None:
        self._free.extend(st.blocks)
        st.blocks, st.fed = [], []

    def finished(self, tokens, prompt_len: int) -> None:
        pass
