"""GGUF vocabulary metadata -> a HuggingFace tokenizer definition, token attributes and pieces,
read the way llama.cpp's `llama_vocab::impl::load` reads them (slow; once per model file, then
cached by tokenizer.py).

Two vocabulary kinds are supported: ``llama`` (SentencePiece-style: spaces become ``▁``, BPE merges
derived from the token scores, ``<0xXX>`` byte fallback) and ``gpt2`` (byte-level BPE: explicit
merges, the pre-tokenizer regexes llama.cpp uses for ``tokenizer.ggml.pre``, GPT-2's byte-to-unicode
mapping). Special ids, end-of-generation tokens and per-token attributes follow llama.cpp's rules,
down to its text-based detection and its per-model exceptions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.worker.model.gguf_file import GGUFFile, ModelFileError

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

SPECIAL_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # hidden unless skip_special=False
PARTITION_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # llama.cpp cache_special_tokens

_SPACE_ESC = "\u2581"  # ▁

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

# o200k (tiktoken's o200k_base pattern, llama.cpp's GPT4O pre-tokenizer): gpt-oss, Llama 4
_RX_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
for _n in ("gpt-4o", "llama4", "minimax-m2"):
    _PRE_TABLE[_n] = _PreTok((_RX_O200K,))
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
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


# ------------------------------------------------------------------------------------------------------
# Building (slow, once per model file)
# ------------------------------------------------------------------------------------------------------


def _fail(g: GGUFFile, problem: str) -> ModelFileError:
    return ModelFileError(g.path, problem.replace("\n", " "))


def build(g: GGUFFile) -> tuple[dict, dict, bytes, np.ndarray, np.ndarray]:
    """GGUF metadata -> (HF tokenizer JSON, meta, pieces blob, piece offsets, attributes)."""
    md = g.metadata
    kind = _kind(g)
    tokens = _tokens(g)
    n = len(tokens)
    scores = _per_token(g, "tokenizer.ggml.scores", n, "fiu", "a numeric array", np.float32, 0)
    types = _per_token(g, "tokenizer.ggml.token_type", n, "iu", "an integer array", np.int64, 1)
    attrs = np.array([_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types.tolist()], dtype=np.int32)
    vocab = _vocab(g, tokens)
    flags = _flags(g, kind, n)
    ids = flags.ids
    _detect_by_text(ids, vocab, tokens, attrs)
    eog = _end_of_generation(ids, vocab, tokens, attrs)
    pieces = _pieces(g, kind, tokens, attrs)
    _strip_by_model(md, vocab, attrs)

    added = _added_tokens(tokens, attrs)
    if kind == "spm":
        hf = _hf_spm(tokens, vocab, scores, attrs, flags, added)
    else:
        assert flags.pre is not None
        hf = _hf_bpe(g, vocab, flags.pre, added)
    partition_all = [i for i in range(n) if attrs[i] & PARTITION_ATTRS]
    partition_user = [i for i in partition_all if not attrs[i] & SPECIAL_ATTRS]
    meta = {
        "version": CACHE_VERSION, "kind": kind, "pre": flags.pre_name if kind == "bpe" else None,
        "n_vocab": n, "add_bos": flags.add_bos, "add_eos": flags.add_eos, "add_space_prefix": flags.add_space_prefix,
        "ids": ids, "eog": sorted(eog),
        "ll_safe_all": _leftmost_longest_is_exact([tokens[i] for i in partition_all]),
        "ll_safe_user": _leftmost_longest_is_exact([tokens[i] for i in partition_user]),
    }
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return hf, meta, b"".join(pieces), offsets, attrs


# -- the vocabulary ---------------------------------------------------------------------------------------


def _kind(g: GGUFFile) -> str:
    """spm (tokenizer.ggml.model llama) or bpe (gpt2)."""
    model = g.metadata.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise _fail(g, "unsupported tokenizer: no tokenizer.ggml.model in metadata")
    if model == "llama":
        return "spm"
    if model == "gpt2":
        return "bpe"
    raise _fail(g, f"unsupported tokenizer model '{model}' (supported: llama, gpt2)")


def _tokens(g: GGUFFile) -> list[str]:
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.tokens is missing or not a list of strings")
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does


def _per_token(g: GGUFFile, key: str, n: int, kinds: str, what: str, dtype: type, default: int) -> np.ndarray:
    """The first n of a per-token array, or `default` for every token where the key is absent."""
    raw = g.metadata.get(key)
    if raw is None:
        return np.full(n, default, dtype=dtype)
    values = np.asarray(raw)
    if values.ndim != 1 or values.shape[0] < n or values.dtype.kind not in kinds:
        raise _fail(g, f"unsupported tokenizer: {key} is not {what} as long as the vocabulary")
    return values[:n].astype(dtype)


def _vocab(g: GGUFFile, tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise _fail(g, f"unsupported tokenizer: duplicate token {t!r} (ids {vocab[t]} and {i})")
        vocab[t] = i
    return vocab


# -- flags and special ids, llama.cpp defaults first, then the GGUF keys ----------------------------------


@dataclass
class _Flags:
    pre_name: Any  # tokenizer.ggml.pre as given ("default" for a gpt2 vocabulary without one)
    pre: _PreTok | None  # a gpt2 vocabulary's pre-tokenizer
    add_space_prefix: bool
    add_bos: bool
    add_eos: bool
    ids: dict[str, int | None]


def _flags(g: GGUFFile, kind: str, n: int) -> _Flags:
    md = g.metadata
    flags = _defaults(g, kind)
    ids = flags.ids
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
    flags.add_space_prefix = _flag(md, "tokenizer.ggml.add_space_prefix", flags.add_space_prefix)
    flags.add_bos = _flag(md, "tokenizer.ggml.add_bos_token", flags.add_bos)
    flags.add_eos = _flag(md, "tokenizer.ggml.add_eos_token", flags.add_eos)
    if flags.add_bos and ids["bos"] is None:
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.add_bos_token is true, but no BOS token id is set")
    if flags.add_eos and ids["eos"] is None:
        raise _fail(g, "unsupported tokenizer: tokenizer.ggml.add_eos_token is true, but no EOS token id is set")
    return flags


def _defaults(g: GGUFFile, kind: str) -> _Flags:
    """llama.cpp's defaults for the kind (and a gpt2 vocabulary's pre-tokenizer)."""
    pre_name = g.metadata.get("tokenizer.ggml.pre")
    if kind == "spm":
        return _Flags(pre_name, None, True, True, False, {"bos": 1, "eos": 2, "unk": 0})
    if pre_name is None or pre_name == "":
        pre_name = "default"
    if not isinstance(pre_name, str) or pre_name not in _PRE_TABLE:
        raise _fail(g, f"unsupported tokenizer pre-tokenizer '{pre_name}' for gpt2 vocabulary "
                       f"(supported: {', '.join(sorted(_PRE_TABLE))})")
    pre = _PRE_TABLE[pre_name]
    return _Flags(pre_name, pre, False, pre.add_bos, False, {"bos": None if pre.no_bos else 11, "eos": 11})


def _flag(md: dict, key: str, default: bool) -> bool:
    v = md.get(key)
    return bool(v) if isinstance(v, (bool, np.bool_)) else default


# -- text-based detection of EOT/EOM/FIM tokens; they become control tokens -------------------------------


def _detect_by_text(ids: dict[str, int | None], vocab: dict[str, int], tokens: list[str], attrs: np.ndarray) -> None:
    _detect(ids, vocab, attrs, "eot", _EOT_TEXTS)
    _detect(ids, vocab, attrs, "eom", _EOM_TEXTS)
    for name, texts in _FIM_TEXTS.items():
        _detect(ids, vocab, attrs, name, texts)
    for i in range(len(tokens)):  # control tokens named "unused" are unused
        if attrs[i] & ATTR_CONTROL and "unused" in tokens[i]:
            attrs[i] |= ATTR_UNUSED


def _detect(ids: dict[str, int | None], vocab: dict[str, int], attrs: np.ndarray, name: str,
            texts: Iterable[str]) -> None:
    if ids[name] is not None:
        return
    for t in texts:  # llama.cpp walks a hash map; we take the first listed text that exists
        if t in vocab:
            ids[name] = vocab[t]
            attrs[vocab[t]] |= ATTR_CONTROL
            return


def _end_of_generation(ids: dict[str, int | None], vocab: dict[str, int], tokens: list[str],
                       attrs: np.ndarray) -> set[int]:
    """The end-of-generation ids (llama.cpp's special_eog_ids, with its exceptions)."""
    eog = {i for k in ("fim_pad", "fim_rep", "fim_sep") if (i := ids[k]) is not None}
    for t in _EOG_TEXTS:
        i = vocab.get(t)
        if i is not None:
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always render
        if t in vocab:
            attrs[vocab[t]] = ATTR_USER_DEFINED
    eog |= {i for k in ("eos", "eot", "eom") if (i := ids[k]) is not None}
    eog_texts = {tokens[i] for i in eog}
    if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and "<|call|>" in eog_texts)
                                   or ("<|calls|>" in eog_texts and "<|flush|>" in eog_texts)):
        eog.discard(vocab["<|end|>"])
        attrs[vocab["<|end|>"]] = ATTR_USER_DEFINED
    if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
        eog.discard(vocab["</s>"])
        attrs[vocab["</s>"]] = ATTR_NORMAL
    return eog


# -- pieces (llama.cpp's token_to_piece cache, rendered with special=true) --------------------------------


def _pieces(g: GGUFFile, kind: str, tokens: list[str], attrs: np.ndarray) -> list[bytes]:
    pieces: list[bytes] = []
    for i, t in enumerate(tokens):
        a = int(attrs[i])
        if a & (SPECIAL_ATTRS | ATTR_USER_DEFINED):
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
    return pieces


def _strip_by_model(md: dict, vocab: dict[str, int], attrs: np.ndarray) -> None:
    """Per-token strip attributes by model name (llama.cpp, after the caches)."""
    name = str(md.get("general.name", "")).lower()
    arch = str(md.get("general.architecture", ""))
    pre_s = str(md.get("tokenizer.ggml.pre", ""))
    if any(s in pre_s for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in vocab:
            attrs[vocab["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in range(len(attrs)):
            if attrs[i] & PARTITION_ATTRS:
                attrs[i] |= ATTR_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in vocab:
                attrs[vocab[t]] = (attrs[vocab[t]] | ATTR_RSTRIP) if on else (attrs[vocab[t]] & ~ATTR_RSTRIP)
    elif "modern-bert" in name and "[MASK]" in vocab:
        attrs[vocab["[MASK]"]] |= ATTR_LSTRIP


# -- the HF tokenizer -------------------------------------------------------------------------------------


def _added_tokens(tokens: list[str], attrs: np.ndarray) -> list[dict]:
    added = []
    for i in range(len(tokens)):
        a = int(attrs[i])
        if a & PARTITION_ATTRS:
            added.append({"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": bool(a & SPECIAL_ATTRS)})
    return added


def _hf_spm(tokens: list[str], vocab: dict[str, int], scores: np.ndarray, attrs: np.ndarray, flags: _Flags,
            added: list[dict]) -> dict:
    merges = _spm_merges(tokens, vocab, scores, attrs)
    normalizers: list[dict] = []
    if flags.add_space_prefix:
        normalizers.append({"type": "Prepend", "prepend": _SPACE_ESC})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPACE_ESC})
    unk_id = flags.ids["unk"]
    unk = tokens[unk_id] if unk_id is not None else None
    decoders = [{"type": "Replace", "pattern": {"String": _SPACE_ESC}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if flags.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def _hf_bpe(g: GGUFFile, vocab: dict[str, int], pre: _PreTok, added: list[dict]) -> dict:
    merges = _bpe_merges(g, g.metadata.get("tokenizer.ggml.merges"), vocab)
    pretoks: list[dict] = [{"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
                           for rx in pre.regexes]
    pretoks.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretoks}, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges},
    }


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
