"""GGUF vocabularies as HuggingFace tokenizers, token for token what llama.cpp produces.

A GGUF file carries its vocabulary as metadata (`tokenizer.ggml.*`). This module turns it into a
`tokenizers.Tokenizer` (Rust, fast) and wraps it so that `encode` and `decode` agree exactly with
llama.cpp's `llama_tokenize` and `llama_token_to_piece`, the behaviour every GGUF model was
converted and tested against.

Two vocabulary kinds are supported:

* ``llama`` (SentencePiece-style, e.g. Gemma, Llama 2, Mistral): spaces become ``▁``, BPE merges
  are derived from the token scores (a merge's priority is the score of the token it makes, as in
  llama.cpp's SPM tokenizer and HF's ``convert_slow_tokenizer``), characters without a token fall
  back to ``<0xXX>`` byte tokens.
* ``gpt2`` (byte-level BPE, e.g. Llama 3, Qwen 2): explicit merges, the pre-tokenizer regexes that
  llama.cpp uses for ``tokenizer.ggml.pre``, GPT-2 byte-to-unicode mapping.

How encoding works (mirrors ``llama_vocab::impl::tokenize``):

1. Special-token partition. Every user-defined token (type 4: whitespace runs, newlines, HTML
   tags...) is cut out of the text first; with ``parse_special=True`` control tokens (type 3,
   ``<start_of_turn>``...) are cut out as well, with ``parse_special=False`` their text stays plain
   text. llama.cpp processes the special tokens longest first and splits every fragment at each
   occurrence. That is identical to one leftmost-longest scan whenever no two special tokens
   overlap partially (checked once per vocabulary at build time; runs of one repeated character
   are fine), so the common path is one regex scan; vocabularies that fail the check run the
   literal llama.cpp loop.
2. Each remaining text fragment goes through the HF tokenizer (normalizer + pre-tokenizer + BPE),
   BOS/EOS are added per ``add_bos``/``add_eos`` when ``add_special`` is true.

Decoding (mirrors ``llama_token_to_piece``): a token's piece is its text with ``▁`` turned back into
spaces (SPM) or its GPT-2 byte string decoded (BPE); byte tokens give their byte; user-defined tokens
always render as their text. Control and unknown tokens render as their text only when
``skip_special=False`` (llama.cpp's ``special=true``); with the default ``skip_special=True`` they
render as nothing, exactly like llama.cpp with ``special=false``. ``decode`` is the concatenation of
pieces (what llama.cpp's ``Llama.detokenize`` and llama-server's streaming do); llama.cpp's
``llama_detokenize`` additionally applies ``clean_up_tokenization_spaces`` for some BPE
vocabularies and strips one leading space for ``add_space_prefix`` vocabularies; we do neither, so
streamed text and full decodes always agree (for the embedded Gemma model both are identical).

The built tokenizer is cached in ``model_cache_dir(fingerprint)/tokenizer-v<N>``: the HF
tokenizer JSON, a small ``meta.json`` and the token pieces and attributes as flat arrays. The first
build of a 262k vocabulary takes a few seconds; later loads read the cache.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.paths import model_cache_dir

from .special_partition import Partitioner
from .vocab_build import CACHE_VERSION, PARTITION_ATTRS, SPECIAL_ATTRS, build

__all__ = ["Tokenizer", "IncrementalDecoder", "ModelFileError", "TooManyTokens"]

_SURROGATES = re.compile("[\ud800-\udfff]")

BATCH_CHARS = 64 * 1024  # characters of text per encode batch (the GIL is dropped inside one)
BATCH_FRAGMENTS = 4096  # and fragments per batch (each costs a Python object on the way in and out)


class TooManyTokens(ValueError):
    """A text known to tokenize to more than the limit (`at_least` tokens or more)."""

    def __init__(self, at_least: int, limit: int, chars: int):
        super().__init__(f"the prompt has at least {at_least} tokens ({chars} characters); the limit is {limit}")
        self.at_least, self.limit, self.chars = at_least, limit, chars


def _without_surrogates(text: str) -> str:
    """`text` with its lone surrogates (not valid Unicode text, so never from UTF-8 input) as U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)
    return text


class Tokenizer:
    """A GGUF model's tokenizer; encode/decode agree with llama.cpp token for token."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]
    add_bos: bool
    add_eos: bool

    def __init__(self, hf: HFTokenizer, meta: dict, pieces: bytes, offsets: np.ndarray, attrs: np.ndarray):
        self._hf = hf
        self._hf.encode_special_tokens = True  # the partition below decides what is special
        self.meta = meta
        self.kind: str = meta["kind"]
        self.vocab_size = int(meta["n_vocab"])
        ids = meta["ids"]
        self.bos_id = ids.get("bos")
        self.eos_id = ids.get("eos")
        self.eot_ids = frozenset(int(i) for i in meta["eog"])
        self.add_bos = bool(meta["add_bos"])
        self.add_eos = bool(meta["add_eos"])
        self.add_space_prefix = bool(meta["add_space_prefix"])
        self._pieces = pieces
        self._offsets = offsets.tolist()
        self._attrs = attrs
        self._special = (attrs & SPECIAL_ATTRS) != 0
        self._special_list = self._special.tolist()
        self._parts: dict[bool, Partitioner] = {}
        self._parts_lock = threading.Lock()
        self._specials_all = np.flatnonzero(attrs & PARTITION_ATTRS).tolist()
        self._longest: tuple[int, int] | None = None

    # -- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> Tokenizer:
        """Build from GGUF metadata, or load the cached build for this model file."""
        cache: Path | None
        try:
            cache = model_cache_dir(g.fingerprint) / f"tokenizer-v{CACHE_VERSION}"
        except OSError:
            cache = None  # no usable cache dir: build every time
        if cache is not None and cache.is_dir():
            try:
                return cls._load(cache)
            except Exception:  # corrupt or partial cache: rebuild it
                shutil.rmtree(cache, ignore_errors=True)
        hf_json, meta, pieces, offsets, attrs = build(g)
        tok = cls(HFTokenizer.from_str(json.dumps(hf_json, ensure_ascii=False)), meta, pieces, offsets, attrs)
        if cache is not None:
            with contextlib.suppress(OSError):  # an unwritable cache only costs speed
                cls._save(cache, hf_json, meta, pieces, offsets, attrs)
        return tok

    @classmethod
    def from_metadata_only(cls, g: GGUFFile) -> Tokenizer:
        """Build without touching the cache (tests, tools)."""
        hf_json, meta, pieces, offsets, attrs = build(g)
        return cls(HFTokenizer.from_str(json.dumps(hf_json, ensure_ascii=False)), meta, pieces, offsets, attrs)

    @staticmethod
    def _save(cache: Path, hf_json: dict, meta: dict, pieces: bytes, offsets: np.ndarray, attrs: np.ndarray) -> None:
        parent = cache.parent
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=parent))
        try:
            with open(tmp / "tokenizer.json", "w", encoding="utf-8") as f:
                json.dump(hf_json, f, ensure_ascii=False)
            (tmp / "pieces.bin").write_bytes(pieces)
            np.save(tmp / "offsets.npy", offsets)
            np.save(tmp / "attrs.npy", attrs)
            with open(tmp / "meta.json", "w", encoding="utf-8") as f:  # written last: marks a complete build
                json.dump(meta, f)
            os.rename(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cache / "meta.json").is_file():
                raise

    @classmethod
    def _load(cls, cache: Path) -> Tokenizer:
        meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
        if meta.get("version") != CACHE_VERSION:
            raise ValueError("stale tokenizer cache")
        hf = HFTokenizer.from_file(str(cache / "tokenizer.json"))
        pieces = (cache / "pieces.bin").read_bytes()
        offsets = np.load(cache / "offsets.npy")
        attrs = np.load(cache / "attrs.npy")
        if len(offsets) != meta["n_vocab"] + 1 or len(attrs) != meta["n_vocab"] or offsets[-1] != len(pieces):
            raise ValueError("inconsistent tokenizer cache")
        return cls(hf, meta, pieces, offsets, attrs)

    # -- encoding --------------------------------------------------------------------------------------

    def _partitioner(self, parse_special: bool) -> Partitioner:
        p = self._parts.get(parse_special)
        if p is None:
            with self._parts_lock:
                p = self._parts.get(parse_special)
                if p is None:
                    ids = [i for i in self._specials_all if parse_special or not self._special_list[i]]
                    texts = [self._text(i) for i in ids]
                    safe = self.meta["ll_safe_all" if parse_special else "ll_safe_user"]
                    p = Partitioner(ids, texts, self._attrs, safe)
                    self._parts[parse_special] = p
        return p

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False,
               limit: int | None = None) -> list[int]:
        """Token ids of `text`, as llama_tokenize(text, add_special, parse_special) gives them.

        parse_special=True is for rendered chat templates (control-token strings become control
        tokens); parse_special=False is for raw user text (control-token strings stay text).
        Lone surrogates (not valid Unicode text, so never from UTF-8 input) become U+FFFD.

        limit: raise TooManyTokens once the ids are known to exceed it: before any work when the
        text is too long for that many of the vocabulary's longest tokens, else between batches.
        The fragments between special tokens are encoded in batches of about BATCH_CHARS
        characters; the tokenizers library drops the GIL inside each batch, so a long text never
        holds up the other threads (the event loop) for long.
        """
        if limit is not None:
            fewest = self.fewest_tokens(text)
            if fewest > limit:
                raise TooManyTokens(fewest, limit, len(text))
        text = _without_surrogates(text)
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        out += self._encode_parts(self._partitioner(parse_special).split(text), len(out), limit, len(text))
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        if limit is not None and len(out) > limit:
            raise TooManyTokens(len(out), limit, len(text))
        return out

    def _encode_parts(self, parts: list[str | int], total: int, limit: int | None, chars: int) -> list[int]:
        """The ids of `parts` (text fragments and special tokens' ids), the fragments encoded in batches.
        total: the ids before them; limit and chars: for TooManyTokens."""
        batch: list[str] = []
        slots: list[int] = []  # where each batched fragment's ids go in `pieces`
        pieces: list[list[int] | int] = []
        size = 0  # characters in the batch; `total`: ids known so far

        def flush() -> None:
            nonlocal size, total
            for slot, e in zip(slots, self._hf.encode_batch_fast(batch, add_special_tokens=False), strict=True):
                pieces[slot] = e.ids
                total += len(e.ids)
            if limit is not None and total > limit:
                raise TooManyTokens(total, limit, chars)
            batch.clear()
            slots.clear()
            size = 0

        for p in parts:
            if isinstance(p, str):
                slots.append(len(pieces))
                pieces.append([])
                batch.append(p)
                size += len(p)
                if size >= BATCH_CHARS or len(batch) >= BATCH_FRAGMENTS:
                    flush()
            else:
                pieces.append(p)
                total += 1
        if batch:
            flush()
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, list):
                out.extend(piece)
            else:
                out.append(piece)
        return out

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, from its length alone: no token stands for more
        bytes or characters than the vocabulary's longest piece (an unknown or byte token stands
        for one character)."""
        if not text:
            return 0
        most_bytes, most_chars = self.longest_token()
        by_chars = -(-len(text) // most_chars)
        # no character is longer than 4 bytes: then the count of bytes adds nothing
        if by_chars * most_bytes >= len(text) * 4:
            return by_chars
        return max(by_chars, -(-len(text.encode("utf-8", "surrogatepass")) // most_bytes))

    def longest_token(self) -> tuple[int, int]:
        """(bytes, characters) of the longest text a single token stands for."""
        if self._longest is None:
            off = np.asarray(self._offsets, dtype=np.int64)
            lengths = off[1:] - off[:-1]
            most_chars = 1
            for i in np.argsort(-lengths, kind="stable"):  # a piece has at most as many characters as bytes
                if lengths[i] <= most_chars:
                    break
                most_chars = max(most_chars, len(self._pieces[off[i]:off[i + 1]].decode("utf-8", "replace")))
            self._longest = (max(int(lengths.max(initial=0)), 4), most_chars)
        return self._longest

    # -- decoding --------------------------------------------------------------------------------------

    def _check(self, i: int) -> int:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} out of range (vocabulary has {self.vocab_size} tokens)")
        return i

    def token_piece(self, id: int) -> bytes:
        """Raw bytes of one token, special tokens rendered as their text (llama.cpp special=true)."""
        i = self._check(int(id))
        return self._pieces[self._offsets[i]:self._offsets[i + 1]]

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = True) -> bytes:
        off, blob, special = self._offsets, self._pieces, self._special_list
        out = []
        for i in ids:
            i = self._check(int(i))
            if skip_special and special[i]:
                continue
            out.append(blob[off[i]:off[i + 1]])
        return b"".join(out)

    def piece_chars(self) -> np.ndarray:
        """Characters each token's piece adds to a text (special tokens as their text), one int32 an id:
        its UTF-8 lead bytes, so a sum over tokens counts the characters of their text even where a
        character's bytes span tokens."""
        blob = np.frombuffer(self._pieces, dtype=np.uint8)
        lead = np.concatenate([[0], np.cumsum((blob & 0xC0) != 0x80)])
        off = np.asarray(self._offsets, dtype=np.int64)
        return (lead[off[1:]] - lead[off[:-1]]).astype(np.int32)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """Text of `ids`: the concatenation of llama.cpp token pieces.

        skip_special=True (default) renders control and unknown tokens (BOS, EOS, <end_of_turn>...)
        as nothing, like llama.cpp's token_to_piece(special=false); skip_special=False renders their
        text. User-defined tokens always render. Invalid UTF-8 becomes U+FFFD.
        """
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    # -- lookups ---------------------------------------------------------------------------------------

    def is_special(self, id: int) -> bool:
        """True for control and unknown tokens: the ones decode(skip_special=True) leaves out."""
        return bool(self._special_list[self._check(int(id))])

    def id_of(self, token_str: str) -> int | None:
        """Id of the token whose text (as stored in the GGUF) is `token_str`."""
        return self._hf.token_to_id(token_str)

    def token_text(self, id: int) -> str:
        """The token's text as stored in the GGUF (with ▁ or GPT-2 byte characters)."""
        return self._text(self._check(int(id)))

    def _text(self, i: int) -> str:
        text = self._hf.id_to_token(i)
        if text is None:  # (every id in the vocabulary has one)
            raise ValueError(f"token id {i} has no text")
        return text

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HuggingFace tokenizer (standalone: its own encode splits added tokens HF's way)."""
        return self._hf

    def incremental_decoder(self, *, skip_special: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special=skip_special)


class IncrementalDecoder:
    """Streams text token by token; what it returns, joined, equals Tokenizer.decode of all ids.

    feed() returns only complete UTF-8 characters: bytes of a character split across tokens
    (byte-fallback tokens, byte-level BPE) wait for the rest; invalid sequences become U+FFFD as
    in decode. Call flush() at the end of the stream for whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, id: int) -> str:
        tok = self.tokenizer
        if self.skip_special and tok.is_special(id):
            return ""
        return self._dec.decode(tok.token_piece(id), final=False)

    def flush(self) -> str:
        """The rest of a stream that ended mid-character (as U+FFFD), and a reset."""
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._dec.getstate()[0])
