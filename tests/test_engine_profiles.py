"""Named foreign-engine profiles (daemon/engines.py): the URLs each fills in, and the fatal lines each
one's log is watched for, on lines shaped as those engines print them. The daemon acting on one (kill,
archive, restart) runs in test_daemon_supervision.py with the stand-in engine."""

from __future__ import annotations

import pytest

from ember.daemon import settings as ds
from ember.daemon.detect import poison_in_line
from ember.daemon.engines import PROFILES, profile


def _settings(**kw) -> ds.Settings:
    s = ds.Settings(port=8123, **kw)
    ds.validate(s)
    return s


def test_a_profile_fills_in_the_urls_unless_set():
    s = _settings(command=["vllm", "serve", "m"], engine="vllm")
    assert (s.live_url, s.readiness_url) == ("http://127.0.0.1:8123/health", "http://127.0.0.1:8123/v1/models")
    assert s.generation_url == ""  # vLLM checks the model name: no probe without probe_model
    s = _settings(command=["vllm", "serve", "m"], engine="vllm", probe_model="m")
    assert s.generation_url == "http://127.0.0.1:8123/v1/completions"
    s = _settings(command=["ds4"], engine="ds4", health_url="http://127.0.0.1:9/v1/models")
    assert s.live_url == "http://127.0.0.1:9/v1/models" and s.readiness_url == "http://127.0.0.1:8123/v1/models"
    assert _settings(command=["python", "-m", "sglang.launch_server"], engine="sglang").generation_url == ""
    assert s.engine_label == "ds4" and _settings(command=["x"], health_url="http://h/").engine_label == "command"
    assert ds.Settings().engine_label == "ember"


def test_profile_mistakes_are_one_line_settings_errors():
    with pytest.raises(ds.SettingsError, match="not a known profile .*llama-server, vllm, sglang, ds4"):
        _settings(command=["x"], engine="tgi")
    with pytest.raises(ds.SettingsError, match="engine: vllm needs command"):
        _settings(engine="vllm")


# (profile, a line its engine prints when it can no longer serve, the signature it must be)
FATAL = [
    ("llama-server", "ggml_cuda_compute_forward: MUL_MAT failed", "ggml-cuda-failed"),
    ("llama-server", "/src/ggml/ggml.c:2345: GGML_ASSERT(ne00 == ne10) failed", "ggml-assert"),
    ("vllm", "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", "vllm-engine-dead"),
    ("vllm", "ERROR [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
     "vllm-engine-core-died"),
    ("vllm", "vllm.engine.async_llm_engine.AsyncEngineDeadError: Background loop has errored already.",
     "vllm-engine-dead"),
    ("sglang", "[2026-12-04 10:21:07 TP0] Scheduler hit an exception: Traceback (most recent call last):",
     "sglang-scheduler-exception"),
    ("sglang", "Received sigquit from a child process. It usually means the child failed.", "sglang-child-failed"),
    ("ds4", "cuBLAS sgemm failed: status 14 (CUBLAS_STATUS_INTERNAL_ERROR)", "ds4-cublas-failed"),
]


@pytest.mark.parametrize("engine,line,name", FATAL, ids=[f"{e}-{n}" for e, _, n in FATAL])
def test_each_profile_knows_its_engines_fatal_lines(engine, line, name):
    found = poison_in_line(line, None, profile(engine).signatures)
    assert found is not None and found["name"] == name and found["line"] == line
    assert poison_in_line(line, None) is None or engine == "llama-server"  # not without the profile


@pytest.mark.parametrize("engine", list(PROFILES))
def test_ordinary_lines_and_logged_text_are_not_fatal(engine):
    sigs = profile(engine).signatures
    for line in ("INFO:     127.0.0.1:51234 - \"POST /v1/completions HTTP/1.1\" 200 OK",
                 "srv  update_slots: all slots are idle", "CUDA error: out of memory",
                 "[2026-12-04 10:21:07] Prefill batch. #new-seq: 1, #new-token: 512"):
        found = poison_in_line(line, None, sigs)
        assert found is None, (engine, line, found)
    # a JSON line (ember's own log) is judged by its event alone: a prompt quoting an error is not one
    assert poison_in_line('{"event": "admit", "prompt": "EngineDeadError"}',
                          {"event": "admit", "prompt": "EngineDeadError"}, sigs) is None


def test_the_raw_cuda_checks_hold_for_every_profile():
    line = "CUDA error 700 at ggml-cuda.cu:2345: an illegal memory access was encountered"
    for p in PROFILES.values():
        found = poison_in_line(line, None, p.signatures)
        assert found is not None and found["code"] == 700
