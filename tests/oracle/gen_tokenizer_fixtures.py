"""Tokenizer fixtures from llama.cpp (the oracle), for tests/test_tokenizer.py.

For every string of tests/fixtures/tokenizer/corpus.jsonl this records what llama.cpp's
llama_tokenize gives with add_special=true, once with parse_special=false (raw user text) and once
with parse_special=true (rendered chat templates), and the detokenized text of both id lists: the
concatenation of llama_token_to_piece(special=false) and (special=true) pieces.

Two steps, because llama-cpp-python and ember live in different virtual environments:

1. (ember venv, only for the synthetic vocabularies) write vocab-only GGUF files of the
   vocabularies that `ember bench make-model` puts into its synthetic models:

       /work/venv/bin/python tests/oracle/gen_tokenizer_fixtures.py --write-synth-ggufs /tmp/synth-vocabs

2. (oracle venv: llama_cpp + stdlib only) tokenize the corpus and write the fixtures:

       /work/oracle-venv/bin/python tests/oracle/gen_tokenizer_fixtures.py \\
           --model /work/models/gemma-3-270m-q4_k_m.gguf --name gemma3-270m [--synth-dir /tmp/synth-vocabs]

Output: tests/fixtures/tokenizer/<name>.jsonl, one line per corpus string
    {"id", "text", "ids_text", "ids_parsed", "dec_text", "dec_text_sp", "dec_parsed", "dec_parsed_sp"}
(ids_text: parse_special=false; ids_parsed: parse_special=true; dec_*: detokenized with
special=false, dec_*_sp: special=true; a dec_* key is left out when the detokenized text equals
"text", ids_parsed is left out when it equals ids_text, and a "<key>_hex" twin appears when the
bytes are not valid UTF-8), and <name>.meta.json with the vocabulary's flags, its end-of-generation
ids and the llama-cpp-python version.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "tokenizer"
CORPUS = FIXTURES / "corpus.jsonl"

# (fixture name, arch, shape) of the synthetic vocabularies worth covering: Llama 2 style SPM (with
# add_space_prefix), Qwen2/Qwen3 byte-level BPE (qwen2 pre-tokenizer, user-defined <think> tokens)
# Llama 3 byte-level BPE (llama-bpe pre-tokenizer, ignore_merges) and gpt-oss byte-level BPE (gpt-4o,
# tiktoken's o200k pre-tokenizer; Harmony's special tokens).
SYNTH_VOCABS = (
    ("synth-llama-spm", "llama", "tiny"),
    ("synth-qwen2-bpe", "qwen2", "tiny"),
    ("synth-qwen3-bpe", "qwen3", "tiny"),
    ("synth-llama3-bpe", "llama", "llama-8b"),
    ("synth-gpt-oss-bpe", "gpt-oss", "tiny"),
)


# -- step 1: synthetic vocab-only GGUFs (needs ember) -----------------------------------------------


def write_synth_vocab_gguf(arch: str, shape: str, out: Path) -> Path:
    """The metadata of `ember bench make-model ARCH --shape SHAPE`, without tensors (vocab only)."""
    from gguf import GGUFWriter

    from ember.worker.bench import synth

    spec = synth.resolve_shape(arch, shape)
    vocab = synth.build_vocab(spec)
    w = GGUFWriter(str(out), spec.arch)
    synth._add_metadata(w, spec, vocab, 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out


def vocab_digest(path: Path) -> str:
    """Hash of a GGUF's tokenizer.* metadata (ember venv), to notice a synthetic vocabulary that changed."""
    import numpy as np

    from ember.worker.model.gguf_file import GGUFFile

    md = GGUFFile(path).metadata
    h = hashlib.sha256()
    for key in sorted(k for k in md if k.startswith("tokenizer.") and k != "tokenizer.chat_template"):
        v = md[key]
        v = v.tolist() if isinstance(v, np.ndarray) else v
        h.update(json.dumps([key, v], ensure_ascii=False).encode())
    return h.hexdigest()[:16]


# -- step 2: the oracle (llama_cpp only) ------------------------------------------------------------


class Oracle:
    def __init__(self, path: Path):
        import llama_cpp

        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))  # no "double BOS" warnings
        self.lc = llama_cpp
        self.llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llama._model.vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n = len(data) + 8
        while True:
            buf = (self.lc.llama_token * n)()
            k = self.lc.llama_tokenize(self.vocab, data, len(data), buf, n, add_special, parse_special)
            if k >= 0:
                return list(buf[:k])
            n = -k

    def piece(self, tok: int, special: bool) -> bytes:
        n = 64
        while True:
            buf = ctypes.create_string_buffer(n)
            k = self.lc.llama_token_to_piece(self.vocab, tok, buf, n, 0, special)
            if k >= 0:
                return buf.raw[:k]
            n = -k

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (self.lc.llama_token * max(len(ids), 1))(*ids)
        n = 64 + 8 * len(ids)
        while True:
            buf = ctypes.create_string_buffer(n)
            k = self.lc.llama_detokenize(self.vocab, arr, len(ids), buf, n, remove_special, unparse_special)
            if k >= 0:
                return buf.raw[:k]
            n = -k


def _put(row: dict, key: str, data: bytes) -> None:
    row[key] = data.decode("utf-8", errors="replace")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        row[key + "_hex"] = data.hex()


def gen(model: Path, name: str, corpus: list[dict], extra_meta: dict) -> None:
    o = Oracle(model)
    lc = o.lc
    rows, detok_differs = [], 0
    for r in corpus:
        row: dict = {"id": r["id"], "text": r["text"]}
        row["ids_text"] = o.tokenize(r["text"], True, False)
        row["ids_parsed"] = o.tokenize(r["text"], True, True)
        for key, ids in (("dec_text", row["ids_text"]), ("dec_parsed", row["ids_parsed"])):
            if key == "dec_parsed" and ids == row["ids_text"]:
                continue
            for sp in (False, True):
                data = b"".join(o.piece(t, sp) for t in ids)
                if data != r["text"].encode("utf-8"):  # the common case, equal to the text, is left out
                    _put(row, key + ("_sp" if sp else ""), data)
                # llama_detokenize may differ (clean_spaces, leading-space strip); count, don't store
                if o.detokenize(ids, False, sp) != data:
                    detok_differs += 1
        if row["ids_parsed"] == row["ids_text"]:
            del row["ids_parsed"]  # no control-token text in the string: left out, same as ids_text
        rows.append(row)
    eog = [i for i in range(o.n_vocab) if lc.llama_vocab_is_eog(o.vocab, i)]
    version = getattr(lc, "__version__", "?")
    meta = {
        "model": model.name, "llama_cpp_python": version, "n_vocab": o.n_vocab,
        "bos": lc.llama_vocab_bos(o.vocab), "eos": lc.llama_vocab_eos(o.vocab), "eot": lc.llama_vocab_eot(o.vocab),
        "add_bos": bool(lc.llama_vocab_get_add_bos(o.vocab)), "add_eos": bool(lc.llama_vocab_get_add_eos(o.vocab)),
        "eog": eog, "n_strings": len(rows), "llama_detokenize_differs_from_pieces": detok_differs,
        **extra_meta,
    }
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with open(FIXTURES / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            line = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
            for ch in "\u2028\u2029\x85":  # line breaks to some readers: keep them escaped
                line = line.replace(ch, f"\\u{ord(ch):04x}")
            f.write(line + "\n")
    with open(FIXTURES / f"{name}.meta.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{name}: {len(rows)} strings, llama_detokenize != pieces for {detok_differs} decodes", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-synth-ggufs", type=Path, metavar="DIR", help="step 1 (ember venv)")
    ap.add_argument("--model", type=Path, help="GGUF file for step 2 (oracle venv)")
    ap.add_argument("--name", default="gemma3-270m")
    ap.add_argument("--synth-dir", type=Path, help="vocab-only GGUFs from step 1 to cover too")
    args = ap.parse_args()

    if args.write_synth_ggufs:
        args.write_synth_ggufs.mkdir(parents=True, exist_ok=True)
        for name, arch, shape in SYNTH_VOCABS:
            p = write_synth_vocab_gguf(arch, shape, args.write_synth_ggufs / f"{name}.gguf")
            Path(f"{p}.digest").write_text(vocab_digest(p) + "\n")
            print(f"wrote {p}", file=sys.stderr)
        return

    corpus = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    if args.model:
        gen(args.model, args.name, corpus, {})
    if args.synth_dir:
        for name, arch, shape in SYNTH_VOCABS:
            p = args.synth_dir / f"{name}.gguf"
            digest = Path(f"{p}.digest").read_text().strip()
            gen(p, name, corpus, {"synth": {"arch": arch, "shape": shape}, "vocab_digest": digest})


if __name__ == "__main__":
    main()
