"""Persistence of the KV cache rides out what the disk does (issue 38 item 2), in a real worker: a full
disk (a small tmpfs where this machine lets the test mount one, and always the `disk-full` fault's stand-in,
which fails the writer's file writes with ENOSPC half-way), a KV directory deleted while serving, and a
directory standing at a block's path. Each time the engine serves on, the state shows in the health bodies,
/v1/stats and /metrics, and writing resumes once the disk can take it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ARGS = ("--ctx", "1024", "--kv-mem", "64MiB", "--max-seqs", "2", "--kv-disk-budget", "1GiB")
# distinct prompts of several full 16-token blocks each
PROMPTS = [f"Chapter {i}. " + "The lighthouse keeper counted the candles, checked the lamp and wound the clock "
           f"while the storm number {i} lasted for days. " * 3 for i in range(6)]


def _complete(w, prompt: str) -> httpx.Response:
    return httpx.post(f"{w.url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0}, headers=w.headers(), timeout=120)


def kv_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if "quarantine" not in p.parts and p.is_file())


def tmp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last}")


def _persistence(w) -> dict:
    return httpx.get(f"{w.url}/health/ready", timeout=5).json()["kv_persistence"]


def _wait_written(w, before: int, timeout: float = 60) -> int:
    """Until the worker has written more block files than `before` (its writes counter)."""
    return int(_wait(lambda: (n := w.metric_values().get("ember_kv_writes_total", 0)) > before and n, timeout,
                     "blocks written"))


def _assert_degraded_everywhere(w, reason: str) -> dict:
    kv = _wait(lambda: (k := _persistence(w))["state"] == "degraded" and k, 30, "degraded persistence")
    assert reason in kv["reason"] and kv["since"] and kv["not_persisted"] > 0, kv
    ready = httpx.get(f"{w.url}/health/ready", timeout=5)
    assert ready.status_code == 200  # it serves on: the state is news, not a reason to take it out
    stats = httpx.get(f"{w.url}/v1/stats", headers=w.headers(), timeout=5).json()
    assert stats["kv_persistence"]["state"] == "degraded" and reason in stats["kv_persistence"]["reason"]
    m = w.metric_values()
    assert m["ember_kv_persistence_degraded"] == 1.0 and m["ember_kv_not_persisted_total"] > 0
    [line] = w.events("kv_persistence", state="degraded")  # said once, however many retries fail alike
    assert reason in line["reason"] and line["level"] == "warning"
    return kv


def _recovers(w, kv_dir: Path) -> None:
    _wait(lambda: _persistence(w)["state"] == "persisting", 45, "persisting again")
    back = w.wait_event("kv_persistence", state="persisting", timeout=5)
    assert back["not_persisted_then"] > 0 and back["degraded_seconds"] > 0
    assert w.metric_values()["ember_kv_persistence_degraded"] == 0.0
    before_files = len(kv_files(kv_dir))
    writes = w.metric_values()["ember_kv_writes_total"]
    assert _complete(w, PROMPTS[5]).status_code == 200
    _wait_written(w, writes)
    assert len(kv_files(kv_dir)) > before_files  # new blocks reach the disk again


# -- a full disk ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 6 MiB tmpfs (room for a handful of blocks), where this machine lets the test mount one."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(d)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "test_a_full_disk_stand_in_degrades_and_recovers covers the fault")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(d: Path) -> Path:
    """Write a file until the file system is full (as `dd if=/dev/zero` does)."""
    filler = d / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # ENOSPC ends it
            while True:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)
    assert shutil.disk_usage(d).free < 65536
    return filler


def test_a_full_tmpfs_degrades_persistence_and_it_recovers_once_freed(start_worker, small_tmpfs):
    kv_dir = small_tmpfs / "kv"
    w = start_worker(*ARGS, "--kv-dir", str(kv_dir))
    try:
        assert _complete(w, PROMPTS[0]).status_code == 200
        _wait_written(w, 0)
        filler = _fill(small_tmpfs)
        assert _complete(w, PROMPTS[1]).status_code == 200  # served, its blocks not persisted
        kv = _assert_degraded_everywhere(w, "disk full")
        assert kv["errno"] == "ENOSPC"
        assert tmp_files(kv_dir) == []  # the partial temp files went at once
        filler.unlink()
        _recovers(w, kv_dir)
        assert tmp_files(kv_dir) == []
    finally:
        w.stop()


def test_a_full_disk_stand_in_degrades_and_recovers(start_worker, tmp_path):
    """The same fault where no tmpfs can be mounted: --fault disk-full fails every KV file write with
    ENOSPC half-way while a flag file exists."""
    kv_dir, flag = tmp_path / "kv", tmp_path / "disk-is-full"
    w = start_worker(*ARGS, "--kv-dir", str(kv_dir), "--fault", f"disk-full:while={flag}")
    try:
        assert _complete(w, PROMPTS[0]).status_code == 200
        _wait_written(w, 0)
        files = len(kv_files(kv_dir))
        flag.touch()
        assert _complete(w, PROMPTS[1]).status_code == 200
        kv = _assert_degraded_everywhere(w, "disk full")
        assert kv["errno"] == "ENOSPC" and len(kv_files(kv_dir)) == files
        assert tmp_files(kv_dir) == []  # each failed write's half-written temp file is gone
        time.sleep(2.5)  # a few retries fail alike: still one log line (checked above, and again below)
        assert len(w.events("kv_persistence", state="degraded")) == 1
        flag.unlink()
        _recovers(w, kv_dir)
    finally:
        w.stop()


# -- the KV directory deleted while serving ----------------------------------------------------------------------


def test_a_kv_dir_deleted_while_serving_is_made_again_and_written(start_worker, tmp_path):
    kv_dir = tmp_path / "kv"
    w = start_worker(*ARGS, "--kv-dir", str(kv_dir))
    try:
        assert _complete(w, PROMPTS[0]).status_code == 200
        writes = _wait_written(w, 0)
        assert w.metric_values()["ember_kv_disk_bytes"] > 0
        shutil.rmtree(kv_dir)  # rm -rf while serving
        w.wait_event("kv_dir_recreated", timeout=10)  # the idle writer notices, without traffic
        assert kv_dir.is_dir()
        m = w.metric_values()
        assert m["ember_kv_disk_bytes"] == 0.0 and m["ember_kv_disk_blocks"] == 0.0  # not the deleted bytes
        assert _complete(w, PROMPTS[1]).status_code == 200  # a new conversation's blocks land in the new dir
        _wait_written(w, writes)
        assert kv_files(kv_dir) and w.metric_values()["ember_kv_disk_bytes"] > 0
        assert _persistence(w)["state"] == "persisting" and not w.events("kv_persistence", state="degraded")
    finally:
        w.stop()


# -- something else at a block's path -----------------------------------------------------------------------------


def test_a_directory_at_a_blocks_path_is_quarantined_not_fatal(start_worker, tmp_path):
    """A directory standing where a block file belongs: at start (the scan) and while serving (the
    writer) it goes to quarantine with a reason, and persistence stays on (it used to turn off at every
    start)."""
    kv_dir = tmp_path / "kv"
    w = start_worker(*ARGS, "--kv-dir", str(kv_dir))
    try:
        assert _complete(w, PROMPTS[0]).status_code == 200
        _wait_written(w, 0)
    finally:
        w.stop()
    first, *rest = kv_files(kv_dir)
    assert rest
    for p in (first, *rest):
        p.unlink()
    first.mkdir()
    (first / "something").write_text("not a block")  # a non-empty directory at a block's path
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover = first.parent / f".{rest[1].name}.{gone.pid}.1.tmp"  # a killed writer's partial file
    leftover.write_bytes(b"half a block")
    w = start_worker(*ARGS, "--kv-dir", str(kv_dir))
    try:
        q = w.wait_event("kv_quarantined", timeout=30)
        assert not leftover.exists()  # its writer is gone: removed at start, whatever its age
        assert q["file"] == first.name and "not a regular file" in q["reason"]
        rest[0].mkdir()  # after the scan: the writer meets this one
        assert _complete(w, PROMPTS[0]).status_code == 200
        _wait(lambda: len(w.events("kv_quarantined")) == 2, 30, "the writer's quarantine")
        _wait(lambda: first.is_file() and rest[0].is_file(), 30, "the blocks written in their places")
        assert _persistence(w)["state"] == "persisting"
        assert not w.events("kv_persistence")  # no change of state at all
        quarantined = list((kv_dir / "quarantine").iterdir())
        assert any(p.name.endswith(first.name) and p.is_dir() for p in quarantined)
    finally:
        w.stop()
