"""Every kernel module builds for every GPU architecture NVRTC targets from sm_80 (Ampere) up: the
RTX 3090/4090/5090 cards, A100, L40S, H100/H200, B200 and DGX Spark's sm_121, on a machine without a
GPU (CI). Each build's ptxas report is checked for register spills as test_kernels_build.py checks
sm_90's. The cubins of one run go to one cache under the session's temporary folder: each
architecture is compiled once per run (about 50 s on two cores)."""

from __future__ import annotations

import pytest

from ember.kernels import build
from ember.kernels.errors import CudaUnavailable

MIN_ARCH = 80  # Ampere: the oldest architecture ember's kernels are written for (mma.sync, cp.async)
SPILL_BAR = 64  # bytes of spill stores a kernel may have (test_kernels_build.py's bar)


def _archs() -> list[str]:
    try:
        return [a for a in build.supported_archs() if int(a[3:]) >= MIN_ARCH]
    except CudaUnavailable:
        return []


ARCHS = _archs()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels-every-arch")


def test_nvrtc_targets_the_architectures_users_run():
    if not ARCHS:
        pytest.skip("NVRTC is not available here; CI installs it with pip install -e '.[cuda]'")
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120", "sm_121"):  # 3090, A100, 4090/L40S, H100, 5090, Spark
        assert arch in ARCHS, f"NVRTC {build.nvrtc_version()} cannot target {arch}"


@pytest.mark.parametrize("arch", ARCHS or ["sm_80"])
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
