"""What a log line or an exit says about the worker: poisoned context, OOM, or nothing.

The ember worker logs `engine_poisoned` (a JSON line with the CUDA code and name; ember.ops.contract). A foreign engine
(llama.cpp's llama-server, a PyTorch server) prints the raw CUDA messages instead; the sticky ones
(the context is unusable afterwards, every later launch fails: the contract's STICKY_CUDA_ERRORS,
the same list the worker poisons on, less RAW_LOG_EXEMPT) are recognised by message, by enum name
and by code. JSON lines are judged only by their `event`, so a logged prompt or error text can never
trigger a restart.
"""

from __future__ import annotations

import re
from typing import Any

from ember.ops.contract import ERROR_LEVELS, RAW_LOG_EXEMPT, STICKY_CUDA_ERRORS, Event

# The runtime API's name and message of each sticky error the contract names (by its driver API name);
# None: the runtime's text is not known here, and such a line is found by its names and code alone.
_RUNTIME: dict[int, tuple[str, str | None]] = {
    214: ("cudaErrorECCUncorrectable", "uncorrectable ECC error encountered"),
    226: ("cudaErrorContained", None),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    702: ("cudaErrorLaunchTimeout", "the launch timed out and was terminated"),
    710: ("cudaErrorAssert", "device-side assert triggered"),
    714: ("cudaErrorHardwareStackError", "hardware stack error"),
    715: ("cudaErrorIllegalInstruction", "an illegal instruction was encountered"),
    716: ("cudaErrorMisalignedAddress", "misaligned address"),
    717: ("cudaErrorInvalidAddressSpace", "operation not supported on global/shared address space"),
    718: ("cudaErrorInvalidPc", "invalid program counter"),
    719: ("cudaErrorLaunchFailure", "unspecified launch failure"),
    721: ("cudaErrorTensorMemoryLeak", None),
    810: ("cudaErrorMpsClientTerminated", None),
    911: ("cudaErrorExternalDevice", None),
}
# code -> (driver API name, runtime API name, message): the sticky errors a raw log line is read for
STICKY: dict[int, tuple[str, str, str | None]] = {
    code: (name, *_RUNTIME[code]) for code, name in STICKY_CUDA_ERRORS.items() if code not in RAW_LOG_EXEMPT}
_BY_TEXT: list[tuple[re.Pattern[str], int]] = []
for _code, (_drv, _rt, _msg) in STICKY.items():
    if _msg is not None:
        _BY_TEXT.append((re.compile(re.escape(_msg), re.IGNORECASE), _code))
    _BY_TEXT.append((re.compile(r"\b" + re.escape(_drv) + r"\b"), _code))
    _BY_TEXT.append((re.compile(r"\b" + re.escape(_rt) + r"\b"), _code))
_CODES = "|".join(str(c) for c in STICKY)
# "CUDA error 700", "CUDA error: 700", "cuda error code 719", "CUDA_ERROR 716", "(error code 700)" on a CUDA line
_CODE_RE = re.compile(r"\bcuda[ _]?error(?:\s*code)?\s*[:=]?\s*\(?(" + _CODES + r")\b", re.IGNORECASE)
_CODE_CTX_RE = re.compile(r"\b(?:error|err|code|status)\s*[:=]?\s*\(?(" + _CODES + r")\b", re.IGNORECASE)

_OOM_RE = re.compile(
    r"\bMemoryError\b|out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|std::bad_alloc"
    r"|Cannot allocate memory|failed to allocate .* buffer", re.IGNORECASE)


def cuda_info(code: int) -> dict[str, Any]:
    drv, rt, msg = STICKY[code]
    info: dict[str, Any] = {"code": code, "name": drv, "runtime_name": rt}
    return info if msg is None else {**info, "message": msg}


def poison_in_text(text: str) -> dict[str, Any] | None:
    """A sticky CUDA error in a raw (non-JSON) log line: {'code', 'name', 'message', 'line'} or None."""
    if len(text) > 8192:
        text = text[:8192]
    code = None
    for pat, c in _BY_TEXT:
        if pat.search(text):
            code = c
            break
    if code is None:
        m = _CODE_RE.search(text)
        if m is None and "cuda" in text.lower():
            m = _CODE_CTX_RE.search(text)
        if m:
            code = int(m.group(1))
    if code is None:
        return None
    return {**cuda_info(code), "line": text.strip()[:2000]}


def poison_in_line(text: str, parsed: dict[str, Any] | None, signatures: tuple = ()) -> dict[str, Any] | None:
    """A line that means the engine can no longer serve: ember's `engine_poisoned`, a raw sticky CUDA
    error, or one of a foreign engine profile's `signatures` (daemon/engines.py; no CUDA code then)."""
    if parsed is not None:
        if parsed.get("event") == Event.ENGINE_POISONED:
            out = {k: parsed.get(k) for k in ("code", "name", "message", "step", "running")}
            return {k: v for k, v in out.items() if v is not None}
        return None
    found = poison_in_text(text)
    if found is None and signatures:
        from .engines import signature_in_text

        found = signature_in_text(text, signatures)
    return found


def oom_in_text(text: str, parsed: dict[str, Any] | None) -> bool:
    if parsed is not None:
        blob = " ".join(str(parsed.get(k, "")) for k in ("event", "error", "message", "name"))
        return bool(_OOM_RE.search(blob)) and parsed.get("level") in ERROR_LEVELS
    return bool(_OOM_RE.search(text[:8192]))


# crash classes of a bundle (meta.json "class"); which probe results lead to which: verdicts.py; what
# the exit and the log change about the class once the worker is gone: incident.classify()
# hang: no progress (the engine says it stalled, D state, no generation while nothing moves, or
#   never ready after start); unresponsive: alive, but liveness timed out for unresponsive_seconds
#   (an overload: not counted by the breaker); unhealthy: alive, but liveness refused or errored
POISONED, CRASH_SIGNAL, CRASH_EXIT, HANG, UNRESPONSIVE, UNHEALTHY, OOM = (
    "poisoned-context", "crash-signal", "crash-exit", "hang", "unresponsive", "unhealthy", "oom")
CLASSES = (POISONED, CRASH_SIGNAL, CRASH_EXIT, HANG, UNRESPONSIVE, UNHEALTHY, OOM)

_NORM = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"), (re.compile(r"\d+"), "N"), (re.compile(r"/[^\s:'\"]+"), "/PATH")]


def normalize(text: str) -> str:
    """A log line with the volatile parts (numbers, addresses, paths) taken out, for signatures."""
    for pat, rep in _NORM:
        text = pat.sub(rep, text)
    return " ".join(text.split())[:300]
