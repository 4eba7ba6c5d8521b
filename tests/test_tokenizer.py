"""ember's tokenizer against llama.cpp, through fixtures recorded from llama-cpp-python.

The fixtures (tests/fixtures/tokenizer/*.jsonl) come from tests/oracle/gen_tokenizer_fixtures.py:
for every string of corpus.jsonl, llama_tokenize's ids with parse_special false and true, and the
detokenized text of those ids. CI has no llama.cpp; these tests only read the fixtures.

Vocabularies: the embedded Gemma 3 270M (SentencePiece-style, 262k tokens) and the synthetic ones
of `ember bench make-model` (Llama 2 SPM with add_space_prefix, Qwen 2/3 and Llama 3 byte-level
BPE), rebuilt here as vocab-only GGUF files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from ember.worker.model.gguf_file import GGUFFile, ModelFileError
from ember.worker.text import tokenizer as tokenizer_mod
from ember.worker.text.special_partition import Partitioner
from ember.worker.text.tokenizer import IncrementalDecoder, Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizer"
GEN_SCRIPT = Path(__file__).parent / "oracle" / "gen_tokenizer_fixtures.py"
VOCABS = ["gemma3-270m", "synth-llama-spm", "synth-qwen2-bpe", "synth-qwen3-bpe", "synth-llama3-bpe",
          "synth-gpt-oss-bpe"]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_tokenizer_fixtures", GEN_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _load_fixture(name: str) -> tuple[dict, list[dict]]:
    meta = json.loads((FIXTURES / f"{name}.meta.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
    return meta, rows


def _ids_parsed(row: dict) -> list[int]:
    return row.get("ids_parsed", row["ids_text"])


def _expected_dec(row: dict, which: str, special: bool) -> str:
    """The detokenized text in the fixture (keys are left out when they equal the input text)."""
    sp = "_sp" if special else ""
    if which == "parsed" and "ids_parsed" not in row:
        which = "text"
    return row.get(f"dec_{which}{sp}", row["text"])


class Vocab:
    def __init__(self, name: str, tok: Tokenizer, meta: dict, rows: list[dict], path: Path):
        self.name, self.tok, self.meta, self.rows, self.path = name, tok, meta, rows, path


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    gen = _gen_module()
    d = tmp_path_factory.mktemp("synth-vocabs")
    for name, arch, shape in gen.SYNTH_VOCABS:
        gen.write_synth_vocab_gguf(arch, shape, d / f"{name}.gguf")
    return d


@pytest.fixture(scope="session")
def gemma(default_model_path) -> Vocab:
    meta, rows = _load_fixture("gemma3-270m")
    tok = Tokenizer.from_gguf(GGUFFile(default_model_path))
    return Vocab("gemma3-270m", tok, meta, rows, Path(default_model_path))


_VOCAB_CACHE: dict[str, Vocab] = {}


@pytest.fixture(scope="session", params=VOCABS)
def vocab(request) -> Vocab:
    name = request.param
    if name == "gemma3-270m":
        return request.getfixturevalue("gemma")
    if name not in _VOCAB_CACHE:
        d = request.getfixturevalue("synth_dir")
        meta, rows = _load_fixture(name)
        path = d / f"{name}.gguf"
        digest = _gen_module().vocab_digest(path)
        assert digest == meta["vocab_digest"], (
            f"the synthetic vocabulary {name} changed (digest {digest}, fixtures recorded {meta['vocab_digest']}); "
            f"regenerate the fixtures with {GEN_SCRIPT.name} (see its docstring)")
        _VOCAB_CACHE[name] = Vocab(name, Tokenizer.from_metadata_only(GGUFFile(path)), meta, rows, path)
    return _VOCAB_CACHE[name]


# -- agreement with llama.cpp ------------------------------------------------------------------------


def test_fixture_corpus_is_big_and_current():
    corpus = [json.loads(line) for line in (FIXTURES / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(corpus) >= 500
    _, rows = _load_fixture("gemma3-270m")
    assert [r["text"] for r in rows] == [c["text"] for c in corpus], "fixtures are stale: regenerate them"


@pytest.mark.parametrize("parse_special", [False, True], ids=["raw-text", "parse-special"])
def test_encode_matches_llama_cpp(vocab, parse_special):
    bad = []
    for row in vocab.rows:
        want = _ids_parsed(row) if parse_special else row["ids_text"]
        got = vocab.tok.encode(row["text"], add_special=True, parse_special=parse_special)
        if got != want:
            bad.append((row["id"], row["text"][:60], got[:12], want[:12]))
    rate = 1 - len(bad) / len(vocab.rows)
    assert not bad, f"{vocab.name}: match rate {rate:.2%}; first mismatches (id, text, ember, llama.cpp): {bad[:3]}"


@pytest.mark.parametrize("special", [False, True], ids=["skip-special", "render-special"])
def test_decode_matches_llama_cpp(vocab, special):
    bad = []
    for row in vocab.rows:
        for which, ids in (("text", row["ids_text"]), ("parsed", _ids_parsed(row))):
            got = vocab.tok.decode(ids, skip_special=not special)
            want = _expected_dec(row, which, special)
            if got != want:
                bad.append((row["id"], which, got[:40], want[:40]))
    assert not bad, f"{vocab.name}: first mismatches (id, ids, ember, llama.cpp): {bad[:3]}"


def test_flags_match_llama_cpp(vocab):
    m, tok = vocab.meta, vocab.tok
    assert tok.vocab_size == m["n_vocab"]
    assert tok.bos_id == (m["bos"] if m["bos"] >= 0 else None)
    assert tok.eos_id == (m["eos"] if m["eos"] >= 0 else None)
    assert tok.add_bos == m["add_bos"] and tok.add_eos == m["add_eos"]
    assert tok.eot_ids == set(m["eog"])


def test_add_special_false_leaves_out_bos(vocab):
    tok = vocab.tok
    for row in vocab.rows[:200]:
        want = row["ids_text"][1:] if tok.add_bos else row["ids_text"]
        assert tok.encode(row["text"], add_special=False) == want


def test_incremental_decoder_equals_decode(vocab):
    tok = vocab.tok
    for row in vocab.rows:
        for ids in (row["ids_text"], _ids_parsed(row)):
            for skip in (True, False):
                dec = IncrementalDecoder(tok, skip_special=skip)
                chunks = [dec.feed(i) for i in ids]
                tail = dec.flush()
                full = tok.decode(ids, skip_special=skip)
                assert "".join(chunks) + tail == full, (vocab.name, row["id"])
                if "\ufffd" not in full:  # never half a character on the way
                    assert not any("\ufffd" in c for c in chunks), (vocab.name, row["id"])


def test_exact_partition_agrees_with_fast_path(gemma):
    """The literal llama.cpp loop (used for vocabularies with partially overlapping special tokens)
    gives the same partition as the one-regex path on the whole corpus."""
    tok = gemma.tok
    for parse_special in (False, True):
        fast = tok._partitioner(parse_special)
        exact = Partitioner(fast.ids, fast.texts, tok._attrs, ll_safe=False)
        assert exact.exact_scan and not fast.exact_scan
        for row in gemma.rows:
            assert exact.split(row["text"]) == fast.split(row["text"]), row["id"]


# -- Gemma specifics ---------------------------------------------------------------------------------


def test_gemma_special_tokens(gemma):
    tok = gemma.tok
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
    sot, eot = tok.id_of("<start_of_turn>"), tok.id_of("<end_of_turn>")
    assert (sot, eot) == (105, 106)
    assert {1, 106} <= tok.eot_ids
    assert tok.is_special(sot) and tok.is_special(tok.bos_id)
    assert not tok.is_special(tok.id_of("\n")) and not tok.is_special(tok.id_of("<b>"))  # user-defined
    assert tok.id_of("no such token, surely") is None
    assert tok.token_piece(tok.id_of("\n")) == b"\n"
    assert tok.token_piece(tok.id_of("▁world")) == b" world"
    assert tok.token_piece(sot) == b"<start_of_turn>"
    assert tok.token_piece(tok.id_of("<0xE2>")) == b"\xe2"
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", parse_special=True)
    assert ids[:2] == [2, sot] and eot in ids
    assert tok.decode(ids) == "user\nHi\n"
    assert tok.decode(ids, skip_special=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    raw = tok.encode("<start_of_turn>", parse_special=False)
    assert sot not in raw and tok.decode(raw) == "<start_of_turn>"


def test_incremental_decoder_waits_for_whole_characters(gemma):
    tok = gemma.tok
    bytes_ids = [tok.id_of(f"<0x{b:02X}>") for b in "😀".encode()]
    dec = tok.incremental_decoder()
    assert [dec.feed(i) for i in bytes_ids] == ["", "", "", "😀"]
    assert dec.flush() == ""
    dec.feed(bytes_ids[0])
    assert dec.pending and dec.flush() == "\ufffd" and not dec.pending
    assert tok.decode(bytes_ids[:2]) == "\ufffd"
    # special tokens vanish unless asked for
    assert dec.feed(tok.eos_id) == "" and tok.incremental_decoder(skip_special=False).feed(tok.eos_id) == "<eos>"


def test_bad_token_ids_are_refused(gemma):
    tok = gemma.tok
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError):
            tok.decode([bad])
        with pytest.raises(ValueError):
            tok.token_piece(bad)


# -- the cache -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_cache(gemma, tmp_path_factory):
    """A cache dir holding one cold build of the Gemma tokenizer, and that build's timing."""
    d = tmp_path_factory.mktemp("ember-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CACHE_DIR", str(d))
        t0 = time.perf_counter()
        tok = Tokenizer.from_gguf(GGUFFile(gemma.path))
        cold = time.perf_counter() - t0
    return d, tok, cold


def test_cache_second_load_uses_cache_and_is_equal(gemma, built_cache, monkeypatch):
    d, cold, cold_s = built_cache
    assert len(list(d.rglob("tokenizer-v*/meta.json"))) == 1
    monkeypatch.setenv("EMBER_CACHE_DIR", str(d))

    def no_rebuild(_g):
        raise AssertionError("the second load rebuilt the tokenizer instead of reading the cache")

    monkeypatch.setattr(tokenizer_mod, "build", no_rebuild)
    t0 = time.perf_counter()
    warm = Tokenizer.from_gguf(GGUFFile(gemma.path))
    print(f"\ntokenizer cold build {cold_s:.2f} s, cached load {time.perf_counter() - t0:.2f} s")
    assert warm.meta == cold.meta and warm.eot_ids == cold.eot_ids
    assert np.array_equal(warm._attrs, cold._attrs) and warm._pieces == cold._pieces
    for row in gemma.rows[::7]:
        for ps in (False, True):
            assert warm.encode(row["text"], parse_special=ps) == cold.encode(row["text"], parse_special=ps)


def test_corrupt_cache_is_rebuilt(gemma, built_cache, tmp_path, monkeypatch):
    shutil.copytree(built_cache[0], tmp_path / "cache")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    (hf_json,) = (tmp_path / "cache").rglob("tokenizer-v*/tokenizer.json")
    hf_json.write_text('{"truncated": ')
    tok = Tokenizer.from_gguf(GGUFFile(gemma.path))
    assert tok.encode("Hello world") == [2, 9259, 1902]
    assert json.loads(hf_json.read_text(encoding="utf-8"))["model"]["type"] == "BPE"  # rewritten


# -- bad metadata ----------------------------------------------------------------------------------------


def _write_gguf(path: Path, fields: dict) -> Path:
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], str):
            w.add_array(key, value)
        elif value and isinstance(value[0], float):
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


_SMALL = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
_BAD_VOCABS = {
    "unknown model": {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": _SMALL},
    "no model": {"tokenizer.ggml.tokens": _SMALL},
    "no tokens": {"tokenizer.ggml.model": "llama"},
    "duplicate token": {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": _SMALL + ["a"]},
    "unknown pre-tokenizer": {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
                              "tokenizer.ggml.tokens": _SMALL, "tokenizer.ggml.merges": ["a b"]},
    "gpt2 without merges": {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                            "tokenizer.ggml.tokens": _SMALL},
    "short scores": {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": _SMALL,
                     "tokenizer.ggml.scores": [0.0, 1.0]},
}


@pytest.mark.parametrize("case", sorted(_BAD_VOCABS))
def test_bad_metadata_raises_model_file_error(tmp_path, case):
    g = GGUFFile(_write_gguf(tmp_path / "bad.gguf", _BAD_VOCABS[case]))
    with pytest.raises(ModelFileError) as err:
        Tokenizer.from_metadata_only(g)
    msg = str(err.value)
    assert "\n" not in msg and "unsupported tokenizer" in msg and str(g.path) in msg


# -- llama.cpp's longest-first partition where leftmost-longest would differ -------------------------------


def test_partially_overlapping_special_tokens_match_llama_cpp(tmp_path):
    """Special tokens whose occurrences overlap partially ("ab<" and "<bcd>"): llama.cpp cuts the
    longest first, not the leftmost. Expected ids recorded from llama-cpp-python 0.3.36."""
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(toks)
    for i, t in enumerate(["a", "b", "c", "d", "x", "▁", "ab", "cd", "bc", "▁a"]):
        toks.append(t)
        types.append(1)
        scores.append(-float(i))
    for t in ["ab<", "<bcd>", "bcd", "XY", "YZW", "<ctl>", "l>q"]:
        toks.append(t)
        types.append(3 if t == "<ctl>" else 4)
        scores.append(-1000.0)
    g = GGUFFile(_write_gguf(tmp_path / "overlap.gguf", {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_space_prefix": False}))
    tok = Tokenizer.from_metadata_only(g)
    assert not tok.meta["ll_safe_all"] and not tok.meta["ll_safe_user"]
    expected = {  # text: (parse_special=False, parse_special=True)
        "ab<bcd>": ([265, 270], [265, 270]),
        "abcd": ([259, 271], [259, 271]),
        "xXYZW": ([263, 91, 273], [263, 91, 273]),
        "XYZWXYZW": ([91, 273, 91, 273], [91, 273, 91, 273]),
        "ab<ctl>q": ([269, 261, 119, 275], [265, 274, 116]),
        "<ctl>": ([63, 261, 119, 111, 65], [274]),
        "a<ctl>>q": ([259, 63, 261, 119, 111, 65, 65, 116], [259, 274, 65, 116]),
        "ab<bcd>ab<bcd>": ([265, 270, 265, 270], [265, 270, 265, 270]),
        "XYZW abcd <bcd>": ([91, 273, 268, 271, 264, 270], [91, 273, 268, 271, 264, 270]),
    }
    for text, (plain, parsed) in expected.items():
        assert tok.encode(text, parse_special=False) == plain, text
        assert tok.encode(text, parse_special=True) == parsed, text
