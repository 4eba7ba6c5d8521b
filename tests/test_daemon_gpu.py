"""The whole path on a real GPU: the daemon supervises the worker on the CUDA backend; a kernel really
writes out of bounds (--fault cuda-illegal-address); the daemon archives a poisoned-context bundle
with CUDA error 700 and restarts the worker, which comes back warm: the prompt's KV blocks reached the
host tier as soon as they were full, so the disk store has them although the context died, and the new
worker finds them (restoring them, or computing them again where it measured that faster).

Marked gpu: skipped where no CUDA device exists (CI). The model is the shape-faithful synthetic Gemma 3
270M, generated here by the project's generator.
"""

from __future__ import annotations

import json

import pytest
from test_daemon_support import Ember

pytestmark = pytest.mark.gpu

PROMPT = "The history of the printing press begins with movable type. " * 40


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    try:
        from ember.kernels.cuda_runtime import try_device
    except ImportError as e:
        pytest.skip(f"no cuda-python: {e}")
    dev, why = try_device()
    if dev is None:
        pytest.skip(f"no CUDA device: {why}")
    from ember.worker.bench.synth import make_model

    path = tmp_path_factory.mktemp("gpu-model") / "gemma3-270m.gguf"
    make_model("gemma3", "gemma3-270m", path, seed=3)
    return path


def test_illegal_address_on_the_gpu_gives_a_bundle_and_a_warm_restart(ember: Ember, gpu_model):
    e = ember
    # the fault fires at the 12th engine step of every worker process: the first request's prefill and
    # a few decode steps run first; after the restart the warm request needs far fewer steps than that
    e.configure(worker={"model": str(gpu_model), "backend": "cuda", "kv_mem": "1GiB", "drain_seconds": 2,
                        "max_seqs": 2, "prefill_chunk": 256},
                worker_args=["--fault", "cuda-illegal-address:step=12"], ready_interval="30s", ready_timeout="10s",
                live_interval="0.5s", live_timeout="2s", startup_timeout="120s", backoff_base="0.5s",
                poison_grace="5s")
    assert e.start(timeout=120).returncode == 0
    pid = e.status()["worker"]["pid"]
    status, _ = e.complete(PROMPT, timeout=120, max_tokens=64)
    assert status >= 500  # the request in flight when the context died fails, loudly
    st = e.wait_ready(after_restarts=1, timeout=120)
    assert st["worker"]["pid"] != pid and st["last_crash"]["class"] == "poisoned-context"
    [path] = e.bundles()
    e.check_private(path)
    m = e.bundle(path)["meta"]
    assert m["exit_code"] == 75 and m["cuda_error"]["code"] == 700, m
    status, body = e.complete(PROMPT, timeout=120, max_tokens=3)
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the new worker found the blocks on disk; it restores them or, where it measured computing them
    # faster (a 270M model on an H200 prefills ~1k tokens in milliseconds), computes them again
    [choice] = [json.loads(ln) for ln in (e.state / "logs" / "worker.log").read_text().splitlines()
                if '"kv_restore_choice"' in ln][-1:]
    print(f"\nwarm restart: {choice['blocks']} blocks of {prompt_tokens} prompt tokens found on disk, "
          f"{choice['choice']} ({choice['restore_seconds']} s vs {choice['compute_seconds']} s), {cached} cached")
    assert choice["blocks"] * 16 >= prompt_tokens // 2
    if choice["choice"] == "restore":
        assert cached >= prompt_tokens // 2
    else:
        assert choice["compute_seconds"] < choice["restore_seconds"]
