"""Cutting special tokens out of a text before the BPE runs, the way llama.cpp's
tokenizer_st_partition does: longest token first, every fragment split at each occurrence.

That loop equals one leftmost-longest regex scan whenever no two special tokens overlap partially
(vocab_build checks it once per vocabulary), so the common path is one scan; other vocabularies,
and tokens with strip attributes (phi-3, jina), run the literal loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from .vocab_build import ATTR_LSTRIP, ATTR_RSTRIP


def _trie_regex(texts: Iterable[str]) -> str:
    """A regex that matches the longest of `texts` at a position (children before the end mark)."""
    root: dict = {}
    for w in texts:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = None
    # iterative post-order to stay clear of the recursion limit on long tokens
    out: dict[int, str] = {}
    stack: list[tuple[dict, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if not done:
            stack.append((node, True))
            for ch, child in node.items():
                if ch != "":
                    stack.append((child, False))
            continue
        alts = [re.escape(ch) + out.pop(id(child)) for ch, child in node.items() if ch != ""]
        end = "" in node
        if not alts:
            out[id(node)] = ""
        elif len(alts) == 1 and not end:
            out[id(node)] = alts[0]
        else:
            out[id(node)] = "(?:" + "|".join(alts) + ("|" if end else "") + ")"
    return out[id(root)]


class Partitioner:
    """Cuts special tokens out of text the way llama.cpp's tokenizer_st_partition does."""

    def __init__(self, ids: list[int], texts: list[str], attrs: np.ndarray, ll_safe: bool):
        # llama.cpp's order: longest (in bytes) first; ties by id (std::sort leaves them unspecified)
        order = sorted(range(len(ids)), key=lambda k: (-len(texts[k].encode("utf-8")), ids[k]))
        self.ids = [ids[k] for k in order]
        self.texts = [texts[k] for k in order]
        self.by_text = dict(zip(self.texts, self.ids, strict=True))
        self.strip = {self.ids[k]: int(attrs[self.ids[k]]) & (ATTR_LSTRIP | ATTR_RSTRIP) for k in range(len(order))}
        # strip attributes (phi-3, jina) act while llama.cpp's loop runs: only the literal loop gets them right
        self.exact_scan = not ll_safe or any(self.strip.values())
        self.rx = re.compile(_trie_regex(self.texts)) if self.texts else None
        self._rx_overlap: re.Pattern | None = None
        self._prefix_tokens: dict[str, list[str]] | None = None

    def split(self, text: str) -> list[str | int]:
        if self.rx is None or not text:
            return [text] if text else []
        if self.exact_scan:
            return self._split_exact(text)
        out: list[str | int] = []
        pos = 0
        for m in self.rx.finditer(text):
            if m.start() > pos:
                out.append(text[pos:m.start()])
            out.append(self.by_text[m.group()])
            pos = m.end()
        if pos == 0:
            return [text]
        if pos < len(text):
            out.append(text[pos:])
        return out

    def _split_exact(self, text: str) -> list[str | int]:
        """The literal llama.cpp loop, restricted to the special tokens that occur in `text`."""
        present = self._present(text)
        if not present:
            return [text]
        frags: list[str | int] = [text]
        for tid, tok in zip(self.ids, self.texts, strict=True):
            if tok in present:
                frags = _cut(frags, tid, tok, self.strip.get(tid, 0))
        return frags

    def _present(self, text: str) -> set[str]:
        """The special tokens that occur in `text`."""
        if self._rx_overlap is None:
            self._rx_overlap = re.compile("(?=(" + _trie_regex(self.texts) + "))")
            pt: dict[str, list[str]] = {}
            for t in self.texts:
                pt[t] = [t[:k] for k in range(1, len(t) + 1) if t[:k] in self.by_text]
            self._prefix_tokens = pt
        assert self._prefix_tokens is not None
        present: set[str] = set()
        for m in self._rx_overlap.finditer(text):
            present.update(self._prefix_tokens[m.group(1)])
        return present


def _cut(frags: list[str | int], tid: int, tok: str, strip: int) -> list[str | int]:
    """One token's pass of llama.cpp's loop: each `tok` in the text fragments becomes `tid`, the
    whitespace beside it stripped where its attributes say."""
    new: list[str | int] = []
    for f in frags:
        if not isinstance(f, str):
            new.append(f)
            continue
        start = 0
        while True:
            hit = f.find(tok, start)
            if hit < 0:
                break
            left = f[start:hit]
            if strip & ATTR_LSTRIP:
                left = left.rstrip(" \t\n\v\f\r")
            if left:
                new.append(left)
            new.append(tid)
            start = hit + len(tok)
            if strip & ATTR_RSTRIP:
                while start < len(f) and f[start] in " \t\n\v\f\r":
                    start += 1
        if start < len(f):
            new.append(f[start:])
    return new
