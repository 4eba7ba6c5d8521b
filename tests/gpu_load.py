"""Another process keeping the GPU busy, for the tests of what must hold under a neighbour's load (the GPU
time-slices between processes, so copies and kernels of the process under test land later than alone).

As a program: `python tests/gpu_load.py SECONDS` runs 4096-square tensor-core matmuls back to back on a
stream of its own, prints "busy" once the first has run, and exits after SECONDS. As a module: `busy_gpu()`,
a context manager that runs it beside the block and stops it after."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

N = 4096


def main(seconds: float) -> None:
    from ember.kernels import ops
    from ember.kernels.cuda_runtime import Stream, try_device

    dev, why = try_device()
    if dev is None:
        raise SystemExit(f"no CUDA device: {why}")
    rng = np.random.default_rng(0)
    a = dev.to_device(rng.normal(0, 1, (N, N)).astype(np.float16).view(np.uint16))
    c = dev.empty((N, N))
    stream, end, said = Stream(), time.monotonic() + seconds, False
    while time.monotonic() < end:
        for _ in range(20):
            ops.gemm(dev, a, a, c, m=N, n=N, k=N, stream=stream)
        stream.synchronize()
        if not said:
            print("busy", flush=True)
            said = True


@contextlib.contextmanager
def busy_gpu(seconds: float = 120.0):
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(seconds)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "busy":
            proc.wait(10)
            raise RuntimeError(f"the GPU load did not start (exit {proc.returncode})")
        yield
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main(float(sys.argv[1]))
