"""Named profiles of the inference servers people already run, for `engine = "..."` with `command`:
where each one answers liveness, readiness and a one-token probe, and the log lines that mean its
engine is gone although its process (and often its HTTP server) is still up.

Every engine also gets the raw CUDA checks of detect.py (the sticky errors by message, enum name and
code) and the daemon's exit handling: an exit nobody asked for restarts it, whatever its status (a
server that exits 0 after a fatal error is restarted like any crash). A profile's URLs are defaults:
`health_url`, `ready_url` and `completions_url` set in [daemon] win.

The signatures are the engines' own fatal-error names and messages, read from their source and issue
threads: vLLM's engine core dying behind an API server that keeps answering 200 (EngineDeadError),
SGLang's scheduler or detokenizer exceptions before it takes itself down, llama.cpp's failed CUDA
calls and asserts, and the forum's ds4 server's cuBLAS failure that precedes its illegal-access line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    """A log line that means the engine can no longer serve: `pattern` (a regex), and what it means."""

    name: str
    pattern: re.Pattern[str]
    message: str


@dataclass(frozen=True)
class EngineProfile:
    name: str
    health_path: str  # liveness: any answer from the HTTP server
    ready_path: str  # readiness: 200 once the model is loaded
    completions_path: str  # the one-token generation probe ("": the readiness URL generates itself)
    needs_model: bool  # the probe must name the served model (probe_model); without it, no generation probe
    signatures: tuple[Signature, ...]
    notes: str


def _sig(name: str, regex: str, message: str) -> Signature:
    return Signature(name, re.compile(regex), message)


PROFILES: dict[str, EngineProfile] = {
    "llama-server": EngineProfile(
        "llama-server", "/health", "/health", "/v1/completions", False,
        (_sig("ggml-cuda-failed", r"ggml_cuda_\w+: .*failed|CUDA error: (?!out of memory)",
              "a CUDA call of ggml's failed: the context is unusable"),
         _sig("ggml-assert", r"GGML_ASSERT\(", "ggml assert: the server aborts or is left inconsistent")),
        "/health answers 503 while the model loads and 200 once ready; any model name is accepted"),
    "vllm": EngineProfile(
        "vllm", "/health", "/v1/models", "/v1/completions", True,
        (_sig("vllm-engine-dead", r"\b(?:Async)?EngineDeadError\b",
              "vLLM's engine died; its API server may keep answering"),
         _sig("vllm-engine-core-died", r"Engine core proc \S+ died unexpectedly|EngineCore encountered a fatal error",
              "vLLM's engine core process died"),
         _sig("vllm-loop-died", r"Engine loop has died|Background loop has errored already",
              "vLLM's engine loop died")),
        "the API server keeps answering 200 after its engine died: the log decides; set probe_model to the "
        "served model name for the generation probe"),
    "sglang": EngineProfile(
        "sglang", "/health", "/health_generate", "", False,
        (_sig("sglang-scheduler-exception", r"Scheduler hit an exception|Detokenizer hit an exception",
              "SGLang's scheduler or detokenizer failed"),
         _sig("sglang-child-failed", r"Received sigquit from a child process|child process.*(?:failed|died)",
              "an SGLang child process failed; the server is going down")),
        "/health_generate runs a one-token generation itself"),
    "ds4": EngineProfile(
        "ds4", "/v1/models", "/v1/models", "/v1/completions", False,
        (_sig("ds4-cublas-failed", r"cuBLAS\b.*failed: status 14\b",
              "cuBLAS failed (status 14): the illegal access that follows poisons the context"),),
        "users watched it with GET /v1/models within 10 s; it overwrites its log at every start, so the daemon "
        "keeps the previous run's lines in its ring and crash bundle"),
}


def profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"engine: {name!r} is not a known profile (known: {', '.join(PROFILES)})") from None


def signature_in_text(text: str, signatures: tuple[Signature, ...]) -> dict | None:
    """An engine-specific fatal line: {'name', 'message', 'line'} (no CUDA code) or None."""
    for sig in signatures:
        if sig.pattern.search(text[:8192]):
            return {"name": sig.name, "message": sig.message, "line": text.strip()[:2000]}
    return None
