"""The kernel builds CI checks, and the background build that makes them once a run.

Which modules are built for what: every module for sm_90 (test_kernels_build.py,
test_kernels_constants.py); for the six other architectures ember's users run, every module but the
low-bit types' own, of which each architecture takes two of twelve (test_kernels_archs.py); as PTX
for the three compat modes, every module but those, a third of them each (test_device_caps.py).

Together that is about 40 minutes of one core's compiling, a third of CI's time on its two cores.
.ci/run therefore runs this file as a script right after installing, at the lowest priority, into
build/kernel-cache (the cubin cache's keys hash source, options and NVRTC version, so a stale file is
never served): it uses the core the suite leaves idle, and the tests that read its cubins
(the `kernel_cache` fixture, tests/conftest.py) are moved to the end of the run, where they wait for it.
A `kernel-cache.building` file (its pid) lies beside the cache while it runs; `kernel-cache.failed` holds
the error if it failed (the tests then compile what is missing themselves and report the compiler's
error)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from ember.kernels import build, constants
from ember.kernels.device_caps import COMPAT_SMEM_OPTIN

PREBUILT = Path(__file__).resolve().parents[1] / "build" / "kernel-cache"

# A100, RTX 3090, RTX 4090 / L40S, H100 / H200, B200, RTX 5090, DGX Spark; sm_80 (Ampere) is the oldest
# ember's kernels are written for (mma.sync, cp.async)
USER_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121")
COMPAT_TARGETS = tuple(f"compute_{a[3:]}" for a in COMPAT_SMEM_OPTIN)
LOW_BIT_MODULES = {f"{kind}_{t}": t for t in constants.LOW_BIT_TYPES for kind in ("matvec", "qgemm")}


def _spread(targets: tuple[str, ...], target: str) -> list[str]:
    """Every module but the low-bit types' own, of which `target` takes every len(targets)-th type."""
    if os.environ.get("EMBER_ARCH_BUILDS") == "all":
        return list(build.MODULES)
    mine = constants.LOW_BIT_TYPES[targets.index(target)::len(targets)]
    return [m for m in build.MODULES if m not in LOW_BIT_MODULES or LOW_BIT_MODULES[m] in mine]


def modules_for(arch: str) -> list[str]:
    """The modules CI builds for `arch`: all of them for sm_90 (or with EMBER_ARCH_BUILDS=all), else all but
    the low-bit types' own, of which the architecture takes every sixth type (two of twelve)."""
    if arch == "sm_90":
        return list(build.MODULES)
    return _spread(tuple(a for a in USER_ARCHS if a != "sm_90"), arch)


def ptx_modules_for(target: str) -> list[str]:
    """The modules CI builds as PTX for a compat target: every one but the low-bit types' own, which are
    spread over the targets (a third each; they share their kernels' code with matvec_q4_k and qgemm_q4_k,
    which every target builds). EMBER_ARCH_BUILDS=all: every module."""
    return _spread(COMPAT_TARGETS, target)


def plan() -> list[tuple[str, list[str]]]:
    """(target, modules) for every build the suite checks, sm_90 first (two test files read it)."""
    archs = ["sm_90", *(a for a in USER_ARCHS if a != "sm_90")]
    return [(a, modules_for(a)) for a in archs] + [(t, ptx_modules_for(t)) for t in COMPAT_TARGETS]


def building_pid() -> int | None:
    """The pid of a background build still running on this machine, else None (none started, done, or
    killed before it could clean up)."""
    try:
        pid = int((PREBUILT.parent / "kernel-cache.building").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def main() -> int:
    cache = build.cache_dir(PREBUILT)  # made 0700, as every kernel cache is
    building, failed = cache.parent / "kernel-cache.building", cache.parent / "kernel-cache.failed"
    failed.unlink(missing_ok=True)
    building.write_text(f"{os.getpid()}\n")
    try:
        for target, modules in plan():
            build.build_all(target, cache=cache, modules=modules, jobs=os.cpu_count() or 1)
    except Exception:
        failed.write_text(traceback.format_exc())
        return 1
    finally:
        building.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
