"""Facts about the machine a figure was measured on."""

from __future__ import annotations

import os
import platform
import resource


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = threadpool_info()
        if info:
            return f"{info[0].get('internal_api')} {info[0].get('version')} ({info[0].get('architecture')})"
    except ImportError:
        pass
    return "numpy BLAS"


def machine_facts() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "blas": _blas(),
    }


def gpu_names() -> list[str]:
    """The NVIDIA GPUs nvidia-smi lists (none where it is missing or fails)."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
