"""A stand-in engine for the daemon tests (a script, not a test module: it has no tests).

It speaks the worker contract (docs/architecture.md, "The contracts") with the standard library
only, so it starts in a fraction of a second: /health/live, /health/ready, POST /v1/completions,
JSON log lines on stderr (config, ready, admit, completed, engine_poisoned, exit), SIGTERM drains
and exits 0. With --raw it plays a foreign engine instead (llama-server style plain-text log, GET
/health).

Faults (--fault KIND[:key=value...]); `requests=N` fires on the N-th completion (the daemon's
"ping" probes are counted apart, as probe-N) (that request is in
flight when it fires), `after=S` fires S seconds after ready; --once FILE fires only if FILE does
not exist yet (and creates it), so the restarted engine is healthy:
  poison    log engine_poisoned (CUDA 700), live/ready 503 poisoned, exit 75 after 0.5 s
  illegal   print "CUDA error 700 ...: an illegal memory access was encountered" and keep serving
  engine-dead  print vLLM's EngineDeadError lines and keep serving 200 (its API server outliving the engine)
  hang      the completion never answers; with stall=S, /health/live turns 503 (stalled) S s later
  exit      exit with code=N (default 1)
  segv      kill itself with SIGSEGV
  oom       print a MemoryError traceback and exit 1
  config    log config_error and exit 78 at once
  zombie    the main thread exits (pthread_exit) while the server's threads serve on: the process is a
            zombie (state Z) that answers its probes and never exits
  freeze    every completion (not the daemon's probes) holds the server's one "event loop" for
            secs=S (default 2) seconds, as a CPU-bound request on an asyncio loop does: /health/live,
            /health/ready and everything else wait behind it; the process lives, and serves again after
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()


class _Loop:
    """The "event loop" that the freeze fault holds: requests take it in arrival order, as an event
    loop serves what queued while it was busy (a plain Lock lets a newer request jump the queue and
    starve the probes that waited through a freeze)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


LOOP = _Loop()  # taken only with the freeze fault
STATE = {"state": "loading", "steps": 0, "requests": 0, "stalled_at": None, "last_progress": time.monotonic()}
ARGS = None
FAULT: dict = {}


def log(event: str, level: str = "info", **fields) -> None:
    if ARGS.raw:
        msg = " ".join(f"{k}={v}" for k, v in fields.items())
        line = f"srv  {event}: {msg}"
    else:
        rec = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "level": level, "event": event}
        rec.update(fields)
        line = json.dumps(rec)
    with LOCK:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def raw(text: str) -> None:
    with LOCK:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def fault_armed() -> bool:
    if not FAULT:
        return False
    once = ARGS.once
    return not (once and os.path.exists(once))


def fire() -> None:
    if ARGS.once:
        with open(ARGS.once, "w") as f:
            f.write("fired\n")
    kind = FAULT["kind"]
    if kind == "poison":
        STATE["state"] = "poisoned"
        log("engine_poisoned", level="error", code=700, name="CUDA_ERROR_ILLEGAL_ADDRESS",
            message="an illegal memory access was encountered (injected)", step=STATE["steps"],
            running=list(STATE.get("inflight", [])))
        for rid, seq in list(STATE.get("inflight_seq", {}).items()):
            log("failed", level="error", request_id=rid, seq=seq, error="the engine's compute context failed")

        def later():
            time.sleep(0.5)
            log("exit", code=75, reason="poisoned compute context")
            os._exit(75)

        threading.Thread(target=later, daemon=True).start()
    elif kind == "illegal":
        raw("CUDA error 700 at /src/ggml/ggml-cuda/ggml-cuda.cu:2345: an illegal memory access was encountered")
        raw("  current device: 0, in function ggml_backend_cuda_synchronize at ggml-cuda.cu:2345")
    elif kind == "engine-dead":  # vLLM's shape: the engine core dies, the API server answers on
        raw("ERROR 12-04 10:21:07 [core.py:700] EngineCore encountered a fatal error.")
        raw("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
            "for the root cause.")
    elif kind == "hang":
        STATE["hung"] = True
        STATE["stalled_at"] = time.monotonic()
    elif kind == "exit":
        log("fatal", level="error", error=f"injected exit {FAULT.get('code', 1)}")
        os._exit(int(FAULT.get("code", 1)))
    elif kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "zombie":  # from the main thread (`after`): the rest of the process lives on without it
        log("zombie", level="warning", note="the main thread exits; the server threads serve on")
        import ctypes

        ctypes.CDLL(None).pthread_exit(None)
    elif kind == "oom":
        raw("Traceback (most recent call last):")
        raw('  File "engine.py", line 1, in step')
        raw("MemoryError")
        os._exit(1)


def loop():
    return LOOP if FAULT.get("kind") == "freeze" else contextlib.nullcontext()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        with loop():
            self._get()

    def do_POST(self) -> None:
        with loop():
            self._post()

    def _send(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _health(self) -> dict:
        st = STATE["state"]
        out = {"state": st, "steps": STATE["steps"]}
        stall = FAULT.get("stall")
        if STATE.get("hung") and stall is not None and time.monotonic() - STATE["stalled_at"] > float(stall):
            out["stalled"] = True
            out["last_progress_seconds"] = round(time.monotonic() - STATE["stalled_at"], 3)
        return out

    def _get(self) -> None:
        h = self._health()
        if self.path in ("/health/live", "/health") and ARGS.raw and self.path == "/health":
            return self._send(200 if h["state"] == "ready" else 503,
                              {"status": "ok" if h["state"] == "ready" else "loading"})
        if self.path == "/health/live":
            bad = h["state"] == "poisoned" or h.get("stalled")
            return self._send(503 if bad else 200, h)
        if self.path == "/health/ready":
            ok = h["state"] == "ready" and not h.get("stalled")
            return self._send(200 if ok else 503, h)
        if self.path == "/v1/models":
            return self._send(200, {"data": [{"id": "standin"}]})
        self._send(404, {"error": "not found"})

    def _post(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return self._send(400, {"error": "bad json"})
        if self.path != "/v1/completions":
            return self._send(404, {"error": "not found"})
        if ARGS.api_key and self.headers.get("Authorization") != f"Bearer {ARGS.api_key}":
            return self._send(401, {"error": {"message": "bad key"}})
        if STATE["state"] != "ready":
            return self._send(503, {"error": {"message": STATE["state"]}})
        prompt = str(req.get("prompt", ""))
        probe = prompt == "ping"  # the daemon's readiness probe: numbered apart from the test's requests
        with LOCK:
            key = "probes" if probe else "requests"
            STATE[key] = STATE.get(key, 0) + 1
            number = STATE[key]
            STATE["seq"] = STATE.get("seq", 0) + 1
            seq = STATE["seq"]
        rid = f"probe-{number}" if probe else f"cmpl-{number}"
        ptoks = max(1, len(prompt.split()))
        fields = dict(request_id=rid, seq=seq, protocol="completions", prompt_tokens=ptoks, cached_tokens=0,
                      new_tokens=ptoks)
        if ARGS.log_prompts:
            fields["prompt"] = prompt
        log("admit", **fields)
        STATE.setdefault("inflight", set()).add(rid)
        STATE.setdefault("inflight_seq", {})[rid] = seq
        try:
            if not probe and FAULT.get("requests") and int(FAULT["requests"]) == number and fault_armed():
                fire()
            if not probe and FAULT.get("kind") == "freeze":
                time.sleep(float(FAULT.get("secs", 2)))  # holding LOOP: nothing else is answered meanwhile
            if STATE.get("hung"):
                while True:
                    time.sleep(3600)
            if STATE["state"] == "poisoned":
                return self._send(503, {"error": {"message": "poisoned"}})
            STATE["steps"] += 2
            log("completed", request_id=rid, seq=seq, protocol="completions", prompt_tokens=ptoks, cached_tokens=0,
                completion_tokens=1, finish_reason="length", seconds=0.001)
            self._send(200, {"id": rid, "object": "text_completion", "model": "standin",
                             "choices": [{"index": 0, "text": " pong", "finish_reason": "length"}]})
        finally:
            STATE["inflight"].discard(rid)
            STATE["inflight_seq"].pop(rid, None)


def main() -> None:
    global ARGS, FAULT
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--load", type=float, default=0.1, help="seconds of 'model loading'")
    p.add_argument("--fault", default="")
    p.add_argument("--once", default="")
    p.add_argument("--raw", action="store_true", help="foreign-engine mode: plain-text log, GET /health")
    p.add_argument("--api-key", default="")
    p.add_argument("--log-prompts", action="store_true")
    ARGS = p.parse_args()
    if ARGS.fault:
        kind, *opts = ARGS.fault.split(":")
        FAULT = {"kind": kind, **dict(o.split("=", 1) for o in opts)}
    log("config", version="standin-1", pid=os.getpid(),
        config={"port": ARGS.port, "api_key": "***" if ARGS.api_key else None, "fault": ARGS.fault})
    if FAULT.get("kind") == "config" and fault_armed():
        log("config_error", level="error", error="port: injected configuration error")
        sys.exit(78)
    server = ThreadingHTTPServer((ARGS.host, ARGS.port), Handler)
    server.daemon_threads = True

    def on_term(signum, frame):
        STATE["state"] = "draining"
        log("draining", in_flight=0, seconds=0)

        def bye():
            log("exit", code=0)
            os._exit(0)

        threading.Timer(0.1, bye).start()

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(ARGS.load)
    STATE["state"] = "ready"
    log("ready", host=ARGS.host, port=ARGS.port, model="standin", fingerprint="f00dfeed", backend="standin")
    if FAULT.get("after") is not None and fault_armed():
        time.sleep(float(FAULT["after"]))
        fire()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
