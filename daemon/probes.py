"""Health probes over HTTP with a hard deadline each (connect, send and every read share one budget).

- liveness: GET /health/live (or a foreign engine's health URL) within live_timeout, plus the
  process itself: alive, not a zombie, not stopped, not stuck in uninterruptible sleep (D state).
- readiness: GET /health/ready, then a real one-token generation (POST /v1/completions); a 429
  answer to the generation (queue full) is marked `busy`: the worker answers, it is just full.
Each probe returns a ProbeResult (its record() also goes into the crash bundle's health.jsonl). What
a result means for the worker (how long to wait, which class of incident) is verdicts.py's business.
"""

from __future__ import annotations

import enum
import http.client
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psutil

from ember.ops.contract import PROBE_HEADER, HealthState, iso_utc

ZOMBIE_RECHECK = 0.5  # seconds a zombie gets to be reaped before it counts as one


class ProbeTimeout(Exception):
    pass


def http_call(method: str, url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
              timeout: float = 5.0, max_body: int = 1 << 20) -> tuple[int, bytes]:
    """(status, body) or raises OSError/ProbeTimeout; never takes longer than about `timeout`."""
    deadline = time.monotonic() + timeout
    u = urlsplit(url)
    if u.scheme not in ("http", ""):
        raise OSError(f"unsupported URL scheme {u.scheme!r}")

    def left() -> float:
        r = deadline - time.monotonic()
        if r <= 0:
            raise ProbeTimeout(f"no answer within {timeout:g}s")
        return r

    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=left())
    try:
        conn.connect()
        conn.sock.settimeout(left())
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn.request(method, path, body=body, headers=headers or {})
        sock = conn.sock  # getresponse() may hand the socket over to the response
        sock.settimeout(left())
        resp = conn.getresponse()
        chunks, n = [], 0
        while n < max_body:
            sock.settimeout(left())
            c = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
            if not c:
                break
            chunks.append(c)
            n += len(c)
        return resp.status, b"".join(chunks)
    except TimeoutError:  # socket.timeout
        raise ProbeTimeout(f"no answer within {timeout:g}s") from None
    finally:
        conn.close()


class Probe(enum.StrEnum):
    LIVE = "live"
    READY = "ready"
    STARTUP = "startup"  # the readiness probe while the worker starts


@dataclass
class ProbeResult:
    """One probe's result; record() is what health.jsonl and `ember status` keep of it."""

    probe: str  # a Probe, or the scheduler's job name for a run it skipped or missed
    ts: str = field(default_factory=iso_utc)
    url: str | None = None
    ok: bool | None = None  # None: no verdict (the probe did not run)
    status: int | None = None  # the HTTP status, when the endpoint answered at all
    state: str | None = None  # the health body's `state` (a HealthState, for ember)
    error: str | dict[str, Any] | None = None  # a dict: the engine's own error object (CUDA, thread_died)
    timeout: bool | None = None
    refused: bool | None = None
    busy: bool | None = None  # the one-token generation got 429: answering, just full
    generation_status: int | None = None
    stalled: bool | None = None  # the engine's own words, from the liveness body
    steps: int | None = None
    running: int | None = None
    waiting: int | None = None
    last_progress_seconds: float | None = None
    kv_persistence: dict[str, Any] | None = None  # the health body's: do the worker's KV blocks reach the disk?
    process: str | None = None  # psutil's status of the worker process
    cpu: float | None = None  # its user + system CPU seconds so far
    ms: float | None = None
    pid: int | None = None
    incarnation: int | None = None

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ProcessCheck:
    ok: bool  # alive and not a zombie
    status: str | None = None  # psutil's status (running, sleeping, disk-sleep, zombie...)
    cpu: float | None = None  # user + system CPU seconds so far: was a silent worker busy or idle?
    error: str | None = None


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def process_check(pid: int | None) -> ProcessCheck:
    """The worker process, as psutil sees it."""
    if not pid:
        return ProcessCheck(False, error="no process")
    try:
        p = psutil.Process(pid)
        st = p.status()
    except psutil.NoSuchProcess:
        return ProcessCheck(False, error="process gone")
    except psutil.Error as e:
        return ProcessCheck(True, status="unknown", error=str(e))
    if st == psutil.STATUS_ZOMBIE:
        # an exit supervisord has not reaped yet passes in a moment; a zombie that stays is a process
        # whose main thread is gone while others run on (the liveness rule kills it)
        time.sleep(ZOMBIE_RECHECK)
        try:
            st = p.status()
        except psutil.NoSuchProcess:
            return ProcessCheck(False, error="process gone")
        except psutil.Error as e:
            return ProcessCheck(True, status="unknown", error=str(e))
        if st == psutil.STATUS_ZOMBIE:
            return ProcessCheck(False, status=st, error="zombie")
    try:
        t = p.cpu_times()
        return ProcessCheck(True, status=st, cpu=round(t.user + t.system, 2))
    except psutil.Error:
        return ProcessCheck(True, status=st)


# a health body's fields the liveness rule reads (verdicts.py), copied into the result as they are
_LIVE_BODY_FIELDS = ("stalled", "steps", "running", "waiting", "last_progress_seconds", "error", "kv_persistence")
_NOT_SERVING = (HealthState.LOADING, HealthState.DRAINING)


def live_probe(url: str, timeout: float) -> ProbeResult:
    rec = ProbeResult(Probe.LIVE, url=url)
    t0 = time.monotonic()
    try:
        status, body = http_call("GET", url, timeout=timeout)
        obj = _json(body)
        rec.status = status
        if obj is not None:
            rec.state = obj.get("state", obj.get("status"))
            for k in _LIVE_BODY_FIELDS:
                if k in obj:
                    setattr(rec, k, obj[k])
        rec.ok = status < 500 and rec.state != HealthState.POISONED
        if status == 503 and rec.state in _NOT_SERVING and not rec.stalled:
            rec.ok = True  # alive, just not serving (llama-server answers 503 while loading)
        if not rec.ok:
            rec.error = rec.error or f"HTTP {status}"
    except Exception as e:
        _failed(rec, e)
    rec.ms = round((time.monotonic() - t0) * 1000, 1)
    return rec


def _failed(rec: ProbeResult, e: Exception, during: str = "") -> None:
    """A probe that raised, as every probe records it: no answer in time (`timeout`, `during` saying
    which part), refused or reset (`refused` for a refusal), or a malformed answer
    (http.client.HTTPException and friends)."""
    rec.ok = False
    if isinstance(e, ProbeTimeout):
        rec.timeout, rec.error = True, f"{e}{during}"
    elif isinstance(e, OSError):
        rec.error, rec.refused = f"{type(e).__name__}: {e}", isinstance(e, ConnectionRefusedError)
    else:
        rec.error = f"bad answer: {type(e).__name__}: {e}"


def _generation(model: str | None) -> bytes:
    return json.dumps({"model": model or "x", "prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()


def ready_probe(ready_url: str, gen_url: str, timeout: float, api_key: str | None,
                generate: bool = True, model: str | None = None) -> ProbeResult:
    """GET the readiness URL; when it says ready, a one-token generation. `ok` = both passed."""
    rec = ProbeResult(Probe.READY, url=ready_url)
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        status, body = http_call("GET", ready_url, timeout=timeout)
        obj = _json(body) or {}
        rec.status = status
        rec.state = obj.get("state", obj.get("status"))
        if isinstance(obj.get("kv_persistence"), dict):
            rec.kv_persistence = obj["kv_persistence"]
        if status != 200:
            rec.ok, rec.error = False, f"not ready: HTTP {status}" + (f" ({rec.state})" if rec.state else "")
        elif generate and gen_url:
            headers = {"Content-Type": "application/json", PROBE_HEADER: "1"}
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeTimeout(f"no answer within {timeout:g}s")
            gs, gb = http_call("POST", gen_url, body=_generation(model), headers=headers, timeout=left)
            rec.generation_status = gs
            go = _json(gb)
            if gs == 200 and go is not None and go.get("choices"):
                rec.ok = True
            elif gs == 429:  # the queue is full: answering, just busy
                rec.ok, rec.busy = False, True
                rec.error = "busy: the generation was refused with HTTP 429 (queue full)"
            else:
                err = (go or {}).get("error")
                msg = err.get("message") if isinstance(err, dict) else err
                rec.ok = False
                rec.error = f"generation failed: HTTP {gs}" + (f": {str(msg)[:200]}" if msg else "")
        else:
            rec.ok = True
    except Exception as e:
        _failed(rec, e, " (one-token generation)" if rec.status == 200 else "")
    rec.ms = round((time.monotonic() - t0) * 1000, 1)
    return rec
