"""Turning rendered chat text into prompt token ids."""

from __future__ import annotations

from .tokenizer import Tokenizer


def encode_chat(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """Tokenize a rendered chat template: special tokens parsed, exactly one BOS.

    Templates usually print the BOS token themselves; the tokenizer adds one too when the model
    asks for it, and a doubled BOS measurably changes the output (llama.cpp warns about it).
    """
    ids = tokenizer.encode(rendered, add_special=True, parse_special=True)
    bos = tokenizer.bos_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
