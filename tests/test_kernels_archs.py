"""Every kernel module builds for each GPU architecture ember's users run: the RTX 3090/4090/5090
cards, A100, L40S, H100/H200, B200 and DGX Spark's sm_121, on a machine without a GPU (CI). Each
build's ptxas report is checked for register spills as test_kernels_build.py checks sm_90's. The
cubins go to the session's shared kernel cache (the `kernel_cache` fixture; .ci/run builds them in the
background, tests/kernel_builds.py, and these tests run last and wait for it): each architecture is
compiled once per run (about 50 s on two cores), so the list is the users' architectures, not every one
NVRTC knows.

The low-bit types' own modules (constants.LOW_BIT_TYPES: a staged matvec and a qgemm module each,
two dozen compiles, about two thirds as long again as the rest) are spread over the six architectures
besides sm_90, two types each (kernel_builds.modules_for): every type's kernels then build for sm_90
(test_kernels_build.py builds every module) and one more architecture, and every type's decoder for
all seven through dequant.cu, which holds them all. EMBER_ARCH_BUILDS=all builds every module for
every architecture."""

from __future__ import annotations

import pytest
from kernel_builds import LOW_BIT_MODULES, USER_ARCHS, modules_for

from ember.kernels import build
from ember.kernels.errors import CudaUnavailable

SPILL_BAR = 64  # bytes of spill stores a kernel may have (test_kernels_build.py's bar)


def _archs() -> list[str]:
    try:
        return build.supported_archs()
    except CudaUnavailable:
        return []


ARCHS = _archs()


def test_every_low_bit_module_builds_beyond_sm90_somewhere(monkeypatch):
    monkeypatch.delenv("EMBER_ARCH_BUILDS", raising=False)
    others = [set(modules_for(a)) for a in USER_ARCHS if a != "sm_90"]
    assert set(LOW_BIT_MODULES) <= set().union(*others)
    assert all({"dequant", "matvec_q4_k", "qgemm_q4_k"} <= m for m in others)
    assert modules_for("sm_90") == list(build.MODULES)


def test_nvrtc_targets_the_architectures_users_run():
    if not ARCHS:
        pytest.skip("NVRTC is not available here; CI installs it with pip install -e '.[cuda]'")
    for arch in USER_ARCHS:
        assert arch in ARCHS, f"NVRTC {build.nvrtc_version()} cannot target {arch}"


@pytest.mark.parametrize("arch", USER_ARCHS)
def test_every_module_builds_without_spills(arch, kernel_cache):
    if not ARCHS:
        pytest.skip("NVRTC is not available here; CI installs it with pip install -e '.[cuda]'")
    modules = modules_for(arch)
    results = build.build_all(arch, cache=kernel_cache, jobs=2, modules=modules)
    assert [r.module for r in results] == modules
    spills = {f"{r.module}.{fn}": res for r in results for fn, res in r.resources.items()
              if res.get("spill_stores", 0) > SPILL_BAR}
    assert all(r.resources for r in results), [r.module for r in results if not r.resources]
    assert not spills, f"{arch}: {spills}"
    for r in results:
        assert r.path.read_bytes()[:4] == b"\x7fELF", f"{arch} {r.module}: not a cubin"
