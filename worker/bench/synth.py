"""Shape-faithful synthetic GGUF models for benchmarks and tests.

`make_model(arch, shape, out)` writes a GGUF file that llama.cpp (and ember) load like the real
thing: the architecture's metadata keys, tensor names, shapes and quantization types, and a working
tokenizer, with random (but valid and sanely scaled) weights. Nothing is downloaded; the same seed
gives a byte-identical file.

Shapes (`SHAPES`, what users type after --shape):
  tiny             a small test model of the chosen arch (tiny-llama, tiny-qwen2, tiny-qwen3,
                   tiny-gemma3); a few layers, hidden 128, GQA, vocab 512-1000
  gemma3-270m      Gemma 3 270M, tensor for tensor the embedded Q4_K_M file
  gemma3-4b        Gemma 3 4B (text), Q4_K_M mix
  llama-8b         Llama 3 8B, Q4_K_M mix, Llama 3 BPE vocabulary

Weights use llama.cpp's Q4_K_M type choice (llama-quant.cpp): Q4_K everywhere, Q6_K for the output
(or the tied embedding) and for attn_v / ffn_down on the "use_more_bits" layers, with llama.cpp's
fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0) for rows that are not a multiple of 256; norms and biases F32.

Tensor data is generated and written a chunk of rows at a time straight into the file, so a
multi-GB model needs only a few MB of memory. `plan(arch, shape)` returns the tensor table without
writing anything.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from gguf import GGUFWriter, RopeScalingType, TokenType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ember.kernels.quants import BLOCK_DTYPES, pack_k_scales
from ember.worker.text.tokenizer import bytes_to_unicode

T = GGMLQuantizationType

__all__ = [
    "ARCHS",
    "SHAPES",
    "PlannedTensor",
    "ShapeSpec",
    "SynthError",
    "add_make_model_parser",
    "make_model",
    "plan",
    "q4_k_m_type",
    "resolve_shape",
    "run_make_model",
]

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

WEIGHT_STD = 0.02  # target standard deviation of the dequantized random weights


class SynthError(ValueError):
    """A bad request (unknown arch or shape, unusable output path); str() is one line."""


@dataclass(frozen=True)
class ShapeSpec:
    name: str
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rope_base: float
    rms_eps: float
    tokenizer: str  # "spm-llama" | "spm-gemma" | "bpe-qwen2" | "bpe-qwen3" | "bpe-llama3"
    tied: bool  # no output.weight: logits through token_embd
    sliding_window: int = 0  # gemma3: local attention window (5 local : 1 global layers)
    rope_base_swa: float | None = None  # gemma3: rope base of the local layers, written when set
    rope_scaling_linear: float | None = None  # linear rope scaling factor (gemma3 4B+)
    mix: str = "q4_k_m"
    size_label: str = ""
    description: str = ""
    real: bool = False  # the shape of a released model (multi-GB file)
    # fixed per-tensor types (name -> type per layer) instead of the mix rule; see _GEMMA3_270M_TYPES
    type_table: dict[str, tuple[str, ...]] | None = field(default=None, repr=False, compare=False, hash=False)


# The tensor types of /work/models/gemma-3-270m-q4_k_m.gguf (read once from the file; the test
# checks that this table, the Q4_K_M rule and the file agree). Per-layer entries list layers 0..17.
_M, _L = "Q8_0", "Q5_0"  # attn_v: more bits (Q6_K -> Q8_0 fallback) / plain (Q4_K -> Q5_0 fallback)
_GEMMA3_270M_TYPES: dict[str, tuple[str, ...]] = {
    "output_norm.weight": ("F32",),
    "token_embd.weight": ("Q8_0",),
    "attn_k.weight": ("Q5_0",) * 18,
    "attn_k_norm.weight": ("F32",) * 18,
    "attn_norm.weight": ("F32",) * 18,
    "attn_output.weight": ("Q4_K",) * 18,
    "attn_q.weight": ("Q5_0",) * 18,
    "attn_q_norm.weight": ("F32",) * 18,
    "attn_v.weight": (_M, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _M, _M, _M),
    "ffn_down.weight": tuple("Q6_K" if t == _M else "Q4_K" for t in
                             (_M, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _L, _M, _L, _M, _M, _M)),
    "ffn_gate.weight": ("Q5_0",) * 18,
    "ffn_norm.weight": ("F32",) * 18,
    "ffn_up.weight": ("Q5_0",) * 18,
    "post_attention_norm.weight": ("F32",) * 18,
    "post_ffw_norm.weight": ("F32",) * 18,
}
del _M, _L

SHAPES: dict[str, ShapeSpec] = {
    s.name: s
    for s in [
        ShapeSpec("tiny-llama", "llama", n_vocab=512, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff=256, n_ctx=2048, rope_base=10000.0, rms_eps=1e-5, tokenizer="spm-llama", tied=False,
                  description="tiny llama test model, SentencePiece vocab, untied output"),
        ShapeSpec("tiny-qwen2", "qwen2", n_vocab=768, n_embd=128, n_layer=3, n_head=4, n_head_kv=2, head_dim=32,
                  n_ff=512, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen2", tied=False,
                  description="tiny qwen2 test model, byte-level BPE vocab, qkv biases"),
        ShapeSpec("tiny-qwen3", "qwen3", n_vocab=1000, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, head_dim=64,
                  n_ff=384, n_ctx=4096, rope_base=1000000.0, rms_eps=1e-6, tokenizer="bpe-qwen3", tied=True,
                  description="tiny qwen3 test model, q/k norms, head_dim*heads != hidden, tied embeddings"),
        ShapeSpec("tiny-gemma3", "gemma3", n_vocab=640, n_embd=128, n_layer=6, n_head=4, n_head_kv=1, head_dim=64,
                  n_ff=512, n_ctx=2048, rope_base=1000000.0, rms_eps=1e-6, tokenizer="spm-gemma", tied=True,
                  sliding_window=8, rope_base_swa=10000.0,
                  description="tiny gemma3 test model, 5 local (window 8) : 1 global layers"),
        ShapeSpec("gemma3-270m", "gemma3", n_vocab=262144, n_embd=640, n_layer=18, n_head=4, n_head_kv=1,
                  head_dim=256, n_ff=2048, n_ctx=32768, rope_base=1000000.0, rms_eps=1e-6, tokenizer="spm-gemma",
                  tied=True, sliding_window=512, size_label="270M", real=True, type_table=_GEMMA3_270M_TYPES,
                  description="Gemma 3 270M, the embedded Q4_K_M file's tensor table"),
        ShapeSpec("gemma3-4b", "gemma3", n_vocab=262208, n_embd=2560, n_layer=34, n_head=8, n_head_kv=4,
                  head_dim=256, n_ff=10240, n_ctx=131072, rope_base=1000000.0, rms_eps=1e-6,
                  tokenizer="spm-gemma", tied=True, sliding_window=1024, rope_base_swa=10000.0,
                  rope_scaling_linear=8.0, size_label="4B", real=True,
                  description="Gemma 3 4B (text part), Q4_K_M"),
        ShapeSpec("llama-8b", "llama", n_vocab=128256, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8,
                  head_dim=128, n_ff=14336, n_ctx=8192, rope_base=500000.0, rms_eps=1e-5, tokenizer="bpe-llama3",
                  tied=False, size_label="8B", real=True, description="Llama 3 8B, Q4_K_M, Llama 3 BPE vocab"),
    ]
}


def resolve_shape(arch: str, shape: str) -> ShapeSpec:
    """The ShapeSpec for `--arch arch --shape shape`; `tiny` means `tiny-<arch>`."""
    if arch not in ARCHS:
        raise SynthError(f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
    spec = SHAPES.get(shape) or SHAPES.get(f"{shape}-{arch}")
    if spec is None:
        known = sorted({"tiny"} | {n for n in SHAPES if not n.startswith("tiny-")})
        raise SynthError(f"unknown shape {shape!r} (known: {', '.join(known)})")
    if spec.arch != arch:
        raise SynthError(f"shape {spec.name} is a {spec.arch} shape, not {arch}")
    return spec


# -- the tensor plan ------------------------------------------------------------------------------


class PlannedTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml order (shape[0] is the row length), as GGUFFile's TensorInfo
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    # llama-quant.cpp
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def q4_k_m_type(kind: str, i_layer: int, n_layer: int, row_len: int, tied: bool) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M choice for a 2-D weight (kind: token_embd, output, attn_v, ffn_down, ...)."""
    if kind == "output" or (kind == "token_embd" and tied):
        t = T.Q6_K
    elif kind in ("attn_v", "ffn_down") and _use_more_bits(i_layer, n_layer):
        t = T.Q6_K
    else:
        t = T.Q4_K
    if row_len % GGML_QUANT_SIZES[t][0]:
        t = _FALLBACK[t]
        if row_len % GGML_QUANT_SIZES[t][0]:
            t = T.F16
    return t


def _tensor_shapes(s: ShapeSpec) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """(global tensors, per-layer tensors) as (name, ggml shape); layer names without 'blk.N.'."""
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    glob = [("token_embd.weight", (s.n_embd, s.n_vocab)), ("output_norm.weight", (s.n_embd,))]
    if not s.tied:
        glob.append(("output.weight", (s.n_embd, s.n_vocab)))
    layer = [
        ("attn_norm.weight", (s.n_embd,)),
        ("attn_q.weight", (s.n_embd, q_dim)),
        ("attn_k.weight", (s.n_embd, kv_dim)),
        ("attn_v.weight", (s.n_embd, kv_dim)),
        ("attn_output.weight", (q_dim, s.n_embd)),
        ("ffn_norm.weight", (s.n_embd,)),
        ("ffn_gate.weight", (s.n_embd, s.n_ff)),
        ("ffn_up.weight", (s.n_embd, s.n_ff)),
        ("ffn_down.weight", (s.n_ff, s.n_embd)),
    ]
    if s.arch == "qwen2":
        layer += [("attn_q.bias", (q_dim,)), ("attn_k.bias", (kv_dim,)), ("attn_v.bias", (kv_dim,))]
    if s.arch in ("qwen3", "gemma3"):
        layer += [("attn_q_norm.weight", (s.head_dim,)), ("attn_k_norm.weight", (s.head_dim,))]
    if s.arch == "gemma3":
        layer += [("post_attention_norm.weight", (s.n_embd,)), ("post_ffw_norm.weight", (s.n_embd,))]
    return glob, layer


def _plan_spec(s: ShapeSpec) -> list[PlannedTensor]:
    glob, layer = _tensor_shapes(s)
    if s.mix != "q4_k_m":
        raise SynthError(f"unknown quantization mix {s.mix!r}")

    def type_of(name: str, shape: tuple[int, ...], il: int) -> GGMLQuantizationType:
        if s.type_table is not None:
            types = s.type_table[name]
            return T[types[il] if il >= 0 else types[0]]
        if len(shape) == 1:
            return T.F32
        return q4_k_m_type(name.split(".")[0], il, s.n_layer, shape[0], s.tied)

    # order: global tensors, then layer by layer, names sorted (as in the embedded Gemma file)
    out = [PlannedTensor(n, sh, type_of(n, sh, -1)) for n, sh in sorted(glob)]
    for il in range(s.n_layer):
        out += [PlannedTensor(f"blk.{il}.{n}", sh, type_of(n, sh, il)) for n, sh in sorted(layer)]
    return out


def plan(arch: str, shape: str) -> list[PlannedTensor]:
    """The tensor table (name, ggml-order shape, type) that make_model writes, in file order."""
    return _plan_spec(resolve_shape(arch, shape))


# -- tokenizers -----------------------------------------------------------------------------------

# Training text for the learned vocab pieces (original text, ASCII; prose, chat and code).
_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model runs on one machine all day and answers
questions from coding agents. It reads the prompt, looks up the cached prefix, and generates new
tokens one at a time. When the process dies, the daemon restarts it and the cache comes back warm.
The weights are stored in a file with many tensors; each tensor has a name, a shape and a type.
Some tensors are quantized to four or six bits in blocks of thirty two or two hundred fifty six
values, with a scale for every block. The kernels read the blocks and multiply them with the input.
Hello, how are you today? I am fine, thank you. What would you like to do next? Let us write a test
for the new function, then run the tests again and check that everything still passes.
The user asked the assistant to explain the error message and to suggest a fix for the problem.
Please summarize the following text in three sentences. The answer should be short and clear.
In the beginning there was the command line, and the command line was good enough for most people.
She said that the results of the experiment were better than they had expected at the start.
We will meet at the station at nine o'clock and take the train to the city before it rains.
There are 24 hours in a day, 7 days in a week and 365 days in a year; 1024 bytes make a kilobyte.

def generate(model, prompt, max_tokens=16):
    tokens = model.tokenize(prompt)
    for _ in range(max_tokens):
        logits = model.forward(tokens)
        next_token = int(logits[-1].argmax())
        if next_token == model.eos_token:
            break
        tokens.append(next_token)
    return model.detokenize(tokens)


class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.blocks = {}

    def get(self, key, default=None):
        return self.blocks.get(key, default)

    def put(self, key, value):
        if len(self.blocks) >= self.capacity:
            self.blocks.pop(next(iter(self.blocks)))
        self.blocks[key] = value


for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.3f}")

if __name__ == "__main__":
    result = generate(load_model("model.gguf"), "Once upon a time")
    print(result)
"""


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special: dict[str, int]  # bos/eos/unk/pad/eot -> id
    add_bos: bool
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None


def _learn_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on a word histogram; ties broken by the pair itself, so the result is fixed."""
    segs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, n in words.items():
            sym = segs[w]
            for a, b in zip(sym, sym[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        a, b = best
        for w, sym in segs.items():
            i, out = 0, []
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            segs[w] = out
    return merges


# GPT-2 style pre-tokenizer for ASCII text (the real ones use \p{L} / \p{N}; same split here)
_PRETOKENIZE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=8)
def _bpe_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode()) for w in _PRETOKENIZE.findall(_TEXT))
    return tuple(_learn_merges(words, n_merges))


@lru_cache(maxsize=8)
def _spm_pieces(n_pieces: int) -> tuple[str, ...]:
    """SentencePiece-style pieces ('▁' marks a space): learned merges by rank, then single characters."""
    words = Counter("▁" + w for w in _TEXT.split())
    chars = sorted({c for w in words for c in w})
    n_merged = max(0, n_pieces - len(chars))
    merged: dict[str, None] = {}  # insertion-ordered set
    for a, b in _learn_merges(words, n_merged):
        if a + b not in chars:
            merged.setdefault(a + b)
    return (tuple(merged)[:n_merged] + tuple(chars))[:n_pieces]


# Filler tokens pad a vocabulary to the shape's size: ordinary, unique words (" tok123") that decode
# to visible text, so random generation from a large synthetic vocab still prints something.
_FILLER_SPM = "\u2581tok{}".format
_FILLER_BPE = "\u0120tok{}".format  # 'Ġ' is the byte-level form of a space
_FILLER_SCORE = -1e4


def _fill(tokens: list[str], types: list[int], n: int, name: Callable[[int], str], ttype: int) -> None:
    seen = set(tokens)
    i = 0
    while len(tokens) < n:
        t = name(i)
        i += 1
        if t not in seen:
            tokens.append(t)
            types.append(int(ttype))
            seen.add(t)


_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n'"
    " + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def _vocab_spm_llama(n_vocab: int) -> Vocab:
    # Llama 2 layout: <unk> <s> </s>, the 256 byte tokens, then pieces by score
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(_spm_pieces(n_vocab - len(tokens))):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))
    n_real = len(tokens)
    _fill(tokens, types, n_vocab, _FILLER_SPM, TokenType.NORMAL)
    scores += [_FILLER_SCORE] * (len(tokens) - n_real)
    return Vocab("llama", None, tokens, [int(t) for t in types], scores, None,
                 {"bos": 1, "eos": 2, "unk": 0}, add_bos=True, add_space_prefix=True,
                 chat_template=_LLAMA2_TEMPLATE)


def _vocab_spm_gemma(n_vocab: int) -> Vocab:
    # Gemma 3 layout: <pad> <eos> <bos> <unk> <mask> [multimodal], (<unused0..98> in the real-size
    # vocab), <start_of_turn> <end_of_turn>, the 256 byte tokens, pieces by score, <unusedN> filler
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]"]
    types = [TokenType.CONTROL] * 5 + [TokenType.USER_DEFINED]
    n_unused = 99 if n_vocab >= 100_000 else 0
    tokens += [f"<unused{i}>" for i in range(n_unused)]
    types += [TokenType.CONTROL] * n_unused
    tokens += ["<start_of_turn>", "<end_of_turn>"]
    types += [TokenType.CONTROL] * 2
    scores = [-1000.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    scores += [0.0] * 256
    for rank, piece in enumerate(_spm_pieces(min(n_vocab - len(tokens), 4096))):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))
    n_real = len(tokens)
    _fill(tokens, types, n_vocab, _FILLER_SPM, TokenType.NORMAL)
    scores += [_FILLER_SCORE] * (len(tokens) - n_real)
    return Vocab("llama", "default", tokens, [int(t) for t in types], scores, None,
                 {"bos": 2, "eos": 1, "unk": 3, "pad": 0}, add_bos=True, add_space_prefix=False,
                 chat_template=_GEMMA_TEMPLATE)


def _vocab_bpe(n_vocab: int, kind: str) -> Vocab:
    b2u = bytes_to_unicode()
    tokens = list(b2u.values())  # the 256 byte characters, in GPT-2's order
    if kind == "bpe-llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
        specials += [f"<|reserved_special_token_{i}|>" for i in range(5, 5 + 256 - len(specials))]
        special_types = [TokenType.CONTROL] * len(specials)
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        special_types = [TokenType.CONTROL] * 3
        if kind == "bpe-qwen3":
            specials += ["<tool_call>", "</tool_call>", "<think>", "</think>"]
            special_types += [TokenType.USER_DEFINED] * 4
    n_regular = n_vocab - len(specials)
    merges = _bpe_merges(min(max(0, n_regular - 256), 4096))
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen and len(tokens) < n_regular:
            tokens.append(a + b)
            seen.add(a + b)
    merges = tuple(m for m in merges if m[0] + m[1] in seen)  # every merge yields a token
    types = [int(TokenType.NORMAL)] * len(tokens)
    _fill(tokens, types, n_regular, _FILLER_BPE, TokenType.NORMAL)
    first_special = len(tokens)
    tokens += specials
    types += [int(t) for t in special_types]
    merge_strs = [f"{a} {b}" for a, b in merges]
    if kind == "bpe-llama3":
        return Vocab("gpt2", "llama-bpe", tokens, types, None, merge_strs,
                     {"bos": first_special, "eos": first_special + 9}, add_bos=True,
                     chat_template=_LLAMA3_TEMPLATE)
    return Vocab("gpt2", "qwen2", tokens, types, None, merge_strs,
                 {"bos": first_special, "eos": first_special + 2, "pad": first_special}, add_bos=False,
                 chat_template=_CHATML)


def build_vocab(spec: ShapeSpec) -> Vocab:
    if spec.tokenizer == "spm-llama":
        v = _vocab_spm_llama(spec.n_vocab)
    elif spec.tokenizer == "spm-gemma":
        v = _vocab_spm_gemma(spec.n_vocab)
    elif spec.tokenizer in ("bpe-qwen2", "bpe-qwen3", "bpe-llama3"):
        v = _vocab_bpe(spec.n_vocab, spec.tokenizer)
    else:
        raise SynthError(f"unknown tokenizer kind {spec.tokenizer!r}")
    assert len(v.tokens) == spec.n_vocab == len(set(v.tokens)) == len(v.types), spec.name
    return v


# -- random tensor data ---------------------------------------------------------------------------

_U = (0.5, 1.5)  # per-block spread of the scales around their target


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _signs(rng: np.random.Generator, shape) -> np.ndarray:
    return np.where(rng.random(shape) < 0.5, -1.0, 1.0)


def _uniform_std(levels: int) -> float:
    """Standard deviation of an integer uniform over `levels` consecutive values."""
    return float(np.sqrt((levels * levels - 1) / 12.0))


def _random_blocks(t: GGMLQuantizationType, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random blocks of type t as bytes: random codes, scales chosen for a ~WEIGHT_STD spread.

    Scale conventions follow what llama.cpp's quantizers emit: Q4_0/Q5_0/Q6_K scales of either sign
    (d = max / -8 etc.), Q8_0 codes in -127..127, K-quant 6-bit sub-block scales with mins that
    centre the 4/5-bit codes.
    """
    dt = BLOCK_DTYPES[t]
    raw = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=np.uint8).copy()
    b = raw.view(dt)
    spread = rng.uniform(*_U, size=n)
    if t == T.Q8_0:
        qs = b["qs"]
        qs[qs == -128] = -127
        b["d"] = _f16(WEIGHT_STD / _uniform_std(255) * spread)
    elif t in (T.Q4_0, T.Q5_0):
        levels = 16 if t == T.Q4_0 else 32
        b["d"] = _f16(WEIGHT_STD / _uniform_std(levels) * spread * _signs(rng, n))
    elif t in (T.Q4_1, T.Q5_1):
        levels = 16 if t == T.Q4_1 else 32
        d = _f16(WEIGHT_STD / _uniform_std(levels) * spread)
        b["d"] = d
        b["m"] = _f16(-d.astype(np.float64) * (levels - 1) / 2 * rng.uniform(0.9, 1.1, size=n))
    elif t in (T.Q4_K, T.Q5_K):
        levels = 16 if t == T.Q4_K else 32
        sc = rng.integers(24, 64, size=(n, 8))
        rms_sc = float(np.sqrt(np.mean(np.arange(24, 64) ** 2)))
        d = _f16(WEIGHT_STD / (rms_sc * _uniform_std(levels)) * spread)
        # dmin/d so that the largest min (63 * (levels-1)/2 / ratio) still fits in 6 bits
        ratio = rng.uniform((levels - 1) / 2, (levels - 1) / 2 * 1.2, size=n)
        dmin = _f16(d.astype(np.float64) * ratio)
        centre = sc * ((levels - 1) / 2) * (d.astype(np.float64) / dmin.astype(np.float64))[:, None]
        m = np.clip(np.rint(centre) + rng.integers(-1, 2, size=(n, 8)), 0, 63)
        b["d"], b["dmin"] = d, dmin
        b["scales"] = pack_k_scales(sc.astype(np.uint8), m.astype(np.uint8))
    elif t == T.Q6_K:
        mag = rng.integers(32, 128, size=(n, 16))
        b["scales"] = (mag * _signs(rng, (n, 16))).astype(np.int8)
        rms_sc = float(np.sqrt(np.mean(np.arange(32, 128) ** 2)))
        b["d"] = _f16(WEIGHT_STD / (rms_sc * _uniform_std(64)) * spread * _signs(rng, n))
    else:
        raise SynthError(f"no random block generator for {t.name}")
    return raw


def _random_rows(name: str, t: GGMLQuantizationType, n_rows: int, row_len: int,
                 rng: np.random.Generator) -> np.ndarray:
    """n_rows rows of tensor `name` as bytes."""
    if t in (T.F32, T.F16, T.BF16):
        if name.endswith("norm.weight"):  # norms near 1 (gemma's stored 1 + w included)
            x = 1.0 + 0.05 * rng.standard_normal(n_rows * row_len, dtype=np.float32)
        else:  # biases and float weights
            x = WEIGHT_STD * rng.standard_normal(n_rows * row_len, dtype=np.float32)
        if t == T.F32:
            return x.view(np.uint8)
        if t == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, _ = GGML_QUANT_SIZES[t]
    return _random_blocks(t, n_rows * row_len // block, rng)


_CHUNK_BYTES = 8 << 20  # tensor data generated and written per step


def _tensor_chunks(pt: PlannedTensor, seed: int):
    """The tensor's bytes in chunks of whole rows; chunk k is a pure function of (seed, name, k)."""
    row_len = pt.shape[0]
    n_rows = int(np.prod(pt.shape[1:], dtype=np.int64)) if len(pt.shape) > 1 else 1
    block, size = GGML_QUANT_SIZES[pt.ggml_type]
    row_bytes = row_len // block * size
    step = max(1, _CHUNK_BYTES // row_bytes)
    name_key = zlib.crc32(pt.name.encode())
    for k, start in enumerate(range(0, n_rows, step)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, name_key, k]))
        yield _random_rows(pt.name, pt.ggml_type, min(step, n_rows - start), row_len, rng)


# -- writing --------------------------------------------------------------------------------------


def _add_metadata(w: GGUFWriter, s: ShapeSpec, v: Vocab, seed: int) -> None:
    a = s.arch
    w.add_type("model")
    w.add_name(f"ember synthetic {s.name}")
    w.add_description(f"random weights in the shape of {s.description or s.name}; "
                      f"generated by ember bench make-model (seed {seed}); not a trained model")
    if s.size_label:
        w.add_size_label(s.size_label)
    w.add_string("ember.synthetic.shape", s.name)
    w.add_uint32("ember.synthetic.seed", seed)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_base)
    if a in ("qwen3", "gemma3") or s.head_dim * s.n_head != s.n_embd:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if a == "llama":
        w.add_vocab_size(s.n_vocab)
        w.add_rope_dimension_count(s.head_dim)
    if s.rope_scaling_linear:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.rope_scaling_linear)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.rope_base_swa is not None:
        w.add_rope_freq_base_swa(s.rope_base_swa)
    # tokenizer
    w.add_tokenizer_model(v.model)
    if v.pre:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    ids = v.special
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    if "unk" in ids:
        w.add_unk_token_id(ids["unk"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(v.add_eos)
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        w.add_chat_template(v.chat_template)
    w.add_quantization_version(2)
    w.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))


def make_model(
    arch: str,
    shape: str,
    out: Path | str,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a synthetic GGUF model of `arch`/`shape` to `out`; returns the path.

    The file appears atomically (written to `out`.part, then renamed). `progress(done, total)` is
    called with bytes of tensor data written so far. Raises SynthError for an unknown arch or shape
    or an unusable output path, OSError for failures while writing.
    """
    spec = resolve_shape(arch, shape)
    if not 0 <= seed < 2**32:
        raise SynthError(f"seed must be in 0..{2**32 - 1}, got {seed}")
    tensors = _plan_spec(spec)
    out = Path(out)
    if out.is_dir():
        raise SynthError(f"{out} is a directory; give a file name such as {out / (spec.name + '.gguf')}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise SynthError(f"cannot write {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SynthError(f"cannot write {out}: directory {parent} is not writable")
    total = sum(t.nbytes for t in tensors)
    free = shutil.disk_usage(parent).free
    if free < total + (64 << 20):
        raise SynthError(f"cannot write {out}: needs about {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")

    vocab = build_vocab(spec)
    tmp = out.with_name(out.name + ".part")
    writer = GGUFWriter(tmp, spec.arch)
    try:
        _add_metadata(writer, spec, vocab, seed)
        for t in tensors:
            writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes,
                                   raw_dtype=t.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())  # data section starts aligned
        done = 0
        if progress:
            progress(0, total)
        for t in tensors:
            written = 0
            for chunk in _tensor_chunks(t, seed):
                fout.write(memoryview(chunk))
                written += chunk.nbytes
                done += chunk.nbytes
                if progress:
                    progress(done, total)
            assert written == t.nbytes, (t.name, written, t.nbytes)
            writer.write_padding(fout, written)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


# -- CLI ------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, out: Path, stream=None):
        self.out, self.stream = out, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_t, self.last_pct = 0.0, -10

    def __call__(self, done: int, total: int) -> None:
        pct = 100 if total == 0 else int(done * 100 // total)
        now = time.monotonic()
        if self.tty:
            if done < total and now - self.last_t < 0.2:
                return
            end = "\n" if done >= total else ""
            self.stream.write(f"\rwriting {self.out}: {_size(done)} / {_size(total)} ({pct}%)" + end)
        else:
            if pct < self.last_pct + 10 and done < total:
                return
            self.last_pct = pct
            self.stream.write(f"writing {self.out}: {_size(done)} / {_size(total)} ({pct}%)\n")
        self.last_t = now
        self.stream.flush()


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def run_make_model(args: argparse.Namespace) -> int:
    """Handler of `make-model`: returns the exit code (0 done, 2 bad request or write failure)."""
    out = Path(args.out)
    try:
        path = make_model(args.arch, args.shape, out, seed=args.seed, progress=_Progress(out))
    except SynthError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"make-model: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make-model: interrupted", file=sys.stderr)
        return 130
    print(f"{path}  sha256 {_sha256(path)}")
    return 0


def add_make_model_parser(subparsers) -> argparse.ArgumentParser:
    """Register `make-model` on an argparse subparsers object; the handler is `args.func(args)`."""
    shapes = ", ".join(["tiny"] + [n for n in SHAPES if not n.startswith("tiny-")])
    p = subparsers.add_parser(
        "make-model",
        help="write a synthetic GGUF model of a given architecture and shape",
        description="Write a GGUF model with random weights in the exact layout of a real model "
        "(metadata, tensor names, shapes, Q4_K_M types, tokenizer), for benchmarks and tests.",
    )
    p.add_argument("--arch", required=True, help=f"architecture: {', '.join(ARCHS)}")
    p.add_argument("--shape", required=True, help=f"shape: {shapes}")
    p.add_argument("--out", required=True, help="output .gguf file (replaced if it exists)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same file (default 0)")
    p.set_defaults(func=run_make_model)
    return p
