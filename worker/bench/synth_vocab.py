"""The working tokenizers of synthetic models: vocabularies laid out like the real families'
(SentencePiece for Llama 2 and Gemma 3, byte-level BPE for Qwen 2/3, Llama 3 and gpt-oss), with pieces
and merges learned from a fixed text, special tokens and a chat template. Deterministic; no downloads."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from gguf import TokenType

from ember.worker.text.chat_template import builtin_source
from ember.worker.text.vocab_build import bytes_to_unicode

from .synth_shapes import ShapeSpec, SynthError

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
            for a, b in zip(sym, sym[1:], strict=False):
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
_PRETOKENIZE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*"""
                          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


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
# Qwen 3's template in outline (dense and MoE files carry one like it): tools listed in the system
# message, calls as <tool_call>{json}</tool_call> (Hermes), results in <tool_response>, <think> blocks
_QWEN3_TEMPLATE = (  # newlines as '\\n' expressions: the renderer trims the one after a block tag
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function if tc.function else tc %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{ '}\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
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

# gpt-oss's Harmony in outline (the real template also renders tools, reasoning and channels; ember
# renders Harmony prompts with openai_harmony itself, see worker/text/formats/harmony.py)
_HARMONY_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}"
)
# gpt-oss's special tokens from its first special id on (199998 in the real vocabulary), Harmony's
# o200k_harmony layout; the gaps are reserved tokens
_HARMONY_SPECIALS = {0: "<|startoftext|>", 1: "<|endoftext|>", 4: "<|return|>", 5: "<|constrain|>",
                     7: "<|channel|>", 8: "<|start|>", 9: "<|end|>", 10: "<|message|>", 14: "<|call|>"}
_HARMONY_FIRST_SPECIAL = 199998
# DeepSeek V4's: begin and end of sentence, the two turn markers (templates/deepseek.jinja), the think tags
_DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                      "</think>")


def _vocab_spm_llama(n_vocab: int) -> Vocab:
    # Llama 2 layout: <unk> <s> </s>, the 256 byte tokens, then pieces by score
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
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
    types: list[int] = [*[TokenType.CONTROL] * 5, TokenType.USER_DEFINED]
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
    elif kind == "bpe-gpt-oss":
        # the real layout when the vocabulary is full size, else the 16 specials at the end
        n_special = n_vocab - _HARMONY_FIRST_SPECIAL if n_vocab > _HARMONY_FIRST_SPECIAL else 16
        first = n_vocab - n_special
        specials = [_HARMONY_SPECIALS.get(k, f"<|reserved_{first + k}|>") for k in range(n_special)]
        special_types = [TokenType.CONTROL] * n_special
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        special_types = [TokenType.CONTROL] * 3
        if kind == "bpe-qwen3":
            specials += ["<tool_call>", "</tool_call>", "<think>", "</think>"]
            special_types += [TokenType.USER_DEFINED] * 4
    if kind == "bpe-deepseek4":  # DeepSeek V4's turn tokens and think tags (the DSML markup is text here)
        specials = list(_DEEPSEEK_SPECIALS)
        special_types = [TokenType.CONTROL] * 4 + [TokenType.USER_DEFINED] * 2
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
    if kind == "bpe-gpt-oss":  # bos <|startoftext|>, eos <|return|>, pad <|endoftext|> as in the real file
        return Vocab("gpt2", "gpt-4o", tokens, types, None, merge_strs,
                     {"bos": first_special, "eos": first_special + 4, "pad": first_special + 1}, add_bos=False,
                     chat_template=_HARMONY_TEMPLATE)
    if kind == "bpe-deepseek4":  # bos and eos as DeepSeek's; its template prints the bos itself
        return Vocab("gpt2", "qwen2", tokens, types, None, merge_strs, {"bos": first_special, "eos": first_special + 1},
                     add_bos=True, chat_template=builtin_source("deepseek"))
    return Vocab("gpt2", "qwen2", tokens, types, None, merge_strs,
                 {"bos": first_special, "eos": first_special + 2, "pad": first_special}, add_bos=False,
                 chat_template=_QWEN3_TEMPLATE if kind == "bpe-qwen3" else _CHATML)


def build_vocab(spec: ShapeSpec) -> Vocab:
    if spec.tokenizer == "spm-llama":
        v = _vocab_spm_llama(spec.n_vocab)
    elif spec.tokenizer == "spm-gemma":
        v = _vocab_spm_gemma(spec.n_vocab)
    elif spec.tokenizer in ("bpe-qwen2", "bpe-qwen3", "bpe-llama3", "bpe-gpt-oss", "bpe-deepseek4"):
        v = _vocab_bpe(spec.n_vocab, spec.tokenizer)
    else:
        raise SynthError(f"unknown tokenizer kind {spec.tokenizer!r}")
    assert len(v.tokens) == spec.n_vocab == len(set(v.tokens)) == len(v.types), spec.name
    return v
