"""Fault injection, so the daemon's tests drive the real failure paths (off unless --fault).

SPEC is a comma-separated list of faults, each `kind[:key=value[:key=value]]`:
  poison[:step=N][:phase=prefill|decode]   the compute context becomes poisoned (CUDA error 700)
  raise[:request=N]                         the N-th request (1-based, default 1) fails alone
  hang[:step=N]                             the engine loop stops making progress
  slow[:ms=M]                               every step takes M ms longer (default 200)
  cuda-illegal-address                      (CUDA backend) a kernel really writes out of bounds
  thread-die:thread=T                       a guarded thread's loop raises at its next turn, T one of
                                            engine (when it next has work), kv-writer (at the next
                                            block it writes), kv-reader (at the next restore), mask
                                            (a grammar mask thread, at its next call)
  disk-full:while=PATH                      while PATH exists, every KV file write fails with ENOSPC
                                            half-way (a full disk where the test cannot mount one)
Without `step`, poison and hang fire at the first step of the given phase (or any step).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from .base import Backend, ContextPoisoned, SeqChunk

KINDS = ("poison", "raise", "hang", "slow", "cuda-illegal-address", "thread-die", "disk-full")
THREADS = ("engine", "kv-writer", "kv-reader", "mask")  # thread-die targets: ember-<name>...


class FaultSpecError(ValueError):
    pass


class InjectedRequestError(RuntimeError):
    pass


@dataclass
class Fault:
    kind: str
    step: int | None = None
    phase: str | None = None
    request: int = 1
    ms: int = 200
    thread: str | None = None
    path: str | None = None
    fired: bool = False


def parse_faults(spec: str | None) -> list[Fault]:
    faults: list[Fault] = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        kind, *opts = part.split(":")
        if kind not in KINDS:
            raise FaultSpecError(f"unknown fault {kind!r} (known: {', '.join(KINDS)})")
        f = Fault(kind)
        for opt in opts:
            key, _, value = opt.partition("=")
            try:
                if key == "step":
                    f.step = int(value)
                elif key == "phase" and value in ("prefill", "decode"):
                    f.phase = value
                elif key == "request":
                    f.request = int(value)
                elif key == "ms":
                    f.ms = int(value)
                elif key == "thread" and value in THREADS:
                    f.thread = value
                elif key == "while" and value:
                    f.path = value
                else:
                    raise ValueError
            except ValueError:
                raise FaultSpecError(f"bad option {opt!r} for fault {kind!r}") from None
        if kind == "thread-die" and f.thread is None:
            raise FaultSpecError(f"fault thread-die needs thread=NAME (one of {', '.join(THREADS)})")
        if kind == "disk-full" and f.path is None:
            raise FaultSpecError("fault disk-full needs while=PATH (the disk is full while PATH exists)")
        faults.append(f)
    return faults


class FaultInjector:
    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self.stop_hang = threading.Event()  # lets tests and shutdown end an injected hang

    def __bool__(self) -> bool:
        return bool(self.faults)

    def check_backend(self, backend) -> None:
        """Refuse faults the backend cannot inject (a configuration error, exit 78)."""
        for f in self.faults:
            if f.kind == "cuda-illegal-address" and f.kind not in backend.fault_kinds:
                raise FaultSpecError(f"fault cuda-illegal-address needs --backend cuda (this is {backend.name})")

    def arm_threads(self, watch) -> None:
        """Doom the threads that thread-die faults name (a ThreadWatch: they raise at a checkpoint)."""
        for f in self.faults:
            if f.kind == "thread-die" and not f.fired:
                f.fired = True
                watch.doom(f"ember-{f.thread}")

    def disk_full(self) -> bool:
        """A disk-full fault holds now (the KV store's writer asks before each file)."""
        return any(f.kind == "disk-full" and f.path and os.path.exists(f.path) for f in self.faults)

    def before_step(self, step: int, phases: set[str], backend=None) -> None:
        for f in self.faults:
            if f.kind == "slow":
                time.sleep(f.ms / 1000)
                continue
            if f.fired or f.kind not in ("poison", "hang", "cuda-illegal-address"):
                continue
            if f.step is not None and step < f.step:
                continue
            if f.phase is not None and f.phase not in phases:
                continue
            f.fired = True
            if f.kind == "cuda-illegal-address":
                backend.inject_fault(f.kind)  # raises ContextPoisoned from the real sticky error
                return
            if f.kind == "poison":
                raise ContextPoisoned(700, "CUDA_ERROR_ILLEGAL_ADDRESS",
                                      "an illegal memory access was encountered (injected)")
            while not self.stop_hang.wait(3600):  # hang: the loop stops, the process lives on
                pass

    def check_request(self, request_number: int) -> None:
        for f in self.faults:
            if f.kind == "raise" and not f.fired and request_number == f.request:
                f.fired = True
                raise InjectedRequestError(f"injected failure in request #{request_number}")


class FaultyBackend(Backend):
    """A backend with the step faults (poison, hang, slow, cuda-illegal-address) in its way: each step
    the engine launches (forward or submit) runs the injector's before_step first. Calibration and
    the reruns of a step that failed go to unhooked(), so the steps counted are the engine's."""

    def __init__(self, inner: Backend, injector: FaultInjector):
        self.inner, self.injector = inner, injector
        self.steps = 0
        self.name, self.config, self.kv_layout = inner.name, inner.config, inner.kv_layout
        self.block_size, self.n_blocks, self.block_dtype = inner.block_size, inner.n_blocks, inner.block_dtype
        self.fault_kinds = inner.fault_kinds

    @property
    def runs_ahead(self) -> bool:  # type: ignore[override]  # read through: the server (--no-run-ahead) and tests may set it later
        return self.inner.runs_ahead

    @property
    def samples_on_device(self) -> bool:  # type: ignore[override]
        return self.inner.samples_on_device

    def _before(self, chunks: list[SeqChunk]) -> None:
        self.steps += 1
        phases = {"prefill" if c.prefill else "decode" for c in chunks}
        self.injector.before_step(self.steps, phases, self.inner)

    def forward(self, chunks):
        self._before(chunks)
        return self.inner.forward(chunks)

    def submit(self, chunks, feed=None):
        self._before(chunks)
        return self.inner.submit(chunks, feed=feed)

    def read_block(self, block):
        return self.inner.read_block(block)

    def write_block(self, block, data):
        self.inner.write_block(block, data)

    def save_blocks(self, blocks):
        return self.inner.save_blocks(blocks)

    def load_blocks(self, blocks, payloads):
        self.inner.load_blocks(blocks, payloads)

    def restore_buffers(self):
        return self.inner.restore_buffers()

    def inject_fault(self, kind):
        self.inner.inject_fault(kind)

    def unhooked(self) -> Backend:
        return self.inner.unhooked()
