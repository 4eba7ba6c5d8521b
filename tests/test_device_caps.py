"""The paths the CUDA backend takes on each GPU it may meet, chosen from what the device reports
(kernels/device_caps.py), and the compat modes that prove them on the H200: all pure logic, so it runs
on CI's CPU. The kernels themselves build for every architecture in test_kernels_archs.py; the compat
modes' PTX builds are here."""

from __future__ import annotations

import types

import pytest
from kernel_builds import COMPAT_TARGETS, ptx_modules_for

from ember.kernels import build, ops
from ember.kernels.device_caps import COMPAT_SMEM_OPTIN, DeviceCaps, build_target, compat_from_env
from ember.kernels.errors import CudaUnavailable

NVRTC_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121"]


def _read(**attrs):
    base = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
            "L2_CACHE_SIZE": 60 << 20, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 << 10, "CLUSTER_LAUNCH": 1,
            "INTEGRATED": 0, "MANAGED_MEMORY": 1}
    base.update(attrs)
    return lambda name: base[name]


H200 = DeviceCaps.from_attributes(_read())
RTX4090 = DeviceCaps.from_attributes(_read(COMPUTE_CAPABILITY_MAJOR=8, COMPUTE_CAPABILITY_MINOR=9,
                                           MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=99 << 10, CLUSTER_LAUNCH=0))
SPARK = DeviceCaps.from_attributes(_read(COMPUTE_CAPABILITY_MAJOR=12, COMPUTE_CAPABILITY_MINOR=1,
                                         MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=99 << 10, INTEGRATED=1,
                                         MULTIPROCESSOR_COUNT=48))


def test_capabilities_come_from_the_attributes():
    assert (H200.arch, H200.pdl, H200.clusters, H200.integrated) == ("sm_90", True, True, False)
    assert (RTX4090.arch, RTX4090.pdl, RTX4090.clusters) == ("sm_89", False, False)
    assert SPARK.integrated and SPARK.pdl and SPARK.arch == "sm_121"
    # a device that reports cluster launch below sm_90 still gets none (the kernels' cluster code is sm_90)
    odd = DeviceCaps.from_attributes(_read(COMPUTE_CAPABILITY_MAJOR=8, COMPUTE_CAPABILITY_MINOR=0, CLUSTER_LAUNCH=1))
    assert not odd.clusters


@pytest.mark.parametrize("arch", list(COMPAT_SMEM_OPTIN))
def test_a_compat_mode_takes_that_architectures_paths(arch):
    c = H200.for_compat(arch)
    assert c.arch == arch and c.compat == arch and not c.pdl and not c.clusters
    assert c.smem_optin == COMPAT_SMEM_OPTIN[arch] < H200.smem_optin
    assert (c.sm_count, c.l2_bytes) == (H200.sm_count, H200.l2_bytes)  # the hardware's own
    assert build_target(c, NVRTC_ARCHS) == (f"compute_{arch[3:]}", None)  # PTX, JIT-compiled by the driver
    assert H200.for_compat(None) is H200


def test_compat_modes_refuse_what_they_cannot_emulate():
    with pytest.raises(ValueError, match="the compat modes are sm_80, sm_86, sm_89"):
        H200.for_compat("sm_75")
    with pytest.raises(ValueError, match="emulates an older one"):
        RTX4090.for_compat("sm_89").for_compat("sm_86").for_compat("sm_89")
    assert compat_from_env({"EMBER_CUDA_COMPAT": " SM_86 "}) == "sm_86"
    assert compat_from_env({}) is None


def test_build_targets_for_the_gpus_users_run():
    assert build_target(H200, NVRTC_ARCHS) == ("sm_90", None)
    target, warning = build_target(RTX4090, NVRTC_ARCHS)  # nothing ember has run on below it: its own cubin
    assert target == "sm_89" and "not been run on sm_89" in warning
    target, warning = build_target(SPARK, NVRTC_ARCHS)  # another major: the sm_90 kernels as PTX
    assert target == "compute_90" and "sm_121" in warning and "PTX" in warning
    h20 = DeviceCaps.from_attributes(_read(COMPUTE_CAPABILITY_MINOR=1))
    assert build_target(h20, NVRTC_ARCHS)[0] == "sm_90"  # same major, newer minor: the sm_90 cubin runs
    turing = DeviceCaps.from_attributes(_read(COMPUTE_CAPABILITY_MAJOR=7, COMPUTE_CAPABILITY_MINOR=5))
    with pytest.raises(ValueError, match="need sm_80"):
        build_target(turing, NVRTC_ARCHS)


def _fake_dev(caps: DeviceCaps):
    return types.SimpleNamespace(caps=caps, sm_count=caps.sm_count)


def test_attention_fits_the_shared_memory_of_each_architecture():
    for caps in (H200, RTX4090, H200.for_compat("sm_80"), SPARK):
        dev = _fake_dev(caps)
        for d in ops.FLASH_HEAD_DIMS:
            stage = ops.attention_warp_stage_bytes(dev, d)
            split = ops.attention_warp_cap(d, 2, stage)
            static = 4 * d + 4 * ops.ATTW_SPLIT_MAX + 4 * ops.ATTW_WARPS * (2 + d)
            assert split >= 1 and ops.attention_warp_smem(d, 2, split) + static <= caps.smem_optin, (caps.arch, d)
    assert ops.attention_warp_stage_bytes(_fake_dev(H200), 256) == ops.ATTW_STAGE_BYTES  # Hopper: as before
    # without clusters, long contexts split into parts merged by attn_combine; with them, one launch
    for caps, merged in ((H200, True), (RTX4090, False)):
        parts = ops.attention_parts(_fake_dev(caps), 1, 8, 1, 1000, 128, decode=True)
        assert (parts == 1) == merged, caps.arch


def test_flash_tiles_fit_ninety_nine_kib():
    """flash.cu's largest tile (head_dim 256) takes exactly the 99 KiB of the RTX cards."""
    assert max(ops.flash_smem_bytes(d) for d in ops.FLASH_HEAD_DIMS) <= 99 << 10


def test_every_low_bit_module_builds_as_ptx_for_some_compat_mode(monkeypatch):
    monkeypatch.delenv("EMBER_ARCH_BUILDS", raising=False)
    built = [set(ptx_modules_for(t)) for t in COMPAT_TARGETS]
    assert set().union(*built) == set(build.MODULES)
    assert all({"dequant", "matvec_q4_k", "qgemm_q4_k"} <= b for b in built)


@pytest.mark.parametrize("target", COMPAT_TARGETS)
def test_every_module_builds_as_ptx_for_the_compat_modes(target, kernel_cache):
    try:
        build.nvrtc_version()
    except CudaUnavailable as e:
        pytest.skip(f"NVRTC is not available here ({e})")
    modules = ptx_modules_for(target)
    results = build.build_all(target, cache=kernel_cache, jobs=2, modules=modules)
    assert len(results) == len(modules)
    for r in results:
        text = r.path.read_bytes()
        assert r.path.suffix == ".ptx" and f".target sm_{target[8:]}".encode() in text, r.module
        assert b"griddepcontrol" not in text and b"barrier.cluster" not in text, r.module  # sm_90-only code


def test_build_targets_are_checked():
    assert build.check_target("compute_86") == "compute_86" and build.is_ptx("compute_86")
    assert build.check_target("sm_90") == "sm_90" and not build.is_ptx("sm_90")
    for bad in ("compute_90a", "hopper", "compute_9"):
        with pytest.raises(ValueError):
            build.check_target(bad)
