"""Bad model files give one line naming the file and the problem, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from ember.worker.model.config import read_config
from ember.worker.model.gguf_file import GGUFFile, ModelFileError, model_stem


def _run_generate(model: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.worker", "generate", "--model", str(model), "--max-tokens", "1", "hello"],
        capture_output=True, text=True, timeout=120,
    )


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, (data, raw_type) in tensors.items():
        if raw_type is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _prefix_copy(src: Path, dst: Path, n: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return dst


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, default_model_path) -> dict[str, tuple[Path, str]]:
    d = tmp_path_factory.mktemp("bad-models")
    files = {}
    files["missing"] = (d / "nope.gguf", "no such file")
    (d / "a-directory.gguf").mkdir()
    files["directory"] = (d / "a-directory.gguf", "is a directory")
    (d / "empty.gguf").write_bytes(b"")
    files["empty"] = (d / "empty.gguf", "too small")
    (d / "magic.gguf").write_bytes(b"GGML" + bytes(200))
    files["magic"] = (d / "magic.gguf", "not a GGUF file")
    files["header"] = (_prefix_copy(default_model_path, d / "header.gguf", 4096), "truncated or corrupt header")
    files["data"] = (_prefix_copy(default_model_path, d / "data.gguf", 50_000_000), "truncated: tensor")
    garbage = bytearray(b"GGUF") + (3).to_bytes(4, "little") + np.random.default_rng(0).bytes(4096)
    (d / "garbage.gguf").write_bytes(bytes(garbage))
    files["garbage"] = (d / "garbage.gguf", "corrupt")
    files["arch"] = (
        _write_gguf(d / "arch.gguf", "mamba", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}),
        "unsupported architecture 'mamba'",
    )
    # IQ1_S: 50 bytes per 256 elements; valid layout, a type the engine does not run
    iq = np.zeros((4, 50), dtype=np.uint8)
    files["quant"] = (
        _write_gguf(d / "quant.gguf", "llama", {"token_embd.weight": (iq, gguf.GGMLQuantizationType.IQ1_S)}),
        "tensor token_embd.weight has unsupported quant type IQ1_S",
    )
    return files


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "magic", "header", "data", "garbage", "arch",
                                  "quant"])
def test_bad_model_file_is_one_clear_line(bad_files, case):
    path, problem = bad_files[case]
    proc = _run_generate(path)
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0] and problem in lines[0], lines[0]


def test_reader_parses_embedded_model_lazily(default_model_path):
    g = GGUFFile(default_model_path)
    assert g.architecture == "gemma3"
    assert len(g.tensors) == 236
    emb = g.tensors["token_embd.weight"]
    assert emb.shape == (640, 262144) and emb.ggml_type == gguf.GGMLQuantizationType.Q8_0
    # tensor data are views into the mapping, not copies
    raw = g.raw("token_embd.weight")
    assert raw.nbytes == emb.nbytes and not raw.flags.owndata
    cfg = read_config(g)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert cfg.sliding_window == 512 and cfg.rope_base_local == 10000.0 and cfg.tied_output
    assert [cfg.is_local_layer(i) for i in range(6)] == [True] * 5 + [False]


def test_fingerprint_is_stable_and_sensitive(tmp_path, default_model_path):
    g = GGUFFile(default_model_path)
    a = g.fingerprint
    assert a == GGUFFile(default_model_path).fingerprint
    copy = tmp_path / "copy.gguf"
    data = bytearray(default_model_path.read_bytes())
    data[g.data_offset + (g.size - g.data_offset) * 3 // 16 + 10] ^= 0xFF  # inside a sampled window
    copy.write_bytes(bytes(data))
    assert GGUFFile(copy).fingerprint != a


def test_reader_error_names_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(64))
    with pytest.raises(ModelFileError, match="unsupported GGUF version 7") as e:
        GGUFFile(p)
    assert str(p) in str(e.value)


# -- split models ------------------------------------------------------------------------------------------


def _split(src: Path, out: Path, per_shard: int) -> list[Path]:
    """src re-written as llama.cpp's gguf-split writes it (gguf-py's writer: NAME-0000k-of-0000N.gguf, the
    metadata in the first shard, split.* keys in every one); the shards' paths in order."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents(), split_max_tensors=per_shard)
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = f.types[0]
            w.add_key_value(key, f.contents(), kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> tuple[Path, list[Path]]:
    from ember.worker.bench.synth import make_model

    d = tmp_path_factory.mktemp("split")
    whole = make_model("llama", "tiny", d / "whole.gguf")
    (d / "shards").mkdir()
    shards = _split(whole, d / "shards" / "tiny.gguf", per_shard=8)
    assert [p.name for p in shards] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return whole, shards


def test_a_split_model_opens_from_its_first_shard(split_model):
    whole, shards = split_model
    g, w = GGUFFile(shards[0]), GGUFFile(whole)
    assert {k: v for k, v in g.metadata.items() if not k.startswith("split.")}.keys() == w.metadata.keys()
    assert g.tensors.keys() == w.tensors.keys() and {t.shard for t in g.tensors.values()} == {0, 1, 2}
    assert all(np.array_equal(g.raw(n), w.raw(n)) for n in w.tensors)
    assert read_config(g) == read_config(w) and g.size == sum(p.stat().st_size for p in shards)
    assert g.fingerprint == GGUFFile(shards[0]).fingerprint != w.fingerprint
    # and the model runs from it: greedy, the same text as from the whole file
    runs = [subprocess.run([sys.executable, "-m", "ember.worker", "generate", "--model", str(p), "--max-tokens", "12",
                            "hello"], capture_output=True, text=True, timeout=120) for p in (whole, shards[0])]
    assert runs[0].returncode == runs[1].returncode == 0, runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()


@pytest.mark.parametrize("case", ["second", "missing", "renamed", "renamed-as-second"])
def test_a_split_model_opened_wrongly_is_one_clear_line(split_model, tmp_path, case):
    _, shards = split_model
    d = tmp_path / "shards"
    d.mkdir()
    for p in shards:
        (d / p.name).symlink_to(p)
    path, problem = d / shards[0].name, ""
    if case == "second":
        path = d / shards[1].name
        problem = "is shard 2 of 3 of a split model: give its first shard, tiny-00001-of-00003"
    elif case == "missing":
        (d / shards[2].name).unlink()
        problem = "shard 3 of 3 is missing: no tiny-00003-of-00003.gguf beside it"
    else:
        (d / shards[1].name).unlink()
        path = (d / shards[0].name).rename(d / ("tiny.gguf" if case == "renamed" else shards[1].name))
        problem = "is the first of 3 shards, but its name does not end in -00001-of-00003.gguf"
    proc = _run_generate(path)
    assert proc.returncode == 78 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0], lines


def test_a_split_count_that_is_not_a_number_is_one_clear_line(tmp_path):
    path = tmp_path / "odd-00001-of-00002.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("split.count", "two")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="corrupt metadata: split.count is 'two', not an integer") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_a_split_model_is_named_without_its_shard_suffix():
    assert model_stem(Path("/m/DeepSeek-V4-Flash-IQ2_XXS-00001-of-00003.gguf")) == "DeepSeek-V4-Flash-IQ2_XXS"
    assert model_stem(Path("/m/gemma-3-270m.gguf")) == "gemma-3-270m"
