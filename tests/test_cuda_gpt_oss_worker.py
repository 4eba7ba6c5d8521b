"""A real worker serving the tiny synthetic gpt-oss on the CUDA backend (issue 39 item 2): the Harmony tests
the numpy backend passes, run as they are against `--backend cuda` -- the four APIs (completions, chat
completions, Responses, Anthropic messages) with forced tool calls in Harmony's commentary channel
(tests/test_moe_models.py), and streamed forced calls with reasoning asked for at three levels, an
Anthropic thinking budget among them (tests/test_harmony.py). Marked gpu; skips without a device.
"""

from __future__ import annotations

import httpx
import pytest
import test_harmony
import test_moe_models

from ember.worker.bench import synth

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_worker(start_worker, tmp_path_factory):
    try:
        from ember.kernels.cuda_runtime import try_device
    except ImportError as e:
        pytest.skip(f"no cuda-python: {e}")
    dev, why = try_device()
    if dev is None:
        pytest.skip(f"no CUDA device: {why}")
    path = synth.make_model("gpt-oss", "tiny", tmp_path_factory.mktemp("g") / "gpt-oss.gguf")
    w = start_worker("--backend", "cuda", "--max-seqs", "4", "--ctx", "2048", "--kv-mem", "64MiB", "--log-prompts",
                     model=path)
    stats = httpx.get(w.url + "/v1/stats", headers={"Authorization": f"Bearer {w.api_key}"}, timeout=30).json()
    assert stats["engine"]["backend"] == "cuda"
    return w


def test_four_apis_force_harmony_calls_on_cuda(cuda_worker, openai_factory):
    test_moe_models.test_four_apis_generate_and_force_a_call((cuda_worker, test_moe_models.FAMILIES["gpt-oss"]),
                                                             openai_factory)


def test_streamed_calls_and_reasoning_on_cuda(cuda_worker, openai_factory):
    test_harmony.test_streamed_forced_calls_on_chat_completions_and_messages(cuda_worker, openai_factory)
    assert cuda_worker.events("completed") and not cuda_worker.events("failed")
    assert not cuda_worker.events("engine_poisoned")
