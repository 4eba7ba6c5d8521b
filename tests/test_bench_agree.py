"""`ember bench agree` (worker/bench/agree.py), for real on the CPU: the reference of the tiny DeepSeek V4 file
written by one process and compared by another on the numpy backend (the tool against itself: every
position's correlation 1, every argmax), a reference of another file refused in one line, and the flags'
errors. The GPU's side is the device's (docs/benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ember.worker.bench.synth import make_model


def _ember(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {"EMBER_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "bench", "agree", *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("agree")
    return make_model("deepseek4", "tiny", d / "tiny.gguf"), make_model("llama", "tiny", d / "llama.gguf")


def test_the_reference_against_itself_agrees_everywhere(tiny, tmp_path):
    model, _ = tiny
    ref = tmp_path / "ref.npz"
    wrote = _ember("--model", str(model), "--positions", "40", "--out", str(ref), tmp_path=tmp_path)
    assert wrote.returncode == 0, wrote.stderr
    saved = np.load(ref)
    assert saved["sub"].shape == (40, len(saved["ids"])) and saved["last"].size == 768
    ran = _ember("--model", str(model), "--reference", str(ref), "--backend", "numpy", "--json", tmp_path=tmp_path)
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert got["positions"] == 40 and got["argmax_agree_all"] == 40 and got["below_0999"] == 0
    assert got["corr_min"] > 0.999999 and got["last_row_corr"] > 0.999999
    assert got["argmax_agree_clear"] == got["clear_positions"] == int((saved["gap"] >= 0.5).sum())
    table = _ember("--model", str(model), "--reference", str(ref), "--backend", "numpy", tmp_path=tmp_path)
    assert table.returncode == 0 and "40 of 40 in all" in table.stdout


def test_a_reference_of_another_file_and_bad_flags_are_one_line(tiny, tmp_path):
    model, other = tiny
    ref = tmp_path / "ref.npz"
    assert _ember("--model", str(model), "--positions", "8", "--out", str(ref), tmp_path=tmp_path).returncode == 0
    wrong = _ember("--model", str(other), "--reference", str(ref), "--backend", "numpy", tmp_path=tmp_path)
    assert wrong.returncode == 2 and "made from another file" in wrong.stderr and "Traceback" not in wrong.stderr
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a reference")
    bad = _ember("--model", str(model), "--reference", str(junk), "--backend", "numpy", tmp_path=tmp_path)
    assert bad.returncode == 2 and "is not a reference" in bad.stderr and "Traceback" not in bad.stderr
    both = _ember("--model", str(model), tmp_path=tmp_path)
    assert both.returncode == 2 and "--out" in both.stderr
    short = _ember("--model", str(model), "--positions", "1", "--out", str(ref), tmp_path=tmp_path)
    assert short.returncode == 2 and "at least 2" in short.stderr
