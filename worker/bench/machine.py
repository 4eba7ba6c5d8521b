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
