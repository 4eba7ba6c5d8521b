"""Every kernel module builds for each GPU architecture ember's users run: the RTX 3090/4090/5090
cards, A100, L40S, H100/H200, B200 and DGX Spark's sm_121, on a machine without a GPU (CI). Each
build's ptxas report is checked for register spills as test_kernels_build.py checks sm_90's. The
cubins of one run go to the session's shared kernel cache (test_kernels_build.py and
test_kernels_constants.py build sm_90 into it too): each architecture is compiled once per run
(about 50 s on two cores), so the list is the users' architectures, not every one NVRTC knows."""

from __future__ import annotations

import pytest

from ember.kernels import build
from ember.kernels.errors import CudaUnavailable

# A100, RTX 3090, RTX 4090 / L40S, H100 / H200, B200, RTX 5090, DGX Spark; sm_80 (Ampere) is the oldest
# ember's kernels are written for (mma.sync, cp.async)
USER_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121")
SPILL_BAR = 64  # bytes of spill stores a kernel may have (test_kernels_build.py's bar)


def _archs() -> list[str]:
    try:
        return build.supported_archs()
    except CudaUnavailable:
        return []


ARCHS = _archs()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "kernel-cache"


def test_nvrtc_targets_the_architectures_users_run():
    if not ARCHS:
        pytest.skip("NVRTC is not available here; CI installs it with pip install -e '.[cuda]'")
    for arch in USER_ARCHS:
        assert arch in ARCHS, f"NVRTC {build.nvrtc_version()} cannot target {arch}"


@pytest.mark.parametrize("arch", USER_ARCHS)
def test_every_module_builds_without_spills(arch, cache):
    if not ARCHS:
        pytest.skip("NVRTC is not available here; CI installs it with pip install -e '.[cuda]'")
    results = build.build_all(arch, cache=cache, jobs=2)
    assert [r.module for r in results] == list(build.MODULES)
    spills = {f"{r.module}.{fn}": res for r in results for fn, res in r.resources.items()
              if res.get("spill_stores", 0) > SPILL_BAR}
    assert all(r.resources for r in results), [r.module for r in results if not r.resources]
    assert not spills, f"{arch}: {spills}"
    for r in results:
        assert r.path.read_bytes()[:4] == b"\x7fELF", f"{arch} {r.module}: not a cubin"
