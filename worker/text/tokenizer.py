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
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.paths import model_cache_dir

__all__ = ["Tokenizer", "IncrementalDecoder", "ModelFileError", "TooManyTokens"]

# Bump when the built artefacts change meaning; old caches are then ignored and rebuilt.
CACHE_VERSION = 1

# llama.cpp token attributes (enum llama_token_attr); we keep llama.cpp's bits so every rule below
# reads like its source.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# GGUF token types (tokenizer.ggml.token_type) -> attributes.
_TYPE_TO_ATTR = {
    0: ATTR_UNDEFINED,
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # hidden unless skip_special=False
_PARTITION_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # llama.cpp cache_special_tokens

_SPACE_ESC = "\u2581"  # ▁
_SURROGATES = re.compile("[\ud800-\udfff]")

# -- pre-tokenizers for byte-level BPE (regexes as in llama.cpp's llm_tokenizer_bpe) ------------------

_RX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RX_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RX_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTok:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default before the GGUF's add_bos_token key
    no_bos: bool = False  # llama.cpp clears the BOS id (chatglm)


_PRE_DEFAULT = _PreTok((r"[\p{P}\$\+<=>\^~\|]+", _RX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_TABLE: dict[str, _PreTok] = {"default": _PRE_DEFAULT}
for _n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"):
    _PRE_TABLE[_n] = _PreTok((_RX_LLAMA3,), ignore_merges=True, add_bos=True)
for _n in ("dbrx", "smaug-bpe"):
    _PRE_TABLE[_n] = _PreTok((_RX_LLAMA3,))
for _n in ("glm4", "chatglm-bpe"):
    _PRE_TABLE[_n] = _PreTok((_RX_LLAMA3,), no_bos=True)
for _n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"):
    _PRE_TABLE[_n] = _PreTok((_RX_QWEN2,))
for _n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
           "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"):
    _PRE_TABLE[_n] = _PreTok((_RX_GPT2,))
for _n in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"):
    _PRE_TABLE[_n] = _PreTok((r"\p{N}", _RX_GPT2))
_PRE_TABLE["falcon"] = _PreTok((r"[\p{P}\$\+<=>\^~\|`]+", _RX_GPT2, r"[0-9][0-9][0-9]"))

# -- llama.cpp's text-based special token detection (llama_vocab::impl::load) --------------------------

_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id", "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id", "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id", "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}
_DEPRECATED_FIM_KEYS = {"fim_pre": "tokenizer.ggml.prefix_token_id", "fim_suf": "tokenizer.ggml.suffix_token_id",
                        "fim_mid": "tokenizer.ggml.middle_token_id"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


# ------------------------------------------------------------------------------------------------------
# Building (slow, once per model file)
# ------------------------------------------------------------------------------------------------------


def _fail(g: GGUFFile, problem: str) -> ModelFileError:
    return ModelFileError(g.path, problem.replace("\n", " "))


def _build(g: GGUFFile) -> tuple[dict, dict, bytes, np.ndarray, np.ndarray]:
    """GGUF metadata -> (HF tokenizer JSON, meta, pieces blob, piece offsets, attributes)."""
    md = g.metadata
    model = md.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise _fail(g, "unsupported tokenizer: no tokenizer.ggml.model in metadata")
    if model == "llama":
        kind = "spm"
    elif model == "gpt2":
        kind = "bpe"
    else:
        raise _fail(g, f"unsupported tokenizer model '{model}' (supported: llama, gpt2)")

    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does

    scores_raw = md.get("tokenizer.ggml.scores")
    if scores_raw is None:
        scores = np.zeros(n, dtype=np.float32)
    else:
        scores = np.asarray(scores_raw)
        if scores.ndim != 1 or scores.shape[0] < n or scores.dtype.kind not in "fiu":
            raise _fail(g, "unsupported tokenizer: tokenizer.ggml.scores is not a numeric array as long as the vocabulary")
        scores = scores[:n].astype(np.float32)
    types_raw = md.get("tokenizer.ggml.token_type")
    if types_raw is None:
        types = np.ones(n, dtype=np.int64)
    else:
        types = np.asarray(types_raw)
        if types.ndim != 1 or types.shape[0] < n or types.dtype.kind not in "iu":
            raise _fail(g, "unsupported tokenizer: tokenizer.ggml.token_type is not an integer array as long as the vocabulary")
        types = types[:n].astype(np.int64)
    attrs = np.array([_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types.tolist()], dtype=np.int32)

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise _fail(g, f"unsupported tokenizer: duplicate token {t!r} (ids {vocab[t]} and {i})")
        vocab[t] = i

    # -- flags and special ids, llama.cpp defaults first, then the GGUF keys --------------------------
    pre_name = md.get("tokenizer.ggml.pre")
    pre: _PreTok | None = None
    if kind == "spm":
        add_space_prefix, add_bos, add_eos = True, True, False
        ids: dict[str, int | None] = {"bos": 1, "eos": 2, "unk": 0}
    else:
        if pre_name is None or pre_name == "":
            pre_name = "default"
        if not isinstance(pre_name, str) or pre_name not in _PRE_TABLE:
            raise _fail(g, f"unsupported tokenizer pre-tokenizer '{pre_name}' for gpt2 vocabulary "
                           f"(supported: {', '.join(sorted(_PRE_TABLE))})")
        pre = _PRE_TABLE[pre_name]
        add_space_prefix, add_bos, add_eos = False, pre.add_bos, False
        ids = {"bos": 11, "eos": 11}
        if pre.no_bos:
            ids["bos"] = None
    for k in _ID_KEYS:
        ids.setdefault(k, None)
    for k, v in list(ids.items()):
        if v is not None and v >= n:
            ids[k] = None
    for k, key in list(_ID_KEYS.items()) + list(_DEPRECATED_FIM_KEYS.items()):
        v = md.get(key)
        if v is None:
            continue
        if isinstance(v, (int, np.integer)) and 0 <= int(v) < n:
            ids[k] = int(v)
    for key, name in (("tokenizer.ggml.add_space_prefix", "asp"), ("tokenizer.ggml.add_bos_token", "bos"),
                      ("tokenizer.ggml.add_eos_token", "eos")):
        v = md.get(key)
        if isinstance(v, (bool, np.bool_)):
            if name == "asp":
                add_space_prefix = bool(v)
            elif name == "bos":
                add_bos = bool(v)
            else:
                add_eos = bool(v)
    if add_bos and ids["bos"] is None:
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.add_bos_token is true, but no BOS token id is set")
    if add_eos and ids["eos"] is None:
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.add_eos_token is true, but no EOS token id is set")

    # -- text-based detection of EOT/EOM/FIM tokens; they become control tokens ------------------------
    def detect(name: str, texts: Iterable[str]) -> None:
        if ids[name] is not None:
            return
        for t in texts:  # llama.cpp walks a hash map; we take the first listed text that exists
            if t in vocab:
                ids[name] = vocab[t]
                attrs[vocab[t]] |= ATTR_CONTROL
                return

    detect("eot", _EOT_TEXTS)
    detect("eom", _EOM_TEXTS)
    for name, texts in _FIM_TEXTS.items():
        detect(name, texts)
    for i in range(n):  # control tokens named "unused" are unused
        if attrs[i] & ATTR_CONTROL and "unused" in tokens[i]:
            attrs[i] |= ATTR_UNUSED

    eog: set[int] = set(ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None)
    for t in _EOG_TEXTS:
        i = vocab.get(t)
        if i is not None:
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always render
        if t in vocab:
            attrs[vocab[t]] = ATTR_USER_DEFINED
    for k in ("eos", "eot", "eom"):
        if ids[k] is not None:
            eog.add(ids[k])
    eog_texts = {tokens[i] for i in eog}
    if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and "<|call|>" in eog_texts)
                                   or ("<|calls|>" in eog_texts and "<|flush|>" in eog_texts)):
        eog.discard(vocab["<|end|>"])
        attrs[vocab["<|end|>"]] = ATTR_USER_DEFINED
    if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
        eog.discard(vocab["</s>"])
        attrs[vocab["</s>"]] = ATTR_NORMAL

    # -- pieces (llama.cpp's token_to_piece cache, rendered with special=true) ------------------------
    pieces: list[bytes] = []
    for i, t in enumerate(tokens):
        a = int(attrs[i])
        if a & (_SPECIAL_ATTRS | ATTR_USER_DEFINED):
            pieces.append(t.encode("utf-8"))
        elif a & ATTR_NORMAL:
            if kind == "spm":
                pieces.append(t.replace(_SPACE_ESC, " ").encode("utf-8"))
            else:
                pieces.append(_byte_decode(t))
        elif a & ATTR_BYTE:
            try:
                pieces.append(bytes([int(t[3:5], 16)]))
            except ValueError:
                raise _fail(g, f"unsupported tokenizer: byte token {i} has text {t!r}") from None
        else:
            pieces.append(b"")

    # -- per-token strip attributes by model name (llama.cpp, after the caches) ------------------------
    name = str(md.get("general.name", "")).lower()
    arch = str(md.get("general.architecture", ""))
    pre_s = str(md.get("tokenizer.ggml.pre", ""))
    if any(s in pre_s for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in vocab:
            attrs[vocab["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in range(n):
            if attrs[i] & _PARTITION_ATTRS:
                attrs[i] |= ATTR_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in vocab:
                attrs[vocab[t]] = (attrs[vocab[t]] | ATTR_RSTRIP) if on else (attrs[vocab[t]] & ~ATTR_RSTRIP)
    elif "modern-bert" in name and "[MASK]" in vocab:
        attrs[vocab["[MASK]"]] |= ATTR_LSTRIP

    # -- the HF tokenizer ------------------------------------------------------------------------------
    added = []
    for i in range(n):
        a = int(attrs[i])
        if a & _PARTITION_ATTRS:
            added.append({"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": bool(a & _SPECIAL_ATTRS)})
    if kind == "spm":
        merges = _spm_merges(tokens, vocab, scores, attrs)
        normalizers: list[dict] = []
        if add_space_prefix:
            normalizers.append({"type": "Prepend", "prepend": _SPACE_ESC})
        normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPACE_ESC})
        unk = tokens[ids["unk"]] if ids["unk"] is not None else None
        decoders = [{"type": "Replace", "pattern": {"String": _SPACE_ESC}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"}]
        if add_space_prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        hf = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True,
                      "ignore_merges": False, "vocab": vocab, "merges": merges},
        }
    else:
        assert pre is not None
        merges = _bpe_merges(g, md.get("tokenizer.ggml.merges"), vocab)
        pretoks: list[dict] = [{"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
                               for rx in pre.regexes]
        pretoks.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
        hf = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretoks}, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges},
        }

    partition_all = [i for i in range(n) if attrs[i] & _PARTITION_ATTRS]
    partition_user = [i for i in partition_all if not attrs[i] & _SPECIAL_ATTRS]
    meta = {
        "version": CACHE_VERSION, "kind": kind, "pre": pre_name if kind == "bpe" else None,
        "n_vocab": n, "add_bos": add_bos, "add_eos": add_eos, "add_space_prefix": add_space_prefix,
        "ids": ids, "eog": sorted(eog),
        "ll_safe_all": _leftmost_longest_is_exact([tokens[i] for i in partition_all]),
        "ll_safe_user": _leftmost_longest_is_exact([tokens[i] for i in partition_user]),
    }
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return hf, meta, b"".join(pieces), offsets, attrs


def _byte_decode(text: str) -> bytes:
    """llama.cpp's llama_decode_text: GPT-2 byte-level string -> raw bytes."""
    out = bytearray()
    for ch in text:
        b = _UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:  # llama.cpp's marker for a character outside the byte alphabet
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _spm_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray, attrs: np.ndarray) -> list[str]:
    """Every split of every token into two tokens, ranked by the score of the token it makes.

    llama.cpp's SPM tokenizer merges any adjacent pair whose concatenation is a token, best score
    first; a BPE model holding all those pairs, in score order, makes the same choices. Tokens
    with a literal space can never be formed (spaces are escaped to ▁ before merging), so they are
    left out and the merges fit HF's compact "left right" format, which loads faster.
    """
    sc = scores.tolist()
    found: list[tuple[float, int, int, str, str]] = []
    for i, t in enumerate(tokens):
        if len(t) < 2 or attrs[i] & ATTR_BYTE or " " in t:
            continue
        for k in range(1, len(t)):
            left = vocab.get(t[:k])
            if left is None:
                continue
            if t[k:] in vocab:
                found.append((-sc[i], i, left, t[:k], t[k:]))
    found.sort()
    return [f"{a} {b}" for _, _, _, a, b in found]


def _bpe_merges(g: GGUFFile, raw: Any, vocab: dict[str, int]) -> list[str] | list[list[str]]:
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise _fail(g, "unsupported tokenizer: gpt2 vocabulary without tokenizer.ggml.merges")
    merges = []
    for m in raw:
        pos = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        if a in vocab and b in vocab and (a + b) in vocab:
            merges.append([a, b])
    if any(" " in a or " " in b for a, b in merges):
        return merges  # HF's pair format, which allows spaces
    return [f"{a} {b}" for a, b in merges]


def _is_run(s: str) -> bool:
    return len(set(s)) == 1


def _leftmost_longest_is_exact(texts: list[str]) -> bool:
    """True when one leftmost-longest scan partitions text exactly as llama.cpp's longest-first loop.

    The two differ only where occurrences of two special tokens overlap partially (a proper suffix
    of one is a proper prefix of the other); overlaps between runs of the same character (spaces,
    newlines, tabs) provably give the same result either way.
    """
    prefixes: dict[str, list[str]] = {}
    for t in texts:
        for k in range(1, len(t)):
            prefixes.setdefault(t[:k], []).append(t)
    for a in texts:
        for k in range(1, len(a)):
            for b in prefixes.get(a[k:], ()):
                if _is_run(a) and _is_run(b) and a[0] == b[0]:
                    continue
                return False
    return True


# ------------------------------------------------------------------------------------------------------
# Special-token partition
# ------------------------------------------------------------------------------------------------------


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


class _Partitioner:
    """Cuts special tokens out of text the way llama.cpp's tokenizer_st_partition does."""

    def __init__(self, ids: list[int], texts: list[str], attrs: np.ndarray, ll_safe: bool):
        # llama.cpp's order: longest (in bytes) first; ties by id (std::sort leaves them unspecified)
        order = sorted(range(len(ids)), key=lambda k: (-len(texts[k].encode("utf-8")), ids[k]))
        self.ids = [ids[k] for k in order]
        self.texts = [texts[k] for k in order]
        self.by_text = dict(zip(self.texts, self.ids))
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
        if not present:
            return [text]
        frags: list[str | int] = [text]
        for tid, tok in zip(self.ids, self.texts):
            if tok not in present:
                continue
            strip = self.strip.get(tid, 0)
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
            frags = new
        return frags


# ------------------------------------------------------------------------------------------------------
# The public tokenizer
# ------------------------------------------------------------------------------------------------------


BATCH_CHARS = 64 * 1024  # characters of text per encode batch (the GIL is dropped inside one)
BATCH_FRAGMENTS = 4096  # and fragments per batch (each costs a Python object on the way in and out)


class TooManyTokens(ValueError):
    """A text known to tokenize to more than the limit (`at_least` tokens or more)."""

    def __init__(self, at_least: int, limit: int, chars: int):
        super().__init__(f"the prompt has at least {at_least} tokens ({chars} characters); the limit is {limit}")
        self.at_least, self.limit, self.chars = at_least, limit, chars


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
        self._special = (attrs & _SPECIAL_ATTRS) != 0
        self._special_list = self._special.tolist()
        self._parts: dict[bool, _Partitioner] = {}
        self._parts_lock = threading.Lock()
        self._specials_all = np.flatnonzero(attrs & _PARTITION_ATTRS).tolist()
        self._longest: tuple[int, int] | None = None

    # -- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Tokenizer":
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
        hf_json, meta, pieces, offsets, attrs = _build(g)
        tok = cls(HFTokenizer.from_str(json.dumps(hf_json, ensure_ascii=False)), meta, pieces, offsets, attrs)
        if cache is not None:
            try:
                cls._save(cache, hf_json, meta, pieces, offsets, attrs)
            except OSError:
                pass  # an unwritable cache only costs speed
        return tok

    @classmethod
    def from_metadata_only(cls, g: GGUFFile) -> "Tokenizer":
        """Build without touching the cache (tests, tools)."""
        hf_json, meta, pieces, offsets, attrs = _build(g)
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
    def _load(cls, cache: Path) -> "Tokenizer":
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

    def _partitioner(self, parse_special: bool) -> _Partitioner:
        p = self._parts.get(parse_special)
        if p is None:
            with self._parts_lock:
                p = self._parts.get(parse_special)
                if p is None:
                    ids = [i for i in self._specials_all if parse_special or not self._special_list[i]]
                    texts = [self._hf.id_to_token(i) for i in ids]
                    safe = self.meta["ll_safe_all" if parse_special else "ll_safe_user"]
                    p = _Partitioner(ids, texts, self._attrs, safe)
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
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = _SURROGATES.sub("\ufffd", text)
        parts = self._partitioner(parse_special).split(text)
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        batch: list[str] = []
        slots: list[int] = []  # where each batched fragment's ids go in `pieces`
        pieces: list[list[int] | int] = []
        size, total = 0, len(out)  # characters in the batch; ids known so far

        def flush() -> None:
            nonlocal size, total
            for slot, e in zip(slots, self._hf.encode_batch_fast(batch, add_special_tokens=False)):
                pieces[slot] = e.ids
                total += len(e.ids)
            if limit is not None and total > limit:
                raise TooManyTokens(total, limit, len(text))
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
        for p in pieces:
            if isinstance(p, list):
                out.extend(p)
            else:
                out.append(p)
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        if limit is not None and len(out) > limit:
            raise TooManyTokens(len(out), limit, len(text))
        return out

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, from its length alone: no token stands for more
        bytes or characters than the vocabulary's longest piece (an unknown or byte token stands
        for one character)."""
        if not text:
            return 0
        most_bytes, most_chars = self.longest_token()
        by_chars = -(-len(text) // most_chars)
        if by_chars * most_bytes >= len(text) * 4:  # no character is longer than 4 bytes: the count of bytes adds nothing
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
        return self._hf.id_to_token(self._check(int(id)))

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HuggingFace tokenizer (standalone: its own encode splits added tokens HF's way)."""
        return self._hf

    def incremental_decoder(self, *, skip_special: bool = True) -> "IncrementalDecoder":
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

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """The rest of a stream that ended mid-character (as U+FFFD), and a reset."""
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._dec.getstate()[0])
