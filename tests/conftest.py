"""Shared fixtures. Tests run real components against the embedded model (assembled once)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ember.worker.bench.workerproc import WorkerProcess


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    override = os.environ.get("EMBER_TEST_MODEL")
    if override:
        return Path(override)
    from ember.worker.model.embedded import default_model_path as embedded

    return embedded(quiet=True)


@pytest.fixture(scope="module")
def dev():
    """The CUDA device the GPU tests run on; they skip, saying why, where there is none."""
    try:
        from ember.kernels.cuda_runtime import try_device
    except ImportError as e:
        pytest.skip(f"no cuda-python: {e}")
    d, why = try_device()
    if d is None:
        pytest.skip(f"no CUDA device: {why}")
    return d


@pytest.fixture
def rng():
    """A generator seeded at random for each test (the GPU kernels' tests draw their inputs from it); the seed
    is printed, so a failure's draw can be repeated."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


# -- a real worker process over HTTP (ember.worker.bench.workerproc, the bench's own launcher) ------------------

API_KEY = "test-key"


def hermetic_env(workdir: Path) -> dict[str, str]:
    """The test's environment without the developer's EMBER_* settings, and a KV store of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env["EMBER_KV_DIR"] = str(workdir / "kv")  # never the user's KV store
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="session")
def start_worker(request, tmp_path_factory):
    """Start a worker with extra flags and wait until it is ready; `model` replaces the default
    model (the embedded one is assembled only when a test asks for it, so a machine without its
    package runs the tests that bring their own). Each runs in a fresh directory (its log is
    `worker.log` there) and is stopped at the end of the session unless a test or fixture stops it sooner."""
    started: list[WorkerProcess] = []

    def start(*args: str, api_key: str | None = API_KEY, model: Path | None = None) -> WorkerProcess:
        workdir = tmp_path_factory.mktemp("worker")
        path = model or request.getfixturevalue("default_model_path")
        w = WorkerProcess("--model", str(path), *args, log_path=workdir / "worker.log",
                          env=hermetic_env(workdir), cwd=workdir, api_key=api_key, own_session=False)
        started.append(w)
        return w.start()

    yield start
    for w in started:
        w.stop(timeout=10)


@pytest.fixture
def ember(tmp_path):
    """The real CLI, daemon and supervisord against a private state dir (tests/test_daemon_support.py's `Ember`);
    fails the test if any process it started outlives `ember stop`."""
    from test_daemon_support import Ember

    e = Ember(tmp_path)
    yield e
    left = e.stop_and_check()
    assert not left, f"processes left behind after ember stop: {left}"


@pytest.fixture
def worker_env(tmp_path) -> dict[str, str]:
    """The hermetic environment for a worker that a test runs itself (one that must fail to start)."""
    return hermetic_env(tmp_path)


@pytest.fixture(scope="session")
def api_worker(start_worker) -> WorkerProcess:
    """The shared worker of the API tests: small context and KV budget, four sequences."""
    return start_worker("--max-seqs", "4", "--max-queue", "16", "--ctx", "1024", "--kv-mem", "96MiB",
                        "--prefill-chunk", "64", "--drain-seconds", "5")


@pytest.fixture(scope="session")
def openai_client(api_worker):
    import openai

    return openai.OpenAI(base_url=api_worker.url + "/v1", api_key=api_worker.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(api_worker):
    import anthropic

    return anthropic.Anthropic(base_url=api_worker.url, api_key=api_worker.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def openai_factory():
    """An official openai client for any WorkerProcess."""
    import openai

    return lambda w: openai.OpenAI(base_url=w.url + "/v1", api_key=w.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def hardened_worker(start_worker) -> WorkerProcess:
    """The worker the adversarial suites attack (tests/test_api_hardening.py, test_api_fuzz.py): a
    key, the metrics behind it, one allowed web origin, a two-token output cap so that generated
    requests stay quick, and the default bounds otherwise."""
    return start_worker("--max-seqs", "4", "--max-queue", "64", "--ctx", "2048", "--kv-mem", "160MiB",
                        "--prefill-chunk", "128", "--max-output-tokens", "2", "--metrics-auth",
                        "--allowed-origins", "https://ok.example")


KERNEL_BUILD_WAIT = 45 * 60  # seconds: .ci/run's background kernel build, at the lowest priority beside the suite


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    """The session's cubin cache, shared by the tests that compile the kernels without a GPU. .ci/run
    builds what they check in the background (tests/kernel_builds.py, into build/kernel-cache, a
    `kernel-cache.building` file with its pid beside it until done); a test reading it waits for that build and then
    finds its cubins cached (a module the build did not make, it compiles itself, reporting the compiler's
    error where there is one). Without that build: a fresh folder of this session."""
    import time

    from kernel_builds import PREBUILT, building_pid

    if not PREBUILT.is_dir():
        return tmp_path_factory.getbasetemp() / "kernel-cache"
    deadline = time.monotonic() + KERNEL_BUILD_WAIT
    while building_pid() is not None and time.monotonic() < deadline:
        time.sleep(2)
    if building_pid() is not None:
        pytest.fail(f"the background kernel build was still running after {KERNEL_BUILD_WAIT} s")
    return PREBUILT


def pytest_collection_modifyitems(config, items):
    """The tests that read the background kernel build run last: the build then has the whole suite's idle
    core before anything waits for it."""
    items.sort(key=lambda item: "kernel_cache" in getattr(item, "fixturenames", ()))  # stable: order kept within


LLAMA_CPP_BUILD = Path(__file__).resolve().parents[1] / "build" / "llama.cpp"
LLAMA_SERVER_WAIT = 40 * 60  # seconds: .ci/run's background build takes about 10 minutes beside the tests


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """llama.cpp's llama-server ($EMBER_LLAMA_SERVER, or what .ci/run builds into build/llama.cpp/bin).
    .ci/run builds it in the background while the suite runs (a `building` file beside it until done,
    `failed` with the log's end if the build failed): a test that needs it waits for the build, fails
    when it failed, and skips only where nothing builds it."""
    import time

    path = Path(os.environ.get("EMBER_LLAMA_SERVER") or LLAMA_CPP_BUILD / "bin" / "llama-server")
    deadline = time.monotonic() + LLAMA_SERVER_WAIT
    while (LLAMA_CPP_BUILD / "building").exists() and time.monotonic() < deadline:
        time.sleep(2)
    if path.is_file():
        return path
    failed = LLAMA_CPP_BUILD / "failed"
    if failed.exists():
        pytest.fail(f"the llama-server build failed:\n{failed.read_text()[-2000:]}")
    if (LLAMA_CPP_BUILD / "building").exists():
        pytest.fail(f"the llama-server build was still running after {LLAMA_SERVER_WAIT} s")
    pytest.skip(f"no llama-server at {path} (.ci/run builds it; or set EMBER_LLAMA_SERVER)")
