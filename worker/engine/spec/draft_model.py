"""`--spec draft:PATH`: a small GGUF model with the target's vocabulary drafts by decoding greedily ahead.

It runs on the target's backend kind, with a KV pool of its own. Each sequence keeps what its draft
cache holds (`fed`: the tokens whose KV is there); before a proposal the cache is rolled back to what
the sequence still agrees with (guesses the target refused are simply overwritten), the new tokens are
fed in one step, and k - 1 more single-token steps decode the rest of the draft.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...backends.base import Backend, SeqChunk
from ...model.gguf_file import ModelFileError

DRAFT_MATCH = 8  # the "match length" a model's draft reports to the policy (speculation.MATCH_PRIOR)


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

    def __init__(self, model, backend, n_blocks: int):
        """model: the draft model (loader.Model); backend: a backend over it with n_blocks KV blocks."""
        self.model, self.backend = model, backend
        self.bs = backend.block_size
        self._free = list(range(n_blocks - 1, -1, -1))

    @classmethod
    def load(cls, path: str, target_model, backend_kind: str, n_blocks: int, block_size: int) -> ModelDrafter:
        """The draft model at `path`, refused in one line where its vocabulary is not the target's."""
        from ...model.loader import open_model

        model = open_model(path)
        ours, theirs = (m.gguf.get("tokenizer.ggml.tokens") for m in (target_model, model))
        if model.config.vocab_size != target_model.config.vocab_size or list(ours or []) != list(theirs or []):
            raise ModelFileError(Path(path), f"the draft model's vocabulary ({model.config.vocab_size} tokens) is not "
                                             f"the model's ({target_model.config.vocab_size} tokens): a draft must "
                                             "share the model's tokenizer")
        backend: Backend
        if backend_kind == "cuda":
            from ...backends.cuda.backend import CudaBackend

            backend = CudaBackend(model.config, model.gguf, n_blocks=n_blocks, block_size=block_size)
        else:
            from ...backends.numpy.backend import NumpyBackend
            from ...model.weights import load_weights

            backend = NumpyBackend(model.config, load_weights(model.gguf, model.config), n_blocks=n_blocks,
                                   block_size=block_size)
        return cls(model, backend, n_blocks)

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
        logits = self.backend.forward([SeqChunk(np.asarray(toks[agree:], np.int32), agree, st.blocks, "last")])[0]
        draft = [int(np.argmax(logits[-1]))]
        st.fed = list(toks)
        while len(draft) < k:
            at = len(st.fed)
            logits = self.backend.forward([SeqChunk(np.asarray(draft[-1:], np.int32), at, st.blocks, "last")])[0]
            st.fed.append(draft[-1])
            draft.append(int(np.argmax(logits[-1])))
        return draft, DRAFT_MATCH

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
