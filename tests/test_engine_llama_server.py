"""engine = "llama-server" for real: llama.cpp's own server (built by .ci/run from the llama-cpp-python
sdist's vendored llama.cpp, for the CPU) under the daemon and real supervisord, serving a tiny synthetic
model. The profile's URLs must fit what the server really answers (ready only once /health says so, the
one-token probe on /v1/completions), a SIGKILL must be archived naming the engine and restarted, and
requests must be answered again afterwards. The profiles' fatal lines are tested in
test_engine_profiles.py; the stand-in replaying other engines' behaviour in test_daemon_supervision.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_daemon_support import FAST, Ember, kill, to_toml


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from ember.worker.bench.synth import make_model

    path = tmp_path_factory.mktemp("llama-server") / "tiny-llama.gguf"
    make_model("llama", "tiny", path, seed=0)
    return path


def test_llama_server_is_supervised_archived_and_restarted(ember: Ember, tiny_model: Path, llama_server: Path):
    e = ember
    command = [str(llama_server), "-m", str(tiny_model), "--host", "127.0.0.1", "--port", str(e.port),
               "-c", "512", "-np", "1", "-t", "1"]
    e.config.write_text(to_toml({"worker": {"port": e.port},
                                 "daemon": {**FAST, "command": command, "engine": "llama-server",
                                            "startup_timeout": "60s"}}))
    r = e.start(timeout=90)
    assert r.returncode == 0, r.stderr
    st = e.status()
    assert st["state"] == "ready" and st["worker"]["engine"] == "llama-server"
    pid1 = st["worker"]["pid"]
    status, body = e.complete("hello", max_tokens=4)
    assert status == 200 and body["choices"][0]["text"] is not None  # llama.cpp's own answer, any model name

    kill(pid1, signal.SIGKILL)
    st = e.wait_ready(after_restarts=1, timeout=90)
    assert st["worker"]["pid"] != pid1 and st["worker"]["engine"] == "llama-server"
    [path] = e.bundles()
    m = e.bundle(path)["meta"]
    assert m["class"] == "crash-signal" and m["signal"] == "SIGKILL"
    assert m["worker"]["engine"] == "llama-server" and m["worker"]["pid"] == pid1
    assert m["detection"]["source"] == "exit"
    # the probes that judged it were the profile's: /health for liveness and readiness
    probes = [h for h in e.bundle(path)["health"] if h.get("url")]
    assert probes and all(h["url"].endswith(("/health", "/v1/completions")) for h in probes)
    assert e.complete("hello again", max_tokens=4)[0] == 200
