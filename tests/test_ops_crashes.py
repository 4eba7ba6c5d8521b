"""`ember crashes list | show | export` over an archive laid out as the daemon writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ember.ops import crashes


def _bundle(root: Path, name: str, cls: str, sig: str, **meta) -> Path:
    d = root / "crashes" / name
    d.mkdir(parents=True, mode=0o700)
    m = {"schema": 1, "id": name, "class": cls, "signature": sig, "detected_at": "2026-05-09T10:00:00.000+00:00",
         "uptime_seconds": 3725.0, "restart_count": 2, "exit_code": 75, "signal": None,
         "cuda_error": {"code": 700, "name": "CUDA_ERROR_ILLEGAL_ADDRESS", "message": "an illegal memory access"},
         "detection": {"source": "log", "reason": "poisoned"}, "worker": {"pid": 42, "version": "0.1.0"},
         "host": {"hostname": "gpubox-7", "platform": "Linux"}, "gpu": {"present": False},
         "log_window": {"lines": 2, "affected_requests": ["r1"], "last_healthy_request": "r0"},
         "events": {"count": 1}, "health": {"count": 1}, **meta}
    (d / "meta.json").write_text(json.dumps(m))
    home = os.path.expanduser("~")
    (d / "worker.log").write_text('{"event": "completed", "request_id": "r0"}\n'
                                  f"loading {home}/models/x.gguf on gpubox-7\n"
                                  "Authorization: Bearer abcdefghijklmnop\n")
    (d / "events.jsonl").write_text('{"event": "admit", "request_id": "r1", "new_tokens": 10}\n')
    (d / "health.jsonl").write_text('{"probe": "live", "ok": true}\n')
    return d


@pytest.fixture
def archive(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_STATE_DIR", str(tmp_path))
    _bundle(tmp_path, "20260509T100000Z-poisoned-context", "poisoned-context", "aaaaaaaaaaaa")
    _bundle(tmp_path, "20260509T110000Z-crash-signal", "crash-signal", "bbbbbbbbbbbb", exit_code=None,
            signal="SIGSEGV", cuda_error=None)
    _bundle(tmp_path, "20260509T120000Z-poisoned-context", "poisoned-context", "aaaaaaaaaaaa")
    (tmp_path / "crashes" / ".tmp-half-written").mkdir()
    return tmp_path


def test_list_table_and_json(archive, capsys):
    assert crashes.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["WHEN", "(UTC)", "CLASS"]
    assert len(out) == 4 and "SIGSEGV" in out[2] and "62m" in out[1] and ".tmp" not in "".join(out)
    assert crashes.main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["repeats"] for r in rows] == [2, 1, 2]
    assert rows[0]["cuda"] == "CUDA_ERROR_ILLEGAL_ADDRESS" and rows[1]["signal"] == "SIGSEGV"


def test_resolve_ids(archive):
    names = [b.name for b in crashes.bundles()]
    assert crashes.resolve("latest").name == names[-1] == crashes.resolve("-1").name
    assert crashes.resolve("-3").name == names[0]
    assert crashes.resolve("20260509T11").name == names[1]
    assert crashes.resolve("bbbbbbbbbbbb").name == names[1]
    with pytest.raises(crashes.NotFound, match="matches 2"):
        crashes.resolve("aaaaaaaaaaaa")
    with pytest.raises(crashes.NotFound):
        crashes.resolve("nope")


def test_show_prints_meta_and_window(archive, capsys):
    assert crashes.main(["show", "latest"]) == 0
    out = capsys.readouterr().out
    assert "poisoned-context" in out and "700 CUDA_ERROR_ILLEGAL_ADDRESS" in out
    assert '"request_id": "r0"' in out and "last healthy r0" in out
    assert crashes.main(["show", "-1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["class"] == "poisoned-context"
    assert crashes.main(["show", "nope"]) == 1


def test_export_is_scrubbed_and_private(archive, tmp_path):
    out = tmp_path / "x.tar.gz"
    crashes.export(crashes.resolve("-2"), out)
    assert (out.stat().st_mode & 0o777) == 0o600
    with tarfile.open(out) as t:
        members = t.getmembers()
        assert sorted(m.name for m in members) == sorted(
            f"20260509T110000Z-crash-signal/{n}" for n in ("events.jsonl", "health.jsonl", "meta.json", "worker.log"))
        assert all(m.mode == 0o600 and m.uname == "ember" for m in members)
        log = t.extractfile("20260509T110000Z-crash-signal/worker.log").read().decode()
        meta = json.loads(t.extractfile("20260509T110000Z-crash-signal/meta.json").read())
    home = os.path.expanduser("~")
    assert home not in log and "~/models/x.gguf" in log
    assert "gpubox-7" not in log and meta["host"]["hostname"] == "<host>"
    assert "abcdefghijklmnop" not in log


def test_cli_entry_and_empty_archive(tmp_path):
    env = {**os.environ, "EMBER_STATE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "crashes", "list"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "no crashes archived" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ember.daemon.cli_main", "crashes", "show", "latest"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "empty" in r.stderr and "Traceback" not in r.stderr


def test_ops_imports_nothing_of_the_daemon_or_worker():
    code = "import sys, ember.ops.crashes; print('\\n'.join(sorted(sys.modules)))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in mods if m.startswith(("ember.daemon", "ember.worker", "ember.kernels"))]
