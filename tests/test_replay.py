"""Agent session shapes against real worker processes (scaled down; `ember bench replay` runs the
issue's sizes): cached-token counts as predicted, outputs equal to a clean reference worker."""

from __future__ import annotations

from ember.worker.bench.replay import Shapes, run_replay


def test_session_shapes_replay(tmp_path):
    shapes = Shapes(base=180, turns=3, answer=8, suffixes=(60, 250), tiny_suffixes=(1, 3), kill_suffix=900)
    report = run_replay(shapes, tmp_path, ["--kv-mem", "64MiB"])
    bad = [c for c in report.checks if not c.ok]
    assert not bad, bad
    assert report.outcomes["failed"] == 0 and report.outcomes["completed"] >= len(report.checks)
    assert report.outcomes["canceled"] >= 1  # the client that gave up mid-prefill
    names = [c.name for c in report.checks]
    assert "after-kill-9" in names and "retry-after-abandon" in names
    restored = next(c for c in report.checks if c.name == "after-kill-9")
    assert restored.cached > 0  # came from disk: the new worker's memory was empty
