#!/usr/bin/env python3
"""Regenerate the llama.cpp logit fixtures that tests/test_forward_oracle.py checks our engine against.

llama-cpp-python is the oracle. This script runs in a virtual environment that has
llama-cpp-python, numpy and gguf, and it does NOT import ember (the oracle must not share code with
what it checks). CI never runs it: CI uses the committed fixtures and does not build llama.cpp.

    /work/oracle-venv/bin/python tests/oracle/gen_logit_fixtures.py            # everything
    /work/oracle-venv/bin/python tests/oracle/gen_logit_fixtures.py --only gemma
    /work/oracle-venv/bin/python tests/oracle/gen_logit_fixtures.py --only llama,qwen2,qwen3

What is recorded, per model (see tests/fixtures/logits/manifest.json for the figures):

* The prompts are tokenized by llama.cpp (BOS added; special tokens parsed for chat-formatted
  prompts), then llama.cpp generates GEN_TOKENS tokens greedily (stopping early at an
  end-of-generation token). prompt + generation is "llama.cpp's greedy path".
* The whole path is then evaluated by llama.cpp in ONE batched eval (n_batch = n_ubatch = n_ctx,
  logits for every position). Per position the fixture keeps the token ids, llama.cpp's top-8 ids
  and logits, the top-2 gap, and the logits on an evaluation subset of the vocabulary: that
  position's top-64 ids followed by a fixed seeded random sample of N_RANDOM ids (float16). Models
  with a small vocabulary keep full logits instead (float16; the subset is then the whole vocabulary).
* llama.cpp's own self-consistency: the same path evaluated token by token (one eval per token),
  and the Pearson correlation of batched vs token-by-token logits at each position, on the same
  subset (`self_corr`) and on the full vocabulary (`self_corr_full`). On a quantized model
  llama.cpp quantizes activations inside its matmuls (q8_0 / q8_K) with batch-size-dependent
  kernels, so this is its own noise floor; the test uses it (see test_forward_oracle.py).
* For every quantized file also llama.cpp's agreement with its own run of an F32 copy of it along
  the same path (`xf32_corr` on the subset, `xf32_top8_ids`): how far llama.cpp's quantized
  activations take it from the exact math on the very same weights.

Variants for Gemma 3 270M (the embedded model):
  gemma3-q4_k_m : the quantized embedded file (the issue's criterion).
  gemma3-f32    : the same weights dequantized to F32 (gguf.quants.dequantize, written with
                  gguf.GGUFWriter into a temporary folder, never into the repo), evaluated along the
                  SAME token paths as gemma3-q4_k_m. llama.cpp does no activation quantization on
                  F32 weights, so this is the strict check of our math.
Tiny synthetic llama / qwen2 / qwen3 / qwen3moe / gpt-oss / deepseek4 models, and qwen3moe in every
low-bit type: written
by ember's deterministic generator (`ember bench make-model --arch A --shape tiny|tiny-lowbit --seed 0`,
run through EMBER_PYTHON in a subprocess; SYNTH_MODELS);
the fixture stores the model's sha256 so the test notices when the generator changes. Their
prompts are seeded random token ids (the synthetic vocabularies are not natural language).
deepseek4 has its own prompt lengths (past its window, its CSA indexer's top k and its HCA blocks;
SYNTH_PROMPT_LENGTHS_BY_KEY) and, as gpt-oss and qwen3moe-lowbit do, keeps a top-32 + 96 random ids
subset, not full logits, so their fixtures stay small (SYNTH_SUBSET_BY_KEY); its F32 copy runs with a
float32 KV cache (SYNTH_KV_F32: the indexer's top-k choice is otherwise at the mercy of float16 keys).
Integer tensors (its hash-routing table) stay as they are in the F32 copy.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

FIXTURE_VERSION = 1
GEN_TOKENS = 32
TOP_K = 64  # per-position top ids kept in the evaluation subset
N_RANDOM = 768  # fixed random vocabulary sample in the evaluation subset
SUBSET_SEED = 20261202
FULL_LOGITS_MAX_VOCAB = 4096  # vocabularies up to this size keep full logits (float16)
N_THREADS = 2
# fixture key -> (arch, shape) of `ember bench make-model`
SYNTH_MODELS = {"llama": ("llama", "tiny"), "qwen2": ("qwen2", "tiny"), "qwen3": ("qwen3", "tiny"),
                "qwen3moe": ("qwen3moe", "tiny"), "qwen3moe-lowbit": ("qwen3moe", "tiny-lowbit"),
                "gpt-oss": ("gpt-oss", "tiny"), "deepseek4": ("deepseek4", "tiny")}
SYNTH_SEED = 0
SYNTH_PROMPT_SEED = 1234
SYNTH_PROMPT_LENGTHS = (1, 3, 7, 12, 20, 31, 45, 64, 100, 1010)  # + BOS; the last one is over 1,000
# deepseek4 (window 16, CSA blocks of 4 with an indexer's top 8, HCA blocks of 128): prompts inside the
# window, past it, past the indexer's top k of CSA rows, and past one, three and seven HCA blocks
SYNTH_PROMPT_LENGTHS_BY_KEY = {"deepseek4": (1, 3, 7, 12, 20, 45, 64, 150, 400, 1010)}
# fixtures kept small (well under 1 MB): a top-32 and 96 random ids subset of the vocabulary, not full logits
SYNTH_SUBSET_BY_KEY = {"deepseek4": (32, 96), "gpt-oss": (32, 96), "qwen3moe-lowbit": (32, 96)}
# the F32 copy's run keeps its KV cache in float32 too: deepseek4's lightning indexer picks the top k of
# its compressed rows, and float16 keys move near-ties (a few in a hundred positions) to the other side,
# which later positions inherit through the compressed rows built from them
SYNTH_KV_F32 = ("deepseek4",)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "fixtures" / "logits"


def chat(*turns: str) -> str:
    """Gemma 3 chat format for alternating user/model turns, ending with the model's turn open."""
    out = []
    for i, text in enumerate(turns):
        role = "user" if i % 2 == 0 else "model"
        out.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
    return "".join(out) + "<start_of_turn>model\n"


# ---------------------------------------------------------------------------------------------
# Prompts for Gemma: varied, deterministic, plain strings.

LONG_NOTES = """\
Field notes from the lighthouse at Kestrel Point, collected over one winter.

The keeper's name was Ilse Marrow, and the first thing she wrote in the log was that the bread
would not rise. The bakery in the village had closed in October, so she baked her own loaves in the
iron stove, and the secret ingredient, she noted with some pride, was a spoonful of dark buckwheat
honey from her sister's farm in the valley. She kept the jar on the windowsill beside the barometer.

On the second day a storm came in from the south-west. The barometer fell from 1012 to 987
hectopascals in nine hours, and the wind backed from south to east before it veered hard to the
north-west. She wrote that the lamp had to be wound every two hours instead of every four, because
the vibration of the tower made the clockwork slip. The lens itself was a second-order Fresnel lens,
made in Paris in 1887, with a focal length of seven hundred millimetres.

A short history of the light, as Ilse copied it from the board in the entrance hall: the first
tower was built of timber in 1821 and burned down in 1840 when a keeper knocked over an oil lamp.
The stone tower that stands today was finished in 1846. Electricity arrived only in 1961, and even
then the keepers kept the old paraffin burner ready, because the cable from the mainland failed
almost every winter. The light flashes white twice every fifteen seconds and can be seen from
twenty-two nautical miles away on a clear night.

Weather, week three. Calm mornings, fog in the afternoons. The foghorn sounded for a total of
thirty-one hours. Ilse counted the seabirds on the rocks below the tower: forty-two cormorants,
eleven eider ducks, a single grey heron that stood motionless on the slipway every evening at
dusk, and a flock of turnstones that ran along the tide line like clockwork toys.

She also kept a small notebook of recipes. Fish soup: two onions, one leek, four potatoes, a
handful of dried dill, whatever the boat brought in, simmered for forty minutes, and a splash of
cream at the end. Oat biscuits: equal weights of oats, flour and butter, half that weight of sugar,
a pinch of salt, baked until the edges turn brown. She wrote that the biscuits kept for three
weeks in a tin, but only if nobody knew where the tin was.

Maintenance log. The brass fittings were polished every Saturday. The weights of the clockwork,
which hung down the centre of the tower, weighed eighty kilograms together and descended one floor
every hour. The glass of the lantern room was cleaned with a mixture of vinegar and warm water, and
dried with newspaper, never with cloth, because cloth left threads that caught the light. In the
third week she replaced a cracked pane on the north side, which took most of a day and three
attempts, since the wind kept lifting the putty before it set.

Visitors were rare. The supply boat came on Tuesdays when the sea allowed it, skippered by a man
called Tomas Brekke who had fished these waters for forty years and who never once, Ilse noted,
took off his woollen hat. He brought flour, paraffin, letters, and on one occasion a crate of
oranges from Valencia that had travelled, according to the label, through four different ports.
In return she gave him a loaf of bread and the weather observations for the harbour master.

A letter from her sister arrived in the fifth week. The farm had lost two sheep to the snow, the
river had frozen solid for the first time in eleven years, and the children had built a sledge
out of an old door. Her sister asked whether the honey had lasted, and whether the lighthouse was
as lonely as everyone in the valley imagined. Ilse wrote back that loneliness was mostly a matter
of having too little to do, and that at Kestrel Point there was always something to wind, polish,
mend or write down.

In the sixth week the generator failed during a gale, and she ran the old paraffin burner for
three nights in a row. The paraffin light was dimmer, and she worried that the fishing boats would
not see it through the rain, so she stood in the lantern room with a hand lamp as well, signalling
the pattern by hand whenever the burner flickered. On the fourth morning an engineer came across on
the supply boat and found that a mouse had chewed through the control cable.

Astronomy. On clear nights she noted the planets. Jupiter was bright in the east after sunset, and
Saturn low in the south-west. On the night of the new moon she saw the Milky Way so clearly that she
could make out the dark lane of dust that runs through Cygnus, and she wrote that the light of the
tower, sweeping overhead every fifteen seconds, seemed to pause at the same star each time, though
she knew that this was only an illusion of the eye.

The last entry of the winter described the first warm day of March. The eiders had begun to pair
off, the heron had gone, the ice in the harbour was breaking into plates that knocked together
with a sound like distant applause, and Tomas Brekke arrived with a new jar of honey from the
valley, because the first one had run out in February.
"""

LONG_QUESTION = (
    "Read the keeper's notes below, then answer the question at the end in one or two sentences.\n\n"
    + LONG_NOTES
    + "\nQuestion: What was the secret ingredient in Ilse's bread, and where did it come from?"
)

GEMMA_PROMPTS: list[dict] = [
    {
        "name": "chat_haiku",
        "chat": True,
        "description": "chat, English, short creative request",
        "text": chat("Write a haiku about the first frost of autumn."),
    },
    {
        "name": "chat_python",
        "chat": True,
        "description": "chat, code generation request (Python)",
        "text": chat(
            "Write a Python function `is_palindrome(s: str) -> bool` that ignores case, spaces "
            "and punctuation. Include two doctest examples."
        ),
    },
    {
        "name": "raw_code_c",
        "chat": False,
        "description": "raw, C source code continuation",
        "text": (
            "#include <stdio.h>\n#include <stdlib.h>\n\n/* Sum the integers given on the command line. */\n"
            "int main(int argc, char **argv) {\n    long total = 0;\n    for (int i = 1; i < argc; i++) {\n"
            "        total += strtol(argv[i], NULL, 10);\n    }\n"
        ),
    },
    {
        "name": "raw_prose_en",
        "chat": False,
        "description": "raw, English encyclopedic prose",
        "text": (
            "The river Danube rises in the Black Forest of Germany and flows for some 2,850 kilometres "
            "through ten countries before it reaches the Black Sea. For centuries it served as a trade "
            "route between western and eastern Europe, and several capital cities were built on its banks,"
        ),
    },
    {
        "name": "raw_french",
        "chat": False,
        "description": "raw, French prose",
        "text": (
            "Il était une fois, dans un petit village au bord de la mer, une vieille femme qui "
            "vendait des crêpes sur la place du marché. Chaque matin, avant le lever du soleil,"
        ),
    },
    {
        "name": "chat_german_translate",
        "chat": True,
        "description": "chat, translation English to German",
        "text": chat(
            "Translate into German: The train to Munich leaves at half past seven, so we should "
            "have breakfast early and pack our bags tonight."
        ),
    },
    {
        "name": "chat_japanese",
        "chat": True,
        "description": "chat, Japanese question",
        "text": chat("日本の四季について、それぞれの季節の特徴を短く説明してください。"),
    },
    {
        "name": "raw_chinese_russian",
        "chat": False,
        "description": "raw, mixed Chinese and Russian prose",
        "text": (
            "北京是中国的首都，有三千多年的历史。故宫位于城市的中心，"
            "曾经是明清两代皇帝的住所。\nМосква — столица России, крупнейший город страны. "
            "Она расположена на реке Москве, и её история"
        ),
    },
    {
        "name": "raw_json",
        "chat": False,
        "description": "raw, structured data (JSON) with numbers",
        "text": (
            '{"orders": [\n  {"id": 1001, "customer": "Ana", "items": ["tea", "scones"], "total": 12.50},\n'
            '  {"id": 1002, "customer": "Bram", "items": ["coffee"], "total": 3.20},\n'
            '  {"id": 1003, "customer": "Chen", "items": ["cake", "coffee", "water"], "total":'
        ),
    },
    {
        "name": "chat_multiturn_math",
        "chat": True,
        "description": "chat, multi-turn arithmetic word problem",
        "text": chat(
            "I have 3 boxes with 12 apples each.",
            "That makes 36 apples in total.",
            "I give away 9 apples and then buy two more boxes of 12. How many apples do I have now? "
            "Explain step by step.",
        ),
    },
    {
        "name": "chat_long_notes",
        "chat": True,
        "description": "chat, >1,000-token reading-comprehension prompt; the answer is at the start, "
        "past gemma3's 512-token sliding window",
        "text": chat(LONG_QUESTION),
    },
]

# ---------------------------------------------------------------------------------------------
# llama.cpp helpers


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def open_llama(path: Path, n_tokens: int, kv_f32: bool = False) -> llama_cpp.Llama:
    """kv_f32: keep K and V in float32 instead of llama.cpp's default float16 (SYNTH_KV_F32)."""
    n_ctx = max(256, -(-(n_tokens + 8) // 256) * 256)
    kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # GGML_TYPE_F32
    return llama_cpp.Llama(
        str(path),
        **kv,
        n_ctx=n_ctx,
        n_batch=n_ctx,  # the whole path in one batch
        n_ubatch=n_ctx,
        logits_all=True,
        flash_attn=False,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        seed=0,
        verbose=False,
    )


def greedy_path(m: llama_cpp.Llama, prompt: list[int], n_gen: int) -> list[int]:
    """llama.cpp's greedy continuation: prompt in one eval, then one token at a time."""
    m.reset()
    m.eval(prompt)
    gen: list[int] = []
    while len(gen) < n_gen:
        t = int(np.argmax(np.asarray(m.scores[m.n_tokens - 1])))
        if llama_cpp.llama_vocab_is_eog(m._model.vocab, t):
            break
        gen.append(t)
        if len(gen) < n_gen:
            m.eval([t])
    return gen


def batched_logits(m: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    m.reset()
    m.eval(tokens)
    return np.array(m.scores[: len(tokens)], dtype=np.float32)


def sequential_logits(m: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    m.reset()
    for t in tokens:
        m.eval([t])
    return np.array(m.scores[: len(tokens)], dtype=np.float32)


def rowwise_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def top_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest entries of each row, largest first (ties broken by lower id)."""
    part = (np.argpartition(-x, k - 1, axis=-1)[:, :k] if k < x.shape[-1]
            else np.tile(np.arange(x.shape[-1]), (len(x), 1)))
    vals = np.take_along_axis(x, part, -1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, -1)


class FixtureBuilder:
    """Collects per-position records for one (model, variant) fixture."""

    def __init__(self, vocab: int, subset: tuple[int, int] | None = None):
        """subset: (top ids, random ids) kept per position whatever the vocabulary's size."""
        self.vocab = vocab
        self.full = subset is None and vocab <= FULL_LOGITS_MAX_VOCAB
        if self.full:
            self.top_k, self.rand_ids = 0, np.arange(vocab, dtype=np.int32)
        else:
            rng = np.random.default_rng(SUBSET_SEED)
            self.top_k, n_random = subset or (TOP_K, N_RANDOM)
            self.rand_ids = np.sort(rng.choice(vocab, size=n_random, replace=False)).astype(np.int32)
        self.rows: dict[str, list[np.ndarray]] = {
            k: [] for k in ("tokens", "top_ids", "sub_logits", "top8_ids", "top8_logits", "gap", "self_corr",
                            "self_corr_full")
        }
        self.extra_summary: dict[str, dict] = {}
        self.prompts: list[dict] = []

    def subset_ids(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, K] top ids and [n, K + R] evaluation-subset ids for each row of logits."""
        n = len(logits)
        top = top_sorted(logits, self.top_k) if self.top_k else np.zeros((n, 0), np.int32)
        sub = np.concatenate([top, np.broadcast_to(self.rand_ids, (n, len(self.rand_ids)))], axis=1)
        return top.astype(np.int32), sub

    def add(self, info: dict, tokens: list[int], logits: np.ndarray, seq: np.ndarray | None) -> dict:
        n = len(tokens)
        top, sub = self.subset_ids(logits)
        sub_logits = np.take_along_axis(logits, sub, -1)
        top8 = top_sorted(logits, 8).astype(np.int32)
        top8_logits = np.take_along_axis(logits, top8, -1)
        gap = top8_logits[:, 0] - top8_logits[:, 1]
        self_corr = np.full(n, np.nan, np.float32)
        self_corr_full = np.full(n, np.nan, np.float32)
        summary = {}
        if seq is not None:
            self_corr = rowwise_corr(sub_logits, np.take_along_axis(seq, sub, -1)).astype(np.float32)
            self_corr_full = rowwise_corr(logits, seq).astype(np.float32)
            seq_top5 = top_sorted(seq, 5)
            overlap = np.array([len(set(a[:5]) & set(b)) for a, b in zip(top8, seq_top5, strict=True)])
            big = gap >= 0.5
            summary = {
                "self_corr_min": float(self_corr.min()),
                "self_corr_full_min": float(self_corr_full.min()),
                "self_argmax_equal": int((seq_top5[:, 0] == top8[:, 0]).sum()),
                "self_argmax_equal_gap_ge_0.5": f"{int((seq_top5[big, 0] == top8[big, 0]).sum())}/{int(big.sum())}",
                "self_top5_overlap_min": int(overlap.min()),
                "self_max_abs_diff": float(np.abs(logits - seq).max()),
            }
        self.rows["tokens"].append(np.asarray(tokens, np.int32))
        self.rows["top_ids"].append(top)
        self.rows["sub_logits"].append(sub_logits.astype(np.float32))  # float16 in the file
        self.rows["top8_ids"].append(top8)
        self.rows["top8_logits"].append(top8_logits.astype(np.float32))
        self.rows["gap"].append(gap.astype(np.float32))
        self.rows["self_corr"].append(self_corr)
        self.rows["self_corr_full"].append(self_corr_full)
        rec = dict(info, n_tokens=n, **summary)
        self.prompts.append(rec)
        return rec

    def attach_reference(self, k: int, ref_logits: np.ndarray) -> dict:
        """Per-position agreement of prompt k's logits with llama.cpp's logits for the same path on
        another variant of the model (here: the F32 copy): `xf32_corr` on this fixture's subset and
        that run's top-8 ids `xf32_top8_ids`."""
        top = self.rows["top_ids"][k]
        n = len(top)
        sub = np.concatenate([top, np.broadcast_to(self.rand_ids, (n, len(self.rand_ids)))], axis=1)
        corr = rowwise_corr(self.rows["sub_logits"][k], np.take_along_axis(ref_logits, sub, -1)).astype(np.float32)
        ref_top8 = top_sorted(ref_logits, 8).astype(np.int32)
        self.rows.setdefault("xf32_corr", []).append(corr)
        self.rows.setdefault("xf32_top8_ids", []).append(ref_top8)
        mine = self.rows["top8_ids"][k]
        gap = self.rows["gap"][k]
        big = gap >= 0.5
        overlap = np.array([len(set(a[:5]) & set(b[:5])) for a, b in zip(mine, ref_top8, strict=True)])
        summary = {
            "xf32_corr_min": float(corr.min()),
            "xf32_argmax_equal_gap_ge_0.5": f"{int((mine[big, 0] == ref_top8[big, 0]).sum())}/{int(big.sum())}",
            "xf32_top5_overlap_min": int(overlap.min()),
        }
        self.prompts[k].update(summary)
        return summary

    def save(self, path: Path, extra: dict) -> dict:
        arrays = {k: np.concatenate(v) for k, v in self.rows.items()}
        arrays["sub_logits"] = arrays["sub_logits"].astype(np.float16)
        lengths = [len(t) for t in self.rows["tokens"]]
        arrays["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays["n_prompt"] = np.array([p["n_prompt"] for p in self.prompts], np.int32)
        arrays["rand_ids"] = self.rand_ids
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)
        return dict(
            extra,
            file=path.name,
            bytes=path.stat().st_size,
            vocab=self.vocab,
            full_logits=self.full,
            top_k=self.top_k,
            n_random=0 if self.full else len(self.rand_ids),
            positions=int(arrays["offsets"][-1]),
            prompts=self.prompts,
        )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Gemma


def write_f32_copy(src: Path, dst: Path) -> None:
    """The same model with every tensor dequantized to F32 (same metadata, file type ALL_F32)."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    align = reader.fields.get("general.alignment")
    if align is not None:
        writer.data_alignment = align.contents()
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    shapes = {}
    index_tables = (gguf.GGMLQuantizationType.I32,)  # deepseek4's hash routing: ids, kept as they are
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order
        shapes[t.name] = shape
        if t.tensor_type in index_tables:
            writer.add_tensor_info(t.name, shape, np.dtype(np.int32), int(np.prod(shape)) * 4, t.tensor_type)
            continue
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4,
                               gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        if t.tensor_type in index_tables:
            writer.write_tensor_data(np.asarray(t.data, dtype=np.int32).reshape(shapes[t.name]))
            continue
        arr = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shapes[t.name])
        writer.write_tensor_data(arr)
        del arr
    writer.close()


def gemma_fixtures(model: Path, out: Path, tmp: Path, *, self_check_long: bool) -> list[dict]:
    log(f"gemma: {model}")
    model_sha = sha256_file(model)
    results = []
    # (a) the quantized file: greedy path, batched logits, token-by-token logits
    paths: list[tuple[dict, list[int]]] = []
    quant = None
    for p in GEMMA_PROMPTS:
        vocab_m = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
        prompt = vocab_m.tokenize(p["text"].encode("utf-8"), add_bos=True, special=p["chat"])
        del vocab_m
        m = open_llama(model, len(prompt) + GEN_TOKENS)
        if quant is None:
            quant = FixtureBuilder(m.n_vocab())
        gen = greedy_path(m, prompt, GEN_TOKENS)
        tokens = prompt + gen
        logits = batched_logits(m, tokens)
        long = len(tokens) > 512
        seq = sequential_logits(m, tokens) if (self_check_long or not long) else None
        info = {
            "name": p["name"],
            "chat": p["chat"],
            "description": p["description"],
            "n_prompt": len(prompt),
            "n_gen": len(gen),
            "generated_text": m.detokenize(gen).decode("utf-8", "replace"),
        }
        rec = quant.add(info, tokens, logits, seq)
        log(f"  q4_k_m {p['name']}: {len(prompt)}+{len(gen)} tokens, self corr min "
            f"{rec.get('self_corr_min', float('nan')):.5f} (full {rec.get('self_corr_full_min', float('nan')):.5f})")
        paths.append((info, tokens))
        del m
    common = {"model": model.name, "model_sha256": model_sha, "arch": "gemma3"}

    # (b) the same weights dequantized to F32, along the same token paths
    f32 = tmp / "gemma3-f32.gguf"
    t0 = time.time()
    write_f32_copy(model, f32)
    log(f"  wrote F32 copy ({f32.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.0f} s")
    fb = None
    for k, (info, tokens) in enumerate(paths):
        m = open_llama(f32, len(tokens))
        if fb is None:
            fb = FixtureBuilder(m.n_vocab())
        logits = batched_logits(m, tokens)
        long = len(tokens) > 512
        seq = sequential_logits(m, tokens) if (self_check_long or not long) else None
        rec = fb.add(dict(info, generated_text=None), tokens, logits, seq)
        x = quant.attach_reference(k, logits)
        log(f"  f32 {info['name']}: self corr min {rec.get('self_corr_min', float('nan')):.6f}, "
            f"max|diff| {rec.get('self_max_abs_diff', float('nan')):.4f}; vs q4_k_m: corr min "
            f"{x['xf32_corr_min']:.5f}, argmax {x['xf32_argmax_equal_gap_ge_0.5']} (gap >= 0.5), "
            f"top-5 share min {x['xf32_top5_overlap_min']}")
        del m
    results.append(quant.save(out / "gemma3-q4_k_m.npz", dict(
        common, variant="q4_k_m",
        description="the quantized embedded file along llama.cpp's greedy path; xf32_* fields: llama.cpp's "
        "agreement with its own run of the F32 copy along the same path")))
    results.append(fb.save(out / "gemma3-f32.npz", dict(
        common, variant="f32", f32_copy_sha256=sha256_file(f32),
        description="the same weights dequantized to F32 (gguf.quants.dequantize), along gemma3-q4_k_m's token paths")))
    f32.unlink()
    return results


# ---------------------------------------------------------------------------------------------
# Synthetic models


def make_synth(arch: str, shape: str, out: Path, ember_python: str) -> None:
    cmd = [ember_python, "-m", "ember.worker", "bench", "make-model", "--arch", arch, "--shape", shape,
           "--out", str(out), "--seed", str(SYNTH_SEED)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"make-model failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr}")


def synth_prompts(m: llama_cpp.Llama, lengths: tuple[int, ...] = SYNTH_PROMPT_LENGTHS) -> list[list[int]]:
    """Seeded random token ids (BOS first), skipping control/special tokens."""
    vocab = m._model.vocab
    n = m.n_vocab()
    normal = [i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_NORMAL
              and not llama_cpp.llama_vocab_is_eog(vocab, i) and i != m.token_bos()]
    rng = np.random.default_rng(SYNTH_PROMPT_SEED)
    bos = m.token_bos()
    out = []
    for length in lengths:
        ids = rng.choice(normal, size=length).tolist()
        out.append(([bos] if bos >= 0 else []) + [int(i) for i in ids])
    return out


def synth_fixture(key: str, out: Path, tmp: Path, ember_python: str) -> list[dict]:
    arch, shape = SYNTH_MODELS[key]
    path = tmp / f"synth-{key}-tiny.gguf"
    make_synth(arch, shape, path, ember_python)
    sha = sha256_file(path)
    log(f"synthetic {key}: {path.stat().st_size / 1e6:.1f} MB, sha256 {sha[:16]}")
    probe = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    prompts = synth_prompts(probe, SYNTH_PROMPT_LENGTHS_BY_KEY.get(key, SYNTH_PROMPT_LENGTHS))
    del probe
    subset = SYNTH_SUBSET_BY_KEY.get(key)
    fb = None
    paths = []
    for prompt in prompts:
        m = open_llama(path, len(prompt) + GEN_TOKENS)
        if fb is None:
            fb = FixtureBuilder(m.n_vocab(), subset)
        gen = greedy_path(m, prompt, GEN_TOKENS)
        tokens = prompt + gen
        logits = batched_logits(m, tokens)
        seq = sequential_logits(m, tokens)
        info = {"name": f"random_{len(prompt)}", "chat": False,
                "description": f"{len(prompt)} seeded random token ids", "n_prompt": len(prompt), "n_gen": len(gen)}
        rec = fb.add(info, tokens, logits, seq)
        log(f"  {info['name']}: {len(prompt)}+{len(gen)}, self corr min {rec['self_corr_min']:.6f}")
        paths.append(tokens)
        del m
    f32 = tmp / f"synth-{key}-tiny-f32.gguf"
    write_f32_copy(path, f32)
    exact = FixtureBuilder(fb.vocab, subset)  # llama.cpp's exact math: the F32 copy along the same paths
    for k, tokens in enumerate(paths):
        m = open_llama(f32, len(tokens), kv_f32=key in SYNTH_KV_F32)
        ref = batched_logits(m, tokens)
        x = fb.attach_reference(k, ref)
        exact.add({f: fb.prompts[k][f] for f in ("name", "chat", "description", "n_prompt", "n_gen")}, tokens, ref,
                  None)
        log(f"  {fb.prompts[k]['name']} vs F32 copy: corr min {x['xf32_corr_min']:.6f}, argmax "
            f"{x['xf32_argmax_equal_gap_ge_0.5']} (gap >= 0.5), top-5 share min {x['xf32_top5_overlap_min']}")
        del m
    f32.unlink()
    res = fb.save(out / f"synth-{key}-tiny.npz", {
        "model": f"ember bench make-model --arch {arch} --shape {shape} --seed {SYNTH_SEED}",
        "model_sha256": sha, "arch": arch, "variant": "synthetic-tiny",
        "description": f"tiny synthetic {arch} model from ember's generator (--shape {shape}); xf32_* fields: "
        "llama.cpp's agreement with its own run of an F32 copy along the same path"})
    res_f32 = exact.save(out / f"synth-{key}-f32.npz", {
        "model": f"ember bench make-model --arch {arch} --shape {shape} --seed {SYNTH_SEED}, every tensor "
                 "dequantized to F32 (gguf.quants) in a temporary copy", "model_sha256": sha, "arch": arch,
        "variant": "synthetic-tiny-f32",
        "description": f"llama.cpp on the F32 copy of the tiny synthetic {arch} (--shape {shape}) model, along "
                       "the quantized file's greedy paths: the exact math on the same weight values"
                       + ("; KV cache in float32" if key in SYNTH_KV_F32 else "")})
    path.unlink()
    return [res, res_f32]


# ---------------------------------------------------------------------------------------------


def ember_default_model(ember_python: str) -> Path:
    code = "from ember.worker.model.embedded import default_model_path; print(default_model_path(quiet=True))"
    res = subprocess.run([ember_python, "-c", code], check=True, capture_output=True, text=True)
    return Path(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture folder (default {DEFAULT_OUT})")
    ap.add_argument("--gemma", type=Path, help="the Gemma 3 270M Q4_K_M file (default: ember's embedded model, "
                    "located through EMBER_PYTHON)")
    ap.add_argument("--ember-python", default=os.environ.get("EMBER_PYTHON", "/work/venv/bin/python"),
                    help="a python with ember installed, used only as a subprocess (make-model, embedded model path)")
    ap.add_argument("--only", default=",".join(["gemma", *SYNTH_MODELS]),
                    help=f"comma-separated subset of gemma,{','.join(SYNTH_MODELS)}")
    ap.add_argument("--no-self-check-long", action="store_true",
                    help="skip llama.cpp's token-by-token self-consistency run on prompts over 512 tokens")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - {"gemma", *SYNTH_MODELS}
    if unknown:
        ap.error(f"unknown --only entries: {sorted(unknown)}")

    manifest_path = args.out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    fixtures = {f["file"]: f for f in manifest.get("fixtures", [])}
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="ember-oracle-") as tmpdir:
        tmp = Path(tmpdir)
        if "gemma" in only:
            model = args.gemma or ember_default_model(args.ember_python)
            for rec in gemma_fixtures(model, args.out, tmp, self_check_long=not args.no_self_check_long):
                fixtures[rec["file"]] = rec
        for key in SYNTH_MODELS:
            if key in only:
                for rec in synth_fixture(key, args.out, tmp, args.ember_python):
                    fixtures[rec["file"]] = rec
    manifest = {
        "fixture_version": FIXTURE_VERSION,
        "generated_by": "tests/oracle/gen_logit_fixtures.py",
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
        "llama_cpp_python": llama_cpp.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "numpy": np.__version__,
        "llama_system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "settings": {
            "gen_tokens": GEN_TOKENS, "top_k": TOP_K, "n_random": N_RANDOM, "subset_seed": SUBSET_SEED,
            "full_logits_max_vocab": FULL_LOGITS_MAX_VOCAB, "n_threads": N_THREADS, "flash_attn": False,
            "batched_eval": "one eval of the whole path, n_batch = n_ubatch = n_ctx, logits_all",
            "self_consistency": "the same path evaluated one token per eval; Pearson correlation per position",
        },
        "fixtures": sorted(fixtures.values(), key=lambda f: f["file"]),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    log(f"done in {time.time() - t_start:.0f} s; manifest {manifest_path}")
    return 0


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
