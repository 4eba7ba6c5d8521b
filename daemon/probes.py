"""Health probes over HTTP with a hard deadline each (connect, send and every read share one budget).

- liveness: GET /health/live (or a foreign engine's health URL) within live_timeout, plus the
  process itself: alive, not a zombie, not stuck in uninterruptible sleep (D state).
- readiness: GET /health/ready, then a real one-token generation (POST /v1/completions); a 429
  answer to the generation (queue full) is marked `busy`: the worker answers, it is just full.
Each probe returns a record (also written to the crash bundle's health.jsonl). What a record means
for the worker (how long to wait, which class of incident) is verdicts.py's business.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import psutil


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
    except socket.timeout:
        raise ProbeTimeout(f"no answer within {timeout:g}s") from None
    finally:
        conn.close()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def process_check(pid: int | None) -> dict[str, Any]:
    """{'ok', 'status', 'cpu', 'error'} for the worker process (psutil); `cpu` is its user+system
    seconds so far (evidence in health.jsonl of whether a silent worker was busy or idle)."""
    if not pid:
        return {"ok": False, "error": "no process"}
    try:
        p = psutil.Process(pid)
        st = p.status()
    except psutil.NoSuchProcess:
        return {"ok": False, "error": "process gone"}
    except psutil.Error as e:
        return {"ok": True, "status": "unknown", "error": str(e)}
    if st == psutil.STATUS_ZOMBIE:
        return {"ok": False, "status": st, "error": "zombie"}
    out: dict[str, Any] = {"ok": True, "status": st}
    try:
        t = p.cpu_times()
        out["cpu"] = round(t.user + t.system, 2)
    except psutil.Error:
        pass
    return out


def live_probe(url: str, timeout: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"ts": _now(), "probe": "live", "url": url}
    t0 = time.monotonic()
    try:
        status, body = http_call("GET", url, timeout=timeout)
        obj = _json(body)
        rec["status"] = status
        if obj is not None:
            rec["state"] = obj.get("state", obj.get("status"))
            for k in ("stalled", "steps", "running", "waiting", "last_progress_seconds", "error"):
                if k in obj:
                    rec[k] = obj[k]
        rec["ok"] = status < 500 and rec.get("state") != "poisoned"
        if status == 503 and rec.get("state") in ("loading", "draining") and not rec.get("stalled"):
            rec["ok"] = True  # alive, just not serving (llama-server answers 503 while loading)
        if not rec["ok"]:
            rec["error"] = rec.get("error") or f"HTTP {status}"
    except ProbeTimeout as e:
        rec.update(ok=False, error=str(e), timeout=True)
    except OSError as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", refused=isinstance(e, ConnectionRefusedError))
    except Exception as e:  # a malformed answer (http.client.HTTPException and friends) is a failed probe
        rec.update(ok=False, error=f"bad answer: {type(e).__name__}: {e}")
    rec["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return rec


def ready_probe(ready_url: str, gen_url: str, timeout: float, api_key: str | None,
                generate: bool = True) -> dict[str, Any]:
    """GET the readiness URL; when it says ready, a one-token generation. `ok` = both passed."""
    rec: dict[str, Any] = {"ts": _now(), "probe": "ready", "url": ready_url}
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        status, body = http_call("GET", ready_url, timeout=timeout)
        obj = _json(body) or {}
        rec["status"] = status
        rec["state"] = obj.get("state", obj.get("status"))
        if status != 200:
            rec.update(ok=False, error=f"not ready: HTTP {status}" + (f" ({rec['state']})" if rec["state"] else ""))
        elif generate and gen_url:
            headers = {"Content-Type": "application/json", "X-Ember-Probe": "1"}
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            body = json.dumps({"model": "x", "prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeTimeout(f"no answer within {timeout:g}s")
            gs, gb = http_call("POST", gen_url, body=body, headers=headers, timeout=left)
            rec["generation_status"] = gs
            go = _json(gb)
            if gs == 200 and go is not None and go.get("choices"):
                rec["ok"] = True
            elif gs == 429:  # the queue is full: answering, just busy
                rec.update(ok=False, busy=True, error="busy: the generation was refused with HTTP 429 (queue full)")
            else:
                err = (go or {}).get("error")
                msg = err.get("message") if isinstance(err, dict) else err
                rec.update(ok=False, error=f"generation failed: HTTP {gs}" + (f": {str(msg)[:200]}" if msg else ""))
        else:
            rec["ok"] = True
    except ProbeTimeout:
        rec.update(ok=False, error=f"no answer within {timeout:g}s"
                   + (" (one-token generation)" if rec.get("status") == 200 else ""), timeout=True)
    except OSError as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", refused=isinstance(e, ConnectionRefusedError))
    except Exception as e:  # a malformed answer (http.client.HTTPException and friends) is a failed probe
        rec.update(ok=False, error=f"bad answer: {type(e).__name__}: {e}")
    rec["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return rec
