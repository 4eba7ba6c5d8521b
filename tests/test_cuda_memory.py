"""How the CUDA backend divides the device's memory (worker/backends/cuda/memory.py): pure arithmetic over
what the device reports, so the 24 GB card, the H200 and the DGX Spark cases run on CI's CPU. The
backend applies it on the device (tests/test_cuda_backend.py, test_daemon_gpu.py)."""

from __future__ import annotations

import pytest

from ember.kernels.cuda_runtime import capped_memory
from ember.worker.backends.cuda.memory import (
    HALF_COPY_KV_SHARE,
    KV_MARGIN_MIN,
    MemoryPicture,
    auto_kv_bytes,
    check_unified_budget,
    keep_half_copy,
    kv_margin,
)

GiB = 1 << 30


def test_the_margin_grows_with_the_device():
    assert kv_margin(24 * GiB) == KV_MARGIN_MIN
    assert kv_margin(141 * GiB) > KV_MARGIN_MIN


def test_auto_takes_what_is_free_minus_the_margin_and_on_unified_memory_the_host_tier():
    free, total = 100 * GiB, 141 * GiB
    assert auto_kv_bytes(free, total, integrated=False, host_tier=8 * GiB) == free - kv_margin(total)
    spark = auto_kv_bytes(free, 128 * GiB, integrated=True, host_tier=8 * GiB)
    assert spark == free - kv_margin(128 * GiB) - 8 * GiB  # one budget for the pool and the host tier


def test_the_16_bit_copy_on_each_kind_of_device():
    # the 8B Q4_K_M (16 GB as 16 bits) on a 24 GB card with 18 GB free after the weights: not kept
    assert not keep_half_copy("auto", 16 * GiB, 18 * GiB, 24 * GiB, integrated=False, kv_sized=False)
    # on the H200: kept, the pool still gets most of the device
    assert keep_half_copy("auto", 16 * GiB, 130 * GiB, 141 * GiB, integrated=False, kv_sized=False)
    assert 16 * GiB <= (130 * GiB - kv_margin(141 * GiB)) * HALF_COPY_KV_SHARE
    # never by default on unified memory (DGX Spark), whatever is free; "on" and "off" are obeyed
    assert not keep_half_copy("auto", 1 * GiB, 100 * GiB, 128 * GiB, integrated=True, kv_sized=False)
    assert keep_half_copy("on", 16 * GiB, 1 * GiB, 24 * GiB, integrated=True, kv_sized=False)
    assert not keep_half_copy("off", 1, 100 * GiB, 141 * GiB, integrated=False, kv_sized=False)
    # an explicit --kv-mem already has its pool: the copy needs only a tenth of the device left free
    assert keep_half_copy("auto", 16 * GiB, 40 * GiB, 141 * GiB, integrated=False, kv_sized=True)
    assert not keep_half_copy("auto", 16 * GiB, 20 * GiB, 141 * GiB, integrated=False, kv_sized=True)


def test_explicit_budgets_on_unified_memory_must_fit_together():
    assert check_unified_budget(40 * GiB, 8 * GiB, 100 * GiB, 128 * GiB) is None
    problem = check_unified_budget(90 * GiB, 30 * GiB, 100 * GiB, 128 * GiB)
    assert problem and "--kv-mem (92160 MiB) and --kv-host-mem (30720 MiB)" in problem and "\n" not in problem


def test_the_memory_picture_for_status():
    pic = MemoryPicture(128 * GiB, 10 * GiB, 0, 90 * GiB, True, 8 * GiB).as_dict()
    assert pic == {"device_total_mb": 131072, "weights_mb": 10240, "f16_copy_mb": 0, "kv_pool_mb": 92160,
                   "unified_memory": True, "kv_host_tier_mb": 8192}


def test_kv_mem_auto_is_the_default_and_means_1gib_on_numpy():
    from ember.worker import config as worker_config
    from ember.worker.model.loader import open_model
    from ember.worker.server import kv_blocks_for

    assert worker_config.WorkerConfig().kv_mem == "auto"
    cfg = open_model(None).config  # the embedded model
    assert kv_blocks_for("auto", cfg, 16, "numpy") == kv_blocks_for("1GiB", cfg, 16, "numpy")
    assert kv_blocks_for("auto", cfg, 16, "cuda") is None  # sized by the backend from the free memory
    assert abs(kv_blocks_for("2GiB", cfg, 16, "cuda") - 2 * kv_blocks_for("1GiB", cfg, 16, "cuda")) <= 1


def test_gpu_mem_makes_the_device_look_that_size_with_everything_in_use_still_in_use():
    assert capped_memory(78 * GiB, 80 * GiB, 24 * GiB) == (22 * GiB, 24 * GiB)  # 2 GiB in use (the context)
    assert capped_memory(78 * GiB, 80 * GiB, None) == (78 * GiB, 80 * GiB)
    assert capped_memory(78 * GiB, 80 * GiB, 96 * GiB) == (78 * GiB, 80 * GiB)  # above the card: the card
    assert capped_memory(10 * GiB, 80 * GiB, 24 * GiB) == (0, 24 * GiB)  # more in use than the cap: none free
    # a 24 GB card's decisions: 18.6 GiB of weights leave 3.4 GiB, whose pool keeps no 2 GiB 16-bit copy
    free, total = capped_memory(80 * GiB - 2 * GiB - int(18.6 * GiB), 80 * GiB, 24 * GiB)
    assert not keep_half_copy("auto", 2 * GiB, free, total, integrated=False, kv_sized=False)
    assert auto_kv_bytes(free, total, integrated=False, host_tier=0) == free - GiB


def test_gpu_mem_is_a_size_of_at_least_1gib():
    import argparse

    from ember.worker import config as wc

    p = argparse.ArgumentParser()
    wc.add_arguments(p)
    cfg, src = wc.load(p.parse_args(["--gpu-mem", "24GiB"]), env={})
    assert wc.parse_size(cfg.gpu_mem) == 24 << 30 and src["gpu_mem"] == "flag --gpu-mem"
    assert wc.load(p.parse_args([]), env={})[0].gpu_mem == "auto"
    with pytest.raises(wc.ConfigError, match="gpu_mem: at least 1GiB"):
        wc.load(p.parse_args(["--gpu-mem", "512MiB"]), env={})
    with pytest.raises(wc.ConfigError, match="gpu_mem"):
        wc.load(p.parse_args([]), env={"EMBER_GPU_MEM": "lots"})
